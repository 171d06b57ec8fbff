"""Which policy versions a run keeps, which checkpoints it writes and where a resumed
run starts computing (docs/architecture.md, "Where state lives"): one rule, from the
three settings it depends on.

The driver asks it what to release after each commit and which checkpoints to drop,
which checkpoints a run writes and where a run is resumed; :class:`GraphLayout
<digenrl.graph.structure.GraphLayout>` answers the same questions through it
(:attr:`~digenrl.graph.structure.GraphLayout.retention`). The scheduler does not read
it: a version's read-back waits for its checkpoint only where the version's graph has
a checkpoint task (``schedulers/policy/rules/handoff.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

__all__ = ["Retention"]


@dataclass(frozen=True)
class Retention:
    """The retention and resume rule of a run.

    ``version_lag``: how many versions behind the trained one a rollout may read (the
    bounded staleness); ``kl``: the micro-steps read version 0 (the KL term's reference);
    ``checkpoint_every``: the resume points are the multiples of it and the run's last
    iteration (``store.checkpoint_every``)."""

    version_lag: int = 0
    kl: bool = False
    checkpoint_every: int = 1

    def retains(self, version: int, iteration: int) -> bool:
        """Whether a run at iteration ``iteration`` keeps the weights and checkpoint of
        ``version``: the versions from ``iteration - version_lag`` on (what the rollouts
        of this iteration and later ones may read, recomputed or resumed) and, with the
        KL term, version 0 (its reference)."""
        return version >= iteration - self.version_lag or (self.kl and version == 0)

    def retained_versions(self, iteration: int) -> list[int]:
        """The versions up to ``iteration`` that :meth:`retains` keeps there: what a run
        resumed at ``iteration`` restores."""
        # (Of the versions up to ``iteration``, only these can be: version 0 and the
        # last ``version_lag + 1``.)
        window = range(max(0, iteration - self.version_lag), iteration + 1)
        return [v for v in sorted({0, *window}) if self.retains(v, iteration)]

    def writes_checkpoint(self, version: int, iterations: int) -> bool:
        """Whether a run of ``iterations`` iterations writes the checkpoint of
        ``version``: version 0, and every version a run resumed at a resume point
        restores (:meth:`retained_versions`), the resume points being the multiples of
        ``checkpoint_every`` and the run's last iteration. (With ``checkpoint_every`` 1,
        every version.) A version not written is read back from the memory of the
        worker whose optimizer step made it, and recomputed from the newest checkpoint
        before it when that memory is lost."""
        if version == 0:
            return True
        every = self.checkpoint_every
        point = min(-(-version // every) * every, max(iterations, version))
        return self.retains(version, point)

    def resume_point(self, committed: int, checkpointed: Callable[[int], bool]) -> int:
        """Where a run whose store holds ``committed`` iterations starts computing
        again, ``checkpointed(v)`` saying whether version ``v``'s checkpoint is complete:
        the latest iteration at most ``committed`` whose retained versions are all
        checkpointed (0, from the start, when none is). The iterations from there to
        ``committed`` are computed again, bit for bit, and not stored again."""
        for point in range(committed, 0, -1):
            if all(checkpointed(v) for v in self.retained_versions(point)):
                return point
        return 0

    def keeps_checkpoint(self, version: int, committed: int, iterations: int) -> bool:
        """Whether a run of ``iterations`` iterations whose store holds ``committed``
        keeps the checkpoint of ``version``: what its latest resume point restores
        (and the recomputation of any later version starts from), and every later
        version's."""
        point = self.resume_point(committed, lambda v: self.writes_checkpoint(v, iterations))
        return version > point or self.retains(version, point)
