"""Whole runs of Flow-GRPO on real local Dask clusters."""

import numpy as np
import torch

from digenrl.commands.report import summarise
from digenrl.run.runner import Runner
from digenrl.store import open_run

from conftest import small_config

TRAINING = {"grad", "reduce", "optimize"}


def run(cfg, cluster, path):
    result = Runner(cfg, str(path), cluster=cluster).run()
    return result, open_run(path)


#: The disaggregated run of the small config: asserted on here, and the run the others
#: must reproduce (one run per cluster, shared).
DISAGGREGATED = {"schedule.mode": "disaggregated"}


def test_disaggregated_run_writes_every_step_as_its_own_task(cluster_1x1, shared_runs):
    result, ds, *_ = shared_runs(cluster_1x1, small_config(**DISAGGREGATED))
    tasks = ds["tasks"].to_dataframe()
    assert tasks.key.is_unique
    denoise = tasks[tasks.kind == "denoise"]
    expected = {(i, c, t) for i in range(3) for c in range(2) for t in range(4)}
    assert set(zip(denoise.iteration, denoise.chunk, denoise.timestep)) == expected
    assert len(denoise) == len(expected)
    assert set(tasks.kind) >= {"noise", "denoise", "decode", "reward", "advantage", "grad",
                               "reduce", "optimize", "publish", "stats", "init"}
    assert not tasks[tasks.kind.isin(TRAINING)].pool.eq("rollout").any()
    assert not tasks[tasks.kind == "denoise"].pool.eq("trainer").any()
    assert (tasks.stop >= tasks.start).all()
    # Fetches from other workers: the trainer fetched the chunks' latents from the
    # rollout worker for its micro-steps, before the task Dask attached each fetch to
    # started. (A version's weights are copied to the rollout worker as soon as they are
    # published, a fetch Dask attaches to no task unless a step already waits for it.)
    fetched = tasks.dropna(subset=["transfer_start", "transfer_stop"])
    assert (fetched.transfer_stop >= fetched.transfer_start).all()
    assert (fetched.transfer_stop <= fetched.start + 0.05).all()
    assert (fetched[fetched.kind == "grad"].pool == "trainer").sum() >= 3
    m = ds["metrics"]
    assert (m.ratio_dev.values < 1e-6).all()
    for name in ("reward_mean", "reward_std", "loss", "clip_fraction", "approx_kl",
                 "images_per_s", "wall_time"):
        assert np.isfinite(m[name].values).all(), name
    # The CPU of every process of the run, and the model's share of it (Dask's metrics
    # reach the scheduler with the workers' heartbeats: compared over the run).
    cpu, model = m.cpu_seconds.values.sum(), m.model_cpu_seconds.values.sum()
    assert 0 < model < cpu, (model, cpu)
    assert "beside the model" in summarise(ds)
    s = ds["samples"]
    assert s.reward.dims == ("iteration", "sample") and s.reward.shape == (3, 4)
    assert (s.trained_version.values - s.behaviour_version.values == 0).all()
    assert ds["steps"].log_prob.shape == (3, 4, 4)
    assert result.final_weights.version == 3


def final(result):
    return result.final_weights.tensors


def assert_same_run(a, b):
    ra, rb = a[1]["samples"].reward.values, b[1]["samples"].reward.values
    assert np.array_equal(ra, rb)
    wa, wb = final(a[0]), final(b[0])
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def test_results_do_not_depend_on_worker_count_or_mode(cluster_1x1, cluster_2x2, shared_runs,
                                                       tmp_path):
    base = shared_runs(cluster_1x1, small_config(**DISAGGREGATED))
    assert_same_run(base, shared_runs(cluster_2x2, small_config(**DISAGGREGATED)))
    assert_same_run(base, run(small_config(**{"schedule.mode": "colocated"}),
                              cluster_1x1, tmp_path / "c"))
    assert_same_run(base, run(small_config(**{"schedule.mode": "colocated"}),
                              cluster_2x2, tmp_path / "d"))


