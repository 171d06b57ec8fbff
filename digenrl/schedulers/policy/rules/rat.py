"""RAT (rollout-assisted training): idle rollout workers take grads.

TAG lends idle trainers to generation; RAT lends idle rollout workers to training, so
the pools are preferences rather than walls in both directions. It applies with pools
and the TSP queue (without TSP every micro-step is pinned to its trainer and nothing is
lent). A rollout worker takes a ``grad`` micro-step (:meth:`Rat.lend`, the one place a
grad is lent) in two cases:

* **idle**: once every other worker has taken its share of the round, a rollout worker
  with nothing in flight and no rollout step it may run (its own, a shared one, or one
  it may steal) -- it would otherwise idle, typically because the staleness bound holds
  the next iteration's generation back -- takes one grad at a time;
* **ahead of work that can wait**: a rollout worker whose next rollout task can wait
  for the version change (:meth:`.Facts.can_wait`) takes a grad before it, counting the
  GPU tasks already released to it (each as a grad), so the version change those grads
  lead to comes sooner and the finishing work fills the wait for its weights.

In both, no generation may be owed to the worker: each chunk that may start now or at
any moment (its first step not yet released, its iteration within the staleness bound,
the version it reads published) keeps one idle rollout worker free (in the second case
no grad goes first while any chunk is owed). Such a chunk's first step becomes ready a
few milliseconds after the publish that let it start, once its noise is drawn; a grad
lent in that moment would sit in front of it. Chunks that wait for a version not yet
published owe nothing yet: the trainers publish it only after the grads they have
queued.

And the grad must gain: it is the most urgent task of the training queue, every trainer
has a GPU task in flight (an idle trainer takes the grad itself), and the rollout
worker is expected to finish it no later than the first trainer to free would: the
transfer of the inputs it lacks (at ``transfer_bandwidth``; the trained version's
weights count when the worker does not hold them) plus its released tasks and the grad
at its speed, against the trainer's released GPU tasks plus the grad at its speed. The
grad seconds are measured (a moving average over finished grads, at speed 1, in the
policy's facts); before
the first grad finishes nothing is lent. A grad left to the trainers is counted as
``rat_declined``.

Why this never delays generation: the grads that can be runnable read the newest
published version, so they belong to the iteration whose optimizer step publishes the
next one, and every generation the staleness bound still holds back waits at least for
that version. Reductions, optimizer steps and the rest stay on trainers: a lent grad's
gradient is copied to the least loaded trainer as soon as it is computed
(:meth:`Rat.done`), so the reduction summing it does not wait for that transfer.
"""

from __future__ import annotations

from digenrl.schedulers.options import ScheduleOptions
from digenrl.schedulers.policy.rules import Pick, Rule
from digenrl.schedulers.policy.state import Decision, TaskInfo, WorkerInfo
from digenrl.schedulers.policy.trail import DECLINED, LENT
from digenrl.vocabulary import BACKGROUND_KINDS, GRAD, ROLLOUT

__all__ = ["Rat", "lends_grads"]


def lends_grads(options: ScheduleOptions) -> bool:
    """Whether rollout-assisted training applies under ``options``: RAT on, with pools
    and TSP."""
    return options.rat and options.pools and options.tsp


class Rat(Rule):
    """Lends idle rollout workers to training."""

    __slots__ = ("on", "_lending", "_round", "_kept")
    name = "RAT"

    def __init__(self, policy) -> None:
        super().__init__(policy)
        #: Whether rollout-assisted training applies: RAT on, with pools and TSP.
        self.on = lends_grads(self.options)
        # Whether a grad waits that an idle rollout worker might be lent (this round).
        self._lending = False
        # Lending to the workers idle after a round (see round_over): the trainers' reach
        # and the owed chunks (neither changes while grads are lent), and how many idle
        # workers were kept for those chunks.
        self._round: tuple[float | None, int] | None = None
        self._kept = 0

    # ------------------------------------------------------------ what it learns

    def done(self, info: TaskInfo, worker: str | None, duration: float | None) -> None:
        """Grad ``info`` computed on ``worker`` (its time measured in the facts): when
        it was lent, a trainer (the least loaded) copies its gradient now, while the
        trainers still compute, rather than when the reduction that sums it becomes
        ready (which a trainer runs)."""
        if info.kind != GRAD or duration is None or duration <= 0 or worker is None:
            return
        policy = self.policy
        w = self.workers.get(worker)
        if w is None:
            return
        if w.pool == ROLLOUT and self.options.pools:
            trainers = policy.trainers()
            if trainers:
                to = min(trainers,
                         key=lambda t: (len(t.inflight) + len(t.cpu_inflight), t.name))
                policy.copy_ahead(info.key, to.address)

    # ---------------------------------------------------------------- deciding

    def wake(self, candidates: set[str]) -> None:
        """When a grad waits that an idle rollout worker might be lent, every idle
        rollout worker is added to the workers looked at."""
        policy = self.policy
        self._lending = self.on and self.queues.training.peek() is not None
        if self._lending:
            workers = self.workers
            candidates |= {a for a in policy.free[ROLLOUT] if not workers[a].inflight}

    def lends(self, info: TaskInfo) -> str | None:
        """Rollout workers may run grads."""
        return ROLLOUT if self.on and info.kind == GRAD else None

    def ahead(self, w: WorkerInfo, pick: Pick) -> Pick | None:
        """A grad a rollout worker takes before the rollout task it picked, when that
        task can wait (:meth:`lend`)."""
        if (not self.on or pick.by is self or w.pool != ROLLOUT
                or pick.info.kind in BACKGROUND_KINDS):
            return pick
        lent = self.lend(w, pick.info)
        return Pick(lent, self) if lent is not None else pick

    def owed_chunks(self) -> int:
        """Chunks that may start now or at any moment: their first step has not been
        released, the staleness bound no longer holds their iteration back and the
        version they read has been published. Their first steps become ready as soon as
        the last inputs exist (the noise, the version's weights), a few milliseconds
        after the publish that let them start, so a rollout worker idle now is not idle
        for long. (A chunk waiting for a version not yet published is not owed: the
        trainers publish it only after the grads they have queued.)"""
        return self.facts.unstarted_chunks(self.facts.version + self.options.max_staleness)

    def trainers_reach(self) -> float | None:
        """Seconds until a trainer would have finished the most urgent grad if it were
        queued there now: once the GPU tasks released to it have run (each counted as a
        grad), then the grad (measured seconds). None while a trainer has no GPU task
        (it takes the grad itself) or no grad has been measured."""
        grad_s = self.facts.ref_grad
        trainers = self.policy.trainers()
        if grad_s is None or not trainers or any(not t.inflight for t in trainers):
            return None
        return min((len(t.inflight) + 1) * grad_s / t.speed for t in trainers)

    def lend(self, w: WorkerInfo, before: TaskInfo | None = None) -> TaskInfo | None:
        """The grad rollout worker ``w`` takes now, or None; every lending decision is
        taken here (see the module's rule). ``before``: the rollout task ``w`` would take
        next (the grad goes first only when that task can wait and no chunk is owed);
        None: ``w`` is idle after the round, and each owed chunk keeps one idle worker
        (in the order :meth:`round_over` asks)."""
        if not self.on:
            return None
        policy = self.policy
        if before is not None:
            if not self.facts.can_wait(before):
                return None
            owed = self.owed_chunks()
            if owed:
                if self.noting:
                    self._note_declined(w, "{} chunks may start: no grad goes ahead of {}",
                                        owed, before.key)
                return None
            theirs = self.trainers_reach()
            if theirs is None:
                return None
        else:
            if self._round is None:
                self._round = (self.trainers_reach(), self.owed_chunks())
            theirs, owed = self._round
            if theirs is None:
                return None
            if self._kept < owed:
                self._kept += 1
                policy.count("rat_declined")
                if self.noting:
                    self._note_declined(w, "the worker is kept free for a chunk that may "
                                           "start ({} chunks may)", owed)
                return None
        top = self.queues.training.peek()
        if top is None or top.info.kind != GRAD:
            return None
        ref_grad = self.facts.ref_grad
        assert ref_grad is not None    # (theirs is a number: a grad was measured)
        mine = (self.facts.transfer_seconds(w, top.info)
                + (len(w.inflight) + 1) * ref_grad / w.speed)
        if mine > theirs:
            policy.count("rat_declined")
            if self.noting:
                self._note_declined(w, "a trainer finishes it sooner: {:.3g} s here > "
                                       "{:.3g} s on the first trainer to free", mine, theirs)
            return None
        if self.noting:
            if before is None:
                policy.note(top.info, LENT, self.name, w,
                            "the worker is idle and every trainer busy; it finishes the grad "
                            "in {:.3g} s <= {:.3g} s on the first trainer to free",
                            mine, theirs)
            else:
                policy.note(top.info, LENT, self.name, w,
                            "ahead of {}, which can wait for the version change; it "
                            "finishes the grad in {:.3g} s <= {:.3g} s on the first trainer "
                            "to free", before.key, mine, theirs)
        return top.info

    def _note_declined(self, w: WorkerInfo, reason: str, *args) -> None:
        """Note on the grad ``w`` would be lent why it is not."""
        top = self.queues.training.peek()
        if top is not None and top.info.kind == GRAD:
            self.policy.note(top.info, DECLINED, self.name, w, reason, *args)

    def round_over(self, idle: list[WorkerInfo], now: float) -> list[Decision]:
        """Once every other worker has taken its share of the round: the grads lent to
        the rollout workers of ``idle`` (idle when the round began) still idle."""
        if not self._lending:
            return []
        self._round, self._kept = None, 0
        out = []
        for w in idle:
            if w.pool == ROLLOUT and not w.inflight:
                info = self.lend(w)
                if info is not None:
                    d = self.policy.offer(w, Pick(info, self), now)
                    if d is not None:
                        out.append(d)
        return out
