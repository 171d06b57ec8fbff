"""The progress watchdog's decisions: pure code, no Dask.

Dask can lose track of a task without failing it: the scheduler holds it as processing
on a worker that will never run it (after a worker loss, a task can wait on an input its
worker holds as ``released`` with no ``who_has`` after a cancelled fetch). Nothing in Dask
notices; the run would wait forever. The watchdog notices it from what the scheduler
knows -- how long each task has been processing on its worker, what that worker reports
executing in its heartbeats, and how long the policy expects the task to take -- and
says which tasks to take back (the plugin takes them back through their worker, as work
stealing does, so the policy decides them again).

A task is taken back when it has been processing on a running worker for longer than
its *grace* -- ``GRACE_FACTOR`` times its expected seconds, at least the floor -- and its
worker has executed nothing for longer than that grace as well. A worker that executes
something is making progress (a task released to it waits for a slot there); a paused
worker is explained, not lost, and is left alone (the run's stall check names it). A
task still processing on a worker the scheduler no longer lists is an *orphan*: a
worker's removal moves every task it processed back at once, so one left behind (a
transition failed in the middle of the removal) waits for a worker that will never
answer, and it is taken back at once, without asking that worker.

The run's *stall timeout* is the other bound: when no GPU task has finished for that
long and the watchdog has nothing left to try, the run stops and says what it waits for.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Mapping

from digenrl.vocabulary import Key

__all__ = ["Processing", "TakeBack", "Watchdog", "GRACE_FACTOR", "GRACE_FLOOR",
           "STALL_FACTOR", "STALL_FLOOR", "stall_timeout", "RunStalled"]

#: A task is overdue after this many times its expected seconds...
GRACE_FACTOR = 10.0
#: ...and never before this many seconds (nor before a fifth of the stall timeout, so
#: the watchdog acts well before the run would stop).
GRACE_FLOOR = 30.0
#: The default stall timeout: this many times the longest expected task...
STALL_FACTOR = 50.0
#: ...and at least this many seconds (a model's first load, a slow first step).
STALL_FLOOR = 600.0


class RunStalled(RuntimeError):
    """No GPU task finished for the stall timeout and the progress watchdog has nothing
    left to try (``schedule.stall_timeout``): the message names what the run waits for.
    The store keeps the complete iterations before it."""


def stall_timeout(configured: float | None, longest_expected: float | None) -> float:
    """Seconds without a finished GPU task after which a run stops: ``configured``, or
    by default ``STALL_FACTOR`` times the longest expected task, at least ``STALL_FLOOR``."""
    if configured is not None:
        return float(configured)
    return max(STALL_FLOOR, STALL_FACTOR * (longest_expected or 0.0))


@dataclass(frozen=True)
class Processing:
    """A task the scheduler holds as processing on ``worker`` since ``since``."""

    key: Key
    worker: str
    since: float
    expected: float | None = None   # the policy's expected seconds, None: unknown


@dataclass(frozen=True)
class TakeBack:
    """The decision to take ``key`` back from ``worker``, and why."""

    key: Key
    worker: str
    why: str
    orphan: bool = False   # its worker is gone: take it back without asking it


class Watchdog:
    """Feed it what the workers execute (:meth:`observe`); :meth:`overdue` says which
    processing tasks to take back."""

    def __init__(self, floor: float = GRACE_FLOOR, factor: float = GRACE_FACTOR):
        self.floor = floor
        self.factor = factor
        #: worker -> since when it has executed nothing (absent: executing now).
        self._idle_since: dict[str, float] = {}

    def grace(self, expected: float | None) -> float:
        """Seconds a task may wait on a worker that runs nothing."""
        return max(self.floor, self.factor * (expected or 0.0))

    def observe(self, now: float, executing: Mapping[str, bool]) -> None:
        """``executing``: for every worker, whether it reports executing anything."""
        idle = self._idle_since
        for worker in [w for w in idle if w not in executing]:
            del idle[worker]
        for worker, busy in executing.items():
            if busy:
                idle.pop(worker, None)
            else:
                idle.setdefault(worker, now)

    def overdue(self, now: float, tasks: Iterable[Processing],
                running: Mapping[str, bool]) -> list[TakeBack]:
        """The tasks to take back now: processing for longer than their grace on a
        running worker that has executed nothing for longer than that grace, or on a
        worker absent from ``running`` (every worker the scheduler lists) at all."""
        out = []
        for t in tasks:
            if t.worker not in running:
                out.append(TakeBack(t.key, t.worker, "processing on a worker the scheduler "
                                    "no longer lists", orphan=True))
                continue
            idle_since = self._idle_since.get(t.worker)
            if idle_since is None or not running.get(t.worker, False):
                continue
            grace = self.grace(t.expected)
            waited, idle = now - t.since, now - idle_since
            if waited > grace and idle > grace:
                expected = "unknown" if t.expected is None else f"{t.expected:.3g} s"
                out.append(TakeBack(t.key, t.worker, (
                    f"processing for {waited:.0f} s (expected {expected}, grace "
                    f"{grace:.0f} s) on a worker that has executed nothing for {idle:.0f} s")))
        return out
