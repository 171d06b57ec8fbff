"""The progress watchdog and the stall check on in-process clusters (Dask's validation on).

A task Dask has lost track of is made on demand: the scheduler sends it to a worker
whose ``compute-task`` message for it is dropped on arrival, so the scheduler holds it
as processing there while the worker never knows it, executes nothing and will never
run it -- what the scheduler sees of a task stuck behind an input the worker holds as
``released`` after a cancelled fetch.
"""

from __future__ import annotations

import asyncio

import pytest
from distributed.core import Status
from distributed.utils_test import async_poll_for, inc

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


def lose_compute_task(worker, key) -> list:
    """Drop the worker's next ``compute-task`` message for ``key``: the scheduler then
    holds ``key`` as processing on ``worker``, which knows nothing of it. Returns a list
    that receives the key once the message was dropped."""
    handler = worker.stream_handlers["compute-task"]
    dropped = []

    def maybe_drop(**msg):
        if msg.get("key") == key and not dropped:
            dropped.append(key)
            return None
        return handler(**msg)

    worker.stream_handlers["compute-task"] = maybe_drop
    return dropped


def chain():
    """A rollout step, then a training micro-step reading it (on the other pool)."""
    return {
        ("denoise", 0, 0, 0): (inc, (1,), task_meta("denoise", 0, 0, chunk=0, timestep=0)),
        ("grad", 0, 0, 0): (worker_name, (("denoise", 0, 0, 0),),
                            task_meta("grad", 0, 0, chunk=0, timestep=0, behaviour_version=0)),
    }


@pooled_cluster(POOLED)
async def test_a_task_its_worker_never_runs_hangs_without_the_watchdog_and_is_taken_back(
        c, s, r, t):
    plugin = await install(s)
    plugin.progress.enabled = False
    stuck = ("grad", 0, 0, 0)
    dropped = lose_compute_task(t, stuck)
    tasks = chain()
    fut = c.get(annotated(tasks), [stuck], sync=False)[0]
    await async_poll_for(lambda: dropped, timeout=10)
    # Without the watchdog the task waits forever: processing on the trainer, which
    # executes nothing and does not know it.
    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(asyncio.shield(fut), 3 * STALL / 5 + 2)
    assert s.tasks[stuck].processing_on.address == t.address
    assert stuck not in t.state.tasks and not s.workers[t.address].executing
    # With it, the trainer is asked to give the task back; it never had it, so the
    # scheduler reschedules it and the policy releases it again (to the trainer: its
    # pool's only worker), which now runs it.
    plugin.progress.enabled = True
    assert await asyncio.wait_for(fut, 20) == t.name
    state = await c.scheduler.digenrl_state()
    assert state["counters"]["watchdog_taken_back"] == 1
    assert state["counters"]["released"] == 3   # the step, the micro-step twice
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
