"""Worker loss on a real multi-process local cluster in mode digenrl.

While the run computes a later iteration, a rollout worker (then a trainer worker) is
killed with SIGKILL in the middle of a task; its nanny starts a new process, which joins
the cluster mid-run. Lost results are recomputed from lineage -- every random draw is
keyed by what is drawn and every optimizer step starts from a checkpoint -- so the run
completes with every iteration in the store and with the rewards, log-probs, metrics and
final weights of the undisturbed run, bit for bit.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from concurrent.futures import Future

import numpy as np
import pytest
import torch
import zarr
from distributed import Client

from digenrl.store.checkpoints import complete_checkpoints, read_checkpoint, read_weights
from digenrl.graph.keys import publish_key
from digenrl.graph.structure import Dep, rollout_nodes, train_nodes
from digenrl.run.runner import RLWorkload, Runner
from digenrl.schedulers.plugin import DigenRLSchedulerPlugin
from digenrl.schedulers.policy.rules.gang import Gang
from digenrl.store import StoreError, open_run
from digenrl.tasks.checkpoint import CheckpointSpec, load_state
from digenrl.tasks.resident import PLUGIN_NAME
from digenrl.tasks.train import OptimizeOut
from digenrl.tasks.types import TrainerState
from digenrl.vocabulary import ROLLOUT_KINDS, STATS, TRAINING_KINDS

from conftest import REFERENCE_ITERATIONS, assert_same_results, small_config
from invariants import assert_schedule_invariants


@pytest.fixture
def another_client(cluster_1x1):
    """A second client in this process, newer than the run's and so Dask's default: the
    driver must still wait on its own client's event loop (a result lost with a worker
    is gathered again there)."""
    with Client(cluster_1x1.client.scheduler.address) as c:
        yield c


def _processing(dask_scheduler, address):
    """The keys the scheduler has sent to ``address`` and not heard back about."""
    ws = dask_scheduler.workers.get(address)
    return [ts.key for ts in ws.processing] if ws is not None else []


def _pool_worker(client, pool: str, name: str | None = None) -> str:
    """The address of the ``pool`` worker named ``name`` (None: the pool's only one)."""
    [address] = [a for a, w in client.scheduler_info(n_workers=-1)["workers"].items()
                 if (w.get("resources") or {}).get(pool)
                 and (name is None or str(w.get("name")) == name)]
    return address


def _resident(dask_worker, versions):
    """The parameters this worker's resident transformer holds for each version."""
    plugin = dask_worker.plugins.get(PLUGIN_NAME)
    if plugin is None or plugin.models is None:
        return None
    out = {}
    for v in versions:
        params = plugin.models.loaded(v)
        if params is not None:
            out[v] = {n: t.numpy() for n, t in params.items()}
    return out


def _in_background(fn) -> Future:
    """``fn()`` on a daemon thread, as a future. (Not an executor, whose exit joins the
    thread: a run that hangs then fails the test at its timeout instead of hanging it.)"""
    fut: Future = Future()

    def target():
        try:
            fut.set_result(fn())
        except BaseException as e:  # noqa: BLE001 -- handed to the test
            fut.set_exception(e)

    threading.Thread(target=target, name="run", daemon=True).start()
    return fut


def _stuck(dask_scheduler) -> str:
    """What a run that does not finish waits on: each worker's status and the keys it
    computes, the run's tasks the scheduler holds outside memory (by state), and the
    policy's view (each worker's pool and tasks in flight, the tasks ready or held, and
    the gang rule's waiting gangs and kept workers)."""
    lines = [f"{a} {ws.name} {ws.status.name}: processing {[ts.key for ts in ws.processing]}"
             for a, ws in dask_scheduler.workers.items()]
    [plugin] = [p for p in dask_scheduler.plugins.values()
                if isinstance(p, DigenRLSchedulerPlugin)]
    states: dict[str, list] = {}
    for key in plugin._meta:
        ts = dask_scheduler.tasks.get(key)
        if ts is not None and ts.state != "memory":
            states.setdefault(ts.state, []).append(key)
    lines.append("scheduler, the run's tasks: " + ", ".join(
        f"{state} {len(keys)}" if state in ("released", "waiting") else f"{state} {keys}"
        for state, keys in states.items()))
    policy = plugin.policy
    if policy is None:
        return "\n".join(lines)
    for w in policy.workers.values():
        lines.append(f"policy worker {w.name} ({w.pool}): in flight {sorted(w.inflight)}")
    ready = [(info.key, info.state, info.gang) for info in policy.tasks.values()
             if info.state in ("ready", "held")]
    lines.append(f"policy, ready or held: {ready}")
    gang = policy.rule(Gang)
    members = {gid: (sorted(g.ready), g.size, g.degree, g.after)
               for gid, g in gang.gangs.items()}
    lines.append(f"gang rule: waiting {list(gang.waiting)}, reserved {gang.reserved}, "
                 f"kept_for {gang.kept_for}, short {gang.short}, due {gang.due}, "
                 f"gangs (ready members, size, degree, after) {members}")
    return "\n".join(lines)


def run_killing(cluster, path, pool: str, kind: str, min_iteration: int, cfg=None,
                before: int | None = None, worker: str | None = None,
                bound: float = 600.0):
    """Run ``cfg`` (default: the reference config); SIGKILL the ``pool`` worker (named
    ``worker``; None: the pool's only one) while it computes a ``kind`` task of iteration
    ``min_iteration`` or later (and before ``before``), wait at most ``bound`` seconds
    for the run to end, and until the cluster has as many workers again. Returns the
    killed worker's address and the keys it was computing."""
    client = cluster.client
    address = _pool_worker(client, pool, worker)
    count = len(client.scheduler_info(n_workers=-1)["workers"])
    cfg = cfg or small_config(iterations=REFERENCE_ITERATIONS)
    run = _in_background(Runner(cfg, str(path), cluster=cluster).run)
    deadline = time.monotonic() + 300
    while True:
        if run.done():
            run.result()  # raises what stopped it, if anything
            raise AssertionError(f"the run ended before the {pool} worker computed a "
                                 f"{kind} task of iteration {min_iteration} or later")
        assert time.monotonic() < deadline, "timed out waiting for the moment to kill"
        keys = client.run_on_scheduler(_processing, address=address)
        hit = [k for k in keys if k[0] == kind and k[1] >= min_iteration
               and (before is None or k[1] < before)]
        if hit:
            pid = client.run(os.getpid, workers=[address])[address]
            os.kill(pid, signal.SIGKILL)
            break
        time.sleep(0.01)
    try:
        run.result(timeout=bound)
    except TimeoutError:  # (concurrent.futures raises the builtin since 3.11)
        stuck = client.run_on_scheduler(_stuck)
        raise AssertionError(f"the run did not finish within {bound:.0f} s of the kill; "
                             f"it waits on:\n{stuck}") from None
    # The nanny's new process joins again (the next tests use the whole cluster).
    client.wait_for_workers(count, timeout=120)
    return address, hit


def check_run(path, reference, dead: str):
    """Every iteration stored, the reference run's numbers bit for bit, the scheduling
    rules kept. Returns the task records."""
    ds = open_run(path)
    assert ds["metrics"].sizes["iteration"] == REFERENCE_ITERATIONS
    assert_same_results(ds, read_weights(path)[1], reference)
    t = ds["tasks"].to_dataframe()
    assert (t.worker == dead).any()  # the killed worker did run part of this run
    assert_schedule_invariants(t, small_config().schedule.options())
    return t


@pytest.mark.slow
def test_a_killed_rollout_worker_loses_nothing(cluster_1x1, reference_run, another_client,
                                               tmp_path):
    path = tmp_path / "r.zarr"
    # Iteration 2's rollouts start once version 1 is published: mid-run.
    dead, keys = run_killing(cluster_1x1, path, "rollout", "denoise", 2)
    assert keys and all(k[0] == "denoise" for k in keys)
    check_run(path, reference_run, dead)


@pytest.mark.slow
def test_a_killed_trainer_loses_nothing_and_its_successor_gets_the_weights(
        cluster_1x1, reference_run, another_client, tmp_path):
    # Checkpoints at resume points 4 apart (``store.checkpoint_every``): of the 4
    # iterations' versions only 0 and the last two (a run resumed at its end restores
    # them) are written. Killed during iteration 2, the trainer takes version 2's state
    # with it, which only its memory held: the optimizer steps of iterations 0 and 1
    # (and what they read) are computed again from version 0's checkpoint. (A trainer
    # lost when every version is checkpointed: tests/test_chaos_kills.py,
    # tests/test_lora_runs.py.)
    path = tmp_path / "r.zarr"
    cfg = small_config(iterations=REFERENCE_ITERATIONS, **{"store.checkpoint_every": 4})
    dead, keys = run_killing(cluster_1x1, path, "trainer", "grad", 2, cfg=cfg, before=3)
    assert keys and all(k[0] == "grad" and k[1] == 2 for k in keys)
    t = check_run(path, reference_run, dead)
    steps = t[t.kind == "optimize"].iteration.value_counts().to_dict()
    assert steps[0] == steps[1] == 2 and steps[3] == 1, steps
    assert complete_checkpoints(path) == [3, 4]
    client = cluster_1x1.client
    successor = _pool_worker(client, "trainer")
    assert successor != dead
    # The one trainer died, so its successor -- a worker that joined mid-run, with an
    # empty process -- trained every micro-step after the loss, each reading a version
    # published before it joined.
    ran = t[t.worker == successor]
    assert (ran.kind == "grad").any() and ran[ran.kind == "grad"].iteration.min() <= keys[0][1]
    # What it computed with: for every version it holds, exactly that version's weights
    # (the checkpoints the store still keeps are the versions' trainer state, bit-exact).
    kept = complete_checkpoints(path)
    resident = client.run(_resident, versions=kept, workers=[successor])[successor]
    assert resident, f"no version of {kept} is resident on the new trainer"
    for v, params in resident.items():
        expected = read_checkpoint(path, v)[0]["params"]
        assert params.keys() == expected.keys()
        assert all(np.array_equal(params[n], expected[n]) for n in params), v


def test_every_model_task_reads_its_weights_as_an_input():
    """Why a worker that joins mid-run computes with the current weights: every task that
    runs the transformer takes the published weights of the version it reads as a Dask
    input, so Dask moves them to the worker before the task starts, and the worker's
    resident model is keyed by that version. Nothing is cached by position or order."""
    for kl in (0.0, 0.01):
        w = RLWorkload(small_config(**{"train.kl_beta": kl, "schedule.stale_groups": 1}))
        for i in range(3):
            plan = w.plan(i)
            nodes = rollout_nodes(w.layout, plan) + train_nodes(w.layout, plan)
            model_tasks = [n for n in nodes if n.op in ("denoise", "grad")]
            assert model_tasks
            for n in model_tasks:
                assert Dep(publish_key(n.meta["policy_version"])) in n.args, n.key
                if n.op == "grad" and kl:
                    assert Dep(publish_key(0)) in n.args, n.key


def test_each_version_is_read_back_on_the_worker_that_made_its_state(reference_run):
    """The scheduler sends the read-back of version ``v`` (what ``v`` is published from)
    to the worker whose optimizer step (version 0: the initial state) made it, which
    takes the state from its memory rather than waiting for the checkpoint."""
    _, ds = reference_run
    t = ds["tasks"].to_dataframe()
    where = dict(zip(t.key, t.worker))
    reads = t[t.kind == "restore"]
    assert len(reads) == REFERENCE_ITERATIONS + 1  # versions 0 .. n
    for key, worker in zip(reads.key, reads.worker):
        version = int(key.strip("()").split(",")[1])
        maker = "('init',)" if version == 0 else f"('optimize', {version - 1})"
        assert worker == where[maker], (key, worker, where[maker])


def _made_state(version: int) -> OptimizeOut:
    g = torch.Generator().manual_seed(version)
    params = {"w": torch.randn(3, 4, generator=g), "b": torch.randn(4, generator=g)}
    return OptimizeOut(TrainerState(version=version, params=params,
                                    exp_avg={k: v * 0.5 for k, v in params.items()},
                                    exp_avg_sq={k: v * v for k, v in params.items()},
                                    step=version), None)


def test_a_read_back_takes_the_state_from_its_makers_memory_else_the_checkpoint(
        cluster_1x1, tmp_path):
    """On the worker holding the maker's result the read-back returns that state, bit
    for bit, without a checkpoint; on another worker it reads the checkpoint, and
    without one it fails naming what it expected."""
    client = cluster_1x1.client
    trainer, rollout = (_pool_worker(client, pool) for pool in ("trainer", "rollout"))
    spec = CheckpointSpec(str(tmp_path / "no-checkpoints.zarr"))
    zarr.open_group(spec.store, mode="w").require_group("checkpoints")
    made = client.submit(_made_state, 3, key=("made", 3), workers=[trainer])
    want = made.result()  # (the read-back names its maker but does not wait for it)
    got = client.submit(load_state, spec, 3, made.key, workers=[trainer], pure=False).result()
    for part in ("params", "exp_avg", "exp_avg_sq"):
        mine, theirs = getattr(got.state, part), getattr(want.state, part)
        assert mine.keys() == theirs.keys()
        assert all(torch.equal(mine[k], theirs[k]) for k in mine)
    assert (got.state.version, got.state.step) == (3, 3)
    elsewhere = client.submit(load_state, spec, 3, made.key, workers=[rollout], pure=False)
    with pytest.raises(StoreError, match="complete checkpoint of policy version 3"):
        elsewhere.result()


#: The kinds of an iteration's work, keyed ``(kind, iteration, ...)``.
_ITERATION_KINDS = ROLLOUT_KINDS | TRAINING_KINDS | {STATS}


def _wanted_iterations(dask_scheduler) -> list[tuple]:
    """The keys of an iteration's work some client still holds."""
    return [ts.key for ts in dask_scheduler.tasks.values()
            if ts.who_wants and isinstance(ts.key, tuple) and ts.key[0] in _ITERATION_KINDS]


def test_the_driver_holds_nothing_of_a_committed_iteration(cluster_1x1, monkeypatch,
                                                            tmp_path):
    """Once an iteration is committed, no client holds any of its work, so a worker lost
    later never has Dask recompute it (through checkpoints already dropped). Every wait
    of the driver here times out (a 1 ms poll) and the garbage collector is off, so
    futures kept only by the reference cycles of those timeouts would stay held."""
    import gc

    import digenrl.run.driver

    monkeypatch.setattr(digenrl.run.driver, "STALL_POLL", 0.001)
    client = cluster_1x1.client
    held: dict[int, list] = {}

    def committed(summary) -> None:
        deadline = time.monotonic() + 10  # releases reach the scheduler in milliseconds
        while True:
            old = [k for k in client.run_on_scheduler(_wanted_iterations)
                   if k[1] <= summary.iteration]
            if not old or time.monotonic() > deadline:
                break
            time.sleep(0.01)
        held[summary.iteration] = old

    gc.disable()
    try:
        Runner(small_config(), str(tmp_path / "run.zarr"), cluster=cluster_1x1,
               on_iteration=committed).run()
    finally:
        gc.enable()
    assert sorted(held) == [0, 1, 2] and not any(held.values()), held
