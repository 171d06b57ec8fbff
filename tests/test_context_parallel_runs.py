"""Whole runs whose chunks are computed with context parallelism
(``rollout.context_parallel: 2``) on a real local Dask cluster of two rollout workers:
each denoise step of a chunk is a gang of two tasks, one on each rollout worker, which
form a gloo group and compute the step together. Against the run at degree 1: the same
rewards (bar 1e-4) and log-probabilities; the same run twice is the same bits; a rollout
worker killed while it computes its part of a step costs the run nothing, and with no wait
for the pool to grow back the step runs again at degree 1."""

from __future__ import annotations

import ast

import numpy as np
import pytest
import torch

from digenrl.run.runner import Runner
from digenrl.store import open_run
from digenrl.store.checkpoints import read_weights
from digenrl.vocabulary import DECODE, DENOISE, ROLLOUT

from conftest import DETERMINISTIC_METRICS, small_config


def config(degree: int | str, **overrides):
    """Two iterations on the two rollout workers of the 2 + 2 cluster; a collective
    waits at most 120 s for a member (a restarted worker's member may start late on a
    loaded machine: it fetches its inputs first; a lost peer fails a collective at once)."""
    return small_config(**{"rollout.context_parallel": degree, "iterations": 2,
                           "cluster.rollout_workers": 2, "cluster.trainer_workers": 2,
                           "cluster.collective_timeout": 120.0, **overrides})


#: The runs made so far in this process: (degree, attempt) -> store path.
_MADE: dict = {}


@pytest.fixture
def runs(tmp_path_factory, cluster_2x2):
    def get(degree: int | str, attempt: int = 0, **overrides) -> str:
        key = (degree, attempt, tuple(sorted(overrides.items())))
        if key not in _MADE:
            path = tmp_path_factory.mktemp("cp") / "run.zarr"
            Runner(config(degree, **overrides), str(path), cluster=cluster_2x2).run()
            _MADE[key] = str(path)
        return _MADE[key]
    return get


def test_a_run_at_degree_2_gives_degree_1s_results_and_the_same_bits_twice(runs):
    one, two, again = open_run(runs(1)), open_run(runs(2)), open_run(runs(2, 1))
    assert np.max(np.abs(two["samples"]["reward"].values
                         - one["samples"]["reward"].values)) <= 1e-4
    assert np.nanmax(np.abs(two["steps"]["log_prob"].values
                            - one["steps"]["log_prob"].values)) <= 1e-4
    for name in ("reward", "advantage", "image"):
        assert np.array_equal(two["samples"][name].values, again["samples"][name].values), name
    for name in DETERMINISTIC_METRICS:
        assert np.array_equal(two["metrics"][name].values, again["metrics"][name].values,
                              equal_nan=True), name
    (v2, w2), (v3, w3) = read_weights(runs(2)), read_weights(runs(2, 1))
    assert v2 == v3 and all(np.array_equal(w2[n], w3[n]) for n in w2)
    # Every step of every chunk ran as two members, each on its own rollout worker; a
    # chunk's steps stayed on one pair; decoding once per chunk.
    t = two["tasks"].to_dataframe()
    steps = t[t.kind == DENOISE]
    assert set(steps.pool) == {ROLLOUT}
    members = steps.key.map(ast.literal_eval)  # (keys are stored as their repr)
    steps = steps.assign(step=members.map(lambda k: k[:4]), member=members.map(len) - 4)
    per_step = steps.groupby("step")
    assert (per_step.size() == 2).all() and (per_step.worker_name.nunique() == 2).all()
    assert sorted(set(steps.member)) == [0, 1]
    chunks = steps.groupby([steps.step.map(lambda k: k[1:3])]).worker_name.nunique()
    assert (chunks == 2).all()
    assert len(t[t.kind == DECODE]) == len(steps) // (2 * config(2).sampler.num_steps)


def test_auto_measures_degree_one_first_then_probes_two_for_a_lone_chunk(runs):
    """``auto`` with one chunk an iteration on two rollout workers: degree 1 until a
    measurement of it is in (plans are made while the previous iterations still run),
    then degree 2, predicted faster, probed; the rewards those of the run at degree 1."""
    single = {"iterations": 4, "rollout.chunk_size": 4}
    auto, one = open_run(runs("auto", **single)), open_run(runs(1, **single))
    m = auto["metrics"]
    assert list(m["context_parallel_max"].values) == [1, 1, 1, 2]
    assert list(m["context_parallel_probes"].values) == [0, 0, 0, 1]
    assert np.max(np.abs(auto["samples"]["reward"].values
                         - one["samples"]["reward"].values)) <= 1e-4
    t = auto["tasks"].to_dataframe()
    steps = t[t.kind == DENOISE]
    last = steps[steps.iteration == 3].key.map(ast.literal_eval)
    assert sorted(set(last.map(len))) == [4, 5]        # iteration 3's steps: gangs of 2
    assert set(steps[steps.iteration < 3].key.map(ast.literal_eval).map(len)) == {4}
    # The report tells the choices.
    from digenrl.commands.report import summarise

    assert ("context parallelism (auto), each iteration's mean and highest degree: 1/1, "
            "1/1, 1/1, 2/2; a degree not measured before was probed in iterations [3]"
            ) in summarise(auto)


def test_auto_keeps_a_chunks_activations_within_a_gpus_memory(runs, cluster_2x2):
    """The rollout workers measured a step's activations in the runs before (the first
    degree-1 step of each process: ``digenrl-step-memory`` events). With
    ``cluster.gpu_memory_gb`` leaving room for three quarters of a chunk's beside the
    models a worker keeps (in the fraction of a GPU's memory tensors may take), ``auto`` runs every chunk at degree 2, though there are as
    many chunks as workers (degree 1 by time), and stores the figures it used; the
    rewards are those of the run at degree 1."""
    from digenrl.tasks.footprint import EVENT_TOPIC, USABLE_FRACTION, model_key

    one = open_run(runs(1))
    key = model_key(config(1).model)
    measured = [e for _, e in cluster_2x2.client.get_events(EVENT_TOPIC)
                if e["model"] == key and e["name"].startswith(ROLLOUT)]
    assert measured and all(e["transient_bytes"] > 0 < e["resident_bytes"] for e in measured)
    per_sample = max(e["transient_bytes"] / e["samples"] for e in measured)
    resident = max(e["resident_bytes"] for e in measured)
    chunk = config(1).rollout.chunk_size
    assert one["samples"].sizes["sample"] == 2 * chunk    # two chunks, two workers
    memory_gb = (resident + 0.75 * chunk * per_sample) / 1e9 / USABLE_FRACTION
    free_gb = USABLE_FRACTION * memory_gb - resident / 1e9

    bounded = open_run(runs("auto", **{"cluster.gpu_memory_gb": memory_gb}))
    m = bounded["metrics"]
    assert list(m["context_parallel_max"].values) == [2, 2]
    assert list(m["context_parallel_mean"].values) == [2, 2]
    assert np.allclose(m["context_parallel_sample_gb"].values, per_sample / 1e9)
    assert np.allclose(m["context_parallel_free_gb"].values, free_gb)
    from digenrl.commands.report import summarise

    assert (f"2/2, 2/2; a degree not measured before was probed in iterations [0, 1]; a "
            f"sample's activations {per_sample / 1e9:.3g} GB / degree within "
            f"{free_gb:.3g} GB free per rollout GPU (iteration 1)"
            ) in summarise(bounded)
    assert np.max(np.abs(bounded["samples"]["reward"].values
                         - one["samples"]["reward"].values)) <= 1e-4


@pytest.mark.slow
def test_a_rollout_worker_killed_mid_step_costs_the_run_nothing(runs, tmp_path, cluster_2x2):
    """rollout-1 SIGKILLed while it computes its part of a step of iteration 1: the
    step's other member fails at once (its peer's connection closes) and is taken back,
    the chunk's steps run again on a group formed anew once the nanny's new process
    has joined, and the run gives the undisturbed run's bits."""
    from test_worker_loss import run_killing

    reference = open_run(runs(2))
    path = tmp_path / "run.zarr"
    run_killing(cluster_2x2, path, ROLLOUT, DENOISE, 1, config(2), worker="rollout-1",
                bound=300.0)
    ds = open_run(path)
    assert ds["metrics"].sizes["iteration"] == 2
    for name in ("reward", "advantage", "image", "behaviour_version"):
        assert np.array_equal(ds["samples"][name].values,
                              reference["samples"][name].values), name
    for name in DETERMINISTIC_METRICS:
        assert np.array_equal(ds["metrics"][name].values, reference["metrics"][name].values,
                              equal_nan=True), name
    (v, w), (rv, rw) = read_weights(path), read_weights(runs(2))
    assert v == rv and all(torch.equal(torch.from_numpy(w[n]), torch.from_numpy(rw[n]))
                           for n in rw)


@pytest.mark.slow
def test_a_step_whose_pool_shrank_runs_at_a_lower_degree(runs, tmp_path, cluster_2x2):
    """rollout-1 SIGKILLed while it computes its part of a step of iteration 1, with
    ``schedule.context_parallel_wait: 0``: the step does not wait for the nanny's new
    process but runs again at degree 1 on rollout-0 (its second member after the first,
    there); the run finishes with the undisturbed run's rewards (bar 1e-4). (Whether the
    chunk's later steps find the pool whole again, at degree 2, is the nanny's timing.)"""
    from test_worker_loss import run_killing

    reference = open_run(runs(2))
    path = tmp_path / "run.zarr"
    run_killing(cluster_2x2, path, ROLLOUT, DENOISE, 1,
                config(2, **{"schedule.context_parallel_wait": 0.0}), worker="rollout-1",
                bound=300.0)
    ds = open_run(path)
    assert ds["metrics"].sizes["iteration"] == 2
    assert np.max(np.abs(ds["samples"]["reward"].values
                         - reference["samples"]["reward"].values)) <= 1e-4
    # Each member's last run (a step run again has a record per run): some steps of
    # iteration 1 ran alone on rollout-0 (and any of iteration 0 whose result was lost
    # with rollout-1 and computed again); those before the kill on both workers.
    t = ds["tasks"].to_dataframe()
    steps = t[t.kind == DENOISE].sort_values("stop").drop_duplicates("key", keep="last")
    members = steps.key.map(ast.literal_eval)
    per_step = steps.assign(step=members.map(lambda k: k[:4])).groupby("step")
    assert (per_step.size() == 2).all()
    workers = per_step.worker_name.nunique()
    alone = workers[workers == 1].index
    assert any(step[1] == 1 for step in alone)
    assert (workers == 2).sum() >= 1
