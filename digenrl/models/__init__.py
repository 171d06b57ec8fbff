"""The policy and its fixed companions, per model family: the diffusers flow-matching
transformer that is trained, the VAE, the text encoders, and the sigma schedule.

``model.path`` null builds the built-in tiny model (:mod:`digenrl.models.tiny`) with
seeded random weights; a local diffusers pipeline folder is loaded by the family its
``model_index.json`` names (:data:`~digenrl.models.registry.FAMILIES`). The functions
below are the ones tasks call; each asks the configured family.
"""

from __future__ import annotations

import numpy as np
import torch

from digenrl.config import ModelConfig, SamplerConfig
from digenrl.metering import model_time
from digenrl.models.base import Conditioning, ModelFamily, to_uint8
from digenrl.models.parts import BUILDING, TORCH_DTYPES
from digenrl.models.registry import FAMILIES, family
from digenrl.models.tiny import PromptEncoder

__all__ = ["build_transformer", "build_vae", "PromptEncoder", "flow_sigmas",
           "predict_velocity", "decode_latents", "latent_shape", "transformer_config",
           "model_seed", "family", "FAMILIES", "Conditioning", "ModelFamily"]


def model_seed(cfg: ModelConfig, run_seed: int) -> int:
    return cfg.init_seed if cfg.init_seed is not None else run_seed


def transformer_config(cfg: ModelConfig) -> dict:
    """The transformer's diffusers config (read from the folder when ``cfg.path`` is set)."""
    return family(cfg).transformer_config()


def build_transformer(cfg: ModelConfig, seed: int) -> torch.nn.Module:
    """The trainable velocity model, float32, with the initial (version 0) weights."""
    with BUILDING:
        return family(cfg).build_transformer(seed)


def build_vae(cfg: ModelConfig, seed: int) -> torch.nn.Module:
    with BUILDING:
        return family(cfg).build_vae(seed)


def latent_shape(cfg: ModelConfig) -> tuple[int, ...]:
    """The shape of one sample's latent: (channels, height, width), or (channels,
    frames, height, width) for a video family."""
    return family(cfg).latent_shape()


def flow_sigmas(sampler: SamplerConfig, model: ModelConfig) -> tuple[float, ...]:
    """``num_steps + 1`` sigmas from diffusers' FlowMatchEulerDiscreteScheduler (shifted),
    ending at 0, as the family's pipeline sets them."""
    return family(model).sigmas(sampler)


def predict_velocity(cfg: ModelConfig, transformer: torch.nn.Module, x: torch.Tensor,
                     sigma: float | torch.Tensor, cond: Conditioning,
                     guidance_scale: float = 1.0) -> torch.Tensor:
    """v(x, sigma | prompt), with the family's guidance, in float32: the transformer runs
    in ``model.dtype`` (its input and the conditioning are cast to it). ``sigma``: one
    noise level for every sample, or a float64 tensor of one per sample."""
    dtype = TORCH_DTYPES[cfg.dtype]
    with model_time():
        if dtype == torch.float32:
            return family(cfg).predict_velocity(transformer, x, sigma, cond, guidance_scale)
        v = family(cfg).predict_velocity(transformer, x.to(dtype), sigma,
                                         cond.to_dtype(dtype), guidance_scale)
        return v.float()


@torch.no_grad()
def decode_latents(cfg: ModelConfig, vae: torch.nn.Module, latents: torch.Tensor) -> np.ndarray:
    """Latents to uint8 pixels: images ``(n, height, width, 3)``, or videos
    ``(n, frames, height, width, 3)`` for a video family (numpy)."""
    with model_time():
        pixels = family(cfg).decode(vae, latents)
    return to_uint8(pixels)
