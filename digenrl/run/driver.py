"""The driver loop of a run, whatever its tasks compute.

It keeps the iterations the schedule may run at once in the scheduler (the oldest
unfinished one plus ``max_staleness + 1`` more), collects each iteration once its
optimizer step has checkpointed the next version, appends it to the store with the task
records and utilisation of its window, and submits the next. A :class:`Workload` says
what the graph's tasks are and what of their results goes into the store: the real
RL workload (:mod:`digenrl.run.runner`) or an emulated one (:mod:`digenrl.sim.emulate`).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import platform
import statistics
import time
import uuid
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Protocol

import numpy as np
from distributed import Future, wait

from digenrl import __version__
from digenrl.figures.analysis import optimize_stop, pools_served, window_metrics
from digenrl.store.checkpoints import complete_checkpoints, drop_checkpoints
from digenrl.store.sharded import drop_sharded, sharded_checkpoints
from digenrl.run.cluster import ClusterHandle, workers_now
from digenrl.graph.dask_graph import IterationGraph, iteration_outputs
from digenrl.graph.plan import IterationPlan
from digenrl.graph.keys import (checkpoint_key, kind_of, optimize_key, publish_key,
                                restore_key)
from digenrl.graph.pieces import Checkpoint, IllegalTransition, Pieces, Stage, Weights
from digenrl.graph.retention import Retention
from digenrl.graph.structure import (GraphLayout, chain_keys_trained, eval_iteration,
                                     init_nodes, making_nodes, restore_nodes, rollout_nodes,
                                     sharded_tail_nodes, sharded_train_nodes,
                                     state_members, tail_nodes,
                                     train_nodes, train_outputs)
from digenrl.records import task_columns
from digenrl.schedulers.chunking import (ChunkingSpec, ChunkMeasurement, choose_chunk_size,
                                         fitting_chunk, measure_chunks)
from digenrl.schedulers.options import ScheduleOptions
from digenrl.schedulers.parallelism import DegreePlan, plan_degrees
from digenrl.schedulers.policy import TaskInfo, validate_task
from digenrl.schedulers.watchdog import RunStalled
from digenrl.metering import CpuMeter
from digenrl.checks import ConfigError
from digenrl.tasks.footprint import EVENT_TOPIC as STEP_MEMORY_TOPIC, USABLE_FRACTION
from digenrl.tasks.sharded_steps import GangLost
from digenrl.store import (EVAL_GROUP, RunStore, StoreError, StoreWriter, committed_iterations,
                           evaluation_means, read_attrs)
from digenrl.vocabulary import (Key, ADVANTAGE, DECODE, DENOISE, GB, GROUP_REWARD, INIT,
                                REWARD, STATS, TRAINER)
from digenrl.run.weight_receipts import WeightReceipts, drain as drain_weight_receipts

__all__ = ["Workload", "Driver", "Pipeline", "IterationSummary", "RunResult", "RunStalled",
           "check_store", "library_versions"]

logger = logging.getLogger("digenrl")

#: Seconds between two asks whether a run that waits can still progress.
STALL_POLL = 1.0


@dataclass
class IterationSummary:
    iteration: int
    reward_mean: float
    reward_std: float
    loss: float
    images_per_s: float
    metrics: dict[str, float]
    #: (policy version, mean reward, prompts scored) of each evaluation stored with it
    evaluations: list[tuple[int, float, int]] = field(default_factory=list)


@dataclass(frozen=True)
class RolloutNow:
    """The workers that generate now, by name, and the memory that bounds a chunk on
    them: one sample's activations at degree 1 and the least a GPU has free for a
    chunk's, in GB (0 and infinite while unknown)."""

    workers: list[str]
    sample_gb: float
    free_gb: float


@dataclass
class RunResult:
    store: str
    iterations: list[IterationSummary] = field(default_factory=list)
    #: What the workload's ``finish`` made of the last version's weights once every
    #: iteration is stored (the RL workload: its ``PolicyWeights``; set once, at the end)
    final_weights: Any = None


class Workload(Protocol):
    """What a run computes and stores."""

    options: ScheduleOptions
    layout: GraphLayout
    iterations: int
    images_per_iteration: int
    #: the task kinds whose results the driver gathers for :meth:`rows` (of decode,
    #: reward, advantage and stats: the outputs it waits for)
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

    # Optional: ``check_cluster(client)``, raising what the run cannot do on that
    # cluster before the store is written.
    # Optional: ``close(client)``, what the workload keeps on the workers let go once the
    # run has ended (a sharded run's collective group and trainer state).

    # Optional: ``eval_nodes(version) -> list[Node]``, the held-out evaluation of a
    # policy version (empty when it is not evaluated); its tasks' results reach
    # :meth:`rows` of the iteration :func:`eval_iteration` names.


def check_store(workload: Workload, out: str, *, overwrite: bool = False,
                resume: bool = False) -> int:
    """The iteration a run of ``workload`` writing ``out`` stores first (a resumed run
    may start computing earlier, :func:`resume_point`), or why it cannot run (a
    :class:`StoreError`, or the workload's ``ConfigError`` for a resumed run whose
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
    return start


def resume_point(workload: Workload, out: str, committed: int) -> int:
    """Where a run resumed with ``committed`` iterations in its store at ``out`` starts
    computing: the latest iteration whose retained versions' checkpoints the store
    holds (:meth:`Retention.resume_point`; ``committed`` itself unless the run wrote
    only some versions' checkpoints, ``store.checkpoint_every``)."""
    if committed == 0:
        return 0  # nothing to restore: version 0 is built (and checkpointed) again
    # (A run writes Zarr checkpoints, or sharded ones when it trains sharded.)
    have = set(complete_checkpoints(out)) | set(sharded_checkpoints(out))
    return workload.layout.retention.resume_point(committed, have.__contains__)


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

    Each iteration is submitted in three pieces, each as soon as what it reads exists
    (:class:`Pipeline`): its *rollout*, its *train* part (advantages, micro-steps and the
    reduction) and its *tail* (the optimizer step, from the previous state read back,
    which checkpoints version i + 1); version i + 1 is published from its state read
    back, a task without inputs that takes the state from the memory of the worker that
    made it while the checkpoint is written (and from the checkpoint when recomputed).
    Once complete an iteration is committed to the store (:meth:`_commit`). Because
    every optimizer step starts from, and every version is published from, a state read
    back by a task without inputs, no result ever needs more than about one iteration of
    lineage to be recomputed (published weights: none past their own checkpoint), the
    scheduler forgets finished iterations, and ``resume`` continues a run from its last
    complete iteration bit for bit. With ``store.checkpoint_every`` N the versions
    between resume points are read back from the memory of the worker that made them,
    with that optimizer step as an input: lineage then reaches back to the newest
    checkpoint (at most N iterations), and ``resume`` computes again, without storing
    them again, the iterations since the last resume point.
    """

    def __init__(self, workload: Workload, out: str, cluster: ClusterHandle, *,
                 overwrite: bool = False, resume: bool = False,
                 on_iteration: Callable[[IterationSummary], None] | None = None,
                 commit_interval: float = 0.0, tracker: Any = None):
        self.w = workload
        self.out = out
        self.handle = cluster
        self.overwrite = overwrite
        self.resume = resume
        self.on_iteration = on_iteration
        #: Seconds between two commits to the store (:class:`StoreWriter`).
        self.commit_interval = commit_interval
        #: The experiment trackers (a :class:`digenrl.run.tracking.Tracker`, or None), handed
        #: each iteration's rows once they are committed.
        self.tracker = tracker
        self.run_id = uuid.uuid4().hex[:12]
        #: Every future of this run still referenced anywhere (weakly: the run releases
        #: what it no longer needs by dropping it).
        self._live: weakref.WeakValueDictionary[int, Future] = weakref.WeakValueDictionary()
        #: Each iteration's plan, fixed when it is first needed (adaptive chunking picks
        #: its chunk size then, from what the iterations collected so far measured).
        self._plans: dict[int, IterationPlan] = {}
        self._measured: ChunkMeasurement | None = None
        #: With ``rollout.context_parallel: auto``: the degrees the run may choose from,
        #: each one's latest measured seconds of a sample's step, and each iteration's
        #: choice.
        self._degrees: tuple[int, ...] | None = getattr(workload, "context_degrees", None)
        self._step_seconds: dict[int, float] = {}
        self._degree_plans: dict[int, DegreePlan] = {}
        #: The task records of iterations computed again (the store holds them), until
        #: they are stored with the next iteration committed.
        self._carried: list[dict] = []

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
            self._track(f)
        return dict(zip(keys, futures))

    def _track(self, future: Future) -> None:
        """Hold ``future`` (weakly) among the run's, released when the run ends."""
        self._live[id(future)] = future

    def pools(self) -> dict[str, list[str]]:
        """Worker names by the pool they serve in this run's mode."""
        return pools_served(self.handle.description.get("pools", {}), self.w.options.pools)

    def plan(self, j: int) -> IterationPlan:
        """Iteration ``j``'s plan: the workload's, with the chunk size adaptive chunking
        chooses when the workload asks for it."""
        plan = self._plans.get(j)
        if plan is None:
            spec = getattr(self.w, "chunking", None)
            rollout = (self._rollout_now() if spec is not None or self._degrees is not None
                       else None)
            if spec is None:
                plan = self.w.plan(j)
            else:
                assert rollout is not None
                largest = fitting_chunk(spec.largest, rollout.sample_gb, rollout.free_gb)
                size = choose_chunk_size(
                    self.w.images_per_iteration, spec.samples_per_prompt, largest,
                    capacity=self._generating_capacity(), slots=self.w.options.slots_per_worker,
                    measured=self._measured, fallback=spec.start)
                plan = self.w.plan(j, size)
            if self._degrees is not None:
                assert rollout is not None
                plan = self._choose_degrees(plan, rollout)
            self._plans[j] = plan
        return plan

    def _choose_degrees(self, plan: IterationPlan, rollout: RolloutNow) -> IterationPlan:
        """``rollout.context_parallel: auto``: ``plan`` with each chunk's degree, chosen
        for the generating workers there are now (``rollout``) from the degrees'
        measured step times (:func:`~digenrl.schedulers.parallelism.plan_degrees`),
        logged and kept for the iteration's metrics."""
        assert self._degrees is not None
        size = plan.num_samples // len(plan.chunks)
        workers = len(rollout.workers)
        try:
            chosen = plan_degrees(len(plan.chunks), size, workers, self._degrees,
                                  self._step_seconds, sample_gb=rollout.sample_gb,
                                  free_gb=rollout.free_gb)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        self._degree_plans[plan.iteration] = chosen
        logger.info("iteration %d: context parallelism on %d rollout workers: %s",
                    plan.iteration, workers, chosen.describe())
        degrees = chosen.degrees if max(chosen.degrees, default=1) > 1 else ()
        return dataclasses.replace(plan, context_parallel=degrees)

    def _rollout_now(self) -> RolloutNow:
        """For ``auto`` and adaptive chunking, asked of the scheduler once: the workers
        that generate now (the rollout pool; every worker when the mode has no pools),
        so a pool that shrank or grew is counted as it is; one sample's activations in
        a degree-1 step, in GB (the most per sample the workers measured for the newest
        latent shape: :mod:`digenrl.tasks.footprint`); and the least a generating
        worker's GPU has free for a chunk's beside what the worker keeps resident (the
        ``USABLE_FRACTION`` of its GPU's memory, else of ``cluster.gpu_memory_gb``;
        infinite where neither is known). 0 and infinite before any measurement."""
        client = self.handle.client
        pools, total = workers_now(client)
        generating = [n for p, ns in pools_served(pools, self.w.options.pools).items()
                      if p != TRAINER for n in ns]
        mine = getattr(self.w, "model_key", None)
        events = [msg for _, msg in client.get_events(STEP_MEMORY_TOPIC)
                  if msg.get("model") == mine]
        if not events:
            return RolloutNow(generating, 0.0, math.inf)
        newest = events[-1]["shape"][1:]
        sample = max(e["transient_bytes"] / e["samples"] for e in events
                     if e["shape"][1:] == newest)
        resident = {e["name"]: e["resident_bytes"] for e in events}
        fallback = float(getattr(self.w, "gpu_memory_gb", 0.0))
        free = math.inf
        for name in generating:
            gb = total.get(name) or fallback
            if gb:
                kept = resident.get(name, max(resident.values())) / GB
                free = min(free, USABLE_FRACTION * gb - kept)
        return RolloutNow(generating, sample / GB, free)

    def _measure_degrees(self, records: list[dict]) -> None:
        """``auto``: each degree's seconds of a sample's step, the median over the
        denoise tasks of the newest iteration that ran it (so a workload that changes
        is measured anew)."""
        newest: dict[int, tuple[int, list[float]]] = {}
        for r in records:
            if r.get("kind") != DENOISE or r.get("start") is None or r.get("stop") is None:
                continue
            i, c = int(r["iteration"]), int(r["chunk"])
            plan = self._plans.get(i)
            if plan is None:
                continue
            d = plan.degree(c)
            a, b = plan.chunks[c]
            held = newest.get(d)
            if held is None or held[0] < i:
                held = newest[d] = (i, [])
            if held[0] == i:
                held[1].append((r["stop"] - r["start"]) / (b - a))
        for d, (_, seconds) in newest.items():
            self._step_seconds[d] = statistics.median(seconds)

    def _degree_metrics(self, i: int) -> dict[str, float]:
        """``auto``: iteration ``i``'s chosen degrees as metrics (none otherwise)."""
        chosen = self._degree_plans.get(i)
        if self._degrees is None:
            return {}
        if chosen is None:
            return dict.fromkeys(("context_parallel_mean", "context_parallel_max",
                                  "context_parallel_probes", "context_parallel_sample_gb",
                                  "context_parallel_free_gb"), float("nan"))
        return {"context_parallel_mean": float(np.mean(chosen.degrees)),
                "context_parallel_max": float(max(chosen.degrees)),
                "context_parallel_probes": float(len(chosen.probes)),
                "context_parallel_sample_gb": chosen.sample_gb or float("nan"),
                "context_parallel_free_gb": (chosen.free_gb if math.isfinite(chosen.free_gb)
                                             else float("nan"))}

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
        iterations = {int(r["iteration"]) for r in records if r.get("kind") == DENOISE}
        sizes = {(i, c): b - a for i in iterations if i in self._plans
                 for c, (a, b) in enumerate(self._plans[i].chunks)}
        m = measure_chunks(records, sizes, self._speeds())
        if m is not None:
            self._measured = m

    # --------------------------------------------------------------------- run

    def _open_store(self) -> tuple[RunStore, int, int]:
        """The store, the iteration the run starts computing at and how many iterations
        the store holds (those before it are computed again, not stored again)."""
        w = self.w
        committed = check_store(w, self.out, overwrite=self.overwrite, resume=self.resume)
        if not self.resume:
            store = RunStore.create(self.out, {
                **w.attrs(), "schedule": w.options.as_dict(), "versions": library_versions(),
                "cluster": self.handle.description, "run": self.run_id,
            }, overwrite=self.overwrite)
            return store, 0, 0
        start = resume_point(w, self.out, committed)
        if start < committed:
            logger.info("resuming at iteration %d from the checkpoints of iteration %d: "
                        "iterations %d to %d are computed again, not stored again",
                        committed, start, start, committed - 1)
        store = RunStore.open(self.out)
        self.run_id = store.attrs.get("run", self.run_id)
        # The config the run now follows (it may extend the iterations), and when.
        store.update_attrs(**w.attrs(), resumed=[
            *store.attrs.get("resumed", []),
            {"at_iteration": committed, "computed_from": start, "time": time.time()}])
        return store, start, committed

    def run(self) -> RunResult:
        w, opts, client = self.w, self.w.options, self.handle.client
        check_cluster = getattr(w, "check_cluster", None)
        if check_cluster is not None:
            check_cluster(client)       # (before the store is written)
        store, start, committed = self._open_store()
        w.prepare(client, store)
        client.register_plugin(WeightReceipts())
        client.sync(client.scheduler.digenrl_begin_run, run=self.run_id, options=opts.as_dict())
        logger.info("run %s: mode %s (gap=%s tsp=%s tag=%s max_staleness=%d), %d iterations%s",
                    self.run_id, opts.mode, opts.gap, opts.tsp, opts.tag, opts.max_staleness,
                    w.iterations, f", resuming at iteration {committed}" if committed else "")
        for line in w.describe():
            logger.info(line)
        pools = self.handle.description.get("pools", {})
        logger.info("workers: %s", {p: len(ws) for p, ws in pools.items() if ws})
        if self.handle.dashboard_link:
            logger.info("dashboard: %s", self.handle.dashboard_link)

        try:
            result = self._run(store, start, committed)
        finally:
            self._release()
        return result

    def _release(self, timeout: float = 30.0) -> None:
        """The run finished or stopped: release everything it holds in the cluster and
        end its schedule, waiting until the scheduler has dropped its tasks, so that a
        later run on the same (perhaps long-lived) scheduler starts from nothing. (The
        next run's keys are the same: one whose results were still held would be
        taken for this run's.)

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
        close = getattr(self.w, "close", None)
        if close is not None:
            try:
                close(client)
            except Exception as e:
                logger.debug("could not close run %s's workload: %r", self.run_id, e)

    def _run(self, store: RunStore, start: int, committed: int) -> RunResult:
        writer = StoreWriter(store, self.commit_interval)
        try:
            result, last_weights = self._iterate(writer, start, committed)
        except BaseException:
            # What is complete reaches the store, however the run ends.
            try:
                writer.close()
            except StoreError:
                logger.exception("could not commit the run's last complete iterations")
            raise
        writer.close()
        result.final_weights = self.w.finish(self.handle.client, store, last_weights)
        store.update_attrs(finished=self.w.iterations)
        return result

    def _iterate(self, writer: StoreWriter, start: int,
                 committed: int) -> tuple[RunResult, Future]:
        """Run iterations ``start ..`` to the end, handing each from ``committed`` on
        (those before are in the store already) to ``writer`` once it is complete; the
        run's result and the future of the last version's published weights."""
        w, client = self.w, self.handle.client
        #: The CPU the run's processes spend, read as each iteration is committed.
        self.cpu_meter = CpuMeter(client)
        pipeline = Pipeline(w, client, self._submit, self.plan, self._track)
        pipeline.begin(start, stored=committed)
        result = RunResult(store=self.out)
        window = _Window(time.time())
        pipeline.submit_ready(start)
        for i in range(start, w.iterations):
            pipeline.wait_for(i, self._stalled, self._gang_failed)
            if i < committed:
                self._recomputed(pipeline, window, i)
                continue
            summary = self._commit(writer, pipeline, window, i)
            result.iterations.append(summary)
            if self.on_iteration is not None:
                self.on_iteration(summary)
            logger.info("iteration %d/%d  reward %.4f +- %.4f  loss %+.3e  %.2f images/s",
                        i + 1, w.iterations, summary.reward_mean, summary.reward_std,
                        summary.loss, summary.images_per_s)
            for version, mean, count in summary.evaluations:
                logger.info("evaluation of policy version %d  reward %.4f  (%d held-out "
                            "prompts)", version, mean, count)
        return result, pipeline.weights(w.iterations)

    def _gang_failed(self) -> str | None:
        """The scheduler's line on a failed gang step of this run (None while none)."""
        client = self.handle.client
        return client.sync(client.scheduler.digenrl_gang_failed, run=self.run_id)

    def _stalled(self) -> str | None:
        """The scheduler's diagnosis once this run can no longer progress (None while
        it can)."""
        client = self.handle.client
        return client.sync(client.scheduler.digenrl_stalled, run=self.run_id)

    def _recomputed(self, pipeline: Pipeline, window: _Window, i: int) -> None:
        """Iteration ``i``, which the store holds, is computed again (a run resumed
        from an earlier resume point): let go of its outputs and of the weights no later
        piece reads, and begin the next iteration's window and measurements here."""
        let_go(pipeline.take(i).values())
        records, window.opened = window.close(self.handle.client, i)
        self._measure(records)
        self._carried += records  # stored with the next committed iteration's
        pipeline.release(i)
        self._cpu()
        self._weight_receipts()
        logger.info("iteration %d/%d computed again (the store holds it)", i + 1,
                    self.w.iterations)

    def _commit(self, writer: StoreWriter, pipeline: Pipeline, window: _Window,
                i: int) -> IterationSummary:
        """Iteration ``i`` is complete: gather what the workload stores, read the task
        records, hand the iteration to the store's writer (which commits it, then drops
        the checkpoints a run resumed after it no longer needs), and let go of the
        weights no later piece reads (:meth:`Retention.retains`)."""
        w, client = self.w, self.handle.client
        futs = pipeline.take(i)
        wanted = {k: f for k, f in futs.items() if kind_of(k) in w.collected}
        values = dict(zip(wanted, client.gather(list(wanted.values()))))
        let_go(futs.values())  # (before the checkpoints they were computed from go)
        records, t1 = window.close(client, i)
        self._measure(records)
        if self._degrees is not None:
            self._measure_degrees(records)
        records, self._carried = self._carried + records, []
        t0 = window.opened
        seconds = t1 - t0
        plan = self.plan(i)
        groups, metrics = w.rows(i, plan, values)
        evaluations = evaluation_means(groups.get(EVAL_GROUP))
        metrics.update({
            "chunk_size": plan.num_samples / len(plan.chunks),
            "images_per_s": w.images_per_iteration / seconds if seconds > 0 else float("nan"),
            "iteration_seconds": seconds,
            "wall_time": t1 - window.started,
            "policy_version": float(i + 1),
            **self._weight_receipts(),
            **self._degree_metrics(i),
            **self._cpu(),
            **window_metrics(window.recent, self.pools(), t0, t1),
        })
        groups["metrics"] = {k: np.asarray(v, np.float64) for k, v in metrics.items()}
        groups["tasks"] = task_columns(records)
        writer.submit(groups, after=lambda: self._committed(i, groups))
        pipeline.release(i)
        client.sync(client.scheduler.digenrl_metrics, run=self.run_id, iteration=i,
                    metrics={k: float(v) for k, v in metrics.items()})
        window.opened = t1
        return IterationSummary(i, metrics.get("reward_mean", float("nan")),
                                metrics.get("reward_std", float("nan")),
                                metrics.get("loss", float("nan")), metrics["images_per_s"],
                                metrics, evaluations)

    def _committed(self, i: int, groups: dict) -> None:
        """Iteration ``i`` is in the store (the store's writer calls this): keep what a
        run resumed at ``i + 1`` may read or recompute from, and hand the iteration to
        the experiment trackers (which no commit waits for)."""
        retention, iterations = self.w.layout.retention, self.w.iterations
        def drop(v: int) -> bool:
            return not retention.keeps_checkpoint(v, i + 1, iterations)

        drop_checkpoints(self.out, drop)
        drop_sharded(self.out, drop)
        if self.tracker is not None:
            self.tracker.log_iteration(i, groups)

    def _cpu(self) -> dict[str, float]:
        """The CPU seconds of every process of the run since the last iteration was
        committed, and those the tasks spent in the model (:class:`CpuMeter`)."""
        cpu, model = self.cpu_meter.read()
        return {"cpu_seconds": cpu, "model_cpu_seconds": model}

    def _weight_receipts(self) -> dict[str, float]:
        """The seconds workers spent receiving policy weights since the last iteration
        was committed, summed over workers, and how many versions they received (a
        worker lost meanwhile takes its figures with it)."""
        client = self.handle.client
        got = client.run(drain_weight_receipts, on_error="ignore").values()
        return {"weight_sync_seconds": float(sum(s for s, _ in got)),
                "weight_sync_transfers": float(sum(n for _, n in got))}


def let_go(futures: Iterable[Future]) -> None:
    """Release futures the run is done with now, not when their last reference goes: a
    reference cycle (the traceback of a ``wait`` that timed out keeps its frame and the
    futures it waited on) would hold them until the garbage collector runs, and a worker
    lost meanwhile would have Dask recompute them -- outputs of iterations already
    committed, through checkpoints already dropped, or a checkpoint written again."""
    for f in futures:
        f.release()


class Pipeline:
    """Which pieces of a run's iterations are in the cluster, and when the next may go.

    Iteration ``j`` is submitted in three pieces, each as soon as what it reads exists:

    * its *rollout* once ``j`` is at most ``max_staleness + 1`` iterations past the
      oldest one not yet collected (its plan is fixed then) and every policy version
      its chunks read is published;
    * its *train* piece (advantages, micro-steps, the reduction) once its rollout is in
      and version ``j`` -- with the KL term, version 0 too -- is published;
    * its *tail* (the optimizer step from version ``j``'s state read back, which
      checkpoints version ``j + 1``) once its train piece is in and that read is.

    With the tail (and with the initial state) goes the read-back of the version it
    makes, which publishes the version (version 0 is published from the initial state,
    which has no inputs either). The read-back is a task without inputs: the scheduler
    sends it to the worker holding the new state in memory, so the version is published
    while its checkpoint is still being written, and a version's weights lost with
    every worker holding them are recomputed from its checkpoint alone. The read-back
    state is held until the tail of iteration ``v`` is in, which starts from it. A
    resumed run reads back the version it starts from in a piece of its own.

    What is in, and the futures each piece holds, are :attr:`pieces`' states
    (:mod:`digenrl.graph.pieces`: an iteration goes planned -> rollout -> train -> tail
    -> collected, a version's weights stored -> published -> released and its
    checkpoint writing -> written); which versions are retained and which checkpoints
    written, the run's :class:`~digenrl.graph.retention.Retention`. A piece's collected
    outputs are handed over by :meth:`take`, and published weights held until
    :meth:`release`.

    The held-out evaluation of a version (when the workload evaluates it) goes in as
    soon as the version's publish task is, and is collected with the iteration that
    published it (:func:`eval_iteration`). Nothing of training reads it: while only an
    iteration's evaluation is left, the next pieces are submitted as if it were
    collected.
    """

    def __init__(self, workload: Workload, client,
                 submit: Callable[[list, list[Key], str], dict[Key, Future]],
                 plan: Callable[[int], IterationPlan],
                 track: Callable[[Future], None] = lambda future: None):
        self.w = workload
        self.client = client
        self._submit = submit
        #: Told of each future the pipeline makes itself (not by ``submit``), for the
        #: run's release.
        self._track = track
        self._plan = plan
        self.start = 0
        self.stored = 0
        #: The run trains sharded: its versions are made by gangs of trainers, each
        #: version's state the members' results (:func:`sharded_train_nodes`).
        self.sharded = bool(workload.layout.shards)
        #: The run's retention and resume rule.
        self.retention: Retention = workload.layout.retention
        #: Every iteration's and version's pieces in the cluster, and their futures.
        self.pieces = Pieces()

    def begin(self, start: int, stored: int = 0) -> None:
        """Version 0 for a new run; for one resumed at ``start``, the weights of the
        versions it retains, restored from their checkpoints. ``stored``: the iterations
        the store holds (their evaluations are not computed again)."""
        self.start = start
        self.stored = max(start, stored)
        if start == 0:
            if self.sharded:
                self._submit_made_sharded(0, making_nodes(self.w.layout, 0,
                                                          written=self.writes(0)), INIT)
            else:
                self._submit_made(0, init_nodes(checkpoint=True), [], INIT)
            return
        # The earlier versions it retains here; version ``start`` by :meth:`_restore`.
        for v in self.retention.retained_versions(start)[:-1]:
            futs = self._submit(restore_nodes(v, publish=True), [publish_key(v)],
                                f"restore-{v}")
            self.pieces.stored(v).publish(futs[publish_key(v)])
        self.pieces.stored(start)

    def weights(self, v: int) -> Future:
        """The future of version ``v``'s published weights (while it is published)."""
        rec = self.pieces.version(v)
        if rec.weights is not Weights.PUBLISHED:
            raise IllegalTransition(f"version {v}: its weights are {str(rec.weights)!r}, "
                                    f"not published")
        return rec.published

    # ------------------------------------------------------------------ submitting

    def submit_ready(self, oldest: int) -> None:
        """Submit every piece whose inputs exist, in iteration order, until none is
        left; ``oldest``: the oldest iteration not collected yet."""
        window = self.w.options.max_staleness + 1
        progress = True
        while progress:
            progress = self._restore()
            for j in range(self.start, self.w.iterations):
                if self.pieces.stage(j) is Stage.PLANNED and j > oldest + window:
                    break  # not yet: its plan is fixed when it can be submitted
                plan = self._plan(j)
                progress |= self._rollout(plan)
                progress |= self._train(plan)
                progress |= self._tail(plan)
            progress |= self._evaluate()

    def _evaluate(self) -> bool:
        """Submit the evaluation of every published version the workload evaluates that
        this run has to collect (a resumed run's earlier ones are stored)."""
        nodes_of = getattr(self.w, "eval_nodes", None)
        if nodes_of is None:
            return False
        progress = False
        for rec in self.pieces.in_weights(Weights.PUBLISHED):
            if rec.evaluated:
                continue
            rec.evaluate()
            v = rec.version
            if eval_iteration(v) < self.stored or v > self.w.iterations:
                continue
            nodes = nodes_of(v)
            if not nodes:
                continue
            keys = [n.key for n in nodes]
            futs = self._submit(nodes, keys, f"eval-{v}")
            self.pieces.iteration(eval_iteration(v)).add_evals(futs)
            progress = True
        return progress

    def _restore(self) -> bool:
        """Read back the version a resumed run starts from, publishing it."""
        progress = False
        for rec in self.pieces.in_weights(Weights.STORED):
            v = rec.version
            state: Future | tuple[Future, ...] | None
            if self.sharded:
                # The gang builds its trainer from the version's sharded checkpoint.
                nodes = making_nodes(self.w.layout, v, written=False, from_checkpoint=True)
                members = state_members(self.w.layout, nodes)
                futs = self._submit(nodes, members + [publish_key(v)], f"restore-{v}")
                published, state = futs[publish_key(v)], tuple(futs[k] for k in members)
            else:
                _, published, state = self._submit_read_back(
                    v, restore_nodes(v, publish=True), [], f"restore-{v}")
            rec.publish(published, state)
            progress = True
        return progress

    def writes(self, v: int) -> bool:
        """Whether this run writes version ``v``'s checkpoint (``store.checkpoint_every``)."""
        return self.retention.writes_checkpoint(v, self.w.iterations)

    def _submit_made(self, v: int, nodes: list, keys: list[Key], name: str) -> dict[Key, Future]:
        """Submit ``nodes``, which make version ``v``'s trainer state (and checkpoint it
        when the run writes its checkpoint), with the read-back of that state (handed
        over in memory while the checkpoint is written) and, past version 0 (published
        from the initial state), its publish."""
        written = self.writes(v)
        futs, published, state = self._submit_read_back(
            v, nodes + restore_nodes(v, publish=v > 0, handoff=True, written=written),
            keys + ([checkpoint_key(v)] if written else []), name)
        self.pieces.made(v, published, state,
                         checkpoint=futs[checkpoint_key(v)] if written else None)
        return futs

    def _submit_made_sharded(self, v: int, nodes: list, name: str) -> dict[Key, Future]:
        """Submit ``nodes``: the gang making version ``v`` (and writing its sharded
        checkpoint where the run writes it), with the version's publish. The members'
        results are the version's state, which the next train piece's first round reads;
        member 0's, done, means the checkpoint is written (every member writes its
        shards, and member 0 records the checkpoint once all have)."""
        members = state_members(self.w.layout, nodes)
        keys = [n.key for n in nodes if n.op == STATS]
        futs = self._submit(nodes, members + keys + [publish_key(v)], name)
        written: Future | None = None
        if self.writes(v):
            # Its own reference to member 0's result: noting the checkpoint written lets
            # go of this one, not of the state's.
            written = Future(members[0], self.client)
            self._track(written)
        self.pieces.made(v, futs[publish_key(v)], tuple(futs[k] for k in members),
                         checkpoint=written)
        return futs

    def _submit_read_back(self, v: int, nodes: list, keys: list[Key],
                          name: str) -> tuple[dict[Key, Future], Future, Future | None]:
        """Submit ``nodes``, which read back version ``v``'s state: their futures, the
        published weights' and the state's when a tail starts from it (else None)."""
        read = [restore_key(v)] if v < self.w.iterations else []
        futs = self._submit(nodes, keys + read + [publish_key(v)], name)
        return futs, futs[publish_key(v)], futs[restore_key(v)] if read else None

    def _rollout(self, plan: IterationPlan) -> bool:
        j, layout = plan.iteration, self.w.layout
        if self.pieces.stage(j) is not Stage.PLANNED:
            return False
        reads = {layout.chunk_version(plan, c) for c in range(len(plan.chunks))}
        if not all(self.pieces.is_published(v) for v in reads):
            return False
        outputs = iteration_outputs(plan, layout.group_rewards)
        keys = outputs[DECODE] + outputs[REWARD] + outputs[GROUP_REWARD]
        trained = chain_keys_trained(layout, plan)
        futs = self._submit(rollout_nodes(layout, plan), keys + trained, f"rollout-{j}")
        self.pieces.iteration(j).rollout_in({k: futs[k] for k in keys},
                                            {k: futs[k] for k in trained})
        return True

    def _train(self, plan: IterationPlan) -> bool:
        j, layout = plan.iteration, self.w.layout
        if (self.pieces.stage(j) is not Stage.ROLLOUT or not self.pieces.is_published(j)
                or (layout.kl and not self.pieces.is_published(0))):
            return False
        held = train_outputs(layout, plan)
        keys = iteration_outputs(plan)[ADVANTAGE]
        if self.sharded:
            # Round 0 reads the results of the gang that made version j: a resumed run's
            # first version is made from its checkpoint, the others by an optimizer step.
            made = restore_key(j) if j == self.start and j > 0 else optimize_key(j - 1)
            nodes = sharded_train_nodes(layout, plan, made)
        else:
            nodes = train_nodes(layout, plan)
        futs = self._submit(nodes, keys + held, f"train-{j}")
        # The chain latents are read now.
        let_go(self.pieces.iteration(j).train_in({k: futs[k] for k in keys},
                                                 {k: futs[k] for k in held}))
        return True

    def _tail(self, plan: IterationPlan) -> bool:
        j = plan.iteration
        source = self.pieces.versions.get(j)  # the version its optimizer step starts from
        if self.pieces.stage(j) is not Stage.TRAIN or source is None or source.state is None:
            return False
        stats = iteration_outputs(plan)[STATS]
        if self.sharded:
            futs = self._submit_made_sharded(
                j + 1, sharded_tail_nodes(self.w.layout, plan, written=self.writes(j + 1)),
                f"tail-{j}")
        else:
            futs = self._submit_made(
                j + 1, tail_nodes(self.w.layout, plan, restore_key(j), checkpoint=True,
                                  written=self.writes(j + 1)),
                stats, f"tail-{j}")
        let_go(self.pieces.iteration(j).tail_in({k: futs[k] for k in stats}))
        # The optimizer step reads it now (sharded: the train piece read it already).
        state = source.take_state()
        let_go(state if isinstance(state, tuple) else [state])
        return True

    # ------------------------------------------------------------------ waiting

    def _note_checkpoints(self, i: int) -> None:
        """Note the checkpoints written; raise the error of checkpoint ``i + 1`` (what
        iteration ``i`` waits for), which stops the run. A later checkpoint's error (a
        later iteration failed) is raised once that iteration is waited for, after the
        iterations before it are committed."""
        for rec in self.pieces.writing():
            f = rec.writing
            if f.status == "error":
                if rec.version <= i + 1:
                    f.result()  # raises
                continue
            if f.done():
                let_go([rec.written()])

    def wait_for(self, i: int, stalled: Callable[[], str | None],
                 gang_failed: Callable[[], str | None] = lambda: None) -> None:
        """Submit pieces as they become ready until iteration ``i`` is complete: its
        tail is in, its outputs are computed and checkpoint ``i + 1`` is written (where
        the run writes it). A task's error is raised here. After each ``STALL_POLL``
        seconds without progress, ``stalled()`` says why the run can no longer progress
        (None while it can), and :class:`RunStalled` is raised with that; a sharded run
        first asks ``gang_failed()`` whether a gang step failed (the trainers' state is
        then not whole: what it waits for will not come) and raises :class:`GangLost`
        with its line."""
        while True:
            self._note_checkpoints(i)
            self.submit_ready(i)
            it = self.pieces.iteration(i)
            futs, evals = it.outputs, it.evals
            # With its tail in, version i + 1 is made: complete once its checkpoint is
            # written, or at once when the run does not write it.
            trained = (it.stage is Stage.TAIL
                       and self.pieces.version(i + 1).checkpoint is not Checkpoint.WRITING
                       and all(f.done() for f in futs.values()))
            errors = [f for f in [*futs.values(), *evals.values()] if f.status == "error"]
            if errors:
                errors[0].result()  # raises the task's exception
            if trained and all(f.done() for f in evals.values()):
                return
            if trained:
                # Only the evaluation is left: training goes on without it.
                self.submit_ready(i + 1)
            waiting = [f for f in [*futs.values(), *evals.values(),
                                   *(r.writing for r in self.pieces.writing())]
                       if not f.done()]
            assert waiting, (f"iteration {i}: nothing left to wait for "
                             f"({self.pieces.describe()})")
            # distributed.wait runs on the default client's event loop, which is not this
            # run's when the process holds several clients; the futures' events would
            # then belong to the wrong loop.
            with self.client.as_current():
                try:
                    wait(waiting, timeout=STALL_POLL, return_when="FIRST_COMPLETED")
                except TimeoutError:
                    failed = gang_failed() if self.sharded else None
                    if failed:
                        raise GangLost(failed) from None
                    why = stalled()
                    if why:
                        raise RunStalled(f"run stalled at iteration {i}: {why}") from None

    # ------------------------------------------------------------------ committing

    def take(self, i: int) -> dict[Key, Future]:
        """The futures of complete iteration ``i``'s collected outputs (its evaluations'
        among them), handed over."""
        return self.pieces.iteration(i).collect()

    def release(self, i: int) -> None:
        """Iteration ``i`` is committed: drop the weights of the versions the run, now at
        iteration ``i + 1``, no longer retains."""
        for rec in self.pieces.in_weights(Weights.PUBLISHED):
            if not self.retention.retains(rec.version, i + 1):
                let_go([rec.release()])


class _Window:
    """Iteration windows, each from the previous iteration's optimizer step stopping to
    its own, and the task records read from the scheduler that may overlap them."""

    def __init__(self, started: float):
        self.started = started
        self.opened = started   # when the current window opened
        self.cursor = 0         # the next record to read from the scheduler
        self.recent: list[dict] = []

    def close(self, client, i: int) -> tuple[list[dict], float]:
        """Read the records of the tasks finished since the last call, and close
        iteration ``i``'s window when its optimizer step stopped (now, if they lack it).
        Returns those records and that time; :attr:`recent` then holds every record
        that may overlap the window. (The optimizer step may have been read in an
        earlier call: the pipeline runs up to two iterations ahead of the commits.)"""
        batch = client.sync(client.scheduler.digenrl_tasks, start=self.cursor)
        self.cursor = batch["next"]
        records = list(batch["records"])
        self.recent = [r for r in self.recent if (r["stop"] or 0.0) > self.opened] + records
        closes = optimize_stop(self.recent, i) or time.time()
        return records, closes
