"""Rewards that raise, return NaN/inf or the wrong shape, through ``digenrl run``.

With ``reward.on_error: raise`` (the default) the run stops with one line naming the
reward, the samples and the iteration, exit status 1, and the store keeps the complete
iterations before it. With ``drop`` the run completes; those samples are left out of
training and counted in ``metrics.dropped_samples``. The rewards fail only on samples of
a "broken" prompt, which the seed below draws in iteration 1 and not in iteration 0.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

from digenrl.commands.cli import main
from digenrl.prompts import draw_prompts
from digenrl.store import open_run

from conftest import SMALL, assert_complete
from faulty_rewards import MARKER, PROMPTS

TESTS = Path(__file__).resolve().parent


def _seed() -> tuple[int, list[int]]:
    """The first seed whose iteration 0 has no broken prompt and whose iteration 1 has
    exactly one; and that group's sample ids (2 samples per prompt)."""
    for seed in range(1000):
        first, second = (draw_prompts(PROMPTS, 2, seed, i) for i in (0, 1))
        broken = [g for g, p in enumerate(second) if MARKER in p]
        if not any(MARKER in p for p in first) and len(broken) == 1:
            return seed, [2 * broken[0], 2 * broken[0] + 1]
    raise AssertionError("no seed draws the broken prompt in iteration 1 only")


SEED, BROKEN = _seed()

FAILURES = {
    "faulty_raises": "reward 'faulty_raises' raised ConnectionError: reward server refused the "
                   f"request for samples {BROKEN} of iteration 1",
    "faulty_nonfinite": f"reward 'faulty_nonfinite' returned NaN or inf for samples {BROKEN} of "
                      "iteration 1",
    "faulty_wrong_shape": "reward 'faulty_wrong_shape' returned shape (3,), expected (2,) for "
                        f"samples {BROKEN} of iteration 1",
}


@pytest.fixture(scope="module")
def config_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("bad-rewards") / "small.yaml"
    path.write_text(yaml.safe_dump({**SMALL, "iterations": 2, "seed": SEED,
                                    "data": {**SMALL["data"], "prompts": list(PROMPTS)}}))
    return path


def argv(config_file, out, cluster, reward, *extra):
    return ["run", str(config_file), "--out", str(out), "--reward", reward,
            "--scheduler", cluster.client.scheduler.address, "--quiet", "--no-progress",
            *extra]


@pytest.mark.parametrize("reward", sorted(FAILURES))
def test_a_failing_reward_stops_the_run_with_one_line(cluster_1x1, config_file, tmp_path,
                                                       capsys, reward):
    out = tmp_path / "run.zarr"
    assert main(argv(config_file, out, cluster_1x1, reward)) == 1
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if "error:" in line]
    assert len(errors) == 1 and "Traceback" not in err, err
    assert errors[0].startswith(f"digenrl run: error: {FAILURES[reward]} (")
    assert f"holds the 1 complete iteration before it (--resume {out} continues it)" \
        in errors[0]
    assert "reward.on_error: drop" in errors[0]
    # Nothing in the store is corrupted: iteration 0, whole, and nothing of iteration 1.
    assert assert_complete(open_run(out)) == 1


def test_failing_rewards_with_drop_leave_their_samples_out(cluster_1x1, config_file, tmp_path,
                                                          caplog):
    """All three failing rewards as components of one reward, with ``drop``."""
    out = tmp_path / "run.zarr"
    assert main(argv(config_file, out, cluster_1x1, ",".join(sorted(FAILURES)), "--set",
                     "reward.on_error=drop")) == 0
    ds = open_run(out)
    assert assert_complete(ds, valid=False) == 2
    s, m = ds["samples"], ds["metrics"]
    assert m.dropped_samples.values.tolist() == [0.0, float(len(BROKEN))]
    dropped = ~s.valid.values
    assert np.flatnonzero(dropped[1]).tolist() == BROKEN and not dropped[0].any()
    assert np.isnan(s.reward.values[dropped]).all()
    assert (s.advantage.values[dropped] == 0).all()  # left out of training
    assert np.isfinite(m.loss.values).all() and np.isfinite(m.grad_norm.values).all()
    for failure in FAILURES.values():
        assert f"iteration 1: {failure}" in caplog.text  # each logged as a warning


def test_the_command_prints_one_line_and_no_traceback(cluster_1x1, config_file, tmp_path):
    """The real entry point in its own process (the reward registered by importing its
    module first), its whole stderr checked."""
    out = tmp_path / "run.zarr"
    code = ("import sys, faulty_rewards\n"
            "from digenrl.commands.cli import main\n"
            "sys.exit(main(sys.argv[1:]))")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get(
        "PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", code,
                           *argv(config_file, out, cluster_1x1, "faulty_raises")],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert errors == [line for line in proc.stderr.splitlines() if line.strip()], proc.stderr
    assert errors[0].startswith(f"digenrl run: error: {FAILURES['faulty_raises']} (")
    assert assert_complete(open_run(out)) == 1
