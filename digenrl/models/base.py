"""What every model family answers, and what its prompt conditioning looks like.

A family adapts one kind of diffusers pipeline to the sampler: it loads (or builds) the
trained transformer and the VAE, encodes prompts with its own text encoders into the
tensors its transformer takes, predicts the velocity at a noise level (with
classifier-free guidance or a guidance embedding, as the family does), gives the latent
shape and the sigma schedule, and decodes latents to pixels. What several families
compute the same way (text-encoder loading and caching, guidance, VAE decoding, latent
packing) is in :mod:`digenrl.models.common`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Sequence

import numpy as np
import torch
from diffusers import FlowMatchEulerDiscreteScheduler

from digenrl.config import ConfigError, ModelConfig, SamplerConfig
from digenrl.models.parts import check_tokens, load_tokenizer, read_json

__all__ = ["Conditioning", "ModelFamily", "PromptCache", "PromptEncoderLike", "to_uint8",
           "JOINT_ATTENTION_TARGETS"]


#: LoRA targets of an MMDiT (SD3, FLUX): the joint attention's image and text projections.
JOINT_ATTENTION_TARGETS = ("to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj",
                           "add_v_proj", "to_add_out")


@dataclass
class Conditioning:
    """The encoded prompts of a chunk, one row per sample, and the negative prompt's
    (one row, for classifier-free guidance; None when the family does not use it).

    Plain tensors on the CPU: it travels as Dask data from the rollout worker that
    encoded it, with the chunk's latents, to every task that needs it."""

    prompts: tuple[str, ...]
    tensors: dict[str, torch.Tensor]
    negative: dict[str, torch.Tensor] | None = None

    def _map(self, fn) -> "Conditioning":
        """The same prompts with ``fn`` applied to every tensor."""
        def each(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
            return {k: fn(v) for k, v in tensors.items()}

        return Conditioning(self.prompts, each(self.tensors),
                            None if self.negative is None else each(self.negative))

    def to(self, device) -> "Conditioning":
        return self._map(lambda t: t.to(device))

    def to_dtype(self, dtype: torch.dtype) -> "Conditioning":
        """The floating-point tensors in ``dtype`` (the transformer's)."""
        return self._map(lambda t: t.to(dtype) if t.is_floating_point() else t)

    @property
    def nbytes(self) -> int:
        parts = list(self.tensors.values()) + list((self.negative or {}).values())
        return sum(t.numel() * t.element_size() for t in parts)


class PromptCache:
    """Encodes prompts through ``encode_batch`` once each and stacks the cached rows."""

    def __init__(self, encode_batch):
        self._encode_batch = encode_batch
        self._cache: dict[str, dict[str, torch.Tensor]] = {}

    def __call__(self, prompts: Sequence[str]) -> dict[str, torch.Tensor]:
        new = list(dict.fromkeys(p for p in prompts if p not in self._cache))
        if new:
            with torch.no_grad():
                rows = self._encode_batch(new)
            for i, p in enumerate(new):
                self._cache[p] = {k: v[i].detach().cpu() for k, v in rows.items()}
        names = self._cache[prompts[0]].keys()
        return {k: torch.stack([self._cache[p][k] for p in prompts]) for k in names}

    def __len__(self) -> int:
        return len(self._cache)


def to_uint8(pixels: torch.Tensor) -> np.ndarray:
    """Decoded pixels in [-1, 1], channels second, to uint8 with channels last:
    ``(n, 3, H, W)`` -> ``(n, H, W, 3)``; ``(n, 3, F, H, W)`` -> ``(n, F, H, W, 3)``."""
    x = ((pixels.clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)
    order = (0, 2, 3, 1) if x.ndim == 4 else (0, 2, 3, 4, 1)
    return x.permute(*order).contiguous().cpu().numpy()


class ModelFamily:
    """One kind of pipeline. Subclasses set the class attributes and override the
    methods that raise NotImplementedError; see ``docs/howto.md`` for adding one."""

    #: ``_class_name`` in the folder's ``model_index.json`` (None: the built-in model).
    pipeline_class: ClassVar[str | None] = None
    #: Subfolders the pipeline folder must hold (each with a config or tokenizer files).
    parts: ClassVar[tuple[str, ...]] = ("transformer", "vae", "scheduler")
    #: True when a sample is a video (frames x height x width x 3).
    video: ClassVar[bool] = False
    #: The pipeline's own default for the text encoder's sequence length.
    default_max_sequence_length: ClassVar[int] = 256
    #: The folder's tokenizers as ``(subfolder, bounded)``; ``bounded``: its encoding is
    #: ``model.max_sequence_length`` tokens long (the T5 / UMT5 / LLM one), so a longer
    #: prompt is refused. :meth:`check_prompts` tokenizes every prompt with each.
    tokenizer_parts: ClassVar[tuple[tuple[str, bool], ...]] = ()
    #: The diffusers classes of the trained transformer and of the VAE.
    transformer_class: ClassVar[type]
    vae_class: ClassVar[type]
    #: Modules that get LoRA adapters when ``train.lora_targets`` is empty: the
    #: attention projections (as peft matches names: full name or last dotted parts).
    lora_targets: ClassVar[tuple[str, ...]] = ("to_q", "to_k", "to_v", "to_out.0")

    def __init__(self, cfg: ModelConfig):
        self.cfg = cfg
        self.folder = Path(cfg.path).expanduser() if cfg.path is not None else None

    # ------------------------------------------------------------ checks (no weights)

    def check_folder(self) -> None:
        """Every part the family loads is in the folder (config validation calls this)."""
        for part in self.parts:
            sub = self.folder / part
            if not sub.is_dir() or not any(sub.iterdir()):
                raise ConfigError(
                    f"model.path: expected a {self.pipeline_class} folder with {part}/, got "
                    f"{str(self.cfg.path)!r} without it")

    def check_size(self) -> None:
        """``model.height`` / ``model.width`` are multiples of :meth:`size_multiple`."""
        m = self.size_multiple()
        for name in ("height", "width"):
            v = getattr(self.cfg, name)
            if v is not None and v % m:
                raise ConfigError(f"model.{name}: expected a multiple of {m} for this "
                                  f"{self.pipeline_class} folder (VAE factor x patch), got {v}")

    def size_multiple(self) -> int:
        """Pixels per latent patch: heights and widths must be multiples of it."""
        return 1

    def check_prompts(self, named: Sequence[tuple[str, str]]) -> None:
        """Each ``(field, prompt)`` can be tokenized as the family encodes it (as
        :meth:`prompt_text`, by each of :attr:`tokenizer_parts`); a prompt that cannot
        fails naming its field (config validation calls this)."""
        texts = [(field, self.prompt_text(prompt)) for field, prompt in named]
        for part, bounded in self.tokenizer_parts:
            check_tokens(load_tokenizer(self.folder, part), part, texts,
                         self.max_sequence_length if bounded else None)

    def prompt_text(self, prompt: str) -> str:
        """The text the tokenizers see for ``prompt`` (a pipeline that cleans prompts
        first overrides this, and its encoder calls it)."""
        return prompt

    # ---------------------------------------------------------------- shapes, schedule

    @property
    def max_sequence_length(self) -> int:
        return self.cfg.max_sequence_length or self.default_max_sequence_length

    def transformer_config(self) -> dict:
        return read_json(self.folder / "transformer" / "config.json")

    def vae_config(self) -> dict:
        return read_json(self.folder / "vae" / "config.json")

    def latent_shape(self) -> tuple[int, ...]:
        """The shape of one sample's latent as the sampler holds it."""
        raise NotImplementedError

    def scheduler_config(self) -> dict:
        f = self.folder / "scheduler" / "scheduler_config.json"
        return read_json(f) if f.is_file() else {}

    def num_train_timesteps(self) -> int:
        return int(self.scheduler_config().get("num_train_timesteps", 1000))

    def flow_scheduler(self, sampler: SamplerConfig) -> FlowMatchEulerDiscreteScheduler:
        """The folder's flow-matching scheduler with ``sampler.shift`` (a folder whose
        scheduler is of another class contributes its training timesteps)."""
        conf = self.scheduler_config()
        if conf.get("_class_name") == FlowMatchEulerDiscreteScheduler.__name__:
            return FlowMatchEulerDiscreteScheduler.from_config(conf, shift=float(sampler.shift))
        return FlowMatchEulerDiscreteScheduler(num_train_timesteps=self.num_train_timesteps(),
                                               shift=float(sampler.shift))

    def sigmas(self, sampler: SamplerConfig) -> tuple[float, ...]:
        """``num_steps + 1`` noise levels from 1 to 0, as the family's pipeline sets them:
        here the flow-matching Euler schedule with ``sampler.shift`` over the folder's
        training timesteps (a family whose pipeline shifts by the image's length, or sets
        its own sigmas, overrides this)."""
        sched = self.flow_scheduler(sampler)
        sched.set_timesteps(sampler.num_steps)
        return tuple(float(s) for s in sched.sigmas)

    def timestep(self, sigma: float) -> float:
        """The transformer's timestep input at noise level ``sigma``."""
        return sigma * self.num_train_timesteps()

    # --------------------------------------------------------------------- the parts

    def build_transformer(self, seed: int) -> torch.nn.Module:
        """The trainable velocity model, float32, with the initial (version 0) weights:
        the folder's ``transformer/``."""
        return self.transformer_class.from_pretrained(
            self.folder, subfolder="transformer", dtype=torch.float32).eval()

    def build_vae(self, seed: int) -> torch.nn.Module:
        """The folder's ``vae/``, frozen."""
        vae = self.vae_class.from_pretrained(self.folder, subfolder="vae", dtype=torch.float32)
        return vae.requires_grad_(False).eval()

    def build_encoder(self, device: torch.device) -> "PromptEncoderLike":
        """An object whose ``encode(prompts, negative) -> Conditioning`` runs the text
        encoders on ``device`` (``negative``: also encode ``model.negative_prompt``); a
        family's is a :class:`~digenrl.models.common.TextEncoders`."""
        raise NotImplementedError

    # ------------------------------------------------------------------ computation

    def predict_velocity(self, transformer: torch.nn.Module, x: torch.Tensor, sigma: float,
                         cond: Conditioning, guidance_scale: float) -> torch.Tensor:
        raise NotImplementedError

    def decode(self, vae: torch.nn.Module, latents: torch.Tensor) -> torch.Tensor:
        """Latents to pixels in [-1, 1] (not yet clamped), channels second."""
        raise NotImplementedError


class PromptEncoderLike:
    """The interface :meth:`ModelFamily.build_encoder` returns (documentation only)."""

    def encode(self, prompts: Sequence[str], negative: bool) -> Conditioning:  # pragma: no cover
        raise NotImplementedError
