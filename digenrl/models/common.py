"""What several model families compute the same way: the base of a family's prompt
encoder, classifier-free guidance, the timestep input, VAE decoding in the two latent
layouts diffusers' VAEs use, and 2 x 2 latent packing.

A new family (a module beside ``sd3.py``, ``flux.py``, ``wan.py``) builds on these and on
:class:`~digenrl.models.base.ModelFamily`; the built-in tiny model's module
(:mod:`digenrl.models.tiny`) holds only what is its own.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar, Mapping, Sequence

import torch

from digenrl.models.base import Conditioning, PromptCache
from digenrl.models.parts import TORCH_DTYPES, load_part

if TYPE_CHECKING:
    from digenrl.models.base import ModelFamily

__all__ = ["TextEncoders", "guided", "timesteps", "vae_block_factor", "scaled_vae_decode",
           "normalized_vae_decode", "pack", "unpack"]


class TextEncoders:
    """The base of a family's prompt encoder (what
    :meth:`~digenrl.models.base.ModelFamily.build_encoder` returns).

    A subclass loads its parts in ``__init__`` (after this one's) with :meth:`tokenizer`
    and :meth:`text_encoder`, and implements :meth:`encode_batch`. :meth:`encode` encodes
    each prompt once (:class:`~digenrl.models.base.PromptCache`) and adds the negative
    prompt's encoding when asked, unless the family uses none (``uses_negative = False``:
    a guidance-distilled model).
    """

    #: Whether the family's guidance needs the negative prompt's encoding.
    uses_negative: ClassVar[bool] = True

    def __init__(self, family: "ModelFamily", device: torch.device):
        self.family, self.device = family, device
        #: ``model.text_encoder_dtype``: the text encoders' weights and forward pass.
        self.dtype = TORCH_DTYPES[family.cfg.text_encoder_dtype]
        self.cache = PromptCache(self.encode_batch)

    def tokenizer(self, part: str):
        """The folder's tokenizer ``part`` (e.g. ``tokenizer_2``)."""
        return load_part(self.family.folder, part)

    def text_encoder(self, part: str) -> torch.nn.Module:
        """The folder's text encoder ``part`` on this device, in ``model.text_encoder_dtype``,
        in eval mode."""
        return load_part(self.family.folder, part, dtype=self.dtype).to(self.device).eval()

    def encode_batch(self, prompts: list[str]) -> dict[str, torch.Tensor]:
        """The family's tensors for ``prompts``, one row per prompt (run under no_grad)."""
        raise NotImplementedError

    def encode(self, prompts: Sequence[str], negative: bool) -> Conditioning:
        neg = None
        if negative and self.uses_negative:
            neg = self.cache([self.family.cfg.negative_prompt])
        return Conditioning(tuple(prompts), self.cache(list(prompts)), neg)


def guided(v_uncond: torch.Tensor, v_cond: torch.Tensor, scale: float) -> torch.Tensor:
    """Classifier-free guidance: ``v_uncond + scale * (v_cond - v_uncond)``."""
    return v_uncond + scale * (v_cond - v_uncond)


def timesteps(x: torch.Tensor, value: float, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The transformer's timestep input: ``value`` for each sample of ``x``."""
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


def normalized_vae_decode(vae, latents: torch.Tensor) -> torch.Tensor:
    """Latents ``(n, z_dim, frames, h, w)`` normalised per channel by the VAE's
    ``latents_mean`` / ``latents_std`` (the layout of ``AutoencoderKLWan``) de-normalised
    as the pipelines do and decoded."""
    c = vae.config
    mean = torch.tensor(c.latents_mean).view(1, c.z_dim, 1, 1, 1).to(latents)
    std = torch.tensor(c.latents_std).view(1, c.z_dim, 1, 1, 1).to(latents)
    # The pipelines divide by 1 / std.
    return vae.decode(latents / (1.0 / std) + mean, return_dict=False)[0]


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
