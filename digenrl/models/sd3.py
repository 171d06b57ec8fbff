"""Stable Diffusion 3 / 3.5 (``StableDiffusion3Pipeline``): an MMDiT transformer
conditioned on CLIP-L and CLIP-G (penultimate hidden states and pooled projections)
and T5 (last hidden states), with classifier-free guidance against the negative prompt.
"""

from __future__ import annotations

from contextlib import contextmanager
from functools import cached_property
from typing import Any, Iterator

import torch

from digenrl.config import ConfigError, SamplerConfig
from digenrl.models.base import JOINT_ATTENTION_TARGETS, Conditioning, ModelFamily
from digenrl.models.common import (TextEncoders, guided, scaled_vae_decode, timesteps,
                                   vae_block_factor)

__all__ = ["SD3Family", "sd3_velocity", "sd3_context_parallel_plan", "JointAttnParallelProcessor",
           "parallel_joint_attention"]

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


def sd3_context_parallel_plan() -> dict:
    """How context parallelism splits an SD3 transformer (diffusers has no plan for it),
    as diffusers' FLUX plan splits FLUX's: the image's tokens (as the patch embedding
    gives them, their positions added) and the prompt's (as their projection gives
    them) split along the token axis, each block on its share, and the last
    projection's output gathered before the image is unpatched. Attention needs
    :class:`JointAttnParallelProcessor` (:func:`parallel_joint_attention`)."""
    from diffusers.models._modeling_parallel import ContextParallelInput, ContextParallelOutput

    # (Split as the embeddings' outputs: the last block's text output is None, which a
    # split hook on a block's inputs would refuse to pass through.)
    tokens = {0: ContextParallelInput(split_dim=1, expected_dims=3, split_output=True)}
    return {"pos_embed": tokens, "context_embedder": tokens,
            "proj_out": ContextParallelOutput(gather_dim=1, expected_dims=3)}


class JointAttnParallelProcessor:
    """diffusers' ``JointAttnProcessor2_0`` (SD3's joint attention over the image's and
    the prompt's tokens; SD3.5's image-only second attention) computed through diffusers'
    attention dispatcher, which splits it over the processes of a context-parallel step
    (Ulysses: each attends over every token with its share of the heads). The same
    projections, norms and output split; the attention's inputs laid out (batch, tokens,
    heads, head dim) as the dispatcher takes them."""

    _attention_backend = None
    _parallel_config = None

    def __call__(self, attn: Any, hidden_states: torch.Tensor,
                 encoder_hidden_states: torch.Tensor | None = None,
                 attention_mask: torch.Tensor | None = None, *args, **kwargs):
        from diffusers.models.attention_dispatch import dispatch_attention_fn

        def heads(x: torch.Tensor) -> torch.Tensor:
            return x.unflatten(-1, (attn.heads, -1))

        image = hidden_states.shape[1]
        query = heads(attn.to_q(hidden_states))
        key = heads(attn.to_k(hidden_states))
        value = heads(attn.to_v(hidden_states))
        if attn.norm_q is not None:
            query = attn.norm_q(query)
        if attn.norm_k is not None:
            key = attn.norm_k(key)
        if encoder_hidden_states is not None:
            e = encoder_hidden_states
            c_query, c_key = heads(attn.add_q_proj(e)), heads(attn.add_k_proj(e))
            c_value = heads(attn.add_v_proj(e))
            if attn.norm_added_q is not None:
                c_query = attn.norm_added_q(c_query)
            if attn.norm_added_k is not None:
                c_key = attn.norm_added_k(c_key)
            query = torch.cat([query, c_query], dim=1)
            key = torch.cat([key, c_key], dim=1)
            value = torch.cat([value, c_value], dim=1)
        out = dispatch_attention_fn(query, key, value, dropout_p=0.0, is_causal=False,
                                    backend=self._attention_backend,
                                    parallel_config=self._parallel_config)
        out = out.flatten(2, 3).to(query.dtype)
        context = None
        if encoder_hidden_states is not None:
            out, context = out[:, :image], out[:, image:]
            if not attn.context_pre_only:
                context = attn.to_add_out(context)
        out = attn.to_out[1](attn.to_out[0](out))
        return out if context is None else (out, context)


@contextmanager
def parallel_joint_attention(transformer: Any) -> Iterator[Any]:
    """An SD3 transformer whose attention layers compute through
    :class:`JointAttnParallelProcessor` inside the block, and through their own
    processors again after it."""
    before = transformer.attn_processors
    transformer.set_attn_processor(JointAttnParallelProcessor())
    try:
        yield transformer
    finally:
        transformer.set_attn_processor(before)


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

    def context_parallel_plan(self) -> dict:
        return sd3_context_parallel_plan()

    def parallel_attention(self, transformer):
        return parallel_joint_attention(transformer)

    def decode(self, vae, latents):
        return scaled_vae_decode(vae, latents)
