"""FLUX.1 (``FluxPipeline``): a transformer on 2x2-packed latents with image and text
position ids, conditioned on T5 (sequence) and CLIP-L (pooled), with guidance as an
embedding (``guidance_embeds``) instead of classifier-free guidance.

The sampler holds latents unpacked, ``(channels, height, width)``; they are packed into
``(height/2 x width/2, 4 channels)`` tokens for the transformer only.
"""

from __future__ import annotations

from functools import cached_property
from typing import Sequence

import numpy as np
import torch
from diffusers import AutoencoderKL, FluxTransformer2DModel

from digenrl.config import SamplerConfig
from digenrl.models.base import (JOINT_ATTENTION_TARGETS, Conditioning, ModelFamily,
                                 PromptCache)
from digenrl.models.parts import TORCH_DTYPES, check_tokens, load_part, load_tokenizer
from digenrl.models.tiny import scaled_vae_decode

__all__ = ["FluxFamily", "pack", "unpack", "image_ids"]


def pack(x: torch.Tensor) -> torch.Tensor:
    """(n, c, h, w) -> (n, h/2 * w/2, 4c), as FluxPipeline packs its latents."""
    n, c, h, w = x.shape
    x = x.view(n, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5)
    return x.reshape(n, (h // 2) * (w // 2), c * 4)


def unpack(tokens: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """The inverse of :func:`pack` for latents ``h`` x ``w``."""
    n, _, d = tokens.shape
    x = tokens.view(n, h // 2, w // 2, d // 4, 2, 2).permute(0, 3, 1, 4, 2, 5)
    return x.reshape(n, d // 4, h, w)


def image_ids(h: int, w: int, device) -> torch.Tensor:
    """(h/2 * w/2, 3) position ids of the packed tokens: (0, row, column)."""
    ids = torch.zeros(h // 2, w // 2, 3)
    ids[..., 1] += torch.arange(h // 2)[:, None]
    ids[..., 2] += torch.arange(w // 2)[None, :]
    return ids.reshape(-1, 3).to(device)


class _FluxEncoder:
    def __init__(self, family: "FluxFamily", device):
        folder, dtype = family.folder, TORCH_DTYPES[family.cfg.text_encoder_dtype]
        self.family, self.device = family, device
        self.clip_tokenizer = load_part(folder, "tokenizer")
        self.clip = load_part(folder, "text_encoder", dtype=dtype).to(device).eval()
        self.t5_tokenizer = load_part(folder, "tokenizer_2")
        self.t5 = load_part(folder, "text_encoder_2", dtype=dtype).to(device).eval()
        self.cache = PromptCache(self._encode)

    def _encode(self, prompts: list[str]) -> dict[str, torch.Tensor]:
        tok = self.clip_tokenizer
        ids = tok(prompts, padding="max_length", max_length=tok.model_max_length,
                  truncation=True, return_tensors="pt").input_ids
        pooled = self.clip(ids.to(self.device), output_hidden_states=False).pooler_output
        ids = self.t5_tokenizer(prompts, padding="max_length",
                                max_length=self.family.max_sequence_length, truncation=True,
                                return_tensors="pt").input_ids
        embeds = self.t5(ids.to(self.device), output_hidden_states=False)[0]
        return {"embeds": embeds, "pooled": pooled}

    def encode(self, prompts: Sequence[str], negative: bool) -> Conditioning:
        # FLUX is guidance-distilled: no negative prompt.
        return Conditioning(tuple(prompts), self.cache(list(prompts)), None)


class FluxFamily(ModelFamily):
    pipeline_class = "FluxPipeline"
    parts = ("transformer", "vae", "scheduler", "tokenizer", "text_encoder", "tokenizer_2",
             "text_encoder_2")
    default_max_sequence_length = 512
    transformer_class = FluxTransformer2DModel
    vae_class = AutoencoderKL
    lora_targets = JOINT_ATTENTION_TARGETS
    #: FluxPipeline's default_sample_size: 128 latent pixels.
    default_sample_size = 128

    @cached_property
    def vae_scale_factor(self) -> int:
        return 2 ** (len(self.vae_config()["block_out_channels"]) - 1)

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

    def tokenizers(self):
        return [(name, load_tokenizer(self.folder, name)) for name in ("tokenizer", "tokenizer_2")]

    def check_prompts(self, named: Sequence[tuple[str, str]]) -> None:
        for name, tok in self.tokenizers():
            check_tokens(tok, name, named,
                         self.max_sequence_length if name == "tokenizer_2" else None)

    def build_encoder(self, device) -> _FluxEncoder:
        return _FluxEncoder(self, device)

    def predict_velocity(self, transformer, x, sigma, cond, guidance_scale):
        n, _, h, w = x.shape
        cond = cond.to_dtype(x.dtype)
        embeds = cond.tensors["embeds"]
        t = torch.full((n,), self.timestep(sigma), dtype=x.dtype, device=x.device) \
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
