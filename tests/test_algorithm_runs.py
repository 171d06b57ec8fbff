"""Whole runs of each algorithm on real local Dask clusters: each learns the default
reward in one mode and gives the same bits in the others and with other worker counts;
an SDE window with CPS records and trains only its SDE steps; decoupled runs keep no
trajectory."""

import numpy as np
import pytest
import torch

from digenrl.config import RunConfig

from conftest import DETERMINISTIC_METRICS, small_config

#: The decoupled algorithms and a learning rate at which six iterations of
#: :func:`learning_config` clearly raise the reward.
LEARNING_RATES = {"diffusion_nft": 1e-2, "awm": 1e-2, "dpo": 3e-2}


def learning_config(name: str, **overrides) -> RunConfig:
    """The small model at 64 x 64 pixels (its JPEG sizes vary enough to learn from), four
    prompts of four images, six iterations, on-policy (``max_staleness`` 0: the
    DiffusionNFT loss anchors its implicit policies at the sampling copy of the chunk's
    version, so one-version-stale chunks pull the weights back towards the older copy and
    learn more slowly than six iterations show)."""
    return small_config(**{"algorithm.name": name, "iterations": 6,
                           "model.image_size": 64, "data.prompts_per_iteration": 4,
                           "data.samples_per_prompt": 4, "rollout.chunk_size": 4,
                           "schedule.max_staleness": 0,
                           "train.learning_rate": LEARNING_RATES[name], **overrides})


def assert_same_iterations(ds, ref, iterations: int) -> None:
    """``ds`` and ``ref`` (open_run of two stores) hold the same bits in their first
    ``iterations`` iterations: samples, advantages, versions and deterministic metrics."""
    s, r = ds["samples"].isel(iteration=slice(0, iterations)), \
        ref["samples"].isel(iteration=slice(0, iterations))
    assert s.sizes == r.sizes, (dict(s.sizes), dict(r.sizes))
    assert bool(s.valid.all()) and np.isfinite(s.reward.values).all()
    for name in ("reward", "advantage", "behaviour_version", "trained_version", "group",
                 "prompt"):
        assert np.array_equal(s[name].values, r[name].values), name
    m = ds["metrics"].isel(iteration=slice(0, iterations))
    mr = ref["metrics"].isel(iteration=slice(0, iterations))
    for name in DETERMINISTIC_METRICS:
        assert np.array_equal(m[name].values, mr[name].values, equal_nan=True), name


def assert_no_trajectory(ds) -> None:
    """A decoupled run's store has no ``steps`` rows."""
    steps = ds["steps"]
    assert not steps.data_vars or steps.sizes.get("iteration", 0) == 0, dict(steps.sizes)


@pytest.mark.slow
@pytest.mark.parametrize("name", LEARNING_RATES)
def test_each_decoupled_algorithm_learns_the_reward(name, cluster_1x1, shared_runs):
    """The bar of test_end_to_end's learning test: the mean reward of the last three
    iterations beats the first three's by more than 0.1 and five standard errors."""
    ds = shared_runs(cluster_1x1, learning_config(name)).ds
    r = ds["samples"].reward.values  # (iteration, sample)
    first, last = r[:3].ravel(), r[-3:].ravel()
    gain = last.mean() - first.mean()
    stderr = np.sqrt(first.var() / first.size + last.var() / last.size)
    assert gain > 0.1 and gain > 5 * stderr, (name, gain, stderr)
    assert_no_trajectory(ds)
    assert ds["metrics"].attrs["digenrl"]["algorithm"] == name


@pytest.mark.slow
@pytest.mark.parametrize("name", LEARNING_RATES)
def test_a_learning_run_is_the_same_bits_colocated_on_two_plus_two(name, cluster_1x1,
                                                                    cluster_2x2,
                                                                    shared_runs):
    """What learned in digenrl mode on 1 + 1 workers is what colocated mode computes on
    2 + 2: its first two iterations, bit for bit (the second's samples are drawn with
    version 1, so they repeat its weights too)."""
    learned = shared_runs(cluster_1x1, learning_config(name)).ds
    short = shared_runs(cluster_2x2, learning_config(name, **{
        "iterations": 2, "schedule.mode": "colocated", "schedule.max_staleness": None})).ds
    assert_same_iterations(short, learned, 2)
    assert_no_trajectory(short)


def final(result):
    return result.final_weights.tensors


def test_stale_chunks_give_the_same_bits_on_any_worker_count(cluster_1x1, cluster_2x2,
                                                              shared_runs):
    """digenrl mode with one-version-stale groups: DiffusionNFT's micro-steps of chunks an
    older version sampled read the trained weights and the sampling copy of their own
    version, wherever they run."""
    cfg = small_config(**{"algorithm.name": "diffusion_nft", "iterations": 3,
                          "schedule.stale_groups": 1})
    a, b = shared_runs(cluster_1x1, cfg), shared_runs(cluster_2x2, cfg)
    stale = a.ds["samples"].trained_version - a.ds["samples"].behaviour_version
    assert int(stale.max()) == 1   # the path under test ran
    assert_same_iterations(a.ds, b.ds, 3)
    wa, wb = final(a.result), final(b.result)
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    assert_no_trajectory(a.ds)


def test_a_cps_window_records_and_trains_only_its_sde_steps(cluster_1x1, shared_runs):
    """CPS in an SDE window of two of steps 0..2 (of four), with GRPO-Guard: each
    iteration's samples have log-probabilities exactly at its drawn steps, its micro-steps
    are exactly those steps, and the on-policy ratio is exactly 1."""
    cfg = small_config(**{"algorithm.dynamics": "cps", "algorithm.sde_steps": [0, 1, 2],
                          "algorithm.num_sde_steps": 2, "algorithm.guard": True,
                          "schedule.mode": "disaggregated"})
    shape = cfg.algorithm_shape
    ds = shared_runs(cluster_1x1, cfg).ds
    lp = ds["steps"].log_prob.values  # (iteration, sample, step)
    tasks = ds["tasks"].to_dataframe()
    grads = tasks[tasks.kind == "grad"]
    windows = set()
    for i in range(cfg.iterations):
        sde = shape.sde_steps(i)
        windows.add(sde)
        assert len(sde) == 2
        recorded = np.isfinite(lp[i]).all(axis=0)
        assert np.flatnonzero(recorded).tolist() == list(sde), (i, sde)
        assert np.isnan(lp[i][:, [t for t in range(4) if t not in sde]]).all()
        assert set(grads[grads.iteration == i].timestep.astype(int)) == set(sde)
    m = ds["metrics"]
    assert (m.ratio_dev.values < 1e-6).all(), m.ratio_dev.values
    assert (ds["samples"].trained_version == ds["samples"].behaviour_version).all()
