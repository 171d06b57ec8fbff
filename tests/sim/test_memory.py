"""Full-parameter training sharded with FSDP: the memory each GPU holds, the refusal of a
model its GPUs cannot hold, and the collectives the cost model charges."""

import dataclasses
import math

import pytest

from digenrl.commands.cli import main
from digenrl.schedulers.options import MODES, ScheduleOptions
from digenrl.sim.costs import Extras, TaskCosts, WorkerHeld
from digenrl.sim.profile import ProfileError, load_profile, profile_from_dict
from digenrl.sim.simulate import format_reports, simulate
from digenrl.vocabulary import DENOISE, GRAD, REDUCE

FULL = ("flux12b-full-16gpu", "flux12b-full-32gpu", "qwenimage20b-full-16gpu",
        "qwenimage20b-full-32gpu")
GPUS_PER_NODE = 8
SWITCH = 1e-6  # the fat-tree's latency per switch crossed (one leaf at these sizes)


def opts(mode):
    return ScheduleOptions(mode=mode, **MODES[mode])


def small(name):
    p = load_profile(name)
    return dataclasses.replace(p, prompts_per_iteration=max(1, p.prompts_per_iteration // 4))


def test_each_role_holds_what_its_share_of_the_state_takes():
    p = load_profile("qwenimage20b-full-32gpu")
    m, params = p.model, 20.43e9
    mem = p.memory()
    assert mem.rollout_gb == pytest.approx((2 * params) / 1e9 + m.rollout_activations_gb)
    assert mem.trainer_gb == pytest.approx(16 * params / 25 / 1e9 + m.trainer_activations_gb)
    assert mem.colocated_gb == pytest.approx(mem.rollout_gb + 16 * params / 32 / 1e9
                                             + m.trainer_activations_gb)
    # Unsharded, every trainer holds the whole state.
    whole = dataclasses.replace(m, sharding="none").per_gpu(7, 25)
    assert whole.trainer_gb == pytest.approx(16 * params / 1e9 + m.trainer_activations_gb)


def _data(**model):
    return {"name": "x", "rollout_workers": 4, "trainer_workers": 12,
            "prompts_per_iteration": 16, "samples_per_prompt": 16, "chunk_size": 4,
            "num_steps": 10, "trained_steps": 9, "costs": {"denoise_per_sample": 0.47},
            "model": {"params": 20.43, "sharding": "fsdp", "gpu_memory_gb": 80,
                      "rollout_activations_gb": 18, "trainer_activations_gb": 18.5, **model}}


@pytest.mark.parametrize("model,says", [
    ({"gpu_memory_gb": 40}, "profile.model.gpu_memory_gb: expected at least the 58.9 GB a "
                            "rollout GPU holds (2 bytes x 20.43e9 params + 18 GB), got 40.0"),
    ({"sharding": "none"}, "profile.model.gpu_memory_gb: expected at least the 345.4 GB a "
                           "trainer GPU holds (16 bytes x 20.43e9 params + 18.5 GB), got 80.0"),
    ({"sharding": "zero3"}, "profile.model.sharding: expected one of ['none', 'fsdp'], "
                            "got 'zero3'"),
    ({"params": 0}, "profile.model.params: expected a number > 0"),
])
def test_a_model_its_gpus_cannot_hold_is_refused_in_one_line(model, says):
    with pytest.raises(ProfileError) as e:
        profile_from_dict(_data(**model))
    assert str(e.value).startswith(says) and "\n" not in str(e.value)


def test_sharded_profiles_derive_their_bytes_from_the_size():
    data = _data()
    data["costs"] = {**data["costs"], "weight_bytes": 40.9e9}
    with pytest.raises(ProfileError, match=r"^profile\.costs\.weight_bytes: expected no value "
                                           r"with model\.sharding fsdp"):
        profile_from_dict(data)
    p = profile_from_dict(_data())
    assert p.costs.weight_bytes == 2 * 20.43e9 and p.costs.grad_bytes == 4 * 20.43e9


def test_colocated_holds_both_roles_and_is_refused_before_any_work():
    p = small("qwenimage20b-full-32gpu")
    with pytest.raises(ProfileError) as e:
        simulate(p, opts("colocated"), 3)
    msg = str(e.value)
    assert msg.startswith("profile.model.gpu_memory_gb: expected at least the 87.6 GB a "
                          "co-located GPU holds") and msg.endswith("got 80.0")
    assert "/ 32 ranks" in msg and "\n" not in msg
    # The disaggregated pools hold their roles.
    assert simulate(p, opts("disaggregated"), 3).images_per_s > 0
    # FLUX's smaller model fits both roles on one GPU.
    flux = load_profile("flux12b-full-16gpu").memory()
    assert flux.colocated_gb < flux.gpu_memory_gb == 80


def _ring(ranks, nbytes, bandwidth, latency):
    """(ranks-1)/ranks of the bytes over the slowest link, one latency a step."""
    return (ranks - 1) / ranks * nbytes / bandwidth + (ranks - 1) * latency


def test_a_micro_step_pays_two_all_gathers_and_an_iteration_one_reduce_scatter():
    for name in FULL:
        p = load_profile(name)
        net, params = p.network, p.model.params * 1e9
        lat = net.latency + SWITCH
        for colocated, ranks in ((False, p.trainer_workers), (True, p.gpus)):
            # Every sharded group here spans nodes: the network's bandwidth bounds it.
            assert ranks > GPUS_PER_NODE
            gather = 2 * _ring(ranks, 2 * params, net.bandwidth, lat)   # bf16, fwd + bwd
            scatter = _ring(ranks, 4 * params, net.bandwidth, lat)      # fp32 gradients
            extras = Extras.of(p, colocated=colocated)
            held = WorkerHeld()
            assert extras.pay(held, GRAD, 0, rollout_worker=False) == pytest.approx(gather)
            assert held.gathered == pytest.approx(gather)
            if colocated:   # each GPU gathers a version's bf16 weights once to sample with
                assert extras.weight_sync == pytest.approx(gather / 2)
                fresh = WorkerHeld()
                assert extras.pay(fresh, DENOISE, 0, rollout_worker=False) == extras.weight_sync
                assert extras.pay(fresh, DENOISE, 0, rollout_worker=True) == 0.0
            assert extras.pay(held, GRAD, 0, rollout_worker=False) == pytest.approx(gather)
            layout, plans = p.layout(), p.plans(1)
            costs = TaskCosts(p, layout, plans, colocated=colocated)
            root = layout.reduce_root(plans[0])
            assert costs.seconds(REDUCE, 0, root, 0) == pytest.approx(scatter)
    # A rollout worker lent a micro-step holds the version's weights whole: no gather.
    extras = Extras.of(load_profile("flux12b-full-16gpu"), colocated=False)
    held = WorkerHeld()
    assert extras.pay(held, GRAD, 0, rollout_worker=True) == extras.weight_sync
    assert held.gathered == 0


def test_each_version_is_broadcast_in_buckets_filled_while_one_is_in_flight():
    for name, nvlink_chain in (("flux12b-full-16gpu", True), ("flux12b-full-32gpu", False)):
        p = load_profile(name)
        net, weights = p.network, 2 * p.model.params * 1e9
        bucket = net.sync_bucket_mb * 2**20
        t, r = p.trainer_workers, p.rollout_workers
        # The sending trainer (the last) and the rollout workers after it: one node or more.
        assert ((t - 1) // GPUS_PER_NODE == (t + r - 1) // GPUS_PER_NODE) == nvlink_chain
        sizes = [bucket] * int(weights // bucket) + [weights % bucket]
        fill = [_ring(t, b, net.bandwidth, net.latency + SWITCH) for b in sizes]
        if nvlink_chain:
            send = [b / 450e9 + r * net.latency for b in sizes]
        else:
            send = [b / net.bandwidth + r * (net.latency + SWITCH) for b in sizes]
        expected = fill[0] + sum(max(s, f) for s, f in zip(send, fill[1:])) + send[-1]
        extras = Extras.of(p, colocated=False)
        assert extras.weight_sync == pytest.approx(expected)
        # Paid once per version by each rollout worker, never by a trainer.
        held = WorkerHeld()
        assert extras.pay(held, DENOISE, 3, rollout_worker=True) == extras.weight_sync
        assert extras.pay(held, DENOISE, 3, rollout_worker=True) == 0.0
        assert extras.pay(WorkerHeld(), DENOISE, 3, rollout_worker=False) == 0.0
        # Bandwidth-bound: no faster than the weights over one NIC, less the first bucket.
        assert extras.weight_sync > (weights - bucket) / net.bandwidth * (t - 1) / t


def test_the_sharded_profiles_report_their_share_of_time_in_collectives():
    p = small("flux12b-full-16gpu")
    r = simulate(p, opts("digenrl"), 3)
    assert 0 < r.collective_share < 0.5
    plain = simulate(small("flux12b-16gpu"), opts("digenrl"), 3)
    assert plain.collective_share is None
    table = format_reports([("digenrl", r)])
    assert table.splitlines()[0].endswith("collectives")
    assert f"{100 * r.collective_share:.1f}%" in table.splitlines()[2]
    assert "collectives" not in format_reports([("digenrl", plain)])
    assert not math.isnan(r.images_per_s) and r.images_per_s < plain.images_per_s


def test_simulate_prints_the_memory_per_gpu_and_refuses_a_variant_that_does_not_fit(capsys):
    argv = ["simulate", "qwenimage20b-full-16gpu", "--iterations", "3"]
    assert main(argv + ["--variants", "digenrl,colocated"]) == 2
    out, err = capsys.readouterr()
    assert not out   # refused before anything is simulated
    assert ("profile.model.gpu_memory_gb: expected at least the 97.8 GB a co-located GPU "
            "holds") in err
    assert main(argv + ["--variants", "digenrl"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == ("memory per GPU of 80 GB: rollout 58.9 GB, trainer 45.7 GB (state over "
                      "12), colocated 97.8 GB (state over 16)")
    assert out[1].endswith("collectives") and out[3].startswith("digenrl")


def test_emulated_gpus_that_cannot_hold_the_model_are_refused_before_a_cluster(tmp_path):
    from digenrl.commands.bench import bench_profile

    with pytest.raises(ProfileError, match=r"^profile\.model\.gpu_memory_gb: expected at "
                                           r"least the 87\.6 GB a co-located GPU holds"):
        bench_profile(small("qwenimage20b-full-32gpu"), ["digenrl", "colocated"],
                      tmp_path / "out", iterations=3, dashboard_address=None)
    assert not (tmp_path / "out").exists()
