"""Model state resident on a worker, keyed by policy version.

A worker keeps the transformer with each recently used version's weights loaded, plus
the VAE and, on the rollout workers that encode prompts, the text encoders, so tasks
pass only weight versions, latents, conditioning and gradients. Text encoders are built
on the first encoding (an ``encode`` task, in the rollout pool; a trainer lent to
generation may run one too, and an evaluation chunk encodes its held-out prompts). :class:`ResidentPlugin` is the Dask worker plugin that owns this state; a
task reaches it through :func:`resident`. Outside a worker (unit tests, the client) the
same state lives in a process-wide table.
"""

from __future__ import annotations

import copy
import logging
import threading
from collections import OrderedDict
from typing import Callable

import torch
from distributed import WorkerPlugin

from digenrl.config import ModelConfig
from digenrl.models.lora import Trainable, build_policy, cast_for_forward, trainable_parameters
from digenrl.metering import model_time
from digenrl.models import Conditioning, build_vae, family
from digenrl.models.parts import BUILDING
from digenrl.process import freeze_collector, tune_malloc
from digenrl.prompts import read_source
from digenrl.store import SAMPLING_PART
from digenrl.tasks.footprint import tensor_bytes
from digenrl.tasks.types import PolicyWeights
from digenrl.tasks.worker import current_worker

__all__ = ["ResidentModels", "ResidentPlugin", "resident", "compute_device", "PLUGIN_NAME",
           "sharded_weights"]

logger = logging.getLogger(__name__)

PLUGIN_NAME = "digenrl-resident"


def compute_device() -> torch.device:
    """Where this process computes: its GPU when it has one (dask-cuda gives each worker
    one visible device), else the CPU. Task outputs always return to CPU."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


class ResidentModels:
    """Transformers per policy version (least recently used evicted), VAE, text encoders.

    With LoRA the versions' transformers share one set of frozen base weights (loaded
    once): each version's module differs only in its adapters. A version's sampling copy
    (DiffusionNFT) is a module of its own beside the version's trained weights."""

    def __init__(self, cfg: ModelConfig, seed: int, max_versions: int = 4,
                 trainable: Trainable = Trainable()):
        self.cfg, self.seed, self.max_versions = cfg, seed, max_versions
        self.trainable = trainable
        self.device = compute_device()
        self._lock = threading.RLock()
        #: (version, whether the weights are its sampling copy) -> the module holding them
        self._versions: OrderedDict[tuple[int, bool], torch.nn.Module] = OrderedDict()
        #: With LoRA: the module whose frozen weights every version's module shares.
        self._base: torch.nn.Module | None = None
        self._vae = None
        self._encoder = None
        self.loads = 0  # how many times weights were copied into a module (telemetry)

    @property
    def vae(self):
        with self._lock:
            if self._vae is None:
                self._vae = build_vae(self.cfg, self.seed).to(self.device)
            return self._vae

    @property
    def encoder(self):
        """The family's prompt encoder (its text encoders, in ``text_encoder_dtype``, with
        an embedding cache per prompt), built on first use."""
        with self._lock:
            if self._encoder is None:
                with BUILDING:
                    self._encoder = family(self.cfg).build_encoder(self.device)
            return self._encoder

    @property
    def has_encoder(self) -> bool:
        return self._encoder is not None

    def policy(self, weights: PolicyWeights) -> torch.nn.Module:
        """The transformer holding ``weights`` (loaded once per version per worker). For
        broadcast weights (``weights.held``) the version this worker received, or, on a
        worker that did not (it joined the run later, or dropped the version), the
        version read from its sharded checkpoint."""
        key = (weights.version, weights.sampling_copy)
        with self._lock:
            module = self._versions.get(key)
            if module is not None:
                self._versions.move_to_end(key)
                return module
            if weights.held:
                weights = _from_checkpoint(weights)
            module = self._slot()
            module.load_state_dict(weights.tensors, strict=False)
            self._versions[key] = module
            self.loads += 1
            return module

    def _slot(self) -> torch.nn.Module:
        """A module to load a version into: the least recently used one's, or a new one."""
        if len(self._versions) >= self.max_versions:
            return self._versions.popitem(last=False)[1]
        return self._new_module()

    def held(self, version: int, sampling_copy: bool = False) -> torch.nn.Module | None:
        """The transformer holding ``version`` (its sampling copy), if resident."""
        with self._lock:
            return self._versions.get((version, sampling_copy))

    def receive(self, version: int, sampling_copy: bool,
                fill: Callable[[dict[str, torch.Tensor]], object]) -> torch.nn.Module:
        """Hold ``version`` (its sampling copy) in a module whose trainable tensors
        ``fill`` writes in place (a broadcast's receiving end). If ``fill`` fails, the
        module is dropped: no version is held with part of its weights."""
        key = (version, sampling_copy)
        with self._lock:
            module = self._versions.pop(key, None) or self._slot()
            fill({n: p.data for n, p in trainable_parameters(module).items()})
            self._versions[key] = module
            self.loads += 1
            return module

    def _new_module(self) -> torch.nn.Module:
        """A transformer in ``model.dtype`` on this worker's device, for one version (its
        trainable weights are loaded next). Without LoRA, built once: a further version
        starts as a copy of one held, whose other tensors are the same (a copy in memory
        costs milliseconds; a build draws every initial weight again, or reads the
        folder again)."""
        if not self.trainable.lora:
            if self._versions:
                return copy.deepcopy(next(iter(self._versions.values())))
            return cast_for_forward(build_policy(self.cfg, self.trainable, self.seed),
                                    self.cfg, self.trainable).to(self.device)
        if self._base is None:
            self._base = cast_for_forward(build_policy(self.cfg, self.trainable, self.seed),
                                          self.cfg, self.trainable).to(self.device)
        adapters = {id(p) for p in trainable_parameters(self._base).values()}
        # A copy that shares (does not copy) every tensor except the adapters'.
        shared = {id(t): t for t in list(self._base.parameters()) + list(self._base.buffers())
                  if id(t) not in adapters}
        return copy.deepcopy(self._base, memo=shared)

    def conditioning(self, prompts, guidance_scale: float, inputs=()) -> Conditioning:
        """The prompts' conditioning on the CPU (and the negative prompts' with guidance).
        ``inputs``: each prompt's :class:`~digenrl.prompts.PromptInputs` (its source
        image, read here, and its own negative prompt), or () when none has any. Each
        prompt (with its source image) is encoded once per process while the encoder's
        cache keeps it."""
        images = negatives = None
        if inputs:
            negatives = [i.negative for i in inputs]
            if any(i.images for i in inputs):
                images = [read_source(i.images[0]) for i in inputs]
        with self._lock, model_time():
            return self.encoder.encode(tuple(prompts), guidance_scale > 1.0, images=images,
                                       negatives=negatives)

    def prompts_encoded(self) -> int:
        """How many prompts (and negative prompts, and source images) this process's
        encoder has encoded so far: its cache misses (0 before its first encoding)."""
        with self._lock:
            if self._encoder is None:
                return 0
            caches = [getattr(self._encoder, name, None) for name in ("cache", "source_cache")]
            return sum(c.encoded for c in caches if c is not None)

    def nbytes(self) -> int:
        """The bytes of every tensor it holds on its device (versions, VAE, text encoders
        unless offloaded to the CPU; shared weights once)."""
        with self._lock:
            encoders = getattr(self._encoder, "modules", None)
            modules = [*self._versions.values(), self._base, self._vae,
                       *(encoders() if callable(encoders) else ())]
            return tensor_bytes((m for m in modules if isinstance(m, torch.nn.Module)),
                                self.device)

    def resident_versions(self) -> list[int]:
        with self._lock:
            return sorted({v for v, _ in self._versions})

    def loaded(self, version: int, sampling_copy: bool = False) -> dict[str, torch.Tensor] | None:
        """The trainable parameters of the transformer holding ``version`` (its sampling
        copy with ``sampling_copy``; None when not resident): what this worker computes
        with for that version."""
        with self._lock:
            module = self._versions.get((version, sampling_copy))
            if module is None:
                return None
            return {n: p.detach().cpu().clone()
                    for n, p in trainable_parameters(module).items()}


class ResidentPlugin(WorkerPlugin):
    """Keeps :class:`ResidentModels` on every worker, including ones that join later."""

    name = PLUGIN_NAME

    def __init__(self, cfg: ModelConfig, seed: int, torch_threads: int = 1,
                 max_versions: int = 4, trainable: Trainable = Trainable()):
        self.cfg, self.seed, self.trainable = cfg, seed, trainable
        self.torch_threads, self.max_versions = torch_threads, max_versions
        self.models: ResidentModels | None = None

    def setup(self, worker) -> None:
        torch.set_num_threads(self.torch_threads)
        if not tune_malloc():
            logger.info("worker %s: could not tune the allocator (not glibc)", worker.name)
        self.models = ResidentModels(self.cfg, self.seed, self.max_versions, self.trainable)
        freeze_collector()   # (the imports above are most of what this process holds)

    def teardown(self, worker) -> None:
        self.models = None


def sharded_weights(store: str, version: int, sampling_copy: bool) -> PolicyWeights:
    """Version ``version``'s published weights (its sampling copy with ``sampling_copy``)
    read whole, in float32, from its sharded checkpoint in the run's ``store``, in one
    process."""
    from digenrl.store.sharded import read_sharded

    parts, _ = read_sharded(store, version)
    part = SAMPLING_PART if sampling_copy else "params"
    return PolicyWeights(version=version, tensors={n: t.float() for n, t in parts[part].items()},
                         sampling_copy=sampling_copy)


def _from_checkpoint(weights: PolicyWeights) -> PolicyWeights:
    """Broadcast weights a worker did not receive, read from their version's sharded
    checkpoint; one line saying why when the run wrote none."""
    from digenrl.store.sharded import sharded_checkpoints

    if weights.store is None or weights.version not in sharded_checkpoints(weights.store):
        raise RuntimeError(
            f"policy version {weights.version}: expected it in this worker's resident "
            f"transformer (broadcast to the run's collective group) or a sharded "
            f"checkpoint of it in the store, got neither (the worker joined the group's "
            f"pool after the group formed, and the run checkpoints other versions)")
    return sharded_weights(weights.store, weights.version, weights.sampling_copy)


_LOCAL: dict[tuple[ModelConfig, int, Trainable], ResidentModels] = {}
_LOCAL_LOCK = threading.Lock()


def resident(cfg: ModelConfig, seed: int, trainable: Trainable = Trainable()) -> ResidentModels:
    """The resident model state for ``cfg`` (and what of it trains) in this process."""
    worker = current_worker()
    plugin = worker.plugins.get(PLUGIN_NAME) if worker is not None else None
    if isinstance(plugin, ResidentPlugin) and plugin.models is not None \
            and plugin.cfg == cfg and plugin.seed == seed and plugin.trainable == trainable:
        return plugin.models
    with _LOCAL_LOCK:
        key = (cfg, seed, trainable)
        if key not in _LOCAL:
            _LOCAL[key] = ResidentModels(cfg, seed, trainable=trainable)
        return _LOCAL[key]
