"""The graphs each algorithm's shape declares: SDE windows and CPS train only SDE steps;
decoupled micro-steps read only the final latent, so no trajectory is held."""

from collections import Counter

from digenrl.algorithms import ALGORITHMS, AWM, DiffusionNFT, FlowGRPO, OnlineDPO
from digenrl.graph.keys import publish_key, trained_key
from digenrl.graph.plan import IterationPlan
from digenrl.graph.structure import GraphLayout, iteration_nodes
from digenrl.seeding import SDE_WINDOW_DRAW, stable_seed


def plan(i=5, prompts=("cat", "dog", "fox"), spp=4, chunk=2):
    return IterationPlan.uniform(i, prompts, spp, chunk)


def layout(alg, **kw):
    return GraphLayout(num_steps=alg.num_steps, trained_steps=alg.trained_steps,
                       reduce_fanin=3, algorithm=alg, **kw)


def nodes_of(alg, p=None, **kw):
    return {n.key: n for n in iteration_nodes(layout(alg, **kw), p or plan())}


def test_an_sde_window_is_drawn_per_iteration_from_the_named_draw():
    alg = FlowGRPO(num_steps=8, trained_steps=4, sde_candidates=(0, 1, 2, 3, 4),
                   num_sde_steps=2, seed=11)
    windows = {i: alg.sde_steps(i) for i in range(12)}
    for i, w in windows.items():
        ranked = sorted(range(5), key=lambda c: stable_seed(11, SDE_WINDOW_DRAW, i, c))
        assert w == tuple(sorted(ranked[:2]))
        assert alg.micro_steps(i) == w
    assert len(set(windows.values())) > 1   # the window moves between iterations


def test_a_window_trains_only_its_sde_steps_and_annotates_every_step():
    alg = FlowGRPO(num_steps=6, trained_steps=3, dynamics="cps", sde_candidates=(1, 2, 3),
                   num_sde_steps=2, seed=3)
    sde = alg.sde_steps(5)
    nodes = nodes_of(alg)
    for (kind, *rest), n in nodes.items():
        if kind == "denoise":
            assert n.meta["sde"] is (rest[2] in sde)
    grads = [k for k in nodes if k[0] == "grad"]
    assert sorted({k[3] for k in grads}) == list(sde) and len(grads) == 6 * 2
    # A micro-step reads the latents before and after its step; decode reads the SDE
    # steps' results (their log-probabilities) and the final latent, no ODE step's.
    t = sde[0]
    before = ("noise", 5, 0) if t == 0 else ("denoise", 5, 0, t - 1)
    assert nodes[("grad", 5, 0, t)].deps[:3] == [publish_key(5), before, ("denoise", 5, 0, t)]
    read = nodes[("decode", 5, 0)].deps
    assert {d[3] for d in read if d[0] == "denoise"} == set(sde) | {5}


def test_cps_without_a_window_samples_its_last_step_with_the_ode():
    alg = FlowGRPO(num_steps=4, trained_steps=2, dynamics="cps")
    assert alg.sde_steps(0) == (0, 1, 2)
    meta = {k[3]: n.meta["sde"] for k, n in nodes_of(alg).items() if k[0] == "denoise"}
    assert meta == {0: True, 1: True, 2: True, 3: False}
    assert FlowGRPO(num_steps=4, trained_steps=2).sde_steps(0) == (0, 1, 2, 3)


def decoupled_graphs():
    for cls in (DiffusionNFT, AWM, OnlineDPO):
        alg = cls(num_steps=4, trained_steps=3)
        yield alg, nodes_of(alg)


def test_decoupled_micro_steps_read_only_final_latents_and_advantages():
    for alg, nodes in decoupled_graphs():
        assert not alg.coupled and alg.sde_steps(5) == ()
        final = {("denoise", 5, c, 3) for c in range(6)}
        for key, n in nodes.items():
            if key[0] == "denoise":
                assert n.meta["sde"] is False
            if key[0] == "grad":
                read = {d for d in n.deps if d[0] in ("denoise", "noise")}
                assert read and read <= final, (alg.name, key, read)
                assert {d[0] for d in n.deps} <= {"denoise", "advantage", "publish",
                                                   "trained"}
        grads = Counter(k[2] for k in nodes if k[0] == "grad")
        if alg.pairwise:   # the first chunk of each group trains the group's pairs
            assert grads == {0: 3, 2: 3, 4: 3}
            assert {d for d in nodes[("grad", 5, 2, 0)].deps if d[0] == "denoise"} == \
                {("denoise", 5, 2, 3), ("denoise", 5, 3, 3)}
        else:
            assert grads == {c: 3 for c in range(6)}


def test_a_decoupled_graph_holds_no_trajectory():
    """Every intermediate step's result has one reader, the next step: Dask releases it
    as soon as that step has it, so a rollout worker keeps no per-step latents."""
    for alg, nodes in decoupled_graphs():
        readers = Counter(d for n in nodes.values() for d in n.deps)
        for c in range(6):
            assert readers[("noise", 5, c)] == 1
            for t in range(3):
                assert readers[("denoise", 5, c, t)] == 1, (alg.name, c, t)
            assert nodes[("decode", 5, c)].deps == [("denoise", 5, c, 3)]


def test_a_sampling_copy_publishes_the_copy_and_trains_the_weights():
    """DiffusionNFT: the rollouts sample with the published copy; a micro-step reads the
    trained weights (the ``trained`` task of the state) and the copy that sampled its
    chunk, and for a chunk an older version sampled the copy of the version it trains
    too (the anchor of its loss); AWM reads the weights that sampled a stale chunk (its
    behaviour policy) and only the trained ones on-policy."""
    nft = DiffusionNFT(num_steps=4, trained_steps=2)
    nodes = nodes_of(nft)
    g = nodes[("grad", 5, 0, 1)]
    assert g.deps[:2] == [trained_key(5), publish_key(5)]
    assert nodes[trained_key(5)].deps == [("optimize", 4)]
    assert nodes[("denoise", 5, 0, 0)].deps[0] == publish_key(5)
    stale = nodes_of(nft, version_lag=1)
    assert stale[("denoise", 5, 0, 0)].deps[0] == publish_key(4)   # sampled by version 4
    assert stale[("grad", 5, 0, 1)].deps[:3] == [trained_key(5), publish_key(4),
                                                 publish_key(5)]
    assert stale[("grad", 5, 0, 1)].meta["behaviour_version"] == 4
    awm = AWM(num_steps=4, trained_steps=2)
    g = nodes_of(awm)[("grad", 5, 0, 1)]
    assert g.deps[0] == publish_key(5) and publish_key(5) not in g.deps[1:2]
    assert nodes_of(awm, version_lag=1)[("grad", 5, 0, 1)].deps[:2] == [publish_key(5),
                                                                       publish_key(4)]


def test_every_registered_algorithm_builds_a_graph_without_torch_names():
    for cls in ALGORITHMS.values():
        alg = cls(num_steps=4, trained_steps=2)
        nodes = nodes_of(alg)
        assert any(k[0] == "grad" for k in nodes)
        assert all(n.meta["kind"] == k[0] for k, n in nodes.items())
