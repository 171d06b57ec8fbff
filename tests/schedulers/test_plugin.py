"""The scheduler plugin on in-process clusters with the scheduler's validation on."""

from __future__ import annotations

from distributed import Event, Worker
from distributed.core import Status
from distributed.utils_test import async_poll_for, inc

from digenrl.records import TASK_COLUMNS
from digenrl.schedulers.options import MODES, ScheduleOptions
from digenrl.schedulers.plugin import WORKER_SEND_INTERVAL, DigenRLSchedulerPlugin
from digenrl.vocabulary import CONTEXT_METADATA

from inprocess import pooled_cluster
from plugin_helpers import annotated, task_meta, wait_for_event, worker_name

ROLLOUT = {"resources": {"GPU": 1, "rollout": 1}}
TRAINER = {"resources": {"GPU": 1, "trainer": 1}}
POOLED = [("127.0.0.1", 2, ROLLOUT), ("127.0.0.1", 2, TRAINER)]


def options(mode="digenrl", **kw):
    return ScheduleOptions(mode=mode, **{**MODES[mode], **kw}).as_dict()


async def install(s, **kw):
    plugin = DigenRLSchedulerPlugin()
    await s.register_scheduler_plugin(plugin, idempotent=True)
    plugin = s.plugins[plugin.name]
    plugin.begin_run("test", options(**kw))
    return plugin


@pooled_cluster(POOLED)
async def test_pools_come_from_the_workers_own_resources(c, s, r, t):
    """With no lending (TAG, RAT), each kind runs on the pool its worker's resources
    name."""
    plugin = await install(s, tag=False, rat=False)
    tasks = {}
    for j in range(6):
        tasks[("denoise", 0, j, 0)] = (worker_name, (j,), task_meta("denoise", 0, 0, chunk=j, timestep=0))
        tasks[("grad", 0, j, 0)] = (worker_name, (j,), task_meta("grad", 0, 0, chunk=j, timestep=0,
                                                                  behaviour_version=0))
    futs = c.get(annotated(tasks), list(tasks), sync=False)
    names = dict(zip(tasks, await c.gather(futs)))
    assert {v for k, v in names.items() if k[0] == "denoise"} == {r.name}
    assert {v for k, v in names.items() if k[0] == "grad"} == {t.name}
    state = await c.scheduler.digenrl_state()
    assert state["pools"]["rollout"]["workers"] == 1 and state["pools"]["trainer"]["workers"] == 1
    assert state["counters"]["released"] == 12
    recs = (await c.scheduler.digenrl_tasks(start=0))["records"]
    assert len(recs) == 12 and {rec["pool"] for rec in recs} == {"rollout", "trainer"}
    assert all(list(rec) == list(TASK_COLUMNS) for rec in recs)
    assert plugin.run == "test"


@pooled_cluster(POOLED)
async def test_a_bad_graph_is_held_until_the_bound_allows_then_released(c, s, r, t):
    """A rollout of iteration 2 reading version 0 with max_staleness 1 must wait until
    version 1 is published -- and never run earlier."""
    plugin = await install(s, max_staleness=1)
    gate = Event("publish-1")
    tasks = {
        ("publish", 0): (inc, (0,), task_meta("publish", -1, 0)),
        ("publish", 1): (wait_for_event, ("publish-1",), task_meta("publish", 0, 1)),
        ("denoise", 2, 0, 0): (inc, (("publish", 0),), task_meta("denoise", 2, 0, chunk=0, timestep=0)),
    }
    futs = c.get(annotated(tasks), list(tasks), sync=False)
    await futs[0]
    await async_poll_for(lambda: s.tasks[("denoise", 2, 0, 0)].state == "no-worker", timeout=5)
    assert plugin.policy.held()["staleness"] == 1
    assert s.tasks[("denoise", 2, 0, 0)].state == "no-worker"
    assert s.validate
    await gate.set()
    assert await futs[2] == 2
    recs = {rec["key"]: rec for rec in (await c.scheduler.digenrl_tasks(start=0))["records"]}
    # Scheduler clock: released only once version 1's publication had been reported.
    assert recs[str(("denoise", 2, 0, 0))]["released"] >= recs[str(("publish", 1))]["finished"]


@pooled_cluster(POOLED)
async def test_training_beyond_the_bound_fails_with_a_clear_error(c, s, r, t):
    await install(s, max_staleness=1)
    tasks = {("grad", 3, 0, 0): (inc, (1,), task_meta("grad", 3, 3, chunk=0, timestep=0,
                                                       behaviour_version=1))}
    [f] = c.get(annotated(tasks), list(tasks), sync=False)
    try:
        await f
    except Exception as e:
        assert "staleness 2 exceeds max_staleness=1" in str(e)
        assert type(e).__name__ == "StalenessBoundError"
    else:
        raise AssertionError("the task ran")


@pooled_cluster(POOLED)
async def test_the_schedulers_messages_to_every_worker_go_out_at_the_plugins_interval(c, s, r, t):
    """Workers that joined before the plugin was registered and one that joins later."""
    default = s.stream_comms[r.address].interval
    assert default > WORKER_SEND_INTERVAL
    await install(s)
    assert {s.stream_comms[w.address].interval for w in (r, t)} == {WORKER_SEND_INTERVAL}
    async with Worker(s.address, nthreads=1, resources={"GPU": 1, "rollout": 1}) as late:
        await async_poll_for(lambda: late.address in s.stream_comms, timeout=20)
        assert s.stream_comms[late.address].interval == WORKER_SEND_INTERVAL


@pooled_cluster([("127.0.0.1", 2, ROLLOUT), ("127.0.0.1", 2, {"resources": {"GPU": 1}})])
async def test_an_untagged_worker_is_not_used_and_is_reported(c, s, r, untagged):
    await install(s, tag=False)
    tasks = {("denoise", 0, j, 0): (worker_name, (j,), task_meta("denoise", 0, 0, chunk=j, timestep=0))
             for j in range(4)}
    names = await c.gather(c.get(annotated(tasks), list(tasks), sync=False))
    assert set(names) == {r.name}
    state = await c.scheduler.digenrl_state()
    assert any("has no pool tag" in w for w in state["warnings"])


@pooled_cluster(POOLED)
async def test_the_dashboard_page_reads_the_runs_telemetry(c, s, r, t):
    from digenrl.schedulers.dashboard import DigenRLPage

    await install(s, tag=False)
    tasks = {("publish", 0): (inc, (0,), task_meta("publish", -1, 0)),
             ("grad", 0, 0, 0): (inc, (1,), task_meta("grad", 0, 0, chunk=0, timestep=0,
                                                       behaviour_version=0, samples=3))}
    await c.gather(c.get(annotated(tasks), list(tasks), sync=False))
    await c.scheduler.digenrl_metrics(run="test", iteration=0, metrics={"reward_mean": 0.5})
    page = DigenRLPage(s)
    page.update()
    assert page.stale_source.data == {"staleness": [0], "samples": [3]}
    assert page.reward_source.data == {"iteration": [0], "reward": [0.5]}
    assert (await c.scheduler.digenrl_state())["records"] == 2


def test_the_preload_starts_the_plugin_once():
    """``dask scheduler --preload digenrl.schedulers.preload``: the scheduler starts the
    plugin with its others, once (one progress guard, one set of handlers)."""
    import asyncio

    from distributed import Scheduler

    from digenrl.schedulers import plugin as plugin_module

    starts = []
    original = plugin_module.DigenRLSchedulerPlugin.start

    async def counted(self, scheduler):
        starts.append(self)
        await original(self, scheduler)

    async def main():
        async with Scheduler(dashboard_address=":0", preload=["digenrl.schedulers.preload"],
                             port=0) as s:
            return s.plugins[plugin_module.PLUGIN_NAME], s

    plugin_module.DigenRLSchedulerPlugin.start = counted
    try:
        installed, s = asyncio.run(main())
    finally:
        plugin_module.DigenRLSchedulerPlugin.start = original
    assert starts == [installed]
    assert s.handlers["digenrl_state"] == installed.state


def name_after_event(name):
    from distributed import Event, get_worker

    Event(name).wait()
    return get_worker().name


def submit_gang(c, event):
    """A gang of two grad members, each giving its worker's name once ``event`` is set:
    (their keys, their futures)."""
    keys = [("grad", 0, j, 0) for j in range(2)]
    tasks = {k: (name_after_event, (event,),
                 task_meta("grad", 0, 0, chunk=j, timestep=0, behaviour_version=0,
                           gang=(0, j, 2)))
             for j, k in enumerate(keys)}
    return keys, c.get(annotated(tasks), keys, sync=False)


@pooled_cluster(POOLED + [("127.0.0.1", 2, TRAINER)] * 2)
async def test_a_gang_member_lost_with_its_worker_takes_the_other_back_and_the_gang_reruns(
        c, s, r, t1, t2, t3):
    """A gang of two runs on the first two trainers (by name); the first dies while
    both run: the plugin sends the other member back to waiting (the policy took it
    back), and both run again together, on the second and the third trainer."""
    await install(s)
    keys, futs = submit_gang(c, "gang-go")

    def running_on():
        states = [s.tasks.get(k) for k in keys]
        if all(ts is not None and ts.state == "processing" for ts in states):
            return [ts.processing_on.address for ts in states]
        return None

    await async_poll_for(lambda: running_on() == [t1.address, t2.address], timeout=20)
    await s.remove_worker(t1.address, stimulus_id="test-gang-loss")   # as if it died
    await async_poll_for(lambda: running_on() == [t2.address, t3.address], timeout=20)
    await Event("gang-go").set()
    assert await c.gather(futs) == [t2.name, t3.name]
    recs = (await c.scheduler.digenrl_tasks(start=0))["records"]
    withdrawn = [rec["key"] for rec in recs if "\tlost\tgang\t" in rec["decisions"]]
    assert withdrawn == [str(keys[1])]


async def set_status(s, worker, status):
    """``worker`` sets its own status (``paused``, ``running``), and tells the scheduler,
    as a worker over its memory bound does."""
    worker.status = Status[status]
    await async_poll_for(lambda: s.workers[worker.address].status == Status[status],
                         timeout=20)


#: Workers whose memory monitor leaves their status as the test sets it.
UNPAUSED = {"distributed.worker.memory.pause": False}


@pooled_cluster(POOLED + [("127.0.0.1", 2, TRAINER)], config=UNPAUSED)
async def test_a_worker_is_used_once_dask_runs_tasks_on_it(c, s, r, t1, t2):
    """A worker that does not run tasks when the run begins (one still starting, or
    paused) is not the policy's until its status changes to running."""
    await set_status(s, t1, "paused")
    plugin = await install(s)
    assert t1.address not in plugin.policy.workers and t2.address in plugin.policy.workers
    await set_status(s, t1, "running")
    assert t1.address in plugin.policy.workers


@pooled_cluster(POOLED + [("127.0.0.1", 2, TRAINER)], config=UNPAUSED)
async def test_a_gang_is_not_started_on_a_worker_that_does_not_run_tasks(c, s, r, t1, t2):
    """A gang of two goes to the two trainers; the first is paused (Dask sends it
    nothing): neither member is sent, and no step fails, until it runs again; then both
    run, each on its own trainer, once."""
    plugin = await install(s)
    await set_status(s, t1, "paused")
    keys, futs = submit_gang(c, "gang-resumed")
    policy = plugin.policy
    # The policy released the gang, and its release was taken back whole.
    await async_poll_for(lambda: all(k in policy.tasks and "retried" in
                                     [e.verb for e in policy.trail_of(k)] for k in keys),
                         timeout=20)
    assert [s.tasks[k].state for k in keys] == ["no-worker", "no-worker"]
    assert plugin._gang().retried == 0 and plugin._gang().failed == []
    await set_status(s, t1, "running")
    await Event("gang-resumed").set()
    assert await c.gather(futs) == [t1.name, t2.name]
    recs = (await c.scheduler.digenrl_tasks(start=0))["records"]
    assert not [rec["key"] for rec in recs if "\tlost\t" in rec["decisions"]]


@pooled_cluster([("127.0.0.1", 2, ROLLOUT)] * 2 + [("127.0.0.1", 2, TRAINER)])
async def test_a_members_word_that_its_group_failed_runs_its_step_again(c, s, r1, r2, t):
    """A context-parallel step (a placed gang of two denoise members) runs on the two
    rollout workers; one member says its group failed with nothing lost (the
    ``digenrl_gang_rerun`` handler, with the failed-step count its placement carries):
    both members are taken back from their workers and the step runs again, its new
    placement counting one failed step; the other member's word of the same release
    changes nothing."""
    plugin = await install(s)
    keys = [("denoise", 0, 0, 0) + ((1,) if j else ()) for j in range(2)]
    tasks = {k: (name_after_event, ("cp-go",),
                 task_meta("denoise", 0, 0, chunk=0, timestep=0, behaviour_version=0,
                           samples=1, sde=True, gang=(7, j, 2)))
             for j, k in enumerate(keys)}
    futs = c.get(annotated(tasks), keys, sync=False)

    def placed():
        return s.task_metadata.get(CONTEXT_METADATA, {}).get("7")

    def processing():
        return all(s.tasks.get(k) is not None and s.tasks[k].state == "processing"
                   for k in keys)

    await async_poll_for(lambda: placed() is not None and processing(), timeout=20)
    assert placed()["failed"] == 0
    assert await c.scheduler.digenrl_gang_rerun(gang=7, failed=0)
    assert not await c.scheduler.digenrl_gang_rerun(gang=7, failed=0)
    await async_poll_for(lambda: placed()["failed"] == 1 and processing(), timeout=20)
    assert plugin._gang().retried == 1
    await Event("cp-go").set()
    assert sorted(await c.gather(futs)) == sorted([r1.name, r2.name])
    recs = (await c.scheduler.digenrl_tasks(start=0))["records"]
    assert {rec["key"] for rec in recs if "\tlost\tgang\t" in rec["decisions"]} \
        == set(map(str, keys))
