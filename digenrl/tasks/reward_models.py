"""Rewards that own a model, resident in every process that scores them.

A model reward is named under ``reward.models`` with its settings
(:class:`~digenrl.config.RewardModelConfig`). Its function, :class:`ModelReward`,
carries only those settings, so it travels with the reward task as cheaply as a
built-in reward's. The model is loaded the first time a process scores with those
settings -- on the process's GPU when it has one (else the CPU), in the configured
dtype -- and kept for every later task: once per worker process, not once per task.
The same holds outside a worker (the client, a test) and in ``digenrl reward-server``.
Models are keyed by their settings, so two names with the same settings share one.
:func:`reward_model_loads` counts this process's loads; each load is logged and, on a
Dask worker, recorded as a ``digenrl-reward-model`` event (``Client.get_events``), which
a run's log repeats.
A model reward is a ``gpu`` reward: its tasks hold a GPU slot.

Kinds (``kind``):

* ``clip``: ``logit_scale.exp() * cos(image embedding, prompt embedding)`` of a
  transformers ``CLIPModel``, the score PickScore computes; with OpenAI's CLIP weights
  (``logit_scale`` 100) it is the CLIP score (without CLIPScore's clipping at 0).
* ``aesthetic``: an MLP head on the L2-normalised CLIP image embedding, in the layout of
  LAION's improved aesthetic predictor (``Linear-Dropout-Linear-Dropout-Linear-Dropout-
  Linear-Linear``, state-dict keys ``layers.0.weight`` ... ``layers.7.bias``). The head
  computes in float32 whatever the CLIP model's dtype.
* ``clip_consistency``: ``cos(image embedding, source image embedding)`` of a
  transformers ``CLIPModel``: how much of its source image an instruction edit keeps
  (the reward receives each sample's source image: ``sources``). A sample without a
  source image is an error naming the reward.
* ``ocr``: Flow-GRPO's OCR reward, in [0, 1]: how well the image renders its target text
  (its prompt's quoted text, or its prompt-file line's ``text`` key: the reward receives
  each sample's ``metadata``), read by RapidOCR's PP-OCR models on onnxruntime
  (:mod:`digenrl.tasks.ocr`, which says how it reads, threads and batches). Its models
  ship inside the ``rapidocr`` wheel: nothing to point at.

In the CLIP kinds (``clip``, ``aesthetic``, ``clip_consistency``) every forward pass runs
under ``torch.no_grad`` and holds exactly ``batch_size`` rows: the images are scored in
slices of at most ``batch_size``, and a slice of fewer is padded
with zero images (and, for ``clip``, empty prompts) whose scores are dropped. Prompts are
tokenized to the text model's full length, never to the longest prompt of the slice. So
every pass has the same shapes and a sample's score does not depend on which images
share its batch or how many do: the same image and prompt get the same bits whether
scored alone, among others, in-process or by ``digenrl reward-server`` (given the same
settings, device and software, and on a CPU the same torch thread count). The cost: a
slice of fewer than ``batch_size`` images costs a whole batch's forward pass (scoring
one image with ``batch_size`` 32 computes 32 rows), so a ``batch_size`` that divides
the number of images a reward task scores (the chunk size, or the requests'
``batch_size`` a server receives) wastes nothing. Scores return to the CPU as float64.
"""

from __future__ import annotations

import collections
import logging
import threading
from dataclasses import dataclass
from typing import Callable, Sequence, cast

import numpy as np
import torch

from digenrl.config import (BUNDLED_MODEL_KINDS, REWARD_MODEL_KINDS, ConfigError,
                            RewardModelConfig)
from digenrl.models.parts import BUILDING, TORCH_DTYPES
from digenrl.tasks.resident import compute_device
from digenrl.tasks.rewards import RewardSpec
from digenrl.tasks.worker import current_worker

__all__ = ["ModelReward", "ModelSourceReward", "ModelTextReward", "ClipConsistency",
           "OcrModel", "model_reward",
           "resident_reward_model", "reward_model_loads",
           "ClipPreference", "AestheticPredictor", "AestheticHead", "load_head",
           "HEAD_LAYERS", "EVENT_TOPIC", "log_load_event"]

logger = logging.getLogger("digenrl")

#: The Dask event topic a worker records each reward-model load under.
EVENT_TOPIC = "digenrl-reward-model"
#: The head's linear layers by their index in LAION's ``nn.Sequential`` (the others are
#: dropouts, without weights), and each dropout's rate after the linear before it.
HEAD_LAYERS = (0, 2, 4, 6, 7)
_HEAD_DROPOUT = {0: 0.2, 2: 0.2, 4: 0.1}


class _Clip:
    """A CLIPModel and its image processor from local folders, on ``device`` in the
    configured dtype; the L2-normalised image embeddings of uint8 images, in forward
    passes of exactly ``batch_size`` rows (the module's docstring says why)."""

    def __init__(self, config: RewardModelConfig, device: torch.device):
        from transformers import CLIPImageProcessor, CLIPModel

        self.config, self.device = config, device
        self.dtype = TORCH_DTYPES[config.dtype]
        self.model = CLIPModel.from_pretrained(config.path, dtype=self.dtype).to(device)
        self.model.eval().requires_grad_(False)
        self.processor_folder = config.processor if config.processor is not None else config.path
        self.image_processor = CLIPImageProcessor.from_pretrained(self.processor_folder)
        # A worker may run two reward tasks at once; a model (and a fast tokenizer, whose
        # padding settings are shared state) scores one batch at a time.
        self._lock = threading.Lock()

    @torch.no_grad()
    def image_embeddings(self, images: np.ndarray | Sequence[np.ndarray]) -> torch.Tensor:
        """``batch_size`` rows: the normalised embeddings of ``images`` (at most
        ``batch_size``), then those of zero images."""
        pixels = self.image_processor(images=list(images), return_tensors="pt",
                                      input_data_format="channels_last")["pixel_values"]
        pixels = torch.cat([pixels, pixels.new_zeros((self._padding(len(images)),
                                                      *pixels.shape[1:]))])
        out = self.model.vision_model(pixel_values=pixels.to(self.device, self.dtype))
        embeds = self.model.visual_projection(out.pooler_output)
        return embeds / embeds.norm(dim=-1, keepdim=True)

    def _padding(self, n: int) -> int:
        """Rows that fill a slice of ``n`` samples up to ``batch_size``."""
        return self.config.batch_size - n

    def score(self, images: np.ndarray, prompts: Sequence[str],
              sources: Sequence[np.ndarray | None] = ()) -> np.ndarray:
        """One float64 score per image: slices of at most ``batch_size``, each scored in
        a forward pass padded to ``batch_size`` rows (the padding's scores dropped).
        ``sources``: each image's source image (None where it has none), for the kinds
        that compare with it."""
        size = self.config.batch_size
        sources = list(sources) or [None] * len(images)
        parts = []
        with self._lock:
            for a in range(0, len(images), size):
                batch = images[a:a + size]
                parts.append(self._score_batch(batch, list(prompts[a:a + size]),
                                               sources[a:a + size])[:len(batch)])
        return np.concatenate(parts) if parts else np.zeros(0)

    def _score_batch(self, images: np.ndarray, prompts: list[str],
                     sources: list[np.ndarray | None]) -> np.ndarray:
        """``batch_size`` float64 scores: those of ``images`` (at most ``batch_size``),
        then the padding's. What each kind (a subclass) computes."""
        raise NotImplementedError(f"{type(self).__name__} scores no batch: a reward-model "
                                  f"kind defines _score_batch")


class ClipPreference(_Clip):
    """``logit_scale.exp() * cos(image, prompt)`` per image (PickScore, CLIP score)."""

    def __init__(self, config: RewardModelConfig, device: torch.device):
        from transformers import AutoTokenizer

        super().__init__(config, device)
        self.tokenizer = AutoTokenizer.from_pretrained(self.processor_folder)
        self.max_length = min(self.tokenizer.model_max_length,
                              self.model.config.text_config.max_position_embeddings)

    @torch.no_grad()
    def text_embeddings(self, prompts: list[str]) -> torch.Tensor:
        """``batch_size`` rows: the normalised embeddings of ``prompts`` (at most
        ``batch_size``), then those of empty prompts; every prompt tokenized to the text
        model's full length (its attention mask covers its own tokens only)."""
        prompts = prompts + [""] * self._padding(len(prompts))
        tokens = self.tokenizer(prompts, padding="max_length", truncation=True,
                                max_length=self.max_length, return_tensors="pt")
        out = self.model.text_model(input_ids=tokens["input_ids"].to(self.device),
                                    attention_mask=tokens["attention_mask"].to(self.device))
        embeds = self.model.text_projection(out.pooler_output)
        return embeds / embeds.norm(dim=-1, keepdim=True)

    @torch.no_grad()
    def _score_batch(self, images: np.ndarray, prompts: list[str],
                     sources: list[np.ndarray | None]) -> np.ndarray:
        cosine = (self.image_embeddings(images) * self.text_embeddings(prompts)).sum(-1)
        scores = self.model.logit_scale.exp() * cosine
        return scores.float().cpu().numpy().astype(np.float64)


class AestheticPredictor(_Clip):
    """LAION's improved aesthetic predictor: an MLP on the normalised image embedding."""

    def __init__(self, config: RewardModelConfig, device: torch.device):
        super().__init__(config, device)
        assert config.head is not None      # (an aesthetic reward's: the config requires it)
        head, width = load_head(config.head)
        projection = self.model.config.projection_dim
        if width != projection:
            raise ValueError(f"the aesthetic head {config.head!r} takes {width} inputs, the "
                             f"CLIP model at {config.path!r} embeds in {projection}")
        self.head = head.to(device).eval().requires_grad_(False)

    @torch.no_grad()
    def _score_batch(self, images: np.ndarray, prompts: list[str],
                     sources: list[np.ndarray | None]) -> np.ndarray:
        scores = self.head(self.image_embeddings(images).float()).squeeze(-1)
        return scores.cpu().numpy().astype(np.float64)


class ClipConsistency(_Clip):
    """``cos(image, source image)`` per edited image, of CLIP's normalised image
    embeddings (each in passes of ``batch_size`` rows, as every kind's)."""

    def score(self, images: np.ndarray, prompts: Sequence[str],
              sources: Sequence[np.ndarray | None] = ()) -> np.ndarray:
        sources = list(sources) or [None] * len(images)
        missing = [i for i, x in enumerate(sources) if x is None]
        if missing:
            raise ValueError(f"expected a source image for every sample (a prompt-file "
                             f"line's \"image\"), got none for the batch's samples at "
                             f"{missing[:8]}")
        return super().score(images, prompts, sources)

    def _score_batch(self, images: np.ndarray, prompts: list[str],
                     sources: list[np.ndarray | None]) -> np.ndarray:
        present = cast("list[np.ndarray]", sources)     # (score: every sample has one)
        cosine = (self.image_embeddings(images) * self.image_embeddings(present)).sum(-1)
        return cosine.float().cpu().numpy().astype(np.float64)


class OcrModel:
    """Flow-GRPO's OCR score per image (:mod:`digenrl.tasks.ocr`): the reader built
    with as many onnxruntime threads as torch has in this process (a worker's
    ``cluster.torch_threads``), on the CUDA provider where onnxruntime-gpu offers it and
    the process has a GPU."""

    def __init__(self, config: RewardModelConfig, device: torch.device):
        from digenrl.tasks.ocr import OcrReader

        self.config = config
        self.reader = OcrReader(threads=torch.get_num_threads(), batch_size=config.batch_size,
                                cuda=None if device.type == "cuda" else False)
        self.device = self.reader.device

    def score(self, images: np.ndarray, prompts: Sequence[str],
              sources: Sequence[np.ndarray | None] = (),
              metadata: Sequence[dict] = ()) -> np.ndarray:
        """One float64 score in [0, 1] per image, against its target text (a sample
        without one is an error naming it)."""
        from digenrl.tasks.ocr import ocr_score, ocr_target

        metadata = list(metadata) or [{} for _ in prompts]
        targets = []
        for i, (prompt, meta) in enumerate(zip(prompts, metadata)):
            try:
                targets.append(ocr_target(prompt, meta))
            except ValueError as e:
                raise ValueError(f"sample {i} of the batch: {e}") from None
        texts = self.reader.read(images)
        return np.asarray([ocr_score(t, g) for t, g in zip(texts, targets)],
                          dtype=np.float64)


_KINDS: dict[str, Callable[[RewardModelConfig, torch.device], _Clip | OcrModel]] = {
    "clip": ClipPreference, "aesthetic": AestheticPredictor,
    "clip_consistency": ClipConsistency, "ocr": OcrModel}
assert set(_KINDS) == set(REWARD_MODEL_KINDS), "every configurable kind is implemented"


def load_head(path: str) -> tuple["AestheticHead", int]:
    """The aesthetic head saved at ``path`` (float32, on the CPU) and its input width.

    ``.safetensors`` is read with safetensors, ``.pth``/``.pt`` with
    ``torch.load(weights_only=True)``: tensors only, never arbitrary objects. Raises
    ValueError saying what is wrong with the file."""
    try:
        if path.endswith(".safetensors"):
            from safetensors.torch import load_file

            state = load_file(path)
        else:
            state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # a truncated file, or a pickle of more than tensors
        reason = " ".join(f"{type(e).__name__}: {e}".split())[:300]
        raise ValueError(f"a readable state dict of tensors ({reason})") from None
    expected = sorted(f"layers.{i}.{w}" for i in HEAD_LAYERS for w in ("weight", "bias"))
    if not isinstance(state, dict) or sorted(state) != expected:
        got = sorted(state)[:12] if isinstance(state, dict) else type(state).__name__
        raise ValueError(f"the keys of LAION's aesthetic head {expected}, got {got}")
    layers: list[torch.nn.Module] = []
    width = None
    for i in HEAD_LAYERS:
        weight = state[f"layers.{i}.weight"]
        if weight.ndim != 2 or (width is not None and weight.shape[1] != width):
            raise ValueError(f"layers.{i}.weight of shape (n, {width}) after the layer "
                             f"before it, got {tuple(weight.shape)}")
        width = weight.shape[0]
        layers.append(torch.nn.Linear(weight.shape[1], weight.shape[0]))
        if i in _HEAD_DROPOUT:
            layers.append(torch.nn.Dropout(_HEAD_DROPOUT[i]))
    if width != 1:
        raise ValueError(f"a last layer with one output, got {width}")
    head = AestheticHead(torch.nn.Sequential(*layers))
    head.load_state_dict({k: v.float() for k, v in state.items()})
    return head, state["layers.0.weight"].shape[1]


class AestheticHead(torch.nn.Module):
    """The MLP of LAION's improved aesthetic predictor (its ``layers``, keys and all)."""

    def __init__(self, layers: torch.nn.Sequential):
        super().__init__()
        self.layers = layers

    def forward(self, embeddings: torch.Tensor) -> torch.Tensor:
        return self.layers(embeddings)


# ---------------------------------------------------------------- resident models

_LOADED: dict[RewardModelConfig, _Clip | OcrModel] = {}
_LOADS: collections.Counter = collections.Counter()
_LOCK = threading.Lock()


def resident_reward_model(config: RewardModelConfig) -> _Clip | OcrModel:
    """This process's model for ``config``, loaded on first use and kept."""
    with _LOCK:
        model = _LOADED.get(config)
        if model is None:
            device = compute_device()
            with BUILDING:
                model = _KINDS[config.kind](config, device)
            _LOADED[config] = model
            _LOADS[config] += 1
            _announce(config, model.device)
        return model


def _announce(config: RewardModelConfig, device: torch.device | str) -> None:
    path = config.path if config.kind not in BUNDLED_MODEL_KINDS else f"the {config.kind} wheel"
    record = {"kind": config.kind, "path": path, "device": str(device),
              "dtype": config.dtype, "loads": sum(_LOADS.values())}
    worker = current_worker()
    if worker is None:
        logger.info("%s", _load_line(record))
        return
    record["worker"] = worker.address
    logger.info("%s", _load_line(record))
    worker.log_event(EVENT_TOPIC, record)


def _load_line(record: dict) -> str:
    where = f"worker {record['worker']}" if "worker" in record else "this process"
    n = record["loads"]
    return (f"reward model {record['kind']} from {record['path']} loaded on {record['device']}"
            f" in {record['dtype']} ({n} reward model load{'' if n == 1 else 's'} in "
            f"{where})")


def log_load_event(event: tuple[float, dict]) -> None:
    """Log a load a worker recorded, in the process that runs the driver (the run
    subscribes this to :data:`EVENT_TOPIC`)."""
    _, record = event
    logger.info("%s", _load_line(record))


def reward_model_loads(config: RewardModelConfig | None = None) -> int:
    """How many times this process loaded the model of ``config`` (of any, when None)."""
    with _LOCK:
        return _LOADS[config] if config is not None else sum(_LOADS.values())


@dataclass(frozen=True)
class ModelReward:
    """The function of a model reward: scores with this process's resident model."""

    name: str
    config: RewardModelConfig

    def __call__(self, images: np.ndarray, prompts: Sequence[str]) -> np.ndarray:
        return resident_reward_model(self.config).score(images, prompts)

    def load(self) -> None:
        """Load the model now (a server does so before it serves)."""
        resident_reward_model(self.config)

    @property
    def batch_size(self) -> int:
        """The rows of every forward pass (a server gathers requests into passes of it)."""
        return self.config.batch_size

    @property
    def loads(self) -> int:
        """How many times this process loaded this reward's model."""
        return reward_model_loads(self.config)


@dataclass(frozen=True)
class ModelTextReward(ModelReward):
    """The function of a model reward that reads each sample's metadata (``ocr``: a
    prompt-file line's ``text`` key)."""

    def __call__(self, images: np.ndarray, prompts: Sequence[str],
                 metadata: Sequence[dict] = ()) -> np.ndarray:
        model = resident_reward_model(self.config)
        assert isinstance(model, OcrModel)    # (the kinds that read metadata)
        return model.score(images, prompts, (), metadata)


@dataclass(frozen=True)
class ModelSourceReward(ModelReward):
    """The function of a model reward that compares each sample with its source image."""

    def __call__(self, images: np.ndarray, prompts: Sequence[str],
                 sources: Sequence[np.ndarray | None] = ()) -> np.ndarray:
        return resident_reward_model(self.config).score(images, prompts, sources)


def model_reward(name: str, config: RewardModelConfig) -> RewardSpec:
    """The spec of the model reward ``name`` (a ``gpu`` reward). Checks now, before any
    work starts, what the config's validation could not without torch: an aesthetic
    head's file and that its input width is the CLIP model's projection width; an OCR
    reward's libraries (its extra) and models."""
    if config.kind == "ocr":
        from digenrl.tasks.ocr import check_installed

        check_installed(f"reward.models.{name}.kind")
        return RewardSpec(name, ModelTextReward(name, config), "gpu",
                          "Flow-GRPO's OCR score of the prompt's quoted text (RapidOCR's "
                          "PP-OCR models)", takes_metadata=True)
    if config.kind == "aesthetic":
        from transformers import CLIPConfig

        field = f"reward.models.{name}.head"
        assert config.head is not None      # (an aesthetic reward's: the config requires it)
        try:
            _, width = load_head(config.head)
        except ValueError as e:
            raise ConfigError(f"{field}: expected {e}, in {config.head!r}") from None
        projection = CLIPConfig.from_pretrained(config.path).projection_dim
        if width != projection:
            raise ConfigError(f"{field}: expected a head taking {projection} inputs (the "
                              f"projection_dim of the CLIP model at reward.models.{name}.path),"
                              f" got one taking {width}")
    what = {"clip": "logit_scale x cosine of CLIP image and prompt embeddings",
            "aesthetic": "an aesthetic head on the CLIP image embedding",
            "clip_consistency": "cosine of the CLIP embeddings of the edit and its source "
                                "image"}[config.kind]
    if config.kind == "clip_consistency":
        return RewardSpec(name, ModelSourceReward(name, config), "gpu",
                          f"{what} ({config.path})", takes_sources=True)
    return RewardSpec(name, ModelReward(name, config), "gpu", f"{what} ({config.path})")
