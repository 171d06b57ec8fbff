"""The driver loop of a run, whatever its tasks compute.

It keeps the iterations the schedule may run at once in the scheduler (the oldest
unfinished one plus ``max_staleness + 1`` more), collects each iteration once its
optimizer step has published the next version, appends it to the store with the task
records and utilisation of its window, and submits the next. A :class:`Workload` says
what the graph's tasks are and what of their results goes into the store: the real
Flow-GRPO workload (:mod:`digenrl.runner`) or an emulated one (:mod:`digenrl.sim.emulate`).
"""

from __future__ import annotations

import logging
import platform
import time
import uuid
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Hashable, Protocol

import numpy as np
from distributed import Future, wait

from digenrl import __version__
from digenrl.analysis import busy_seconds, pools_served
from digenrl.cluster import ClusterHandle
from digenrl.graph.dask_graph import IterationGraph, iteration_outputs
from digenrl.graph.plan import IterationPlan
from digenrl.graph.structure import (GraphLayout, chain_keys_trained, checkpoint_key,
                                     init_nodes, publish_key, reduce_root_key, restore_key,
                                     restore_nodes, rollout_nodes, tail_nodes, train_nodes)
from digenrl.schedulers.chunking import (ChunkingSpec, ChunkMeasurement, choose_chunk_size,
                                         measure_chunks)
from digenrl.schedulers.options import COLOCATED, ROLLOUT, TRAINER, ScheduleOptions
from digenrl.schedulers.policy import TaskInfo, validate_task
from digenrl.store import (RunStore, StoreError, committed_iterations, complete_checkpoints,
                           drop_checkpoints, read_attrs)

__all__ = ["Workload", "Driver", "IterationSummary", "RunResult", "check_store",
           "library_versions", "task_columns"]

logger = logging.getLogger("digenrl")
Key = Hashable


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
    final: Any = None
    final_weights: Any = None  # the Flow-GRPO workload's last PolicyWeights


class Workload(Protocol):
    """What a run computes and stores."""

    options: ScheduleOptions
    layout: GraphLayout
    iterations: int
    images_per_iteration: int
    #: task kinds whose results the driver gathers for :meth:`rows`
    collected: tuple[str, ...]

    #: the chunking the driver chooses per iteration; None: the workload's fixed chunks
    chunking: ChunkingSpec | None

    def plan(self, iteration: int, chunk_size: int | None = None) -> IterationPlan: ...
    def bind(self, nodes: list, outputs: dict) -> IterationGraph: ...
    def attrs(self) -> dict[str, Any]: ...
    def check_resume(self, attrs: dict[str, Any]) -> None: ...
    def prepare(self, client, store: RunStore) -> None: ...
    def describe(self) -> list[str]: ...
    def rows(self, iteration: int, plan: IterationPlan,
             values: dict[Key, Any]) -> tuple[dict[str, dict], dict[str, float]]: ...
    def finish(self, client, store: RunStore, final_weights: Future) -> Any: ...


def check_store(workload: Workload, out: str, *, overwrite: bool = False,
                resume: bool = False) -> int:
    """The iteration a run of ``workload`` writing ``out`` starts at, or why it cannot
    run (a :class:`StoreError`, or the workload's ``ConfigError`` for a resumed run whose
    config differs). It only reads, so callers check before starting any cluster."""
    if not resume:
        if Path(out).exists() and not overwrite:
            raise StoreError(f"out: expected a path that does not exist yet (or --overwrite, "
                             f"or --resume to continue it), got {str(out)!r}")
        return 0
    attrs = read_attrs(out)
    workload.check_resume(attrs)
    start = committed_iterations(out)
    # All iterations committed but the final state not written (the run stopped while
    # finishing): resuming only finishes it.
    if start > workload.iterations or (start == workload.iterations
                                       and attrs.get("finished") == start):
        raise StoreError(f"resume: the store already holds {start} iterations; pass "
                         f"--iterations above {start} to continue it")
    if start == 0:
        return 0  # nothing to restore: version 0 is built (and checkpointed) again
    have = set(complete_checkpoints(out))
    need = set(range(max(0, start - workload.options.max_staleness), start + 1))
    if workload.layout.kl:
        need.add(0)
    missing = sorted(need - have)
    if missing:
        raise StoreError(f"resume: the store lacks the checkpoints of policy versions "
                         f"{missing} (it holds {sorted(have)})")
    return start


def library_versions() -> dict[str, str]:
    import dask
    import distributed
    import xarray
    import zarr

    out = {"digenrl": __version__, "python": platform.python_version(),
           "dask": dask.__version__, "distributed": distributed.__version__,
           "zarr": zarr.__version__, "xarray": xarray.__version__, "numpy": np.__version__}
    for name in ("torch", "diffusers"):
        try:
            out[name] = __import__(name).__version__
        except ImportError:
            pass
    return out


class Driver:
    """Runs a workload to completion on a cluster, writing the store at ``out``.

    Each iteration is submitted in three pieces, each as soon as what it reads exists:
    its *rollout* (once the policy versions its chunks read are published), its *train*
    part (advantages, micro-steps and the reduction, once version i is published) and its
    *tail* (the optimizer step, from the previous state read back from its checkpoint,
    which publishes and checkpoints version i + 1). Because every optimizer step starts
    from a checkpoint, no result ever needs more than about two iterations of lineage to
    be recomputed, the scheduler forgets finished iterations, and ``resume`` continues a
    run from its last complete iteration bit for bit.
    """

    def __init__(self, workload: Workload, out: str, cluster: ClusterHandle, *,
                 overwrite: bool = False, resume: bool = False,
                 on_iteration: Callable[[IterationSummary], None] | None = None):
        self.w = workload
        self.out = out
        self.handle = cluster
        self.overwrite = overwrite
        self.resume = resume
        self.on_iteration = on_iteration
        self.run_id = uuid.uuid4().hex[:12]
        #: Every future of this run still referenced anywhere (weakly: the run releases
        #: what it no longer needs by dropping it).
        self._live: weakref.WeakValueDictionary[int, Future] = weakref.WeakValueDictionary()
        #: Each iteration's plan, fixed when it is first needed (adaptive chunking picks
        #: its chunk size then, from what the iterations collected so far measured).
        self._plans: dict[int, IterationPlan] = {}
        self._measured: ChunkMeasurement | None = None

    # ------------------------------------------------------------------ helpers

    def _check(self, graph: IterationGraph) -> None:
        """Reject a graph the scheduler would refuse, before submitting it."""
        for key, meta in graph.meta.items():
            why = validate_task(TaskInfo.from_meta(key, meta), self.w.options)
            if why is not None:
                raise ValueError(why)

    def _submit(self, nodes, keys: list[Key], name: str) -> dict[Key, Future]:
        graph = self.w.bind(nodes, {"out": keys})
        self._check(graph)
        futures = self.handle.client.get(graph.to_hlg(name), keys, sync=False)
        for f in futures:
            self._live[id(f)] = f
        return dict(zip(keys, futures))

    def pools(self) -> dict[str, list[str]]:
        """Worker names by the pool they serve in this run's mode."""
        return pools_served(self.handle.description.get("pools", {}), self.w.options.pools)

    def plan(self, j: int) -> IterationPlan:
        """Iteration ``j``'s plan: the workload's, with the chunk size adaptive chunking
        chooses when the workload asks for it."""
        plan = self._plans.get(j)
        if plan is None:
            spec = getattr(self.w, "chunking", None)
            if spec is None:
                plan = self.w.plan(j)
            else:
                size = choose_chunk_size(
                    self.w.images_per_iteration, spec.samples_per_prompt, spec.largest,
                    capacity=self._generating_capacity(), slots=self.w.options.slots_per_worker,
                    measured=self._measured, fallback=spec.start)
                plan = self.w.plan(j, size)
            self._plans[j] = plan
        return plan

    def _speeds(self) -> dict[str, float]:
        """Each worker's declared speed, by name (as the cluster description has them)."""
        return {str(k): float(v) for k, v in (self.handle.description.get("speeds") or {}).items()}

    def _generating_capacity(self) -> float:
        """The summed speeds of the workers that generate (the rollout pool; every
        worker when the mode has no pools)."""
        speeds = self._speeds()
        names = [n for p, ns in self.pools().items() if p != TRAINER for n in ns]
        return sum(speeds.get(str(n), 1.0) for n in names) or 1.0

    def _measure(self, records: list[dict]) -> None:
        """Adaptive chunking: what this iteration's denoise tasks measured."""
        if getattr(self.w, "chunking", None) is None:
            return
        iterations = {int(r["iteration"]) for r in records if r.get("kind") == "denoise"}
        sizes = {(i, c): b - a for i in iterations if i in self._plans
                 for c, (a, b) in enumerate(self._plans[i].chunks)}
        m = measure_chunks(records, sizes, self._speeds())
        if m is not None:
            self._measured = m

    def _versions_read(self, j: int) -> set[int]:
        plan = self.plan(j)
        return {self.w.layout.chunk_version(plan, c) for c in range(len(plan.chunks))}

    # --------------------------------------------------------------------- run

    def _open_store(self) -> tuple[RunStore, int]:
        w = self.w
        start = check_store(w, self.out, overwrite=self.overwrite, resume=self.resume)
        if not self.resume:
            store = RunStore.create(self.out, {
                **w.attrs(), "schedule": w.options.as_dict(), "versions": library_versions(),
                "cluster": self.handle.description, "run": self.run_id,
            }, overwrite=self.overwrite)
            return store, 0
        store = RunStore.open(self.out)
        self.run_id = store.attrs.get("run", self.run_id)
        # The config the run now follows (it may extend the iterations), and when.
        store.update_attrs(**w.attrs(), resumed=[*store.attrs.get("resumed", []),
                                                 {"at_iteration": start, "time": time.time()}])
        return store, start

    def run(self) -> RunResult:
        w, opts, client = self.w, self.w.options, self.handle.client
        store, start = self._open_store()
        w.prepare(client, store)
        client.sync(client.scheduler.digenrl_begin_run, run=self.run_id, options=opts.as_dict())
        logger.info("run %s: mode %s (gap=%s tsp=%s tag=%s max_staleness=%d), %d iterations%s",
                    self.run_id, opts.mode, opts.gap, opts.tsp, opts.tag, opts.max_staleness,
                    w.iterations, f", resuming at iteration {start}" if start else "")
        for line in w.describe():
            logger.info(line)
        pools = self.handle.description.get("pools", {})
        logger.info("workers: %s", {p: len(ws) for p, ws in pools.items() if ws})
        if self.handle.dashboard_link:
            logger.info("dashboard: %s", self.handle.dashboard_link)

        try:
            result = self._run(store, start)
        except BaseException:
            self._abandon()
            raise
        client.sync(client.scheduler.digenrl_end_run, run=self.run_id)
        return result

    def _abandon(self, timeout: float = 30.0) -> None:
        """The run stopped on an error: release everything it holds in the cluster and
        end its schedule, waiting until the scheduler has dropped its tasks, so that a
        later run on the same (perhaps long-lived) scheduler starts from nothing.

        (Releasing, not ``Client.cancel``: cancelling a key whose dependents nobody
        holds trips an assertion in the scheduler's cancel handler, distributed
        2026.7.1.)"""
        client = self.handle.client
        for f in list(self._live.values()):
            f.release()
        try:
            deadline = time.monotonic() + timeout
            while client.sync(client.scheduler.digenrl_end_run, run=self.run_id):
                if time.monotonic() > deadline:
                    logger.warning("run %s stopped; the scheduler still holds some of its "
                                   "tasks after %.0f s", self.run_id, timeout)
                    break
                time.sleep(0.05)
        except Exception as e:  # the cluster itself may be what failed
            logger.debug("could not end run %s on the scheduler: %r", self.run_id, e)

    def _run(self, store: RunStore, start: int) -> RunResult:
        w, opts, client = self.w, self.w.options, self.handle.client
        k = opts.max_staleness
        published: dict[int, Future] = {}     # version -> its publish future (held)
        checkpoints: dict[int, Future] = {}   # version -> its checkpoint future
        checkpointed: set[int] = set()
        held: dict[int, dict[Key, Future]] = {}   # rollout/train keys a later piece reads
        collect: dict[int, dict[Key, Future]] = {}
        submitted = {"rollout": set(), "train": set(), "tail": set()}

        if start == 0:
            futs = self._submit(init_nodes(checkpoint=True),
                                [publish_key(0), checkpoint_key(0)], "init")
            published[0] = futs[publish_key(0)]
            checkpoints[0] = futs[checkpoint_key(0)]
        else:
            versions = sorted({v for v in range(max(0, start - k), start + 1)}
                              | ({0} if w.layout.kl else set()))
            for v in versions:
                futs = self._submit(restore_nodes(v, publish=True), [publish_key(v)],
                                    f"restore-{v}")
                published[v] = futs[publish_key(v)]
            checkpointed.add(start)

        def submit_ready(next_collect: int) -> None:
            progress = True
            while progress:
                progress = False
                for j in range(start, w.iterations):
                    if j not in submitted["rollout"] and j > next_collect + k + 1:
                        break  # not yet: its plan is fixed when it can be submitted
                    plan = self.plan(j)
                    if (j not in submitted["rollout"]
                            and self._versions_read(j) <= set(published)):
                        keys = (iteration_outputs(plan)["decode"]
                                + iteration_outputs(plan)["reward"])
                        trained = chain_keys_trained(w.layout, plan)
                        futs = self._submit(rollout_nodes(w.layout, plan), keys + trained,
                                            f"rollout-{j}")
                        collect.setdefault(j, {}).update({k_: futs[k_] for k_ in keys})
                        held[j] = {k_: futs[k_] for k_ in trained}
                        submitted["rollout"].add(j)
                        progress = True
                    if (j in submitted["rollout"] and j not in submitted["train"]
                            and j in published and (not w.layout.kl or 0 in published)):
                        root = reduce_root_key(j, len(plan.chunks) * w.layout.trained_steps,
                                               w.layout.reduce_fanin)
                        keys = iteration_outputs(plan)["advantage"]
                        futs = self._submit(train_nodes(w.layout, plan), keys + [root],
                                            f"train-{j}")
                        collect[j].update({k_: futs[k_] for k_ in keys})
                        held[j] = {root: futs[root]}  # the chain latents are read now
                        submitted["train"].add(j)
                        progress = True
                    if (j in submitted["train"] and j not in submitted["tail"]
                            and j in checkpointed):
                        keys = [("stats", j), publish_key(j + 1), checkpoint_key(j + 1)]
                        futs = self._submit(tail_nodes(w.layout, plan, restore_key(j),
                                                       checkpoint=True), keys, f"tail-{j}")
                        collect[j][("stats", j)] = futs[("stats", j)]
                        published[j + 1] = futs[publish_key(j + 1)]
                        checkpoints[j + 1] = futs[checkpoint_key(j + 1)]
                        held.pop(j, None)
                        submitted["tail"].add(j)
                        progress = True

        def note_checkpoints() -> None:
            for v, f in list(checkpoints.items()):
                if f.status == "error":
                    f.result()  # raises: a checkpoint that cannot be written stops the run
                if f.done():
                    checkpointed.add(v)
                    del checkpoints[v]

        result = RunResult(store=self.out)
        started = time.time()
        cursor = 0
        last_done = started
        recent: list[dict] = []
        submit_ready(start)
        for i in range(start, w.iterations):
            while True:
                note_checkpoints()
                submit_ready(i)
                futs = collect.get(i, {})
                complete = (i in submitted["tail"] and (i + 1) in checkpointed
                            and all(f.done() for f in futs.values()))
                errors = [f for f in futs.values() if f.status == "error"]
                if errors:
                    errors[0].result()  # raises the task's exception
                if complete:
                    break
                waiting = [f for f in futs.values() if not f.done()] + list(checkpoints.values())
                assert waiting, f"iteration {i}: nothing left to wait for ({submitted})"
                # distributed.wait runs on the default client's event loop, which is
                # not this run's when the process holds several clients; the futures'
                # events would then belong to the wrong loop.
                with client.as_current():
                    wait(waiting, return_when="FIRST_COMPLETED")
            futs = collect.pop(i)
            values = dict(zip(futs, client.gather(list(futs.values()))))
            batch = client.sync(client.scheduler.digenrl_tasks, start=cursor)
            cursor = batch["next"]
            records = list(batch["records"])
            self._measure(records)
            done_at = _optimize_stop(records, i) or time.time()
            recent = [r for r in recent if (r["stop"] or 0.0) > last_done] + records
            seconds = done_at - last_done
            plan = self.plan(i)
            groups, metrics = w.rows(i, plan, values)
            metrics.update({
                "chunk_size": plan.num_samples / len(plan.chunks),
                "images_per_s": w.images_per_iteration / seconds if seconds > 0 else float("nan"),
                "iteration_seconds": seconds,
                "wall_time": done_at - started,
                "policy_version": float(i + 1),
                **_window_metrics(recent, self.pools(), last_done, done_at),
            })
            groups["metrics"] = {k_: np.asarray(v, np.float64) for k_, v in metrics.items()}
            groups["tasks"] = task_columns(records)
            store.append_iteration(groups)
            # Keep the checkpoints a resume at i + 1, or a recomputation, may read: the
            # versions from i - k on (and 0 for the KL reference).
            oldest = max(0, i - k)
            drop_checkpoints(self.out, lambda v: v < oldest and not (v == 0 and w.layout.kl))
            store.commit()
            for v in [v for v in published if v < oldest and not (v == 0 and w.layout.kl)]:
                del published[v]
            client.sync(client.scheduler.digenrl_metrics, run=self.run_id, iteration=i,
                        metrics={k_: float(v) for k_, v in metrics.items()})
            last_done = done_at
            summary = IterationSummary(i, metrics.get("reward_mean", float("nan")),
                                       metrics.get("reward_std", float("nan")),
                                       metrics.get("loss", float("nan")),
                                       metrics["images_per_s"], metrics)
            result.iterations.append(summary)
            if self.on_iteration is not None:
                self.on_iteration(summary)
            logger.info("iteration %d/%d  reward %.4f +- %.4f  loss %+.3e  %.2f images/s",
                        i + 1, w.iterations, summary.reward_mean, summary.reward_std,
                        summary.loss, summary.images_per_s)
            del futs, values
        result.final = w.finish(client, store, published[w.iterations])
        store.update_attrs(finished=w.iterations)
        return result


_TASK_COLUMNS = {
    "key": str, "kind": str, "gpu": bool, "worker": str, "worker_name": str, "pool": str,
    "start": np.float64, "stop": np.float64, "iteration": np.int32,
    "policy_version": np.int32, "timestep": np.int32, "chunk": np.int32,
    "ready": np.float64, "eligible": np.float64, "released": np.float64,
    "finished": np.float64, "tag": bool,
    "stolen": bool, "rat": bool, "nbytes": np.int64, "transfer": np.float64,
    "transfer_start": np.float64, "transfer_stop": np.float64,
}


def task_columns(records: list[dict]) -> dict[str, np.ndarray]:
    out = {}
    for name, dtype in _TASK_COLUMNS.items():
        vals = [r.get(name) for r in records]
        if dtype is np.float64:
            vals = [np.nan if v is None else v for v in vals]
        out[name] = np.asarray(vals, dtype=dtype) if records else np.zeros(0, dtype)
    return out


def _window_metrics(records: list[dict], pools: dict[str, list[str]], t0: float,
                    t1: float) -> dict[str, float]:
    """Per-pool GPU utilisation, TAG GPU-seconds and the mean wait of GPU tasks from
    ready to released, over an iteration's window ``[t0, t1]``."""
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
