"""What the scheduler plugin reports about a run: task records, the utilisation
timeline, staleness counts and the metrics the driver sends back.

The plugin (:mod:`digenrl.schedulers.plugin`) tells a :class:`Telemetry` when each task
became ready, was released and finished; the ``digenrl_tasks``, ``digenrl_timeline``
and ``digenrl_state`` handlers and the dashboard page read it. Nothing here takes or
changes a decision.
"""

from __future__ import annotations

import time
from collections import defaultdict, deque
from typing import Any

from digenrl.schedulers.policy import Decision, SchedulingPolicy
from digenrl.schedulers.policy.trail import trail_text
from digenrl.vocabulary import Key, GRAD

__all__ = ["Telemetry"]



class Telemetry:
    """One run's telemetry, kept on the scheduler."""

    def __init__(self, timeline_samples: int = 20_000, recent: int = 5_000) -> None:
        #: Finished tasks' records (:data:`digenrl.records.TASK_COLUMNS`), from index
        #: ``record_offset`` of the run's on: the driver's reads drop those before.
        self.records: list[dict[str, Any]] = []
        self.record_offset = 0
        #: When each task last became ready. A task whose inputs are lost with a worker
        #: goes back to waiting and becomes ready again once they are recomputed; the
        #: records report that last time, when it was actually runnable.
        self._ready_at: dict[Key, float] = {}
        self._decisions: dict[Key, Decision] = {}
        #: Samples of (time, policy version, per-pool busy/TAG workers, held tasks).
        self.timeline: deque[dict[str, Any]] = deque(maxlen=timeline_samples)
        self._last_sample = 0.0
        #: When the run began (what the dashboard's task stories count from).
        self.started = time.time()
        #: Samples trained so far by staleness (first trained timestep of each chunk).
        self.staleness_counts: dict[int, int] = defaultdict(int)
        #: Per-iteration metrics the driver reports (reward curve on the dashboard).
        self.metrics: list[dict[str, float]] = []
        #: The last ``recent`` finished tasks' records by key (as text), kept after the
        #: driver has read them: the dashboard tells their story.
        self.recent: dict[str, dict[str, Any]] = {}
        self._recent_limit = recent

    # ---------------------------------------------------------------- task events

    def ready(self, key: Key) -> None:
        self._ready_at[key] = time.time()

    def released(self, decision: Decision) -> None:
        self._decisions[decision.key] = decision

    def forget(self, key: Key) -> None:
        self._ready_at.pop(key, None)
        self._decisions.pop(key, None)

    def finished(self, key: Key, meta: dict[str, Any], policy: SchedulingPolicy,
                 worker_name: str, kwargs: dict[str, Any]) -> float | None:
        """Record a finished task (``kwargs``: those of the scheduler's transition to
        ``memory``); returns its compute seconds."""
        worker = kwargs.get("worker")
        start = stop = None
        fetch = 0.0
        fetch_start = fetch_stop = None
        for ss in kwargs.get("startstops") or ():
            if ss.get("action") == "compute":
                start, stop = ss["start"], ss["stop"]
            elif ss.get("action") == "transfer":
                fetch += ss["stop"] - ss["start"]
                fetch_start = ss["start"] if fetch_start is None else min(fetch_start, ss["start"])
                fetch_stop = ss["stop"] if fetch_stop is None else max(fetch_stop, ss["stop"])
        d = self._decisions.get(key)
        bv = meta.get("behaviour_version")
        ready = self._ready_at.get(key) or policy.ready_since(key) or 0.0
        if meta["kind"] == GRAD and meta.get("timestep") == 0 and bv is not None:
            self.staleness_counts[meta["policy_version"] - bv] += int(meta.get("samples") or 0)
        record = {
            "key": str(key),
            "kind": meta["kind"],
            "gpu": bool(meta.get("gpu")),
            "worker": worker,
            "worker_name": worker_name,
            "pool": (policy.pool_of(worker) or "") if worker is not None else "",
            "start": start,
            "stop": stop,
            "iteration": meta["iteration"],
            "policy_version": meta["policy_version"],
            "timestep": -1 if meta.get("timestep") is None else meta["timestep"],
            "chunk": -1 if meta.get("chunk") is None else meta["chunk"],
            "ready": ready,
            "eligible": max(policy.eligible_since(key) or 0.0, ready),
            "released": d.time if d is not None else 0.0,
            "finished": time.time(),
            "tag": bool(d.tag) if d is not None else False,
            "stolen": bool(d.stolen) if d is not None else False,
            "rat": bool(d.rat) if d is not None else False,
            "nbytes": int(kwargs.get("nbytes") or 0),
            # Dask attaches a fetch to one dependent of the fetched data (not
            # necessarily the task that waited for it), so the analysis attributes
            # fetches by time on the worker (digenrl.figures.analysis.dispatch_overhead).
            "transfer": fetch,
            "transfer_start": fetch_start,
            "transfer_stop": fetch_stop,
            "decisions": trail_text(policy.trail_of(key)),
        }
        self.records.append(record)
        recent = self.recent
        recent.pop(record["key"], None)
        recent[record["key"]] = record
        if len(recent) > self._recent_limit:
            del recent[next(iter(recent))]
        return stop - start if start is not None and stop is not None else None

    # ---------------------------------------------------------------- the timeline

    def sample(self, policy: SchedulingPolicy, every: float = 0.2) -> None:
        """Append a timeline sample: at most every ``every`` seconds, and always when a
        new policy version has been published."""
        now = time.time()
        last_version = self.timeline[-1]["policy_version"] if self.timeline else None
        if now - self._last_sample < every and policy.version == last_version:
            return
        self._last_sample = now
        snap = policy.snapshot()
        self.timeline.append({"time": now, "policy_version": snap["policy_version"],
                              "pools": snap["pools"], "held": snap["held"]})

    # ---------------------------------------------------------------- reading it

    def task_records(self, start: int = 0) -> dict[str, Any]:
        """Completed-task records from index ``start`` on (indices count from the run's
        beginning); records before ``start`` are dropped, so pass back ``next``."""
        drop = start - self.record_offset
        if drop > 0:
            del self.records[:drop]
            self.record_offset = start
        begin = max(0, start - self.record_offset)
        out = self.records[begin:]
        return {"records": out, "next": self.record_offset + begin + len(out)}

    @property
    def recorded(self) -> int:
        """How many tasks the run has recorded, dropped ones included."""
        return self.record_offset + len(self.records)

    def timeline_since(self, since: float = 0.0) -> list[dict[str, Any]]:
        """Utilisation samples after ``since`` (seconds since the epoch): per pool the
        workers with a GPU task in flight and those doing TAG work, the held tasks by
        reason, the newest policy version."""
        return [s for s in self.timeline if s["time"] > since]
