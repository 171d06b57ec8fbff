"""The DAG of one iteration, the same for every mode (DESIGN.md section 4).

``noise`` (chunk) -> ``denoise`` (chunk, t) -> ... -> ``decode`` (chunk) -> ``reward``
(chunk) -> ``advantage`` (group) -> ``grad`` (chunk, t) for the trained timesteps ->
``reduce`` (a fixed tree) -> ``optimize`` -> ``publish`` (the weights of version v+1,
which later ``denoise`` and ``grad`` tasks read) and ``stats``.

Only the policy version the rollouts of an iteration read depends on the schedule:
iteration ``i`` trains with version ``i`` and generates its first ``stale_groups``
groups (all, by default) with version ``max(0, i - k)`` for the bounded staleness
``k``, the rest with version ``i``. Everything else about scheduling lives in the
annotations and the scheduler plugin.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Hashable

from dask._task_spec import Task, TaskRef
from dask.highlevelgraph import HighLevelGraph, MaterializedLayer

from digenrl.config import RunConfig
from digenrl.graph.keys import ANNOTATION, task_meta
from digenrl.graph.plan import IterationPlan
from digenrl.models import flow_sigmas, model_seed
from digenrl.tasks import advantage as adv_tasks
from digenrl.tasks import rollout, train
from digenrl.tasks.rewards import rewards_need_gpu

__all__ = ["GraphContext", "IterationGraph", "init_graph", "iteration_graph",
           "publish_key", "rollout_version"]

Key = tuple


def publish_key(version: int) -> Key:
    return ("publish", version)


INIT_KEY: Key = ("init",)


def optimize_key(iteration: int) -> Key:
    return INIT_KEY if iteration < 0 else ("optimize", iteration)


@dataclass(frozen=True)
class GraphContext:
    """Everything static for a run that the graph builder needs."""

    config: RunConfig
    rollout: rollout.RolloutSpec
    train: train.TrainSpec
    reward_gpu: bool
    version_lag: int
    stale_groups: int | None = None

    def chunk_version(self, plan: IterationPlan, chunk: int) -> int:
        """The policy version chunk ``chunk`` of ``plan`` is generated with."""
        i = plan.iteration
        first_group = plan.groups_of_chunk(chunk)[0]
        if self.stale_groups is None or first_group < self.stale_groups:
            return rollout_version(i, self.version_lag)
        return i

    def oldest_version(self, iteration: int) -> int:
        """The oldest version any rollout of ``iteration`` reads."""
        if self.stale_groups == 0:
            return iteration
        return rollout_version(iteration, self.version_lag)

    @classmethod
    def from_config(cls, config: RunConfig, version_lag: int | None = None) -> "GraphContext":
        sigmas = flow_sigmas(config.sampler, config.model)
        seed = model_seed(config.model, config.seed)
        rspec = rollout.RolloutSpec(
            model=config.model, sampler=config.sampler, seed=config.seed, model_seed=seed,
            sigmas=sigmas,
            samples_per_prompt=config.data.samples_per_prompt,
            same_noise_in_group=config.data.same_noise_in_group,
            save_latents=config.store.save_latents)
        tspec = train.TrainSpec(
            model=config.model, sampler=config.sampler, train=config.train, seed=seed,
            sigmas=sigmas,
            normaliser=config.data.samples_per_iteration * config.sampler.trained_steps)
        lag = config.schedule.options().max_staleness if version_lag is None else version_lag
        return cls(config=config, rollout=rspec, train=tspec,
                   reward_gpu=rewards_need_gpu(config.reward.components), version_lag=lag,
                   stale_groups=config.schedule.stale_groups)


def rollout_version(iteration: int, version_lag: int) -> int:
    """The policy version iteration ``iteration`` generates with."""
    return max(0, iteration - version_lag)


@dataclass
class IterationGraph:
    """Tasks, their annotations and the keys the driver collects."""

    tasks: dict[Key, Task] = field(default_factory=dict)
    meta: dict[Key, dict[str, Any]] = field(default_factory=dict)
    outputs: dict[str, list[Key]] = field(default_factory=dict)

    def add(self, key: Key, meta: dict[str, Any], func, *args) -> Key:
        assert key not in self.tasks, key
        self.tasks[key] = Task(key, func, *args)
        self.meta[key] = meta
        return key

    @property
    def output_keys(self) -> list[Key]:
        return [k for keys in self.outputs.values() for k in keys]

    def resources(self) -> dict[Key, dict[str, float]]:
        return {k: {"GPU": 1} for k, m in self.meta.items() if m["gpu"]}

    def to_hlg(self, name: str) -> HighLevelGraph:
        """One layer whose per-key annotations are looked up in plain dicts."""
        res = self.resources()
        layer = MaterializedLayer(dict(self.tasks), annotations={
            ANNOTATION: dict(self.meta).get,
            "resources": res.get,
        })
        return HighLevelGraph({name: layer}, {name: set()})


def _ref(key: Hashable) -> TaskRef:
    return TaskRef(key)


def init_graph(ctx: GraphContext) -> IterationGraph:
    """Version 0: the initial trainer state and its published weights."""
    g = IterationGraph()
    g.add(INIT_KEY, task_meta("init", -1, 0), train.init_state, ctx.train)
    g.add(publish_key(0), task_meta("publish", -1, 0), train.publish, _ref(INIT_KEY))
    g.outputs = {"publish": [publish_key(0)], "state": [INIT_KEY]}
    return g


def iteration_graph(ctx: GraphContext, plan: IterationPlan) -> IterationGraph:
    """The DAG of iteration ``plan.iteration``; external inputs are the published weights
    of the versions it reads and the previous optimizer state."""
    cfg = ctx.config
    i = plan.iteration
    tv = i
    T = cfg.sampler.num_steps
    trained = cfg.sampler.trained_steps
    g = IterationGraph()

    # Rollout: one chain of denoise steps per chunk, then decode and reward.
    step_keys: dict[int, list[Key]] = {}
    versions = {c: ctx.chunk_version(plan, c) for c in range(len(plan.chunks))}
    for c in range(len(plan.chunks)):
        rv = versions[c]
        ids = plan.sample_ids(c)
        prompts = plan.chunk_prompts(c)
        groups = plan.groups_of_chunk(c)
        common = dict(chunk=c, group=groups[0], samples=len(ids))
        prev = g.add(("noise", i, c), task_meta("noise", i, rv, **common),
                     rollout.noise, ctx.rollout, i, ids)
        chain = [prev]
        for t in range(T):
            prev = g.add(("denoise", i, c, t), task_meta("denoise", i, rv, timestep=t, **common),
                         rollout.denoise, ctx.rollout, _ref(publish_key(rv)), prompts, i, t,
                         _ref(prev))
            chain.append(prev)
        step_keys[c] = chain
        g.add(("decode", i, c), task_meta("decode", i, rv, **common), rollout.decode,
              ctx.rollout, *map(_ref, chain))
        g.add(("reward", i, c), task_meta("reward", i, rv, gpu=ctx.reward_gpu, **common),
              adv_tasks.score, dict(cfg.reward.components), cfg.reward.on_error, prompts,
              _ref(("decode", i, c)))

    # Advantages per prompt group.
    all_rewards = [_ref(("reward", i, c)) for c in range(len(plan.chunks))]
    for grp in range(plan.num_groups):
        if cfg.train.advantage_std == "batch":
            parts = all_rewards
        else:
            parts = [_ref(("reward", i, c)) for c in plan.chunks_of_group(grp)]
        bv = min(versions[c] for c in plan.chunks_of_group(grp))
        g.add(("advantage", i, grp),
              task_meta("advantage", i, tv, group=grp, behaviour_version=bv,
                        samples=cfg.data.samples_per_prompt),
              adv_tasks.advantage, grp, plan.group_sample_ids(grp),
              cfg.train.advantage_std, cfg.train.advantage_clip, *parts)

    # Micro-steps: one per chunk and trained timestep, in (chunk, t) order.
    reference = _ref(publish_key(0)) if cfg.train.kl_beta > 0 else None
    leaves: list[Key] = []
    for c in range(len(plan.chunks)):
        groups = plan.groups_of_chunk(c)
        advs = [_ref(("advantage", i, grp)) for grp in groups]
        for t in range(trained):
            leaves.append(g.add(
                ("grad", i, c, t),
                task_meta("grad", i, tv, timestep=t, chunk=c, group=groups[0],
                          behaviour_version=versions[c], samples=len(plan.sample_ids(c))),
                train.grad, ctx.train, _ref(publish_key(tv)), reference,
                plan.chunk_prompts(c), t, _ref(step_keys[c][t]), _ref(step_keys[c][t + 1]),
                *advs))

    # A fixed reduction tree: sums in (chunk, t) order whoever computes the parts.
    fanin = cfg.train.reduce_fanin
    level, nodes = 0, leaves
    while True:
        parents = []
        for j in range(0, len(nodes), fanin):
            parents.append(g.add(("reduce", i, level, j // fanin),
                                 task_meta("reduce", i, tv), train.reduce,
                                 *map(_ref, nodes[j:j + fanin])))
        nodes, level = parents, level + 1
        if len(nodes) == 1:
            break
    root = nodes[0]

    g.add(("optimize", i), task_meta("optimize", i, tv), train.optimize, ctx.train,
          _ref(optimize_key(i - 1)), _ref(root), i)
    g.add(publish_key(tv + 1), task_meta("publish", i, tv + 1), train.publish,
          _ref(("optimize", i)))
    g.add(("stats", i), task_meta("stats", i, tv), train.iteration_stats, _ref(("optimize", i)))
    n_chunks = len(plan.chunks)
    g.outputs = {
        "decode": [("decode", i, c) for c in range(n_chunks)],
        "reward": [("reward", i, c) for c in range(n_chunks)],
        "advantage": [("advantage", i, grp) for grp in range(plan.num_groups)],
        "stats": [("stats", i)],
        "state": [("optimize", i)],
        "publish": [publish_key(tv + 1)],
    }
    return g
