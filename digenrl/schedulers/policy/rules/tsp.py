"""TSP (time-step parallelism): any trainer takes any micro-step.

With TSP every micro-step of a chunk is an independent task in one training queue, so
the micro-steps of a chunk spread over the trainers (and, with RAT, over idle rollout
workers). Without TSP a chunk's micro-steps all run on the one trainer the chunk maps
to (``trainers[chunk % n]``, by name), as in data-parallel training; when the trainers
change, the waiting micro-steps are mapped again.
"""

from __future__ import annotations

from collections import defaultdict

from digenrl.schedulers.policy.queues import ReadyEntry, ReadyHeap
from digenrl.schedulers.policy.rules import Pick, Rule
from digenrl.schedulers.policy.rules.pools import Pools
from digenrl.schedulers.policy.state import READY, TaskInfo, WorkerInfo
from digenrl.schedulers.policy.trail import RELEASED
from digenrl.vocabulary import ROLLOUT, TRAINER

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

    def queue(self, info: TaskInfo, entry: ReadyEntry) -> bool:
        """A ready training task waits for its trainer, or for any."""
        if info.pool == ROLLOUT:
            return False
        pin = self.pin_of(info)
        info.pin = pin
        (self.queues.pinned[pin] if pin else self.queues.training).push(entry)
        self.policy.new_training = True
        return True

    def worker_added(self, w: WorkerInfo) -> None:
        self.repin()

    def worker_removed(self, w: WorkerInfo) -> None:
        self.repin()

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

    def take(self, w: WorkerInfo, now: float) -> Pick | None:
        """A trainer (or a co-located worker) takes the most urgent training task it
        may run."""
        if self.options.pools and w.pool != TRAINER:
            return None
        top = self.queues.training_for(w.address)
        return Pick(top.info, self) if top is not None else None

    def taken(self, w: WorkerInfo, pick: Pick, now: float) -> None:
        """Note why ``w`` takes the training task it picked."""
        if pick.by is not self:
            return
        info, policy = pick.info, self.policy
        if info.pin is not None:
            policy.note(info, RELEASED, self.name, w,
                        "TSP is off: chunk {} trains on this trainer", info.chunk)
        else:
            policy.note(info, RELEASED, Pools.name, w,
                        "the most urgent training task (iteration {})", info.iteration)
