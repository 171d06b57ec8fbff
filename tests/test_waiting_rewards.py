"""Rewards that wait (a reward server, a judge) wait at once, holding no thread or GPU
slot of the worker."""

from __future__ import annotations

import numpy as np

import waiting_rewards  # noqa: F401 -- registers slow_brightness
from digenrl.run.runner import Runner
from digenrl.store import open_run
from digenrl.vocabulary import REWARD

from conftest import small_config


def most_at_once(starts: np.ndarray, stops: np.ndarray) -> int:
    """The most intervals ``[start, stop)`` that overlap at one moment."""
    events = sorted([(t, 1) for t in starts] + [(t, -1) for t in stops])
    now = best = 0
    for _, step in events:
        now += step
        best = max(best, now)
    return best


def test_an_iterations_waiting_rewards_wait_at_once(cluster_1x1, tmp_path):
    """Four chunks per iteration, each scored by a reward that waits 3 s: on one rollout
    worker of two threads (one for its GPU slot), the reward tasks of an iteration wait
    together, none holding a GPU slot, and the run's rewards are the brightness they
    wait to return."""
    cfg = small_config(iterations=2, **{"data.prompts_per_iteration": 4,
                                        "reward.components": {"slow_brightness": 1.0}})
    Runner(cfg, str(tmp_path / "w.zarr"), cluster=cluster_1x1).run()
    ds = open_run(tmp_path / "w.zarr")
    tasks = ds["tasks"].to_dataframe()
    rewards = tasks[tasks.kind == REWARD]
    assert len(rewards) == 8 and not rewards.gpu.any()
    assert (rewards.stop - rewards.start >= waiting_rewards.DELAY).all()
    workers = cluster_1x1.client.scheduler_info(n_workers=-1)["workers"].values()
    threads = max(w["nthreads"] for w in workers)
    assert most_at_once(rewards.start.values, rewards.stop.values) > threads, rewards
    assert np.isfinite(ds["samples"].reward.values).all()
