"""What the policy knows of tasks and workers, and the decisions it hands out.

A :class:`TaskInfo` is a task's annotation plus the policy's state of it, kept on the
task itself (every event reads several fields); a :class:`WorkerInfo` is a worker's
pool, slots and what is released to it; a :class:`Decision` is one release.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Hashable, Mapping

from digenrl.vocabulary import DENOISE, GRAD, ROLLOUT

__all__ = ["Key", "TaskInfo", "WorkerInfo", "Decision", "ADDED", "HELD", "READY", "RELEASED",
           "DONE", "FORGOTTEN", "QUEUED", "first_step", "tracked", "discard"]

Key = Hashable

# Task states inside the policy.
ADDED, HELD, READY, RELEASED, DONE, FORGOTTEN = ("added", "held", "ready", "released",
                                                 "done", "forgotten")

#: The states in which a task is already ready, held or running.
QUEUED = frozenset({READY, HELD, RELEASED})


@dataclass(slots=True)
class TaskInfo:
    """What the policy knows of a task: its annotation, nothing from its key."""

    key: Key
    kind: str
    pool: str
    iteration: int
    policy_version: int
    gpu: bool
    timestep: int | None = None
    chunk: int | None = None
    group: int | None = None
    behaviour_version: int | None = None
    samples: int = 0
    # The policy's state of the task (not part of the annotation): kept on the task
    # itself rather than in a dict per field, since every event reads several of them.
    state: str = field(default=ADDED, compare=False, repr=False)
    order: int = field(default=0, compare=False, repr=False)       # arrival: breaks ties
    where: str | None = field(default=None, compare=False, repr=False)  # released to
    locality: Mapping[str, int] | None = field(default=None, compare=False, repr=False)
    ready_since: float | None = field(default=None, compare=False, repr=False)
    eligible_since: float | None = field(default=None, compare=False, repr=False)
    affinity: str | None = field(default=None, compare=False, repr=False)
    pin: str | None = field(default=None, compare=False, repr=False)
    pending: bool = field(default=False, compare=False, repr=False)  # rollout outstanding
    #: The decisions noted on it (:mod:`digenrl.schedulers.policy.trail`), or None.
    trail: list | None = field(default=None, compare=False, repr=False)
    #: The sample-steps a ``denoise`` task computes: its samples, at least one.
    sample_steps: int = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        self.sample_steps = max(self.samples, 1)

    @classmethod
    def from_meta(cls, key: Key, meta: Mapping[str, Any]) -> "TaskInfo":
        return cls(key=key, kind=meta["kind"], pool=meta["pool"],
                   iteration=int(meta["iteration"]),
                   policy_version=int(meta["policy_version"]), gpu=bool(meta["gpu"]),
                   timestep=meta.get("timestep"), chunk=meta.get("chunk"),
                   group=meta.get("group"), behaviour_version=meta.get("behaviour_version"),
                   samples=int(meta.get("samples") or 0))


@dataclass(slots=True)
class WorkerInfo:
    address: str
    name: str
    pool: str
    gpus: int
    slots: int                  # GPU tasks released at once: gpus x slots_per_worker
    speed: float = 1.0
    inflight: set = field(default_factory=set)      # GPU tasks released, not finished
    cpu_inflight: set = field(default_factory=set)  # other tasks released, not finished
    tag_inflight: int = 0            # rollout tasks released to it as a trainer (TAG)
    rat_inflight: int = 0            # grads released to it as a rollout worker (RAT)
    step_time: float | None = None   # measured seconds per sample-step (moving average)
    busy_until: float = 0.0          # when its released GPU work is expected to end
    step_samples: int = 0            # sample-steps of the denoise tasks it was released
    rank: int = 0                    # its place among all workers by name (then address)


@dataclass(slots=True)
class Decision:
    key: Key
    worker: str
    time: float
    tag: bool = False          # a rollout task released to a trainer
    stolen: bool = False       # taken from another worker's affinity
    rat: bool = False          # a grad released to a rollout worker
    info: TaskInfo | None = field(default=None, compare=False, repr=False)  # the task


def first_step(info: TaskInfo) -> bool:
    """Whether ``info`` is the first denoising step of a rollout chunk."""
    return info.kind == DENOISE and info.timestep == 0 and info.pool == ROLLOUT


def tracked(info: TaskInfo) -> bool:
    """Whether the policy follows ``info`` until its release: a generation's denoise
    step or a training micro-step."""
    return (info.kind == DENOISE and info.pool == ROLLOUT) or info.kind == GRAD


def discard(table: dict[Any, set], at: Any, key: Key) -> None:
    """Drop ``key`` from ``table[at]``, and the entry once it is empty."""
    waiting = table.get(at)
    if waiting is not None:
        waiting.discard(key)
        if not waiting:
            del table[at]
