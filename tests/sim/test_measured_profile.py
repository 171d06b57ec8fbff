"""A run's measured cost profile: written by the report, read by the simulator."""

from __future__ import annotations

import numpy as np

from digenrl.commands.report import write_report
from digenrl.schedulers.options import MODES, ScheduleOptions
from digenrl.sim.profile import load_profile
from digenrl.sim.simulate import simulate
from digenrl.vocabulary import GPU_KINDS, REWARD


def test_the_report_writes_the_runs_costs_and_the_simulator_runs_them(reference_run,
                                                                       tmp_path):
    result, ds = reference_run
    written, text = write_report(result.store, tmp_path)
    path = tmp_path / "profile.yaml"
    assert path in written
    assert f"digenrl simulate {path} --splits" in text
    profile = load_profile(path)
    assert (profile.rollout_workers, profile.trainer_workers) == (1, 1)

    # Its GPU work per iteration is the run's own, past the first iteration.
    t = ds["tasks"].to_dataframe()
    gpu = t[(t.iteration >= 1) & (t.kind.isin(GPU_KINDS) | (t.kind.eq(REWARD) & t.gpu))]
    per_iteration = float((gpu.stop - gpu.start).sum()) / (t.iteration.max())
    assert np.isclose(profile.gpu_seconds_per_iteration(), per_iteration, rtol=1e-6), (
        profile.gpu_seconds_per_iteration(), per_iteration)
    assert profile.costs.train_factor > 1   # a micro-step costs more than a step

    # The simulator runs the run's workload in each mode, within the ideal bound (over
    # 8 iterations: in a shorter window the iterations' completions bunch, and work done
    # ahead of the window, such as the next groups' encodings, can lift it above).
    for mode in ("disaggregated", "digenrl"):
        r = simulate(profile, ScheduleOptions(mode=mode, **MODES[mode]), 8)
        assert 0 < r.ideal_fraction <= 1, (mode, r.ideal_fraction)
