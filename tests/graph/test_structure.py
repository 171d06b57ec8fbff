"""The iteration DAG: keys, annotations, versions, the reduction tree."""

from collections import Counter

import pytest

from digenrl.graph.plan import IterationPlan
from digenrl.graph.keys import publish_key
from digenrl.graph.structure import GraphLayout, iteration_nodes, reduce_root_key

LAYOUT = GraphLayout(num_steps=4, trained_steps=2, reduce_fanin=3)


def plan(i=5, prompts=("cat", "dog", "fox"), spp=4, chunk=2):
    return IterationPlan.uniform(i, prompts, spp, chunk)


def test_every_denoise_step_of_every_chunk_is_a_task():
    nodes = iteration_nodes(LAYOUT, plan())
    kinds = Counter(n.key[0] for n in nodes)
    assert kinds["denoise"] == 6 * 4 and kinds["grad"] == 6 * 2
    assert kinds["noise"] == kinds["decode"] == kinds["reward"] == 6
    assert kinds["advantage"] == kinds["encode"] == 3
    assert kinds["optimize"] == kinds["publish"] == 1
    for n in nodes:
        assert n.key[0] == n.meta["kind"] and n.meta["iteration"] == 5
        if n.key[0] in ("denoise", "grad"):
            assert n.meta["timestep"] == n.key[3] and n.meta["chunk"] == n.key[2]
        rollout = ("encode", "noise", "denoise", "decode", "reward")
        assert n.meta["pool"] == ("rollout" if n.key[0] in rollout else "trainer")
        assert n.meta["gpu"] == (n.key[0] in ("encode", "denoise", "decode", "grad", "optimize"))


def test_each_group_is_encoded_once_and_its_chunks_read_it():
    """Groups of 4 samples in chunks of 2 (one group per chunk), then of 3 (a chunk
    spanning two groups reads both); without ``encode`` a noise task reads nothing."""
    nodes = {n.key: n for n in iteration_nodes(LAYOUT, plan())}
    assert nodes[("encode", 5, 1)].args == ("dog",) and nodes[("encode", 5, 1)].deps == []
    assert nodes[("encode", 5, 1)].meta["chunk"] == 2
    assert nodes[("noise", 5, 2)].deps == nodes[("noise", 5, 3)].deps == [("encode", 5, 1)]
    nodes = {n.key: n for n in iteration_nodes(LAYOUT, plan(chunk=3))}
    assert nodes[("noise", 5, 1)].deps == [("encode", 5, 0), ("encode", 5, 1)]
    assert nodes[("noise", 5, 1)].args[2:4] == (("cat", "dog", "dog"), (0, 1, 1))
    bare = GraphLayout(num_steps=4, trained_steps=2, reduce_fanin=3, encode=False)
    nodes = iteration_nodes(bare, plan())
    assert not [n for n in nodes if n.key[0] == "encode"]
    assert all(n.deps == [] for n in nodes if n.key[0] == "noise")


def test_chains_and_dependencies():
    nodes = {n.key: n for n in iteration_nodes(LAYOUT, plan())}
    assert nodes[("denoise", 5, 1, 0)].deps == [publish_key(5), ("noise", 5, 1)]
    assert nodes[("denoise", 5, 1, 3)].deps == [publish_key(5), ("denoise", 5, 1, 2)]
    assert nodes[("grad", 5, 1, 1)].deps == [publish_key(5), ("denoise", 5, 1, 0),
                                             ("denoise", 5, 1, 1), ("advantage", 5, 0)]
    # Group 1 holds samples 4..7 = chunks 2 and 3.
    assert nodes[("advantage", 5, 1)].deps == [("reward", 5, 2), ("reward", 5, 3)]
    assert nodes[("optimize", 5)].deps[0] == ("optimize", 4)


def test_reduction_tree_is_fixed_and_ordered():
    """A fanin-3 tree over 6 chunks x 2 trained steps = 12 leaves: 4 nodes, then 2 (the
    second with one part), then the root; a node of three parts adds them one at a time
    (a chain of two tasks)."""
    nodes = iteration_nodes(LAYOUT, plan())
    leaves = [n.key for n in nodes if n.key[0] == "grad"]
    reduces = {n.key: n.deps for n in nodes if n.key[0] == "reduce"}
    assert reduces[("reduce", 5, 0, 0, 1)] == leaves[:2]
    assert reduces[("reduce", 5, 0, 0)] == [("reduce", 5, 0, 0, 1), leaves[2]]
    assert reduces[("reduce", 5, 0, 3)] == [("reduce", 5, 0, 3, 1), leaves[11]]
    assert reduces[("reduce", 5, 1, 0, 1)] == [("reduce", 5, 0, 0), ("reduce", 5, 0, 1)]
    assert reduces[("reduce", 5, 1, 0)] == [("reduce", 5, 1, 0, 1), ("reduce", 5, 0, 2)]
    assert reduces[("reduce", 5, 1, 1)] == [("reduce", 5, 0, 3)]
    assert reduces[("reduce", 5, 2, 0)] == [("reduce", 5, 1, 0), ("reduce", 5, 1, 1)]
    assert len(reduces) == 4 * 2 + 2 + 1 + 1
    assert reduce_root_key(5, len(leaves), 3) == ("reduce", 5, 2, 0)
    assert next(n for n in nodes if n.key[0] == "optimize").deps[1] == ("reduce", 5, 2, 0)


@pytest.mark.parametrize("lag,stale,expected", [
    (0, None, [5, 5, 5]), (1, None, [4, 4, 4]), (2, None, [3, 3, 3]),
    (1, 1, [4, 5, 5]), (2, 2, [3, 3, 5]), (1, 0, [5, 5, 5]),
])
def test_rollout_versions_follow_the_staleness_bound(lag, stale, expected):
    layout = GraphLayout(num_steps=4, trained_steps=2, version_lag=lag, stale_groups=stale)
    nodes = iteration_nodes(layout, plan())
    by_group = {}
    for n in nodes:
        if n.key[0] == "denoise":
            by_group.setdefault(n.meta["group"], set()).add(n.meta["policy_version"])
            assert n.deps[0] == publish_key(n.meta["policy_version"])
        if n.key[0] == "grad":
            assert n.meta["policy_version"] == 5
            assert 5 - n.meta["behaviour_version"] <= lag
    assert [by_group[g].pop() for g in range(3)] == expected


@pytest.mark.parametrize("lag,kl,expected", [
    (0, False, [5]), (1, False, [4, 5]), (2, False, [3, 4, 5]), (1, True, [0, 4, 5]),
])
def test_the_retained_versions_are_those_later_iterations_may_read(lag, kl, expected):
    layout = GraphLayout(num_steps=4, trained_steps=2, version_lag=lag, kl=kl)
    assert layout.retained_versions(5) == expected
    for i in range(4):
        # A run resumed at i + 1 (or recomputing it) reads these of what existed then.
        read = {d[1] for n in iteration_nodes(layout, plan(i + 1)) for d in n.deps
                if d[0] == "publish" and d[1] <= i + 1}
        assert read and all(layout.retains(v, i) for v in read)
        assert {v for v in range(i + 2) if layout.retains(v, i + 1)} >= read


@pytest.mark.parametrize("every,lag,kl,written", [
    (1, 1, False, set(range(11))),
    (4, 0, False, {0, 4, 8, 10}),
    (4, 1, False, {0, 3, 4, 7, 8, 9, 10}),
    (4, 2, True, {0, 2, 3, 4, 6, 7, 8, 9, 10}),
    (20, 1, False, {0, 9, 10}),
])
def test_checkpoints_are_written_for_every_resume_point(every, lag, kl, written):
    layout = GraphLayout(num_steps=4, trained_steps=2, version_lag=lag, kl=kl,
                         checkpoint_every=every)
    assert {v for v in range(11) if layout.writes_checkpoint(v, 10)} == written
    # The resume points of a run of 10 iterations, all stored, include each multiple of
    # ``every`` and its end (others where written versions happen to suffice, as 9 with
    # versions 8 to 10 written); at each, a resumed run restores only written versions.
    points = {layout.resume_point(n, written.__contains__) for n in range(11)}
    assert points >= {p for p in range(11) if p % every == 0 or p == 10}
    assert all(set(layout.retained_versions(p)) <= written for p in points)
    assert all(n - layout.resume_point(n, written.__contains__) < every for n in range(11))


def test_a_resume_point_falls_back_to_the_newest_complete_checkpoints():
    layout = GraphLayout(num_steps=4, trained_steps=2, version_lag=1, checkpoint_every=4)
    assert layout.resume_point(6, {0, 3, 4}.__contains__) == 4
    assert layout.resume_point(4, {0, 3, 4}.__contains__) == 4
    assert layout.resume_point(6, {0, 4, 5}.__contains__) == 5
    assert layout.resume_point(6, {0, 4}.__contains__) == 0  # version 3 is missing
    assert layout.resume_point(0, set().__contains__) == 0


@pytest.mark.parametrize("lag,kl", [(0, False), (1, False), (2, True)])
def test_checkpointing_every_version_keeps_what_resuming_there_restores(lag, kl):
    layout = GraphLayout(num_steps=4, trained_steps=2, version_lag=lag, kl=kl)
    for committed in range(1, 9):
        for v in range(10):
            assert layout.keeps_checkpoint(v, committed, 9) == (
                v > committed or layout.retains(v, committed)), (committed, v)


def test_checkpointing_every_few_versions_keeps_the_last_resume_points_restore():
    layout = GraphLayout(num_steps=4, trained_steps=2, version_lag=1, checkpoint_every=4)
    # Committed 6 of 10: the last resume point is 4 (versions 3 and 4); version 0 and
    # every version past 4 -- each recomputed from 4 when lost -- are not needed, but
    # versions past the committed ones may be written already and are kept.
    kept = {v for v in range(11) if layout.keeps_checkpoint(v, 6, 10)}
    assert kept == set(range(3, 11))
    assert {v for v in range(11) if layout.keeps_checkpoint(v, 8, 10)} == set(range(7, 11))


def test_chunks_spanning_groups():
    p = IterationPlan.uniform(0, ("a", "b", "c", "d"), 2, 4)
    nodes = {n.key: n for n in iteration_nodes(LAYOUT, p)}
    assert nodes[("advantage", 0, 3)].deps == [("reward", 0, 1)]
    assert nodes[("grad", 0, 1, 0)].deps[-2:] == [("advantage", 0, 2), ("advantage", 0, 3)]


def test_batch_std_advantages_read_every_reward():
    layout = GraphLayout(num_steps=4, trained_steps=2, advantage_std="batch")
    nodes = {n.key: n for n in iteration_nodes(layout, plan())}
    assert len(nodes[("advantage", 5, 0)].deps) == 6


def test_plan_rejects_bad_chunks():
    with pytest.raises(ValueError, match="chunk_size"):
        IterationPlan.uniform(0, ("a", "b"), 3, 4)
    with pytest.raises(ValueError, match="chunks"):
        IterationPlan(0, ("a",), 2, ((0, 1),))


def test_a_context_parallel_chunk_computes_each_step_as_a_gang():
    """A chunk at degree 2: each step two members, member 0 keeping the step's key (what
    reads the step reads it), member m reading member m of the previous step (both the
    noise first), decoding reading every member of the last step; a chunk at degree 1
    alongside stays one task a step; a bad list of degrees is refused in one line."""
    from digenrl.graph.keys import (context_gang_id, decode_key, denoise_key, member_key,
                                    noise_key)
    from digenrl.graph.structure import Dep, rollout_nodes

    plan = IterationPlan(0, ("a", "b"), 2, ((0, 2), (2, 4)), context_parallel=(2, 1))
    nodes = {n.key: n for n in rollout_nodes(GraphLayout(num_steps=3, trained_steps=2), plan)}
    reads = {k: [a.key for a in n.args if isinstance(a, Dep)] for k, n in nodes.items()}
    for t in range(3):
        step = denoise_key(0, 0, t)
        before = noise_key(0, 0) if t == 0 else denoise_key(0, 0, t - 1)
        assert nodes[step].meta["gang"] == (context_gang_id(0, 0, t, 3), 0, 2)
        assert nodes[member_key(step, 1)].meta["gang"] == (context_gang_id(0, 0, t, 3), 1, 2)
        assert reads[step][-1] == before
        assert reads[member_key(step, 1)][-1] == (before if t == 0 else member_key(before, 1))
        assert nodes[denoise_key(0, 1, t)].meta["gang"] is None
        assert member_key(denoise_key(0, 1, t), 1) not in nodes
    last = denoise_key(0, 0, 2)
    assert reads[decode_key(0, 0)][-2:] == [last, member_key(last, 1)]
    assert reads[decode_key(0, 1)][-1] == denoise_key(0, 1, 2)
    assert not any(len(k) > 4 for k in reads[decode_key(0, 1)])
    with pytest.raises(ValueError, match=r"^context_parallel: expected a degree >= 1 per "
                                         r"chunk \(2\), got \(2,\)$"):
        IterationPlan(0, ("a", "b"), 2, ((0, 2), (2, 4)), context_parallel=(2,))
