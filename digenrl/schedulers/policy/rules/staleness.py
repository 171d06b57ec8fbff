"""Bounded staleness, and the barrier of the synchronous designs (without GAP).

**Bounded staleness**: a rollout task of iteration ``i`` is held (reason ``staleness``)
until policy version ``i - max_staleness`` has been published, also when a faulty graph
makes it read an older version that already exists; a training task that would consume
samples more than ``max_staleness`` versions old is rejected when it is added
(:func:`stale_training`). Background work (evaluation) reads a published version and
feeds no training: it is never held.

**The barrier** (GAP off): an iteration's training waits until all its rollout work is
done (reason ``barrier``), as in the synchronous designs. Evaluation is no iteration's
rollout work.
"""

from __future__ import annotations

from collections import defaultdict

from digenrl.schedulers.options import ScheduleOptions
from digenrl.schedulers.policy.rules import Rule
from digenrl.schedulers.policy import trail
from digenrl.schedulers.policy.state import HELD, TaskInfo
from digenrl.vocabulary import BACKGROUND_KINDS, ROLLOUT

__all__ = ["Staleness", "stale_training"]


def stale_training(info: TaskInfo, options: ScheduleOptions) -> str | None:
    """Why training task ``info`` breaks the staleness bound (None when it does not)."""
    if info.behaviour_version is None:
        return None
    staleness = info.policy_version - info.behaviour_version
    if staleness > options.max_staleness:
        return (f"task {info.key!r} would train samples of policy version "
                f"{info.behaviour_version} at version {info.policy_version}: staleness "
                f"{staleness} exceeds max_staleness={options.max_staleness}")
    if staleness < 0:
        return (f"task {info.key!r} would train samples of policy version "
                f"{info.behaviour_version} at the older version {info.policy_version}")
    return None


class Staleness(Rule):
    """Holds ready tasks back: rollout past the staleness bound, training behind the
    barrier."""

    __slots__ = ("held_stale", "held_barrier", "rollout_pending", "barrier_open")
    name = "staleness"
    #: The trail's name of the barrier (a hold of its own in the telemetry too).
    barrier = "barrier"

    def __init__(self, policy) -> None:
        super().__init__(policy)
        # Held tasks by iteration.
        self.held_stale: dict[int, set] = defaultdict(set)
        self.held_barrier: dict[int, set] = defaultdict(set)
        # Rollout work outstanding per iteration (for the barrier without GAP).
        self.rollout_pending: dict[int, int] = defaultdict(int)
        self.barrier_open: set[int] = set()

    def added(self, info: TaskInfo) -> None:
        """``info`` entered: rollout work of its iteration (evaluation is none)."""
        if info.pool == ROLLOUT and info.kind not in BACKGROUND_KINDS:
            info.pending = True
            self.rollout_pending[info.iteration] += 1

    def holds(self, info: TaskInfo) -> bool:
        """Whether ``info``, now ready, is held (then marked so): rollout while the
        staleness bound keeps its iteration back, or, without GAP, training until its
        iteration's rollout work is done."""
        policy = self.policy
        it = info.iteration
        if info.kind in BACKGROUND_KINDS:
            return False
        if info.pool == ROLLOUT:
            if it - self.options.max_staleness > policy.version:
                info.state = HELD
                self.held_stale[it].add(info.key)
                if self.noting:
                    policy.note(info, trail.HELD, self.name, None,
                                "iteration {} waits for version {} (published: {})", it,
                                it - self.options.max_staleness, policy.version)
                return True
        elif not self.options.gap and it >= 0 and it not in self.barrier_open:
            if self.rollout_pending.get(it):
                info.state = HELD
                self.held_barrier[it].add(info.key)
                if self.noting:
                    policy.note(info, trail.HELD, self.barrier, None,
                                "without GAP iteration {}'s training waits for its rollout "
                                "work ({} tasks left)", it, self.rollout_pending[it])
                return True
            self.barrier_open.add(it)
        return False

    def done(self, info: TaskInfo, worker: str | None, duration: float | None) -> None:
        """Rollout task ``info`` finished: once its iteration has none left, the barrier
        opens."""
        if info.pool != ROLLOUT:
            return
        left = self.rollout_pending.get(info.iteration)
        if left is not None:
            if info.pending:
                info.pending = False
                left -= 1
                self.rollout_pending[info.iteration] = left
            if not left:
                self._open_barrier(info.iteration)

    def forgotten(self, info: TaskInfo, held: bool) -> None:
        """``info`` was forgotten (``held``: possibly while held)."""
        if held:
            self.held_stale.get(info.iteration, set()).discard(info.key)
            self.held_barrier.get(info.iteration, set()).discard(info.key)
        if info.pending:
            info.pending = False
            self.rollout_pending[info.iteration] -= 1

    def published(self, info: TaskInfo) -> None:
        """A newer version was published: the rollout it lets start is queued."""
        policy = self.policy
        limit = policy.version + self.options.max_staleness
        for it in sorted(i for i in self.held_stale if i <= limit):
            self._enqueue_held(self.held_stale.pop(it), self.name,
                               "version {} published", policy.version)

    def _open_barrier(self, iteration: int) -> None:
        self.barrier_open.add(iteration)
        self._enqueue_held(self.held_barrier.pop(iteration, ()), self.barrier,
                           "iteration {}'s rollout work is done", iteration)

    def _enqueue_held(self, keys, rule: str, reason: str, *args) -> None:
        """Queue the held tasks ``keys`` (noted as eligible because of ``reason``)."""
        policy = self.policy
        for key in sorted(keys, key=policy.sort_key):
            info = self.tasks[key]
            if info.state is HELD:
                if self.noting:
                    policy.note(info, trail.ELIGIBLE, rule, None, reason, *args)
                policy.enqueue(info)

    def held(self) -> dict[str, int]:
        """Ready tasks held by the staleness bound and by the barrier."""
        return {self.name: sum(len(s) for s in self.held_stale.values()),
                self.barrier: sum(len(s) for s in self.held_barrier.values())}
