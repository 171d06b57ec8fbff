"""Ctrl-C and SIGTERM (what a job scheduler sends) stop ``digenrl run`` cleanly: one line
naming the store, how many iterations it holds and the command that continues it, exit
status 128 + the signal, and a store that ``--resume`` finishes to the same bits."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from digenrl.store import committed_iterations, open_run, read_attrs

from conftest import REFERENCE_ITERATIONS, SMALL, assert_complete, assert_same_results
from test_driver_loss import committed, resume, stored_weights

BIN = Path(sys.executable).parent


def start_run(tmp_path, cluster, overrides=None, iterations=REFERENCE_ITERATIONS):
    """``digenrl run`` of the reference config (with ``overrides``, top-level sections)
    as a process of its own, on ``cluster``."""
    config = tmp_path / "small.yaml"
    config.write_text(yaml.safe_dump({**SMALL, **(overrides or {}), "iterations": iterations}))
    out = tmp_path / "run.zarr"
    address = cluster.client.scheduler.address
    proc = subprocess.Popen(
        [str(BIN / "digenrl"), "run", str(config), "--out", str(out), "--scheduler", address,
         "--no-progress"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    return proc, out, address


def wait_for_commits(proc, out, n: int, timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while committed(out) < n:
        assert proc.poll() is None, f"the run ended first: {proc.stderr.read()}"
        assert time.monotonic() < deadline, f"no iteration committed in {timeout} s"
        time.sleep(0.05)


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_stops_the_run_with_the_resume_command(cluster_1x1, reference_run, tmp_path,
                                                        signum):
    proc, out, address = start_run(tmp_path, cluster_1x1)
    try:
        wait_for_commits(proc, out, 1)
        proc.send_signal(signum)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 128 + signum, err
    done = assert_complete(open_run(out))
    assert 1 <= done == committed_iterations(out)
    last = err.strip().splitlines()[-1]
    name = signal.Signals(signum).name
    assert last == (f"digenrl run: stopped by {name}; {out} holds {done} complete "
                    f"iteration{'s' if done != 1 else ''}; continue with: "
                    f"digenrl run --resume {out} --scheduler {address}"), err
    assert "Traceback" not in err, err
    if signum == signal.SIGINT:
        return  # the stop is the same from here on; SIGTERM's run is resumed below
    # Stopped before the last iteration was committed, or after it but before the final
    # weights were written: either way the resume finishes the run.
    if read_attrs(out).get("finished") != REFERENCE_ITERATIONS:
        assert resume(out, cluster_1x1) == 0
    assert_same_results(open_run(out), stored_weights(out), reference_run)


@pytest.mark.slow
def test_a_second_interrupt_exits_at_once(cluster_1x1, tmp_path):
    proc, out, _ = start_run(tmp_path, cluster_1x1, iterations=20)
    try:
        wait_for_commits(proc, out, 1)
        proc.send_signal(signal.SIGINT)
        for line in proc.stderr:
            if line == "digenrl run: SIGINT received, stopping (again to exit at once)\n":
                break
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    # Either the second signal cut the unwinding short, or the unwinding had already
    # ended when it came; both exit 130 and leave a readable store.
    assert proc.returncode == 130, err
    assert "Traceback" not in err
    assert assert_complete(open_run(out)) >= 1
