"""FLUX.1 (``FluxPipeline``): a transformer on 2x2-packed latents with image and text
position ids, conditioned on T5 (sequence) and CLIP-L (pooled), with guidance as an
embedding (``guidance_embeds``) instead of classifier-free guidance.

The sampler holds latents unpacked, ``(channels, height, width)``; they are packed into
``(height/2 x width/2, 4 channels)`` tokens for the transformer only.
"""

from __future__ import annotations

from functools import cached_property

import numpy as np
import torch
from diffusers import AutoencoderKL, FluxTransformer2DModel

from digenrl.config import SamplerConfig
from digenrl.models.base import JOINT_ATTENTION_TARGETS, ModelFamily
from digenrl.models.common import (TextEncoders, pack, scaled_vae_decode, timesteps, unpack,
                                   vae_block_factor)

__all__ = ["FluxFamily", "image_ids"]


def image_ids(h: int, w: int, device) -> torch.Tensor:
    """(h/2 * w/2, 3) position ids of the packed tokens: (0, row, column)."""
    ids = torch.zeros(h // 2, w // 2, 3)
    ids[..., 1] += torch.arange(h // 2)[:, None]
    ids[..., 2] += torch.arange(w // 2)[None, :]
    return ids.reshape(-1, 3).to(device)


class _FluxEncoder(TextEncoders):
    uses_negative = False  # FLUX is guidance-distilled: no negative prompt.

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
    parts = ("transformer", "vae", "scheduler", "tokenizer", "text_encoder", "tokenizer_2",
             "text_encoder_2")
    default_max_sequence_length = 512
    tokenizer_parts = (("tokenizer", False), ("tokenizer_2", True))
    transformer_class = FluxTransformer2DModel
    vae_class = AutoencoderKL
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
        from diffusers.pipelines.flux.pipeline_flux import calculate_shift

        sched = self.flow_scheduler(sampler)
        n = sampler.num_steps
        _, h, w = self.latent_shape()
        c = sched.config
        mu = calculate_shift((h // 2) * (w // 2), c.get("base_image_seq_len", 256),
                             c.get("max_image_seq_len", 4096), c.get("base_shift", 0.5),
                             c.get("max_shift", 1.15))
        sched.set_timesteps(n, sigmas=np.linspace(1.0, 1 / n, n), mu=mu)
        return tuple(float(s) for s in sched.sigmas)

    def build_encoder(self, device) -> _FluxEncoder:
        return _FluxEncoder(self, device)

    def predict_velocity(self, transformer, x, sigma, cond, guidance_scale):
        n, _, h, w = x.shape
        cond = cond.to_dtype(x.dtype)
        embeds = cond.tensors["embeds"]
        t = timesteps(x, self.timestep(sigma), x.dtype) \
            / 1000.0  # as FluxPipeline: the scheduler timestep over 1000
        guidance = None
        if transformer.config.guidance_embeds:
            guidance = torch.full((n,), guidance_scale, dtype=torch.float32, device=x.device)
        out = transformer(hidden_states=pack(x), timestep=t, guidance=guidance,
                          pooled_projections=cond.tensors["pooled"],
                          encoder_hidden_states=embeds,
                          txt_ids=torch.zeros(embeds.shape[1], 3, device=x.device),
                          img_ids=image_ids(h, w, x.device), return_dict=False)[0]
        return unpack(out, h, w)

    def decode(self, vae, latents):
        return scaled_vae_decode(vae, latents)
