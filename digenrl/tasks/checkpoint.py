"""Checkpoint and restore tasks: the trainer state of a policy version to and from the
run's store. Restoring a checkpointed version is a task without inputs, so a result
recomputed after a worker loss never needs more history than the newest checkpoint; a
version the run does not checkpoint (``store.checkpoint_every``) is restored from the
optimizer step that made it, an input.

A restore first looks for the state in the memory of the worker running it: the
scheduler sends it to the worker whose optimizer step made the state while the
checkpoint is being written, so a version is published without waiting for that write
and the read after it. The state taken from memory is the one the checkpoint holds, bit
for bit."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import torch

from digenrl.store import SAMPLING_PART
from digenrl.store.checkpoints import read_checkpoint, write_checkpoint
from digenrl.tasks.train import OptimizeOut
from digenrl.tasks.types import TrainerState
from digenrl.tasks.worker import current_worker

if TYPE_CHECKING:
    from dask.typing import Key

__all__ = ["CheckpointSpec", "save_state", "load_state"]

#: The checkpoint part holding a version's sampling copy, where its algorithm keeps one.


@dataclass(frozen=True)
class CheckpointSpec:
    store: str  # the run's store; every worker must be able to reach it


def save_state(spec: CheckpointSpec, version: int, out: OptimizeOut) -> int:
    """Write the state ``out`` holds as version ``version``'s checkpoint."""
    state = out.state
    assert state.version == version, (state.version, version)
    named = [("params", state.params), ("exp_avg", state.exp_avg),
             ("exp_avg_sq", state.exp_avg_sq)]
    if state.sampling is not None:  # an algorithm's sampling copy (DiffusionNFT)
        named.append((SAMPLING_PART, state.sampling))
    parts = {name: {k: t.detach().cpu().numpy() for k, t in tensors.items()}
             for name, tensors in named}
    write_checkpoint(spec.store, version, parts, state.step)
    return version


def load_state(spec: CheckpointSpec, version: int,
               maker: Key | OptimizeOut | None = None) -> OptimizeOut:
    """Version ``version``'s trainer state, bit for bit as it was written: the result of
    ``maker`` (the key of the task that made the state) when this worker holds it, else
    read from the checkpoint. A version the run does not checkpoint has its maker's
    result as an input (``maker`` is that result)."""
    held: OptimizeOut | None
    if isinstance(maker, OptimizeOut):
        held = maker
    else:
        held = _in_memory(maker) if maker is not None else None
    if held is not None:
        assert held.state.version == version, (held.state.version, version)
        return OptimizeOut(held.state, None)
    parts, step = read_checkpoint(spec.store, version)
    tensors = {name: {k: torch.from_numpy(a.copy()) for k, a in arrays.items()}
               for name, arrays in parts.items()}
    return OptimizeOut(TrainerState(version=version, params=tensors["params"],
                                    exp_avg=tensors["exp_avg"],
                                    exp_avg_sq=tensors["exp_avg_sq"], step=step,
                                    sampling=tensors.get(SAMPLING_PART)), None)


def _in_memory(key: Key) -> OptimizeOut | None:
    """The result of ``key`` if the Dask worker running this task holds it."""
    worker = current_worker()
    if worker is None:
        return None
    try:
        return cast(OptimizeOut, worker.data[key])    # (an optimize task's result)
    except KeyError:
        return None

