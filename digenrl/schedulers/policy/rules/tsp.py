"""TSP (time-step parallelism): any trainer takes any micro-step.

With TSP every micro-step of a chunk is an independent task in one training queue, so
the micro-steps of a chunk spread over the trainers (and, with RAT, over idle rollout
workers). Without TSP a chunk's micro-steps all run on the one trainer the chunk maps
to (``trainers[chunk % n]``, by name), as in data-parallel training; when the trainers
change, the waiting micro-steps are mapped again.
"""

from __future__ import annotations

from collections import defaultdict

from digenrl.schedulers.policy.queues import ReadyHeap, more_urgent
from digenrl.schedulers.policy.rules import Rule
from digenrl.schedulers.policy.state import READY, TaskInfo, WorkerInfo
from digenrl.schedulers.policy.trail import RELEASED

__all__ = ["Tsp"]


class Tsp(Rule):
    """Which trainer a ready training task waits for: any (TSP), or its chunk's."""

    __slots__ = ()
    name = "TSP"

    def pin_of(self, info: TaskInfo) -> str | None:
        """The trainer training task ``info`` must run on (None: any)."""
        policy = self.policy
        if self.options.tsp or info.chunk is None:
            return None
        trainers = policy.trainers()
        if not trainers:
            return None
        return trainers[info.chunk % len(trainers)].address

    def repin(self) -> None:
        """Trainer membership changed: re-target pinned ready tasks."""
        policy = self.policy
        if self.options.tsp:
            return
        entries = ([e for heap in self.queues.pinned.values() for e in heap]
                   + list(self.queues.training))
        self.queues.pinned = defaultdict(ReadyHeap)
        self.queues.training = ReadyHeap()
        for entry in entries:
            info = entry.info
            if info.state is not READY:
                continue
            pin = self.pin_of(info)
            info.pin = pin
            (self.queues.pinned[pin] if pin else self.queues.training).push(entry)
        policy.new_training = True

    def runnable(self, w: WorkerInfo) -> bool:
        """Whether trainer ``w`` has training work it may run."""
        pinned = self.queues.pinned.get(w.address)
        return (self.queues.training.peek() is not None
                or (pinned is not None and pinned.peek() is not None))

    def note_taken(self, info: TaskInfo, w: WorkerInfo) -> None:
        """Note why ``w`` takes training task ``info`` (:meth:`take`)."""
        policy = self.policy
        if info.pin is not None:
            policy.note(info, RELEASED, self.name, w,
                        "TSP is off: chunk {} trains on this trainer", info.chunk)
        else:
            policy.note(info, RELEASED, policy.pools.name, w,
                        "the most urgent training task (iteration {})", info.iteration)

    def take(self, w: WorkerInfo) -> TaskInfo | None:
        """The most urgent training task ``w`` may run (None: none)."""
        pinned = self.queues.pinned.get(w.address)
        own = pinned.peek() if pinned is not None else None
        pick = more_urgent(own, self.queues.training.peek())
        return pick.info if pick is not None else None
