"""What a denoise step needs in memory beside what its process keeps: measured on the
worker, for ``rollout.context_parallel: auto`` to bound a chunk's samples per GPU.

A process keeps its models resident (:class:`~digenrl.tasks.resident.ResidentModels`:
the policy versions, the VAE, the text encoders). A step allocates its activations on
top, and frees them when it ends: its *transient* bytes, the peak of the tensors it
allocated and still held at any moment. :class:`PeakBytes` measures that peak by
watching every tensor operation of its thread (a ``TorchDispatchMode``): each new
tensor storage an operation returns adds its bytes, and the storage's end (its last
view gone) takes them off. Storages that existed before (weights, inputs) and the
results of in-place operations and views add nothing. It counts what tensors hold on
any device (not an allocator's cache or a kernel's workspace), and the same on the CPU
as on a GPU, so a run on emulated GPU slots measures what a GPU run measures.

The first degree-1 step a process computes for a latent shape is measured
(:func:`measured_step`); on a Dask worker the figures are sent to the scheduler as a
``digenrl-step-memory`` event (:data:`EVENT_TOPIC`, ``Client.get_events``):
``{"model", "name", "shape", "samples", "transient_bytes", "resident_bytes"}``
(``model``: :func:`model_key` of the model's settings, as a cluster serves many runs). One sample's
activations at degree ``d`` are taken as ``1/d`` of those at degree 1 (each of a
context-parallel step's processes holds ``1/d`` of the tokens), so only degree 1 is
measured.
"""

from __future__ import annotations

import hashlib
import threading
import weakref
from contextlib import contextmanager
from typing import Iterable, Iterator, Protocol

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from digenrl.tasks.worker import current_worker

__all__ = ["PeakBytes", "tensor_bytes", "measured_step", "model_key", "EVENT_TOPIC",
           "USABLE_FRACTION"]

#: The Dask event topic of a worker's step measurements.
EVENT_TOPIC = "digenrl-step-memory"

#: What the tensors a run measures may take of a GPU's memory: the rest is for what
#: the measurement does not see (the CUDA context, the caching allocator's
#: fragmentation, kernels' workspaces, collectives' buffers). A margin chosen, not
#: measured.
USABLE_FRACTION = 0.9


class PeakBytes(TorchDispatchMode):
    """Within a ``with`` block, on its thread: :attr:`peak`, the most bytes of tensor
    storage allocated inside the block and alive at once, and :attr:`live`, those alive
    now."""

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        #: id of each storage seen -> the bytes it counts (0: it existed before)
        self._seen: dict[int, int] = {}

    def _gone(self, key: int, nbytes: int) -> None:
        self._seen.pop(key, None)
        self.live -= nbytes

    def _note(self, tensor: torch.Tensor, new: bool) -> None:
        storage = tensor.untyped_storage()
        key = id(storage)    # (the storage's Python object lives as long as the storage)
        if key in self._seen:
            return
        nbytes = storage.nbytes() if new else 0
        self._seen[key] = nbytes
        self.live += nbytes
        self.peak = max(self.peak, self.live)
        weakref.finalize(storage, self._gone, key, nbytes)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        for t in tree_flatten((args, kwargs))[0]:
            if isinstance(t, torch.Tensor):
                self._note(t, new=False)
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self._note(t, new=True)
        return out


def tensor_bytes(modules: Iterable[torch.nn.Module], device: torch.device) -> int:
    """The bytes of the parameters and buffers of ``modules`` on ``device`` (its type), each
    storage once (modules that share tensors count them once)."""
    seen: dict[int, int] = {}
    for module in modules:
        for t in list(module.parameters()) + list(module.buffers()):
            if t.device.type != device.type:
                continue
            storage = t.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


class ResidentLike(Protocol):
    """What :func:`measured_step` reads of the process's resident models."""

    def nbytes(self) -> int: ...


def model_key(model: object) -> str:
    """What names a model's measurements among the events of every run on a cluster:
    a digest of its settings (a :class:`~digenrl.config.ModelConfig`)."""
    return hashlib.sha256(repr(model).encode()).hexdigest()[:16]


#: (model key, latent shape) of each step this process has measured.
_MEASURED: set[tuple[str, tuple[int, ...]]] = set()
_LOCK = threading.Lock()


@contextmanager
def measured_step(model: object, shape: tuple[int, ...],
                  resident: ResidentLike) -> Iterator[None]:
    """Around a degree-1 step of ``model`` (its settings) on a chunk whose latents have
    ``shape`` (samples first): the first such step of this process on a Dask worker is
    measured and reported (:data:`EVENT_TOPIC`); every other runs as it is (a step that
    fails is measured again next time)."""
    worker = current_worker()
    key = (model_key(model), tuple(shape))
    with _LOCK:
        first = key not in _MEASURED
    if worker is None or not first:
        yield
        return
    with PeakBytes() as peak:
        yield
    with _LOCK:
        if key in _MEASURED:    # (another thread measured it meanwhile)
            return
        _MEASURED.add(key)
    worker.log_event(EVENT_TOPIC, {
        "model": key[0], "name": str(worker.name), "shape": list(shape),
        "samples": int(shape[0]), "transient_bytes": int(peak.peak),
        "resident_bytes": int(resident.nbytes())})


