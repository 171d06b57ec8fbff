"""Qwen-Image (``QwenImagePipeline``) and Qwen-Image-Edit (``QwenImageEditPipeline``):
an MMDiT on 2x2-packed latents conditioned on the last hidden states of Qwen2.5-VL, with
true classifier-free guidance against the negative prompt (``true_cfg_scale``, here
``sampler.guidance_scale``), the combined velocity rescaled to the conditional one's norm
per token, as the pipelines do.

The prompt goes into the pipeline's chat template; the template's system prefix is
dropped from the encoder's hidden states, and so is the padding: each prompt's
embedding is as long as its own tokens (``model.max_sequence_length`` at most), a
chunk's are zero-padded to the longest with a mask, as the pipeline pads a batch.

Qwen-Image-Edit encodes the prompt together with its source image (the processor's
vision tokens in the template), and the negative prompt with it too, once per sample;
the source image is resized to about 1 megapixel (or ``model.source_area`` pixels) at
its aspect ratio, encoded by the VAE (the latent distribution's mode, normalised by the
VAE's per-channel mean and std) and packed; its tokens follow the image's in the transformer, at their own rotary
positions (a second frame of ``img_shapes``), and its output for them is dropped.

The sampler holds latents unpacked, ``(channels, height, width)``; the VAE decodes them
as one frame, de-normalised by its ``latents_mean`` / ``latents_std``.
"""

from __future__ import annotations

import inspect
from functools import cached_property, lru_cache
from typing import ClassVar, Sequence

import diffusers
import torch
from diffusers.image_processor import VaeImageProcessor

from digenrl.config import ConfigError, SamplerConfig
from digenrl.models.base import JOINT_ATTENTION_TARGETS, Conditioning, ModelFamily, SourceImage
from digenrl.models.common import (TextEncoders, by_source_size, normalized_vae_decode,
                                   normalized_vae_encode, pack, packed_sigmas, timesteps,
                                   unpack)

__all__ = ["QwenImageFamily", "QwenImageEditFamily", "pipeline_defaults",
           "ROPE_POSITIONS", "SOURCE_AREA"]

#: Positions in QwenEmbedRope's rotary table (``torch.arange(4096)``): the text tokens
#: take the positions after the image's largest half side.
ROPE_POSITIONS = 4096
#: The area QwenImageEditPipeline resizes a source image to (``calculate_dimensions(1024
#: * 1024, aspect ratio)``).
SOURCE_AREA = 1024 * 1024


@lru_cache(maxsize=4)
def pipeline_defaults(name: str):
    """The pipeline class ``name`` built without parts: its prompt template, the
    template tokens it drops, its tokenizer length and default sample size, as the
    pipeline's own ``__init__`` sets them."""
    cls = getattr(diffusers, name)
    parts = [p for p in inspect.signature(cls.__init__).parameters if p != "self"]
    return cls(**dict.fromkeys(parts))


def _drop_template(hidden: torch.Tensor, mask: torch.Tensor, drop: int,
                   keep: int | None) -> dict[str, list[torch.Tensor]]:
    """Each prompt's hidden states over its own tokens after the template's first
    ``drop`` (at most ``keep`` of them), with a mask of ones, as the pipelines'
    ``_get_qwen_prompt_embeds`` and ``encode_prompt`` cut them."""
    rows = [h[m.bool()][drop:][:keep] for h, m in zip(hidden, mask)]
    return {"embeds": rows, "mask": [torch.ones(r.shape[0], dtype=torch.long) for r in rows]}


class _QwenEncoder(TextEncoders):
    family: QwenImageFamily

    def __init__(self, family: "QwenImageFamily", device):
        super().__init__(family, device)
        self.qwen_tokenizer = self.tokenizer("tokenizer")
        self.qwen = self.text_encoder("text_encoder")

    def encode_batch(self, prompts: list[str]) -> dict[str, list[torch.Tensor]]:
        f = self.family
        inputs = self.qwen_tokenizer([f.prompt_text(p, "tokenizer") for p in prompts],
                                     max_length=f.tokenizer_max_length + f.dropped_tokens,
                                     padding=True, truncation=True, return_tensors="pt")
        mask = inputs.attention_mask.to(self.device)
        hidden = self.qwen(input_ids=inputs.input_ids.to(self.device), attention_mask=mask,
                           output_hidden_states=True).hidden_states[-1]
        return _drop_template(hidden, mask, f.dropped_tokens, f.max_sequence_length)


class QwenImageFamily(ModelFamily):
    pipeline_class = "QwenImagePipeline"
    parts: ClassVar[tuple[str, ...]] = ("transformer", "vae", "scheduler", "tokenizer",
                                        "text_encoder")
    default_max_sequence_length = 512  # QwenImagePipeline.__call__'s
    tokenizer_parts = (("tokenizer", True),)
    transformer_class_name = "QwenImageTransformer2DModel"
    vae_class_name = "AutoencoderKLQwenImage"
    lora_targets = JOINT_ATTENTION_TARGETS

    @cached_property
    def defaults(self):
        return pipeline_defaults(self.pipeline_class)

    @property
    def dropped_tokens(self) -> int:
        return self.defaults.prompt_template_encode_start_idx

    @property
    def tokenizer_max_length(self) -> int:
        return self.defaults.tokenizer_max_length

    def prompt_text(self, prompt: str, part: str) -> str:
        return self.defaults.prompt_template_encode.format(prompt)

    def check_folder(self) -> None:
        super().check_folder()
        if self.transformer_config().get("guidance_embeds"):
            raise ConfigError(f"model.path: expected a {self.pipeline_class} folder whose "
                              f"transformer has no guidance embedding, got "
                              f"{str(self.cfg.path)!r} with guidance_embeds")

    @cached_property
    def vae_scale_factor(self) -> int:
        return 2 ** len(self.vae_config()["temperal_downsample"])

    def image_size(self) -> tuple[int, int]:
        """(height, width) in pixels: the configured ones, else the pipeline's default."""
        default = self.defaults.default_sample_size * self.vae_scale_factor
        return (self.cfg.height or default, self.cfg.width or default)

    def size_multiple(self) -> int:
        return self.vae_scale_factor * 2  # latents packed 2 x 2

    def check_size(self) -> None:
        """The multiples, and what the rotary table holds (:meth:`check_positions`)."""
        super().check_size()
        self.check_positions()

    def check_positions(self) -> None:
        """The text's rotary positions follow the image's largest half side
        (QwenEmbedRope, ``scale_rope``) and must fit the table; a sequence longer than
        the pipeline's tokenizer length is refused as the pipeline refuses it."""
        limit = self.tokenizer_max_length
        if self.max_sequence_length > limit:
            raise ConfigError(f"model.max_sequence_length: expected at most {limit} for a "
                              f"{self.pipeline_class} folder, got {self.max_sequence_length}")
        self._check_image_side(self.max_sequence_length,
                               f"model.max_sequence_length {self.max_sequence_length}")

    def rope_side(self) -> int:
        """Where the text's rotary positions start after the image's: the largest half
        side of its packed latent grid."""
        return max(self.latent_shape()[1:]) // 4

    def _check_image_side(self, text: int, whose: str) -> None:
        """The image's positions and ``text`` positions after them fit the table
        (``whose``: what takes the ``text``, for the message)."""
        if self.rope_side() + text > ROPE_POSITIONS:
            name = "height" if self.image_size()[0] >= self.image_size()[1] else "width"
            most = (2 * (ROPE_POSITIONS - text) + 1) * self.size_multiple()
            raise ConfigError(f"model.{name}: expected at most {most} pixels for this "
                              f"{self.pipeline_class} folder (its rotary table holds "
                              f"{ROPE_POSITIONS} positions, {whose} of them for the prompt), "
                              f"got {max(self.image_size())}")

    def latent_shape(self) -> tuple[int, int, int]:
        f = self.vae_scale_factor
        h, w = (2 * (int(s) // (f * 2)) for s in self.image_size())
        return (self.transformer_config()["in_channels"] // 4, h, w)

    def sigmas(self, sampler: SamplerConfig) -> tuple[float, ...]:
        """As the pipeline: ``linspace(1, 1/n, n)`` shifted by ``mu`` from the packed
        image's length (Qwen-Image's scheduler shifts dynamically, exponentially, with a
        terminal sigma)."""
        _, h, w = self.latent_shape()
        return packed_sigmas(self.flow_scheduler(sampler), sampler.num_steps,
                             (h // 2) * (w // 2))

    def build_encoder(self, device) -> TextEncoders:
        return _QwenEncoder(self, device)

    def predict_velocity(self, transformer, x, sigma, cond, guidance_scale):
        return self._velocity(transformer, x, sigma, cond.to_dtype(x.dtype), guidance_scale)

    def _velocity(self, transformer, x: torch.Tensor, sigma: float | torch.Tensor,
                  cond: Conditioning, guidance_scale: float, source: tuple[int, int] | None = None):
        """The velocity of latents ``x`` (with the packed source tokens in ``cond`` and
        their grid ``source``, for an editing family), with true classifier-free
        guidance when ``guidance_scale > 1``."""
        n, _, h, w = x.shape
        tokens = pack(x)
        shapes = [(1, h // 2, w // 2)]
        if source is not None:
            tokens = torch.cat([tokens, cond.tensors["source_tokens"]], dim=1)
            shapes.append((1, *source))
        # As the pipeline: the scheduler timestep over 1000.
        t = timesteps(x, self.timestep(sigma), x.dtype) / 1000.0

        def run(text: dict[str, torch.Tensor]) -> torch.Tensor:
            embeds = text["embeds"].expand(n, -1, -1)
            mask = text["mask"].expand(n, -1)
            out = transformer(hidden_states=tokens, timestep=t, guidance=None,
                              encoder_hidden_states_mask=None if mask.all() else mask,
                              encoder_hidden_states=embeds, img_shapes=[shapes] * n,
                              return_dict=False)[0]
            return out[:, : (h // 2) * (w // 2)]

        v = run(cond.tensors)
        if guidance_scale > 1.0:
            assert cond.negative is not None, "guidance needs the negative prompt's encoding"
            v_uncond = run(cond.negative)
            combined = v_uncond + guidance_scale * (v - v_uncond)
            v = combined * (torch.norm(v, dim=-1, keepdim=True)
                            / torch.norm(combined, dim=-1, keepdim=True))
        return unpack(v, h, w)

    def context_parallel_plan(self) -> dict:
        """Diffusers' own plan for the transformer class."""
        return self.transformer_class._cp_plan

    def decode(self, vae, latents):
        return normalized_vae_decode(vae, latents)


class _QwenEditEncoder(TextEncoders):
    family: QwenImageEditFamily
    text_sees_image = True

    def __init__(self, family: "QwenImageEditFamily", device):
        super().__init__(family, device)
        from digenrl.models.qwen_processor import ImageTextProcessor

        self.processor = ImageTextProcessor.from_pretrained(family.pipeline_folder / "processor")
        self.qwen = self.text_encoder("text_encoder")

    def encode_batch(self, keys: list[tuple[str, SourceImage]]) -> dict[str, list]:
        f = self.family
        inputs = self.processor(text=[f.prompt_text(p, "processor") for p, _ in keys],
                                images=[f.prompt_image(image) for _, image in keys],
                                padding=True, return_tensors="pt")
        mask = inputs["attention_mask"].to(self.device)
        hidden = self.qwen(input_ids=inputs["input_ids"].to(self.device), attention_mask=mask,
                           pixel_values=inputs["pixel_values"].to(self.device),
                           image_grid_thw=inputs["image_grid_thw"].to(self.device),
                           output_hidden_states=True).hidden_states[-1]
        # QwenImageEditPipeline keeps every token after the template's prefix.
        return _drop_template(hidden, mask, f.dropped_tokens, None)


class QwenImageEditFamily(QwenImageFamily):
    pipeline_class = "QwenImageEditPipeline"
    parts = QwenImageFamily.parts + ("processor",)
    # The edit pipeline does not cut its encoding to a length: no bound.
    tokenizer_parts = (("tokenizer", False),)
    takes_images = True
    needs_images = True
    max_source_images = 1

    def check_positions(self) -> None:
        """The image leaves a position for the prompt; the prompt's positions depend on
        the source images (:meth:`check_sources`): the edit pipeline does not cut its
        encoding, which holds the source's vision tokens, to a length."""
        self._check_image_side(1, "at least 1")

    def check_sources(self, field: str, lines: Sequence[tuple[str, str, SourceImage]]) -> None:
        """The text (the template, the prompt and the source's vision tokens) takes the
        rotary positions after the largest half side of the image's and the source's
        packed grids (the source is the second frame of ``img_shapes``): both must fit
        the table. Refused in one line naming what is too large: the image's size, the
        source area, or else the prompt file's line."""
        for where, prompt, source in lines:
            height, width = self.source_size(source)
            source_side = max(height, width) // self.size_multiple() // 2
            text = self.encoded_length(prompt, height, width)
            if max(self.rope_side(), source_side) + text <= ROPE_POSITIONS:
                continue
            if source_side + text <= ROPE_POSITIONS:  # the image's own size overflows
                self._check_image_side(text, f"{text} (the prompt of {where} with its "
                                             f"source image's vision tokens)")
            field = "model.source_area" if self.cfg.source_area is not None else \
                f"{field}: {where}"
            got = self.cfg.source_area if self.cfg.source_area is not None else \
                f"a source image resized to {height} x {width} pixels"
            raise ConfigError(f"{field}: expected a source image and prompt that fit this "
                              f"{self.pipeline_class} folder's rotary table of "
                              f"{ROPE_POSITIONS} positions (the prompt of {where} with its "
                              f"source image's vision tokens takes {text} of them after the "
                              f"source's {source_side}), got {got}")

    @cached_property
    def processor(self):
        """The folder's ``processor/``, as the encoder loads it."""
        from digenrl.models.qwen_processor import ImageTextProcessor

        return ImageTextProcessor.from_pretrained(self.pipeline_folder / "processor")

    def encoded_length(self, prompt: str, height: int, width: int) -> int:
        """Tokens of the encoding of ``prompt`` with a source image resized to ``height``
        x ``width``, as the encoder keeps them: the processor's tokens, the template's
        image placeholder turned into the image's vision tokens (patches over
        ``merge_size²``, as Qwen2VLProcessor counts them without the pixels), past the
        template's dropped prefix."""
        images = self.processor.image_processor
        vision = (images.get_number_of_image_patches(height, width)
                  // images.merge_size ** 2)
        ids = self.processor.tokenizer(self.prompt_text(prompt, "processor"))["input_ids"]
        return len(ids) - 1 + vision - self.dropped_tokens

    @cached_property
    def image_processor(self) -> VaeImageProcessor:
        """The pipeline's own image processor (PIL's Lanczos, pixels to [-1, 1])."""
        return VaeImageProcessor(vae_scale_factor=self.vae_scale_factor * 2)

    def pipeline_source_size(self, image: SourceImage) -> tuple[int, int]:
        """(height, width) the pipeline resizes a source image to: about
        :data:`SOURCE_AREA` pixels at its aspect ratio, in multiples of 32."""
        from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit import calculate_dimensions

        h, w = image.pixels.shape[:2]
        width, height, _ = calculate_dimensions(SOURCE_AREA, w / h)
        return height, width

    def prompt_image(self, image: SourceImage):
        """The source image as the vision-language encoder receives it (resized, PIL)."""
        return self.image_processor.resize(image.pil(), *self.source_size(image))

    def source_pixels(self, image: SourceImage) -> torch.Tensor:
        """The source image as the pipeline feeds the VAE: ``(1, 3, H, W)`` in [-1, 1]."""
        return self.image_processor.preprocess(self.prompt_image(image), *self.source_size(image))

    def source_latents(self, vae, pixels: torch.Tensor) -> torch.Tensor:
        """The pipeline's encoding: the latent distribution's mode, normalised by the
        VAE's per-channel mean and std."""
        return normalized_vae_encode(vae, pixels)

    def build_encoder(self, device) -> TextEncoders:
        return _QwenEditEncoder(self, device)

    def predict_velocity(self, transformer, x, sigma, cond, guidance_scale):
        def velocity(x, cond, size):
            return self._velocity(transformer, x, sigma, cond, guidance_scale, size)

        return by_source_size(x, cond.to_dtype(x.dtype), velocity)
