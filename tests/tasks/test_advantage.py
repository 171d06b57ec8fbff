import numpy as np

from digenrl.tasks.advantage import advantage, group_advantages
from digenrl.tasks.types import RewardOut


def test_group_relative_advantages():
    r = np.array([1.0, 2.0, 3.0, 4.0])
    a = group_advantages(r, np.ones(4, bool), clip=5.0)
    np.testing.assert_allclose(a, (r - r.mean()) / (r.std() + 1e-4), rtol=1e-6)
    assert abs(a.mean()) < 1e-6


def test_advantages_are_clipped_and_invalid_samples_get_zero():
    r = np.array([0.0, 0.0, 0.0, 100.0, np.nan])
    valid = np.array([True, True, True, True, False])
    a = group_advantages(r, valid, clip=1.5)
    assert a.max() == 1.5 and a[4] == 0.0


def test_a_group_without_two_valid_samples_has_no_signal():
    a = group_advantages(np.array([1.0, np.nan]), np.array([True, False]), clip=5.0)
    assert (a == 0).all()


def test_batch_std_uses_every_reward_of_the_iteration():
    parts = [RewardOut((0, 1), np.array([0.0, 2.0]), {}, np.ones(2, bool)),
             RewardOut((2, 3), np.array([10.0, 30.0]), {}, np.ones(2, bool))]
    group0 = advantage(0, (0, 1), "group", 5.0, parts[0])
    batch0 = advantage(0, (0, 1), "batch", 5.0, *parts)
    np.testing.assert_allclose(group0.advantages, [-1 / 1.0001, 1 / 1.0001], rtol=1e-5)
    batch_std = np.std([0.0, 2.0, 10.0, 30.0])
    np.testing.assert_allclose(batch0.advantages, np.array([-1.0, 1.0]) / (batch_std + 1e-4),
                               rtol=1e-5)
