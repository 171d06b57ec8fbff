"""The driver of a run: submit iteration graphs, collect results, append the store.

The driver keeps the iterations the schedule may run at once in the scheduler (the
oldest unfinished one plus ``max_staleness + 1`` more), collects each iteration when its
optimizer step has published the next version, writes it to the store and submits the
next. Scheduling itself is the plugin's business.
"""

from __future__ import annotations

import logging
import platform
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
from distributed import Future, wait

from digenrl import __version__
from digenrl.analysis import busy_seconds
from digenrl.cluster import ClusterHandle, start_cluster
from digenrl.config import RunConfig, config_to_dict
from digenrl.graph.build import (GraphContext, IterationGraph, init_graph, iteration_graph,
                                 optimize_key, publish_key)
from digenrl.graph.plan import IterationPlan
from digenrl.models import model_seed
from digenrl.prompts import draw_prompts, prompt_pool
from digenrl.schedulers.options import COLOCATED, ROLLOUT, TRAINER
from digenrl.schedulers.policy import TaskInfo, validate_task
from digenrl.store import RunStore
from digenrl.tasks.resident import ResidentPlugin
from digenrl.tasks.types import PolicyWeights

__all__ = ["Runner", "RunResult", "IterationSummary", "library_versions"]

logger = logging.getLogger("digenrl")


def library_versions() -> dict[str, str]:
    import dask
    import diffusers
    import distributed
    import torch
    import xarray
    import zarr

    return {"digenrl": __version__, "python": platform.python_version(),
            "dask": dask.__version__, "distributed": distributed.__version__,
            "torch": torch.__version__, "diffusers": diffusers.__version__,
            "zarr": zarr.__version__, "xarray": xarray.__version__, "numpy": np.__version__}


@dataclass
class IterationSummary:
    iteration: int
    reward_mean: float
    reward_std: float
    loss: float
    images_per_s: float
    metrics: dict[str, float]


@dataclass
class RunResult:
    store: str
    iterations: list[IterationSummary] = field(default_factory=list)
    final_weights: PolicyWeights | None = None


class Runner:
    """Runs one configuration to completion, writing ``out``."""

    def __init__(self, config: RunConfig, out: str, *, overwrite: bool = False,
                 cluster: ClusterHandle | None = None,
                 on_iteration: Callable[[IterationSummary], None] | None = None):
        self.config = config
        self.out = out
        self.overwrite = overwrite
        self._external_cluster = cluster
        self.on_iteration = on_iteration
        self.options = config.schedule.options()
        self.ctx = GraphContext.from_config(config)
        self.pool = prompt_pool(config.data.prompt_set, config.data.prompts)
        self.run_id = uuid.uuid4().hex[:12]

    # ------------------------------------------------------------------ helpers

    def plan(self, iteration: int) -> IterationPlan:
        d = self.config.data
        prompts = draw_prompts(self.pool, d.prompts_per_iteration, self.config.seed, iteration)
        return IterationPlan.uniform(iteration, prompts, d.samples_per_prompt,
                                     self.config.rollout.chunk_size)

    def _check(self, graph: IterationGraph) -> None:
        """Reject a graph the scheduler would refuse, before submitting it."""
        for key, meta in graph.meta.items():
            why = validate_task(TaskInfo.from_meta(key, meta), self.options)
            if why is not None:
                raise ValueError(why)

    def _submit(self, client, graph: IterationGraph, name: str) -> dict[Any, Future]:
        self._check(graph)
        futures = client.get(graph.to_hlg(name), graph.output_keys, sync=False)
        return dict(zip(graph.output_keys, futures))

    # --------------------------------------------------------------------- run

    def run(self) -> RunResult:
        cfg = self.config
        handle = self._external_cluster or start_cluster(cfg.cluster, pools=self.options.pools)
        try:
            return self._run(handle)
        finally:
            if self._external_cluster is None:
                handle.close()

    def _run(self, handle: ClusterHandle) -> RunResult:
        cfg, opts = self.config, self.options
        client = handle.client
        derived = cfg.derived()
        store = RunStore.create(self.out, {
            "config": config_to_dict(cfg), "schedule": opts.as_dict(),
            "versions": library_versions(), "cluster": handle.description,
            "derived": derived, "run": self.run_id,
        }, overwrite=self.overwrite)
        store.set_static("steps", "sigma", np.asarray(self.ctx.rollout.sigmas[:-1], np.float64),
                         ("step",))
        client.register_plugin(ResidentPlugin(cfg.model, model_seed(cfg.model, cfg.seed),
                                              cfg.cluster.torch_threads,
                                              max_versions=opts.max_staleness + 3))
        client.sync(client.scheduler.digenrl_begin_run, run=self.run_id, options=opts.as_dict())
        pools = handle.description.get("pools", {})
        logger.info("run %s: mode %s (gap=%s tsp=%s tag=%s max_staleness=%d), %d iterations",
                    self.run_id, opts.mode, opts.gap, opts.tsp, opts.tag, opts.max_staleness,
                    cfg.iterations)
        logger.info("per iteration: %d images (%d prompts x %d), %d chunks, %d denoise tasks, "
                    "%d micro-steps (%d trained timesteps of %d)",
                    derived["images_per_iteration"], cfg.data.prompts_per_iteration,
                    cfg.data.samples_per_prompt, derived["chunks_per_iteration"],
                    derived["denoise_tasks_per_iteration"], derived["micro_steps_per_iteration"],
                    derived["trained_steps"], cfg.sampler.num_steps)
        logger.info("workers: %s", {p: len(w) for p, w in pools.items() if w})
        if handle.dashboard_link:
            logger.info("dashboard: %s", handle.dashboard_link)

        result = RunResult(store=self.out)
        start = time.time()
        keep: dict[Any, Future] = self._submit(client, init_graph(self.ctx), "init")
        pending: dict[int, dict[Any, Future]] = {}
        window = opts.max_staleness + 1
        next_submit = 0
        cursor = 0
        last_done = start
        recent: list[dict] = []

        def submit_upto(limit: int) -> None:
            nonlocal next_submit
            while next_submit < min(limit, cfg.iterations):
                graph = iteration_graph(self.ctx, self.plan(next_submit))
                futs = self._submit(client, graph, f"iteration-{next_submit}")
                pending[next_submit] = futs
                for k, f in futs.items():
                    if k[0] in ("publish", "optimize"):
                        keep[k] = f
                next_submit += 1
                self._prune(keep, next_submit)

        submit_upto(window + 1)
        for i in range(cfg.iterations):
            futs = pending.pop(i)
            wait(list(futs.values()))
            errors = [f for f in futs.values() if f.status == "error"]
            if errors:
                errors[0].result()  # raises the task's exception
            wanted = {k: f for k, f in futs.items() if k[0] in _COLLECTED}
            values = dict(zip(wanted, client.gather(list(wanted.values()))))
            submit_upto(i + 1 + window + 1)
            batch = client.sync(client.scheduler.digenrl_tasks, start=cursor)
            cursor = batch["next"]
            records = list(batch["records"])
            done_at = _optimize_stop(records, i) or time.time()
            recent = [r for r in recent if (r["stop"] or 0.0) > last_done] + records
            usage = _window_metrics(recent, self._pools(handle), last_done, done_at)
            summary = self._write_iteration(store, i, values, records, done_at - last_done,
                                            done_at - start, usage)
            last_done = done_at
            result.iterations.append(summary)
            if self.on_iteration is not None:
                self.on_iteration(summary)
            logger.info("iteration %d/%d  reward %.4f +- %.4f  loss %+.3e  %.2f images/s",
                        i + 1, cfg.iterations, summary.reward_mean, summary.reward_std,
                        summary.loss, summary.images_per_s)
            del futs, values
        final = keep[publish_key(cfg.iterations)]
        result.final_weights = final.result()
        self._write_weights(store, result.final_weights)
        client.sync(client.scheduler.digenrl_end_run, run=self.run_id)
        return result

    def _prune(self, keep: dict[Any, Future], next_submit: int) -> None:
        """Drop futures no unsubmitted iteration reads any more."""
        oldest_version = self.ctx.layout.oldest_version(next_submit)
        for k in list(keep):
            if k[0] == "publish" and k[1] < oldest_version and not (
                    k[1] == 0 and self.config.train.kl_beta > 0):
                del keep[k]
            elif k != optimize_key(next_submit - 1) and (
                    k[0] == "optimize" or k == ("init",)):
                del keep[k]

    # ------------------------------------------------------------------ store

    def _pools(self, handle: ClusterHandle) -> dict[str, list[str]]:
        """Worker names by the pool they serve in this run's mode."""
        pools = handle.description.get("pools", {})
        if self.options.pools:
            return {p: list(pools.get(p, [])) for p in (ROLLOUT, TRAINER)}
        return {COLOCATED: [w for p in (ROLLOUT, TRAINER) for w in pools.get(p, [])]}

    def _write_iteration(self, store: RunStore, i: int, values: dict, records: list[dict],
                         seconds: float, wall: float,
                         usage: dict[str, float]) -> IterationSummary:
        cfg = self.config
        plan = self.plan(i)
        n = plan.num_samples
        decoded = [values[("decode", i, c)] for c in range(len(plan.chunks))]
        rewards = [values[("reward", i, c)] for c in range(len(plan.chunks))]
        advs = [values[("advantage", i, g)] for g in range(plan.num_groups)]
        stats = values[("stats", i)]

        reward = np.full(n, np.nan)
        valid = np.zeros(n, bool)
        components = {name: np.full(n, np.nan) for name in cfg.reward.components}
        for r in rewards:
            ids = list(r.sample_ids)
            reward[ids] = r.rewards
            valid[ids] = r.valid
            for name, vals in r.components.items():
                components[name][ids] = vals
        advantage = np.zeros(n, np.float32)
        for a in advs:
            advantage[list(a.sample_ids)] = a.advantages
        log_prob = np.zeros((n, cfg.sampler.num_steps), np.float32)
        behaviour = np.zeros(n, np.int32)
        images = None
        latents = None
        for d in decoded:
            ids = list(d.sample_ids)
            log_prob[ids] = d.log_probs
            behaviour[ids] = d.behaviour_version
            if cfg.store.save_images:
                if images is None:
                    images = np.zeros((n,) + d.images.shape[1:], np.uint8)
                images[ids] = d.images
            if d.latents is not None:
                if latents is None:
                    latents = np.zeros((n,) + d.latents.shape[1:], np.float32)
                latents[ids] = d.latents

        samples = {
            "prompt": np.array([plan.prompts[plan.group_of(s)] for s in range(n)]),
            "group": np.array([plan.group_of(s) for s in range(n)], np.int32),
            "reward": reward.astype(np.float64),
            "advantage": advantage,
            "valid": valid,
            "behaviour_version": behaviour,
            "trained_version": np.full(n, i, np.int32),
        }
        for name, vals in components.items():
            samples[f"reward_{name}"] = vals
        if images is not None:
            samples["image"] = images
        steps = {"log_prob": log_prob}
        if latents is not None:
            steps["latent"] = latents

        m = stats.micro
        count = max(m.count, 1)
        good = reward[valid]
        metrics = {
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
            "grad_norm": stats.grad_norm,
            "images_per_s": n / seconds if seconds > 0 else float("nan"),
            "iteration_seconds": seconds,
            "wall_time": wall,
            "policy_version": float(stats.version),
            "dropped_samples": float(n - valid.sum()),
            **usage,
        }
        problems = [p for r in rewards for p in r.problems]
        for p in problems:
            logger.warning("iteration %d: %s", i, p)
        store.append_iteration({
            "samples": samples,
            "steps": steps,
            "metrics": {k: np.asarray(v, np.float64) for k, v in metrics.items()},
            "tasks": _task_columns(records),
        })
        return IterationSummary(i, metrics["reward_mean"], metrics["reward_std"],
                                metrics["loss"], metrics["images_per_s"], metrics)

    def _write_weights(self, store: RunStore, weights: PolicyWeights) -> None:
        grp = store.root.require_group("weights")
        for name, t in weights.tensors.items():
            arr = t.detach().cpu().numpy()
            grp.create_array(name, shape=arr.shape, dtype=arr.dtype)[...] = arr
        grp.attrs["policy_version"] = weights.version
        store.commit()


#: Task kinds whose results the driver gathers (the others stay on the workers).
_COLLECTED = ("decode", "reward", "advantage", "stats")

_TASK_COLUMNS = {
    "key": str, "kind": str, "gpu": bool, "worker": str, "worker_name": str, "pool": str,
    "start": np.float64, "stop": np.float64, "iteration": np.int32,
    "policy_version": np.int32, "timestep": np.int32, "chunk": np.int32,
    "ready": np.float64, "released": np.float64, "finished": np.float64, "tag": bool,
    "stolen": bool,
    "nbytes": np.int64,
}


def _task_columns(records: list[dict]) -> dict[str, np.ndarray]:
    out = {}
    for name, dtype in _TASK_COLUMNS.items():
        vals = [r.get(name) for r in records]
        if dtype in (np.float64,):
            vals = [np.nan if v is None else v for v in vals]
        out[name] = np.asarray(vals, dtype=dtype) if records else np.zeros(0, dtype)
    return out


def _window_metrics(records: list[dict], pools: dict[str, list[str]], t0: float,
                    t1: float) -> dict[str, float]:
    """Per-pool GPU utilisation, TAG GPU-seconds and the mean wait of GPU tasks from
    ready to released, over the iteration's window ``[t0, t1]``."""
    import pandas as pd

    out = {f"utilisation_{p}": float("nan") for p in (ROLLOUT, TRAINER, COLOCATED)}
    out.update({"tag_seconds": 0.0, "gpu_wait_mean": float("nan")})
    if not records or t1 <= t0:
        return out
    df = pd.DataFrame(records).dropna(subset=["start", "stop"])
    busy = busy_seconds(df, t0, t1)
    for pool, names in pools.items():
        if names:
            out[f"utilisation_{pool}"] = sum(busy.get(w, 0.0) for w in names) / (
                len(names) * (t1 - t0))
    tag = df[df["tag"]]
    out["tag_seconds"] = float(np.clip(np.minimum(tag["stop"], t1) - np.maximum(tag["start"], t0),
                                       0, None).sum())
    gpu = df[df["gpu"] & (df["finished"] > t0) & (df["finished"] <= t1)]
    if len(gpu):
        out["gpu_wait_mean"] = float((gpu["released"] - gpu["ready"]).mean())
    return out


def _optimize_stop(records: list[dict], iteration: int) -> float | None:
    for r in records:
        if r["kind"] == "optimize" and r["iteration"] == iteration and r["stop"]:
            return float(r["stop"])
    return None
