"""Wan2.1 text-to-video (``WanPipeline``): a 3D transformer on ``(channels, frames,
height, width)`` latents conditioned on UMT5 hidden states (zeroed past each prompt's
tokens), with classifier-free guidance against the negative prompt. The VAE decodes
latents de-normalised by its ``latents_mean`` / ``latents_std`` into frames.
"""

from __future__ import annotations

import html
import re

import torch

from digenrl.config import ConfigError
from digenrl.models.base import ModelFamily
from digenrl.models.common import TextEncoders, guided, normalized_vae_decode, timesteps
from digenrl.models.parts import read_json

__all__ = ["WanFamily", "clean_prompt"]


def clean_prompt(text: str) -> str:
    """WanPipeline's prompt cleaning: HTML entities unescaped, whitespace collapsed
    (and ``ftfy``'s text repair when it is installed, as there)."""
    try:
        import ftfy

        text = ftfy.fix_text(text)
    except ImportError:
        pass
    text = html.unescape(html.unescape(text)).strip()
    return re.sub(r"\s+", " ", text).strip()


class _WanEncoder(TextEncoders):
    def __init__(self, family: "WanFamily", device):
        super().__init__(family, device)
        self.umt5_tokenizer = self.tokenizer("tokenizer")
        self.umt5 = self.text_encoder("text_encoder")

    def encode_batch(self, prompts: list[str]) -> dict[str, torch.Tensor]:
        length = self.family.max_sequence_length
        texts = [self.family.prompt_text(p, "tokenizer") for p in prompts]
        inputs = self.umt5_tokenizer(texts, padding="max_length",
                                max_length=length, truncation=True, add_special_tokens=True,
                                return_attention_mask=True, return_tensors="pt")
        mask = inputs.attention_mask.to(self.device)
        hidden = self.umt5(inputs.input_ids.to(self.device), mask).last_hidden_state
        # Rows past each prompt's own tokens are zeros, as in the pipeline.
        return {"embeds": hidden * mask.gt(0).unsqueeze(-1).to(hidden.dtype)}


class WanFamily(ModelFamily):
    pipeline_class = "WanPipeline"
    parts = ("transformer", "vae", "scheduler", "tokenizer", "text_encoder")
    video = True
    transformer_class_name = "WanTransformer3DModel"
    block_lists = ("blocks",)
    vae_class_name = "AutoencoderKLWan"
    default_max_sequence_length = 512
    tokenizer_parts = (("tokenizer", True),)
    #: WanPipeline's defaults.
    default_height, default_width, default_frames = 480, 832, 81

    def check_folder(self) -> None:
        super().check_folder()
        index = read_json(self.pipeline_folder / "model_index.json")
        if index.get("transformer_2") not in (None, [None, None]) \
                or index.get("expand_timesteps"):
            raise ConfigError(f"model.path: expected a Wan2.1 folder (one transformer), got "
                              f"{str(self.cfg.path)!r} with transformer_2 or expand_timesteps "
                              f"(Wan2.2)")

    def video_size(self) -> tuple[int, int, int]:
        """(frames, height, width) in pixels."""
        return (self.cfg.num_frames or self.default_frames, self.cfg.height or self.default_height,
                self.cfg.width or self.default_width)

    def size_multiple(self) -> int:
        vc = self.vae_config()
        return vc.get("scale_factor_spatial", 8) * self.transformer_config()["patch_size"][-1]

    def check_size(self) -> None:
        """The multiples, and the transformer's rotary table: it holds
        ``rope_max_seq_len`` positions along each of frames, height and width (in latent
        patches), and a longer side does not fit it."""
        super().check_size()
        positions = self.transformer_config().get("rope_max_seq_len", 1024)
        patches = self.transformer_config()["patch_size"]
        _, frames, h, w = self.latent_shape()
        for name, latent, patch, default in (
                ("num_frames", frames, patches[0], self.default_frames),
                ("height", h, patches[1], self.default_height),
                ("width", w, patches[2], self.default_width)):
            if latent // patch > positions:
                value = getattr(self.cfg, name)
                got = value if value is not None else f"null (the pipeline's default {default})"
                most = self.most(name, positions * patch)
                raise ConfigError(
                    f"model.{name}: expected at most {most} for this {self.pipeline_class} "
                    f"folder (its transformer's rotary table: rope_max_seq_len {positions} "
                    f"patches), got {got}")

    def most(self, name: str, latent: int) -> int:
        """The most frames or pixels of ``latent`` latent frames or pixels."""
        vc = self.vae_config()
        if name == "num_frames":
            return (latent - 1) * vc.get("scale_factor_temporal", 4) + 1
        return latent * vc.get("scale_factor_spatial", 8)

    def latent_shape(self) -> tuple[int, int, int, int]:
        vc = self.vae_config()
        frames, h, w = self.video_size()
        tf, sf = vc.get("scale_factor_temporal", 4), vc.get("scale_factor_spatial", 8)
        return (self.transformer_config()["in_channels"], (frames - 1) // tf + 1, h // sf, w // sf)

    # sigmas: the base's flow-matching Euler schedule with sampler.shift (a folder whose
    # scheduler is UniPC keeps its training timesteps only: the SDE sampler steps by Euler).

    def prompt_text(self, prompt: str, part: str) -> str:
        return clean_prompt(prompt)

    def build_encoder(self, device) -> _WanEncoder:
        return _WanEncoder(self, device)

    def predict_velocity(self, transformer, x, sigma, cond, guidance_scale):
        cond = cond.to_dtype(x.dtype)
        t = timesteps(x, self.timestep(sigma))
        embeds = cond.tensors["embeds"]
        v = transformer(hidden_states=x, timestep=t, encoder_hidden_states=embeds,
                        return_dict=False)[0]
        if guidance_scale > 1.0:
            assert cond.negative is not None, "guidance needs the negative prompt's encoding"
            neg = cond.negative["embeds"].expand_as(embeds)
            v_uncond = transformer(hidden_states=x, timestep=t, encoder_hidden_states=neg,
                                   return_dict=False)[0]
            v = guided(v_uncond, v, guidance_scale)
        return v

    def context_parallel_plan(self) -> dict:
        """Diffusers' own plan for the transformer class."""
        return self.transformer_class._cp_plan

    def decode(self, vae, latents):
        return normalized_vae_decode(vae, latents)
