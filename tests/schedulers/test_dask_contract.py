"""The Dask behaviours the scheduler plugin relies on (see digenrl.schedulers.plugin).

Each test fails if a Dask upgrade changes the behaviour it names. They run a whole
cluster in one event loop with the scheduler's state validation switched on.
"""

from __future__ import annotations

import dask
import pytest
from dask._task_spec import Task
from dask.highlevelgraph import HighLevelGraph, MaterializedLayer
from distributed import Event, Worker
from distributed.core import Status
from distributed.diagnostics.plugin import SchedulerPlugin
from distributed.utils_test import async_poll_for, inc, slowinc
from distributed.worker_state_machine import (ComputeTaskEvent, FreeKeysEvent,
                                              GatherDepNetworkFailureEvent,
                                              RemoveWorkerEvent, StealRequestEvent,
                                              StealResponseMsg, WorkerState)

from digenrl.schedulers.plugin import PARKED

from inprocess import pooled_cluster
from plugin_helpers import wait_for_event

NTHREADS = [("127.0.0.1", 1), ("127.0.0.1", 1)]


class Parker(SchedulerPlugin):
    name = "parker"

    def __init__(self):
        self.first_transition = {}

    def update_graph(self, scheduler, *, tasks, annotations, **kw):
        for key in annotations.get("park", {}):
            scheduler.tasks[key].worker_restrictions = {PARKED}

    def transition(self, key, start, finish, *args, **kwargs):
        self.first_transition.setdefault(key, (start, finish))


async def submit_parked(c, s, key, func=inc, arg=1):
    """Submit ``func(arg)``, which a plugin parks in update_graph, as the digenrl plugin
    does."""
    s.add_plugin(Parker())
    with dask.annotate(park=True):
        f = c.submit(func, arg, key=key)
    await async_poll_for(lambda: key in s.tasks and s.tasks[key].state == "no-worker",
                         timeout=20)
    return f


@pooled_cluster(NTHREADS)
async def test_1_unreachable_restrictions_park_a_task_even_when_workers_join(c, s, a, b):
    f = await submit_parked(c, s, "parked")
    async with Worker(s.address, nthreads=1):
        await async_poll_for(lambda: len(s.workers) == 3, timeout=20)
        assert s.tasks["parked"].state == "no-worker"
    assert s.validate
    del f


@pooled_cluster(NTHREADS)
async def test_2_new_restriction_plus_processing_sends_it_there(c, s, a, b):
    f = await submit_parked(c, s, "parked")
    s.tasks["parked"].worker_restrictions = {b.address}
    s.transitions({"parked": "processing"}, stimulus_id="test-release")
    assert await f == 2
    assert s.tasks["parked"].who_has == {s.workers[b.address]}


@pooled_cluster(NTHREADS)
async def test_3_and_6_update_graph_sees_per_key_annotations_before_any_transition(c, s, a, b):
    plugin = Parker()
    s.add_plugin(plugin)
    dsk = {("x", 0): Task(("x", 0), inc, 1), ("x", 1): Task(("x", 1), inc, 2)}
    hlg = HighLevelGraph({"x": MaterializedLayer(dsk, annotations={
        "park": {("x", 0): True}.get})}, {"x": set()})
    futs = c.get(hlg, list(dsk), sync=False)
    assert await futs[1] == 3
    await async_poll_for(lambda: s.tasks[("x", 0)].state == "no-worker", timeout=20)
    assert s.tasks[("x", 0)].annotations == {"park": True}
    assert plugin.first_transition[("x", 0)] == ("released", "waiting")
    assert not any(start == "processing" for start, _ in [plugin.first_transition[("x", 0)]])
    del futs


@pooled_cluster(NTHREADS,
               config={"distributed.scheduler.work-stealing-interval": "10ms"})
async def test_4_stealing_never_moves_a_task_restricted_to_one_worker(c, s, a, b):
    assert "stealing" in s.extensions
    futs = c.map(slowinc, range(20), delay=0.05, workers=[a.address])
    await c.gather(futs)
    assert all(s.tasks[f.key].who_has == {s.workers[a.address]} for f in futs)


@pooled_cluster(NTHREADS)
async def test_4_restricted_tasks_bypass_queuing(c, s, a, b):
    futs = c.map(inc, range(50), workers=[a.address, b.address])
    await async_poll_for(lambda: all(f.key in s.tasks for f in futs), timeout=20)
    assert not s.queued
    await c.gather(futs)


def test_5_no_workers_timeout_is_unset():
    assert dask.config.get("distributed.scheduler.no-workers-timeout") is None


@pytest.mark.parametrize("step, noise", [(2, 1), (1, 2)], ids=["step-first", "input-first"])
def test_8_a_failed_gather_strands_an_input_when_it_is_handled_after_its_resumed_task(
        step, noise):
    """Dask's lost-fetch race on a worker's state machine alone (the live cluster:
    tests/schedulers/test_progress.py). Integer keys fix the order of a gather's key
    set: {1, 2} lists 1 first, and the worker handles a failed gather's keys from the
    last of that set to the first."""
    dead, spare = "127.0.0.1:2", "127.0.0.1:3"
    ws = WorkerState(address="127.0.0.1:1", validate=True, threads={})
    # A micro-step needs the step and its input, both on a worker that then dies: the
    # scheduler frees the micro-step (the fetch is cancelled) and says the worker left.
    ws.handle_stimulus(ComputeTaskEvent.dummy(
        "grad", who_has={step: [dead], noise: [dead]}, nbytes={step: 1, noise: 1},
        stimulus_id="compute-grad"))
    assert ws.in_flight_workers[dead] == {step, noise}
    ws.handle_stimulus(FreeKeysEvent(keys=["grad"], stimulus_id="free"),
                       RemoveWorkerEvent(worker=dead, stimulus_id="remove"))
    # The input computed again elsewhere, the step comes to this worker: it resumes the
    # cancelled fetch as a task to compute. Then the fetch fails.
    ws.handle_stimulus(ComputeTaskEvent.dummy(
        step, who_has={noise: [spare]}, nbytes={noise: 1}, stimulus_id="compute-step"))
    assert (ws.tasks[step].state, ws.tasks[noise].state) == ("resumed", "cancelled")
    ws.handle_stimulus(GatherDepNetworkFailureEvent(worker=dead, total_nbytes=2,
                                                    stimulus_id="failed"))
    assert ws.tasks[step].state == "waiting" and not ws.tasks[noise].who_has
    if list({step, noise})[-1] == noise:
        # The input handled first is released, then asked for again by the step: with
        # nobody known to hold it, it is missing, and the worker asks the scheduler.
        assert ws.tasks[noise].state == "missing" and ws.tasks[noise] in ws.missing_dep_flight
        ws.validate_state()
        return
    # The step handled first: the input is released after the step asked for it, and
    # nothing will ever ask for it again -- the step waits forever. Dask's check of a
    # worker's whole state rejects this state (its check after each transition, which
    # the workers run with distributed.worker.validate, does not).
    assert ws.tasks[noise].state == "released"
    assert not ws.missing_dep_flight and not ws.data_needed and not ws.in_flight_workers
    with pytest.raises(AssertionError, match=rf"\({noise}, 'cancelled', 'released'"):
        ws.validate_state()
    # A steal-request (what the progress watchdog sends) drops the step, answered
    # 'waiting'; the step sent again fetches the input from where it is.
    assert ws.handle_stimulus(StealRequestEvent(key=step, stimulus_id="take-back")) == [
        StealResponseMsg(key=step, state="waiting", stimulus_id="take-back")]
    assert step not in ws.tasks
    ws.handle_stimulus(ComputeTaskEvent.dummy(
        step, who_has={noise: [spare]}, nbytes={noise: 1}, stimulus_id="compute-again"))
    assert ws.tasks[noise].state == "flight" and ws.tasks[noise].coming_from == spare
    ws.validate_state()


class StreamAtJoin(SchedulerPlugin):
    name = "stream-at-join"

    def __init__(self):
        self.streams = {}

    def add_worker(self, scheduler, worker):
        self.streams[worker] = scheduler.stream_comms.get(worker)


@pooled_cluster(NTHREADS)
async def test_10_a_workers_stream_exists_when_plugins_hear_it_joined(c, s, a, b):
    """The plugin sets the interval of the scheduler's batched stream to a worker when
    the worker joins: the stream must exist then, and be the one the scheduler keeps."""
    plugin = StreamAtJoin()
    s.add_plugin(plugin)
    async with Worker(s.address, nthreads=1) as w:
        await async_poll_for(lambda: w.address in plugin.streams, timeout=20)
        stream = plugin.streams[w.address]
        assert stream is not None and stream is s.stream_comms[w.address]
        assert isinstance(stream.interval, float) and stream.interval > 0


class StatusAtJoin(SchedulerPlugin):
    name = "status-at-join"

    def __init__(self):
        self.heard = []

    def add_worker(self, scheduler, worker):
        ws = scheduler.workers[worker]
        self.heard.append(("joined", worker, ws.status.name, ws in scheduler.running))

    def log_event(self, topic, msg):
        if isinstance(msg, dict) and msg.get("action") == "worker-status-change":
            self.heard.append(("status", topic, msg["status"]))


@pooled_cluster(NTHREADS, config={"distributed.worker.memory.pause": False})
async def test_11_a_worker_joins_before_it_runs_and_its_running_is_an_event(c, s, a, b):
    """A joining worker is heard in add_worker before it runs tasks; its change to
    running reaches plugins' log_event under its address. A task released to a worker
    that does not run tasks stays no-worker."""
    plugin = StatusAtJoin()
    s.add_plugin(plugin)
    async with Worker(s.address, nthreads=1) as w:
        await async_poll_for(lambda: ("status", w.address, "running") in plugin.heard,
                             timeout=20)
        assert plugin.heard[0] == ("joined", w.address, "init", False)
        assert s.workers[w.address] in s.running
        f = await submit_parked(c, s, "to-a-paused-worker")
        w.status = Status.paused
        await async_poll_for(lambda: s.workers[w.address] not in s.running, timeout=20)
        s.tasks["to-a-paused-worker"].worker_restrictions = {w.address}
        s.transitions({"to-a-paused-worker": "processing"}, "test-11")
        assert s.tasks["to-a-paused-worker"].state == "no-worker"
        w.status = Status.running
        assert await f == 2


class Releases(SchedulerPlugin):
    name = "releases"

    def __init__(self):
        self.seen = []

    def transition(self, key, start, finish, *args, stimulus_id=None, **kwargs):
        if start == "processing" and finish == "released":
            self.seen.append((key, stimulus_id))


@pooled_cluster(NTHREADS)
async def test_12_a_resumed_executions_outcome_is_refused_and_its_task_released(c, s, a, b):
    """A task taken back while it runs and sent to the same worker again before its
    execution ended is resumed there (the worker's task takes the new run id), but the
    execution reports the run id it began with, which the scheduler refuses as stale:
    the task is released again, to be sent anew. (So a context-parallel member sent
    again ends at once rather than compute a result that would be refused.)"""
    releases = Releases()
    s.add_plugin(releases)
    f = await submit_parked(c, s, "resumed", wait_for_event, "go-12")
    s.tasks["resumed"].worker_restrictions = {a.address}
    s.transitions({"resumed": "processing"}, "test-12-send")
    await async_poll_for(lambda: "resumed" in a.state.tasks
                         and a.state.tasks["resumed"].state == "executing", timeout=20)
    first = a.state.tasks["resumed"].run_id
    s.tasks["resumed"].worker_restrictions = {PARKED}
    s.transitions({"resumed": "released"}, "test-12-back")
    s.transitions({"resumed": "waiting"}, "test-12-back")
    assert s.tasks["resumed"].state == "no-worker"
    s.tasks["resumed"].worker_restrictions = {a.address}
    s.transitions({"resumed": "processing"}, "test-12-again")
    await async_poll_for(lambda: a.state.tasks.get("resumed") is not None
                         and a.state.tasks["resumed"].run_id != first
                         and a.state.tasks["resumed"].state == "executing", timeout=20)
    await Event("go-12").set()
    await async_poll_for(lambda: any(k == "resumed" and sid.startswith("task-finished")
                                     for k, sid in releases.seen), timeout=20)
    assert await f == "go-12"       # sent anew, it runs again and its outcome counts
