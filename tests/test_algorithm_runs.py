"""Whole runs of each algorithm on real local Dask clusters: each learns the default
reward at its defaults in digenrl mode and gives the same bits in the others and with
other worker counts;
an SDE window with CPS records and trains only its SDE steps; decoupled runs keep no
trajectory."""

import numpy as np
import pytest
import torch

from digenrl.config import RunConfig, load_config
from digenrl.figures.learning import learning

from conftest import DETERMINISTIC_METRICS, small_config

#: Each algorithm's learning run: a seed and prompt set of its own, and its iterations:
#: Flow-GRPO's default rate is the one steady over the 40 iterations of the default run
#: (docs/algorithm.md, "Each algorithm's defaults"), so it shows its gain over 16; the
#: decoupled algorithms over 10 (DiffusionNFT at its default, on-policy, rises from its
#: first iterations).
LEARNING_RUNS = {"flow_grpo": (21, "simple_animals", 16),
                 "diffusion_nft": (22, "animal_photos", 10),
                 "awm": (23, "simple_animals", 10), "dpo": (24, "animal_photos", 10)}
DECOUPLED = ("diffusion_nft", "awm", "dpo")
TINY = "workflows/configs/tiny.yaml"


def learning_config(name: str, **overrides) -> RunConfig:
    """The embedded default (``workflows/configs/tiny.yaml``: digenrl mode, one-version
    bounded staleness) with the algorithm at its defaults, its seed, prompt set and
    iterations."""
    seed, prompt_set, iterations = LEARNING_RUNS[name]
    return load_config(TINY, {"algorithm.name": name, "seed": seed,
                              "data.prompt_set": prompt_set, "iterations": iterations,
                              "cluster.dashboard_address": None, **overrides})


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
@pytest.mark.parametrize("name", LEARNING_RUNS)
def test_each_algorithm_learns_the_reward_at_its_defaults(name, cluster_1x1, shared_runs):
    """The bar of the learning matrix (workflows/learning_matrix.py): the mean reward of
    the last four iterations beats the first four's by more than three standard errors,
    and no late iteration's spread fell below a third of the first's."""
    ds = shared_runs(cluster_1x1, learning_config(name)).ds
    got = learning(ds["samples"].reward.values)
    assert got.learns, (name, got.describe())
    if name in DECOUPLED:
        assert_no_trajectory(ds)
    assert ds["metrics"].attrs["digenrl"]["algorithm"] == name


@pytest.mark.slow
@pytest.mark.parametrize("name", DECOUPLED)
def test_a_learning_run_is_the_same_bits_colocated_on_two_plus_two(name, cluster_1x1,
                                                                    cluster_2x2,
                                                                    shared_runs):
    """What learned in digenrl mode on 1 + 1 workers is what colocated mode computes on
    2 + 2: its first iteration, bit for bit (samples, advantages, the training's
    deterministic metrics; later iterations of digenrl mode sample with older versions)."""
    learned = shared_runs(cluster_1x1, learning_config(name)).ds
    short = shared_runs(cluster_2x2, learning_config(name, **{
        "iterations": 1, "schedule.mode": "colocated"})).ds
    assert_same_iterations(short, learned, 1)
    assert_no_trajectory(short)


def final(result):
    return result.final_weights.tensors


def test_stale_chunks_give_the_same_bits_on_any_worker_count(cluster_1x1, cluster_2x2,
                                                              shared_runs):
    """digenrl mode with one-version-stale groups: DiffusionNFT's micro-steps of chunks an
    older version sampled read the trained weights and the sampling copy of their own
    version, wherever they run."""
    cfg = small_config(**{"algorithm.name": "diffusion_nft", "iterations": 3,
                          "schedule.max_staleness": 1, "schedule.stale_groups": 1})
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
