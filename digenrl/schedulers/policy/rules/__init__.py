"""The rules of the scheduling policy, one module each (see :mod:`digenrl.schedulers.policy`).

A rule is a :class:`Rule`: a class whose methods are the policy's events, each a no-op
unless the rule defines it. The core (:class:`~digenrl.schedulers.policy.core.SchedulingPolicy`)
holds an ordered list of rules (:data:`~digenrl.schedulers.policy.core.RULES`) and, at
each event, calls the rules that define it, in that order; it holds no rule by name.
Two kinds of event:

* **told** (every rule that defines it is called): :meth:`Rule.added`,
  :meth:`Rule.released`, :meth:`Rule.unreleased`, :meth:`Rule.done`, :meth:`Rule.back`,
  :meth:`Rule.lost`, :meth:`Rule.forgotten`, :meth:`Rule.published`,
  :meth:`Rule.worker_added`, :meth:`Rule.worker_removed`, :meth:`Rule.wake`,
  :meth:`Rule.taken` (the decision trail), :meth:`Rule.round_over`, and the telemetry's
  :meth:`Rule.lends` and :meth:`Rule.held`;
* **asked** (the first answer counts, in the list's order): :meth:`Rule.holds`,
  :meth:`Rule.order`, :meth:`Rule.queue`, :meth:`Rule.place`, :meth:`Rule.take`,
  and the vetoes :meth:`Rule.lets` and :meth:`Rule.ahead`, which every rule defining
  them must pass.

A rule keeps the state only it reads, and reads the core's: the tasks, the workers, the
ready queues, the published version, and the facts several rules read (:mod:`.state`).
It never reads another rule.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Iterable, Mapping, NamedTuple

from digenrl.schedulers.policy.state import Decision, TaskInfo, WorkerInfo

if TYPE_CHECKING:
    from digenrl.schedulers.policy.core import SchedulingPolicy
    from digenrl.schedulers.policy.queues import ReadyEntry

__all__ = ["Rule", "Pick", "PASS", "EVENTS"]


class _Pass:
    """:meth:`Rule.place`'s answer when the task is not the rule's to place."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "PASS"


#: A rule's "not mine" where None is an answer (:meth:`Rule.place`).
PASS = _Pass()


class Pick(NamedTuple):
    """The task a rule picks for a worker's free slot (:meth:`Rule.take`), not released
    yet: the vetoes (:meth:`Rule.ahead`) may put another before it or keep the slot."""

    info: TaskInfo
    by: "Rule"                  # the rule that picked it
    stolen: bool = False        # taken from another worker's affinity


class Rule:
    """A rule of the policy, bound to the core that calls it.

    The core holds its rules and a rule holds the core weakly (a proxy), so a policy and
    its tasks are freed by reference counting as soon as its owner drops it (the
    simulator makes and drops millions of tasks with the cyclic collector off). What
    the rules read at every decision (the options, the tasks, the workers, the ready
    queues, the facts several rules read, whether decisions are noted on a trail) they
    hold directly.

    Every event method below is a no-op (or the neutral answer) here; a rule defines
    those it concerns, and the core calls only the rules that define an event."""

    __slots__ = ("policy", "options", "tasks", "workers", "queues", "facts", "noting")

    #: The rule's name, as the decision trail and docs/scheduling.md give it.
    name = ""

    def __init__(self, policy: "SchedulingPolicy") -> None:
        self.policy = weakref.proxy(policy)
        self.options = policy.options
        self.tasks = policy.tasks
        self.workers = policy.workers
        self.queues = policy.queues
        #: What several rules read (:class:`~digenrl.schedulers.policy.state.Facts`).
        self.facts = policy.facts
        #: Whether the rule notes its decisions (:meth:`SchedulingPolicy.note`).
        self.noting = policy.trail_length > 0

    # ------------------------------------------------------------------ tasks

    def added(self, info: TaskInfo) -> None:
        """Told: ``info`` entered the policy (and is not rejected)."""

    def holds(self, info: TaskInfo) -> bool:
        """Asked: ``info`` is ready; True when this rule holds it back (then it marks it
        held and queues it later itself, :meth:`SchedulingPolicy.enqueue`)."""
        return False

    def order(self, info: TaskInfo, tie: int, queueing: bool) -> "ReadyEntry | None":
        """Asked: ``info``'s entry in a ready heap (its priority), ``tie`` breaking ties;
        ``queueing``: it is being queued now (the rule may record it), else only its
        place in the order is asked."""
        return None

    def queue(self, info: TaskInfo, entry: "ReadyEntry") -> bool:
        """Asked: runnable GPU task ``info`` waits; True when this rule put ``entry`` in
        the ready heap it waits in."""
        return False

    def released(self, info: TaskInfo, w: WorkerInfo, now: float) -> None:
        """Told: GPU task ``info`` was released to ``w``."""

    def unreleased(self, info: TaskInfo, w: WorkerInfo) -> None:
        """Told: GPU task ``info`` left ``w`` (finished, lost, failed or forgotten)."""

    def done(self, info: TaskInfo, worker: str | None, duration: float | None) -> None:
        """Told: ``info`` finished on ``worker`` after ``duration`` seconds (before it
        leaves the worker: :meth:`unreleased` comes next)."""

    def back(self, info: TaskInfo) -> None:
        """Told: ``info`` waits to be released again (lost, or its release failed)."""

    def lost(self, info: TaskInfo) -> None:
        """Told: ``info`` went back to waiting, its result (if any) gone."""

    def forgotten(self, info: TaskInfo, held: bool) -> None:
        """Told: ``info`` was forgotten (``held``: possibly while held or queued)."""

    def published(self, info: TaskInfo) -> None:
        """Told: ``info`` published a newer version (the core's ``version``)."""

    def lends(self, info: TaskInfo) -> str | None:
        """Asked of every rule: a pool besides its own whose workers may run ``info``
        (lent by this rule), or None."""
        return None

    def held(self) -> Mapping[str, int]:
        """Asked of every rule: the ready tasks it holds back, by reason."""
        return {}

    # ---------------------------------------------------------------- workers

    def worker_added(self, w: WorkerInfo) -> None:
        """Told: ``w`` joined."""

    def worker_removed(self, w: WorkerInfo) -> None:
        """Told: ``w`` left (its tasks are already back to waiting)."""

    # ------------------------------------------------------------ the round

    def place(self, info: TaskInfo, loc: Mapping[str, int]) -> "WorkerInfo | None | _Pass":
        """Asked: where ``info``, a task without a GPU slot, goes now (None: it waits),
        or :data:`PASS` when it is not this rule's to place."""
        return PASS

    def wake(self, candidates: set[str]) -> None:
        """Told: a decision round begins; add the workers it must look at."""

    def take(self, w: WorkerInfo, now: float) -> Pick | None:
        """Asked: what ``w``, with a free slot, takes (None: nothing of this rule's)."""
        return None

    def lets(self, w: WorkerInfo, info: TaskInfo, now: float) -> bool:
        """Veto: whether ``w`` may take ``info``, a task waiting for another worker."""
        return True

    def ahead(self, w: WorkerInfo, pick: Pick) -> Pick | None:
        """Veto: the pick ``w`` takes instead of ``pick`` (``pick`` itself: no say; None:
        ``w`` takes nothing this round)."""
        return pick

    def taken(self, w: WorkerInfo, pick: Pick, now: float) -> None:
        """Told (with a trail only): ``w`` takes ``pick``; note why, if the rule says."""

    def round_over(self, idle: list[WorkerInfo], now: float) -> Iterable[Decision]:
        """Told: every worker took its share of the round; ``idle``: the workers looked
        at that had nothing in flight when it began. Returns releases to add."""
        return ()

    def deadline(self) -> float | None:
        """Asked: the time (the policy's clock) from which a round decides otherwise
        with no event before it (a wait the rule measures ends); None: no such time."""
        return None


#: Every event method of :class:`Rule`, for the core's lists of the rules defining each.
EVENTS = tuple(name for name, value in vars(Rule).items()
               if callable(value) and not name.startswith("_"))
