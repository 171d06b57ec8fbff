"""Bind the DAG of :mod:`digenrl.graph.structure` to the task functions.

Each node's operation maps to a task function and the run-wide specs it takes first;
``Dep`` arguments become references to other tasks.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass
from typing import Callable

from digenrl.config import ConfigError, RunConfig
from digenrl.graph.dask_graph import IterationGraph, bind, init_outputs, iteration_outputs
from digenrl.graph.plan import IterationPlan
from digenrl.graph.structure import (GraphLayout, Node, eval_nodes, init_nodes,
                                     iteration_nodes)
from digenrl.models.lora import trainable_spec
from digenrl.models import flow_sigmas, model_seed
from digenrl.prompts import HeldOut, held_out_prompts
from digenrl.tasks import advantage as adv_tasks
from digenrl.tasks import context_parallel, rollout, sharded_steps, train
from digenrl.tasks.context_parallel import ContextSpec
from digenrl.tasks.rollout import RolloutSpec
from digenrl.tasks.sharded_steps import ShardSpec
from digenrl.tasks.reward_sources import resolve_rewards
from digenrl.tasks.rewards import RewardSpec, rewards_need_gpu, split_group_rewards
from digenrl.vocabulary import (ADVANTAGE, DECODE, DENOISE, ENCODE, EVAL, EVAL_REWARD, GRAD,
                                GROUP_REWARD, INIT, NOISE, OPTIMIZE, PUBLISH, REDUCE, RESTORE,
                                REWARD, STATS, TRAINED)

__all__ = ["GraphContext", "IterationGraph", "init_graph", "iteration_graph"]


@dataclass(frozen=True)
class GraphContext:
    """Everything static for a run that the graph needs: its layout and the task specs."""

    config: RunConfig
    layout: GraphLayout
    rollout: RolloutSpec
    train: train.TrainSpec
    #: The reward functions with their weights (the reward tasks carry them): those
    #: that score each sample alone, and those that score a whole prompt group at once
    #: (the group reward tasks').
    rewards: tuple[tuple[RewardSpec, float], ...] = ()
    group_rewards: tuple[tuple[RewardSpec, float], ...] = ()
    #: Held-out evaluation: its sampler (its own steps and guidance) and prompts; None
    #: while evaluation is off.
    evaluation: RolloutSpec | None = None
    held_out: HeldOut | None = None
    #: The gang of a sharded run (``train.sharding: fsdp``), known once its cluster is:
    #: None until then, and for a run that trains unsharded.
    shard: ShardSpec | None = None
    #: How the run's context-parallel steps form their groups (None: a run whose
    #: chunks are all computed at degree 1).
    context: ContextSpec | None = None

    @classmethod
    def from_config(cls, config: RunConfig) -> "GraphContext":
        """The context of ``config``. Building the graph checks nothing of the world:
        what ``config`` names outside itself (the model folder, prompts, rewards, LoRA
        targets) is checked before, by :func:`~digenrl.run.world.check_world`, which the
        workload calls first."""
        sigmas = flow_sigmas(config.sampler, config.model)
        _check_sigmas(sigmas, config)
        mseed = model_seed(config.model, config.seed)
        rewards, group_rewards = split_group_rewards(resolve_rewards(
            config.reward.components, config.reward.remote, config.reward.models,
            config.reward.group))
        shape = config.algorithm_shape
        trainable = trainable_spec(config.model, config.train)
        rspec = rollout.RolloutSpec(
            model=config.model, sampler=config.sampler, seed=config.seed, model_seed=mseed,
            sigmas=sigmas, samples_per_prompt=config.data.samples_per_prompt,
            same_noise_in_group=config.data.same_noise_in_group,
            save_latents=config.store.save_latents, trainable=trainable, shape=shape,
            keep_means=config.algorithm.guard)
        # The rows a micro-step trains: samples, or one pair per prompt group.
        rows = (config.data.prompts_per_iteration if shape.pairwise
                else config.data.samples_per_iteration)
        tspec = train.TrainSpec(
            model=config.model, sampler=config.sampler, train=config.train, seed=mseed,
            sigmas=sigmas, normaliser=rows * shape.micro_steps_per_chunk(),
            trainable=trainable, shape=shape, settings=config.algorithm,
            draw_seed=config.seed)
        # Version 0's weights are the reference where a micro-step reads one (a KL term,
        # online DPO); with LoRA the reference is the base model, read from no version.
        reads_reference = config.train.kl_beta > 0 or shape.reference
        layout = GraphLayout(
            num_steps=config.sampler.num_steps, trained_steps=shape.trained_steps,
            advantage_std=config.train.advantage_std,
            advantage_clip=config.train.advantage_clip,
            reduce_fanin=config.train.reduce_fanin,
            kl=reads_reference and not trainable.lora,
            reward_gpu=rewards_need_gpu(rewards),
            version_lag=config.schedule.options().max_staleness,
            stale_groups=config.schedule.stale_groups, algorithm=shape,
            save_latents=config.store.save_latents, group_rewards=bool(group_rewards),
            group_reward_gpu=rewards_need_gpu(group_rewards),
            checkpoint_every=config.store.checkpoint_every)
        evaluation = held_out = None
        if config.eval.on:
            esampler = config.eval.sampler(config.sampler)
            esigmas = flow_sigmas(esampler, config.model)
            _check_sigmas(esigmas, config, "eval.num_steps")
            evaluation = dataclasses.replace(rspec, sampler=esampler, sigmas=esigmas,
                                             save_latents=False)
            held_out = held_out_prompts(config.data)
        context = None
        if config.rollout.context_parallel != 1:
            # A generation newer than any earlier run's groups on these workers.
            context = ContextSpec(backend=config.cluster.collective_backend,
                                  timeout=config.cluster.collective_timeout,
                                  generation=time.time_ns() // 1_000_000)
        return cls(config=config, layout=layout, rollout=rspec, train=tspec,
                   rewards=rewards, group_rewards=group_rewards, evaluation=evaluation,
                   held_out=held_out, context=context)

    def eval_nodes(self, version: int) -> list[Node]:
        """The evaluation of policy ``version`` (none when it is not evaluated)."""
        if self.held_out is None or not self.config.eval.evaluates(version):
            return []
        return eval_nodes(self.layout, version, self.held_out.prompts,
                          self.held_out.metadata, self.config.rollout.chunk_size,
                          self.held_out.inputs)

    def binding(self, node: Node) -> tuple[Callable, tuple]:
        """The task function of ``node`` and the specs passed before its arguments."""
        if self.layout.shards:
            bound = self._sharded_binding(node)
            if bound is not None:
                return bound
        if node.op == DENOISE and node.meta.get("gang") is not None:
            assert self.context is not None, "a run with context-parallel steps has a spec"
            gang, member = node.meta["gang"][:2]
            return context_parallel.denoise_member, (self.rollout, self.context, gang,
                                                     member)
        on_error = self.config.reward.on_error
        assert self.layout.algorithm is not None    # (set when the layout is made)
        table: dict[str, tuple[Callable, tuple]] = {
            INIT: (train.init_state, (self.train,)),
            ENCODE: (rollout.encode, (self.rollout,)),
            NOISE: (rollout.noise, (self.rollout,)),
            DENOISE: (rollout.denoise, (self.rollout,)),
            DECODE: (rollout.decode, (self.rollout,)),
            REWARD: (adv_tasks.score, (self.rewards, on_error, node.meta["iteration"])),
            GROUP_REWARD: (adv_tasks.score_group,
                           (self.group_rewards, on_error, node.meta["iteration"])),
            EVAL: (rollout.evaluate, (self.evaluation,)),
            EVAL_REWARD: (adv_tasks.score, (self.rewards, on_error, node.meta["iteration"])),
            ADVANTAGE: (adv_tasks.advantage, ()),
            GRAD: ((train.grad if self.layout.algorithm.coupled else train.matching_grad),
                   (self.train,)),
            REDUCE: (train.reduce, ()),
            OPTIMIZE: (train.optimize, (self.train,)),
            PUBLISH: (train.publish, ()),
            TRAINED: (train.trained, ()),
            STATS: (train.iteration_stats, ()),
        }
        return table[node.op]

    def _sharded_binding(self, node: Node) -> tuple[Callable, tuple] | None:
        """A sharded run's own tasks: its gangs' steps, and the publish and statistics
        read off their member 0 (None for the tasks it shares with every run)."""
        shard = self.shard
        assert shard is not None, "a sharded run's gang is set before its graphs are built"
        member = node.meta.get("gang") is not None
        if node.op in (INIT, RESTORE) and member:
            return sharded_steps.make, (self.train, shard)
        if node.op == RESTORE:
            return sharded_steps.read_published, (shard.store,
                                                  self.train.algorithm.sampling_copy)
        if node.op == PUBLISH and member:
            return sharded_steps.publish_member, (self.train, shard)
        table: dict[str, tuple[Callable, tuple]] = {
            GRAD: (sharded_steps.micro_step, (self.train, shard)),
            OPTIMIZE: (sharded_steps.optimizer_step, (self.train, shard)),
            PUBLISH: ((sharded_steps.announced, (self.train, shard)) if shard.broadcast
                      else (sharded_steps.published, ())),
            STATS: (sharded_steps.statistics, ()),
        }
        return table.get(node.op)


def _check_sigmas(sigmas: tuple[float, ...], config: RunConfig,
                  steps_field: str = "sampler.num_steps") -> None:
    """Every step must move: finite noise levels, strictly decreasing (in float32, as the
    scheduler computes them). An extreme shift collapses them to 1 or to NaN."""
    if all(math.isfinite(s) for s in sigmas) and all(
            a > b for a, b in zip(sigmas, sigmas[1:])):
        return
    raise ConfigError(
        f"sampler.shift: expected a shift giving {len(sigmas) - 1} distinct noise "
        f"levels ({steps_field}), got {config.sampler.shift!r} (levels "
        f"{[round(s, 6) for s in sigmas[:4]]}...)")


def init_graph(ctx: GraphContext) -> IterationGraph:
    return bind(init_nodes(), ctx.binding, init_outputs())


def iteration_graph(ctx: GraphContext, plan: IterationPlan) -> IterationGraph:
    return bind(iteration_nodes(ctx.layout, plan), ctx.binding,
                iteration_outputs(plan, ctx.layout.group_rewards))
