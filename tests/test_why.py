"""``digenrl why`` on a finished run's store: the rules that decided each task, and why.

The run is the shared pipelined run on the 1 + 1 cluster (test_digenrl_mode's, where
the rollout worker is lent grads); a step stolen at a timestep boundary is told by
tests/test_rebalance_cluster.py (a slowed rollout worker) and, in the simulator, by
tests/schedulers/test_trail.py.
"""

from __future__ import annotations

import pytest

from digenrl.commands.cli import main
from digenrl.schedulers.policy.trail import key_parts

from conftest import pipelined_config


@pytest.fixture(scope="module")
def run(cluster_1x1, shared_runs):
    r = shared_runs(cluster_1x1, pipelined_config())
    return r.result.store, r.ds["tasks"].to_dataframe()


def why(capsys, *argv) -> tuple[int, str, str]:
    code = main(["why", *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_a_lent_grads_story_names_rat_and_its_reason(run, capsys):
    path, tasks = run
    lent = tasks[tasks.rat].iloc[0]
    code, out, _ = why(capsys, path, lent.key)
    assert code == 0
    lines = out.splitlines()
    assert lines[0] == (f"{lent.key}: grad of iteration {lent.iteration} "
                        f"(policy version {lent.policy_version})")
    assert lines[1] == f"  ran on {lent.worker_name} (rollout pool) [rat]"
    assert "  ready " in lines[2] and " released " in lines[2] and " stop " in lines[2]
    decided = [line for line in lines if f"lent to {lent.worker_name}: RAT -- " in line]
    assert len(decided) == 1
    assert (("the worker is idle and every trainer busy; it finishes the grad in" in decided[0])
            or ("which can wait for the version change" in decided[0]))
    assert "<=" in decided[0] and "on the first trainer to free" in decided[0]
    # The same story for the key written plainly.
    plain = ",".join(key_parts(lent.key))
    assert why(capsys, path, plain)[1] == out


def test_a_task_held_by_the_staleness_bound_says_until_when(run, capsys):
    path, tasks = run
    held = tasks[tasks.decisions.str.contains("\theld\tstaleness\t")]
    assert len(held) > 0
    # Rollout work of iteration i past the bound: with stale groups, the chunks' noise.
    assert set(held.kind) <= {"encode", "noise", "denoise", "decode", "reward"}
    task = held.iloc[0]
    code, out, _ = why(capsys, path, task.key)
    assert code == 0
    k = 1   # mode digenrl's bound
    needed = task.iteration - k
    held_lines = [line for line in out.splitlines() if "held: staleness -- " in line]
    assert len(held_lines) == 1, out
    held_line = held_lines[0]
    published = int(held_line.rsplit("(published: ", 1)[1].rstrip(")"))
    assert held_line.endswith(f"held: staleness -- iteration {task.iteration} waits for "
                              f"version {needed} (published: {published})")
    assert published < needed
    assert f"eligible: staleness -- version {needed} published" in out
    held_at, eligible_at = (out.index("held: staleness"), out.index("eligible: staleness"))
    # Then given to the worker that ran it, by whichever rule: released to it when it
    # frees a slot (a trainer's when idle trainers lend a hand), placed on it, or stolen
    # by it from a worker that fell behind.
    given = [out.index(line) for line in out.splitlines()
             if any(f"{verb} {task.worker_name}: " in line
                    for verb in ("released to", "placed on", "stolen by"))]
    assert held_at < eligible_at < max(given), out
    # The store's times agree: it became eligible after it was ready.
    assert task.eligible > task.ready, out


def test_an_unknown_key_is_one_line_naming_the_nearest_keys(run, capsys):
    path, tasks = run
    code, out, err = why(capsys, path, "grad,99,0,0")
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1
    assert err.startswith(f"digenrl why: error: key: expected the key of a task in {path}, "
                          f"got 'grad,99,0,0'; nearest: ('grad', 3, 0, 0)")


def test_a_path_that_is_no_store_is_one_line(tmp_path, capsys):
    code, out, err = why(capsys, str(tmp_path / "none.zarr"), "grad,0,0,0")
    assert code == 2 and out == ""
    assert err.strip() == (f"digenrl why: error: store: expected an existing digenrl store, "
                           f"got {str(tmp_path / 'none.zarr')!r}")
