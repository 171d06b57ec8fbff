"""Checkpoint and restore tasks: the trainer state of a policy version to and from the
run's store. Restoring is a task without inputs, so a result recomputed after a worker
loss never needs more history than the newest checkpoint."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from digenrl.checkpoints import read_checkpoint, write_checkpoint
from digenrl.tasks.train import OptimizeOut
from digenrl.tasks.types import TrainerState

__all__ = ["CheckpointSpec", "save_state", "load_state"]


@dataclass(frozen=True)
class CheckpointSpec:
    store: str  # the run's store; every worker must be able to reach it


def save_state(spec: CheckpointSpec, version: int, out: OptimizeOut) -> int:
    """Write the state ``out`` holds as version ``version``'s checkpoint."""
    state = out.state
    assert state.version == version, (state.version, version)
    parts = {name: {k: t.detach().cpu().numpy() for k, t in tensors.items()}
             for name, tensors in (("params", state.params), ("exp_avg", state.exp_avg),
                                   ("exp_avg_sq", state.exp_avg_sq))}
    write_checkpoint(spec.store, version, parts, state.step)
    return version


def load_state(spec: CheckpointSpec, version: int) -> OptimizeOut:
    """Version ``version``'s trainer state, bit for bit as it was written."""
    parts, step = read_checkpoint(spec.store, version)
    tensors = {name: {k: torch.from_numpy(a.copy()) for k, a in arrays.items()}
               for name, arrays in parts.items()}
    return OptimizeOut(TrainerState(version=version, params=tensors["params"],
                                    exp_avg=tensors["exp_avg"],
                                    exp_avg_sq=tensors["exp_avg_sq"], step=step), None)
