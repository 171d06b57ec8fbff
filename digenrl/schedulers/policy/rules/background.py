"""Background work (held-out evaluation, ``BACKGROUND_KINDS``) comes last.

A GPU task of it is released only to a rollout (or co-located) worker with nothing in
flight (so a background task never queues behind another, nor a worker runs two), while
no rollout step is ready anywhere (one waiting for its own worker included) and no grad
waits that the worker might be lent (rollout-assisted training comes first). While one
waits, every idle worker that may take it is looked at again at each decision. Trainers
never take one: an evaluation task is a whole ODE loop, and a trainer holding one when
training work arrives would delay training by that long. Background work is never held
and never counted in an iteration's rollout work (:mod:`.staleness`).
"""

from __future__ import annotations

from digenrl.schedulers.policy.queues import ReadyEntry
from digenrl.schedulers.policy.rules import Pick, Rule
from digenrl.schedulers.policy.rules.rat import lends_grads
from digenrl.schedulers.policy.state import TaskInfo, WorkerInfo
from digenrl.schedulers.policy.trail import RELEASED
from digenrl.vocabulary import BACKGROUND_KINDS, COLOCATED, ROLLOUT

__all__ = ["Background"]


class Background(Rule):
    """Gives idle rollout workers the background work nothing else wants."""

    __slots__ = ()
    name = "background"

    def queue(self, info: TaskInfo, entry: ReadyEntry) -> bool:
        """Background work waits apart."""
        if info.kind not in BACKGROUND_KINDS:
            return False
        self.queues.background.push(entry)
        self.policy.new_rollout = True   # (the free rollout workers are who may take it)
        return True

    def wake(self, candidates: set[str]) -> None:
        """While background work waits, add every idle worker that may take it to the
        workers looked at (what held it back may have gone to another worker)."""
        policy = self.policy
        if self.queues.background.peek() is not None:
            pool = ROLLOUT if self.options.pools else COLOCATED
            workers = self.workers
            candidates |= {a for a in policy.free[pool] if not workers[a].inflight}

    def take(self, w: WorkerInfo, now: float) -> Pick | None:
        """The most urgent background task for ``w``, which has nothing else to take,
        or None (see the module's rule)."""
        policy = self.policy
        if ((self.options.pools and w.pool != ROLLOUT) or w.inflight
                or self.queues.stealable.peek() is not None
                or (w.pool == ROLLOUT and lends_grads(self.options)   # (RAT first)
                    and self.queues.training.peek() is not None)):
            return None
        top = self.queues.background.peek()
        if top is None:
            return None
        if self.noting:
            policy.note(top.info, RELEASED, self.name, w,
                        "nothing else for this idle worker: no rollout step is ready and no "
                        "grad waits to be lent")
        return Pick(top.info, self)
