"""The rules of the scheduling policy, one module each (see :mod:`digenrl.schedulers.policy`).

Each rule is an object the core (:class:`~digenrl.schedulers.policy.core.SchedulingPolicy`)
holds and asks for its say at the points the rule concerns; it keeps the state only it
reads, and reads the core's (tasks, workers, ready queues, the published version).
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from digenrl.schedulers.policy.core import SchedulingPolicy

__all__ = ["Rule"]


class Rule:
    """A rule of the policy, bound to the core that asks it.

    The core holds its rules and a rule holds the core weakly (a proxy), so a policy and
    its tasks are freed by reference counting as soon as its owner drops it (the
    simulator makes and drops millions of tasks with the cyclic collector off). What
    the rules read at every decision (the options, the tasks, the workers, the ready
    queues, whether decisions are noted on a trail) they hold directly."""

    __slots__ = ("policy", "options", "tasks", "workers", "queues", "noting")

    #: The rule's name, as the decision trail and docs/scheduling.md give it.
    name = ""

    def __init__(self, policy: "SchedulingPolicy") -> None:
        self.policy = weakref.proxy(policy)
        self.options = policy.options
        self.tasks = policy.tasks
        self.workers = policy.workers
        self.queues = policy.queues
        #: Whether the rule notes its decisions (:meth:`SchedulingPolicy.note`).
        self.noting = policy.trail_length > 0
