"""The scheduling policy: pure decisions, no Dask, no torch.

The plugin (:mod:`digenrl.schedulers.plugin`) and the simulator (:mod:`digenrl.sim.engine`)
feed the same :class:`SchedulingPolicy` events -- workers join and leave, tasks are
added, become ready, finish or are lost -- and ask it which ready task to release to
which worker. A small core (:mod:`.core`) keeps the tasks, the workers, the ready queues
and the facts several rules read (:class:`.state.Facts`: what has started, step times,
the published version) and runs the decision round; each rule of docs/scheduling.md is
a :class:`.rules.Rule` of its own module, owning its state, whose methods are the
events it concerns. The core calls its list of rules (:data:`.core.RULES`), in order,
at each event, and holds none by name:

============================  ===================================================
rule                          module
============================  ===================================================
bounded staleness, barrier    :mod:`.rules.staleness`
gangs (collective steps)      :mod:`.rules.gang`
GAP (order, deferred decodes) :mod:`.rules.gap`
hand-off of the trainer state :mod:`.rules.handoff`
TSP                           :mod:`.rules.tsp`
pools, CPU placement          :mod:`.rules.pools`
background work (evaluation)  :mod:`.rules.background`
rebalancing (stealing)        :mod:`.rules.rebalance`
TAG                           :mod:`.rules.tag`
RAT                           :mod:`.rules.rat`
============================  ===================================================

Every decision is noted on its task with the rule and the reason (:mod:`.trail`), which
``digenrl why`` prints from a run's store. The task, worker and decision records and
the facts are in :mod:`.state`, the ready heaps in :mod:`.queues`.
"""

from digenrl.schedulers.policy.core import HELD_REASONS, SchedulingPolicy, validate_task
from digenrl.schedulers.policy.state import Decision, TaskInfo, WorkerInfo

__all__ = ["TaskInfo", "WorkerInfo", "Decision", "SchedulingPolicy", "validate_task",
           "HELD_REASONS"]
