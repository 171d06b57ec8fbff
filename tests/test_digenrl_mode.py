"""Mode ``digenrl`` on real local clusters: what the tasks and samples groups show."""

import numpy as np
import pytest
import torch

from digenrl.commands.report import summarise
from digenrl.run.runner import Runner
from digenrl.store import open_run

from conftest import assert_same_results, pipelined_config, small_config
from invariants import assert_schedule_invariants


def run(cfg, cluster, path):
    result = Runner(cfg, str(path), cluster=cluster).run()
    ds = open_run(path)
    return result, ds, ds["tasks"].to_dataframe()


def shared(shared_runs, cfg, cluster):
    """:func:`run`, made once for every test that asks for the same work (the run with
    mode digenrl's own staleness bound is the reference run of the reliability tests)."""
    r = shared_runs(cluster, cfg)
    return r.result, r.ds, r.ds["tasks"].to_dataframe()


@pytest.mark.parametrize("k", [0, 1, 2])
def test_no_sample_is_trained_beyond_the_staleness_bound(cluster_1x1, shared_runs, k):
    cfg = small_config(**{"iterations": 4, "schedule.max_staleness": k})
    _, ds, t = shared(shared_runs, cfg, cluster_1x1)
    assert_schedule_invariants(t, cfg.schedule.options())
    s = ds["samples"]
    staleness = s.trained_version.values - s.behaviour_version.values
    assert (staleness <= k).all() and (staleness >= 0).all()
    expected = np.minimum(np.arange(4), k)[:, None]
    assert (staleness == expected).all()
    assert ds["metrics"].staleness_mean.values.tolist() == expected[:, 0].tolist()


def test_max_staleness_zero_is_bit_identical_to_disaggregated(cluster_2x2, shared_runs,
                                                              tmp_path):
    a, da, _ = run(small_config(**{"schedule.max_staleness": 0}), cluster_2x2, tmp_path / "a")
    # (test_end_to_end's results_do_not_depend_on_worker_count_or_mode reads this run too)
    b, db, _ = shared(shared_runs, small_config(**{"schedule.mode": "disaggregated"}),
                      cluster_2x2)
    assert np.array_equal(da["samples"].reward.values, db["samples"].reward.values)
    wa, wb = a.final_weights.tensors, b.final_weights.tensors
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


@pytest.mark.parametrize("cluster", ["cluster_1x1", "cluster_2x2"])
def test_gap_tsp_tag_as_the_tasks_group_records_them(request, shared_runs, cluster):
    cfg = pipelined_config()
    # (on cluster_1x1 test_telemetry_reaches_the_store_and_the_plugin_rpc reads this run)
    result, ds, t = shared(shared_runs, cfg, request.getfixturevalue(cluster))
    # GAP: in every iteration training starts before its last denoise step is done
    # (scheduler clock: a grad was released before the last denoise was reported).
    for i in range(4):
        it = t[t.iteration == i]
        assert it[it.kind == "grad"].released.min() < it[it.kind == "denoise"].finished.max(), i
    # Pools, TAG (only while no grad task is runnable), the staleness bound, the slots.
    assert_schedule_invariants(t, cfg.schedule.options())
    # TAG: trainers generate.
    assert t.tag.sum() > 0
    assert (ds["samples"].trained_version - ds["samples"].behaviour_version).max() <= 1


def test_rollout_assisted_training_changes_no_bit(cluster_1x1, shared_runs, tmp_path):
    cfg = pipelined_config()
    assert cfg.schedule.options().rat   # mode digenrl lends rollout workers
    on = shared_runs(cluster_1x1, cfg)
    t = on.ds["tasks"].to_dataframe()
    lent = t[t.rat]
    # The rollout worker trained: grads only, each on the rollout pool.
    assert len(lent) > 0
    assert lent.kind.eq("grad").all() and lent.pool.eq("rollout").all()
    assert on.state["counters"]["rat_released"] >= len(lent)
    off = pipelined_config(**{"schedule.rat": False})
    result, ds, t_off = run(off, cluster_1x1, tmp_path / "off.zarr")
    assert not t_off.rat.any()
    assert not t_off[t_off.kind == "grad"].pool.eq("rollout").any()
    assert_same_results(ds, result.final_weights.tensors, (on.result, on.ds))
    # The report counts the lent GPU-seconds and advises a split from the task times.
    text = summarise(on.ds)
    assert "rollout-assisted training" in text and "pool sizing:" in text


def test_tsp_spreads_a_chunks_micro_steps_over_trainers(cluster_2x2, tmp_path):
    cfg = pipelined_config(**{"sampler.num_steps": 6, "sampler.timestep_fraction": 0.67})
    _, _, t = run(cfg, cluster_2x2, tmp_path / "r.zarr")
    grads = t[t.kind == "grad"]
    overlapping = 0
    for _, g in grads.groupby(["iteration", "chunk"]):
        rows = list(g.itertuples())
        for x in rows:
            for y in rows:
                if x.worker < y.worker and x.start < y.stop and y.start < x.stop:
                    overlapping += 1
    assert overlapping > 0
    # Without TSP every chunk trains on one trainer (two iterations show it).
    _, _, t2 = run(pipelined_config(**{"schedule.tsp": False, "iterations": 2}), cluster_2x2,
                   tmp_path / "r2.zarr")
    assert (t2[t2.kind == "grad"].groupby(["iteration", "chunk"]).worker.nunique() == 1).all()


def test_without_tag_trainers_never_generate(cluster_2x2, tmp_path):
    cfg = pipelined_config(**{"schedule.tag": False, "iterations": 2})
    _, _, t = run(cfg, cluster_2x2, tmp_path / "r.zarr")
    assert_schedule_invariants(t, cfg.schedule.options())
    rollout = {"encode", "noise", "denoise", "decode", "reward"}
    assert not t[t.kind.isin(rollout)].pool.eq("trainer").any()


def test_telemetry_reaches_the_store_and_the_plugin_rpc(cluster_1x1, shared_runs):
    r = shared_runs(cluster_1x1, pipelined_config())
    ds = r.ds
    m = ds["metrics"]
    for name in ("utilisation_rollout", "utilisation_trainer", "tag_seconds", "gpu_wait_mean"):
        assert name in m
    assert ((m.utilisation_trainer.values > 0) & (m.utilisation_trainer.values <= 1)).all()
    assert np.isnan(m.utilisation_colocated.values).all()
    assert m.tag_seconds.values.sum() > 0
    # The plugin's RPCs, read right after the run.
    state = r.state
    assert state["policy_version"] == 4 and state["options"]["mode"] == "digenrl"
    assert set(state["pools"]) == {"rollout", "trainer"} and "held" in state
    timeline = r.timeline
    assert len(timeline) > 2
    versions = [s["policy_version"] for s in timeline]
    assert versions == sorted(versions) and versions[-1] == 4
    assert any(s["pools"]["trainer"]["tag"] for s in timeline)
