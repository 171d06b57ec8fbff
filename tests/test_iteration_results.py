"""An iteration's results gathered by sample from its collected task results, and the
store rows read off them (runner.IterationResults), on the task results' own types."""

import numpy as np

from digenrl.graph.keys import advantage_key, decode_key, reward_key, stats_key
from digenrl.graph.plan import IterationPlan
from digenrl.run.runner import IterationResults
from digenrl.tasks.types import (AdvantageOut, DecodeOut, IterationStats, MicroStats,
                                 RewardOut)

from conftest import small_config

FRAMES, SIZE, STEPS = 3, 4, 4
#: The rewards the collected results carry.
REWARDS = {"reward.components": {"brightness": 1.0, "colorfulness": 0.5}}


def collected(i: int, plan: IterationPlan, video: bool) -> dict:
    """Task results as the driver collects them: every sample's values made from its id
    (so a sample put in another's row shows), one sample of chunk 1 left unscored."""
    values = {}
    rng = np.random.default_rng(0)
    for c in range(len(plan.chunks)):
        ids = plan.sample_ids(c)
        n = len(ids)
        shape = (n, FRAMES, SIZE, SIZE, 3) if video else (n, SIZE, SIZE, 3)
        images = rng.integers(0, 256, shape, dtype=np.uint8)
        values[decode_key(i, c)] = DecodeOut(
            ids, images, np.array([[s + t / 10 for t in range(STEPS)] for s in ids], np.float32),
            behaviour_version=i - c % 2,
            latents=np.full((n, STEPS + 1, 2, 1, 1), c, np.float32))
        valid = np.array([not (c == 1 and k == 0) for k in range(n)])
        rewards = np.where(valid, np.array(ids, np.float64), np.nan)
        values[reward_key(i, c)] = RewardOut(
            ids, rewards, {"brightness": rewards / 2, "colorfulness": rewards * 3}, valid,
            problems=[] if valid.all() else [f"sample {ids[0]} has no reward"])
    for g in range(plan.num_groups):
        ids = plan.group_sample_ids(g)
        values[advantage_key(i, g)] = AdvantageOut(
            g, ids, np.array([-s for s in ids], np.float32), np.ones(len(ids), bool))
    micro = MicroStats(count=4, loss_sum=2.0, clipped=1, staleness_sum=4)
    values[stats_key(i)] = IterationStats(i, i + 1, micro, grad_norm=0.5, weight_bytes=64)
    return values


def test_results_land_on_their_samples_and_read_off_as_rows():
    cfg = small_config(**REWARDS, **{"store.save_latents": True})
    i = 5
    plan = IterationPlan.uniform(i, ["a cat", "a dog", "a fox"], 2, 3)  # chunks span groups
    values = collected(i, plan, video=False)
    results = IterationResults.collect(i, plan, values, cfg)
    n = plan.num_samples
    samples, steps, metrics = results.samples(), results.steps(), results.metrics()
    assert list(samples) == ["prompt", "group", "reward", "advantage", "valid",
                             "behaviour_version", "trained_version", "reward_brightness",
                             "reward_colorfulness", "image"]
    assert samples["prompt"].tolist() == ["a cat", "a cat", "a dog", "a dog", "a fox", "a fox"]
    assert samples["group"].dtype == np.int32 and samples["group"].tolist() == [0, 0, 1, 1, 2, 2]
    unscored = plan.sample_ids(1)[0]
    expected = np.array([np.nan if s == unscored else s for s in range(n)])
    np.testing.assert_array_equal(samples["reward"], expected)
    np.testing.assert_array_equal(samples["reward_brightness"], expected / 2)
    np.testing.assert_array_equal(samples["reward_colorfulness"], expected * 3)
    assert samples["valid"].tolist() == [s != unscored for s in range(n)]
    assert samples["advantage"].dtype == np.float32
    assert samples["advantage"].tolist() == [-s for s in range(n)]
    assert samples["behaviour_version"].dtype == np.int32
    assert samples["behaviour_version"].tolist() == [i] * 3 + [i - 1] * 3
    assert samples["trained_version"].tolist() == [i] * n
    for c in range(len(plan.chunks)):
        ids = list(plan.sample_ids(c))
        np.testing.assert_array_equal(samples["image"][ids], values[decode_key(i, c)].images)
        np.testing.assert_array_equal(steps["latent"][ids], values[decode_key(i, c)].latents)
    assert steps["log_prob"].dtype == np.float32 and steps["log_prob"].shape == (n, STEPS)
    np.testing.assert_array_equal(steps["log_prob"][:, 0], np.arange(n, dtype=np.float32))
    assert metrics["dropped_samples"] == 1.0
    assert metrics["reward_mean"] == np.mean([s for s in range(n) if s != unscored])
    assert (metrics["loss"], metrics["clip_fraction"], metrics["staleness_mean"]) == (
        0.5, 0.25, 1.0)
    assert np.isnan(metrics["ratio_dev"])  # no on-policy first micro-step measured
    assert (metrics["grad_norm"], metrics["weight_sync_bytes"]) == (0.5, 64.0)
    assert results.problems == [f"sample {unscored} has no reward"]


def test_a_video_keeps_its_middle_frame_and_the_whole_video_only_when_asked():
    i = 0
    plan = IterationPlan.uniform(i, ["a cat", "a dog"], 2, 2)
    values = collected(i, plan, video=True)
    kept = IterationResults.collect(i, plan, values, small_config(**REWARDS, **{
        "store.save_videos": True})).samples()
    for c in range(len(plan.chunks)):
        ids = list(plan.sample_ids(c))
        video = values[decode_key(i, c)].images
        np.testing.assert_array_equal(kept["video"][ids], video)
        np.testing.assert_array_equal(kept["image"][ids], video[:, FRAMES // 2])
    neither = IterationResults.collect(i, plan, values, small_config(**REWARDS, **{
        "store.save_images": False})).samples()
    assert "video" not in neither and "image" not in neither
