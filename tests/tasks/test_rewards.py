import numpy as np
import pytest

from digenrl.tasks.rewards import (REWARDS, RewardError, evaluate_rewards, get_reward,
                                   register_reward)


def images(seed=0, n=3, size=32):
    rng = np.random.default_rng(seed)
    noisy = rng.integers(0, 256, size=(n, size, size, 3), dtype=np.uint8)
    flat = np.full((n, size, size, 3), 128, np.uint8)
    return noisy, flat


def test_jpeg_rewards_follow_ddpo():
    noisy, flat = images()
    comp, incomp = get_reward("jpeg_compressibility").fn, get_reward("jpeg_incompressibility").fn
    assert (comp(flat, [""] * 3) > comp(noisy, [""] * 3)).all()
    np.testing.assert_allclose(comp(noisy, [""] * 3), -incomp(noisy, [""] * 3))
    # kB at quality 95: a 32x32 noise image is more than 1 kB, a flat one well under.
    assert (incomp(noisy, [""] * 3) > 1.0).all() and (incomp(flat, [""] * 3) < 1.0).all()


def test_colorfulness_and_brightness():
    noisy, flat = images()
    assert (get_reward("colorfulness").fn(noisy, []) > 10).all()
    assert (get_reward("colorfulness").fn(flat, []) == 0).all()
    np.testing.assert_allclose(get_reward("brightness").fn(flat, []), 128 / 255, rtol=1e-6)


def test_registry_refuses_duplicates_and_lists_names():
    with pytest.raises(ValueError, match="already registered"):
        register_reward("jpeg_compressibility")(lambda im, p: np.zeros(len(im)))
    with pytest.raises(ValueError, match="jpeg_compressibility") as e:
        get_reward("aesthetics")
    assert "aesthetics" in str(e.value)


def test_weighted_sum_of_components():
    noisy, _ = images()
    total, per, valid, problems = evaluate_rewards(
        noisy, ["a"] * 3, [5, 6, 7], {"jpeg_compressibility": 2.0, "brightness": 0.5})
    np.testing.assert_allclose(total, 2 * per["jpeg_compressibility"] + 0.5 * per["brightness"])
    assert valid.all() and not problems


@pytest.fixture
def bad_rewards():
    def raises(im, p):
        raise RuntimeError("reward server down")

    def nan_for_second(im, p):
        out = np.ones(len(im))
        out[1] = np.nan
        return out

    def wrong_shape(im, p):
        return np.ones(len(im) + 1)

    names = {"test_raises": raises, "test_nan": nan_for_second, "test_shape": wrong_shape}
    for name, fn in names.items():
        register_reward(name)(fn)
    yield names
    for name in names:
        REWARDS.pop(name)


@pytest.mark.parametrize("name,message", [
    ("test_raises", r"reward 'test_raises' raised RuntimeError: reward server down for samples \[5, 6, 7\]"),
    ("test_nan", r"reward 'test_nan' returned NaN or inf for samples \[6\]"),
    ("test_shape", r"reward 'test_shape' returned shape \(4,\), expected \(3,\) for samples \[5, 6, 7\]"),
])
def test_bad_rewards_name_the_reward_and_samples(bad_rewards, name, message):
    noisy, _ = images()
    with pytest.raises(RewardError, match=message):
        evaluate_rewards(noisy, ["a"] * 3, [5, 6, 7], {name: 1.0})
    total, _, valid, problems = evaluate_rewards(noisy, ["a"] * 3, [5, 6, 7], {name: 1.0},
                                                 on_error="drop")
    assert len(problems) == 1
    assert np.isnan(total[~valid]).all() and np.isfinite(total[valid]).all()
    expected_valid = [True, False, True] if name == "test_nan" else [False] * 3
    assert valid.tolist() == expected_valid
