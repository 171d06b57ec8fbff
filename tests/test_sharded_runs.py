"""Whole runs trained sharded (``train.sharding: fsdp``) on real local Dask clusters: the
trainers form a gloo group and every micro-step, optimizer step and checkpoint is a gang
of tasks, one per trainer. Against the unsharded run of the same config: the rewards,
each iteration's gradient norm and the weights' change agree (every algorithm, in
``digenrl`` and ``colocated`` modes); a run that loses a trainer mid-step resumes itself
from its sharded checkpoint and gives the same bits as the undisturbed run of the same
config (so the same sharded run twice is the same bits, and resuming changes none); a
stopped run resumes on another number of trainers."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from digenrl.graph.build import GraphContext
from digenrl.run.runner import Runner
from digenrl.store import open_run, read_attrs
from digenrl.store.checkpoints import complete_checkpoints, read_weights
from digenrl.store.sharded import sharded_checkpoints
from digenrl.tasks.train import init_state
from digenrl.vocabulary import GRAD, INIT, OPTIMIZE, PUBLISH, REDUCE, ROLLOUT, TRAINER

from conftest import DETERMINISTIC_METRICS, small_config

#: Each compared config: the algorithm (with the KL term for Flow-GRPO: its reference
#: is read by every micro-step), the mode, and the cluster (digenrl mode shards over the
#: trainer pool, colocated mode over every worker). Versions are published by broadcast
#: (``train.weight_sync: auto``), DPO's through Dask.
CASES = {
    "flow_grpo-kl-digenrl": ({"train.kl_beta": 0.05}, "digenrl", "cluster_2x2"),
    "diffusion_nft-digenrl": ({"algorithm.name": "diffusion_nft"}, "digenrl", "cluster_2x2"),
    "awm-colocated": ({"algorithm.name": "awm"}, "colocated", "cluster_1x1"),
    "dpo-colocated": ({"algorithm.name": "dpo", "train.weight_sync": "dask"}, "colocated",
                      "cluster_1x1"),
}


#: Each cluster's workers per pool.
WORKERS = {"cluster_1x1": 1, "cluster_2x2": 2}


def config(case: str, sharding: str, **overrides):
    """The case's config; a collective waits at most 30 s for a lost member."""
    settings, mode, cluster = CASES[case]
    return small_config(**{**settings, "schedule.mode": mode, "train.sharding": sharding,
                           "cluster.rollout_workers": WORKERS[cluster],
                           "cluster.trainer_workers": WORKERS[cluster],
                           "cluster.collective_timeout": 30.0, **overrides})


#: The runs made so far in this process: (case, sharding, overrides) -> (store path, the
#: store opened, the final weights, what each worker held of them when the run ended).
_MADE: dict = {}


@pytest.fixture
def runs(tmp_path_factory, cluster_1x1, cluster_2x2):
    """``runs(case, sharding, **overrides)``: the run of that config on its case's cluster
    (its store's path, the store opened, its final weights, and each worker's resident
    weights of the final version, by name), made once."""
    clusters = {"cluster_1x1": cluster_1x1, "cluster_2x2": cluster_2x2}

    def get(case: str, sharding: str, **overrides):
        key = (case, sharding, tuple(sorted(overrides.items())))
        if key not in _MADE:
            path = tmp_path_factory.mktemp("sharded") / "run.zarr"
            cluster = clusters[CASES[case][2]]
            result = Runner(config(case, sharding, **overrides), str(path),
                            cluster=cluster).run()
            _MADE[key] = (str(path), open_run(path), result.final_weights,
                          held_by_worker(cluster.client, result.final_weights))
        return _MADE[key]

    return get


def held_by_worker(client, weights) -> dict[str, dict[str, torch.Tensor] | None]:
    """What each worker computes with for the version ``weights`` are (its resident
    transformer's trainable tensors; None where it holds none), by worker name."""
    version, copy = weights.version, weights.sampling_copy

    def loaded(dask_worker):
        from digenrl.tasks.resident import PLUGIN_NAME

        models = dask_worker.plugins[PLUGIN_NAME].models   # (the run's resident state)
        return str(dask_worker.name), models.loaded(version, copy)

    return dict(client.run(loaded).values())


def relative(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """``|a - b| / |b|`` over all tensors."""
    num = sum(float(((a[n] - b[n]).double() ** 2).sum()) for n in b)
    den = sum(float((b[n].double() ** 2).sum()) for n in b)
    return (num / den) ** 0.5


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_a_sharded_run_agrees_with_the_unsharded_one(runs, case):
    """Three iterations: the rewards within 1e-4, each iteration's gradient norm within
    1e-5 (relative), the weights' change from version 0 within 1e-3 of the unsharded
    change (norm of the difference over the norm); micro-steps ran on every member of
    the gang, with no reduction tasks; the store holds the sharded checkpoints of the
    versions the unsharded run keeps checkpoints of, and no other checkpoints."""
    path, ds, weights, _ = runs(case, "fsdp")
    ref_path, ref, ref_weights, _ = runs(case, "none")
    reward, ref_reward = ds["samples"]["reward"].values, ref["samples"]["reward"].values
    assert reward.shape == ref_reward.shape == (3, 4)
    assert np.abs(reward - ref_reward).max() <= 1e-4
    norms, ref_norms = ds["metrics"]["grad_norm"].values, ref["metrics"]["grad_norm"].values
    assert (np.abs(norms - ref_norms) <= 1e-5 * ref_norms).all(), (norms, ref_norms)
    v0 = init_state(GraphContext.from_config(config(case, "none")).train).state.params
    assert weights.version == ref_weights.version == 3
    change = {n: weights.tensors[n] - v0[n] for n in v0}
    ref_change = {n: ref_weights.tensors[n] - v0[n] for n in v0}
    assert relative(ref_change, v0) > 1e-4          # (it trained)
    assert relative(change, ref_change) <= 1e-3
    tasks = ds["tasks"]
    kinds = np.array([str(k) for k in tasks["kind"].values])
    workers = np.array([str(w) for w in tasks["worker_name"].values])
    gang = {"cluster_2x2": {"trainer-0", "trainer-1"},
            "cluster_1x1": {"rollout-0", "trainer-0"}}[CASES[case][2]]
    assert set(workers[kinds == GRAD]) == gang
    assert set(workers[kinds == OPTIMIZE]) == gang
    assert REDUCE not in set(kinds)
    # The same versions kept as the unsharded run's checkpoints, and only sharded.
    assert complete_checkpoints(path) == []
    assert sorted(sharded_checkpoints(path)) == complete_checkpoints(ref_path)


@pytest.mark.slow
@pytest.mark.parametrize("case", ["flow_grpo-kl-digenrl", "awm-colocated"])
def test_each_version_is_broadcast_to_every_worker_and_none_travels_through_dask(runs,
                                                                                case):
    """A sharded run publishes by broadcast (``train.weight_sync: auto``): every worker
    of the run (the rollout pool's and every trainer) holds the final version, the same
    bits as the trainers' full weights of it (its sharded checkpoint); no task's result
    carries weights, while the unsharded run's ``publish`` results are the weights."""
    _, ds, weights, held = runs(case, "fsdp")
    _, ref, ref_weights, _ = runs(case, "none")
    workers = {"cluster_2x2": ["rollout-0", "rollout-1", "trainer-0", "trainer-1"],
               "cluster_1x1": ["rollout-0", "trainer-0"]}[CASES[case][2]]
    assert sorted(held) == workers
    for name in workers:
        got = held[name]
        assert got is not None, name
        assert sorted(got) == sorted(weights.tensors)
        assert all(torch.equal(got[n], weights.tensors[n]) for n in got), name
    size = sum(t.numel() * t.element_size() for t in weights.tensors.values())

    def largest(store, kinds) -> int:
        tasks = store["tasks"]
        kind = np.array([str(k) for k in tasks["kind"].values])
        return int(tasks["nbytes"].values[np.isin(kind, kinds)].max())

    assert largest(ref, [PUBLISH]) >= size
    assert largest(ds, [PUBLISH, OPTIMIZE, INIT]) < size / 20
    assert ds["metrics"]["weight_sync_bytes"].values[-1] == size
    # Each iteration's version received by every worker but the sender, and timed.
    receivers = len(workers) - 1
    assert (ds["metrics"]["weight_sync_transfers"].values >= receivers).all()
    assert (ds["metrics"]["weight_sync_seconds"].values > 0).all()


@pytest.mark.slow
def test_a_worker_outside_the_group_reads_a_broadcast_version_from_its_checkpoint(runs):
    """A process that did not receive a broadcast version (a worker that joined the pool
    later) computes with it as read from the version's sharded checkpoint, the same bits
    as the workers that received it; a version without a checkpoint is one line."""
    from digenrl.tasks.resident import ResidentModels
    from digenrl.tasks.types import PolicyWeights

    path, _, weights, held = runs("flow_grpo-kl-digenrl", "fsdp")
    spec = GraphContext.from_config(config("flow_grpo-kl-digenrl", "fsdp")).rollout
    models = ResidentModels(spec.model, spec.model_seed, trainable=spec.trainable)
    kept = sorted(sharded_checkpoints(path))
    assert weights.version in kept
    models.policy(PolicyWeights(weights.version, {}, held=True, store=path))
    got = models.loaded(weights.version)
    assert got is not None
    assert all(torch.equal(got[n], held["rollout-0"][n]) for n in got)
    missing = next(v for v in range(weights.version) if v not in kept)
    with pytest.raises(RuntimeError) as e:
        models.policy(PolicyWeights(missing, {}, held=True, store=path))
    assert str(e.value).startswith(f"policy version {missing}: expected it in this "
                                   f"worker's resident transformer")
    assert "\n" not in str(e.value)


@pytest.mark.slow
def test_a_sharded_run_resumes_on_another_number_of_trainers(runs, tmp_path, cluster_1x1,
                                                             cluster_2x2):
    """A colocated run of two iterations sharded over the 2 workers of one cluster,
    resumed on the 4 of another: its third iteration within the bars of an unsharded
    run of the uninterrupted one (the checkpoint resharded from 2 ranks to 4)."""
    _, ref, ref_weights, _ = runs("awm-colocated", "fsdp")
    path = tmp_path / "run.zarr"
    Runner(config("awm-colocated", "fsdp", iterations=2), str(path),
           cluster=cluster_1x1).run()
    assert sharded_checkpoints(path)[2]["ranks"] == 2
    result = Runner(config("awm-colocated", "fsdp"), str(path), resume=True,
                    cluster=cluster_2x2).run()
    ds = open_run(path)
    assert np.abs(ds["samples"]["reward"].values - ref["samples"]["reward"].values).max() \
        <= 1e-4
    assert sharded_checkpoints(path)[3]["ranks"] == 4
    assert relative(result.final_weights.tensors, ref_weights.tensors) <= 1e-5


def test_a_sharded_run_on_a_cluster_with_one_trainer_stops_before_its_store(tmp_path,
                                                                            cluster_1x1):
    """A config that counts two trainers, run on a cluster that has one (a cluster the
    run does not start): one line naming the field, and no store."""
    from digenrl.config import ConfigError

    path = tmp_path / "run.zarr"
    with pytest.raises(ConfigError) as e:
        Runner(small_config(**{"train.sharding": "fsdp", "cluster.trainer_workers": 2}),
               str(path), cluster=cluster_1x1).run()
    assert str(e.value) == ("train.sharding: expected fsdp over at least 2 workers of the "
                            "trainer pool (the cluster has 1), got 'fsdp'")
    assert not path.exists()


#: The iteration from which a trainer may be killed (of the runs' three).
KILL_FROM = 1


@pytest.mark.slow
@pytest.mark.parametrize("kind, pool, worker", [(GRAD, TRAINER, "trainer-1"),
                                                (OPTIMIZE, TRAINER, "trainer-1"),
                                                (PUBLISH, ROLLOUT, "rollout-1")])
def test_a_worker_killed_in_a_gang_step_costs_the_run_nothing(runs, tmp_path, kind, pool,
                                                              worker, cluster_1x1,
                                                              cluster_2x2):
    """A trainer SIGKILLed while it computes its part of a micro-step round, or of an
    optimizer step, or a rollout worker while it receives a version's broadcast: the
    gang's step fails (the survivors' collectives at once, or within the group's
    timeout), the run forms a new gang once the nanny's new process has joined, resumes
    from its newest sharded checkpoint and stores every iteration once, the same bits as
    the undisturbed run (its samples, metrics and final weights as stored). Bounded: the
    run must end within 300 s of the kill (a collective waits at most
    ``cluster.collective_timeout``, 30 s here)."""
    from test_worker_loss import run_killing

    _, ref, ref_weights, _ = runs("flow_grpo-kl-digenrl", "fsdp")
    path = tmp_path / "run.zarr"
    run_killing(cluster_2x2, path, pool, kind, KILL_FROM,
                config("flow_grpo-kl-digenrl", "fsdp"), worker=worker, bound=300.0)
    ds = open_run(path)
    assert ds["metrics"].sizes["iteration"] == 3
    for name in ("reward", "advantage", "behaviour_version"):
        assert np.array_equal(ds["samples"][name].values, ref["samples"][name].values), name
    for name in DETERMINISTIC_METRICS:
        assert np.array_equal(ds["metrics"][name].values, ref["metrics"][name].values,
                              equal_nan=True), name
    version, weights = read_weights(path)
    assert version == ref_weights.version
    assert all(torch.equal(torch.from_numpy(weights[n]), ref_weights.tensors[n])
               for n in ref_weights.tensors)
    # Resumed once, by the run itself, at an iteration the kill left uncommitted.
    [resumed] = read_attrs(path)["resumed"]
    assert KILL_FROM <= resumed["at_iteration"] < 3
