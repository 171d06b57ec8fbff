"""A discrete-event engine that drives the scheduling policy without Dask.

It plays the part of the Dask scheduler and workers: tasks become ready when their
inputs exist, the policy decides releases, a worker runs its GPU tasks one at a time in
release order (tasks without a GPU run beside them), and finishing a task makes its
dependents ready. Task durations come from a cost function; moving an input between
workers costs what the transfer function says. The driver's behaviour is modelled too:
iterations are submitted within the same window as :class:`digenrl.runner.Runner` uses.

The same :class:`~digenrl.schedulers.policy.SchedulingPolicy` object the Dask plugin
uses makes every decision, so what the simulator shows is what the plugin does.
"""

from __future__ import annotations

import gc
import heapq
import itertools
from collections import defaultdict, deque
from dataclasses import dataclass, field
from typing import Callable, Hashable, Iterable, Sequence

from digenrl.graph.plan import IterationPlan
from digenrl.graph.structure import (GraphLayout, Node, init_nodes, iteration_nodes,
                                     optimize_key, publish_key)
from digenrl.schedulers.options import ScheduleOptions
from digenrl.schedulers.policy import SchedulingPolicy, TaskInfo

__all__ = ["SimWorker", "SimRecord", "SimResult", "Simulator", "uniform_plans"]

Key = Hashable


@dataclass(frozen=True)
class SimWorker:
    name: str
    pool: str
    gpus: int = 1               # GPUs the worker advertises (tasks it runs at once)
    speed: float = 1.0          # relative speed: durations are divided by it


@dataclass(slots=True)
class SimRecord:
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
        self._events: list = []
        self._seq = itertools.count()
        self.nodes: dict[Key, Node] = {}
        self.info: dict[Key, TaskInfo] = {}
        self.nbytes: dict[Key, int] = {}        # the size of each task's output
        self.added = 0                           # tasks added over the whole run
        self._by_iteration: dict[int, list[Key]] = defaultdict(list)
        self.waiting: dict[Key, int] = {}
        self.dependents: dict[Key, list[Key]] = defaultdict(list)
        self.done: dict[Key, str] = {}          # key -> worker holding its output
        self.ready_at: dict[Key, float] = {}
        self.released: dict[Key, tuple[float, str, bool]] = {}
        self.queue: dict[str, deque] = {w: deque() for w in self.workers}
        self.running: dict[str, int] = {w: 0 for w in self.workers}
        self.records: list[SimRecord] = []
        for w in workers:
            self.policy.add_worker(w.name, w.name, w.pool, w.gpus, w.speed)

    # ------------------------------------------------------------------ graph

    def add_nodes(self, nodes: Iterable[Node]) -> None:
        new = []
        from_meta = TaskInfo.from_meta
        all_nodes, all_info, nbytes = self.nodes, self.info, self.nbytes
        output_bytes = self.output_bytes
        by_iteration = self._by_iteration
        for node in nodes:
            key = node.key
            all_nodes[key] = node
            info = from_meta(key, node.meta)
            all_info[key] = info
            nbytes[key] = output_bytes(info)
            by_iteration[info.iteration].append(key)
            new.append(info)
        self.added += len(new)
        self.policy.add_tasks(new)
        done, waiting, dependents = self.done, self.waiting, self.dependents
        for info in new:
            key = info.key
            missing = [d for d in all_nodes[key].deps if d not in done]
            waiting[key] = len(missing)
            for d in missing:
                dependents[d].append(key)
            if not missing:
                self._ready(key)

    def _ready(self, key: Key) -> None:
        self.ready_at[key] = self.now
        loc: dict[str, int] = {}
        done, nbytes = self.done, self.nbytes
        for d in self.nodes[key].deps:
            holder = done.get(d)
            if holder is not None and d in nbytes:
                loc[holder] = loc.get(holder, 0) + nbytes[d]
        self.policy.task_ready(key, loc)

    # ----------------------------------------------------------------- events

    def _push(self, t: float, kind: str, payload) -> None:
        heapq.heappush(self._events, (t, next(self._seq), kind, payload))

    def _apply_decisions(self) -> None:
        now, released, info, queue = self.now, self.released, self.info, self.queue
        for d in self.policy.decide():
            key, worker = d.key, d.worker
            released[key] = (now, worker, d.tag)
            if info[key].gpu:
                queue[worker].append(key)
                self._start_next(worker)
            else:
                self._start(key, worker, now + self.latency)

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
            key = q.popleft()
            running[worker] += 1
            self._start(key, worker, start)

    def _start(self, key: Key, worker: str, start: float) -> float:
        info = self.info[key]
        w = self.workers[worker]
        fetch = 0.0
        if self.transfer is not None:
            done, all_info = self.done, self.info
            for d in self.nodes[key].deps:
                holder = done.get(d)
                if holder is not None and holder != worker and d in all_info:
                    t = self.transfer(d, all_info[d], holder, worker)
                    if t > fetch:
                        fetch = t
        stop = start + fetch + self.cost(info, w) / w.speed
        heapq.heappush(self._events, (stop, next(self._seq), "finish",
                                      (key, worker, start + fetch)))
        return stop

    def _finish(self, key: Key, worker: str, start: float) -> None:
        info = self.info[key]
        rel_time, _, tag = self.released[key]
        timestep, chunk = info.timestep, info.chunk
        self.records.append(SimRecord(
            key, info.kind, worker, self.workers[worker].pool, info.iteration,
            info.policy_version, -1 if timestep is None else timestep,
            -1 if chunk is None else chunk, self.ready_at[key], rel_time, start, self.now,
            tag, info.gpu))
        self.done[key] = worker
        self.policy.task_done(key, worker, self.now - start)
        if info.gpu:
            self.running[worker] -= 1
            self._start_next(worker, queued=True)
        waiting = self.waiting
        for dep in self.dependents.pop(key, ()):
            n = waiting[dep] - 1
            waiting[dep] = n
            if n == 0:
                self._ready(dep)

    def _forget(self, iteration: int) -> None:
        """Iteration ``iteration`` finished: drop what no later task reads (everything
        but its optimizer state and published weights), as Dask forgets released keys."""
        keep = (optimize_key(iteration), publish_key(iteration + 1))
        forgotten = self.policy.task_forgotten
        for key in self._by_iteration.pop(iteration, ()):
            if key in keep:
                continue
            forgotten(key)
            for d in (self.nodes, self.info, self.nbytes, self.waiting, self.ready_at,
                      self.released, self.done):
                d.pop(key, None)

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
        submitted = 0
        completed: dict[int, float] = {}

        def submit_upto(limit: int) -> None:
            nonlocal submitted
            while submitted < min(limit, len(plans)):
                self.add_nodes(iteration_nodes(layout, plans[submitted]))
                submitted += 1

        submit_upto(window + 1)
        self._apply_decisions()
        next_done = 0
        while self._events:
            t, _, kind, payload = heapq.heappop(self._events)
            if t > max_time:
                break
            self.now = t
            if kind == "finish":
                key, worker, start = payload
                self._finish(key, worker, start)
                if key[0] == "stats":
                    completed[key[1]] = t
                    self._forget(key[1])
                    while next_done in completed:
                        next_done += 1
                    submit_upto(next_done + window + 1)
            # Finish every event at this instant before deciding, as the plugin does.
            if not self._events or self._events[0][0] > self.now:
                self._apply_decisions()
        images = plans[0].num_samples if plans else 0
        return SimResult(self.records, self.now, completed, images, list(self.workers.values()))
