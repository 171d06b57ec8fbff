"""FLUX.1 (``FluxPipeline``): a transformer on 2x2-packed latents with image and text
position ids, conditioned on T5 (sequence) and CLIP-L (pooled), with guidance as an
embedding (``guidance_embeds``) instead of classifier-free guidance.

The sampler holds latents unpacked, ``(channels, height, width)``; they are packed into
``(height/2 x width/2, 4 channels)`` tokens for the transformer only.
"""

from __future__ import annotations

from functools import cached_property

import torch

from digenrl.config import SamplerConfig
from digenrl.models.base import JOINT_ATTENTION_TARGETS, Conditioning, ModelFamily
from digenrl.models.common import (TextEncoders, pack, packed_sigmas, scaled_vae_decode,
                                   timesteps, unpack, vae_block_factor)

__all__ = ["FluxFamily", "image_ids", "flux_velocity"]


def image_ids(h: int, w: int, device, first: int = 0) -> torch.Tensor:
    """(h/2 * w/2, 3) position ids of the packed tokens of latents h x w: (first, row,
    column); ``first`` is 1 for a source image's tokens (FLUX.1 Kontext)."""
    ids = torch.zeros(h // 2, w // 2, 3)
    ids[..., 0] = first
    ids[..., 1] += torch.arange(h // 2)[:, None]
    ids[..., 2] += torch.arange(w // 2)[None, :]
    return ids.reshape(-1, 3).to(device)


def flux_velocity(transformer, x: torch.Tensor, timestep: float | torch.Tensor, cond: Conditioning,
                  guidance_scale: float, source: torch.Tensor | None = None,
                  source_ids: torch.Tensor | None = None) -> torch.Tensor:
    """A FLUX transformer's velocity for latents ``x`` ``(n, c, h, w)``: packed, with
    the guidance embedding when the transformer has one. ``source`` (packed tokens)
    and ``source_ids`` (their positions) are appended after the image's tokens, as
    FluxKontextPipeline appends its source image; the velocity is the image's part."""
    n, _, h, w = x.shape
    embeds = cond.tensors["embeds"]
    # As FluxPipeline: the scheduler timestep over 1000.
    t = timesteps(x, timestep, x.dtype) / 1000.0
    guidance = None
    if transformer.config.guidance_embeds:
        guidance = torch.full((n,), guidance_scale, dtype=torch.float32, device=x.device)
    tokens, ids = pack(x), image_ids(h, w, x.device)
    if source is not None:
        assert source_ids is not None   # (given with the source)
        tokens, ids = torch.cat([tokens, source], dim=1), torch.cat([ids, source_ids])
    out = transformer(hidden_states=tokens, timestep=t, guidance=guidance,
                      pooled_projections=cond.tensors["pooled"], encoder_hidden_states=embeds,
                      txt_ids=torch.zeros(embeds.shape[1], 3, device=x.device), img_ids=ids,
                      return_dict=False)[0]
    return unpack(out[:, : (h // 2) * (w // 2)], h, w)


class _FluxEncoder(TextEncoders):
    def __init__(self, family: "FluxFamily", device):
        super().__init__(family, device)
        self.clip_tokenizer = self.tokenizer("tokenizer")
        self.clip = self.text_encoder("text_encoder")
        self.t5_tokenizer = self.tokenizer("tokenizer_2")
        self.t5 = self.text_encoder("text_encoder_2")

    def encode_batch(self, prompts: list[str]) -> dict[str, torch.Tensor]:
        tok = self.clip_tokenizer
        ids = tok(prompts, padding="max_length", max_length=tok.model_max_length,
                  truncation=True, return_tensors="pt").input_ids
        pooled = self.clip(ids.to(self.device), output_hidden_states=False).pooler_output
        ids = self.t5_tokenizer(prompts, padding="max_length",
                                max_length=self.family.max_sequence_length, truncation=True,
                                return_tensors="pt").input_ids
        embeds = self.t5(ids.to(self.device), output_hidden_states=False)[0]
        return {"embeds": embeds, "pooled": pooled}


class FluxFamily(ModelFamily):
    pipeline_class = "FluxPipeline"
    # FLUX is guidance-distilled: the guidance embedding, no negative prompt.
    uses_negative_prompt = False
    parts = ("transformer", "vae", "scheduler", "tokenizer", "text_encoder", "tokenizer_2",
             "text_encoder_2")
    default_max_sequence_length = 512
    tokenizer_parts = (("tokenizer", False), ("tokenizer_2", True))
    transformer_class_name = "FluxTransformer2DModel"
    block_lists = ("transformer_blocks", "single_transformer_blocks")
    vae_class_name = "AutoencoderKL"
    lora_targets = JOINT_ATTENTION_TARGETS
    #: FluxPipeline's default_sample_size: 128 latent pixels.
    default_sample_size = 128

    @cached_property
    def vae_scale_factor(self) -> int:
        return vae_block_factor(self.vae_config())

    def image_size(self) -> tuple[int, int]:
        default = self.default_sample_size * self.vae_scale_factor
        return (self.cfg.height or default, self.cfg.width or default)

    def size_multiple(self) -> int:
        return self.vae_scale_factor * 2  # latents packed 2 x 2

    def latent_shape(self) -> tuple[int, int, int]:
        f = self.vae_scale_factor
        h, w = (2 * (int(s) // (f * 2)) for s in self.image_size())
        return (self.transformer_config()["in_channels"] // 4, h, w)

    def sigmas(self, sampler: SamplerConfig) -> tuple[float, ...]:
        """As FluxPipeline: ``linspace(1, 1/n, n)``, shifted by ``mu`` from the packed
        image's length when the scheduler shifts dynamically (FLUX.1-dev), else by
        ``sampler.shift``."""
        _, h, w = self.latent_shape()
        return packed_sigmas(self.flow_scheduler(sampler), sampler.num_steps,
                             (h // 2) * (w // 2))

    def build_encoder(self, device) -> _FluxEncoder:
        return _FluxEncoder(self, device)

    def predict_velocity(self, transformer, x, sigma, cond, guidance_scale):
        return flux_velocity(transformer, x, self.timestep(sigma), cond.to_dtype(x.dtype),
                             guidance_scale)

    def context_parallel_plan(self) -> dict:
        """Diffusers' own plan for the transformer class."""
        return self.transformer_class._cp_plan

    def decode(self, vae, latents):
        return scaled_vae_decode(vae, latents)
