"""TAG (trainer-assisted generation): idle trainers take rollout work.

A trainer with no runnable training work and nothing in flight takes one rollout task
at a time, as a rollout worker would (a step waiting for another worker only when
rebalancing lets it: :mod:`.rebalance`). Once training work is runnable no rollout task
is released to a trainer. An idle trainer does not take work that can wait for the
version change (:class:`~digenrl.schedulers.policy.state.Facts`) once every grad of the iteration being trained
has been released and no other trainer is idle: the reduction and the optimizer step
come next, and on a trainer busy with a decode the optimizer step would queue behind
it, and with it the version change both pools wait for. A denoise step is still taken:
generation that cannot wait may be what the run waits for (in the trainer-heavy splits
it is, and a trainer kept idle for it costs throughput).
"""

from __future__ import annotations

from digenrl.schedulers.policy.rules import Pick, Rule
from digenrl.schedulers.policy.state import TaskInfo, WorkerInfo
from digenrl.schedulers.policy.trail import KEPT, RELEASED
from digenrl.vocabulary import ROLLOUT, TRAINER

__all__ = ["Tag"]


class Tag(Rule):
    """Lends idle trainers to generation."""

    __slots__ = ()
    name = "TAG"

    def take(self, w: WorkerInfo, now: float) -> Pick | None:
        """The rollout task trainer ``w`` takes (None: it takes none)."""
        policy = self.policy
        if (self.options.tag and self.options.pools and w.pool == TRAINER and not w.inflight
                and self.queues.training_for(w.address) is None):
            info, stolen = policy.take_rollout(w, now)
            if info is None:
                return None
            if self.keeps_for_optimizer(w, info):
                if self.noting:
                    policy.note(info, KEPT, self.name, w,
                                "the trainer keeps its slot for the optimizer step: every "
                                "grad of iteration {} is released, no other trainer is "
                                "idle, and this can wait for the version change",
                                policy.version)
                return None
            return Pick(info, self, stolen)
        return None

    def taken(self, w: WorkerInfo, pick: Pick, now: float) -> None:
        if pick.by is self:
            self.policy.note(pick.info, RELEASED, self.name, w, "no runnable training work")

    def lends(self, info: TaskInfo) -> str | None:
        """Trainers may run rollout work."""
        return TRAINER if self.options.tag and info.pool == ROLLOUT else None

    def keeps_for_optimizer(self, w: WorkerInfo, info: TaskInfo) -> bool:
        """Whether trainer ``w``, idle, keeps its slot for the optimizer step rather
        than take ``info``: ``info`` can wait, every grad of the iteration being trained
        has been released, so its reduction and optimizer step come next, and no other
        trainer is idle to take them."""
        facts = self.facts
        return (facts.can_wait(info) and facts.grads_all_released()
                and not any(t is not w and not t.inflight for t in self.policy.trainers()))
