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

from digenrl.schedulers.policy.queues import ReadyEntry
from digenrl.schedulers.policy.rules import Pick, Rule
from digenrl.schedulers.policy.state import TaskInfo, WorkerInfo, first_step
from digenrl.schedulers.policy.trail import KEPT, RELEASED, STOLEN
from digenrl.vocabulary import BACKGROUND_KINDS, DENOISE, NOISE, ROLLOUT, TRAINER

__all__ = ["Rebalance"]


class Rebalance(Rule):
    """Measures step times and decides whether an idle worker may steal a step."""

    __slots__ = ("chunk_home",)
    name = "rebalance"

    def __init__(self, policy) -> None:
        super().__init__(policy)
        # (iteration, chunk) -> the worker that drew the chunk's noise.
        self.chunk_home: dict[tuple, str] = {}

    def done(self, info: TaskInfo, worker: str | None, duration: float | None) -> None:
        """A chunk's noise was drawn on ``worker`` (its step times are in the facts)."""
        if info.kind == NOISE and worker is not None:
            self.noise_drawn(info, worker)

    def forgotten(self, info: TaskInfo, held: bool) -> None:
        if info.kind == NOISE:
            self.noise_forgotten(info)

    # -------------------------------------------------------------- where steps go

    def noise_drawn(self, info: TaskInfo, worker: str) -> None:
        """Chunk ``info``'s noise was drawn on ``worker``: its home without rebalancing."""
        self.chunk_home[(info.iteration, info.chunk)] = worker

    def noise_forgotten(self, info: TaskInfo) -> None:
        self.chunk_home.pop((info.iteration, info.chunk), None)

    def queue(self, info: TaskInfo, entry: ReadyEntry) -> bool:
        """A ready rollout task waits for the worker holding most of its inputs (a
        chunk's first step: see :meth:`first_step_home`), or for any worker."""
        if info.pool != ROLLOUT or info.kind in BACKGROUND_KINDS:
            return False
        queues = self.queues
        if info.timestep == 0 and info.kind == DENOISE:
            aff = self.first_step_home(info)
        else:
            aff = self.policy.affinity_of(info.locality or {})
        info.affinity = aff
        if aff:
            queues.affine[aff].push(entry)
            # Only steps waiting for a worker can be stolen: every worker sees the
            # shared ones first anyway.
            queues.stealable.push(entry)
        else:
            queues.shared.push(entry)
        self.policy.new_rollout = True
        return True

    def first_step_home(self, info: TaskInfo) -> str | None:
        """Where a chunk's first step waits. With rebalancing, nowhere: the chunk starts
        on whichever worker frees first, so faster workers start more chunks. Without,
        on the rollout worker that drew its noise: noise is dealt round-robin, so each
        worker gets an equal share of the chunks, as in data-parallel generation."""
        if self.options.rebalance:
            return None
        home = self.chunk_home.get((info.iteration, info.chunk))
        return home if home in self.workers else None

    def lets(self, w: WorkerInfo, info: TaskInfo, now: float) -> bool:
        return self.may_steal(w, info, now)

    def may_steal(self, w: WorkerInfo, info: TaskInfo, now: float) -> bool:
        """Whether ``w`` may take ``info``, a step waiting for another worker."""
        policy, facts = self.policy, self.facts
        owner = self.workers.get(info.affinity or "")
        if owner is None or owner is w:
            return True
        if not self.options.rebalance:
            # Pinned: a chunk waits for the rollout worker holding its latents.
            return owner.pool != ROLLOUT
        if info.kind != DENOISE or facts.step_time(w) is None or facts.step_time(owner) is None:
            return True  # not a timestep, or nothing measured yet: any idle worker helps
        step = facts.expected(owner, info)
        # The move must cost less than the step it moves, and the step must end before
        # the owner would get through its released work, this step and the slots' worth
        # after it: an idle worker is capacity, but not at any delay to the chunk.
        if (facts.transfer_seconds(w, info) < step and facts.finish_time(w, info, now)
                <= facts.finish_time(owner, info, now) + self.options.slots_per_worker * step):
            return True
        policy.count("kept")
        if self.noting:
            policy.note(info, KEPT, self.name, w,
                        "the move costs more than it gains: moving takes {:.3g} s for a "
                        "{:.3g} s step; it would finish in {:.3g} s here, in {:.3g} s on {} "
                        "(+ {} steps allowed)", facts.transfer_seconds(w, info), step,
                        facts.finish_time(w, info, now) - now,
                        facts.finish_time(owner, info, now) - now, owner.name,
                        self.options.slots_per_worker)
        return False

    def taken(self, w: WorkerInfo, pick: Pick, now: float) -> None:
        """Note a stolen step, and a chunk's first step a worker of its pool takes."""
        info = pick.info
        if pick.stolen:
            self.note_stolen(info, w, now)
        elif (self.options.rebalance and first_step(info) and info.affinity != w.address
              and w.pool != TRAINER):
            self.policy.note(info, RELEASED, self.name, w,
                             "a chunk's first step starts on whichever worker frees first")

    def note_stolen(self, info: TaskInfo, w: WorkerInfo, now: float) -> None:
        """Note why ``w`` takes ``info``, a step waiting for another worker (before its
        release, while the finish times :meth:`may_steal` compared still hold)."""
        policy, facts = self.policy, self.facts
        owner = self.workers.get(info.affinity or "")
        if owner is None:
            policy.note(info, STOLEN, self.name, w, "the worker holding its inputs is gone")
        elif not self.options.rebalance:
            policy.note(info, STOLEN, self.name, w,
                        "from {}, a trainer: only a rollout worker keeps its chunk's steps",
                        owner.name)
        elif (info.kind != DENOISE or facts.step_time(w) is None
              or facts.step_time(owner) is None):
            policy.note(info, STOLEN, self.name, w,
                        "from {}: nothing to compare yet (not a timestep, or no step "
                        "measured), and an idle worker helps", owner.name)
        else:
            policy.note(info, STOLEN, self.name, w,
                        "from {}: finishes in {:.3g} s here against {:.3g} s there "
                        "(+ {} steps of {:.3g} s allowed); moving takes {:.3g} s", owner.name,
                        facts.finish_time(w, info, now) - now,
                        facts.finish_time(owner, info, now) - now,
                        self.options.slots_per_worker, facts.expected(owner, info),
                        facts.transfer_seconds(w, info))
