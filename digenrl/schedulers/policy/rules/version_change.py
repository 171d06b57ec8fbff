"""Work that can wait for the version change (what the GAP, TAG and RAT rules share).

With one-step staleness both pools meet at every version change: the next iteration's
micro-steps and the generation after it both read the version the optimizer step is
about to publish. Between an iteration's last grad and the new version's weights
arriving on the rollout workers, only work that reads no policy version can run, and a
generation has such work: the decodes and rewards of its chunks. Their results feed
only that generation's training, which reads the version being made, so nothing needs
them before the version change, while the version change waits for every grad.

A rollout task *can wait* when it finishes a chunk (a decode or reward, not a denoise
step), every denoise step of its generation has been released, and its iteration
trains on a version not published yet (:meth:`VersionChange.can_wait`). Three rules
act on it: GAP keeps decodes for the version change (:mod:`.gap`), a rollout worker is
lent a grad before such work (:mod:`.rat`), and the last idle trainer does not take it
while the optimizer step comes next (:mod:`.tag`). This module keeps what they read:
which denoise steps and grads of each iteration are yet to be released, the newest
iteration whose grads have started, and which chunks have not started (their first
step not released: the generation RAT may owe).
"""

from __future__ import annotations

from collections import defaultdict

from digenrl.schedulers.policy.rules import Rule
from digenrl.schedulers.policy.state import TaskInfo, discard, tracked
from digenrl.vocabulary import DENOISE, GRAD, ROLLOUT

__all__ = ["VersionChange"]


class VersionChange(Rule):
    """Which work of each iteration is yet to be released, and what can wait."""

    __slots__ = ("waiting", "unstarted", "grads_from")
    name = "version change"

    def __init__(self, policy) -> None:
        super().__init__(policy)
        # Denoise steps and grads not released yet, by (kind, iteration): whether an
        # iteration's generation has steps left to run, and its training grads.
        self.waiting: dict[tuple[str, int], set] = defaultdict(set)
        # The first steps of chunks not released yet, by (iteration, version read).
        self.unstarted: dict[tuple[int, int], set] = defaultdict(set)
        # The newest iteration a grad has been released of (None before the first).
        self.grads_from: int | None = None

    def added(self, info: TaskInfo) -> None:
        self.back(info)

    def released(self, info: TaskInfo, w, now: float) -> None:
        """GPU task ``info`` was released."""
        if info.kind == GRAD:
            if self.grads_from is None or info.iteration > self.grads_from:
                self.grads_from = info.iteration
        self.gone(info)

    def forgotten(self, info: TaskInfo, held: bool) -> None:
        self.gone(info)

    def gone(self, info: TaskInfo) -> None:
        """``info`` no longer waits to be released (released, or forgotten)."""
        if tracked(info):
            discard(self.waiting, (info.kind, info.iteration), info.key)
            if info.timestep == 0 and info.kind == DENOISE:     # a chunk's first step
                discard(self.unstarted, (info.iteration, info.policy_version), info.key)

    def back(self, info: TaskInfo) -> None:
        """``info`` waits to be released (added, lost, or its release failed)."""
        if tracked(info):
            self.waiting[info.kind, info.iteration].add(info.key)
            if info.timestep == 0 and info.kind == DENOISE:     # a chunk's first step
                self.unstarted[info.iteration, info.policy_version].add(info.key)

    def left(self, kind: str, iteration: int) -> bool:
        """Whether a ``kind`` task (``denoise`` or ``grad``) of ``iteration`` is yet to
        be released."""
        return (kind, iteration) in self.waiting

    def can_wait(self, info: TaskInfo) -> bool:
        """Whether rollout task ``info`` can wait for the next version change: it
        finishes a chunk (a decode or a reward, not a denoise step) of a generation
        whose every step has been released, and whose training reads a version not
        published yet. Nothing needs it before the trainers publish that version, and
        the version waits for their grads, then their optimizer step: work that can
        wait goes after them, and fills the wait for the new version's weights."""
        return (info.pool == ROLLOUT and info.kind != DENOISE
                and info.iteration > self.policy.version
                and (DENOISE, info.iteration) not in self.waiting)

    def grads_all_released(self) -> bool:
        """Whether every grad of the iteration being trained (the one reading the
        newest version) has been released: its reduction and optimizer step come next."""
        v = self.policy.version
        return self.grads_from == v and (GRAD, v) not in self.waiting
