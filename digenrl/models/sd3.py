"""Stable Diffusion 3 / 3.5 (``StableDiffusion3Pipeline``): an MMDiT transformer
conditioned on CLIP-L and CLIP-G (penultimate hidden states and pooled projections)
and T5 (last hidden states), with classifier-free guidance against the negative prompt.
"""

from __future__ import annotations

from functools import cached_property

import torch

from digenrl.config import ConfigError, SamplerConfig
from digenrl.models.base import JOINT_ATTENTION_TARGETS, Conditioning, ModelFamily
from digenrl.models.common import (TextEncoders, guided, scaled_vae_decode, timesteps,
                                   vae_block_factor)

__all__ = ["SD3Family", "sd3_velocity"]

CLIP_PARTS = (("tokenizer", "text_encoder"), ("tokenizer_2", "text_encoder_2"))
T5_PARTS = ("tokenizer_3", "text_encoder_3")


def sd3_velocity(transformer, x: torch.Tensor, timestep: float | torch.Tensor, cond: Conditioning,
                 guidance_scale: float) -> torch.Tensor:
    """An SD3 transformer's velocity, with classifier-free guidance when
    ``guidance_scale > 1`` (negative and positive rows in one batch, as the pipeline);
    the built-in SD3-shaped model is called this way too."""
    embeds, pooled = cond.tensors["embeds"], cond.tensors["pooled"]
    t = timesteps(x, timestep)
    if guidance_scale > 1.0:
        assert cond.negative is not None, "guidance needs the negative prompt's encoding"
        ue, up = cond.negative["embeds"], cond.negative["pooled"]
        out = transformer(
            hidden_states=torch.cat([x, x]),
            encoder_hidden_states=torch.cat([ue.expand_as(embeds), embeds]),
            pooled_projections=torch.cat([up.expand_as(pooled), pooled]),
            timestep=torch.cat([t, t]),
            return_dict=False,
        )[0]
        v_uncond, v_cond = out.chunk(2)
        return guided(v_uncond, v_cond, guidance_scale)
    return transformer(hidden_states=x, encoder_hidden_states=embeds,
                       pooled_projections=pooled, timestep=t, return_dict=False)[0]


class _SD3Encoder(TextEncoders):
    def __init__(self, family: "SD3Family", device):
        super().__init__(family, device)
        self.clips = [(self.tokenizer(tok), self.text_encoder(enc)) for tok, enc in CLIP_PARTS]
        self.t5_tokenizer = self.tokenizer(T5_PARTS[0])
        self.t5 = self.text_encoder(T5_PARTS[1])

    def encode_batch(self, prompts: list[str]) -> dict[str, torch.Tensor]:
        seqs, pooled = [], []
        for tokenizer, encoder in self.clips:
            ids = tokenizer(prompts, padding="max_length", max_length=tokenizer.model_max_length,
                            truncation=True, return_tensors="pt").input_ids
            out = encoder(ids.to(self.device), output_hidden_states=True)
            pooled.append(out[0])
            seqs.append(out.hidden_states[-2])
        ids = self.t5_tokenizer(prompts, padding="max_length",
                                max_length=self.family.max_sequence_length, truncation=True,
                                add_special_tokens=True, return_tensors="pt").input_ids
        t5 = self.t5(ids.to(self.device))[0]
        clip = torch.cat(seqs, dim=-1)
        clip = torch.nn.functional.pad(clip, (0, t5.shape[-1] - clip.shape[-1]))
        return {"embeds": torch.cat([clip.to(t5.dtype), t5], dim=-2),
                "pooled": torch.cat(pooled, dim=-1)}


class SD3Family(ModelFamily):
    pipeline_class = "StableDiffusion3Pipeline"
    parts = ("transformer", "vae", "scheduler") + tuple(p for pair in CLIP_PARTS for p in pair) \
        + T5_PARTS
    default_max_sequence_length = 256
    tokenizer_parts = ((CLIP_PARTS[0][0], False), (CLIP_PARTS[1][0], False), (T5_PARTS[0], True))
    transformer_class_name = "SD3Transformer2DModel"
    vae_class_name = "AutoencoderKL"
    lora_targets = JOINT_ATTENTION_TARGETS

    @cached_property
    def vae_scale_factor(self) -> int:
        return vae_block_factor(self.vae_config())

    def image_size(self) -> tuple[int, int]:
        """(height, width) in pixels: the configured ones, else the pipeline's default."""
        default = self.transformer_config()["sample_size"] * self.vae_scale_factor
        return (self.cfg.height or default, self.cfg.width or default)

    def size_multiple(self) -> int:
        return self.vae_scale_factor * self.transformer_config()["patch_size"]

    def check_size(self) -> None:
        """The multiples, and the transformer's positional table: ``pos_embed_max_size``
        patches along each side."""
        super().check_size()
        table = self.transformer_config().get("pos_embed_max_size")
        if table is None:
            return
        for name, value in zip(("height", "width"), self.image_size()):
            if value > table * self.size_multiple():
                raise ConfigError(
                    f"model.{name}: expected at most {table * self.size_multiple()} pixels for "
                    f"this {self.pipeline_class} folder (its transformer's positional table: "
                    f"pos_embed_max_size {table} patches), got {value}")

    def latent_shape(self) -> tuple[int, int, int]:
        h, w = self.image_size()
        f = self.vae_scale_factor
        return (self.transformer_config()["in_channels"], h // f, w // f)

    def sigmas(self, sampler: SamplerConfig) -> tuple[float, ...]:
        sched = self.flow_scheduler(sampler)
        kwargs = {}
        if sched.config.get("use_dynamic_shifting"):
            from diffusers.pipelines.stable_diffusion_3.pipeline_stable_diffusion_3 import \
                calculate_shift

            _, h, w = self.latent_shape()
            p = self.transformer_config()["patch_size"]
            c = sched.config
            kwargs["mu"] = calculate_shift((h // p) * (w // p), c.get("base_image_seq_len", 256),
                                           c.get("max_image_seq_len", 4096),
                                           c.get("base_shift", 0.5), c.get("max_shift", 1.16))
        sched.set_timesteps(sampler.num_steps, **kwargs)
        return tuple(float(s) for s in sched.sigmas)

    def build_encoder(self, device) -> _SD3Encoder:
        return _SD3Encoder(self, device)

    def predict_velocity(self, transformer, x, sigma, cond, guidance_scale):
        return sd3_velocity(transformer, x, self.timestep(sigma), cond.to_dtype(x.dtype),
                            guidance_scale)

    def decode(self, vae, latents):
        return scaled_vae_decode(vae, latents)
