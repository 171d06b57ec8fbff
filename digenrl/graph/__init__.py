"""Graph building: the keys, annotations and DAG of each iteration (DESIGN.md section 4)."""

from digenrl.graph.build import GraphContext, IterationGraph, init_graph, iteration_graph
from digenrl.graph.keys import KINDS, task_meta
from digenrl.graph.plan import IterationPlan

__all__ = ["GraphContext", "IterationGraph", "IterationPlan", "init_graph", "iteration_graph",
           "KINDS", "task_meta"]
