"""Emulated GPUs: the real graph, scheduler and plugin; tasks that only wait.

Every task of the iteration DAG sleeps for its cost instead of computing (times the
profile's ``time_scale``): the cost model of :mod:`digenrl.sim.costs`, which the
simulator uses too -- the profile's seconds divided by the worker's declared ``speed``,
the all-reduce at the reduction root, nothing for a remote reward, and the extras a
worker pays as a real deployment would (a rollout worker's first read of a policy
version, the co-located phase switch).

A member of a context-parallel step's gang (a chunk the profile's ``context_parallel``
computes at a degree above 1: the graph's gangs, :func:`digenrl.sim.costs.planned`)
waits for the step's compute at that degree and its all-to-alls' network time.

A worker's tasks are slower by its injected factor (:mod:`digenrl.tasks.slowdown`) and
by the profile's ``slowdowns`` in force when they start (profile time since the run began).

Nothing here imports torch: dozens of emulated workers fit on one small machine.
"""

from __future__ import annotations

import threading
import time
from dataclasses import asdict, dataclass
from typing import Any

from digenrl.graph.dask_graph import IterationGraph, bind
from digenrl.graph.plan import IterationPlan
from digenrl.graph.structure import Node
from digenrl.schedulers.options import ScheduleOptions
from digenrl.sim.costs import Extras, TaskCosts, WorkerHeld, planned
from digenrl.sim.profile import Profile, Slowdown, slowdown_at
from digenrl.tasks import slowdown as injected
from digenrl.tasks.slowdown import set_slowdown
from digenrl.tasks.worker import current_worker
from digenrl.vocabulary import ROLLOUT, STATS

__all__ = ["EmulatedTask", "EmulatedWorkload", "run_emulated", "set_slowdown", "worker_held"]


@dataclass(frozen=True)
class EmulatedTask:
    """What one emulated task waits for (seconds on a speed-1 GPU, unscaled)."""

    kind: str
    seconds: float
    version: int
    time_scale: float
    extras: Extras = Extras()      # what the worker pays before it (the run's mode's)
    network: float = 0.0           # seconds on the network (a context-parallel step's)


@dataclass
class EmulatedOut:
    kind: str
    version: int


_HELD: dict[str, WorkerHeld] = {}
_SLOWDOWNS: list[tuple[Slowdown, ...]] = [()]   # the profile's, for the run
_LOCK = threading.Lock()
_EPOCH = [0.0]   # wall-clock start of the run: profile time 0


def worker_held(name: str) -> WorkerHeld:
    """What worker ``name`` holds that the extra costs depend on (this run)."""
    with _LOCK:
        return _HELD.setdefault(name, WorkerHeld())


def _this_worker() -> tuple[str, dict[str, float]]:
    w = current_worker()
    if w is None:
        return "local", {}
    return str(w.name), dict(w.state.total_resources)


def run_emulated(task: EmulatedTask, *inputs: Any) -> EmulatedOut:
    name, resources = _this_worker()
    held = worker_held(name)
    speed = float(resources.get("speed", 1.0))
    wait = task.seconds / speed * injected.slowdown(name)
    if _SLOWDOWNS[0]:
        now = (time.time() - _EPOCH[0]) / task.time_scale
        wait *= slowdown_at(_SLOWDOWNS[0], name, now)
    with _LOCK:
        wait += task.network + task.extras.pay(held, task.kind, task.version, resources.get(ROLLOUT, 0) > 0)
    time.sleep(wait * task.time_scale)
    return EmulatedOut(task.kind, task.version)


class EmulatedWorkload:
    """The iteration DAG of a profile, each task sleeping for its cost."""

    collected = (STATS,)

    def __init__(self, profile: Profile, options: ScheduleOptions, iterations: int, *,
                 time_scale: float | None = None, stale_groups: int | None = None):
        self.profile = profile
        self.options = options
        self.iterations = iterations
        self.time_scale = profile.time_scale if time_scale is None else time_scale
        self.layout = profile.layout(options.max_staleness, stale_groups)
        self.images_per_iteration = profile.images_per_iteration
        self.colocated = not options.pools
        profile.check_memory(colocated=self.colocated)
        self._plans = planned(profile, iterations)
        self.costs = TaskCosts(profile, self.layout, self._plans, colocated=self.colocated)
        self.extras = Extras.of(profile, colocated=self.colocated)
        self.chunking = None  # the profile's chunk size throughout

    def plan(self, iteration: int, chunk_size: int | None = None) -> IterationPlan:
        plan = self._plans[iteration]
        if chunk_size is None or chunk_size == self.profile.chunk_size:
            return plan
        return IterationPlan.uniform(iteration, plan.prompts, plan.samples_per_prompt, chunk_size)

    def _task(self, node: Node) -> EmulatedTask:
        meta = node.meta
        seconds, network = self.costs.task(node.op, meta.get("samples") or 0, node.key,
                                           meta["iteration"], meta.get("gang"))
        return EmulatedTask(kind=node.op, seconds=seconds, version=meta["policy_version"],
                            time_scale=self.time_scale, extras=self.extras, network=network)

    def bind(self, nodes, outputs) -> IterationGraph:
        return bind(nodes, lambda node: (run_emulated, (self._task(node),)), outputs)

    def check_resume(self, attrs: dict[str, Any]) -> None:
        raise ValueError("resume: emulated runs hold no trainer state to resume from")

    def attrs(self) -> dict[str, Any]:
        return {"workload": "emulated", "profile": asdict(self.profile),
                "time_scale": self.time_scale,
                "derived": {"images_per_iteration": self.images_per_iteration,
                            "gpu_seconds_per_iteration": self.profile.gpu_seconds_per_iteration()}}

    def prepare(self, client, store) -> None:
        client.run(_reset, time.time(), self.profile.slowdowns)

    def describe(self) -> list[str]:
        p = self.profile
        return [f"emulating {p.name}: {self.images_per_iteration} images per iteration, "
                f"{p.rollout_workers} rollout + {p.trainer_workers} trainer GPUs, "
                f"time scale {self.time_scale}"]

    def rows(self, i: int, plan: IterationPlan, values: dict) -> tuple[dict, dict[str, float]]:
        return {}, {}

    def finish(self, client, store, final_weights) -> None:
        return None


def _reset(epoch: float = 0.0, slowdowns: tuple[Slowdown, ...] = ()) -> None:
    """A new run: nothing held, no slowdown but the profile's ``slowdowns``."""
    with _LOCK:
        _HELD.clear()
        _EPOCH[0] = epoch
        _SLOWDOWNS[0] = tuple(slowdowns)
    injected.reset()
