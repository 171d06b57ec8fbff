"""Chaos: worker processes SIGKILLed again and again through a long run.

On a real 1+1 local cluster (every worker under a nanny, which starts a new process
when its worker dies), a seeded random choice of the rollout or the trainer worker is
killed in the middle of a task each time the run has completed a few more tasks since
the last kill's replacement joined, all through a 14-iteration run in mode ``digenrl``.
The run must complete, and every stored array -- samples, rewards, log-probs, metrics,
the checkpoints it keeps and its final weights -- equal the undisturbed run's, bit for
bit.
"""

from __future__ import annotations

import os
import random
import signal
import time

import numpy as np
import pytest

from digenrl.store.checkpoints import complete_checkpoints, read_checkpoint, read_weights
from digenrl.run.runner import Runner
from digenrl.store import open_run
from digenrl.vocabulary import ROLLOUT, TRAINER

from conftest import assert_same_results, small_config
from invariants import assert_schedule_invariants
from test_worker_loss import _in_background, _processing, _stuck

ITERATIONS = 14
#: The small config made smaller still (one prompt of two samples, two sampler steps):
#: fourteen iterations take seconds, and kills fall in every kind of task.
CHAOS = {"data.prompts_per_iteration": 1, "sampler.num_steps": 2}
SEED = 7
#: Tasks the run completes between a replacement joining and the next kill.
EVERY = 20
#: Kills the run must survive (both pools among them).
MIN_KILLS = 5


def chaos_config():
    return small_config(iterations=ITERATIONS, **CHAOS)


def workers_by_pool(client) -> dict[str, list[str]]:
    info = client.scheduler_info(n_workers=-1)["workers"]
    return {pool: sorted(a for a, w in info.items() if (w.get("resources") or {}).get(pool))
            for pool in (ROLLOUT, TRAINER)}


def _started(dask_worker) -> bool:
    """On a nanny (``client.run(..., nanny=True)``): its worker process has started."""
    return dask_worker.process is not None and dask_worker.process.status.name == "running"


def ready(client, pools) -> bool:
    """One worker in each pool, each with its nanny done starting it. (A worker joins the
    scheduler before its nanny has heard it started; killed in between, it is never
    started again: distributed 2026.7.1.) A nanny that cannot be reached yet (the
    scheduler may still list a worker just killed) is not ready."""
    return (all(len(pools[p]) == 1 for p in pools)
            and all(v is True for v in client.run(_started, nanny=True,
                                                   on_error="return").values()))


def records(client) -> int | None:
    """Tasks the run in progress has completed (None before it has begun)."""
    state = client.sync(client.scheduler.digenrl_state)
    return state["records"] if state["active"] else None


def kill_repeatedly(cluster, path, seed: int) -> list[tuple[str, list]]:
    """Run the chaos config into ``path`` while killing workers: each time both workers
    are up (their nannies done starting them) and the run has completed ``EVERY`` more tasks, a seeded choice of pool, whose
    worker is killed with SIGKILL as soon as it computes a task. Returns each kill's pool
    and the keys that worker was computing."""
    client = cluster.client
    rng = random.Random(seed)
    run = _in_background(Runner(chaos_config(), str(path), cluster=cluster).run)
    kills: list[tuple[str, list]] = []
    since, target = 0, None  # records at the last replacement's joining; the pool to kill
    deadline = time.monotonic() + 600
    while not run.done():
        if time.monotonic() > deadline:
            stuck = client.run_on_scheduler(_stuck)
            raise AssertionError(f"the run did not finish within 600 s, {len(kills)} kills "
                                 f"in; it waits on:\n{stuck}")
        pools = workers_by_pool(client)
        done = records(client)
        if done is None or not ready(client, pools):
            # Not begun yet, or a killed worker's replacement has not joined yet.
            since = done or 0
        elif target is None and done >= since + EVERY:
            target = rng.choice((ROLLOUT, TRAINER))
        elif target is not None:
            [address] = pools[target]
            keys = client.run_on_scheduler(_processing, address=address)
            if keys:
                pid = client.run(os.getpid, workers=[address])[address]
                os.kill(pid, signal.SIGKILL)
                kills.append((target, keys))
                target = None
                # Until the scheduler drops it, the dead worker still counts as up.
                while address in client.scheduler_info(n_workers=-1)["workers"]:
                    time.sleep(0.01)
        time.sleep(0.01)
    run.result()
    client.wait_for_workers(2, timeout=120)  # the last replacement (the next tests use it)
    return kills


@pytest.mark.slow
def test_repeated_worker_kills_change_no_bit(cluster_1x1, shared_runs, tmp_path):
    reference = shared_runs(cluster_1x1, chaos_config())
    path = tmp_path / "chaos.zarr"
    kills = kill_repeatedly(cluster_1x1, path, SEED)
    pools = [pool for pool, _ in kills]
    assert len(kills) >= MIN_KILLS and set(pools) == {ROLLOUT, TRAINER}, kills

    ds = open_run(path)
    assert ds["metrics"].sizes["iteration"] == ITERATIONS
    assert_same_results(ds, read_weights(path)[1], reference[:2])
    # The checkpoints the run keeps hold the reference's trainer state, bit for bit.
    kept = complete_checkpoints(path)
    assert kept == complete_checkpoints(reference.result.store) and kept
    for v in kept:
        (parts, step), (ref_parts, ref_step) = (read_checkpoint(path, v),
                                                read_checkpoint(reference.result.store, v))
        assert step == ref_step and parts.keys() == ref_parts.keys(), v
        for part, arrays in parts.items():
            assert arrays.keys() == ref_parts[part].keys(), (v, part)
            assert all(np.array_equal(a, ref_parts[part][n]) for n, a in arrays.items()), (v, part)
    assert_schedule_invariants(ds["tasks"].to_dataframe(), chaos_config().schedule.options())
    print(f"\nchaos: {len(kills)} kills survived ({pools.count(ROLLOUT)} rollout, "
          f"{pools.count(TRAINER)} trainer) in {ITERATIONS} iterations; every stored array "
          f"bit-identical to the undisturbed run: yes")
