"""The simulator: the plugin's policy on simulated clusters (deterministic figures)."""

import pytest

from digenrl.cli import main
from digenrl.schedulers.options import MODES, ScheduleOptions
from digenrl.sim.profile import load_profile
from digenrl.sim.simulate import simulate


def opts(mode, **kw):
    return ScheduleOptions(mode=mode, **{**MODES[mode], **kw})


@pytest.fixture(scope="module")
def flux():
    return load_profile("flux12b-16gpu")


def test_simulated_throughput_never_beats_the_ideal_bound(flux):
    for mode in MODES:
        r = simulate(flux, opts(mode), 5)
        assert 0 < r.ideal_fraction <= 1.0
        assert r.tasks == len(r.result.records)


def test_digenrl_overlaps_what_the_synchronous_designs_serialise(flux):
    dis = simulate(flux, opts("disaggregated"), 6)
    dig = simulate(flux, opts("digenrl"), 6)
    # Rollout and training are balanced in this profile: the synchronous design leaves
    # each pool idle half the time, DigenRL keeps both busy.
    assert dis.ideal_fraction < 0.55 and dig.ideal_fraction > 0.9
    assert dig.images_per_s > 1.8 * dis.images_per_s
    assert dig.utilisation["rollout"] > 0.9 and dig.utilisation["trainer"] > 0.9


def test_weight_sync_is_paid_once_per_version_per_rollout_worker(flux):
    r = simulate(flux, opts("digenrl"), 4)
    # Versions 0..3 are read by rollouts of iterations 0..3 (with one-step staleness,
    # versions 0, 0, 1, 2): at most 3 distinct versions reach each of 5 rollout workers,
    # plus any a trainer reads while generating (trainers hold every version).
    assert r.weight_sync_s <= 3 * 5 * flux.weight_sync_seconds() + 1e-9
    assert r.weight_sync_s >= 2 * 5 * flux.weight_sync_seconds() - 1e-9
    assert simulate(flux, opts("colocated"), 4).weight_sync_s == 0


def test_a_straggler_slows_its_pool(flux):
    base = simulate(flux, opts("digenrl"), 4)
    slow = simulate(flux, opts("digenrl"), 4,
                    slowdown=lambda worker, now: 5.0 if worker == "trainer-0" else 1.0)
    assert slow.images_per_s < base.images_per_s


def test_the_simulation_is_deterministic(flux):
    a = simulate(flux, opts("digenrl"), 4)
    b = simulate(flux, opts("digenrl"), 4)
    assert a.images_per_s == b.images_per_s
    assert [(r.key, r.worker, r.start) for r in a.result.records] == \
           [(r.key, r.worker, r.start) for r in b.result.records]


def test_simulate_command(capsys):
    assert main(["simulate", "flux12b-16gpu", "--gpus", "64", "--iterations", "3",
                 "--variants", "disaggregated,digenrl"]) == 0
    out = capsys.readouterr().out
    assert "digenrl" in out and "64" in out


@pytest.mark.parametrize("argv,message", [
    (["simulate", "nope"], "profile: expected a YAML file or one of"),
    (["simulate", "flux12b-16gpu", "--variants", "fast"], "--variants: expected names from"),
    (["simulate", "flux12b-16gpu", "--gpus", "1"], "--gpus: expected at least 2, got 1"),
])
def test_simulate_refuses_bad_input(capsys, argv, message):
    assert main(argv) == 2
    assert message in capsys.readouterr().err
