"""Stragglers in profiles: per-worker speeds, transient slowdowns, and what rebalancing
recovers in the simulator (the emulated check is in docs/performance.md)."""

from __future__ import annotations

import pytest
import yaml

from digenrl.schedulers.options import MODES, ScheduleOptions
from digenrl.sim.profile import ProfileError, load_profile, profile_from_dict
from digenrl.sim.simulate import simulate



@pytest.fixture(scope="module")
def straggler():
    return load_profile("flux12b-straggler-16gpu")


def opts(**kw):
    return ScheduleOptions(mode="digenrl", **{**MODES["digenrl"], **kw})


def test_the_profile_declares_per_worker_speeds_and_a_transient_slowdown(straggler):
    speeds = straggler.speeds()
    assert [speeds[f"rollout-{j}"] for j in range(6)] == [0.5, 0.5, 0.5, 1.0, 1.0, 1.0]
    assert all(speeds[f"trainer-{j}"] == 1.0 for j in range(10))
    assert straggler.slowdown_factor("rollout-3", 599.0) == 1.0
    assert straggler.slowdown_factor("rollout-3", 600.0) == 5.0
    assert straggler.slowdown_factor("rollout-4", 900.0) == 1.0
    assert straggler.slowdown_factor("rollout-3", 1800.0) == 1.0
    # The heterogeneous bound counts each worker at its declared speed.
    flat = straggler.ideal_images_per_s(16.0)
    assert straggler.ideal_images_per_s() == pytest.approx(flat * 14.5 / 16)


def test_rebalancing_recovers_what_stragglers_cost(straggler):
    moved = simulate(straggler, opts(), 6)
    pinned = simulate(straggler, opts(rebalance=False), 6)
    assert moved.ideal_fraction >= 0.9
    assert moved.images_per_s > 1.2 * pinned.images_per_s
    # Work left the slow and the slowed-down workers: per declared speed, they did less.
    def per_speed(report, name):
        busy = sum(r.stop - r.start for r in report.result.records
                   if r.worker == name and r.kind == "denoise")
        return busy * straggler.speed_of(name)
    assert per_speed(moved, "rollout-0") < per_speed(pinned, "rollout-0")


@pytest.mark.parametrize("change, field", [
    ({"worker_speeds": {"rollout-9": 0.5}}, "profile.worker_speeds"),
    ({"worker_speeds": {"rollout-0": 0}}, "profile.worker_speeds.rollout-0"),
    ({"slowdowns": [{"worker": "rollout-0", "factor": 2.0, "start": 5.0}]}, r"profile.slowdowns\[0\]"),
    ({"slowdowns": [{"worker": "trainer-99", "factor": 2.0, "start": 0, "stop": 1}]},
     r"profile.slowdowns\[0\].worker"),
    ({"slowdowns": [{"worker": "rollout-0", "factor": 2.0, "start": 5, "stop": 5}]},
     r"profile.slowdowns\[0\].stop"),
])
def test_bad_straggler_fields_name_the_field(change, field):
    from digenrl.sim.profile import PROFILE_DIR

    data = yaml.safe_load((PROFILE_DIR / "flux12b-16gpu.yaml").read_text())
    data.update(change)
    with pytest.raises(ProfileError, match=field):
        profile_from_dict(data)
