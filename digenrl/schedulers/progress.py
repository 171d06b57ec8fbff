"""The progress guard: the watchdog (:mod:`.watchdog`) and the stall check on Dask.

A scheduler plugin of its own, installed by :class:`.plugin.DigenRLSchedulerPlugin`
beside it. Every ``TICK`` seconds it feeds the watchdog what each worker reports
executing (heartbeats) and the run's processing tasks with the policy's expected
seconds, and takes back the tasks the watchdog names. Taking back goes through the
worker, as work stealing does: a ``steal-request`` asks the worker to drop the task, and
only when it answers that it had not started it (or never knew it) does the scheduler
reschedule it -- the plugin then parks it again and the policy decides it afresh.
(``Scheduler._reschedule`` alone is not enough: it assumes the worker has dropped the
task already -- which holds for an orphan, a task left processing on a worker the
scheduler has removed, taken back that way at once.) Every take-back is logged with the task, the worker and why, and counted
(``counters.watchdog_taken_back`` of ``digenrl_state``).

The stall check (``digenrl_stalled``): the driver asks it while it waits; once no GPU
task of the run has finished for the stall timeout and the watchdog has nothing left
to try, it answers with one line naming what the run waits for.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import defaultdict
from typing import TYPE_CHECKING, Any

from distributed.core import Status
from distributed.diagnostics.plugin import SchedulerPlugin
from distributed.stealing import _WORKER_STATE_CONFIRM, _WORKER_STATE_UNDEFINED
from tornado.ioloop import PeriodicCallback

from digenrl.schedulers.watchdog import GRACE_FLOOR, Processing, Watchdog, stall_timeout
from digenrl.vocabulary import Key

if TYPE_CHECKING:
    from distributed import Scheduler

__all__ = ["ProgressGuard", "TAKE_BACK"]

logger = logging.getLogger(__name__)

#: The stimulus of a take-back request (its answer is told apart from work stealing's).
TAKE_BACK = "digenrl-take-back"
#: What a worker answers when it has dropped the task, or never had it: the answers on
#: which work stealing moves a task too.
_DROPPED = _WORKER_STATE_CONFIRM | _WORKER_STATE_UNDEFINED
#: At most this many waited-for tasks are named in the stall line.
_NAMED = 6


class ProgressGuard(SchedulerPlugin):
    """Takes back tasks Dask lost track of; says when a run cannot progress."""

    name = "digenrl-progress"

    def __init__(self, plugin) -> None:
        self.plugin = plugin              # the DigenRLSchedulerPlugin it serves
        self.scheduler: Scheduler | None = None     # (set when it starts)
        self.enabled = True               # whether the watchdog takes tasks back
        self.watchdog = Watchdog()
        self.counters: dict[str, int] = defaultdict(int)
        self._run: str | None = None
        self._since: dict[Key, float] = {}            # processing key -> since when
        self._requests: dict[str, tuple[Key, str, float]] = {}  # stimulus -> ...
        self._progress = 0.0              # when a GPU task of the run last finished
        self._ids = itertools.count()
        self._stealing_response = None

    async def start(self, scheduler) -> None:
        self.scheduler = scheduler
        self._stealing_response = scheduler.stream_handlers.get("steal-response")
        scheduler.stream_handlers["steal-response"] = self._on_response
        scheduler.handlers["digenrl_stalled"] = self.stalled
        pc = PeriodicCallback(self.tick, self.TICK * 1000)
        old = scheduler.periodic_callbacks.get(self.name)
        if old is not None:
            old.stop()
        scheduler.periodic_callbacks[self.name] = pc
        pc.start()

    #: Seconds between two looks.
    TICK = 0.5

    # ------------------------------------------------------------------ events

    def transition(self, key, start, finish, *args, stimulus_id: str, **kwargs) -> None:
        if finish == "processing":
            self._since[key] = time.time()
        elif start == "processing":
            self._since.pop(key, None)
            meta = self.plugin._meta.get(key)
            if finish == "memory" and meta is not None and meta.get("gpu"):
                self._progress = time.time()

    def _new_run(self) -> None:
        """The plugin began another run: start its clocks afresh."""
        self._run = self.plugin.run
        self.counters.clear()
        self._requests.clear()
        self._progress = time.time()
        floor = (self.plugin.policy.options.stall_timeout or GRACE_FLOOR * 5) / 5
        self.watchdog = Watchdog(floor=min(GRACE_FLOOR, floor))

    # ---------------------------------------------------------------- watchdog

    def _look(self, now: float) -> list:
        """Feed the watchdog; the take-backs due now."""
        s, plugin = self.scheduler, self.plugin
        assert s is not None        # (it looks once started)
        self.watchdog.observe(now, {a: bool(ws.executing or ws.long_running)
                                    for a, ws in s.workers.items()})
        tasks = []
        for key, since in self._since.items():
            ts = s.tasks.get(key)
            if key not in plugin._meta or ts is None or ts.processing_on is None:
                continue
            tasks.append(Processing(key, ts.processing_on.address, since,
                                    plugin.policy.expected_seconds(key)))
        running = {a: ws.status == Status.running for a, ws in s.workers.items()}
        return self.watchdog.overdue(now, tasks, running)

    def tick(self) -> None:
        plugin = self.plugin
        if plugin.policy is None or not plugin.active:
            return
        if plugin.run != self._run:
            self._new_run()
        plugin.decide_when_due()
        now = time.time()
        # A request no answer came back to within the grace is given up (and may be
        # made again).
        for sid, (_, _, sent) in list(self._requests.items()):
            if now - sent > self.watchdog.floor:
                del self._requests[sid]
        if not self.enabled:
            return
        s = self.scheduler
        assert s is not None        # (it ticks once started)
        for address in [a for a in plugin.policy.workers if a not in s.workers]:
            # (Left behind like an orphan task: its removal never reached the policy.)
            logger.warning("watchdog: worker %s is gone; the policy no longer counts it",
                           address)
            plugin.remove_worker(s, address, stimulus_id=self._stimulus())
        asked = {(k, w) for k, w, _ in self._requests.values()}
        for t in self._look(now):
            if t.orphan:
                self._take_back(t.key, t.worker, t.why, self._stimulus())
                continue
            if (t.key, t.worker) in asked or t.worker not in s.stream_comms:
                continue
            sid = self._stimulus()
            self._requests[sid] = (t.key, t.worker, now)
            logger.warning("watchdog: asking worker %s to give back task %r: %s",
                           t.worker, t.key, t.why)
            s.stream_comms[t.worker].send(
                {"op": "steal-request", "key": t.key, "stimulus_id": sid})

    def _on_response(self, key=None, state=None, stimulus_id: str = "", worker=None,
                     **kw) -> None:
        request = self._requests.pop(stimulus_id, None)
        if request is None:
            if not stimulus_id.startswith(TAKE_BACK) and self._stealing_response is not None:
                self._stealing_response(key=key, state=state, stimulus_id=stimulus_id,
                                        worker=worker, **kw)
            return
        key, address, _ = request
        assert self.scheduler is not None   # (its requests are made once started)
        ts = self.scheduler.tasks.get(key)
        if ts is None or ts.processing_on is None or ts.processing_on.address != address:
            return  # it finished, or went elsewhere, meanwhile
        if state not in _DROPPED:
            logger.info("watchdog: worker %s holds task %r as %r: left there", address,
                        key, state)
            self.counters["watchdog_declined"] += 1
            return
        self._take_back(key, address, f"it held it as {state!r}", stimulus_id)

    def _stimulus(self) -> str:
        """A new take-back's stimulus id (its answer is told apart from work stealing's)."""
        return f"{TAKE_BACK}-{next(self._ids)}"

    def _take_back(self, key, address: str, why: str, stimulus_id: str) -> None:
        """Reschedule ``key``, which ``address`` has dropped or will never run: the
        plugin parks it again and the policy decides it afresh."""
        logger.warning("watchdog: took task %r back from worker %s (%s); the policy "
                       "decides it again", key, address, why)
        self.counters["watchdog_taken_back"] += 1
        assert self.scheduler is not None   # (it takes back once started)
        self.scheduler._reschedule(key, address, stimulus_id=stimulus_id)

    # ------------------------------------------------------------------- stall

    def stalled(self, run: str | None = None) -> str | None:
        """None while the run progresses, or while the watchdog still has something
        to try; else one line naming what the run waits for."""
        plugin, s = self.plugin, self.scheduler
        if plugin.policy is None or not plugin.active or (run is not None and run != plugin.run):
            return None
        assert s is not None        # (asked once started)
        if plugin.run != self._run:
            self._new_run()
        now = time.time()
        timeout = stall_timeout(plugin.policy.options.stall_timeout,
                                plugin.policy.longest_expected())
        idle = now - self._progress
        if idle <= timeout or self._requests or (self.enabled and self._look(now)):
            return None
        waiting: dict[str, list[str]] = defaultdict(list)
        for key in plugin._meta:
            ts = s.tasks.get(key)
            if ts is not None and ts.state in ("processing", "no-worker"):
                waiting[ts.state].append(self._describe(ts))
        n = sum(len(v) for v in waiting.values())
        named = [d for state in ("processing", "no-worker") for d in waiting[state]][:_NAMED]
        more = f" and {n - len(named)} more" if n > len(named) else ""
        workers = ", ".join(f"{ws.name} {ws.status.name}" for ws in
                            sorted(s.workers.values(), key=lambda ws: str(ws.name)))
        what = "; ".join(named) + more if named else "nothing runnable"
        return (f"no GPU task finished for {idle:.0f} s (stall timeout {timeout:.0f} s) "
                f"and the watchdog has nothing left to try; waiting for: {what}; "
                f"workers: {workers or 'none'}")

    def _describe(self, ts) -> str:
        if ts.state == "no-worker":
            return f"{ts.key!r} ready, not released to any worker"
        ws = ts.processing_on
        doing = len(ws.executing) + len(ws.long_running)
        return (f"{ts.key!r} processing on {ws.name} ({ws.status.name}, executing "
                f"{doing} task{'s' if doing != 1 else ''})")

    def state(self) -> dict[str, Any]:
        return dict(self.counters)
