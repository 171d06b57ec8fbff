"""What every model family answers, and what its prompt conditioning looks like.

A family adapts one kind of diffusers pipeline to the sampler: it loads (or builds) the
trained transformer and the VAE, encodes prompts with its own text encoders into the
tensors its transformer takes (an instruction-editing family: with each prompt's source
image), predicts the velocity at a noise level (with classifier-free guidance or a
guidance embedding, as the family does), gives the latent shape and the sigma schedule,
and decodes latents to pixels. What several families compute the same way (text-encoder
loading and caching, guidance, VAE encoding and decoding, latent packing) is in
:mod:`digenrl.models.common`.
"""

from __future__ import annotations

import hashlib
import math
from collections import OrderedDict
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Protocol, Sequence

import numpy as np
import torch
from diffusers import FlowMatchEulerDiscreteScheduler

from digenrl.checks import require
from digenrl.config import CONTEXT_PARALLEL_FIELD, ConfigError, ModelConfig, SamplerConfig
from digenrl.models.parts import check_tokens, load_tokenizer, read_json

__all__ = ["Conditioning", "ModelFamily", "PromptCache", "PROMPT_CACHE_BYTES",
           "PromptEncoderLike", "SourceImage", "area_size", "stack_rows", "to_uint8",
           "JOINT_ATTENTION_TARGETS", "diffusers_class"]


#: LoRA targets of an MMDiT (SD3, FLUX): the joint attention's image and text projections.
JOINT_ATTENTION_TARGETS = ("to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj",
                           "add_v_proj", "to_add_out")


@dataclass
class Conditioning:
    """The encoded prompts of a chunk, one row per sample, and the negative prompt's
    (for classifier-free guidance; None when the family does not use it): one row, or
    one per sample where the negative's encoding depends on each sample's source image
    (Qwen-Image-Edit). An editing family's ``tensors`` also hold each sample's source
    image as the transformer takes it (its packed VAE latents).

    Plain tensors on the CPU: it travels as Dask data from the rollout worker that
    encoded it, with the chunk's latents, to every task that needs it."""

    prompts: tuple[str, ...]
    tensors: dict[str, torch.Tensor]
    negative: dict[str, torch.Tensor] | None = None
    #: The negative has a row per sample (encoded with each sample's source image), not
    #: one row every sample shares.
    negative_per_sample: bool = False

    @classmethod
    def of_groups(cls, groups: Sequence["Conditioning"], picks: Sequence[int]
                  ) -> "Conditioning":
        """A chunk's conditioning from its prompt groups' (each of one prompt, as an
        ``encode`` task makes it): sample ``k`` takes the row of ``groups[picks[k]]``.
        The rows are stacked as :class:`PromptCache` stacks them (:func:`stack_rows`), so
        the chunk's tensors are those of encoding its prompts together, row for row. The
        negative is the groups' one row where they share it, else a row per sample."""
        first = groups[0]

        def gather(part) -> dict[str, torch.Tensor]:
            return {k: stack_rows([part(groups[j])[k][0] for j in picks])
                    for k in part(first)}

        negative, per_sample = None, False
        if first.negative is not None:
            per_sample = not _one_negative(groups)
            negative = gather(lambda g: g.negative) if per_sample else first.negative
        return cls(tuple(groups[j].prompts[0] for j in picks), gather(lambda g: g.tensors),
                   negative, per_sample)

    def _map(self, fn) -> "Conditioning":
        """The same prompts with ``fn`` applied to every tensor."""
        def each(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
            return {k: fn(v) for k, v in tensors.items()}

        return Conditioning(self.prompts, each(self.tensors),
                            None if self.negative is None else each(self.negative),
                            self.negative_per_sample)

    def to(self, device) -> "Conditioning":
        return self._map(lambda t: t.to(device))

    def rows(self, index: torch.Tensor) -> "Conditioning":
        """The conditioning of the samples ``index`` selects (a negative of one row per
        sample too; one of a single row is shared)."""
        n = len(self.prompts)
        tensors = {k: v[index] if v.shape[0] == n else v for k, v in self.tensors.items()}
        negative = self.negative
        if negative is not None and self.negative_per_sample:
            negative = {k: v[index] for k, v in negative.items()}
        return Conditioning(tuple(self.prompts[i] for i in index.tolist()), tensors,
                            negative, self.negative_per_sample)

    @classmethod
    def concat(cls, parts: Sequence["Conditioning"]) -> "Conditioning":
        """The conditioning of the samples of ``parts`` in order (rows of different
        lengths zero-padded to the longest, as :func:`stack_rows` pads them); their
        negative encodings: the shared row where every part has the same one, else a row
        per sample."""
        def cat(tensors: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
            return {k: _cat_padded([t[k] for t in tensors]) for k in tensors[0]}

        prompts = tuple(p for c in parts for p in c.prompts)
        first = parts[0].negative
        negative, per_sample = None, False
        if first is not None:
            per_sample = not _one_negative(parts)
            negative = (cat([c.negative_rows() for c in parts]) if per_sample else first)
        return cls(prompts, cat([c.tensors for c in parts]), negative, per_sample)

    def negative_rows(self) -> dict[str, torch.Tensor]:
        """The negative encoding with a row per sample (a shared row repeated)."""
        n = len(self.prompts)
        negative = self.negative
        assert negative is not None     # (asked only of a conditioning with one)
        return {k: v if self.negative_per_sample else v.expand(n, *v.shape[1:])
                for k, v in negative.items()}

    def to_dtype(self, dtype: torch.dtype) -> "Conditioning":
        """The floating-point tensors in ``dtype`` (the transformer's)."""
        return self._map(lambda t: t.to(dtype) if t.is_floating_point() else t)

    @property
    def nbytes(self) -> int:
        parts = list(self.tensors.values()) + list((self.negative or {}).values())
        return sum(t.numel() * t.element_size() for t in parts)


@dataclass(frozen=True, eq=False)
class SourceImage:
    """A source image of an instruction-editing prompt: uint8 pixels ``(height, width,
    3)``, equal to another (and cached) by their content."""

    pixels: np.ndarray = field(repr=False)
    digest: str

    @classmethod
    def of(cls, pixels) -> "SourceImage":
        a = np.asarray(pixels)
        if a.dtype != np.uint8 or a.ndim != 3 or a.shape[-1] != 3 or 0 in a.shape:
            raise ValueError(f"source image: expected uint8 pixels (height, width, 3), got "
                             f"{a.dtype} of shape {a.shape}")
        a = np.ascontiguousarray(a)
        digest = hashlib.sha256(repr(a.shape).encode() + a.tobytes()).hexdigest()
        return cls(a, digest)

    def pil(self):
        """The image as PIL holds it (what the pipelines resize)."""
        from PIL import Image

        return Image.fromarray(self.pixels)

    def __eq__(self, other) -> bool:
        return isinstance(other, SourceImage) and other.digest == self.digest

    def __hash__(self) -> int:
        return hash(self.digest)


def stack_rows(rows: Sequence[torch.Tensor]) -> torch.Tensor:
    """One tensor of ``rows``; rows of different lengths (their first axis: a language
    model's embeddings of prompts of different lengths, their masks, a source image's
    tokens) are padded with zeros to the longest, as the pipelines pad a batch (a mask
    padded with zeros masks the padding)."""
    if all(r.shape == rows[0].shape for r in rows):
        return torch.stack(list(rows))
    longest = max(r.shape[0] for r in rows)
    return torch.stack([torch.cat([r, r.new_zeros((longest - r.shape[0],) + r.shape[1:])])
                        for r in rows])


#: The most bytes of encodings a :class:`PromptCache` keeps (per cache, per process):
#: past it the least recently used are dropped and encoded again when next asked for.
PROMPT_CACHE_BYTES = 1 << 30


def _one_negative(parts: Sequence[Conditioning]) -> bool:
    """Whether ``parts`` (each with a negative encoding) share one negative row: none has
    a row per sample and all are the same tensors."""
    first = parts[0].negative
    return not any(c.negative_per_sample or not _same(c.negative, first) for c in parts)


def _same(a: dict[str, torch.Tensor] | None, b: dict[str, torch.Tensor] | None) -> bool:
    """Whether two encodings are the same tensors (or both none)."""
    if a is None or b is None:
        return a is b
    return a.keys() == b.keys() and all(
        a[k].shape == b[k].shape and torch.equal(a[k], b[k]) for k in a)


def _nbytes(row: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in row.values())


def _cat_padded(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """``torch.cat`` of ``parts`` along the rows; parts whose second axis differs (a
    chunk's longest prompt, or source image, sets it) padded with zeros to the longest."""
    if all(p.shape[1:] == parts[0].shape[1:] for p in parts):
        return torch.cat(list(parts))
    longest = max(p.shape[1] for p in parts)
    return torch.cat([torch.cat([p, p.new_zeros((p.shape[0], longest - p.shape[1])
                                                + tuple(p.shape[2:]))], dim=1)
                      for p in parts])


class PromptCache:
    """Encodes each key (a prompt; a prompt with its source image; a source image)
    through ``encode_batch`` once and stacks the cached rows (:func:`stack_rows`).

    A least-recently-used cache of at most ``max_bytes`` of rows (one key's rows are
    kept whatever their size); ``encoded`` counts the keys ``encode_batch`` was asked
    for, so a key asked for again while cached costs nothing and counts nothing."""

    def __init__(self, encode_batch, max_bytes: int = PROMPT_CACHE_BYTES):
        self._encode_batch = encode_batch
        self._cache: OrderedDict = OrderedDict()
        self.max_bytes = max_bytes
        self.nbytes = 0
        self.encoded = 0

    def __call__(self, keys: Sequence) -> dict[str, torch.Tensor]:
        cache = self._cache
        new = list(dict.fromkeys(k for k in keys if k not in cache))
        if new:
            with torch.no_grad():
                rows = self._encode_batch(new)
            self.encoded += len(new)
            for i, key in enumerate(new):
                cache[key] = row = {k: v[i].detach().cpu() for k, v in rows.items()}
                self.nbytes += _nbytes(row)
        found = [cache[key] for key in keys]
        for key in keys:
            cache.move_to_end(key)
        while self.nbytes > self.max_bytes and len(cache) > 1:
            _, row = cache.popitem(last=False)
            self.nbytes -= _nbytes(row)
        return {k: stack_rows([row[k] for row in found]) for k in found[0]}

    def __len__(self) -> int:
        return len(self._cache)


def diffusers_class(name: str) -> type[Any]:
    """The diffusers class ``name`` (``"SD3Transformer2DModel"``), imported now: diffusers
    imports a model's package only when it is first asked for."""
    import diffusers

    return getattr(diffusers, name)


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
    #: True for an instruction-editing family: its encoder takes each prompt's source
    #: image (``encode(prompts, negative, images=...)``) and its transformer sees it.
    takes_images: ClassVar[bool] = False
    #: True when it cannot sample without a source image (Qwen-Image-Edit; FLUX.1
    #: Kontext generates from the prompt alone when it has none).
    needs_images: ClassVar[bool] = False
    #: How many source images a prompt may carry (its pipeline's ``image`` takes that
    #: many): 0 for a family that edits none.
    max_source_images: ClassVar[int] = 0
    #: True when its guidance is classifier-free guidance against a negative prompt
    #: (False: a guidance-distilled model, whose guidance is an embedding).
    uses_negative_prompt: ClassVar[bool] = True
    #: The diffusers classes of the trained transformer and of the VAE, by name: a
    #: family's module imports no diffusers model (diffusers' model packages import
    #: each other, about 3 CPU-seconds), so a driver or scheduler that only asks a
    #: family for its shapes and schedule never imports them.
    transformer_class_name: ClassVar[str]
    vae_class_name: ClassVar[str]
    #: Modules that get LoRA adapters when ``train.lora_targets`` is empty: the
    #: attention projections (as peft matches names: full name or last dotted parts).
    lora_targets: ClassVar[tuple[str, ...]] = ("to_q", "to_k", "to_v", "to_out.0")
    #: The transformer's attributes holding its blocks (each a ``ModuleList``): the units
    #: a sharded trainer gathers one at a time (:mod:`digenrl.tasks.sharding`).
    block_lists: ClassVar[tuple[str, ...]] = ("transformer_blocks",)

    def __init__(self, cfg: ModelConfig):
        self.cfg = cfg
        self.folder = Path(cfg.path).expanduser() if cfg.path is not None else None

    @property
    def pipeline_folder(self) -> Path:
        """:attr:`folder`, where it is read: every family but the built-in model without
        ``model.path`` has one."""
        assert self.folder is not None  # (read only by a family loaded from a folder)
        return self.folder

    # ------------------------------------------------------------ checks (no weights)

    def check_folder(self) -> None:
        """Every part the family loads is in the folder (config validation calls this)."""
        for part in self.parts:
            sub = self.pipeline_folder / part
            if not sub.is_dir() or not any(sub.iterdir()):
                raise ConfigError(
                    f"model.path: expected a {self.pipeline_class} folder with {part}/, got "
                    f"{str(self.cfg.path)!r} without it")

    def check_size(self) -> None:
        """``model.height`` / ``model.width`` are multiples of :meth:`size_multiple` (a
        family whose transformer holds a rotary or positional table of a fixed length
        also checks that the size fits it)."""
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
        for part, bounded in self.tokenizer_parts:
            texts = [(field, prompt, self.prompt_text(prompt, part)) for field, prompt in named]
            if bounded:
                check_tokens(self.tokenizer(part), part, texts, self.max_sequence_length,
                             self.dropped_tokens)
            else:
                check_tokens(self.tokenizer(part), part, texts)

    def prompt_text(self, prompt: str, part: str) -> str:
        """The text the tokenizer ``part`` sees for ``prompt`` (a pipeline that cleans
        prompts first, or puts them in a template, overrides this, and its encoder calls
        it)."""
        return prompt

    @property
    def dropped_tokens(self) -> int:
        """Tokens of the bounded tokenizer's :meth:`prompt_text` that the encoder drops
        before the transformer sees the rest (a language-model encoder's template prefix):
        ``model.max_sequence_length`` bounds what remains."""
        return 0

    def tokenizer(self, part: str):
        """The folder's tokenizer ``part``, as the encoder and the prompt checks use it."""
        return load_tokenizer(self.folder, part)

    # ---------------------------------------------------------------- shapes, schedule

    @property
    def max_sequence_length(self) -> int:
        return self.cfg.max_sequence_length or self.default_max_sequence_length

    def transformer_config(self) -> dict:
        return read_json(self.pipeline_folder / "transformer" / "config.json")

    def vae_config(self) -> dict:
        return read_json(self.pipeline_folder / "vae" / "config.json")

    def latent_shape(self) -> tuple[int, ...]:
        """The shape of one sample's latent as the sampler holds it."""
        raise NotImplementedError

    def scheduler_config(self) -> dict:
        f = self.pipeline_folder / "scheduler" / "scheduler_config.json"
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

    def timestep(self, sigma: float | torch.Tensor) -> float | torch.Tensor:
        """The transformer's timestep input at noise level ``sigma``."""
        return sigma * self.num_train_timesteps()

    # --------------------------------------------------------------------- the parts

    @property
    def transformer_class(self) -> type[Any]:
        return diffusers_class(self.transformer_class_name)

    @property
    def vae_class(self) -> type[Any]:
        return diffusers_class(self.vae_class_name)

    def build_transformer(self, seed: int) -> torch.nn.Module:
        """The trainable velocity model, float32, with the initial (version 0) weights:
        the folder's ``transformer/``."""
        return self.transformer_class.from_pretrained(
            self.folder, subfolder="transformer", dtype=torch.float32).eval()

    def transformer_skeleton(self) -> torch.nn.Module:
        """The transformer's modules without weights, on the meta device (float32, from
        the folder's ``transformer/`` config): what a sharded gang's ranks but the first
        build, their slices then filled from the first rank's weights."""
        cls = self.transformer_class
        with torch.device("meta"):
            return cls.from_config(cls.load_config(self.folder, subfolder="transformer")).eval()

    def build_vae(self, seed: int) -> torch.nn.Module:
        """The folder's ``vae/``, frozen."""
        vae = self.vae_class.from_pretrained(self.folder, subfolder="vae", dtype=torch.float32)
        return vae.requires_grad_(False).eval()

    def build_encoder(self, device: torch.device) -> "PromptEncoderLike":
        """An object whose ``encode(prompts, negative, images=None) -> Conditioning``
        runs the text encoders on ``device`` (``negative``: also encode
        ``model.negative_prompt``; ``images``: each prompt's source image, for a family
        that :attr:`takes_images`); a family's is a
        :class:`~digenrl.models.common.TextEncoders`."""
        raise NotImplementedError

    # --------------------------------------------- source images (editing families)

    def source_size(self, image: SourceImage) -> tuple[int, int]:
        """(height, width) an editing family resizes a source image to: about
        ``model.source_area`` pixels at its aspect ratio (:func:`area_size` on
        :meth:`size_multiple`), or the pipeline's own size (:meth:`pipeline_source_size`)
        while that is null."""
        if self.cfg.source_area is None:
            return self.pipeline_source_size(image)
        height, width = image.pixels.shape[:2]
        return area_size(self.cfg.source_area, height, width, self.size_multiple())

    def check_sources(self, field: str, lines: Sequence[tuple[str, str, SourceImage]]) -> None:
        """Each ``(where, prompt, source image)`` of the prompt file ``field`` names fits
        what the transformer takes (``where``: the line and the file). An editing family
        whose text encoding holds the source's vision tokens, or whose rotary table
        holds the source's positions, checks them here, where the sources are known
        (:meth:`check_size` checks what the configured size alone decides)."""

    def pipeline_source_size(self, image: SourceImage) -> tuple[int, int]:
        """(height, width) the family's pipeline resizes a source image to. Each editing
        family (:attr:`takes_images`) defines it; no other family is asked."""
        raise NotImplementedError(f"{self.pipeline_class or 'the built-in model'}: "
                                  f"resizes no source images (it does not edit images)")

    def source_pixels(self, image: SourceImage) -> torch.Tensor:
        """The source image as the family's pipeline feeds its VAE: ``(1, 3, H, W)`` in
        [-1, 1]. Each editing family defines it (its encoder's
        :meth:`~digenrl.models.common.TextEncoders.encode_sources` asks)."""
        raise NotImplementedError(f"{self.pipeline_class or 'the built-in model'}: "
                                  f"encodes no source images (it does not edit images)")

    def source_latents(self, vae: torch.nn.Module, pixels: torch.Tensor) -> torch.Tensor:
        """The VAE's encoding of :meth:`source_pixels`, as the family's pipeline encodes
        a source image. Each editing family defines it."""
        raise NotImplementedError(f"{self.pipeline_class or 'the built-in model'}: "
                                  f"encodes no source images (it does not edit images)")

    # ---------------------------------------------------------- context parallelism

    def context_parallel_plan(self) -> dict | None:
        """How diffusers' context parallelism splits this family's transformer when a
        chunk's step is computed by several processes together
        (:mod:`digenrl.tasks.context_parallel`): a ``_cp_plan`` (module names mapped to
        the inputs split and the outputs gathered along the token axis), or None where
        the family has none, and a degree above 1 is refused (:meth:`check_context_parallel`).
        A family whose transformer class carries diffusers' own plan returns that."""
        return None

    def parallel_attention(self, transformer: torch.nn.Module
                           ) -> AbstractContextManager[torch.nn.Module]:
        """``transformer`` with attention processors that take diffusers' parallel
        configuration, for a context-parallel step (a ``with`` block): its own where they
        do (diffusers' FLUX, Qwen-Image and Wan processors); a family whose processors
        do not swaps them for ones that do inside the block, and back after it."""
        return nullcontext(transformer)

    def attention_heads(self) -> int:
        """Attention heads of each of the transformer's attention layers (Ulysses gives
        each process ``heads / degree`` of them)."""
        return int(self.transformer_config()["num_attention_heads"])

    def takes_degree(self, degree: int) -> bool:
        """Whether a chunk's step can run over ``degree`` processes: 1, or a plan and
        heads the degree divides (:meth:`check_context_parallel` says which is missing)."""
        return degree == 1 or (self.context_parallel_plan() is not None
                               and self.attention_heads() % degree == 0)

    def check_context_parallel(self, degree: int) -> None:
        """A chunk's step can run over ``degree`` processes: the family has a plan and
        its heads divide among them. Raises :class:`ConfigError` naming the field in one
        line (nothing is built)."""
        if degree == 1:
            return
        what = (f"this {self.pipeline_class} folder" if self.pipeline_class
                else "the built-in model")
        require(self.context_parallel_plan() is not None, CONTEXT_PARALLEL_FIELD,
                f"1 for {what} ({self.transformer_class_name} has no context-parallel "
                f"plan)", degree)
        heads = self.attention_heads()
        require(heads % degree == 0, CONTEXT_PARALLEL_FIELD,
                f"a divisor of the transformer's {heads} attention heads for {what} "
                f"(Ulysses gives each process heads / degree of them)", degree)

    # ------------------------------------------------------------------ computation

    def predict_velocity(self, transformer: torch.nn.Module, x: torch.Tensor,
                         sigma: float | torch.Tensor, cond: Conditioning,
                         guidance_scale: float) -> torch.Tensor:
        raise NotImplementedError

    def decode(self, vae: torch.nn.Module, latents: torch.Tensor) -> torch.Tensor:
        """Latents to pixels in [-1, 1] (not yet clamped), channels second."""
        raise NotImplementedError


def area_size(area: int, height: int, width: int, multiple: int) -> tuple[int, int]:
    """(height, width) of about ``area`` pixels at the aspect ratio of ``height`` x
    ``width``: width sqrt(area x aspect), height width / aspect, each rounded to the
    nearest multiple of ``multiple`` (at least one), as QwenImageEditPipeline's
    ``calculate_dimensions`` sizes a source image on multiples of 32."""
    aspect = width / height
    w = math.sqrt(area * aspect)
    sides = [max(round(side / multiple), 1) * multiple for side in (w / aspect, w)]
    return sides[0], sides[1]


class PromptEncoderLike(Protocol):
    """The interface :meth:`ModelFamily.build_encoder` returns.

    ``images``: one source image per prompt (uint8 ``(height, width, 3)`` arrays, or
    :class:`SourceImage`), for an instruction-editing family; None for the others.
    ``negatives``: each prompt's own negative prompt (None where it has none: the
    model's), or None when no prompt has one."""

    def encode(self, prompts: Sequence[str], negative: bool, images: Sequence | None = None,
               negatives: Sequence[str | None] | None = None
               ) -> Conditioning:  # pragma: no cover
        raise NotImplementedError
