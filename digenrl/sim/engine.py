"""A discrete-event engine that drives the scheduling policy without Dask.

It plays the part of the Dask scheduler and workers: tasks become ready when their
inputs exist, the policy decides releases, a worker runs its GPU tasks one at a time in
release order (tasks without a GPU run beside them), and finishing a task makes its
dependents ready. Task durations come from a cost function; moving an input between
workers costs what the transfer function says.

What it shares with a run on Dask, and where it differs (stated here once):

* **Shared:** the same :class:`~digenrl.schedulers.policy.SchedulingPolicy` makes every
  decision from the same events, and each iteration's rollout, train and tail tasks are
  the graph builders' (:func:`~digenrl.graph.structure.iteration_nodes`;
  :mod:`digenrl.sim.template` repeats them, shifted, for later iterations of one shape).
  Given the same tasks at the same times, it releases what the plugin releases.
* **Different:** the driver (:class:`digenrl.run.driver.Pipeline`) submits an iteration in
  three pieces, each once what it reads exists (:mod:`digenrl.graph.pieces`), and
  publishes each version from its state read back (a ``restore`` task, with a
  ``checkpoint`` task beside it); the simulator submits whole iterations, at most
  ``max_staleness + 1`` beyond the oldest unfinished one (the window that bounds the
  driver's rollouts too), with each optimizer step reading the previous one's state
  directly and no ``restore`` or ``checkpoint`` tasks. So its tasks exist as soon as the
  window admits them, not a driver round trip after their inputs, and it charges none of
  the read-back and checkpoint work, which runs beside the GPU tasks on the trainers.
  With the Dask latencies an emulated run measured, the two agree on its iterations'
  time within 5% (``tests/sim/test_emulate.py``, the simulator against the driver).
"""

from __future__ import annotations

import gc
import heapq
from collections import defaultdict, deque
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import cached_property, partial
from operator import attrgetter
from typing import Callable, Iterable, Iterator, Sequence, cast

from digenrl.graph.plan import IterationPlan
from digenrl.graph.keys import optimize_key, publish_key
from digenrl.graph.structure import GraphLayout, Node, init_nodes
from digenrl.records import SimRecord
from digenrl.schedulers.options import ScheduleOptions
from digenrl.schedulers.policy import SchedulingPolicy, TaskInfo
from digenrl.schedulers.policy.trail import trail_text
from digenrl.sim.template import Batch, IterationSource, node_batch
from digenrl.vocabulary import Key, STATS

__all__ = ["SimWorker", "SimRecord", "SimResult", "SimClock", "Simulator", "uniform_plans",
           "collector_off"]



@dataclass(frozen=True)
class SimWorker:
    name: str
    pool: str
    gpus: int = 1               # GPUs the worker advertises (tasks it runs at once)
    speed: float = 1.0          # relative speed: durations are divided by it


@dataclass
class SimResult:
    finished: list[_Task]   # the engine's tasks, in the order they finished
    end: float
    completed: dict[int, float] = field(default_factory=dict)  # iteration -> optimize stop
    images: int = 0
    workers: list[SimWorker] = field(default_factory=list)

    @property
    def tasks(self) -> int:
        return len(self.finished)

    @cached_property
    def records(self) -> list[SimRecord]:
        """Every task as it ran, in the order they finished (made on first use: a
        large run finishes millions of tasks and most callers need only :meth:`busy`)."""
        records = []
        for t in self.finished:
            assert t.holder is not None     # (set when it finished)
            records.append(SimRecord(
                key=t.key, kind=t.kind, worker=t.holder, pool=t.on.pool,
                iteration=t.iteration, policy_version=t.policy_version,
                timestep=-1 if t.timestep is None else t.timestep,
                chunk=-1 if t.chunk is None else t.chunk, ready=t.ready_at,
                released=t.released, start=t.start, stop=t.stop, tag=t.worker_tag, gpu=t.gpu,
                rat=t.worker_rat, decisions=trail_text(t.trail)))
        return records

    def busy(self, t0: float, t1: float) -> dict[str, float]:
        """GPU-seconds each worker computed within ``[t0, t1]``."""
        busy: dict[str, float] = {}
        for gpu, worker, start, stop in map(attrgetter("gpu", "holder", "start", "stop"),
                                            self.finished):
            if gpu:
                start = start if start > t0 else t0
                stop = stop if stop < t1 else t1
                if stop > start:
                    busy[worker] = busy.get(worker, 0.0) + (stop - start)
        return busy

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
#: Seconds to move the output of a task of a kind and sample count from the worker
#: holding it to another one. (This and the output's size depend on nothing else of the
#: task: the engine computes each once per kind and sample count.)
TransferFn = Callable[[str, int], float]


@contextmanager
def collector_off() -> Iterator[None]:
    """The cyclic garbage collector off for the block, and back as it was after."""
    collecting = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if collecting:
            gc.enable()


class SimClock:
    """Simulated time: the policy's clock, which cost functions may read too."""

    __slots__ = ("now",)

    def __init__(self) -> None:
        self.now = 0.0


class _Task(TaskInfo):
    """A task: the policy's :class:`TaskInfo` (the same object the policy holds) with
    the engine's state of it. The state is set when the task is added."""

    __slots__ = ("deps", "dependents", "waiting", "holder", "nbytes", "fetch", "ready_at",
                 "released", "worker_tag", "worker_rat", "on", "start", "stop")

    # (An empty tuple once no longer needed: a forgotten task's inputs, a finished
    # task's dependents.)
    deps: list[_Task] | tuple[()]
    dependents: list[_Task] | tuple[()]
    waiting: int                # inputs not yet computed
    holder: str | None          # the worker holding its output (None: not finished)
    nbytes: int                 # the output's size
    fetch: float                # seconds to move the output to another worker
    ready_at: float
    released: float
    worker_tag: bool
    worker_rat: bool
    on: _Worker                 # the worker it started on
    start: float
    stop: float


class _Worker:
    """The engine's state of one worker."""

    __slots__ = ("name", "pool", "gpus", "speed", "spec", "queue", "running")

    def __init__(self, spec: SimWorker):
        # (Copies of the frozen spec's fields: every start and finish reads them.)
        self.name, self.pool, self.gpus, self.speed = spec.name, spec.pool, spec.gpus, spec.speed
        self.spec = spec
        self.queue: deque[_Task] = deque()   # GPU tasks released to it, not started
        self.running = 0                     # GPU tasks running


class Simulator:
    """Runs iterations of a layout on simulated workers under one policy.

    ``trail``: how many decisions the policy keeps per task (its decision trail, in the
    records' ``decisions`` column); 0, the default, records none, which keeps large
    simulations at full speed."""

    def __init__(self, options: ScheduleOptions, workers: Sequence[SimWorker], cost: CostFn,
                 *, transfer: TransferFn | None = None, dispatch_latency: float = 0.0,
                 queued_latency: float = 0.0,
                 output_bytes: Callable[[str, int], int] | None = None,
                 clock: SimClock | None = None, trail: int = 0):
        # (The policy reads the clock object, not the simulator: nothing the run makes
        # refers back to the simulator, so reference counting frees it all.)
        self.clock = clock or SimClock()
        self.policy = SchedulingPolicy(options, clock=partial(getattr, self.clock, "now"),
                                       trail=trail)
        self._workers = {w.name: _Worker(w) for w in workers}
        self.cost = cost
        self.transfer = transfer or (lambda kind, samples: 0.0)
        self.latency = dispatch_latency
        self.queued_latency = queued_latency
        self.output_bytes = output_bytes or (lambda kind, samples: 1)
        # (kind, samples) -> (output bytes, transfer seconds): both depend on nothing else.
        self._sizes: dict[tuple[str, int], tuple[int, float]] = {}
        # Pending finishes by time: many tasks end at the same instant, so a heap of the
        # distinct times and a list per time (in the order the tasks started).
        self._times: list[float] = []
        self._at: dict[float, list[_Task]] = {}
        self.added = 0                           # tasks added over the whole run
        self._by_iteration: dict[int, list[_Task]] = defaultdict(list)
        # Tasks waiting for keys that were never added: key -> its waiting dependents.
        self._orphans: dict[Key, list[_Task]] = defaultdict(list)
        self.finished: list[_Task] = []
        self._one_holder: dict[tuple[str | None, int], dict[str, int]] = {}   # see _ready
        for w in workers:
            self.policy.add_worker(w.name, w.name, w.pool, w.gpus, w.speed)

    @property
    def now(self) -> float:
        return self.clock.now

    @property
    def tasks(self) -> dict[Key, _Task]:
        """The tasks added and not forgotten, by key: the policy's table, which holds
        the engine's own task objects."""
        return cast("dict[Key, _Task]", self.policy.tasks)

    @property
    def workers(self) -> dict[str, SimWorker]:
        return {name: w.spec for name, w in self._workers.items()}

    # ------------------------------------------------------------------ graph

    def add_nodes(self, nodes: Iterable[Node]) -> None:
        self.add_batch(node_batch(list(nodes), _Task))

    def add_batch(self, batch: Batch) -> None:
        """Add tasks (see :mod:`digenrl.sim.template` for the batch's form; its tasks are
        made with the factory ``_Task``)."""
        entries, externals = batch
        orphans, by_iteration = self._orphans, self._by_iteration
        sizes = self._sizes
        new: list[_Task] = []
        append = new.append
        for _, info, _ in entries:
            t = cast(_Task, info)   # (made by the factory _Task)
            t.dependents = []
            t.holder = None
            size = sizes.get((t.kind, t.samples))
            if size is None:
                size = sizes[(t.kind, t.samples)] = (
                    self.output_bytes(t.kind, t.samples), self.transfer(t.kind, t.samples))
            t.nbytes, t.fetch = size
            t.ready_at = t.released = 0.0
            t.worker_tag = t.worker_rat = False
            by_iteration[t.iteration].append(t)
            append(t)
        self.added += len(new)
        self.policy.add_tasks(new)
        # Inputs from earlier batches (None: not added yet).
        tasks = self.tasks
        outside = [tasks.get(k) for k in externals]
        missing = any(d is None for d in outside)
        ready = []
        for t, (_, _, inputs) in zip(new, entries):
            found = [new[j] if j >= 0 else outside[~j] for j in inputs]
            waiting = 0
            if missing:
                for j in inputs:
                    if j < 0 and outside[~j] is None:
                        orphans[externals[~j]].append(t)
                        waiting += 1
                found = [d for d in found if d is not None]
            t.deps = deps = cast("list[_Task]", found)   # (without the missing ones)
            for d in deps:
                if d.holder is None:
                    # (Lists until it finishes: a task waiting for d, or d, is unfinished.)
                    cast("list[_Task]", d.dependents).append(t)
                    waiting += 1
            t.waiting = waiting
            if not waiting:
                ready.append(t)
            # A key added now that others were waiting for.
            if orphans and t.key in orphans:
                for o in orphans.pop(t.key):
                    cast("list[_Task]", o.deps).append(t)
                    cast("list[_Task]", t.dependents).append(o)
        for t in ready:
            self._ready(t)

    def _ready(self, t: _Task) -> None:
        """Every input of ``t`` exists: tell the policy where its bytes are."""
        t.ready_at = self.clock.now
        holder: str | None = None
        total = 0
        loc: dict[str, int] | None = None
        for d in t.deps:
            h = d.holder
            assert h is not None        # (every input has finished)
            if loc is None:
                if holder is None or h == holder:
                    holder = h
                    total += d.nbytes
                    continue
                loc = {holder: total}
            loc[h] = loc.get(h, 0) + d.nbytes
        if loc is None:
            # All inputs on one worker (or none): one mapping shared by every such task
            # (the policy only reads it) rather than a small dict each.
            shared = self._one_holder
            loc = shared.get((holder, total))
            if loc is None:
                loc = shared[(holder, total)] = {holder: total} if holder is not None else {}
        self.policy.ready(t, loc)

    # ----------------------------------------------------------------- events

    def _apply_decisions(self) -> None:
        """Start (or queue on its worker) every task the policy releases now. A task
        released to a worker with a free GPU pays the dispatch latency; one queued there
        starts ``queued_latency`` after a GPU frees (the worker's own hand-over)."""
        now, workers = self.clock.now, self._workers
        start = now + self.latency
        # (Copies ahead of need move a lent grad's gradient to a trainer: the engine
        # charges no transfer for a reduction's inputs, so it has nothing to move.)
        self.policy.take_copies()
        for d in self.policy.decide():
            t = cast(_Task, d.info)  # (the engine's task: the policy holds the same objects)
            w = workers[d.worker]
            t.released = now
            t.worker_tag = d.tag
            t.worker_rat = d.rat
            if t.gpu:
                # (A worker's queue is empty whenever it has a free GPU.)
                if w.running < w.gpus:
                    w.running += 1
                else:
                    w.queue.append(t)
                    continue
            self._start(t, w, start)

    def _start(self, t: _Task, w: _Worker, start: float) -> None:
        """``t`` starts on ``w`` at ``start``, once the inputs it lacks have arrived."""
        fetch = 0.0
        name = w.name
        for d in t.deps:
            if d.holder != name:
                f = d.fetch
                if f > fetch:
                    fetch = f
        start += fetch
        t.on = w
        t.start = start
        stop = start + self.cost(t, w.spec) / w.speed
        bucket = self._at.get(stop)
        if bucket is None:
            self._at[stop] = bucket = []
            heapq.heappush(self._times, stop)
        bucket.append(t)

    def _forget(self, iteration: int) -> None:
        """Iteration ``iteration`` finished: drop what no later task reads (everything
        but its optimizer state and published weights), as Dask forgets released keys."""
        keep = (optimize_key(iteration), publish_key(iteration + 1))
        forgotten = self.policy.task_forgotten
        for t in self._by_iteration.pop(iteration, ()):
            key = t.key
            if key in keep:
                continue
            forgotten(key)
            t.deps = ()

    # -------------------------------------------------------------------- run

    def run(self, layout: GraphLayout, plans: Sequence[IterationPlan], *,
            window: int | None = None, max_time: float = float("inf")) -> SimResult:
        """Run ``plans`` (iterations 0..n-1) keeping ``window`` iterations beyond the
        oldest unfinished one submitted, as the driver does."""
        if window is None:
            window = self.policy.options.max_staleness + 1
        # The run allocates millions of small objects and frees none of them in cycles:
        # the cyclic collector's passes over them would cost a quarter of the run.
        with collector_off():
            try:
                return self._run(layout, plans, window, max_time)
            finally:
                # What the run made outlives it (the finished tasks): move it straight
                # to the oldest generation rather than have the next young collection
                # traverse millions of objects.
                gc.freeze()
                gc.unfreeze()

    def _run(self, layout: GraphLayout, plans: Sequence[IterationPlan], window: int,
             max_time: float) -> SimResult:
        self.add_nodes(init_nodes())
        source = IterationSource(layout, _Task)
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
        append = self.finished.append
        task_done = self.policy.done
        start_task, ready = self._start, self._ready
        queued_latency = self.queued_latency
        clock = self.clock
        while times:
            now = times[0]
            if now > max_time:
                break
            pop(times)
            clock.now = now
            bucket = at[now]
            # Tasks finishing at this instant, including any that start and end in it:
            # those are appended to the bucket while it is walked, and a list iterator
            # reaches what is appended to its list.
            for t in bucket:
                w = t.on
                name = w.name
                t.stop = now
                t.holder = name
                append(t)
                task_done(t, name, now - t.start)
                if t.gpu:
                    # The freed GPU takes the next task queued on the worker.
                    queue = w.queue
                    if queue:
                        start_task(queue.popleft(), w, now + queued_latency)
                    else:
                        w.running -= 1
                dependents = t.dependents
                if dependents:
                    t.dependents = ()   # (none are added to a finished task)
                    for dep in dependents:
                        n = dep.waiting - 1
                        dep.waiting = n
                        if n == 0:
                            ready(dep)
                if t.kind == STATS:
                    it = t.iteration
                    completed[it] = now
                    self._forget(it)
                    while next_done in completed:
                        next_done += 1
                    submit_upto(next_done + window + 1)
            del at[now]
            # Finish every event at this instant before deciding, as the plugin does.
            self._apply_decisions()
        images = plans[0].num_samples if plans else 0
        # Tasks left unfinished (a run cut at max_time) drop their links to one another.
        for t in self.tasks.values():
            t.dependents = ()
        return SimResult(self.finished, clock.now, completed, images,
                         [w.spec for w in self._workers.values()])
