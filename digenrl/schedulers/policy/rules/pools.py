"""Pools: a task runs only on a worker of its pool.

Rollout tasks (``encode``, ``noise``, ``denoise``, ``decode``, ``reward``, evaluation) run on
``rollout`` workers and training tasks on ``trainer`` workers; with ``pools`` off every
GPU worker is one ``colocated`` pool. A worker's pool comes from its own resources
(``rollout=1`` or ``trainer=1`` beside ``GPU=1``), never from worker order; an untagged
worker, or one without a GPU slot, is not used. TAG and RAT lend workers across the
pools (:mod:`.tag`, :mod:`.rat`); nothing else crosses them.

GPU tasks take a slot: at most ``slots_per_worker`` are released to a worker at once
(one runs, the others wait on the worker and hide the scheduler round trip). Tasks
that need no GPU are released at once to the worker of their pool holding most of
their input bytes (then the least loaded, then by name); without inputs on the pool,
and a chunk's ``noise`` always, to the next worker of the pool in turn.
"""

from __future__ import annotations

from typing import Mapping

from digenrl.schedulers.options import ScheduleOptions
from digenrl.schedulers.policy.rules import Pick, Rule
from digenrl.schedulers.policy.state import TaskInfo, WorkerInfo, first_step
from digenrl.schedulers.policy.trail import PLACED, RELEASED, WAITS
from digenrl.vocabulary import COLOCATED, NOISE, POOLS, ROLLOUT, TRAINER

__all__ = ["Pools", "pool_problem", "worker_pool"]


def pool_problem(info: TaskInfo) -> str | None:
    """Why ``info``'s pool is none a worker can serve (None when it is one)."""
    if info.pool not in POOLS:
        return f"pool: expected {ROLLOUT!r} or {TRAINER!r}, got {info.pool!r}"
    return None


def worker_pool(tag: str | None, options: ScheduleOptions) -> str | None:
    """The pool a worker tagged ``tag`` serves under ``options`` (None: it is not used)."""
    if not options.pools:
        return COLOCATED
    return tag if tag in POOLS else None


class Pools(Rule):
    """Where tasks without a GPU go, and what a rollout worker takes."""

    __slots__ = ()
    name = "pools"

    def pick(self, info: TaskInfo, loc: Mapping[str, int]) -> WorkerInfo | None:
        """The pool worker holding most input bytes of ``info`` (``loc``: worker -> bytes
        held); without inputs on the pool, the next worker of the pool in turn. A
        chunk's ``noise`` is always dealt in turn: it starts the chunk, which without
        rebalancing stays where it starts, so each worker gets an equal share of the
        chunks (its input, its groups' conditioning, is small and moves to it)."""
        if info.kind == NOISE:
            loc = {}
        # Most bytes first, then the least loaded, then by name.
        best, best_rank = None, None
        workers, pools = self.workers, self.options.pools
        for a, b in loc.items():
            w = workers.get(a) if b > 0 else None
            if w is None or (pools and w.pool != info.pool):
                continue
            rank = (-b, len(w.inflight) + len(w.cpu_inflight), w.name)
            if best_rank is None or rank < best_rank:   # (None: best is None)
                best, best_rank = w, rank
        if best is not None:
            return best
        return self.policy.in_turn(info.pool)

    def place(self, info: TaskInfo, loc: Mapping[str, int]) -> WorkerInfo | None:
        """Where ``info``, a task without a GPU slot, goes now (:meth:`pick`), noted."""
        w = self.pick(info, loc)
        policy = self.policy
        if self.noting:
            held = loc.get(w.address, 0) if w is not None else 0
            if w is None:
                policy.note(info, WAITS, self.name, None, "no worker serves its pool")
            elif info.kind == NOISE:
                policy.note(info, PLACED, self.name, w,
                            "a chunk's noise: dealt to the next worker in turn")
            elif held > 0:
                policy.note(info, PLACED, self.name, w,
                            "it holds most of the task's input bytes ({} bytes)", held)
            else:
                policy.note(info, PLACED, self.name, w,
                            "no input on the pool: the next worker in turn")
        return w

    def take(self, w: WorkerInfo, now: float) -> Pick | None:
        """A rollout (or co-located) worker takes the most urgent rollout step it may
        (:meth:`SchedulingPolicy.take_rollout`)."""
        if self.options.pools and w.pool != ROLLOUT:
            return None
        info, stolen = self.policy.take_rollout(w, now)
        return Pick(info, self, stolen) if info is not None else None

    def taken(self, w: WorkerInfo, pick: Pick, now: float) -> None:
        """Note why ``w`` takes the rollout task it picked: its inputs are there, or it
        waits for no worker in particular (a stolen step and a chunk's first step under
        rebalancing are rebalancing's to note)."""
        info = pick.info
        if pick.by is not self or pick.stolen:
            return
        if info.affinity == w.address:
            self.policy.note(info, RELEASED, self.name, w,
                             "its inputs are on this worker ({} bytes)",
                             (info.locality or {}).get(w.address, 0))
        elif not (first_step(info) and self.options.rebalance):
            self.policy.note(info, RELEASED, self.name, w,
                             "the most urgent rollout task; no single worker holds its "
                             "inputs")
