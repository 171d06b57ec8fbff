"""The ready queues: ready GPU tasks in heaps, the most urgent first.

Which heap a task waits in and its priority are the rules' say (the pools, TSP, GAP and
rebalancing rules); the heaps only keep the order and drop what is no longer ready.
"""

from __future__ import annotations

import heapq
from collections import defaultdict
from typing import Mapping, NamedTuple

from digenrl.schedulers.policy.state import READY, Key, TaskInfo

__all__ = ["ReadyEntry", "ReadyHeap", "ReadyQueues", "more_urgent"]


class ReadyEntry(NamedTuple):
    """A ready task's place in a :class:`ReadyHeap`."""

    #: (iteration, chunk, stage), or for rollout without GAP (iteration, stage, chunk).
    priority: tuple[int, int, int]
    tie: int           # unique to the entry, so the task itself is never compared
    info: TaskInfo


def more_urgent(a: ReadyEntry | None, b: ReadyEntry | None) -> ReadyEntry | None:
    if a is None:
        return b
    if b is None:
        return a
    return b if b < a else a


class ReadyHeap:
    """Ready GPU tasks, the most urgent first.

    A task may wait in more than one heap (its worker's and the stealable ones), or
    twice in one (queued again at a new priority), and stops being ready when it is
    released, lost or forgotten; its entries stay where they are and are dead from then
    on: an entry is live while its task is READY.
    :meth:`peek` drops the dead entries it finds on top.
    """

    __slots__ = ("entries", "dead")

    def __init__(self) -> None:
        self.entries: list[ReadyEntry] = []
        self.dead = 0        # entries known dead (see :meth:`one_dead`)

    def __iter__(self):
        return iter(self.entries)

    def push(self, entry: ReadyEntry) -> None:
        heapq.heappush(self.entries, entry)

    def peek(self) -> ReadyEntry | None:
        """The most urgent live entry (None when there is none)."""
        entries = self.entries
        while entries:
            top = entries[0]
            if top.info.state is READY:
                return top
            heapq.heappop(entries)
        return None

    def one_dead(self) -> None:
        """One more entry is dead (its task was taken from another heap). Once the dead
        are half the heap they are dropped in one pass, cheaper than popping each."""
        self.dead += 1
        if self.dead > 256 and 2 * self.dead > len(self.entries):
            self.entries = [e for e in self.entries if e.info.state is READY]
            heapq.heapify(self.entries)
            self.dead = 0


class ReadyQueues:
    """Where the ready tasks wait: the core's, read by the rules."""

    __slots__ = ("shared", "affine", "stealable", "training", "pinned", "background", "cpu")

    def __init__(self) -> None:
        # GPU rollout tasks: with no affinity, with affinity to a worker (by worker), and
        # the affine ones again (those another worker may steal).
        self.shared = ReadyHeap()
        self.affine: dict[str, ReadyHeap] = defaultdict(ReadyHeap)
        self.stealable = ReadyHeap()
        # GPU training tasks: one heap (TSP), or one per trainer a task is pinned to.
        self.training = ReadyHeap()
        self.pinned: dict[str, ReadyHeap] = defaultdict(ReadyHeap)
        # GPU background tasks (evaluation): taken only by idle workers.
        self.background = ReadyHeap()
        # Tasks needing no GPU slot, with their input locality.
        self.cpu: dict[Key, Mapping[str, int]] = {}

    def training_for(self, address: str) -> ReadyEntry | None:
        """The most urgent training task trainer ``address`` may run (None: none)."""
        pinned = self.pinned.get(address)
        return more_urgent(pinned.peek() if pinned is not None else None,
                           self.training.peek())
