"""What the policy knows of tasks and workers, and the decisions it hands out.

A :class:`TaskInfo` is a task's annotation plus the policy's state of it, kept on the
task itself (every event reads several fields); a :class:`WorkerInfo` is a worker's
pool, slots and what is released to it; a :class:`Decision` is one release; the
:class:`Facts` are what several rules read (what has started, step times, the newest
published version), kept by the core and read through their methods.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Mapping

from digenrl.vocabulary import Key, DENOISE, GRAD, ROLLOUT

__all__ = ["Key", "TaskInfo", "WorkerInfo", "Decision", "Facts", "ADDED", "HELD", "READY",
           "RELEASED", "DONE", "FORGOTTEN", "QUEUED", "STEP_EWMA", "first_step", "tracked",
           "discard"]

#: Weight of the newest measurement in a worker's step time (and the grad time): a
#: slowdown shows within a few steps.
STEP_EWMA = 0.5


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
    #: (gang id, member index, size[, trainers]) of a member's part of a collective step,
    #: or None (:mod:`.rules.gang`).
    gang: tuple[int, ...] | None = None
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
                   samples=int(meta.get("samples") or 0),
                   gang=tuple(meta["gang"]) if meta.get("gang") is not None else None)


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
    lent: int = 0                    # GPU tasks of the other pool released to it
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


class Facts:
    """What several rules read, kept in one place by the core; rules read it only.

    * **The newest published version** (:attr:`version`).
    * **What has started**: the denoise steps and grads of each iteration not released
      yet, the chunks whose first step is not released yet (by iteration and version
      read), the newest iteration a grad has been released of; from them, the work that
      *can wait* for the version change (:meth:`can_wait`).

      With one-step staleness both pools meet at every version change: the next
      iteration's micro-steps and the generation after it both read the version the
      optimizer step is about to publish. Between an iteration's last grad and the new
      version's weights arriving on the rollout workers, only work that reads no policy
      version can run, and a generation has such work: the decodes and rewards of its
      chunks. Their results feed only that generation's training, which reads the
      version being made, so nothing needs them before the version change, while the
      version change waits for every grad. GAP keeps such decodes for the version
      change, RAT lends a grad before such work, and the last idle trainer does not take
      it while the optimizer step comes next (TAG).
    * **Step times**: each worker's seconds per sample-step (a moving average over its
      finished denoise steps), the speed-1 seconds per sample-step over every worker and
      of a grad micro-step, the sample-steps released to each worker and when its
      released GPU work should end (with ``busy``: only rebalancing reads it).
    """

    __slots__ = ("version", "tasks", "workers", "bandwidth", "busy", "waiting",
                 "unstarted", "grads_from", "ref_step", "ref_grad", "clock")

    def __init__(self, tasks: Mapping[Key, TaskInfo], workers: Mapping[str, WorkerInfo],
                 bandwidth: float, clock, busy: bool) -> None:
        self.version = -1                          # newest published policy version
        self.tasks = tasks
        self.workers = workers
        self.bandwidth = bandwidth
        self.clock = clock
        self.busy = busy
        # Denoise steps and grads not released yet, by (kind, iteration).
        self.waiting: dict[tuple[str, int], set] = defaultdict(set)
        # The first steps of chunks not released yet, by (iteration, version read).
        self.unstarted: dict[tuple[int, int], set] = defaultdict(set)
        # The newest iteration a grad has been released of (None before the first).
        self.grads_from: int | None = None
        # Speed-1 seconds per sample-step (every worker) and of a grad, measured.
        self.ref_step: float | None = None
        self.ref_grad: float | None = None

    # ---------------------------------------------------- kept by the core

    def back(self, info: TaskInfo) -> None:
        """``info`` waits to be released (added, lost, or its release failed)."""
        if tracked(info):
            self.waiting[info.kind, info.iteration].add(info.key)
            if info.timestep == 0 and info.kind == DENOISE:     # a chunk's first step
                self.unstarted[info.iteration, info.policy_version].add(info.key)

    def gone(self, info: TaskInfo) -> None:
        """``info`` no longer waits to be released (released, or forgotten)."""
        if tracked(info):
            discard(self.waiting, (info.kind, info.iteration), info.key)
            if info.timestep == 0 and info.kind == DENOISE:     # a chunk's first step
                discard(self.unstarted, (info.iteration, info.policy_version), info.key)

    def released(self, info: TaskInfo, w: WorkerInfo, now: float) -> None:
        """GPU task ``info`` was released to ``w``."""
        if info.kind == GRAD:
            if self.grads_from is None or info.iteration > self.grads_from:
                self.grads_from = info.iteration
        self.gone(info)
        if info.kind == DENOISE:
            w.step_samples += info.sample_steps
        if self.busy:
            # (Only denoise steps are expected to take time.)
            w.busy_until = max(now, w.busy_until) + self.expected(w, info)

    def unreleased(self, info: TaskInfo, w: WorkerInfo) -> None:
        """GPU task ``info`` left ``w`` (finished, lost or forgotten)."""
        if info.kind == DENOISE:
            w.step_samples -= info.sample_steps
        if self.busy:
            n = w.step_samples
            step = self.step_time(w) if n else None
            w.busy_until = self.clock() + (step * n if step is not None else 0.0)

    def done(self, info: TaskInfo, worker: str | None, duration: float | None) -> None:
        """``info`` computed for ``duration`` seconds on ``worker``: a denoise step's or
        a grad's time is measured."""
        if duration is None or duration <= 0 or worker is None:
            return
        w = self.workers.get(worker)
        if w is None:
            return
        if info.kind == DENOISE:
            per_sample = duration / info.sample_steps
            a = STEP_EWMA
            w.step_time = (per_sample if w.step_time is None
                           else (1 - a) * w.step_time + a * per_sample)
            ref = per_sample * w.speed
            self.ref_step = ref if self.ref_step is None else 0.9 * self.ref_step + 0.1 * ref
        elif info.kind == GRAD:
            ref = duration * w.speed
            a = STEP_EWMA
            self.ref_grad = ref if self.ref_grad is None else (1 - a) * self.ref_grad + a * ref

    # ---------------------------------------------------- what has started

    def left(self, kind: str, iteration: int) -> bool:
        """Whether a ``kind`` task (``denoise`` or ``grad``) of ``iteration`` is yet to
        be released."""
        return (kind, iteration) in self.waiting

    def can_wait(self, info: TaskInfo) -> bool:
        """Whether rollout task ``info`` can wait for the next version change: it
        finishes a chunk (a decode or a reward, not a denoise step) of a generation
        whose every step has been released, and whose training reads a version not
        published yet. Nothing needs it before the trainers publish that version, and
        the version waits for their grads, then their optimizer step: work that can
        wait goes after them, and fills the wait for the new version's weights."""
        return (info.pool == ROLLOUT and info.kind != DENOISE
                and info.iteration > self.version
                and (DENOISE, info.iteration) not in self.waiting)

    def grads_all_released(self) -> bool:
        """Whether every grad of the iteration being trained (the one reading the
        newest version) has been released: its reduction and optimizer step come next."""
        v = self.version
        return self.grads_from == v and (GRAD, v) not in self.waiting

    def unstarted_chunks(self, last_iteration: int) -> int:
        """Chunks whose first step has not been released, of an iteration up to
        ``last_iteration``, that read a published version."""
        version = self.version
        return sum(len(keys) for (it, read), keys in self.unstarted.items()
                   if it <= last_iteration and read <= version)

    # ---------------------------------------------------- step times

    def transfer_seconds(self, w: WorkerInfo, info: TaskInfo) -> float:
        """Seconds to move the input bytes of ``info`` that ``w`` lacks."""
        loc = info.locality or {}
        return (sum(loc.values()) - loc.get(w.address, 0)) / self.bandwidth

    def step_time(self, w: WorkerInfo) -> float | None:
        """Expected seconds per sample-step on ``w``: measured, else from its speed."""
        if w.step_time is not None:
            return w.step_time
        return self.ref_step / w.speed if self.ref_step is not None else None

    def expected(self, w: WorkerInfo, info: TaskInfo) -> float:
        """Expected seconds of ``info`` on ``w`` (denoise steps; others count 0)."""
        if info.kind != DENOISE:
            return 0.0
        step = self.step_time(w)
        return step * info.sample_steps if step is not None else 0.0

    def finish_time(self, w: WorkerInfo, info: TaskInfo, now: float) -> float:
        """When ``w`` would finish ``info`` if it took it now: after its released work,
        the transfer of the input bytes it lacks, then the step at its pace."""
        return max(now, w.busy_until) + self.transfer_seconds(w, info) + self.expected(w, info)

    def expected_seconds(self, key: Key) -> float | None:
        """Expected seconds of ``key``, a released GPU task, on its worker: moving the
        input bytes it lacks there, then the worker's seconds per sample-step times the
        task's samples (a denoise step and a training micro-step go over the same
        samples). None before any measurement."""
        info = self.tasks.get(key)
        if info is None or not info.where or not info.gpu:
            return None
        w = self.workers.get(info.where)
        step = self.step_time(w) if w is not None else None
        if w is None or step is None:
            return None
        return self.transfer_seconds(w, info) + step * max(info.samples, 1)

    def longest_expected(self) -> float | None:
        """The longest :meth:`expected_seconds` a known task could have on any worker."""
        steps = [s for s in map(self.step_time, self.workers.values()) if s is not None]
        if not steps:
            return None
        samples = max((info.samples for info in self.tasks.values() if info.gpu), default=1)
        return max(steps) * max(samples, 1)
