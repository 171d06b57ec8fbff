"""Nodes of :mod:`digenrl.graph.structure` as a Dask graph (no task code imported here).

``bind`` turns each node into a ``Task`` calling what a binding function says for its
op; ``IterationGraph.to_hlg`` makes one HighLevelGraph layer whose per-key annotations
(the ``digenrl`` annotation and the ``GPU`` resource) are looked up in plain dicts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from dask._task_spec import Task, TaskRef
from dask.highlevelgraph import HighLevelGraph, MaterializedLayer

from digenrl.graph.keys import (INIT_KEY, Key, advantage_key, decode_key, group_reward_key,
                                optimize_key, publish_key, reward_key, stats_key)
from digenrl.graph.plan import IterationPlan
from digenrl.graph.structure import Dep, Node
from digenrl.vocabulary import (ADVANTAGE, ANNOTATION, DECODE, GROUP_REWARD, PUBLISH, REWARD,
                                STATS)

__all__ = ["IterationGraph", "bind", "init_outputs", "iteration_outputs"]

#: op -> (function, leading arguments)
Binding = Callable[[Node], tuple[Callable, tuple]]


@dataclass
class IterationGraph:
    """Tasks, their annotations and the keys the driver collects."""

    tasks: dict[Key, Task] = field(default_factory=dict)
    meta: dict[Key, dict[str, Any]] = field(default_factory=dict)
    outputs: dict[str, list[Key]] = field(default_factory=dict)

    @property
    def output_keys(self) -> list[Key]:
        return [k for keys in self.outputs.values() for k in keys]

    def resources(self) -> dict[Key, dict[str, float]]:
        return {k: {"GPU": 1} for k, m in self.meta.items() if m["gpu"]}

    def to_hlg(self, name: str) -> HighLevelGraph:
        layer = MaterializedLayer(dict(self.tasks), annotations={
            ANNOTATION: dict(self.meta).get,
            "resources": self.resources().get,
        })
        return HighLevelGraph({name: layer}, {name: set()})


def bind(nodes: Sequence[Node], binding: Binding, outputs: dict[str, list[Key]]) -> IterationGraph:
    g = IterationGraph(outputs=outputs)
    for node in nodes:
        func, lead = binding(node)
        args = [TaskRef(a.key) if isinstance(a, Dep) else a for a in node.args]
        g.tasks[node.key] = Task(node.key, func, *lead, *args)
        g.meta[node.key] = node.meta
    return g


#: The output holding the trainer state (the others are named by their tasks' kind).
STATE = "state"


def init_outputs() -> dict[str, list[Key]]:
    return {PUBLISH: [publish_key(0)], STATE: [INIT_KEY]}


def iteration_outputs(plan: IterationPlan,
                      group_rewards: bool = False) -> dict[str, list[Key]]:
    """The keys the driver collects of an iteration, by kind (the trainer state under
    :data:`STATE`; the group reward tasks' where the run has group rewards)."""
    i, n_chunks = plan.iteration, len(plan.chunks)
    return {
        DECODE: [decode_key(i, c) for c in range(n_chunks)],
        REWARD: [reward_key(i, c) for c in range(n_chunks)],
        GROUP_REWARD: ([group_reward_key(i, g) for g in range(plan.num_groups)]
                       if group_rewards else []),
        ADVANTAGE: [advantage_key(i, grp) for grp in range(plan.num_groups)],
        STATS: [stats_key(i)],
        STATE: [optimize_key(i)],
        PUBLISH: [publish_key(i + 1)],
    }
