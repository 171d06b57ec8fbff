"""A discrete-event engine that drives the scheduling policy without Dask.

It plays the part of the Dask scheduler and workers: tasks become ready when their
inputs exist, the policy decides releases, a worker runs its GPU tasks one at a time in
release order (tasks without a GPU run beside them), and finishing a task makes its
dependents ready. Task durations come from a cost function; moving an input between
workers costs what the transfer function says. The driver's behaviour is modelled too:
iterations are submitted within the same window as :class:`digenrl.runner.Runner` uses.

The same :class:`~digenrl.schedulers.policy.SchedulingPolicy` object the Dask plugin
uses makes every decision, so what the simulator shows is what the plugin does. Each
iteration's tasks are the graph builders' (:mod:`digenrl.sim.template` repeats them,
shifted, for later iterations of one shape).
"""

from __future__ import annotations

import gc
import heapq
from collections import defaultdict, deque
from dataclasses import dataclass, field
from typing import Callable, Hashable, Iterable, NamedTuple, Sequence

from digenrl.graph.plan import IterationPlan
from digenrl.graph.structure import GraphLayout, Node, init_nodes, optimize_key, publish_key
from digenrl.schedulers.options import ScheduleOptions
from digenrl.schedulers.policy import SchedulingPolicy, TaskInfo
from digenrl.sim.template import Batch, IterationSource, node_batch

__all__ = ["SimWorker", "SimRecord", "SimResult", "Simulator", "uniform_plans"]

Key = Hashable


@dataclass(frozen=True)
class SimWorker:
    name: str
    pool: str
    gpus: int = 1               # GPUs the worker advertises (tasks it runs at once)
    speed: float = 1.0          # relative speed: durations are divided by it


class SimRecord(NamedTuple):
    """One task as it ran (a tuple: millions are made in a large run)."""

    key: Key
    kind: str
    worker: str
    pool: str
    iteration: int
    policy_version: int
    timestep: int
    chunk: int
    ready: float
    released: float
    start: float
    stop: float
    tag: bool
    gpu: bool


@dataclass
class SimResult:
    records: list[SimRecord]
    end: float
    completed: dict[int, float] = field(default_factory=dict)  # iteration -> optimize stop
    images: int = 0
    workers: list[SimWorker] = field(default_factory=list)

    def throughput(self, skip: int = 1) -> float:
        """Images per second over iterations ``skip..`` (the first includes start-up)."""
        its = sorted(self.completed)
        if len(its) <= skip:
            return float("nan")
        per = self.images
        return per * (len(its) - skip) / (self.completed[its[-1]] - self.completed[its[skip - 1]])


def uniform_plans(n: int, prompts_per_iteration: int, samples_per_prompt: int,
                  chunk_size: int) -> list[IterationPlan]:
    prompts = tuple(f"p{j}" for j in range(prompts_per_iteration))
    return [IterationPlan.uniform(i, prompts, samples_per_prompt, chunk_size) for i in range(n)]


CostFn = Callable[[TaskInfo, SimWorker], float]
TransferFn = Callable[[Key, TaskInfo, str, str], float]


class _Task:
    """The engine's state of one task."""

    __slots__ = ("key", "info", "deps", "dependents", "waiting", "holder", "nbytes",
                 "ready_at", "released", "worker_tag")

    def __init__(self, key: Key, info: TaskInfo, nbytes: int):
        self.key = key
        self.info = info
        self.deps: list[_Task] = []
        self.dependents: list[_Task] = []
        self.waiting = 0
        self.holder: str | None = None      # the worker holding its output, once done
        self.nbytes = nbytes                # the size of its output
        self.ready_at = 0.0
        self.released = 0.0
        self.worker_tag = False


class Simulator:
    """Runs iterations of a layout on simulated workers under one policy."""

    def __init__(self, options: ScheduleOptions, workers: Sequence[SimWorker], cost: CostFn,
                 *, transfer: TransferFn | None = None, dispatch_latency: float = 0.0,
                 queued_latency: float = 0.0,
                 output_bytes: Callable[[TaskInfo], int] | None = None):
        self.now = 0.0
        self.policy = SchedulingPolicy(options, clock=lambda: self.now)
        self.workers = {w.name: w for w in workers}
        self.cost = cost
        self.transfer = transfer
        self.latency = dispatch_latency
        self.queued_latency = queued_latency
        self.output_bytes = output_bytes or (lambda info: 1)
        # Pending finishes by time: many tasks end at the same instant, so a heap of the
        # distinct times and a list per time (in the order the tasks started).
        self._times: list[float] = []
        self._at: dict[float, list] = {}
        self.tasks: dict[Key, _Task] = {}
        self.added = 0                           # tasks added over the whole run
        self._by_iteration: dict[int, list[_Task]] = defaultdict(list)
        # Tasks waiting for keys that were never added: key -> its waiting dependents.
        self._orphans: dict[Key, list[_Task]] = defaultdict(list)
        self.queue: dict[str, deque] = {w: deque() for w in self.workers}
        self.running: dict[str, int] = {w: 0 for w in self.workers}
        self.records: list[SimRecord] = []
        for w in workers:
            self.policy.add_worker(w.name, w.name, w.pool, w.gpus, w.speed)

    # ------------------------------------------------------------------ graph

    def add_nodes(self, nodes: Iterable[Node]) -> None:
        self.add_batch(node_batch(list(nodes)))

    def add_batch(self, batch: Batch) -> None:
        """Add tasks (see :mod:`digenrl.sim.template` for the batch's form)."""
        entries, externals = batch
        tasks, orphans = self.tasks, self._orphans
        output_bytes = self.output_bytes
        new = [_Task(key, info, output_bytes(info)) for key, info, _ in entries]
        by_iteration = self._by_iteration
        for t in new:
            tasks[t.key] = t
            by_iteration[t.info.iteration].append(t)
        self.added += len(new)
        self.policy.add_tasks([t.info for t in new])
        # Inputs from earlier batches (None: not added yet).
        outside = [tasks.get(k) for k in externals]
        ready = []
        for t, (_, _, inputs) in zip(new, entries):
            waiting = 0
            resolved = t.deps
            for j in inputs:
                dt = new[j] if j >= 0 else outside[~j]
                if dt is None:
                    orphans[externals[~j]].append(t)
                    waiting += 1
                    continue
                resolved.append(dt)
                if dt.holder is None:
                    dt.dependents.append(t)
                    waiting += 1
            t.waiting = waiting
            if not waiting:
                ready.append(t)
            # A key added now that others were waiting for.
            if orphans and t.key in orphans:
                for o in orphans.pop(t.key):
                    o.deps.append(t)
                    t.dependents.append(o)
        for t in ready:
            self._ready(t)

    def _ready(self, t: _Task) -> None:
        t.ready_at = self.now
        loc: dict[str, int] = {}
        for d in t.deps:
            holder = d.holder
            if holder is not None:
                loc[holder] = loc.get(holder, 0) + d.nbytes
        self.policy.task_ready(t.key, loc)

    # ----------------------------------------------------------------- events

    def _apply_decisions(self) -> None:
        now, tasks, queue = self.now, self.tasks, self.queue
        for d in self.policy.decide():
            t = tasks[d.key]
            worker = d.worker
            t.released = now
            t.worker_tag = d.tag
            if t.info.gpu:
                queue[worker].append(t)
                self._start_next(worker)
            else:
                self._start(t, worker, now + self.latency)

    def _start_next(self, worker: str, queued: bool = False) -> None:
        """Start queued GPU tasks while the worker has a free GPU. A task that waited on
        the worker starts ``queued_latency`` after the GPU frees (the worker's own hand-over);
        one just released to an idle worker pays the dispatch latency."""
        q = self.queue[worker]
        if not q:
            return
        gpus = self.workers[worker].gpus
        running = self.running
        start = self.now + (self.queued_latency if queued else self.latency)
        while running[worker] < gpus and q:
            running[worker] += 1
            self._start(q.popleft(), worker, start)

    def _start(self, t: _Task, worker: str, start: float) -> None:
        w = self.workers[worker]
        fetch = 0.0
        transfer = self.transfer
        if transfer is not None:
            for d in t.deps:
                holder = d.holder
                if holder is not None and holder != worker:
                    f = transfer(d.key, d.info, holder, worker)
                    if f > fetch:
                        fetch = f
        start += fetch
        stop = start + self.cost(t.info, w) / w.speed
        bucket = self._at.get(stop)
        if bucket is None:
            self._at[stop] = bucket = []
            heapq.heappush(self._times, stop)
        bucket.append((t, worker, start))

    def _forget(self, iteration: int) -> None:
        """Iteration ``iteration`` finished: drop what no later task reads (everything
        but its optimizer state and published weights), as Dask forgets released keys."""
        keep = (optimize_key(iteration), publish_key(iteration + 1))
        forgotten = self.policy.task_forgotten
        tasks = self.tasks
        for t in self._by_iteration.pop(iteration, ()):
            key = t.key
            if key in keep:
                continue
            forgotten(key)
            del tasks[key]
            t.deps = []

    # -------------------------------------------------------------------- run

    def run(self, layout: GraphLayout, plans: Sequence[IterationPlan], *,
            window: int | None = None, max_time: float = float("inf")) -> SimResult:
        """Run ``plans`` (iterations 0..n-1) keeping ``window`` iterations beyond the
        oldest unfinished one submitted, as the driver does."""
        if window is None:
            window = self.policy.options.max_staleness + 1
        # The run allocates millions of small objects and frees none of them in cycles:
        # the cyclic collector's passes over them would cost a quarter of the run.
        collecting = gc.isenabled()
        gc.disable()
        try:
            return self._run(layout, plans, window, max_time)
        finally:
            if collecting:
                gc.enable()

    def _run(self, layout: GraphLayout, plans: Sequence[IterationPlan], window: int,
             max_time: float) -> SimResult:
        self.add_nodes(init_nodes())
        source = IterationSource(layout)
        submitted = 0
        completed: dict[int, float] = {}

        def submit_upto(limit: int) -> None:
            nonlocal submitted
            while submitted < min(limit, len(plans)):
                self.add_batch(source.batch(plans[submitted]))
                submitted += 1

        submit_upto(window + 1)
        self._apply_decisions()
        next_done = 0
        times, at = self._times, self._at
        pop = heapq.heappop
        append = self.records.append
        new_record = tuple.__new__
        pool_of = {name: w.pool for name, w in self.workers.items()}
        task_done = self.policy.task_done
        running, queue = self.running, self.queue
        start_next, ready = self._start_next, self._ready
        while times:
            now = times[0]
            if now > max_time:
                break
            pop(times)
            self.now = now
            bucket = at[now]
            # Tasks finishing at this instant, including any that start and end in it.
            i = 0
            while i < len(bucket):
                t, worker, start = bucket[i]
                i += 1
                info = t.info
                timestep, chunk = info.timestep, info.chunk
                append(new_record(SimRecord, (
                    t.key, info.kind, worker, pool_of[worker], info.iteration,
                    info.policy_version, -1 if timestep is None else timestep,
                    -1 if chunk is None else chunk, t.ready_at, t.released, start, now,
                    t.worker_tag, info.gpu)))
                t.holder = worker
                task_done(t.key, worker, now - start)
                if info.gpu:
                    running[worker] -= 1
                    if queue[worker]:
                        start_next(worker, True)
                dependents = t.dependents
                if dependents:
                    t.dependents = []
                    for dep in dependents:
                        n = dep.waiting - 1
                        dep.waiting = n
                        if n == 0:
                            ready(dep)
                if info.kind == "stats":
                    it = info.iteration
                    completed[it] = now
                    self._forget(it)
                    while next_done in completed:
                        next_done += 1
                    submit_upto(next_done + window + 1)
            del at[now]
            # Finish every event at this instant before deciding, as the plugin does.
            self._apply_decisions()
        images = plans[0].num_samples if plans else 0
        return SimResult(self.records, self.now, completed, images, list(self.workers.values()))
