"""Group rewards: a reward that scores a whole prompt group at once, as its own task."""

from __future__ import annotations

import ast
import itertools
import math

import numpy as np
import pytest

from conftest import checked_config, small_config
from digenrl.config import ConfigError, GroupRewardConfig
from digenrl.graph.keys import (advantage_key, decode_key, group_reward_key, kind_of,
                                reward_key)
from digenrl.graph.plan import IterationPlan
from digenrl.graph.structure import Dep, GraphLayout, iteration_nodes
from digenrl.tasks.advantage import advantage, group_advantages, score_group
from digenrl.tasks.reward_sources import resolve_rewards
from digenrl.tasks.rewards import (get_reward, group_rank, group_win_rate, ranked_reward,
                                   register_reward, split_group_rewards)
from digenrl.tasks.types import DecodeOut, RewardOut
from digenrl.vocabulary import GROUP_REWARD, KIND_POOL, ROLLOUT, ROLLOUT_KINDS, stage_of

#: Two prompts of two images in chunks of one: each group spans two chunks.
SPLIT = {"rollout.chunk_size": 1}
RANKED = {"reward.components": {"jpeg_compressibility": 1.0, "jpeg_rank": 0.5},
          "reward.group": {"jpeg_rank": {"of": "jpeg_compressibility"}}}


# ------------------------------------------------------------------ the rankings


def _rank_by_hand(scores):
    """The fraction of the others each score beats, a tie counting half."""
    n = len(scores)
    return [sum(1.0 if b < a else 0.5 if b == a else 0.0
                for j, b in enumerate(scores) if j != i) / (n - 1)
            for i, a in enumerate(scores)]


def _win_rate_by_hand(scores, temperature):
    n = len(scores)
    return [sum(1.0 / (1.0 + math.exp(-(a - b) / temperature))
                for j, b in enumerate(scores) if j != i) / (n - 1)
            for i, a in enumerate(scores)]


@pytest.mark.parametrize("scores", [[3.0, 1.0, 2.0], [1.0, 1.0, 5.0, 0.5],
                                    [-2.5, 7.0], [4.0, 4.0, 4.0]])
def test_rank_and_win_rate_are_the_ones_computed_by_hand(scores):
    assert np.allclose(group_rank(np.array(scores)), _rank_by_hand(scores), atol=0)
    for temperature in (1.0, 0.3):
        assert np.allclose(group_win_rate(np.array(scores), temperature),
                           _win_rate_by_hand(scores, temperature), rtol=1e-12, atol=1e-15)


def test_a_sample_without_a_score_is_left_out_of_its_groups_ranking():
    got = group_rank(np.array([2.0, np.nan, 1.0, 3.0]))
    assert np.isnan(got[1])
    assert np.array_equal(got[[0, 2, 3]], _rank_by_hand([2.0, 1.0, 3.0]))


def _images(n, seed):
    return np.random.default_rng(seed).integers(0, 256, (n, 16, 16, 3), dtype=np.uint8)


def test_a_ranked_reward_ranks_its_rewards_scores_within_the_group():
    jpeg = get_reward("jpeg_compressibility")
    images = _images(5, 0)
    scores = jpeg(images, ["p"] * 5)
    spec = ranked_reward("jpeg_rank", jpeg)
    assert spec.group and spec.device == jpeg.device
    assert np.array_equal(spec.score_group(images, ["p"] * 5), _rank_by_hand(list(scores)))
    win = ranked_reward("jpeg_win", jpeg, "win_rate", 2.0)
    assert np.allclose(win.score_group(images, ["p"] * 5),
                       _win_rate_by_hand(list(scores), 2.0), rtol=1e-12)


def test_the_group_task_scores_each_group_whole_across_chunks():
    """Chunks of two, groups of three (chunk 1 holds a sample of each group): each
    group's images gathered from two chunks."""
    plan = IterationPlan.uniform(0, ("a", "b"), 3, 2)
    rewards = resolve_rewards({"jpeg_compressibility": 1.0, "jpeg_rank": 0.5},
                              group={"jpeg_rank": GroupRewardConfig(of="jpeg_compressibility")})
    alone, grouped = split_group_rewards(rewards)
    assert [s.name for s, _ in alone] == ["jpeg_compressibility"]
    assert [(s.name, w) for s, w in grouped] == [("jpeg_rank", 0.5)]
    images = _images(plan.num_samples, 1)
    decoded = [DecodeOut(plan.sample_ids(c), images[a:b], np.zeros((b - a, 0), np.float32), 0)
               for c, (a, b) in enumerate(plan.chunks)]
    scored = [RewardOut(d.sample_ids, np.zeros(len(d.sample_ids)), {},
                        np.ones(len(d.sample_ids), bool)) for d in decoded]
    jpeg = get_reward("jpeg_compressibility")(images, ["x"] * len(images))
    for g in range(plan.num_groups):
        parts = [x for c in plan.chunks_of_group(g) for x in (decoded[c], scored[c])]
        ids = plan.group_sample_ids(g)
        out = score_group(grouped, "raise", 0, ids, plan.prompts[g], "", None, *parts)
        expected = _rank_by_hand(list(jpeg[list(ids)]))
        assert out.sample_ids == ids and out.valid.all()
        assert np.array_equal(out.components["jpeg_rank"], expected)
        assert np.array_equal(out.rewards, 0.5 * np.array(expected))


def test_a_sample_its_chunk_dropped_is_left_out_of_the_group():
    decoded = DecodeOut((0, 1, 2), _images(3, 2), np.zeros((3, 0), np.float32), 0)
    scored = RewardOut((0, 1, 2), np.array([1.0, np.nan, 2.0]), {},
                       np.array([True, False, True]))
    rewards = resolve_rewards({"r": 1.0}, group={"r": GroupRewardConfig(of="brightness")})
    out = score_group(rewards, "drop", 0, (0, 1, 2), "p", "", None, decoded, scored)
    assert out.valid.tolist() == [True, False, True]
    bright = get_reward("brightness")(decoded.images[[0, 2]], ["p", "p"])
    assert np.array_equal(out.rewards[[0, 2]], _rank_by_hand(list(bright)))


def test_the_advantage_sums_a_samples_chunk_and_group_rewards():
    chunk = RewardOut((0, 1, 2, 3), np.array([1.0, 2.0, 3.0, 4.0]), {}, np.ones(4, bool))
    group = RewardOut((0, 1, 2, 3), np.array([0.5, 0.0, 0.25, 1.0]), {},
                      np.array([True, True, True, False]))
    out = advantage(0, (0, 1, 2, 3), "group", 5.0, chunk, group)
    expected = group_advantages(np.array([1.5, 2.0, 3.25, np.nan]),
                                np.array([True, True, True, False]), 5.0)
    assert np.array_equal(out.advantages, expected)
    assert out.valid.tolist() == [True, True, True, False]


# ------------------------------------------------------------------ the graph


def test_the_group_reward_task_reads_its_groups_chunks_and_its_advantage_reads_it():
    plan = IterationPlan.uniform(3, ("a", "b"), 3, 2)
    nodes = {n.key: n for n in iteration_nodes(
        GraphLayout(num_steps=4, trained_steps=2, group_rewards=True,
                    group_reward_gpu=True), plan)}
    for g in range(2):
        node = nodes[group_reward_key(3, g)]
        chunks = plan.chunks_of_group(g)
        assert len(chunks) == 2
        assert node.deps == [k for c in chunks for k in (decode_key(3, c), reward_key(3, c))]
        assert node.meta["kind"] == GROUP_REWARD and node.meta["pool"] == ROLLOUT
        assert node.meta["gpu"] and node.meta["group"] == g
        assert node.meta["chunk"] == chunks[-1] and node.meta["samples"] == 3
        assert Dep(group_reward_key(3, g)) in nodes[advantage_key(3, g)].args
    batch = {n.key: n for n in iteration_nodes(
        GraphLayout(num_steps=4, trained_steps=2, advantage_std="batch",
                    group_rewards=True), plan)}
    assert {group_reward_key(3, g) for g in range(2)} <= set(batch[advantage_key(3, 0)].deps)
    plain = iteration_nodes(GraphLayout(num_steps=4, trained_steps=2), plan)
    assert not [n for n in plain if kind_of(n.key) == GROUP_REWARD]


def test_the_scheduler_sees_group_rewards_as_rollout_work_after_the_chunks_reward():
    assert KIND_POOL[GROUP_REWARD] == ROLLOUT and GROUP_REWARD in ROLLOUT_KINDS
    assert stage_of(GROUP_REWARD, None) > stage_of("reward", None)


# ------------------------------------------------------------------ bad configs


@pytest.mark.parametrize("overrides, field", [
    ({**RANKED, "data.samples_per_prompt": 1}, "data.samples_per_prompt"),
    ({**RANKED, "reward.group": {"jpeg_rank": {"of": "no_such_reward"}}},
     "reward.group.jpeg_rank.of"),
    ({**RANKED, "reward.group": {"jpeg_rank": {"of": "jpeg_compressibility",
                                               "method": "median"}}},
     "reward.group.jpeg_rank.method"),
    ({**RANKED, "reward.group": {"jpeg_rank": {"of": "jpeg_compressibility",
                                               "temperature": 0}}},
     "reward.group.jpeg_rank.temperature"),
    ({**RANKED, "reward.group": {"brightness": {"of": "jpeg_compressibility"}},
      "reward.components": {"brightness": 1.0}}, "reward.group.brightness"),
])
def test_a_bad_group_reward_is_one_line_naming_the_field(overrides, field):
    with pytest.raises(ConfigError) as e:
        checked_config(**overrides)
    message = str(e.value)
    assert message.startswith(field + ":") and "\n" not in message, message


# ------------------------------------------------------------------ a real run


def _key(text):
    return ast.literal_eval(text)


def test_group_reward_tasks_run_after_their_groups_chunks_and_before_the_advantage(
        cluster_1x1, shared_runs):
    cfg = small_config(**SPLIT, **RANKED, iterations=1)
    run = shared_runs(cluster_1x1, cfg)
    t = run.ds["tasks"]
    records = {_key(k): (float(r), float(f)) for k, r, f in
               zip(t.key.values, t.ready.values, t.finished.values)}
    for i in range(1):
        plan = IterationPlan.uniform(i, ("a", "b"), 2, 1)
        for g in range(plan.num_groups):
            ready, finished = records[group_reward_key(i, g)]
            for c in plan.chunks_of_group(g):
                for before in (decode_key(i, c), reward_key(i, c)):
                    assert records[before][1] <= ready, (before, g)
            assert finished <= records[advantage_key(i, g)][0], g
    kinds = t.kind.values
    assert (kinds == GROUP_REWARD).sum() == 2
    # The store: the rank column is the rank of the JPEG column within each group, and
    # the reward their weighted sum.
    s = run.ds["samples"]
    jpeg = s["reward_jpeg_compressibility"].values
    rank = s["reward_jpeg_rank"].values
    for i, g in itertools.product(range(1), range(2)):
        mine = s.group.values[i] == g
        assert np.array_equal(rank[i][mine], _rank_by_hand(list(jpeg[i][mine])))
    assert np.array_equal(s.reward.values, (0.0 + 1.0 * jpeg) + (0.0 + 0.5 * rank))
    assert bool(s.valid.all())


# ------------------------------------------------------------------ the simulator


def test_a_profiles_group_reward_cost_adds_simulated_group_reward_tasks_in_order():
    import dataclasses

    from digenrl.schedulers.options import MODES, ScheduleOptions
    from digenrl.sim.profile import load_profile
    from digenrl.sim.simulate import simulate

    base = dataclasses.replace(load_profile("flux12b-16gpu"), rollout_workers=2,
                               trainer_workers=2, prompts_per_iteration=2,
                               samples_per_prompt=4, chunk_size=2, num_steps=4,
                               trained_steps=2)
    costs = dataclasses.replace(base.costs, group_reward_per_sample=0.5)
    grouped = dataclasses.replace(base, costs=costs)
    options = ScheduleOptions(mode="digenrl", **MODES["digenrl"])
    plain = simulate(base, options, 6)
    r = simulate(grouped, options, 6)
    assert r.tasks == plain.tasks + 6 * 2
    assert grouped.gpu_seconds_per_iteration() == (base.gpu_seconds_per_iteration()
                                                   + 2 * 4 * 0.5)
    assert r.images_per_s <= r.ideal_images_per_s
    runs = {rec.key: rec for rec in r.result.records}
    plan = grouped.plans(1)[0]
    for i in range(6):
        for g in range(2):
            task = runs[group_reward_key(i, g)]
            assert task.gpu and task.stop - task.start >= 4 * 0.5 / base.rollout_speed - 1e-9
            for c in plan.chunks_of_group(g):
                assert runs[reward_key(i, c)].stop <= task.start
            assert task.stop <= runs[advantage_key(i, g)].start


# ------------------------------------------------------------------ a registered one


@register_reward("tests_brightness_spread", group=True)
def brightness_spread(images, prompts):
    """Each image's brightness less its group's mean brightness."""
    b = get_reward("brightness")(images, prompts)
    return b - b.mean()


def test_a_registered_group_reward_scores_its_group_whole():
    spec = get_reward("tests_brightness_spread")
    assert spec.group
    images = _images(4, 3)
    b = get_reward("brightness")(images, ["p"] * 4)
    assert np.allclose(spec.score_group(images, ["p"] * 4), b - b.mean(), rtol=0, atol=1e-15)
    with pytest.raises(ConfigError, match=r"^data\.samples_per_prompt: "):
        checked_config(**{"reward.components": {"tests_brightness_spread": 1.0},
                          "data.samples_per_prompt": 1})


def test_the_reward_server_refuses_a_group_reward_in_one_line(capsys):
    from digenrl.commands.cli import main

    assert main(["reward-server", "tests_brightness_spread"]) == 2
    err = capsys.readouterr().err
    assert "group reward 'tests_brightness_spread'" in err and err.count("\n") == 1, err
