"""The scheduling policy: pure decisions, no Dask, no torch.

The plugin (:mod:`digenrl.schedulers.plugin`) and the simulator (:mod:`digenrl.sim.engine`)
feed the same :class:`SchedulingPolicy` events -- workers join and leave, tasks are
added, become ready, finish or are lost -- and ask it which ready task to release to
which worker. A small core (:mod:`.core`) keeps the tasks, the workers and the ready
queues and runs the decision round; each rule of docs/scheduling.md is a module of
:mod:`.rules` that owns its state and is asked for its say where it applies:

============================  ===================================================
rule                          module
============================  ===================================================
pools, CPU placement          :mod:`.rules.pools`
bounded staleness, barrier    :mod:`.rules.staleness`
GAP (order, deferred decodes) :mod:`.rules.gap`
TSP                           :mod:`.rules.tsp`
TAG                           :mod:`.rules.tag`
RAT                           :mod:`.rules.rat`
work that can wait            :mod:`.rules.version_change` (read by GAP, TAG, RAT)
rebalancing (stealing)        :mod:`.rules.rebalance`
background work (evaluation)  :mod:`.rules.background`
hand-off of the trainer state :mod:`.rules.handoff`
============================  ===================================================

Every decision is noted on its task with the rule and the reason (:mod:`.trail`), which
``digenrl why`` prints from a run's store. The task, worker and decision records are in
:mod:`.state`, the ready heaps in :mod:`.queues`.
"""

from digenrl.schedulers.policy.core import HELD_REASONS, SchedulingPolicy, validate_task
from digenrl.schedulers.policy.state import Decision, TaskInfo, WorkerInfo

__all__ = ["TaskInfo", "WorkerInfo", "Decision", "SchedulingPolicy", "validate_task",
           "HELD_REASONS"]
