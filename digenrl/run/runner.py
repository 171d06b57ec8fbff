"""The training workload: what ``digenrl run`` computes and writes.

:class:`RLWorkload` (reinforcement-learning post-training with whichever
``algorithm.name`` selects: Flow-GRPO and its dynamics, DiffusionNFT, AWM, DPO) binds the iteration DAG to the real task functions (a
diffusers model on every worker) and turns each iteration's decoded images, rewards,
advantages and statistics (gathered by sample in an :class:`IterationResults`) into the
``samples``, ``steps`` and ``metrics`` rows of the store, and the held-out evaluations
stored with the iteration into ``eval`` rows. A decoupled algorithm keeps no trajectory:
its runs write no ``steps`` rows (the group stays empty). :class:`Runner` runs it with
the generic :class:`~digenrl.run.driver.Driver`.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
from distributed import wait

from digenrl.algorithms import ALGORITHMS
from digenrl.store.checkpoints import write_weights
from digenrl.checks import require
from digenrl.figures.analysis import pools_served
from digenrl.run.cluster import ClusterHandle, pool_counts, start_cluster
from digenrl.config import (AUTO, ConfigError, RunConfig, StoreConfig, config_from_dict,
                            config_to_dict)
from digenrl.run.driver import Driver, IterationSummary, RunResult, check_store, library_versions
from digenrl.graph.build import GraphContext
from digenrl.graph.dask_graph import IterationGraph, bind
from digenrl.graph.keys import (advantage_key, decode_key, eval_reward_key,
                                group_reward_key, kind_of, reward_key, stats_key)
from digenrl.graph.plan import IterationPlan
from digenrl.models import family, model_seed
from digenrl.prompts import load_prompt_file, prompt_source, source_table
from digenrl.run.world import check_world
from digenrl.schedulers.chunking import ChunkingSpec
from digenrl.schedulers.parallelism import DEGREES
from digenrl.schedulers.options import MODES
from digenrl.store import (ADVANTAGE_COLUMN, EVAL_GROUP, REWARD_COLUMN, SOURCES_ATTRIBUTE,
                           RunStore, evaluation_means, frame_strip, reward_column)
from digenrl.tasks.advantage import scored_samples
from digenrl.tasks import context_parallel, sharded_steps
from digenrl.tasks.checkpoint import CheckpointSpec, load_state, save_state
from digenrl.tasks.footprint import model_key
from digenrl.tasks.sharded_steps import ShardSpec
from digenrl.tasks.resident import ResidentPlugin, sharded_weights
from digenrl.tasks.types import DecodeOut, IterationStats, PolicyWeights, RewardOut
from digenrl.run.tracking import ATTRIBUTE as TRACKING_ATTRIBUTE, Tracker
from digenrl.vocabulary import (ADVANTAGE, CHECKPOINT, COLOCATED, DECODE, EVAL, EVAL_REWARD,
                                GROUP_REWARD, RESTORE, REWARD, ROLLOUT, STATS, TRAINER, Key)

__all__ = ["RLWorkload", "IterationResults", "Runner", "RunResult", "IterationSummary",
           "library_versions"]

logger = logging.getLogger("digenrl")


class RLWorkload:
    """Post-training of the configured model with the configured algorithm."""

    collected: tuple[str, ...] = (DECODE, REWARD, GROUP_REWARD, ADVANTAGE, STATS, EVAL,
                                  EVAL_REWARD)

    def __init__(self, config: RunConfig):
        self.config = config
        self.options = config.schedule.options()
        check_world(config)  # before any graph: a workload exists only for a world that fits
        self.ctx = GraphContext.from_config(config)
        self.layout = self.ctx.layout
        self.iterations = config.iterations
        self.images_per_iteration = config.data.samples_per_iteration
        self.prompts = prompt_source(config.data)
        #: Each source image the prompt files name, once (in line order, the training
        #: prompts' first): a sample's ``source`` column is its position here.
        self.sources = source_table(config.data, config.eval.on)
        self._source_index = {s: k for k, s in enumerate(self.sources)}
        self.checkpoint_spec: CheckpointSpec | None = None
        r = config.rollout
        self.chunking = (ChunkingSpec(config.data.samples_per_prompt, r.chunk_size,
                                      r.max_chunk_size) if r.chunking == "adaptive" else None)
        #: The experiment trackers' runs, by tracker (:attr:`Tracker.runs`), stored with
        #: the run so that a resumed run continues them.
        self.tracking_runs: dict[str, dict] = {}

    def plan(self, iteration: int, chunk_size: int | None = None) -> IterationPlan:
        """Iteration ``iteration``'s prompts in chunks of ``chunk_size`` (default
        ``rollout.chunk_size``), each at the configured context-parallel degree (with
        ``auto``, 1 until the driver sets the iteration's degrees)."""
        d = self.config.data
        prompts, metadata, inputs = self.prompts.draw(d.prompts_per_iteration,
                                                      self.config.seed, iteration)
        degree = self.config.rollout.context_parallel
        return IterationPlan.uniform(iteration, prompts, d.samples_per_prompt,
                                     chunk_size or self.config.rollout.chunk_size, metadata,
                                     inputs, degree if isinstance(degree, int) else 1)

    @property
    def context_degrees(self) -> tuple[int, ...] | None:
        """With ``rollout.context_parallel: auto``, the degrees the run may choose from
        (those of :data:`~digenrl.schedulers.parallelism.DEGREES` the family's plan and
        heads take); None when the degree is fixed."""
        if self.config.rollout.context_parallel != AUTO:
            return None
        fam = family(self.config.model)
        return tuple(d for d in DEGREES if fam.takes_degree(d))

    @property
    def model_key(self) -> str:
        """What names this run's model among the step measurements of a cluster's runs
        (:func:`digenrl.tasks.footprint.model_key`)."""
        return model_key(self.config.model)

    @property
    def gpu_memory_gb(self) -> float:
        """A worker's GPU memory where the worker reports none: ``cluster.gpu_memory_gb``."""
        return self.config.cluster.gpu_memory_gb

    def eval_nodes(self, version: int):
        """The held-out evaluation of policy ``version`` (none when not evaluated)."""
        return self.ctx.eval_nodes(version)

    def bind(self, nodes, outputs) -> IterationGraph:
        return bind(nodes, self._binding, outputs)

    def _binding(self, node):
        if node.op in (CHECKPOINT, RESTORE) and not self.layout.shards:
            assert self.checkpoint_spec is not None, "prepare() sets the store first"
            func = save_state if node.op == CHECKPOINT else load_state
            return func, (self.checkpoint_spec,)
        return self.ctx.binding(node)

    def attrs(self) -> dict[str, Any]:
        attrs: dict[str, Any] = {
            "config": config_to_dict(self.config), "derived": self.config.derived(),
            "workload": "rl", "algorithm": self.config.algorithm.name,
            "prompt_files": self._prompt_files()}
        if self.sources:
            attrs[SOURCES_ATTRIBUTE] = [{"path": s.path, "sha256": s.sha256}
                                        for s in self.sources]
        if self.tracking_runs:
            attrs[TRACKING_ATTRIBUTE] = self.tracking_runs
        return attrs

    def _prompt_files(self) -> dict[str, str]:
        """The SHA-256 of each prompt file the config names, by its field."""
        d = self.config.data
        return {f"data.{name}": load_prompt_file(path, f"data.{name}").sha256
                for name, path in (("prompt_file", d.prompt_file),
                                   ("eval_prompt_file", d.eval_prompt_file))
                if path is not None}

    def check_resume(self, attrs: dict[str, Any]) -> None:
        """A resumed run must do the same work: only iterations, cluster, store and
        tracking settings may differ from the stored config."""
        stored = dict(attrs.get("config") or {})
        try:  # fields added since the run was stored compare as their defaults
            stored = config_to_dict(config_from_dict(stored))
        except ConfigError:
            pass
        now = config_to_dict(self.config)
        differ = sorted(k for k in set(stored) | set(now)
                        if k not in ("iterations", "cluster", "store", "tracking")
                        and stored.get(k) != now.get(k))
        if differ:
            raise ConfigError(f"resume: the config differs from the stored run's in "
                              f"{differ}; resume with the stored config (only iterations, "
                              f"cluster, store and tracking settings may change)")
        stored_files = attrs.get("prompt_files") or {}
        for name, digest in self._prompt_files().items():
            if stored_files.get(name, digest) != digest:
                raise ConfigError(f"resume: {name} changed since the run was stored "
                                  f"(SHA-256 {stored_files[name][:12]}..., now "
                                  f"{digest[:12]}...); its epochs would visit other "
                                  f"prompts: resume with the file the run started with")

    def prepare(self, client, store: RunStore) -> None:
        self.checkpoint_spec = CheckpointSpec(os.path.abspath(store.path))
        cfg = self.config
        if cfg.train.sharding == "fsdp":
            self._shard_over(client, self.checkpoint_spec.store)
        shape = self.layout.algorithm
        assert shape is not None        # (the layout sets it when made)
        if shape.keeps_trajectory():
            store.set_static("steps", "sigma",
                             np.asarray(self.ctx.rollout.sigmas[:-1], np.float64), ("step",))
        # A version with a sampling copy is two modules on a trainer.
        versions = (self.options.max_staleness + 3) * (2 if shape.sampling_copy else 1)
        client.register_plugin(ResidentPlugin(cfg.model, model_seed(cfg.model, cfg.seed),
                                              cfg.cluster.torch_threads,
                                              max_versions=versions,
                                              trainable=self.ctx.rollout.trainable))
        if cfg.reward.models:
            from digenrl.tasks.reward_models import EVENT_TOPIC, log_load_event

            # Each worker's load of a reward model, in this run's log.
            client.subscribe_topic(EVENT_TOPIC, log_load_event)

    def check_cluster(self, client) -> None:
        """What the run needs of the cluster it runs on, before it opens its store: a
        sharded run, a gang of at least two workers that train."""
        if self.config.train.sharding == "fsdp":
            self._gang(client)

    def training_pool(self, client) -> tuple[str, ...]:
        """The workers of the pool that trains (the trainer pool, or every worker in
        colocated mode), in the gang rule's order of a pool: by name."""
        pools = pools_served(pool_counts(client), self.options.pools)
        return tuple(sorted(pools[TRAINER if self.options.pools else COLOCATED]))

    def receiving_pool(self, client) -> tuple[str, ...]:
        """The workers outside the pool that trains (the rollout pool's with pools, none
        in colocated mode), by name: what a broadcast reaches beside the trainers."""
        if not self.options.pools:
            return ()
        return tuple(sorted(pools_served(pool_counts(client), True)[ROLLOUT]))

    def _gang(self, client) -> tuple[str, ...]:
        """:meth:`training_pool`, refused in one line below two workers."""
        members = self.training_pool(client)
        require(len(members) >= 2, "train.sharding",
                f"fsdp over at least 2 workers of the "
                f"{TRAINER if self.options.pools else COLOCATED} pool (the cluster has "
                f"{len(members)})", "fsdp")
        return members

    def _shard_over(self, client, store: str) -> None:
        """Train sharded over the workers of the pool that trains: the gang of every
        collective step, as a new generation of the ``trainer`` group (which, publishing
        by broadcast, spans the rollout pool's workers too)."""
        members = self._gang(client)
        cfg = self.config
        cluster, train = cfg.cluster, cfg.train
        receivers = self.receiving_pool(client) if train.broadcasts else ()
        # A generation newer than any earlier run's on these workers (its groups are
        # torn down when it joins).
        shard = ShardSpec(name=TRAINER, generation=time.time_ns() // 1_000_000,
                          members=members, backend=cluster.collective_backend,
                          timeout=cluster.collective_timeout, store=store,
                          broadcast=train.broadcasts, receivers=receivers,
                          bucket_mb=train.sync_bucket_mb)
        self.layout = dataclasses.replace(self.layout, shards=len(members),
                                          broadcast=shard.broadcast,
                                          receivers=len(receivers))
        self.ctx = dataclasses.replace(self.ctx, layout=self.layout, shard=shard)

    def close(self, client) -> None:
        """A sharded run's members leave its group and drop their trainer state; the
        workers of a run's context-parallel steps leave their groups."""
        named = {str(w.get("name")): a
                 for a, w in client.scheduler_info(n_workers=-1)["workers"].items()}
        futures = []
        shard = self.ctx.shard
        if shard is not None:
            futures += [client.submit(sharded_steps.leave, shard.name, workers=[named[m]],
                                      allow_other_workers=False, pure=False)
                        for m in shard.everyone if m in named]
        if self.ctx.context is not None:
            futures += [client.submit(context_parallel.leave, workers=[address],
                                      allow_other_workers=False, pure=False)
                        for address in named.values()]
        wait(futures, timeout=30)

    def describe(self) -> list[str]:
        cfg, d = self.config, self.config.derived()
        shape = self.layout.algorithm
        assert shape is not None        # (the layout sets it when made)
        if not shape.coupled:
            what = (f"{d['trained_steps']} per chunk, drawn noise levels; ODE sampling, "
                    f"{cfg.sampler.num_steps} steps")
        elif shape.window:
            what = (f"{d['trained_steps']} SDE steps of {cfg.sampler.num_steps} drawn per "
                    f"iteration from {list(shape.sde_candidates)}, {shape.dynamics} dynamics")
        else:
            what = (f"{d['trained_steps']} trained timesteps of {cfg.sampler.num_steps}, "
                    f"{shape.dynamics} dynamics")
        options = self.options
        staleness = f"max staleness {options.max_staleness}"
        if (ALGORITHMS[shape.name].defaults_for(shape.dynamics).get("schedule.max_staleness") == options.max_staleness
                != MODES[options.mode]["max_staleness"]):
            staleness += (f" ({shape.name}'s default, not the mode's "
                          f"{MODES[options.mode]['max_staleness']}: docs/algorithm.md)")
        shard = self.ctx.shard
        lines = [] if shard is None else [
            f"training sharded (fsdp) over {shard.size} workers: "
            f"{', '.join(shard.members)}; new weights "
            + (f"broadcast from {shard.members[0]} to the {len(shard.everyone) - 1} other "
               f"workers of its group in buckets of {shard.bucket_mb:g} MiB"
               if shard.broadcast else "sent through Dask")]
        return lines + [
                f"algorithm {shape.name} ({'coupled' if shape.coupled else 'decoupled'}, "
                f"arXiv {shape.paper})",
                f"schedule: {options.mode} mode, {staleness}",
                f"per iteration: {d['images_per_iteration']} images "
                f"({cfg.data.prompts_per_iteration} prompts x {cfg.data.samples_per_prompt}), "
                f"{d['chunks_per_iteration']} chunks, {d['denoise_tasks_per_iteration']} denoise "
                f"tasks, {d['micro_steps_per_iteration']} micro-steps ({what})"]

    def rows(self, i: int, plan: IterationPlan,
             values: dict[Key, Any]) -> tuple[dict[str, dict], dict[str, float]]:
        results = IterationResults.collect(i, plan, values, self.config)
        for p in results.problems:
            logger.warning("iteration %d: %s", i, p)
        groups = {"samples": results.samples()}
        if self.sources:
            groups["samples"]["source"] = self._sources_of(
                [plan.inputs[plan.group_of(s)] for s in range(plan.num_samples)])
        shape = self.layout.algorithm
        assert shape is not None        # (the layout sets it when made)
        if shape.keeps_trajectory():
            groups["steps"] = results.steps()
        metrics = results.metrics()
        evaluated = self._eval_rows(i, values)
        if self.config.eval.on:
            # NaN for an iteration stored without an evaluation
            metrics["eval_reward_mean"] = metrics["eval_version"] = float("nan")
        if evaluated is not None:
            groups[EVAL_GROUP] = evaluated
            version, mean, _ = evaluation_means(evaluated)[-1]  # the newest
            metrics["eval_reward_mean"], metrics["eval_version"] = mean, float(version)
        return groups, metrics

    def _eval_rows(self, i: int, values: dict[Key, Any]) -> dict[str, np.ndarray] | None:
        """The ``eval`` rows of the evaluations stored with iteration ``i``: one per
        evaluated version and held-out prompt, by version then prompt."""
        keys = sorted((k for k in values if isinstance(k, tuple) and kind_of(k) == EVAL),
                      key=lambda k: (k[1], k[2]))
        if not keys:
            return None
        held_out = self.ctx.held_out
        assert held_out is not None     # (evaluations run only with held-out prompts)
        version, index, reward, valid, images = [], [], [], [], []
        components: dict[str, list] = {name: [] for name in self.config.reward.components}
        for key in keys:
            decoded, scored = values[key], values[eval_reward_key(*key[1:])]
            version += [key[1]] * len(decoded.sample_ids)
            index += list(decoded.sample_ids)
            reward.append(scored.rewards)
            valid.append(scored.valid)
            for name in components:
                components[name].append(scored.components.get(
                    name, np.full(len(decoded.sample_ids), np.nan)))
            images.append(frame_strip(decoded.images))
            for p in scored.problems:
                logger.warning("evaluation of policy version %d: %s", key[1], p)
        rows = {
            "version": np.asarray(version, np.int32),
            "prompt_index": np.asarray(index, np.int32),
            "prompt": np.array([held_out.prompts[j] for j in index]),
            REWARD_COLUMN: np.concatenate(reward).astype(np.float64),
            "valid": np.concatenate(valid).astype(bool),
        }
        for name, parts in components.items():
            rows[reward_column(name)] = np.concatenate(parts).astype(np.float64)
        rows["image"] = np.concatenate(images).astype(np.uint8)
        if self.sources and held_out.inputs:
            rows["source"] = self._sources_of([held_out.inputs[j] for j in index])
        return rows

    def _sources_of(self, inputs) -> np.ndarray:
        """Each sample's source image as its position in :attr:`sources` (-1: none)."""
        return np.asarray([self._source_index[i.images[0]] if i.images else -1
                           for i in inputs], np.int32)

    def finish(self, client, store: RunStore, final_weights) -> PolicyWeights:
        weights = final_weights.result()
        if weights.held:   # broadcast: its float32 weights are in its sharded checkpoint
            weights = sharded_weights(store.path, weights.version, weights.sampling_copy)
        write_weights(store.root, weights.version,
                      {n: t.detach().cpu().numpy() for n, t in weights.tensors.items()})
        store.commit()
        return weights


@dataclass
class IterationResults:
    """An iteration's results by sample, gathered once from the tasks the driver
    collected (:meth:`collect`); the ``samples``, ``steps`` and ``metrics`` rows of the
    store are read off it."""

    iteration: int
    plan: IterationPlan
    #: Each sample's weighted reward (NaN where it has none), and whether it has one.
    reward: np.ndarray
    valid: np.ndarray
    #: Each configured reward's score of each sample (NaN where it has none).
    components: dict[str, np.ndarray]
    #: Each sample's advantage (0 where invalid).
    advantage: np.ndarray
    #: Each sample's log-prob at every step as generated (NaN at an ODE step; no steps for
    #: a decoupled algorithm), and the policy version that generated it.
    log_prob: np.ndarray
    behaviour_version: np.ndarray
    #: What the optimizer step measured.
    stats: IterationStats
    #: The decoded images (a video's middle frame), the whole videos and each step's
    #: latents: each only when the run stores it.
    images: np.ndarray | None = None
    videos: np.ndarray | None = None
    latents: np.ndarray | None = None
    #: What the rewards said of the samples they could not score.
    problems: list[str] = field(default_factory=list)

    @classmethod
    def collect(cls, i: int, plan: IterationPlan, values: dict[Key, Any],
                config: RunConfig) -> "IterationResults":
        """The results of iteration ``i`` from its collected task results ``values``."""
        n = plan.num_samples
        results = cls(
            iteration=i, plan=plan, reward=np.full(n, np.nan), valid=np.zeros(n, bool),
            components={name: np.full(n, np.nan) for name in config.reward.components},
            advantage=np.zeros(n, np.float32),
            log_prob=np.zeros((n, config.sampler.num_steps if config.algorithm.coupled
                               else 0), np.float32),
            behaviour_version=np.zeros(n, np.int32), stats=values[stats_key(i)])
        scored = [values[reward_key(i, c)] for c in range(len(plan.chunks))]
        # The group rewards' outputs, where the run has group rewards.
        grouped = (group_reward_key(i, g) for g in range(plan.num_groups))
        scored += [values[k] for k in grouped if k in values]
        for r in scored:
            results._scored(r)
        ids, reward, valid = scored_samples(scored)  # as the advantage tasks sum them
        results.reward[ids] = reward
        results.valid[ids] = valid
        for g in range(plan.num_groups):
            a = values[advantage_key(i, g)]
            results.advantage[list(a.sample_ids)] = a.advantages
        for c in range(len(plan.chunks)):
            results._decoded(values[decode_key(i, c)], config.store)
        return results

    def _scored(self, r: RewardOut) -> None:
        ids = list(r.sample_ids)
        for name, vals in r.components.items():
            self.components[name][ids] = vals
        self.problems += r.problems

    def _decoded(self, d: DecodeOut, store: StoreConfig) -> None:
        ids = list(d.sample_ids)
        self.log_prob[ids] = d.log_probs
        self.behaviour_version[ids] = d.behaviour_version
        frames = d.images
        if frames.ndim == 5:  # videos: the middle frame stands for each
            if store.save_videos:
                self.videos = self._rows(self.videos, frames, np.uint8)
                self.videos[ids] = frames
            frames = frames[:, frames.shape[1] // 2]
        if store.save_images:
            self.images = self._rows(self.images, frames, np.uint8)
            self.images[ids] = frames
        if d.latents is not None:
            self.latents = self._rows(self.latents, d.latents, np.float32)
            self.latents[ids] = d.latents

    def _rows(self, rows: np.ndarray | None, like: np.ndarray, dtype) -> np.ndarray:
        """``rows``, or zeros for every sample shaped as the rows of ``like``."""
        if rows is None:
            rows = np.zeros((self.plan.num_samples,) + like.shape[1:], dtype)
        return rows

    def samples(self) -> dict[str, np.ndarray]:
        """The iteration's rows of the ``samples`` group."""
        plan, n = self.plan, self.plan.num_samples
        group = [plan.group_of(s) for s in range(n)]
        rows = {
            "prompt": np.array([plan.prompts[g] for g in group]),
            "group": np.array(group, np.int32),
            REWARD_COLUMN: self.reward,
            ADVANTAGE_COLUMN: self.advantage,
            "valid": self.valid,
            "behaviour_version": self.behaviour_version,
            "trained_version": np.full(n, self.iteration, np.int32),
        }
        for name, vals in self.components.items():
            rows[reward_column(name)] = vals
        if self.images is not None:
            rows["image"] = self.images
        if self.videos is not None:
            rows["video"] = self.videos
        return rows

    def steps(self) -> dict[str, np.ndarray]:
        """The iteration's rows of the ``steps`` group."""
        rows = {"log_prob": self.log_prob}
        if self.latents is not None:
            rows["latent"] = self.latents
        return rows

    def metrics(self) -> dict[str, float]:
        """The iteration's training metrics (the driver adds its timings)."""
        m = self.stats.micro
        count = max(m.count, 1)
        good = self.reward[self.valid]
        return {
            "reward_mean": float(good.mean()) if len(good) else float("nan"),
            "reward_std": float(good.std()) if len(good) else float("nan"),
            "loss": m.loss_sum / count,
            "kl": m.kl_sum / count,
            "clip_fraction": m.clipped / count,
            "approx_kl": m.approx_kl_sum / count,
            "ratio_dev": m.ratio_dev if m.ratio_dev_count else float("nan"),
            "importance_weight_mean": m.importance_weight_sum / count,
            "truncated_fraction": m.truncated / count,
            "staleness_mean": m.staleness_sum / count,
            "grad_norm": self.stats.grad_norm,
            "weight_sync_bytes": float(self.stats.weight_bytes),
            "dropped_samples": float(self.plan.num_samples - self.valid.sum()),
        }


class Runner:
    """Runs one configuration to completion, writing ``out`` (starting the cluster the
    config describes unless one is given)."""

    def __init__(self, config: RunConfig, out: str, *, overwrite: bool = False,
                 resume: bool = False, cluster: ClusterHandle | None = None,
                 on_iteration: Callable[[IterationSummary], None] | None = None):
        self.config = config
        self.out = out
        self.overwrite = overwrite
        self.resume = resume
        self.cluster = cluster
        self.on_iteration = on_iteration
        self.workload = RLWorkload(config)

    def run(self) -> RunResult:
        # A store that cannot be written or resumed, or a tracker that cannot start,
        # fails here, before any cluster work.
        start = check_store(self.workload, self.out, overwrite=self.overwrite,
                            resume=self.resume)
        with Tracker.start(self.config, self.out, iteration=start,
                           resume=self.resume) as tracker:
            self.workload.tracking_runs = tracker.runs
            handle = self.cluster or start_cluster(self.config.cluster,
                                                   pools=self.workload.options.pools)
            try:
                result = self._drive(handle, tracker)
            finally:
                if self.cluster is None:
                    handle.close()
        return result

    def _drive(self, handle: ClusterHandle, tracker: Tracker) -> RunResult:
        """Drive the run to its end; a run trained sharded whose gang failed forms a new
        gang and resumes from its newest sharded checkpoint, up to
        ``cluster.gang_restarts`` times."""
        restarts = 0
        while True:
            try:
                return Driver(self.workload, self.out, handle, overwrite=self.overwrite,
                              resume=self.resume or restarts > 0,
                              on_iteration=self.on_iteration,
                              commit_interval=self.config.store.commit_interval,
                              tracker=tracker).run()
            except sharded_steps.GangLost as e:
                if restarts >= self.config.cluster.gang_restarts:
                    raise
                restarts += 1
                logger.warning("%s; the trainers form a new gang and the run resumes from "
                               "its newest sharded checkpoint (restart %d of %d, "
                               "cluster.gang_restarts)", e, restarts,
                               self.config.cluster.gang_restarts)
                self._await_gang(handle.client)

    def _await_gang(self, client) -> None:
        """Give the pool that trains (and, publishing by broadcast, the rollout pool)
        until ``cluster.collective_timeout`` to be as large again as the group that
        failed (a lost worker's nanny restarts it, or a replacement joins); the new gang
        is whoever serves them then."""
        shard = self.workload.ctx.shard
        assert shard is not None        # (a sharded run's gang failed)
        deadline = time.monotonic() + self.config.cluster.collective_timeout
        while time.monotonic() < deadline:
            if (len(self.workload.training_pool(client)) >= shard.size
                    and len(self.workload.receiving_pool(client)) >= len(shard.receivers)):
                return
            time.sleep(0.2)
