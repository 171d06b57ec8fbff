"""What several model families compute the same way: the base of a family's prompt
encoder (and of its source images, for an editing family), classifier-free guidance,
the timestep input, VAE decoding and encoding in the two latent layouts diffusers' VAEs
use, 2 x 2 latent packing, and the sigma schedule shifted by the packed image's length.

A new family (a module beside ``sd3.py``, ``flux.py``, ``wan.py``, ``qwenimage.py``,
``hunyuanvideo.py``) builds on these and on :class:`~digenrl.models.base.ModelFamily`;
the built-in tiny model's module (:mod:`digenrl.models.tiny`) holds only what is its own.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar, Mapping, Sequence

import numpy as np
import torch

from digenrl.models.base import Conditioning, PromptCache, SourceImage
from digenrl.models.parts import BUILDING, TORCH_DTYPES, load_part, tokenizer_of

if TYPE_CHECKING:
    from diffusers import FlowMatchEulerDiscreteScheduler

    from digenrl.models.base import ModelFamily

__all__ = ["TextEncoders", "negative_texts", "guided", "timesteps", "vae_block_factor",
           "scaled_vae_decode", "scaled_vae_encode", "normalized_vae_decode", "normalized_vae_encode", "pack",
           "unpack", "packed_sigmas", "by_source_size"]


class TextEncoders:
    """The base of a family's prompt encoder (what
    :meth:`~digenrl.models.base.ModelFamily.build_encoder` returns).

    A subclass loads its parts in ``__init__`` (after this one's) with :meth:`tokenizer`
    and :meth:`text_encoder`, and implements :meth:`encode_batch`. :meth:`encode` encodes
    each prompt once (:class:`~digenrl.models.base.PromptCache`) and adds the negative
    prompts' encoding when asked, unless the family uses none (its
    ``uses_negative_prompt`` False: a guidance-distilled model).

    An editing family's encoder (its family :attr:`~digenrl.models.base.ModelFamily.takes_images`)
    also implements :meth:`encode_sources`, which turns source images into the tensors
    its transformer takes (once per image); with ``text_sees_image`` its prompts are
    encoded together with their images (a vision-language encoder: ``encode_batch``
    then receives ``(prompt, SourceImage)`` pairs), and so is the negative prompt, once
    per sample.
    """

    #: Whether the text encoder reads each prompt together with its source image.
    text_sees_image: ClassVar[bool] = False

    def __init__(self, family: "ModelFamily", device: torch.device):
        self.family = family
        #: Where the encoders compute; with ``model.text_encoder_offload`` they are kept
        #: on the CPU (``device``) and moved here only while they encode.
        self.compute_device = device
        self.offload = family.cfg.text_encoder_offload
        self.device = torch.device("cpu") if self.offload else device
        #: ``model.text_encoder_dtype`` (the model's dtype when unset): the text
        #: encoders' weights and forward pass.
        self.dtype = TORCH_DTYPES[family.cfg.encoder_dtype]
        self.cache = PromptCache(self._on_device(self.encode_batch))
        self.source_cache = PromptCache(self._on_device(self.encode_sources))
        self._vae = None

    def modules(self) -> list[torch.nn.Module]:
        """The encoders' modules (the text encoders, the source images' VAE once loaded)."""
        found: list[torch.nn.Module] = []

        def visit(v) -> None:
            if isinstance(v, torch.nn.Module):
                found.append(v)
            elif isinstance(v, (list, tuple)):
                for item in v:
                    visit(item)

        for value in vars(self).values():
            visit(value)
        return found

    def move(self, device: torch.device) -> None:
        """Move every encoder module to ``device``, where the next encodings compute."""
        for module in self.modules():
            module.to(device)
        self.device = device

    def _on_device(self, encode):
        """``encode``, run on the compute device; with offloading the encoders move there
        for the call and back to the CPU after it (a cached key moves nothing)."""
        if not self.offload:
            return encode

        def run(keys):
            self.move(self.compute_device)
            try:
                return encode(keys)
            finally:
                self.move(torch.device("cpu"))
                if self.compute_device.type == "cuda":
                    torch.cuda.empty_cache()

        return run

    def tokenizer(self, part: str):
        """The folder's tokenizer ``part`` (e.g. ``tokenizer_2``)."""
        return tokenizer_of(self.family.pipeline_folder, part)

    def text_encoder(self, part: str) -> torch.nn.Module:
        """The folder's text encoder ``part`` on this device, in ``model.text_encoder_dtype``,
        in eval mode."""
        return load_part(self.family.pipeline_folder, part, dtype=self.dtype).to(self.device).eval()

    def encode_batch(self, prompts: list) -> Mapping[str, torch.Tensor | Sequence[torch.Tensor]]:
        """The family's tensors for ``prompts``, one row per prompt (run under no_grad):
        a tensor, or a list of rows of their own lengths (padded when stacked). With
        ``text_sees_image``, each prompt comes as ``(prompt, SourceImage)``."""
        raise NotImplementedError

    @property
    def vae(self):
        """The folder's VAE, for an editing family's source images (loaded on the first;
        the rollout worker's decoding VAE is another copy)."""
        if self._vae is None:
            with BUILDING:
                self._vae = self.family.build_vae(0).to(self.device)
        return self._vae

    def encode_sources(self, images: list[SourceImage]
                       ) -> Mapping[str, torch.Tensor | Sequence[torch.Tensor]]:
        """An editing family's source ``images`` as its transformer takes them (run under
        no_grad): each resized and scaled to [-1, 1] as its pipeline does (the family's
        ``source_pixels``), encoded by the VAE (its ``source_latents``) and packed 2 x 2;
        ``source_tokens`` a row per image of its own length, ``source_grid`` the rows and
        columns of each packed grid."""
        tokens, grids = [], []
        for image in images:
            pixels = self.family.source_pixels(image).to(self.device)
            z = self.family.source_latents(self.vae, pixels)
            tokens.append(pack(z)[0])
            grids.append(torch.tensor([z.shape[2] // 2, z.shape[3] // 2]))
        return {"source_tokens": tokens, "source_grid": torch.stack(grids)}

    def encode(self, prompts: Sequence[str], negative: bool,
               images: Sequence | None = None,
               negatives: Sequence[str | None] | None = None) -> Conditioning:
        """The conditioning of ``prompts`` (``negative``: with the negative prompts'),
        each with its source image for an editing family (``images``: one uint8
        ``(height, width, 3)`` array or :class:`~digenrl.models.base.SourceImage` per
        prompt). ``negatives``: each prompt's own negative prompt (None where it has
        none: ``model.negative_prompt``); the negative encoding is one row when every
        prompt's is the same text, else one row per prompt."""
        texts = negative_texts(self.family.cfg.negative_prompt, negatives, len(prompts))
        with_negative = negative and self.family.uses_negative_prompt
        if images is None:
            if self.family.needs_images:
                raise ValueError(f"{self.family.pipeline_class}: expected a source image "
                                 f"per prompt, got none")
            tensors = self.cache(list(prompts))
            neg = self.cache(texts) if with_negative else None
            return Conditioning(tuple(prompts), tensors, neg, len(texts) > 1)
        if not self.family.takes_images:
            raise ValueError(f"{self.family.pipeline_class}: expected no source images (it "
                             f"is not an editing pipeline), got {len(images)}")
        if len(images) != len(prompts):
            raise ValueError(f"images: expected one source image per prompt "
                             f"({len(prompts)}), got {len(images)}")
        sources = [i if isinstance(i, SourceImage) else SourceImage.of(i) for i in images]
        if self.text_sees_image:
            tensors = self.cache(list(zip(prompts, sources)))
            neg_keys: list[str] | list[tuple[str, SourceImage]] = list(
                zip(texts * len(sources) if len(texts) == 1 else texts, sources))
        else:
            tensors = self.cache(list(prompts))
            neg_keys = texts
        tensors.update(self.source_cache(sources))
        neg = self.cache(neg_keys) if with_negative else None
        return Conditioning(tuple(prompts), tensors, neg, len(neg_keys) > 1)


def negative_texts(default: str, negatives: Sequence[str | None] | None, n: int) -> list[str]:
    """The negative prompt of each of ``n`` prompts (``default`` where ``negatives`` has
    None, or is None), as one text when they are all the same: a chunk whose prompts
    carry no negative prompt of their own is encoded as it always was."""
    if negatives is None:
        return [default]
    if len(negatives) != n:
        raise ValueError(f"negatives: expected one per prompt ({n}), got {len(negatives)}")
    texts = [default if x is None else x for x in negatives]
    return texts[:1] if len(set(texts)) == 1 else texts


def guided(v_uncond: torch.Tensor, v_cond: torch.Tensor, scale: float) -> torch.Tensor:
    """Classifier-free guidance: ``v_uncond + scale * (v_cond - v_uncond)``."""
    return v_uncond + scale * (v_cond - v_uncond)


def timesteps(x: torch.Tensor, value: float | torch.Tensor,
              dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The transformer's timestep input: ``value`` for each sample of ``x``, or each
    sample's own where ``value`` is a tensor of one per sample (a forward-process
    micro-step trains every sample at a noise level drawn for it)."""
    if isinstance(value, torch.Tensor):
        return value.to(device=x.device, dtype=dtype).reshape(x.shape[0])
    return torch.full((x.shape[0],), value, dtype=dtype, device=x.device)


def vae_block_factor(vae_config: Mapping[str, Any]) -> int:
    """Pixels per latent pixel of an ``AutoencoderKL``: 2 ^ (its blocks - 1)."""
    return 2 ** (len(vae_config["block_out_channels"]) - 1)


def scaled_vae_decode(vae, latents: torch.Tensor) -> torch.Tensor:
    """``latents / scaling_factor + shift_factor`` through the VAE decoder (the
    ``AutoencoderKL`` layout: SD3, FLUX.1, the built-in model)."""
    scale = getattr(vae.config, "scaling_factor", 1.0) or 1.0
    shift = getattr(vae.config, "shift_factor", 0.0) or 0.0
    return vae.decode(latents / scale + shift, return_dict=False)[0]


def scaled_vae_encode(vae, pixels: torch.Tensor) -> torch.Tensor:
    """Pixels in [-1, 1] ``(n, 3, H, W)`` to an ``AutoencoderKL``'s latents, as the
    editing pipelines encode a source image: the latent distribution's mode, then
    ``(z - shift_factor) * scaling_factor`` (FLUX.1 Kontext)."""
    scale = getattr(vae.config, "scaling_factor", 1.0) or 1.0
    shift = getattr(vae.config, "shift_factor", 0.0) or 0.0
    z = vae.encode(pixels).latent_dist.mode()
    return (z - shift) * scale


def _channel_stats(vae, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    c = vae.config
    mean = torch.tensor(c.latents_mean).view(1, c.z_dim, 1, 1, 1).to(like)
    std = torch.tensor(c.latents_std).view(1, c.z_dim, 1, 1, 1).to(like)
    return mean, std


def normalized_vae_decode(vae, latents: torch.Tensor) -> torch.Tensor:
    """Latents ``(n, z_dim, frames, h, w)`` normalised per channel by the VAE's
    ``latents_mean`` / ``latents_std`` (the layout of ``AutoencoderKLWan`` and
    ``AutoencoderKLQwenImage``) de-normalised as the pipelines do and decoded. Image
    latents ``(n, z_dim, h, w)`` are decoded as one frame, to ``(n, 3, H, W)``."""
    if latents.ndim == 4:
        return normalized_vae_decode(vae, latents.unsqueeze(2))[:, :, 0]
    mean, std = _channel_stats(vae, latents)
    # The pipelines divide by 1 / std.
    return vae.decode(latents / (1.0 / std) + mean, return_dict=False)[0]


def normalized_vae_encode(vae, pixels: torch.Tensor) -> torch.Tensor:
    """Pixels in [-1, 1] ``(n, 3, H, W)``, one frame each, to latents ``(n, z_dim, h, w)``
    normalised by the VAE's ``latents_mean`` / ``latents_std``, as the Qwen-Image-Edit
    pipeline encodes a source image (the latent distribution's mode)."""
    z = vae.encode(pixels.unsqueeze(2)).latent_dist.mode()
    mean, std = _channel_stats(vae, z)
    return ((z - mean) / std)[:, :, 0]


def pack(x: torch.Tensor) -> torch.Tensor:
    """(n, c, h, w) -> (n, h/2 * w/2, 4c): 2 x 2 patches as tokens, as FluxPipeline packs
    its latents."""
    n, c, h, w = x.shape
    x = x.view(n, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5)
    return x.reshape(n, (h // 2) * (w // 2), c * 4)


def unpack(tokens: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """The inverse of :func:`pack` for latents ``h`` x ``w``."""
    n, _, d = tokens.shape
    x = tokens.view(n, h // 2, w // 2, d // 4, 2, 2).permute(0, 3, 1, 4, 2, 5)
    return x.reshape(n, d // 4, h, w)


def packed_sigmas(scheduler: "FlowMatchEulerDiscreteScheduler", num_steps: int,
                  tokens: int) -> tuple[float, ...]:
    """``num_steps + 1`` sigmas as FluxPipeline, QwenImagePipeline and their editing
    pipelines set them: ``linspace(1, 1/n, n)`` through ``scheduler`` with ``mu`` from
    the packed image's length ``tokens`` (used when the scheduler shifts dynamically;
    otherwise its ``shift`` applies), ending at 0."""
    from diffusers.pipelines.flux.pipeline_flux import calculate_shift

    c = scheduler.config
    mu = calculate_shift(tokens, c.get("base_image_seq_len", 256),
                         c.get("max_image_seq_len", 4096), c.get("base_shift", 0.5),
                         c.get("max_shift", 1.15))
    scheduler.set_timesteps(num_steps, sigmas=np.linspace(1.0, 1 / num_steps, num_steps), mu=mu)
    return tuple(float(s) for s in scheduler.sigmas)


def by_source_size(x: torch.Tensor, cond: Conditioning, velocity) -> torch.Tensor:
    """An editing family's velocity for a chunk whose samples' source images may differ
    in size (other aspect ratios have other token counts and positions): ``velocity(x,
    cond, (rows, columns))`` for the samples of each size of packed source latent grid
    (``cond.tensors["source_grid"]``), their source tokens cut to that size's count.
    A chunk of one size (the usual case) is one call."""
    sizes: dict[tuple[int, int], list[int]] = {}
    for i, (r, c) in enumerate(cond.tensors["source_grid"].tolist()):
        sizes.setdefault((int(r), int(c)), []).append(i)

    def cut(part: Conditioning, size: tuple[int, int]) -> Conditioning:
        tensors = dict(part.tensors)
        tensors["source_tokens"] = tensors["source_tokens"][:, : size[0] * size[1]]
        return Conditioning(part.prompts, tensors, part.negative, part.negative_per_sample)

    if len(sizes) == 1:
        size = next(iter(sizes))
        return velocity(x, cut(cond, size), size)
    v = torch.empty_like(x)
    for size, rows in sizes.items():
        index = torch.tensor(rows, device=x.device)
        v[index] = velocity(x[index], cut(cond.rows(index), size), size)
    return v
