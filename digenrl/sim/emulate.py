"""Emulated GPUs: the real graph, scheduler and plugin; tasks that only wait.

Every task of the iteration DAG sleeps for its cost from a :class:`Profile` (times the
profile's ``time_scale``, divided by the worker's declared ``speed``) instead of
computing. On top of that a worker pays, as a real deployment would:

* on a rollout worker, the first task that reads a new policy version waits for the
  weights to arrive (``weight_bytes / bandwidth``);
* in the co-located mode, each switch between rollout and training work costs
  ``colocated.phase_switch`` (weights and optimizer state offloaded and reloaded), and
  each micro-step one more forward (the old log-prob recomputed), if the profile says so;
* the gradient all-reduce among the trainers, once per iteration, at the reduction root.

A worker's tasks are slower by its injected factor (:mod:`digenrl.tasks.slowdown`) and
by the profile's ``slowdowns`` in force when they start (profile time since the run began).

Nothing here imports torch: dozens of emulated workers fit on one small machine.
"""

from __future__ import annotations

import threading
import time
from dataclasses import asdict, dataclass
from typing import Any, Hashable

from digenrl.graph.dask_graph import IterationGraph, bind
from digenrl.graph.plan import IterationPlan
from digenrl.graph.structure import Node
from digenrl.schedulers.options import ScheduleOptions
from digenrl.sim.profile import Profile
from digenrl.tasks import slowdown as injected
from digenrl.tasks.slowdown import set_slowdown
from digenrl.vocabulary import OPTIMIZE, REWARD, ROLLOUT, ROLLOUT_KINDS, STATS, TRAINING_KINDS

__all__ = ["EmulatedTask", "EmulatedWorkload", "run_emulated", "set_slowdown", "worker_state"]

Key = Hashable


@dataclass(frozen=True)
class EmulatedTask:
    """What one emulated task waits for (seconds on a speed-1 GPU, unscaled)."""

    kind: str
    seconds: float
    version: int
    time_scale: float
    sync_seconds: float = 0.0      # weights of a new version reaching a rollout worker
    switch_seconds: float = 0.0    # co-located phase switch


@dataclass
class EmulatedOut:
    kind: str
    version: int


_STATE: dict[str, dict[str, Any]] = {}
_LOCK = threading.Lock()
_EPOCH = [0.0]   # wall-clock start of the run: profile time 0


def worker_state(name: str) -> dict[str, Any]:
    """Per-worker emulation state: versions held, last phase, scheduled slowdowns."""
    with _LOCK:
        return _STATE.setdefault(name, {"versions": set(), "phase": None, "windows": ()})


def _this_worker() -> tuple[str, dict[str, float]]:
    try:
        from distributed import get_worker

        w = get_worker()
        return str(w.name), dict(w.state.total_resources)
    except ValueError:
        return "local", {}


def run_emulated(task: EmulatedTask, *inputs: Any) -> EmulatedOut:
    name, resources = _this_worker()
    state = worker_state(name)
    speed = float(resources.get("speed", 1.0))
    wait = task.seconds / speed * injected.slowdown(name)
    if state["windows"]:
        now = (time.time() - _EPOCH[0]) / task.time_scale
        for factor, start, stop in state["windows"]:
            if start <= now < stop:
                wait *= factor
    if task.sync_seconds and resources.get(ROLLOUT, 0) > 0 and task.kind in ROLLOUT_KINDS:
        with _LOCK:
            fresh = task.version not in state["versions"]
            state["versions"].add(task.version)
        if fresh:
            wait += task.sync_seconds
    if task.switch_seconds:
        phase = "rollout" if task.kind in ROLLOUT_KINDS else "train" if task.kind in TRAINING_KINDS else None
        if phase is not None:
            with _LOCK:
                switched = state["phase"] is not None and state["phase"] != phase
                state["phase"] = phase
            if switched:
                wait += task.switch_seconds
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
        self._plans = profile.plans(iterations)
        self.chunking = None  # the profile's chunk size throughout

    def plan(self, iteration: int, chunk_size: int | None = None) -> IterationPlan:
        plan = self._plans[iteration]
        if chunk_size is None or chunk_size == self.profile.chunk_size:
            return plan
        return IterationPlan.uniform(iteration, plan.prompts, plan.samples_per_prompt, chunk_size)

    def _task(self, node: Node, root_reduce: Key | None) -> EmulatedTask:
        p = self.profile
        kind = node.op
        seconds = p.task_seconds(kind, node.meta.get("samples") or 0, colocated=self.colocated)
        if kind == REWARD and p.costs.reward_on == "remote":
            seconds = 0.0
        if node.key == root_reduce:
            seconds = p.allreduce_seconds()
        return EmulatedTask(
            kind=kind, seconds=seconds, version=node.meta["policy_version"],
            time_scale=self.time_scale,
            sync_seconds=0.0 if self.colocated else p.weight_sync_seconds(),
            switch_seconds=p.colocated.phase_switch if self.colocated else 0.0)

    def bind(self, nodes, outputs) -> IterationGraph:
        root = next((n.deps[1] for n in nodes if n.op == OPTIMIZE), None)
        return bind(nodes, lambda node: (run_emulated, (self._task(node, root),)), outputs)

    def check_resume(self, attrs: dict[str, Any]) -> None:
        raise ValueError("resume: emulated runs hold no trainer state to resume from")

    def attrs(self) -> dict[str, Any]:
        return {"workload": "emulated", "profile": asdict(self.profile),
                "time_scale": self.time_scale,
                "derived": {"images_per_iteration": self.images_per_iteration,
                            "gpu_seconds_per_iteration": self.profile.gpu_seconds_per_iteration()}}

    def prepare(self, client, store) -> None:
        windows: dict[str, list] = {}
        for s in self.profile.slowdowns:
            windows.setdefault(s.worker, []).append((s.factor, s.start, s.stop))
        client.run(_reset, time.time(), windows)

    def describe(self) -> list[str]:
        p = self.profile
        return [f"emulating {p.name}: {self.images_per_iteration} images per iteration, "
                f"{p.rollout_workers} rollout + {p.trainer_workers} trainer GPUs, "
                f"time scale {self.time_scale}"]

    def rows(self, i: int, plan: IterationPlan, values: dict) -> tuple[dict, dict[str, float]]:
        return {}, {}

    def finish(self, client, store, final_weights) -> None:
        return None


def _reset(epoch: float = 0.0, windows: dict[str, list] | None = None) -> None:
    """A new run: nothing held, no slowdown but the profile's ``windows`` by worker."""
    with _LOCK:
        _STATE.clear()
        _EPOCH[0] = epoch
        for name, w in (windows or {}).items():
            _STATE[name] = {"versions": set(), "phase": None, "windows": tuple(w)}
    injected.reset()
