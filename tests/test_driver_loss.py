"""Driver loss: ``digenrl run`` killed with SIGKILL mid-iteration, then ``--resume``.

The store is committed one iteration at a time (consolidated metadata replaced in one
atomic write), and each iteration's commit comes after the checkpoints of the trainer
state it needs (weights and AdamW moments of the newest versions). Every random draw is
keyed by the run seed and what is drawn, and which policy version each chunk is generated
with is fixed by the schedule, so a resumed run has no other state to restore: it ends
bit-identical to the run that was never interrupted.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import yaml

from digenrl.store.checkpoints import complete_checkpoints, read_weights
from digenrl.commands.cli import main
from digenrl.run.runner import Runner
from digenrl.store import StoreError, committed_iterations, open_run, read_attrs

from conftest import (REFERENCE_ITERATIONS, SMALL, assert_complete, assert_same_results,
                      small_config)
from invariants import assert_schedule_invariants

BIN = Path(sys.executable).parent


def stored_weights(path) -> dict[str, np.ndarray]:
    return read_weights(path)[1]


def group_processes(pgid: int) -> list[int]:
    """Live (not zombie) processes of process group ``pgid``."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            out.append(int(stat.parent.name))
    return out


def resume(path, cluster, *extra) -> int:
    return main(["run", "--resume", str(path), "--scheduler", cluster.client.scheduler.address,
                 "--no-progress", "--quiet", *extra])


def committed(out) -> int:
    """Iterations committed to ``out`` so far (0 while the run has not created it whole)."""
    try:
        return committed_iterations(out) if (out / "zarr.json").is_file() else 0
    except StoreError:  # created, its run attributes not written yet
        return 0


def read_while(run, path) -> set[int]:
    """Open the store over and over while ``run`` (a future) writes it; every read must
    be whole. Returns the iteration counts seen."""
    seen = set()
    while not run.done():
        seen.add(assert_complete(open_run(path)))
        time.sleep(0.02)
    run.result()
    return seen


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads process groups from /proc")
def test_a_killed_driver_resumes_to_the_same_bits(cluster_1x1, reference_run, tmp_path):
    config = tmp_path / "small.yaml"
    config.write_text(yaml.safe_dump({**SMALL, "iterations": REFERENCE_ITERATIONS}))
    out = tmp_path / "run.zarr"
    log = tmp_path / "driver.log"
    # The whole run -- driver, its local cluster's nannies and workers -- in one
    # process group, killed at once as a crash of the machine's job would.
    with open(log, "w") as f:
        proc = subprocess.Popen([str(BIN / "digenrl"), "run", str(config), "--out", str(out),
                                 "--no-progress"], stdout=f, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while committed(out) < 1:
            assert proc.poll() is None, f"the run ended first:\n{log.read_text()}"
            assert time.monotonic() < deadline, f"no iteration committed:\n{log.read_text()}"
            time.sleep(0.02)
        # Later iterations are in flight: the driver keeps two more in the cluster than
        # the oldest uncommitted one, and the fourth goes in only after the first commit.
        # (The commit is seen in the run's attributes, a quick read: a whole read of the
        # store can take long enough for a small run to finish meanwhile.)
        os.killpg(proc.pid, signal.SIGKILL)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        deadline = time.monotonic() + 60
        while group_processes(proc.pid):
            assert time.monotonic() < deadline, group_processes(proc.pid)
            time.sleep(0.05)

    # After the crash: only complete iterations, readable, and the checkpoints a resume
    # needs (versions n - max_staleness .. n).
    done = assert_complete(open_run(out))
    assert 1 <= done < REFERENCE_ITERATIONS and done == committed_iterations(out)
    assert set(complete_checkpoints(out)) >= {done - 1, done}

    # Resume (on another cluster), reading the store all along as it writes.
    with ThreadPoolExecutor(1) as pool:
        run = pool.submit(resume, out, cluster_1x1)
        seen = read_while(run, out)
        assert run.result() == 0
    assert seen <= set(range(done, REFERENCE_ITERATIONS + 1)), seen

    ds = open_run(out)
    assert_same_results(ds, stored_weights(out), reference_run)
    attrs = read_attrs(out)
    assert [r["at_iteration"] for r in attrs["resumed"]] == [done]
    assert attrs["finished"] == REFERENCE_ITERATIONS
    assert_schedule_invariants(ds["tasks"].to_dataframe(), small_config().schedule.options())


class DriverStopped(Exception):
    pass


def test_resume_extends_a_finished_run_and_finishes_a_stopped_one(
        cluster_1x1, reference_run, tmp_path):
    out = tmp_path / "run.zarr"
    Runner(small_config(iterations=REFERENCE_ITERATIONS - 1), str(out), cluster=cluster_1x1).run()
    assert read_attrs(out)["finished"] == REFERENCE_ITERATIONS - 1

    # Extend it by one iteration; the driver stops right after that iteration's commit,
    # before the final weights are written.
    def stop_after_the_last(summary):
        if summary.iteration == REFERENCE_ITERATIONS - 1:
            raise DriverStopped

    with pytest.raises(DriverStopped):
        Runner(small_config(iterations=REFERENCE_ITERATIONS), str(out), resume=True,
               cluster=cluster_1x1, on_iteration=stop_after_the_last).run()
    assert committed_iterations(out) == REFERENCE_ITERATIONS
    assert read_attrs(out)["config"]["iterations"] == REFERENCE_ITERATIONS

    # Resuming it only writes the final state, from the last checkpoint.
    assert resume(out, cluster_1x1) == 0
    assert_same_results(open_run(out), stored_weights(out), reference_run)
    assert read_attrs(out)["finished"] == REFERENCE_ITERATIONS


def test_a_run_checkpointing_every_few_iterations_resumes_at_its_last_resume_point(
        cluster_1x1, reference_run, tmp_path, caplog):
    out = tmp_path / "run.zarr"
    cfg = small_config(iterations=REFERENCE_ITERATIONS, **{"store.checkpoint_every": 4})

    def stop_after_the_second(summary):
        if summary.iteration == 1:
            raise DriverStopped

    with pytest.raises(DriverStopped):
        Runner(cfg, str(out), cluster=cluster_1x1, on_iteration=stop_after_the_second).run()
    assert committed_iterations(out) == 2
    # Versions 1 and 2 (the checkpoints a resume at iteration 2 restores) were never
    # written: the run starts computing again at iteration 0 and stores from iteration 2.
    written = set(complete_checkpoints(out))
    assert 0 in written and not written & {1, 2}, written
    with caplog.at_level(logging.INFO, logger="digenrl"):
        assert main(["run", "--check", "--resume", str(out)]) == 0
    assert (f"would resume {out} at iteration 2, computing iterations 0 to 1 again"
            in caplog.text), caplog.text
    assert resume(out, cluster_1x1) == 0
    ds = open_run(out)
    assert_same_results(ds, stored_weights(out), reference_run)
    [resumed] = read_attrs(out)["resumed"]
    assert (resumed["at_iteration"], resumed["computed_from"]) == (2, 0)
    # The task records keep the work done twice: iterations 0 and 1 ran in both runs.
    # (The first run's record of a later step is stored too if it was read before the
    # run stopped.)
    steps = ds["tasks"].to_dataframe().query("kind == 'optimize'").iteration
    counts = steps.value_counts().to_dict()
    assert counts[0] == counts[1] == 2 and counts[3] == 1 and counts[2] in (1, 2), counts


@pytest.mark.parametrize("argv,message", [
    (["--resume", "{ref}"], "resume: the store already holds 4 iterations; pass --iterations "
                            "above 4 to continue it"),
    (["--resume", "{ref}", "--set", "train.learning_rate=0.5"],
     "resume: the config differs from the stored run's in ['train']"),
    (["--out", "{ref}"], "out: expected a path that does not exist yet"),
    (["--resume", "{missing}"], "--resume: expected an existing digenrl store"),
])
def test_a_store_that_cannot_be_written_is_refused_before_any_work(
        reference_run, tmp_path, capsys, argv, message):
    paths = {"ref": reference_run[0].store, "missing": str(tmp_path / "none.zarr")}
    argv = [a.format(**paths) for a in argv]
    # An unreachable scheduler: had the run started any cluster work, the error would be
    # about the connection.
    assert main(["run", *argv, "--scheduler", "tcp://127.0.0.1:1"]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
