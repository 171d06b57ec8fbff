"""The built-in model: a small SD3-shaped transformer and VAE with seeded random weights
(nothing is downloaded), conditioned by a hash prompt encoder.

Built from the tiny-model sizes of :class:`~digenrl.config.ModelConfig` and called as
the SD3 family calls its transformer (:func:`~digenrl.models.sd3.sd3_velocity`). A
folder without ``model_index.json`` (only ``transformer/``, ``vae/`` and ``scheduler/``
of an SD3-shaped model) loads its transformer and VAE here too; such a folder has no
text encoders, so prompts go through the hash encoder as well.
"""

from __future__ import annotations

import logging
from functools import lru_cache
from typing import Sequence

import torch
from diffusers import FlowMatchEulerDiscreteScheduler

from digenrl.config import SamplerConfig
from digenrl.models.base import JOINT_ATTENTION_TARGETS, Conditioning, ModelFamily, PromptCache
from digenrl.models.common import negative_texts, scaled_vae_decode
from digenrl.models.sd3 import parallel_joint_attention, sd3_context_parallel_plan, sd3_velocity
from digenrl.seeding import INIT_DRAW, PROMPT_ENCODER_DRAW, stable_seed

__all__ = ["TinyFamily", "PromptEncoder", "seeded"]

logger = logging.getLogger(__name__)


def seeded(seed: int, part: str) -> None:
    torch.manual_seed(stable_seed(seed, INIT_DRAW, part))


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

    def _word(self, word: str, what: str, dim: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(stable_seed(PROMPT_ENCODER_DRAW, what, word))
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


class _HashConditioner:
    """The hash encoder's prompts, each encoded once per process (:class:`PromptCache`,
    as a family's text encoders)."""

    def __init__(self, encoder: PromptEncoder, negative_prompt: str):
        self.encoder, self.negative_prompt = encoder, negative_prompt
        self.cache = PromptCache(self._encode_batch)

    def _encode_batch(self, prompts: list[str]) -> dict[str, torch.Tensor]:
        embeds, pooled = self.encoder.encode(prompts)
        return {"embeds": embeds, "pooled": pooled}

    def encode(self, prompts: Sequence[str], negative: bool, images=None,
               negatives: Sequence[str | None] | None = None) -> Conditioning:
        if images is not None:
            raise ValueError(f"the built-in model: expected no source images (it is not an "
                             f"editing pipeline), got {len(images)}")
        texts = negative_texts(self.negative_prompt, negatives, len(prompts))
        neg = self.cache(texts) if negative else None
        return Conditioning(tuple(prompts), self.cache(list(prompts)), neg, len(texts) > 1)


@lru_cache(maxsize=32)
def _sigmas(num_steps: int, shift: float, num_train_timesteps: int) -> tuple[float, ...]:
    sched = FlowMatchEulerDiscreteScheduler(num_train_timesteps=num_train_timesteps, shift=shift)
    sched.set_timesteps(num_steps)
    return tuple(float(s) for s in sched.sigmas)


class TinyFamily(ModelFamily):
    """The built-in SD3-shaped model (``model.path`` null, or a folder of parts only)."""

    parts = ("transformer", "vae")
    transformer_class_name = "SD3Transformer2DModel"
    vae_class_name = "AutoencoderKL"
    lora_targets = JOINT_ATTENTION_TARGETS

    def check_folder(self) -> None:
        from digenrl.config import ConfigError

        for sub in self.parts:
            if not (self.pipeline_folder / sub / "config.json").is_file():
                raise ConfigError(f"model.path: expected a diffusers pipeline folder with "
                                  f"{sub}/config.json, got {self.cfg.path!r}")

    def transformer_config(self) -> dict:
        cfg = self.cfg
        if self.folder is not None:
            return super().transformer_config()
        heads, dim = cfg.attention_heads, cfg.attention_head_dim
        return dict(
            sample_size=cfg.latent_size, patch_size=cfg.patch_size,
            in_channels=cfg.latent_channels, out_channels=cfg.latent_channels,
            num_layers=cfg.transformer_layers, attention_head_dim=dim,
            num_attention_heads=heads, joint_attention_dim=cfg.prompt_embed_dim,
            caption_projection_dim=heads * dim, pooled_projection_dim=cfg.pooled_embed_dim,
            pos_embed_max_size=cfg.latent_size,
        )

    def latent_shape(self) -> tuple[int, int, int]:
        tc = self.transformer_config()
        size = tc["sample_size"]
        return (tc["in_channels"], size, size)

    def num_train_timesteps(self) -> int:
        return 1000 if self.folder is None else super().num_train_timesteps()

    def sigmas(self, sampler: SamplerConfig) -> tuple[float, ...]:
        return _sigmas(sampler.num_steps, float(sampler.shift), self.num_train_timesteps())

    def timestep(self, sigma: float | torch.Tensor) -> float | torch.Tensor:
        return sigma * 1000.0

    def build_transformer(self, seed: int) -> torch.nn.Module:
        if self.folder is not None:
            model = self.transformer_class.from_pretrained(
                self.folder, subfolder="transformer", dtype=torch.float32)
        else:
            seeded(seed, "transformer")
            model = self.transformer_class(**self.transformer_config())
        return model.eval()

    def transformer_skeleton(self) -> torch.nn.Module:
        if self.folder is not None:
            return super().transformer_skeleton()
        with torch.device("meta"):
            return self.transformer_class(**self.transformer_config()).eval()

    def build_vae(self, seed: int) -> torch.nn.Module:
        cfg = self.cfg
        if self.folder is not None:
            vae = self.vae_class.from_pretrained(self.folder, subfolder="vae",
                                                 dtype=torch.float32)
        else:
            seeded(seed, "vae")
            n = len(cfg.vae_channels)
            vae = self.vae_class(
                in_channels=3, out_channels=3,
                down_block_types=("DownEncoderBlock2D",) * n,
                up_block_types=("UpDecoderBlock2D",) * n,
                block_out_channels=tuple(cfg.vae_channels),
                layers_per_block=cfg.vae_layers_per_block,
                latent_channels=cfg.latent_channels,
                norm_num_groups=min(32, min(cfg.vae_channels)),
                sample_size=cfg.image_size,
            )
        vae.requires_grad_(False)
        return vae.eval()

    def prompt_encoder(self) -> PromptEncoder:
        tc = self.transformer_config()
        return PromptEncoder(self.cfg.prompt_tokens, tc["joint_attention_dim"],
                             tc["pooled_projection_dim"])

    def build_encoder(self, device) -> _HashConditioner:
        if self.folder is not None:
            logger.warning("model.path %s has no model_index.json: prompts are encoded by "
                           "the built-in hash encoder, not by text encoders", self.cfg.path)
        return _HashConditioner(self.prompt_encoder(), self.cfg.negative_prompt)

    def predict_velocity(self, transformer, x, sigma, cond, guidance_scale):
        return sd3_velocity(transformer, x, self.timestep(sigma), cond, guidance_scale)

    def context_parallel_plan(self) -> dict:
        return sd3_context_parallel_plan()

    def parallel_attention(self, transformer):
        return parallel_joint_attention(transformer)

    def decode(self, vae, latents):
        return scaled_vae_decode(vae, latents)

