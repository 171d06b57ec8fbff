"""The network study: weight sync and all-reduce on a fat-tree against circuits."""

import dataclasses
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from digenrl.commands.cli import main
from digenrl.sim.network import (CircuitFabric, FatTree, Placement, allreduce_time,
                                 format_network_study, network_case, network_study,
                                 weight_sync_time)
from digenrl.sim.profile import list_profiles, load_profile

W = 24e9  # FLUX-sized weights / gradients in bf16


@pytest.fixture(scope="module")
def flux():
    return load_profile("flux12b-16gpu")


placements = st.builds(Placement, trainers=st.integers(1, 300), rollouts=st.integers(1, 300))
leaves = st.integers(1, 8)


@settings(max_examples=60, deadline=None)
@given(placements, leaves, st.sampled_from([0.0, 1e9, 24e9]))
def test_circuits_at_one_to_one_and_no_delay_are_never_slower(place, nodes_per_leaf, size):
    tree = FatTree(oversubscription=1.0, nodes_per_leaf=nodes_per_leaf)
    ocs = CircuitFabric(switching_delay=0.0)
    for pattern in (weight_sync_time, allreduce_time):
        t, c = pattern(place, tree, size), pattern(place, ocs, size)
        assert c.seconds <= t.seconds + 1e-12
        assert c.intra_node_s == pytest.approx(t.intra_node_s)  # NVLink is the same


@settings(max_examples=40, deadline=None)
@given(placements, leaves, st.sampled_from([1.0, 2.0, 4.0, 8.0]))
def test_oversubscription_never_speeds_the_tree_up(place, nodes_per_leaf, s):
    tree = FatTree(oversubscription=1.0, nodes_per_leaf=nodes_per_leaf)
    over = FatTree(oversubscription=s, nodes_per_leaf=nodes_per_leaf)
    for pattern in (weight_sync_time, allreduce_time):
        assert pattern(place, over, W).seconds >= pattern(place, tree, W).seconds


@pytest.mark.parametrize("fabric", [FatTree(oversubscription=4), CircuitFabric()])
def test_allreduce_grows_with_gradient_bytes_and_falls_with_bandwidth(fabric):
    place = Placement(trainers=64, rollouts=32)
    times = [allreduce_time(place, fabric, b).seconds for b in (1e9, 4e9, 16e9)]
    assert times[0] < times[1] < times[2]
    slow = dataclasses.replace(fabric, nic_bandwidth=fabric.nic_bandwidth / 2)
    fast_nvlink = dataclasses.replace(fabric, nvlink_bandwidth=fabric.nvlink_bandwidth * 2)
    base = allreduce_time(place, fabric, W)
    assert allreduce_time(place, slow, W).inter_node_s > base.inter_node_s
    assert allreduce_time(place, fast_nvlink, W).intra_node_s < base.intra_node_s


def test_allreduce_matches_the_hierarchical_ring_formula():
    place = Placement(trainers=16, rollouts=8)  # two full trainer nodes, one rollout node
    ocs = CircuitFabric(latency=5e-6)
    t = allreduce_time(place, ocs, W)
    # NVLink reduce-scatter + all-gather among 8, then a 2-node ring on 8 rails.
    assert t.intra_node_s == pytest.approx(2 * (7 / 8 * W / 450e9 + 7 * 5e-6))
    assert t.inter_node_s == pytest.approx(2 * (1 / 2) * (W / 8) / 50e9 + 2 * 5e-6)
    # A node shared with the rollout pool leaves fewer rails: more bytes per NIC.
    shared = allreduce_time(Placement(trainers=12, rollouts=4), ocs, W)
    assert shared.inter_node_s == pytest.approx(2 * (1 / 2) * (W / 4) / 50e9 + 2 * 5e-6)


def test_one_node_has_no_inter_node_traffic(flux):
    place = Placement(trainers=1, rollouts=1)
    for fabric in (FatTree(oversubscription=4), CircuitFabric(switching_delay=0.1)):
        assert not weight_sync_time(place, fabric, W).crosses_nodes
        assert allreduce_time(place, fabric, W).seconds == 0.0  # a single trainer
        assert weight_sync_time(place, fabric, W).seconds == pytest.approx(W / 450e9 + 5e-6)
    case = network_case(flux, 2, 4.0)
    assert case.nodes == 1 and case.switches == 0
    assert case.tree_s == pytest.approx(case.circuit_s(0.1))
    assert case.break_even_raw() is None  # nothing to win


def test_oversubscription_does_not_matter_inside_one_leaf(flux):
    cases = [network_case(flux, 32, s) for s in (1.0, 2.0, 4.0)]  # 4 nodes, one leaf
    assert len({round(c.tree_s, 12) for c in cases}) == 1


def test_a_node_order_ring_crosses_each_leaf_once():
    """Each leaf sends one ring link per rail up: only an oversubscription beyond the
    nodes per leaf slows the all-reduce."""
    place = Placement(trainers=512, rollouts=128)
    times = {s: allreduce_time(place, FatTree(oversubscription=s, nodes_per_leaf=4), W)
             for s in (1.0, 2.0, 4.0, 8.0)}
    assert times[1.0].inter_node_s == pytest.approx(times[4.0].inter_node_s)
    assert times[8.0].inter_node_s > 1.5 * times[4.0].inter_node_s


def test_cross_pool_weight_sync_pays_the_oversubscription(flux):
    # 1,024 GPUs: 88 trainer nodes, 40 rollout nodes, under different leaves.
    case = network_case(flux, 1024, 4.0)
    slice_time = W / 8 / 50e9
    assert case.tree_sync.inter_node_s == pytest.approx(4 * slice_time, rel=1e-3)
    assert case.circuit_sync.inter_node_s == pytest.approx(slice_time, rel=1e-3)


def test_switches_are_counted_per_inter_node_pattern(flux):
    # At 16 GPUs the rollout workers share a node with trainers: weight sync is NVLink
    # only, the circuits serve the all-reduce alone and never switch.
    small = network_case(flux, 16, 4.0)
    assert not small.circuit_sync.crosses_nodes and small.circuit_allreduce.crosses_nodes
    assert small.switches == 0 and small.break_even_raw() == math.inf
    big = network_case(flux, 256, 4.0)
    assert big.switches == 2
    assert big.circuit_s(0.01) - big.circuit_s(0.0) == pytest.approx(2 * 0.01)


@pytest.mark.parametrize("s", [2.0, 4.0])
def test_break_even_is_positive_when_the_tree_is_oversubscribed(flux, s):
    for gpus in (256, 1024, 2048):
        case = network_case(flux, gpus, s)
        d = case.break_even_raw()
        assert d is not None and 0 < d < math.inf
        assert case.gain_s(d * 0.99) > 0 > case.gain_s(d * 1.01)
        sync = case.break_even_sync()
        assert sync >= d
        assert case.exposed_sync_circuit_s(sync * 0.99) < case.tree_s
        assert case.exposed_sync_circuit_s(sync * 1.01) > case.tree_s
    assert network_case(flux, 1024, 4.0).break_even_raw() > network_case(
        flux, 1024, 2.0).break_even_raw()


def test_pipelined_iterations_hide_the_traffic_unless_compute_is_short(flux):
    case = network_case(flux, 1024, 4.0)
    assert case.exposed_pipelined_tree_s == 0.0 and case.break_even_pipelined() is None
    assert case.hidden_up_to() > 1.0
    # A thousand times less compute per iteration: the traffic shows.
    quick = dataclasses.replace(flux, costs=dataclasses.replace(
        flux.costs, denoise_per_sample=flux.costs.denoise_per_sample / 1e4,
        decode_per_sample=0.0, reward_per_sample=0.0, optimizer_step=0.0))
    short = network_case(quick, 1024, 4.0)
    assert short.exposed_pipelined_tree_s > 0
    assert short.break_even_pipelined() == pytest.approx(short.break_even_raw())
    assert short.exposed_pipelined_circuit_s(0.0) < short.exposed_pipelined_tree_s


@pytest.mark.parametrize("make, field, expected, got", [
    (lambda: FatTree(oversubscription=0.5), "FatTree.oversubscription", ">= 1", "0.5"),
    (lambda: FatTree(nodes_per_leaf=0), "FatTree.nodes_per_leaf", "integer >= 1", "0"),
    (lambda: FatTree(nic_bandwidth=0), "FatTree.nic_bandwidth", "> 0", "0"),
    (lambda: FatTree(latency=True), "FatTree.latency", ">= 0", "True"),
    (lambda: CircuitFabric(switching_delay=-1e-3), "CircuitFabric.switching_delay", ">= 0",
     "-0.001"),
    (lambda: CircuitFabric(nvlink_bandwidth=float("nan")), "CircuitFabric.nvlink_bandwidth",
     "finite number > 0", "nan"),
    (lambda: Placement(trainers=0, rollouts=4), "Placement.trainers", "integer >= 1", "0"),
    (lambda: allreduce_time(Placement(2, 2), FatTree(), -1.0), "allreduce_time.grad_bytes",
     ">= 0", "-1.0"),
    (lambda: weight_sync_time(Placement(2, 2, gpus_per_node=4), FatTree(), W),
     "Placement.gpus_per_node", "the fabric's 8", "4"),
    (lambda: network_case(load_profile("flux12b-16gpu"), 1), "network_case.gpus",
     "integer >= 2", "1"),
    (lambda: network_case(load_profile("flux12b-16gpu"), 64, delays=(1e-3, -1.0)),
     "network_case.delays", ">= 0", "-1.0"),
    (lambda: network_study([load_profile("flux12b-16gpu")], delays=()),
     "network_study.delays", "at least one", "()"),
])
def test_bad_parameters_name_the_field_expected_and_got(make, field, expected, got):
    with pytest.raises(ValueError) as e:
        make()
    msg = str(e.value)
    assert msg.startswith(f"{field}: expected") and expected in msg and msg.endswith(f"got {got}")


def test_study_covers_every_case_and_formats_one_table_per_profile():
    profiles = [load_profile(n) for n in list_profiles()]
    cases = network_study(profiles, gpus=(16, 256), oversubscriptions=(1, 4))
    assert len(cases) == len(profiles) * 4
    text = format_network_study(cases)
    for p in profiles:
        assert text.count(f"{p.name}: per iteration") == 1
    assert "break-even" in text and "@100 ms" in text


def test_cli_prints_the_study(capsys):
    assert main(["simulate", "flux12b-16gpu", "--network-study", "--gpus", "256",
                 "--quiet"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.lstrip().startswith("256")]
    assert len(rows) == 3  # oversubscription 1, 2, 4
    assert main(["simulate", "flux12b-16gpu", "--network-study", "--gpus", "1"]) == 2
    assert "network_case.gpus: expected an integer >= 2, got 1" in capsys.readouterr().err
