"""HunyuanVideo text-to-video (``HunyuanVideoPipeline``): a 3D transformer on
``(channels, frames, height, width)`` latents conditioned on the LLaVA-Llama-3 text
encoder (its hidden states two layers before the last, over the prompt put in the
pipeline's template, with the template's prefix cropped and a mask over the padding)
and on CLIP-L's pooled output, with guidance as an embedding (guidance-distilled: no
negative prompt). The VAE decodes latents divided by its scaling factor into frames.
"""

from __future__ import annotations

from functools import cached_property

import numpy as np
import torch

from digenrl.config import SamplerConfig
from digenrl.models.base import JOINT_ATTENTION_TARGETS, ModelFamily
from digenrl.models.common import TextEncoders, scaled_vae_decode, timesteps

__all__ = ["HunyuanVideoFamily", "prompt_template", "CLIP_LENGTH", "HIDDEN_LAYERS_SKIPPED"]


def prompt_template() -> dict:
    """The pipeline's prompt template and the tokens of its prefix it crops (imported
    when first asked for: the pipeline's module imports diffusers' model packages)."""
    from diffusers.pipelines.hunyuan_video.pipeline_hunyuan_video import \
        DEFAULT_PROMPT_TEMPLATE

    return DEFAULT_PROMPT_TEMPLATE


#: Tokens of the CLIP encoding (the pipeline's ``_get_clip_prompt_embeds``).
CLIP_LENGTH = 77
#: Layers before the last whose hidden states the pipeline takes from the Llama encoder.
HIDDEN_LAYERS_SKIPPED = 2


class _HunyuanEncoder(TextEncoders):
    def __init__(self, family: "HunyuanVideoFamily", device):
        super().__init__(family, device)
        self.llama_tokenizer = self.tokenizer("tokenizer")
        self.llama = self.text_encoder("text_encoder")
        self.clip_tokenizer = self.tokenizer("tokenizer_2")
        self.clip = self.text_encoder("text_encoder_2")

    def encode_batch(self, prompts: list[str]) -> dict[str, torch.Tensor]:
        f = self.family
        crop = f.dropped_tokens
        inputs = self.llama_tokenizer([f.prompt_text(p, "tokenizer") for p in prompts],
                                      max_length=f.max_sequence_length + crop,
                                      padding="max_length", truncation=True,
                                      return_attention_mask=True, return_tensors="pt")
        mask = inputs.attention_mask.to(self.device)
        hidden = self.llama(input_ids=inputs.input_ids.to(self.device), attention_mask=mask,
                            output_hidden_states=True
                            ).hidden_states[-(HIDDEN_LAYERS_SKIPPED + 1)]
        ids = self.clip_tokenizer(prompts, padding="max_length", max_length=CLIP_LENGTH,
                                  truncation=True, return_tensors="pt").input_ids
        pooled = self.clip(ids.to(self.device), output_hidden_states=False).pooler_output
        # The pipeline passes the mask in the transformer's dtype: a float here.
        return {"embeds": hidden[:, crop:], "mask": mask[:, crop:].float(), "pooled": pooled}


class HunyuanVideoFamily(ModelFamily):
    pipeline_class = "HunyuanVideoPipeline"
    # Guidance-distilled: the guidance embedding, no negative prompt.
    uses_negative_prompt = False
    parts = ("transformer", "vae", "scheduler", "tokenizer", "text_encoder", "tokenizer_2",
             "text_encoder_2")
    video = True
    default_max_sequence_length = 256
    tokenizer_parts = (("tokenizer", True), ("tokenizer_2", False))
    transformer_class_name = "HunyuanVideoTransformer3DModel"
    block_lists = ("transformer_blocks", "single_transformer_blocks")
    vae_class_name = "AutoencoderKLHunyuanVideo"
    lora_targets = JOINT_ATTENTION_TARGETS
    #: HunyuanVideoPipeline's defaults.
    default_height, default_width, default_frames = 720, 1280, 129

    @property
    def dropped_tokens(self) -> int:
        return prompt_template()["crop_start"]

    def prompt_text(self, prompt: str, part: str) -> str:
        """The Llama tokenizer sees the prompt in the template; CLIP's, the prompt."""
        return prompt_template()["template"].format(prompt) if part == "tokenizer" else prompt

    @cached_property
    def factors(self) -> tuple[int, int]:
        """The VAE's (temporal, spatial) compression."""
        vc = self.vae_config()
        return vc.get("temporal_compression_ratio", 4), vc.get("spatial_compression_ratio", 8)

    def video_size(self) -> tuple[int, int, int]:
        """(frames, height, width) in pixels."""
        return (self.cfg.num_frames or self.default_frames, self.cfg.height or self.default_height,
                self.cfg.width or self.default_width)

    def size_multiple(self) -> int:
        return self.factors[1] * self.transformer_config()["patch_size"]

    def latent_shape(self) -> tuple[int, int, int, int]:
        frames, h, w = self.video_size()
        tf, sf = self.factors
        return (self.transformer_config()["in_channels"], (frames - 1) // tf + 1, h // sf, w // sf)

    def sigmas(self, sampler: SamplerConfig) -> tuple[float, ...]:
        """As the pipeline: ``linspace(1, 0, n + 1)`` without its last, shifted by
        ``sampler.shift`` (HunyuanVideo's scheduler: 7), then 0."""
        sched = self.flow_scheduler(sampler)
        sched.set_timesteps(sigmas=np.linspace(1.0, 0.0, sampler.num_steps + 1)[:-1])
        return tuple(float(s) for s in sched.sigmas)

    def build_encoder(self, device) -> _HunyuanEncoder:
        return _HunyuanEncoder(self, device)

    def predict_velocity(self, transformer, x, sigma, cond, guidance_scale):
        cond = cond.to_dtype(x.dtype)
        n = x.shape[0]
        guidance = torch.tensor([guidance_scale] * n, dtype=x.dtype, device=x.device) * 1000.0
        return transformer(hidden_states=x, timestep=timesteps(x, self.timestep(sigma)),
                           encoder_hidden_states=cond.tensors["embeds"],
                           encoder_attention_mask=cond.tensors["mask"],
                           pooled_projections=cond.tensors["pooled"], guidance=guidance,
                           return_dict=False)[0]

    def decode(self, vae, latents):
        return scaled_vae_decode(vae, latents)
