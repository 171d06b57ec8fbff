"""Rewards on videos: an image reward scores each frame and takes the mean (or the frame
it names); a video reward gets whole videos."""

import numpy as np
import pytest

from digenrl.tasks.rewards import REWARDS, RewardError, evaluate_rewards, register_reward


def _videos():
    rng = np.random.default_rng(0)
    return rng.integers(0, 256, size=(2, 5, 16, 16, 3), dtype=np.uint8)


def test_an_image_reward_on_videos_is_the_mean_over_frames():
    videos = _videos()
    total, per, valid, _ = evaluate_rewards(videos, ["a", "b"], [0, 1], {"brightness": 1.0})
    frames = [evaluate_rewards(videos[:, f], ["a", "b"], [0, 1], {"brightness": 1.0})[0]
              for f in range(5)]
    np.testing.assert_allclose(total, np.mean(frames, axis=0))
    assert valid.all() and not np.allclose(frames[0], frames[1])


@pytest.fixture
def registered():
    names = []

    def register(name, **kw):
        names.append(name)
        return register_reward(name, **kw)

    yield register
    for n in names:
        REWARDS.pop(n, None)


def test_a_reward_may_name_the_frame_or_score_whole_videos(registered):
    videos = _videos()

    @registered("first_frame_red", on_video="first")
    def first(images, prompts):
        return images[..., 0].mean(axis=(1, 2)).astype(np.float64)

    @registered("frame_change", scores="video")
    def change(videos, prompts):
        assert videos.ndim == 5
        return np.abs(np.diff(videos.astype(np.float64), axis=1)).mean(axis=(1, 2, 3, 4))

    total, _, _, _ = evaluate_rewards(videos, ["a", "b"], [0, 1], {"first_frame_red": 1.0})
    np.testing.assert_allclose(total, videos[:, 0, ..., 0].mean(axis=(1, 2)))
    total, _, _, _ = evaluate_rewards(videos, ["a", "b"], [0, 1], {"frame_change": 1.0})
    assert (total > 0).all()
    with pytest.raises(RewardError, match="reward 'frame_change' raised RewardError: "
                                          "reward 'frame_change' scores videos"):
        evaluate_rewards(videos[:, 0], ["a", "b"], [0, 1], {"frame_change": 1.0})
    with pytest.raises(ValueError, match="on_video: expected"):
        registered("bad", on_video="all")(first)
