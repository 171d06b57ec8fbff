"""Bind the DAG of :mod:`digenrl.graph.structure` to task functions, for Dask.

Each node's operation maps to a task function and the run-wide specs it takes first;
``Dep`` arguments become references to other tasks. Annotations travel per key in the
layer's annotations (looked up in plain dicts on the scheduler).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Hashable

from dask._task_spec import Task, TaskRef
from dask.highlevelgraph import HighLevelGraph, MaterializedLayer

from digenrl.config import RunConfig
from digenrl.graph.keys import ANNOTATION
from digenrl.graph.plan import IterationPlan
from digenrl.graph.structure import (INIT_KEY, Dep, GraphLayout, Node, init_nodes,
                                     iteration_nodes, optimize_key, publish_key,
                                     rollout_version)
from digenrl.models import flow_sigmas, model_seed
from digenrl.tasks import advantage as adv_tasks
from digenrl.tasks import rollout, train
from digenrl.tasks.rewards import rewards_need_gpu

__all__ = ["GraphContext", "IterationGraph", "init_graph", "iteration_graph", "publish_key",
           "optimize_key", "rollout_version", "INIT_KEY"]

Key = Hashable


@dataclass(frozen=True)
class GraphContext:
    """Everything static for a run that the graph needs: its layout and the task specs."""

    config: RunConfig
    layout: GraphLayout
    rollout: rollout.RolloutSpec
    train: train.TrainSpec

    @classmethod
    def from_config(cls, config: RunConfig) -> "GraphContext":
        sigmas = flow_sigmas(config.sampler, config.model)
        mseed = model_seed(config.model, config.seed)
        rspec = rollout.RolloutSpec(
            model=config.model, sampler=config.sampler, seed=config.seed, model_seed=mseed,
            sigmas=sigmas, samples_per_prompt=config.data.samples_per_prompt,
            same_noise_in_group=config.data.same_noise_in_group,
            save_latents=config.store.save_latents)
        tspec = train.TrainSpec(
            model=config.model, sampler=config.sampler, train=config.train, seed=mseed,
            sigmas=sigmas,
            normaliser=config.data.samples_per_iteration * config.sampler.trained_steps)
        layout = GraphLayout(
            num_steps=config.sampler.num_steps, trained_steps=config.sampler.trained_steps,
            advantage_std=config.train.advantage_std,
            advantage_clip=config.train.advantage_clip,
            reduce_fanin=config.train.reduce_fanin, kl=config.train.kl_beta > 0,
            reward_gpu=rewards_need_gpu(config.reward.components),
            version_lag=config.schedule.options().max_staleness,
            stale_groups=config.schedule.stale_groups)
        return cls(config=config, layout=layout, rollout=rspec, train=tspec)

    def binding(self, op: str) -> tuple[Callable, tuple]:
        """The task function of ``op`` and the specs passed before the node's arguments."""
        reward = self.config.reward
        return {
            "init": (train.init_state, (self.train,)),
            "noise": (rollout.noise, (self.rollout,)),
            "denoise": (rollout.denoise, (self.rollout,)),
            "decode": (rollout.decode, (self.rollout,)),
            "reward": (adv_tasks.score, (dict(reward.components), reward.on_error)),
            "advantage": (adv_tasks.advantage, ()),
            "grad": (train.grad, (self.train,)),
            "reduce": (train.reduce, ()),
            "optimize": (train.optimize, (self.train,)),
            "publish": (train.publish, ()),
            "stats": (train.iteration_stats, ()),
        }[op]


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
        """One layer whose per-key annotations are looked up in plain dicts."""
        layer = MaterializedLayer(dict(self.tasks), annotations={
            ANNOTATION: dict(self.meta).get,
            "resources": self.resources().get,
        })
        return HighLevelGraph({name: layer}, {name: set()})


def _bind(ctx: GraphContext, nodes: list[Node]) -> IterationGraph:
    g = IterationGraph()
    for node in nodes:
        func, specs = ctx.binding(node.op)
        args = [TaskRef(a.key) if isinstance(a, Dep) else a for a in node.args]
        g.tasks[node.key] = Task(node.key, func, *specs, *args)
        g.meta[node.key] = node.meta
    return g


def init_graph(ctx: GraphContext) -> IterationGraph:
    g = _bind(ctx, init_nodes())
    g.outputs = {"publish": [publish_key(0)], "state": [INIT_KEY]}
    return g


def iteration_graph(ctx: GraphContext, plan: IterationPlan) -> IterationGraph:
    g = _bind(ctx, iteration_nodes(ctx.layout, plan))
    i, n_chunks = plan.iteration, len(plan.chunks)
    g.outputs = {
        "decode": [("decode", i, c) for c in range(n_chunks)],
        "reward": [("reward", i, c) for c in range(n_chunks)],
        "advantage": [("advantage", i, grp) for grp in range(plan.num_groups)],
        "stats": [("stats", i)],
        "state": [optimize_key(i)],
        "publish": [publish_key(i + 1)],
    }
    return g
