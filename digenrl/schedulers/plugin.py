"""The Dask scheduler plugin: a thin adapter between Dask and :mod:`.policy`.

Mechanism (a pull model). Every task carrying the ``digenrl`` annotation is *parked*
when it enters the scheduler: its worker restriction names an address no worker has, so
when its inputs are ready Dask moves it to ``no-worker`` instead of sending it anywhere.
The plugin reports that to the policy; whenever the policy decides to release a task to
a worker, the plugin sets the task's restriction to that one worker and transitions it
to ``processing`` -- Dask then sends it there as usual. Every decision (pool, TAG,
priority, staleness) is therefore taken by the policy at the last moment, and a task
never waits on a worker it should not run on.

Dask behaviours relied on (each is checked by ``tests/schedulers/test_dask_contract.py``):

1. A task whose worker restrictions name no connected worker goes to ``no-worker`` and
   stays there, also when new workers join.
2. Changing ``TaskState.worker_restrictions`` of a ``no-worker`` task and recommending
   ``processing`` sends it to the named worker.
3. ``SchedulerPlugin.update_graph`` runs before the new tasks are first transitioned,
   so restrictions set there apply from the start.
4. Tasks restricted to a single worker are never moved by work stealing, and restricted
   tasks bypass scheduler-side queuing.
5. ``distributed.scheduler.no-workers-timeout`` is unset, so parked tasks never time out.
6. Per-key layer annotations reach the plugin's ``update_graph`` as ``annotations``.

(7 to 9, what the progress watchdog and the hand-off rely on: docs/scheduling.md.)

10. The scheduler's batched stream to each worker (``Scheduler.stream_comms[address]``,
    a ``BatchedSend``) exists when ``add_worker`` runs, and its ``interval`` is the
    least time between two of its sends (see :data:`WORKER_SEND_INTERVAL`).
11. A worker registers before it runs: plugins hear ``add_worker`` while its status is
    ``init`` and it is not among ``Scheduler.running``, where Dask sends no task (one
    released to it stays ``no-worker``). Its change to ``running`` is logged as a
    ``worker-status-change`` event under its address, which plugins hear in
    ``log_event``. So the policy is told of a worker only once it runs: a gang whose
    members went to a worker still starting would have one member sent and the other
    refused, and failed at once, round after round, until the worker ran.
12. A task taken back while it runs and sent to the same worker again before its
    execution ended is resumed there, but its outcome carries the run id the execution
    began with, which the scheduler refuses as stale: the task is released (heard here
    as ``processing`` -> ``released``, a loss) and sent anew.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from typing import TYPE_CHECKING, Any

from distributed.core import Status
from distributed.diagnostics.plugin import SchedulerPlugin
from distributed.protocol import pickle

from digenrl.process import freeze_collector
from digenrl.schedulers.options import ScheduleOptions
from digenrl.schedulers.policy import Decision, SchedulingPolicy, TaskInfo
from digenrl.schedulers.policy.rules.gang import Gang
from digenrl.schedulers.progress import ProgressGuard
from digenrl.schedulers.telemetry import Telemetry
from digenrl.vocabulary import ANNOTATION, CONTEXT_METADATA, POOLS, Key

if TYPE_CHECKING:
    from dask.typing import Key as DaskKey
    from distributed import Scheduler
    from distributed.scheduler import TaskStateState

__all__ = ["DigenRLSchedulerPlugin", "PARKED", "PLUGIN_NAME", "ANNOTATION",
           "StalenessBoundError", "pool_from_resources", "WORKER_SEND_INTERVAL"]

logger = logging.getLogger(__name__)

PLUGIN_NAME = "digenrl"
#: The restriction of a parked task: an address no worker can ever have.
PARKED = "tcp://digenrl-parked.invalid:9"


#: Seconds between two batches of the scheduler's messages to a worker (Dask's default:
#: 5 ms; a worker's to the scheduler: 2 ms). A task the policy releases goes out in a
#: loop iteration after the one that handled what made it ready, where Dask would have
#: sent it with that iteration's other messages; with 5 ms it then often waits for the
#: stream's next send: each hop of a dependent chain took 1.29x a plain Dask task's
#: (8.29 against 6.40 ms), with 2 ms 1.03x (``python workflows/microbench.py dispatch``).
WORKER_SEND_INTERVAL = 0.002


class StalenessBoundError(ValueError):
    """A task would train samples older than ``max_staleness`` allows."""


def pool_from_resources(resources: dict[str, float]) -> str | None:
    """A worker's pool: the pool-named resource it advertises (``rollout=1``)."""
    tags = [p for p in POOLS if resources.get(p, 0) > 0]
    return tags[0] if len(tags) == 1 else None


def _gang_of(d: Decision) -> int | None:
    """The gang of a released task, None when it is in none."""
    return d.info.gang[0] if d.info is not None and d.info.gang is not None else None


class DigenRLSchedulerPlugin(SchedulerPlugin):
    """Pools, pipelining, TAG and the staleness bound for tasks annotated ``digenrl``.

    Registered by ``digenrl run`` (``client.register_plugin``) or installed at scheduler
    start with ``dask scheduler --preload digenrl.schedulers.preload``. Each run calls
    the ``digenrl_begin_run`` handler with its schedule options; its :class:`Telemetry`
    is served by ``digenrl_state``, ``digenrl_tasks`` and ``digenrl_timeline``.
    """

    name = PLUGIN_NAME
    idempotent = True

    def __init__(self) -> None:
        self.scheduler: Scheduler | None = None     # (set when it starts)
        self.run: str | None = None      # the run being scheduled, or the last one
        self.active = False              # between digenrl_begin_run and digenrl_end_run
        self.policy: SchedulingPolicy | None = None
        self.telemetry = Telemetry()
        self._flush_pending = False
        self._meta: dict[Key, dict[str, Any]] = {}
        self._to_err: dict[Key, str] = {}
        self.warnings: list[str] = []

    # ------------------------------------------------------------------ lifecycle

    async def start(self, scheduler) -> None:
        from digenrl.schedulers import dashboard
        from digenrl.schedulers.palette import use_kind_colours

        self.scheduler = scheduler
        for address in scheduler.workers:   # (those that joined before this plugin)
            self._tune_stream(address)
        scheduler.handlers.update({
            "digenrl_begin_run": self.begin_run,
            "digenrl_end_run": self.end_run,
            "digenrl_state": self.state,
            "digenrl_tasks": self.task_records,
            "digenrl_timeline": self.timeline_since,
            "digenrl_metrics": self.report_metrics,
            "digenrl_gang_failed": self.gang_failed,
            "digenrl_gang_rerun": self.gang_rerun,
        })
        use_kind_colours()
        # The progress watchdog and the stall check (digenrl.schedulers.progress).
        self.progress = ProgressGuard(self)
        scheduler.add_plugin(self.progress)
        await self.progress.start(scheduler)
        try:
            dashboard.install(scheduler, self.name)
        except Exception:  # the page is a convenience; scheduling never depends on it
            logger.exception("could not add the digenrl page to the dashboard")

    def begin_run(self, run: str, options: dict[str, Any]) -> dict[str, Any]:
        """Start scheduling a run: a fresh policy over the workers present now."""
        if self.active and self.run != run and self._live_tasks():
            raise RuntimeError(f"run {self.run!r} is still active on this scheduler; "
                               "digenrl schedules one run at a time")
        self.run = run
        self.active = True
        self.policy = SchedulingPolicy(ScheduleOptions.from_dict(options))
        self._gang().handing = True
        self.telemetry = Telemetry()
        self._meta.clear()
        self._to_err.clear()
        self.warnings = []
        assert self.scheduler is not None    # (set when it starts)
        self.scheduler.task_metadata.pop(CONTEXT_METADATA, None)
        for addr in list(self.scheduler.workers):
            self._add_worker(addr)
        # What the scheduler's process holds now (the driver's too, on a local cluster)
        # stays out of the collector's full passes, which would pause dispatch.
        freeze_collector()
        return self.state()

    def end_run(self, run: str) -> int:
        """The run is over (finished, or stopped on an error). Returns how many of its
        tasks the scheduler still holds (a driver that stopped waits for none)."""
        if self.run == run:
            self.active = False
        assert self.scheduler is not None    # (set when it starts)
        return sum(key in self.scheduler.tasks for key in self._meta)

    def _live_tasks(self) -> bool:
        assert self.scheduler is not None    # (set when it starts)
        return any(k in self.scheduler.tasks for k in self._meta)

    # -------------------------------------------------------------------- workers

    def _add_worker(self, address: str) -> None:
        """Tell the policy of worker ``address`` once Dask runs tasks on it (a worker
        joins before it runs: contract 11), and once only."""
        assert self.scheduler is not None    # (set when it starts)
        ws = self.scheduler.workers.get(address)
        if ws is None or self.policy is None or ws.status != Status.running \
                or address in self.policy.workers:
            return
        resources = dict(ws.resources or {})
        pool = pool_from_resources(resources)
        if self.policy.options.pools and pool is None:
            msg = (f"worker {ws.name} ({address}) has no pool tag; start it with "
                   f"--resources 'GPU=1,rollout=1' or 'GPU=1,trainer=1' to use it")
            logger.warning(msg)
            self.warnings.append(msg)
        self.policy.add_worker(address, str(ws.name), pool, int(resources.get("GPU", 0)),
                               float(resources.get("speed", 1.0)))

    def add_worker(self, scheduler, worker: str) -> None:
        self._tune_stream(worker)
        self._add_worker(worker)
        self._schedule_flush()

    def log_event(self, topic, msg) -> None:
        """A worker that joined before it ran is now running (contract 11): the policy
        may release work to it."""
        if isinstance(msg, dict) and msg.get("action") == "worker-status-change" \
                and msg.get("status") == "running" and isinstance(topic, str):
            self._add_worker(topic)
            self._schedule_flush()

    def _tune_stream(self, address: str) -> None:
        """The scheduler's messages to worker ``address`` go out at most
        :data:`WORKER_SEND_INTERVAL` apart."""
        assert self.scheduler is not None    # (set when it starts)
        stream = self.scheduler.stream_comms.get(address)
        if stream is not None:
            stream.interval = WORKER_SEND_INTERVAL

    def remove_worker(self, scheduler, worker: str, *, stimulus_id: str, **kw) -> None:
        if self.policy is not None:
            self.policy.remove_worker(worker)
            self._schedule_flush()

    # ---------------------------------------------------------------------- tasks

    def update_graph(self, scheduler, *, keys, tasks, annotations, **kwargs) -> None:
        meta = annotations.get(ANNOTATION)
        if not meta:
            return
        if self.policy is None:
            logger.error("digenrl tasks arrived but no run has begun (call "
                         "digenrl_begin_run first); %d tasks stay parked", len(meta))
        infos = []
        for key, m in meta.items():
            ts = scheduler.tasks.get(key)
            if ts is None or ts.state not in ("released", "waiting"):
                continue
            ts.worker_restrictions = {PARKED}
            ts.host_restrictions = None
            ts.loose_restrictions = False
            self._meta[key] = m
            infos.append(TaskInfo.from_meta(key, m))
        if self.policy is not None:
            self._to_err.update(self.policy.add_tasks(infos))

    def transition(self, key, start, finish, *args, stimulus_id: str, **kwargs) -> None:
        meta = self._meta.get(key)
        if meta is None or self.policy is None:
            return
        if finish == "no-worker":
            if key in self._to_err:
                self._schedule_flush()
                return
            self.telemetry.ready(key)
            self.policy.task_ready(key, self._locality(key))
            self._schedule_flush()
        elif start == "processing":
            if finish == "memory":
                worker: str = kwargs["worker"]    # (Dask's processing -> memory has one)
                assert self.scheduler is not None    # (set when it starts)
                ws = self.scheduler.workers.get(worker)
                duration = self.telemetry.finished(
                    key, meta, self.policy, str(ws.name) if ws is not None else worker, kwargs)
                self.policy.task_done(key, worker, duration)
            elif finish == "erred":
                self.policy.task_failed(key)
            else:
                self.policy.task_lost(key)
                self._park(key)
            self._schedule_flush()
        elif finish in ("released", "waiting"):
            self._park(key)
            if start == "no-worker":
                self.policy.task_lost(key)
        elif finish == "forgotten":
            self.policy.task_forgotten(key)
            self._meta.pop(key, None)
            self._to_err.pop(key, None)
            self.telemetry.forget(key)

    def _park(self, key) -> None:
        assert self.scheduler is not None    # (set when it starts)
        ts = self.scheduler.tasks.get(key)
        if ts is not None:
            ts.worker_restrictions = {PARKED}

    def _locality(self, key) -> dict[str, int]:
        assert self.scheduler is not None    # (set when it starts)
        ts = self.scheduler.tasks[key]
        loc: dict[str, int] = defaultdict(int)
        for dts in ts.dependencies:
            for ws in dts.who_has or ():
                loc[ws.address] += dts.nbytes
        return loc

    # ----------------------------------------------------------------- decisions

    def _schedule_flush(self) -> None:
        if not self._flush_pending and self.scheduler is not None:
            self._flush_pending = True
            self.scheduler.loop.add_callback(self._flush)

    def _flush(self) -> None:
        self._flush_pending = False
        if self.policy is None:
            return
        s = self.scheduler
        assert s is not None    # (set when it starts)
        stimulus_id = f"digenrl-release-{time.time()}"
        for key in [k for k in self._to_err if k in s.tasks and s.tasks[k].state == "no-worker"]:
            exc = StalenessBoundError(self._to_err.pop(key))
            recs = s.transition(key, "erred", exception=pickle.dumps(exc), cause=key,
                                stimulus_id=stimulus_id)
            s.transitions(recs, stimulus_id)
        releases: dict[DaskKey, TaskStateState] = {}
        decisions = self.policy.decide()
        # A release Dask would not apply (the task is no longer waiting for one, its
        # worker left or does not run tasks now) is not applied, nor are the releases of
        # the other members of its gang this round: a gang starts whole or not at all.
        refused = {d.key for d in decisions if not self._applicable(d.key, d.worker)}
        gangs = {_gang_of(d) for d in decisions if d.key in refused} - {None}
        failed: list[Key] = []
        released: list[Key] = []
        for d in decisions:
            if d.key in refused or _gang_of(d) in gangs:
                failed.append(d.key)
                continue
            s.tasks[d.key].worker_restrictions = {d.worker}
            releases[d.key] = "processing"
            released.append(d.key)
            self.telemetry.released(d)
        self._hand_formations()
        if releases:
            s.transitions(releases, stimulus_id)
        for key in released:
            ts = s.tasks.get(key)
            if ts is not None and ts.state == "no-worker":
                ts.worker_restrictions = {PARKED}
                failed.append(key)
        self.policy.release_failed(failed)
        # Releases (or results) the policy took back: each goes back to waiting, and is
        # reported ready again once its inputs exist. A result that nothing waits for
        # any more (a gang member whose dependents hold theirs, while its lost partner's
        # must be computed again) is left released by Dask: it is sent to waiting, since
        # the policy took it back to run again (its gang runs together).
        back: dict[DaskKey, TaskStateState] = {
            key: "released" for key in self.policy.take_withdrawn()
            if key in s.tasks and s.tasks[key].state in ("processing", "memory")}
        if back:
            s.transitions(back, stimulus_id)
            again: dict[DaskKey, TaskStateState] = {
                key: "waiting" for key in back
                if key in s.tasks and s.tasks[key].state == "released"}
            if again:
                s.transitions(again, stimulus_id)
        for key, address in self.policy.take_copies():
            ts, ws = s.tasks.get(key), s.workers.get(address)
            if ts is not None and ts.state == "memory" and ws is not None \
                    and ws not in (ts.who_has or ()):
                s.request_acquire_replicas(address, [key], stimulus_id=stimulus_id)
        self.telemetry.sample(self.policy)

    def _applicable(self, key: Key, address: str) -> bool:
        """Whether Dask sends task ``key`` to worker ``address`` when told to."""
        assert self.scheduler is not None    # (set when it starts)
        ts = self.scheduler.tasks.get(key)
        ws = self.scheduler.workers.get(address)
        return ts is not None and ts.state == "no-worker" and ws is not None \
            and ws in self.scheduler.running

    def decide_when_due(self) -> None:
        """Run a decision round once the policy's deadline has passed
        (:meth:`SchedulingPolicy.deadline`; the progress guard calls this at each tick):
        a wait a rule measures ends with no event."""
        if self.policy is None:
            return
        due = self.policy.deadline()
        if due is not None and due <= self.policy.clock():
            self._schedule_flush()

    def _gang(self) -> Gang:
        assert self.policy is not None      # (set by begin_run)
        gang = self.policy.rule(Gang)
        assert isinstance(gang, Gang)
        return gang

    def _hand_formations(self) -> None:
        """Each placed gang released this round: its members' worker names and its
        count of failed steps before it, where its members read them
        (:data:`~digenrl.vocabulary.CONTEXT_METADATA`); ended gangs' entries go."""
        s = self.scheduler
        assert s is not None    # (set when it starts)
        formed, ended = self._gang().take_formations()
        if not formed and not ended:
            return
        entries = s.task_metadata.setdefault(CONTEXT_METADATA, {})
        for gid in ended:
            entries.pop(str(gid), None)
        for gid, addresses, failed in formed:
            names = [str(s.workers[a].name) for a in addresses]
            entries[str(gid)] = {"workers": names, "failed": failed}
            if len(set(names)) < len(names):
                logger.warning("context-parallel gang %d of %d members runs at degree %d "
                               "on %s: its pool had fewer workers than members for "
                               "schedule.context_parallel_wait seconds", gid, len(names),
                               len(set(names)), ", ".join(dict.fromkeys(names)))

    # ----------------------------------------------------------------- telemetry

    def task_records(self, start: int = 0) -> dict[str, Any]:
        """The ``digenrl_tasks`` handler: :meth:`Telemetry.task_records`."""
        return self.telemetry.task_records(start)

    def report_metrics(self, run: str, iteration: int, metrics: dict[str, float]) -> None:
        """The driver reports an iteration's metrics (for the dashboard's reward curve)."""
        if run == self.run:
            self.telemetry.metrics.append({"iteration": iteration, **metrics})

    def timeline_since(self, since: float = 0.0) -> list[dict[str, Any]]:
        """The ``digenrl_timeline`` handler: :meth:`Telemetry.timeline_since`."""
        return self.telemetry.timeline_since(since)

    def gang_failed(self, run: str) -> str | None:
        """The first failed gang step of ``run`` (one line), or None."""
        if self.policy is None or run != self.run:
            return None
        gang = self._gang()
        return gang.failed[0] if gang.failed else None

    def gang_rerun(self, gang: int, failed: int) -> bool:
        """The ``digenrl_gang_rerun`` handler: :meth:`Gang.rerun` (a member's word that
        its group failed with nothing lost), the members taken back at once."""
        if self.policy is None or not self._gang().rerun(int(gang), int(failed)):
            return False
        self._schedule_flush()
        return True

    def state(self) -> dict[str, Any]:
        snap = self.policy.snapshot() if self.policy is not None else {}
        if self.policy is not None:
            snap["counters"].update(self.progress.state())
        snap.update({"run": self.run, "active": self.active, "warnings": list(self.warnings),
                     "records": self.telemetry.recorded})
        return snap
