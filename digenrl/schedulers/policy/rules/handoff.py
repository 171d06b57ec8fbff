"""Hand-off of the trainer state: where a version's ``restore`` goes.

The read-back of a policy version's state (``restore``, what the version is published
from) goes to the worker that made the state (its optimizer step, or the initial
state), whose memory still holds it while the checkpoint is being written: the version
is published without waiting for the checkpoint's write and read. With that worker gone
(or its result lost or forgotten) it waits until the checkpoint is written, then goes
to any worker of its pool and reads the checkpoint; a resumed run's read-back, with no
checkpoint task in its graph, goes anywhere at once. The read-back of a version the run
does not checkpoint has its maker's result as an input: it runs once that result is in
memory again (recomputed where lost), on the worker that made it.
"""

from __future__ import annotations

from typing import Mapping

from digenrl.schedulers.policy.rules import PASS, Rule
from digenrl.schedulers.policy.state import DONE, TaskInfo, WorkerInfo
from digenrl.schedulers.policy.trail import PLACED, WAITS
from digenrl.vocabulary import CHECKPOINT, INIT, OPTIMIZE, RESTORE

__all__ = ["Handoff", "MAKERS"]

#: The kinds whose result is a trainer state: version ``iteration + 1``'s.
MAKERS = frozenset({INIT, OPTIMIZE})


class Handoff(Rule):
    """Sends each version's read-back to the worker holding its state."""

    __slots__ = ("made_on", "checkpoints")
    name = "hand-off"

    def __init__(self, policy) -> None:
        super().__init__(policy)
        # Policy version -> the worker whose optimizer step (or initial state) made its
        # trainer state, while that task's result is known; and the checkpoint task of
        # each version.
        self.made_on: dict[int, str] = {}
        self.checkpoints: dict[int, TaskInfo] = {}

    def added(self, info: TaskInfo) -> None:
        if info.kind == CHECKPOINT:
            self.checkpoints[info.policy_version] = info

    def done(self, info: TaskInfo, worker: str | None, duration: float | None) -> None:
        """``info`` finished on ``worker``: if a maker (:data:`MAKERS`), that worker
        holds the state it made."""
        if info.kind in MAKERS and worker is not None:
            self.made_on[info.iteration + 1] = worker

    def lost(self, info: TaskInfo) -> None:
        self.result_gone(info)

    def result_gone(self, info: TaskInfo) -> None:
        """``info``'s result is gone (lost or forgotten): if it made a trainer state, no
        worker's memory holds that state for its read-back any more."""
        if info.kind in MAKERS:
            self.made_on.pop(info.iteration + 1, None)

    def forgotten(self, info: TaskInfo, held: bool) -> None:
        self.result_gone(info)
        if info.kind == CHECKPOINT and self.checkpoints.get(info.policy_version) is info:
            del self.checkpoints[info.policy_version]

    def worker_removed(self, w: WorkerInfo) -> None:
        for v in [v for v, a in self.made_on.items() if a == w.address]:
            del self.made_on[v]

    def place(self, info: TaskInfo, loc: Mapping[str, int] | None = None):
        """Where the read-back ``info`` of a version's trainer state goes: to the worker
        that made the state, whose memory holds it (the task takes it from there); with
        that worker gone or unknown, to any worker of the pool once the version's
        checkpoint is written (or when no checkpoint task is known: a resumed run reads
        one written before), and nowhere yet while it is being written. (``loc`` is not
        read: its only possible input is the maker's result, whose worker it picks.)
        Other tasks are not its to place (:data:`PASS`)."""
        if info.kind != RESTORE:
            return PASS
        policy = self.policy
        v = info.policy_version
        maker = self.workers.get(self.made_on.get(v, ""))
        if maker is not None:
            if self.noting:
                policy.note(info, PLACED, self.name, maker,
                            "it made version {}'s state and holds it in memory", v)
            return maker
        writing = self.checkpoints.get(v)
        if writing is not None and writing.state is not DONE:
            if self.noting:
                policy.note(info, WAITS, self.name, None,
                            "no worker holds version {}'s state (not made yet, or its "
                            "maker is gone) and its checkpoint is not written yet", v)
            return None
        w = policy.in_turn(info.pool)
        if self.noting and w is not None:
            policy.note(info, PLACED, self.name, w,
                        "no worker holds version {}'s state: it reads the checkpoint", v)
        return w
