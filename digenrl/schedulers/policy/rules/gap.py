"""GAP: the order of ready work, and decodes kept for the version change.

**Order.** Ready GPU tasks wait most urgent first: the oldest iteration, then (with GAP,
and for training) a chunk's work in order -- its steps by timestep, its decode, its
reward -- before the next chunk's, so groups finish one after another and a group's
training starts as soon as it is scored. Without GAP rollout is breadth-first (one
stage of every chunk before the next stage), and an iteration's training waits until
all its rollout work is done (the barrier: :mod:`.staleness`).

**Deferral.** While grads wait for the trainers (they are behind, and no group the
rollout workers score can be trained before the next version), a decode whose training
reads a version not yet published goes after every denoise step of its generation
instead of at its chunk's place: it can wait for the version change
(:meth:`.Facts.can_wait`). The generation's last steps then come first, the grads lent
next (:mod:`.rat`), and the decodes fill the wait for the new version's optimizer step
and weights. Once that version is published it takes its chunk's place again. A
decode that became ready while no grad waited (the trainers keep up) keeps its chunk's
place.
"""

from __future__ import annotations

from collections import defaultdict

from digenrl.schedulers.policy.queues import ReadyEntry
from digenrl.schedulers.policy.rules import Rule
from digenrl.schedulers.policy.state import READY, TaskInfo
from digenrl.schedulers.policy.trail import DEFERRED, REQUEUED
from digenrl.vocabulary import DECODE, ROLLOUT, stage_of

__all__ = ["Gap", "DEFER_OFFSET"]

#: Added to the chunk in a deferred decode's priority (:meth:`Gap.defers`): it then
#: comes after every step of its generation.
DEFER_OFFSET = 1 << 20


class Gap(Rule):
    """Orders ready work and keeps decodes for the version change."""

    __slots__ = ("deferred",)
    name = "GAP"

    def __init__(self, policy) -> None:
        super().__init__(policy)
        # Decodes queued after their generation's steps (see defers), by iteration.
        self.deferred: dict[int, list[TaskInfo]] = defaultdict(list)

    def order(self, info: TaskInfo, tie: int, queueing: bool) -> ReadyEntry:
        """``info``'s entry in a ready heap, ``tie`` breaking ties of priority (being
        queued, a decode may be deferred: :meth:`defers`)."""
        return self.entry(info, tie, queueing and self.defers(info))

    def entry(self, info: TaskInfo, tie: int, deferred: bool = False) -> ReadyEntry:
        """``info``'s entry in a ready heap, ``tie`` breaking ties of priority
        (``deferred``: see :meth:`defers`)."""
        stage = stage_of(info.kind, info.timestep)
        chunk = 1 << 30 if info.chunk is None else info.chunk
        if deferred:
            chunk += DEFER_OFFSET
        # Training, and rollout with GAP: older iterations first, a chunk's steps in
        # timestep order; rollout without GAP: breadth-first over chunks.
        if self.options.gap or info.pool != ROLLOUT:
            return ReadyEntry((info.iteration, chunk, stage), tie, info)
        return ReadyEntry((info.iteration, stage, chunk), tie, info)

    def defers(self, info: TaskInfo) -> bool:
        """Whether ``info``, becoming runnable, is a decode kept for the version change
        (then recorded so): with GAP, a chunk's decode whose training reads a version not
        published yet, while grads wait in the TSP queue (the trainers are behind)."""
        policy = self.policy
        if (self.options.gap and info.kind == DECODE and info.pool == ROLLOUT
                and info.chunk is not None and info.iteration > policy.version
                and self.queues.training.peek() is not None):
            self.deferred[info.iteration].append(info)
            if self.noting:
                policy.note(info, DEFERRED, self.name, None,
                            "a decode kept for the version change while grads wait (its "
                            "training reads version {}, published: {})", info.iteration,
                            policy.version)
            return True
        return False

    def published(self, info: TaskInfo) -> None:
        """A version was published: the deferred decodes whose training reads it, still
        waiting, are queued again at their chunk's place (an entry of a task is live
        while the task waits, so the first of its two entries taken releases it)."""
        policy = self.policy
        for it in [i for i in self.deferred if i <= policy.version]:
            for info in self.deferred.pop(it):
                if info.state is READY:
                    if self.noting:
                        policy.note(info, REQUEUED, self.name, None,
                                    "version {} published: back at its chunk's place",
                                    policy.version)
                    policy.enqueue(info)
