"""Straggler rebalancing (``rebalance``): timesteps move off slow workers.

The policy learns each worker's seconds per sample-step from its finished denoise tasks
(a moving average that shows a slowdown within a few steps; before a worker's first
step, the other workers' measurements scaled by its declared ``speed``) and keeps when
each worker's released GPU work should end. A chunk's first step waits for no one: it
starts on whichever worker frees first, so faster workers start more chunks. A worker
with nothing of its own takes (steals) the most urgent step waiting for another worker
when

* moving the step's input bytes (at ``transfer_bandwidth``) costs less than the step
  itself on the worker holding them, and
* it would finish the step no later than that worker would finish it plus
  ``slots_per_worker`` more steps: an idle worker is capacity, but not at any delay to
  the chunk.

So at every timestep boundary chunks move off slow or slowed-down workers (trainers
with nothing to train, under TAG, take them too), and a step stays where its latents
are when the move costs more than it gains (counted as ``kept``). Without rebalancing a
chunk runs every step on the rollout worker that drew its noise, and noise is dealt
round-robin: each rollout worker generates an equal share of the chunks whatever its
speed (data-parallel generation).
"""

from __future__ import annotations

from digenrl.schedulers.policy.rules import Rule
from digenrl.schedulers.policy.state import Key, TaskInfo, WorkerInfo
from digenrl.schedulers.policy.trail import KEPT, STOLEN
from digenrl.vocabulary import DENOISE, ROLLOUT

__all__ = ["Rebalance", "STEP_EWMA"]

#: Weight of the newest measurement in a worker's step time: a slowdown shows within a
#: few steps.
STEP_EWMA = 0.5


class Rebalance(Rule):
    """Measures step times and decides whether an idle worker may steal a step."""

    __slots__ = ("ref_step", "chunk_home", "_clock")
    name = "rebalance"

    def __init__(self, policy) -> None:
        super().__init__(policy)
        # Speed-1 seconds per sample-step, averaged over every worker.
        self.ref_step: float | None = None
        # (iteration, chunk) -> the worker that drew the chunk's noise.
        self.chunk_home: dict[tuple, str] = {}
        self._clock = policy.clock

    # ------------------------------------------------------------------ measuring

    def observed(self, info: TaskInfo, worker: str | None, duration: float | None) -> None:
        """Denoise step ``info`` computed for ``duration`` seconds on ``worker``."""
        if duration is not None and duration > 0 and worker is not None:
            w = self.workers.get(worker)
            if w is not None:
                per_sample = duration / info.sample_steps
                a = STEP_EWMA
                w.step_time = (per_sample if w.step_time is None
                               else (1 - a) * w.step_time + a * per_sample)
                ref = per_sample * w.speed
                self.ref_step = ref if self.ref_step is None else 0.9 * self.ref_step + 0.1 * ref

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

    def expected_seconds(self, key: Key) -> float | None:
        """Expected seconds of ``key``, a released GPU task, on its worker: moving the
        input bytes it lacks there, then the worker's seconds per sample-step times the
        task's samples (a denoise step and a training micro-step go over the same
        samples). None before any measurement."""
        policy = self.policy
        info = self.tasks.get(key)
        if info is None:
            return None
        w = self.workers.get(info.where) if info.where else None
        step = self.step_time(w) if w is not None and info.gpu else None
        if step is None:
            return None
        return policy.transfer_seconds(w, info) + step * max(info.samples, 1)

    def longest_expected(self) -> float | None:
        """The longest :meth:`expected_seconds` a known task could have on any worker."""
        steps = [s for s in map(self.step_time, self.workers.values()) if s is not None]
        if not steps:
            return None
        samples = max((info.samples for info in self.tasks.values() if info.gpu), default=1)
        return max(steps) * max(samples, 1)

    # ------------------------------------------------------- released work per worker

    def released(self, w: WorkerInfo, info: TaskInfo, now: float) -> None:
        """GPU task ``info`` was released to ``w``: its work ends later."""
        if info.kind == DENOISE:
            w.step_samples += info.sample_steps
        if self.options.rebalance:
            # (Only denoise steps are expected to take time.)
            w.busy_until = max(now, w.busy_until) + self.expected(w, info)

    def unreleased(self, w: WorkerInfo, info: TaskInfo) -> None:
        """GPU task ``info`` left ``w`` (finished, lost or forgotten)."""
        if info.kind == DENOISE:
            w.step_samples -= info.sample_steps
        if self.options.rebalance:
            n = w.step_samples
            step = self.step_time(w) if n else None
            w.busy_until = self._clock() + (step * n if step is not None else 0.0)

    def finish_time(self, w: WorkerInfo, info: TaskInfo, now: float) -> float:
        """When ``w`` would finish ``info`` if it took it now: after its released work,
        the transfer of the input bytes it lacks, then the step at its pace."""
        return (max(now, w.busy_until) + self.policy.transfer_seconds(w, info)
                + self.expected(w, info))

    # -------------------------------------------------------------- where steps go

    def noise_drawn(self, info: TaskInfo, worker: str) -> None:
        """Chunk ``info``'s noise was drawn on ``worker``: its home without rebalancing."""
        self.chunk_home[(info.iteration, info.chunk)] = worker

    def noise_forgotten(self, info: TaskInfo) -> None:
        self.chunk_home.pop((info.iteration, info.chunk), None)

    def first_step_home(self, info: TaskInfo) -> str | None:
        """Where a chunk's first step waits. With rebalancing, nowhere: the chunk starts
        on whichever worker frees first, so faster workers start more chunks. Without,
        on the rollout worker that drew its noise: noise is dealt round-robin, so each
        worker gets an equal share of the chunks, as in data-parallel generation."""
        if self.options.rebalance:
            return None
        home = self.chunk_home.get((info.iteration, info.chunk))
        return home if home in self.workers else None

    def may_steal(self, w: WorkerInfo, info: TaskInfo, now: float) -> bool:
        """Whether ``w`` may take ``info``, a step waiting for another worker."""
        policy = self.policy
        owner = self.workers.get(info.affinity or "")
        if owner is None or owner is w:
            return True
        if not self.options.rebalance:
            # Pinned: a chunk waits for the rollout worker holding its latents.
            return owner.pool != ROLLOUT
        if info.kind != DENOISE or self.step_time(w) is None or self.step_time(owner) is None:
            return True  # not a timestep, or nothing measured yet: any idle worker helps
        step = self.expected(owner, info)
        # The move must cost less than the step it moves, and the step must end before
        # the owner would get through its released work, this step and the slots' worth
        # after it: an idle worker is capacity, but not at any delay to the chunk.
        if (policy.transfer_seconds(w, info) < step and self.finish_time(w, info, now)
                <= self.finish_time(owner, info, now) + self.options.slots_per_worker * step):
            return True
        policy.count("kept")
        if self.noting:
            policy.note(info, KEPT, self.name, w,
                        "the move costs more than it gains: moving takes {:.3g} s for a "
                        "{:.3g} s step; it would finish in {:.3g} s here, in {:.3g} s on {} "
                        "(+ {} steps allowed)", policy.transfer_seconds(w, info), step,
                        self.finish_time(w, info, now) - now,
                        self.finish_time(owner, info, now) - now, owner.name,
                        self.options.slots_per_worker)
        return False

    def note_stolen(self, info: TaskInfo, w: WorkerInfo, now: float) -> None:
        """Note why ``w`` takes ``info``, a step waiting for another worker (before its
        release, while the finish times :meth:`may_steal` compared still hold)."""
        policy = self.policy
        owner = self.workers.get(info.affinity or "")
        if owner is None:
            policy.note(info, STOLEN, self.name, w, "the worker holding its inputs is gone")
        elif not self.options.rebalance:
            policy.note(info, STOLEN, self.name, w,
                        "from {}, a trainer: only a rollout worker keeps its chunk's steps",
                        owner.name)
        elif (info.kind != DENOISE or self.step_time(w) is None
              or self.step_time(owner) is None):
            policy.note(info, STOLEN, self.name, w,
                        "from {}: nothing to compare yet (not a timestep, or no step "
                        "measured), and an idle worker helps", owner.name)
        else:
            policy.note(info, STOLEN, self.name, w,
                        "from {}: finishes in {:.3g} s here against {:.3g} s there "
                        "(+ {} steps of {:.3g} s allowed); moving takes {:.3g} s", owner.name,
                        self.finish_time(w, info, now) - now,
                        self.finish_time(owner, info, now) - now,
                        self.options.slots_per_worker, self.expected(owner, info),
                        policy.transfer_seconds(w, info))
