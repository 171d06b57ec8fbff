"""The progress watchdog and the stall check on in-process clusters (Dask's validation on).

A task Dask has lost track of is made on demand, with real events on a real scheduler
and real workers: Dask's own race after a worker loss, which leaves a task processing
on a worker that holds one of its inputs as ``released`` with no ``who_has`` after a
cancelled fetch (see the first test).
"""

from __future__ import annotations

import asyncio
import re

import pytest
from distributed import Worker
from distributed.core import Status
from distributed.utils_test import BlockedGatherDep, async_poll_for, inc

from digenrl.schedulers.options import MODES, ScheduleOptions
from digenrl.schedulers.plugin import DigenRLSchedulerPlugin

from inprocess import pooled_cluster
from plugin_helpers import annotated, task_meta, worker_name

ROLLOUT = {"resources": {"GPU": 1, "rollout": 1}}
TRAINER = {"resources": {"GPU": 1, "trainer": 1}}
POOLED = [("127.0.0.1", 1, ROLLOUT), ("127.0.0.1", 1, TRAINER)]
#: A short stall timeout: the watchdog's grace is a fifth of it (1 s).
STALL = 5.0


async def install(s, **kw):
    plugin = DigenRLSchedulerPlugin()
    await s.register_scheduler_plugin(plugin, idempotent=True)
    plugin = s.plugins[plugin.name]
    opts = ScheduleOptions(mode="digenrl", **{**MODES["digenrl"], "stall_timeout": STALL,
                                              **kw})
    plugin.begin_run("test", opts.as_dict())
    return plugin


def chain():
    """A rollout step, then a training micro-step reading it (on the other pool)."""
    return {
        ("denoise", 0, 0, 0): (inc, (1,), task_meta("denoise", 0, 0, chunk=0, timestep=0)),
        ("grad", 0, 0, 0): (worker_name, (("denoise", 0, 0, 0),),
                            task_meta("grad", 0, 0, chunk=0, timestep=0, behaviour_version=0)),
    }


def race_keys() -> tuple[tuple, tuple]:
    """A rollout step's key and its input's key such that a worker's set of keys to
    gather lists the input first, whichever was added first. A worker handles a failed
    gather's keys from the last of that set to the first, and only the step handled
    first strands the input (the test below); string hashes, and so that order, change
    from process to process."""
    for i in range(100):
        step, noise = ("denoise", 0, i, 0), ("noise", 0, i)
        if list({step, noise}) == list({noise, step}) == [noise, step]:
            return step, noise
    raise AssertionError("no keys order the input first")  # pragma: nocover


#: The rollout worker that dies also holds the resource the input needs.
RACE = [("127.0.0.1", 1, {"resources": {**ROLLOUT["resources"], "noise": 1}}),
        ("127.0.0.1", 1, TRAINER)]


# The trainer's fetch from the rollout worker is held until the test lets it go
# (BlockedGatherDep); the dead worker's address refuses connections, and the fetch
# fails once the connect timeout passes.
@pooled_cluster(RACE, worker_class=BlockedGatherDep,
                config={"distributed.comm.timeouts.connect": "2s"})
async def test_dasks_lost_fetch_race_hangs_without_the_watchdog_and_is_taken_back(
        c, s, r, t):
    """Dask's own race after a worker loss, made on demand with real events.

    The trainer fetches a step and its input from the rollout worker in one gather;
    the rollout worker dies while the fetch is under way, so the trainer cancels it.
    The input is computed again on another worker, and trainer-assisted generation
    sends the step to the trainer: it resumes the cancelled fetch as a task to compute.
    Then the fetch fails. The trainer makes the step wait for the input, but the input,
    handled after it, is released and its ``who_has`` cleared: the trainer never asks
    where it is, and the step waits forever although the input is in memory.
    """
    plugin = await install(s)
    plugin.progress.enabled = False
    step, noise = race_keys()
    chunk = step[2]
    grad = ("grad", 0, chunk, 0)
    tasks = {
        noise: (inc, (1,), {"resources": {"noise": 1}}),
        step: (inc, (noise,), task_meta("denoise", 0, 0, chunk=chunk, timestep=0)),
        grad: (worker_name, (step, noise),
               task_meta("grad", 0, 0, chunk=chunk, timestep=0, behaviour_version=0)),
    }
    fut = c.get(annotated(tasks), [grad], sync=False)[0]
    # 1. The rollout worker computes the input and the step; the micro-step, released
    #    to the trainer, fetches both from it in one gather, held on its way.
    await asyncio.wait_for(t.in_gather_dep.wait(), 20)
    gather = list(t.state.in_flight_workers[r.address])
    assert gather == [noise, step]
    # 2. The rollout worker dies; a worker that can compute the input joins.
    async with Worker(s.address, nthreads=1, resources={"noise": 1}, name="spare") as w:
        await r.close()
        # 3. The scheduler computes the input again on the new worker and sends the
        #    step to the trainer (no rollout worker left): the trainer had cancelled
        #    the step's fetch and resumes it as a task to compute.
        await async_poll_for(lambda: step in t.state.tasks
                             and t.state.tasks[step].state == "resumed", timeout=20)
        assert t.state.tasks[noise].state == "cancelled"
        assert s.tasks[noise].who_has == {s.workers[w.address]}
        # 4. The fetch fails (the rollout worker is gone).
        t.block_gather_dep.set()

        def stranded():
            ts = t.state.tasks.get(noise)
            return ts is not None and ts.state == "released" and not ts.who_has

        await async_poll_for(stranded, timeout=20)
        ts = t.state.tasks[step]
        assert ts.state == "waiting" and ts.waiting_for_data == {t.state.tasks[noise]}
        # The trainer's story of the failure: the step, handled first, goes back to
        # waiting and asks for the input; then the input, still a cancelled fetch,
        # is released (its who_has cleared), and nothing asks for it again.
        failed = [(e[0], e[1], e[3]) for e in t.state.story(step, noise)
                  if len(e) == 7 and e[5].startswith("gather-dep-network-failure")]
        assert failed == [(step, "resumed", "released"), (step, "released", "waiting"),
                          (noise, "cancelled", "cancelled"),
                          (noise, "cancelled", "released")]
        # Without the watchdog the step waits forever: three graces on, it is processing
        # on the trainer, which executes nothing and still holds the input as released
        # with no who_has, although the input is in memory on the new worker.
        loop = asyncio.get_running_loop()
        until = loop.time() + 3 * plugin.progress.watchdog.floor
        await async_poll_for(lambda: loop.time() > until, timeout=20)
        assert s.tasks[step].processing_on.address == t.address
        assert not s.workers[t.address].executing and not t.state.executing
        assert t.state.tasks[step].state == "waiting" and stranded()
        assert s.tasks[noise].state == "memory"
        assert s.tasks[noise].who_has == {s.workers[w.address]}
        # Dask's check of the worker's whole state rejects it: a task waits for an
        # input no one will fetch.
        with pytest.raises(AssertionError, match=re.escape(repr(noise))):
            t.state.validate_state()
        # With it, the trainer is asked to give the step back; it held it as waiting,
        # drops it, and the policy releases it again (to the trainer), which now asks
        # for the input where it is, computes the step and then the micro-step.
        plugin.progress.enabled = True
        assert await asyncio.wait_for(fut, 20) == t.name
        state = await c.scheduler.digenrl_state()
        assert state["counters"]["watchdog_taken_back"] == 1
        assert "watchdog_declined" not in state["counters"]
        assert plugin.progress.stalled("test") is None


@pooled_cluster(POOLED)
async def test_a_task_its_worker_runs_is_left_alone(c, s, r, t):
    """A slow task on a worker that executes it is not taken back."""
    from distributed import Event

    from plugin_helpers import wait_for_event

    plugin = await install(s)
    gate = Event("slow")
    tasks = {("denoise", 0, 0, 0): (wait_for_event, ("slow",),
                                    task_meta("denoise", 0, 0, chunk=0, timestep=0))}
    fut = c.get(annotated(tasks), list(tasks), sync=False)[0]
    await async_poll_for(lambda: s.workers[r.address].executing, timeout=10)
    # Three graces pass with the worker executing the task.
    loop = asyncio.get_running_loop()
    until = loop.time() + 3 * plugin.progress.watchdog.floor
    await async_poll_for(lambda: loop.time() > until, timeout=20)
    assert s.tasks[("denoise", 0, 0, 0)].processing_on.address == r.address
    await gate.set()
    assert await fut == "slow"
    assert (await c.scheduler.digenrl_state())["counters"].get("watchdog_taken_back", 0) == 0


@pooled_cluster(POOLED)
async def test_a_task_left_on_a_removed_worker_is_taken_back(c, s, r, t):
    """A transition that fails in the middle of a worker's removal (as Dask's own did
    under validation, on a dependency that had erred) leaves the worker's task
    processing on a worker the scheduler no longer lists, and the worker counted by the
    policy. The watchdog takes the task back at once and the policy forgets the worker
    (which shuts down when the scheduler no longer knows its heartbeat); the trainer
    runs the task instead (trainer-assisted generation)."""
    from distributed import Event

    from conftest import SCHEDULER_ERRORS
    from plugin_helpers import wait_for_event

    plugin = await install(s)
    key = ("denoise", 0, 0, 0)
    tasks = {key: (wait_for_event, ("held",), task_meta("denoise", 0, 0, chunk=0, timestep=0))}
    fut = c.get(annotated(tasks), list(tasks), sync=False)[0]
    await async_poll_for(lambda: s.workers[r.address].executing, timeout=10)
    ws = s.workers[r.address]

    transitions = s.transitions

    def failing(recommendations, stimulus_id):
        s.transitions = transitions   # once
        raise RuntimeError("a transition failed")

    s.transitions = failing
    logged = len(SCHEDULER_ERRORS.records)
    with pytest.raises(RuntimeError, match="a transition failed"):
        await s.remove_worker(r.address, stimulus_id="test-removal", close=False)
    # (The failure this test makes is the one error the scheduler may log.)
    assert [e.getMessage() for e in SCHEDULER_ERRORS.records[logged:]] == [
        "a transition failed"]
    del SCHEDULER_ERRORS.records[logged:]
    assert s.tasks[key].processing_on is ws and r.address not in s.workers
    assert r.address in plugin.policy.workers
    await async_poll_for(lambda: s.tasks[key].processing_on is not ws, timeout=10)
    assert r.address not in plugin.policy.workers
    assert (await c.scheduler.digenrl_state())["counters"]["watchdog_taken_back"] == 1
    await Event("held").set()
    assert await asyncio.wait_for(fut, 30) == "held"
    assert s.tasks[key].who_has == {s.workers[t.address]}


# (The memory monitor would resume a worker paused with its memory low.)
@pooled_cluster(POOLED, config={"distributed.worker.memory.pause": False})
async def test_a_run_whose_workers_are_all_paused_says_what_it_waits_for(c, s, r, t):
    plugin = await install(s)
    for w in (r, t):
        w.status = Status.paused
    await async_poll_for(lambda: all(ws.status == Status.paused
                                     for ws in s.workers.values()), timeout=10)
    tasks = chain()
    futs = c.get(annotated(tasks), list(tasks), sync=False)
    line = None

    def said():
        nonlocal line
        line = plugin.progress.stalled("test")
        return line is not None

    await async_poll_for(said, timeout=3 * STALL)
    assert "\n" not in line
    assert f"stall timeout {STALL:.0f} s" in line
    # (Dask sends no task to a paused worker: the policy's release of the step waits.)
    assert "waiting for: ('denoise', 0, 0, 0) ready, not released to any worker" in line
    assert f"workers: {r.name} paused, {t.name} paused" in line
    assert plugin.progress.stalled("another run") is None
    for w in (r, t):
        w.status = Status.running
    assert (await c.gather(futs))[1] == t.name
    assert plugin.progress.stalled("test") is None
