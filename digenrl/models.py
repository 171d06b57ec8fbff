"""The policy and its fixed companions: a diffusers flow-matching transformer, the VAE,
a prompt encoder, and the sigma schedule.

Built from :class:`~digenrl.config.ModelConfig` sizes with seeded random weights (no
downloads), or loaded with ``from_pretrained`` from a local diffusers pipeline folder.
"""

from __future__ import annotations

import json
import logging
from functools import lru_cache
from pathlib import Path

import torch
from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel

from digenrl.config import ModelConfig, SamplerConfig
from digenrl.seeding import stable_seed

__all__ = ["build_transformer", "build_vae", "PromptEncoder", "flow_sigmas",
           "predict_velocity", "decode_latents", "latent_shape", "transformer_config",
           "model_seed"]

logger = logging.getLogger(__name__)


def model_seed(cfg: ModelConfig, run_seed: int) -> int:
    return cfg.init_seed if cfg.init_seed is not None else run_seed


def _seeded(seed: int, part: str):
    torch.manual_seed(stable_seed(seed, "init", part))


def transformer_config(cfg: ModelConfig) -> dict:
    """The transformer's diffusers config (read from the folder when ``cfg.path`` is set)."""
    if cfg.path is not None:
        return json.loads((Path(cfg.path).expanduser() / "transformer" / "config.json").read_text())
    heads, dim = cfg.attention_heads, cfg.attention_head_dim
    return dict(
        sample_size=cfg.latent_size, patch_size=cfg.patch_size,
        in_channels=cfg.latent_channels, out_channels=cfg.latent_channels,
        num_layers=cfg.transformer_layers, attention_head_dim=dim,
        num_attention_heads=heads, joint_attention_dim=cfg.prompt_embed_dim,
        caption_projection_dim=heads * dim, pooled_projection_dim=cfg.pooled_embed_dim,
        pos_embed_max_size=cfg.latent_size,
    )


def build_transformer(cfg: ModelConfig, seed: int) -> SD3Transformer2DModel:
    """The trainable velocity model, float32, with the initial (version 0) weights."""
    if cfg.path is not None:
        model = SD3Transformer2DModel.from_pretrained(
            Path(cfg.path).expanduser(), subfolder="transformer", torch_dtype=torch.float32)
    else:
        _seeded(seed, "transformer")
        model = SD3Transformer2DModel(**transformer_config(cfg))
    return model.eval()


def build_vae(cfg: ModelConfig, seed: int) -> AutoencoderKL:
    if cfg.path is not None:
        vae = AutoencoderKL.from_pretrained(
            Path(cfg.path).expanduser(), subfolder="vae", torch_dtype=torch.float32)
    else:
        _seeded(seed, "vae")
        n = len(cfg.vae_channels)
        vae = AutoencoderKL(
            in_channels=3, out_channels=3,
            down_block_types=("DownEncoderBlock2D",) * n,
            up_block_types=("UpDecoderBlock2D",) * n,
            block_out_channels=tuple(cfg.vae_channels),
            layers_per_block=cfg.vae_layers_per_block,
            latent_channels=cfg.latent_channels, norm_num_groups=min(32, min(cfg.vae_channels)),
            sample_size=cfg.image_size,
        )
    vae.requires_grad_(False)
    return vae.eval()


def latent_shape(cfg: ModelConfig) -> tuple[int, int, int]:
    """(channels, height, width) of one latent."""
    tc = transformer_config(cfg)
    size = tc["sample_size"]
    return (tc["in_channels"], size, size)


class PromptEncoder:
    """Deterministic text conditioning that needs no downloads.

    Each word maps to a fixed random vector seeded by the word itself; a prompt is the
    sequence of its word vectors, zero-padded to ``tokens``, plus the mean of a second
    set of word vectors as the pooled embedding. The empty prompt is all zeros (the
    unconditional input for classifier-free guidance). The transformer's own trainable
    projections learn what to make of them.
    """

    def __init__(self, tokens: int, embed_dim: int, pooled_dim: int):
        self.tokens, self.embed_dim, self.pooled_dim = tokens, embed_dim, pooled_dim
        self._cache: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    @classmethod
    def for_model(cls, cfg: ModelConfig) -> "PromptEncoder":
        tc = transformer_config(cfg)
        return cls(cfg.prompt_tokens, tc["joint_attention_dim"], tc["pooled_projection_dim"])

    def _word(self, word: str, what: str, dim: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(stable_seed("prompt-encoder", what, word))
        return torch.randn(dim, generator=g, dtype=torch.float32)

    def _one(self, prompt: str) -> tuple[torch.Tensor, torch.Tensor]:
        if prompt not in self._cache:
            words = prompt.lower().split()[: self.tokens]
            seq = torch.zeros(self.tokens, self.embed_dim)
            pooled = torch.zeros(self.pooled_dim)
            for i, w in enumerate(words):
                seq[i] = self._word(w, "token", self.embed_dim)
                pooled += self._word(w, "pooled", self.pooled_dim)
            if words:
                pooled /= len(words)
            self._cache[prompt] = (seq, pooled)
        return self._cache[prompt]

    def encode(self, prompts) -> tuple[torch.Tensor, torch.Tensor]:
        pairs = [self._one(p) for p in prompts]
        return torch.stack([a for a, _ in pairs]), torch.stack([b for _, b in pairs])


@lru_cache(maxsize=32)
def _sigmas(num_steps: int, shift: float, num_train_timesteps: int) -> tuple[float, ...]:
    sched = FlowMatchEulerDiscreteScheduler(num_train_timesteps=num_train_timesteps, shift=shift)
    sched.set_timesteps(num_steps)
    return tuple(float(s) for s in sched.sigmas)


def flow_sigmas(sampler: SamplerConfig, model: ModelConfig) -> tuple[float, ...]:
    """``num_steps + 1`` sigmas from diffusers' FlowMatchEulerDiscreteScheduler (shifted),
    ending at 0. A pipeline folder's ``scheduler/`` config sets the training timesteps."""
    num_train = 1000
    if model.path is not None:
        f = Path(model.path).expanduser() / "scheduler" / "scheduler_config.json"
        if f.is_file():
            num_train = int(json.loads(f.read_text()).get("num_train_timesteps", 1000))
    return _sigmas(sampler.num_steps, float(sampler.shift), num_train)


def predict_velocity(
    transformer: SD3Transformer2DModel,
    x: torch.Tensor,
    sigma: float,
    embeds: torch.Tensor,
    pooled: torch.Tensor,
    guidance_scale: float = 1.0,
    uncond: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """v(x, sigma | prompt), with classifier-free guidance when ``guidance_scale > 1``."""
    n = x.shape[0]
    timestep = torch.full((n,), sigma * 1000.0, dtype=torch.float32, device=x.device)
    if guidance_scale > 1.0:
        assert uncond is not None
        ue, up = uncond
        out = transformer(
            hidden_states=torch.cat([x, x]),
            encoder_hidden_states=torch.cat([ue.expand_as(embeds), embeds]),
            pooled_projections=torch.cat([up.expand_as(pooled), pooled]),
            timestep=torch.cat([timestep, timestep]),
            return_dict=False,
        )[0]
        v_uncond, v_cond = out.chunk(2)
        return v_uncond + guidance_scale * (v_cond - v_uncond)
    return transformer(hidden_states=x, encoder_hidden_states=embeds,
                       pooled_projections=pooled, timestep=timestep, return_dict=False)[0]


@torch.no_grad()
def decode_latents(vae: AutoencoderKL, latents: torch.Tensor):
    """Latents to uint8 images ``(n, height, width, 3)`` (numpy)."""
    scale = getattr(vae.config, "scaling_factor", 1.0) or 1.0
    shift = getattr(vae.config, "shift_factor", 0.0) or 0.0
    images = vae.decode(latents / scale + shift, return_dict=False)[0]
    images = ((images.clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)
    return images.permute(0, 2, 3, 1).contiguous().cpu().numpy()
