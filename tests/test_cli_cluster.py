"""A cluster started from the command line, as README.md documents, runs a workflow."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import NamedTuple

import pytest
import yaml
from distributed import Client

import digenrl
from digenrl.store import open_run, read_attrs

from conftest import REFERENCE_ITERATIONS, SMALL, assert_complete, assert_same_results
from test_driver_loss import resume, stored_weights
from test_signals import committed, wait_for_commits


BIN = Path(sys.executable).parent
#: Where digenrl's own code is: no traceback may pass through it.
PACKAGE = Path(digenrl.__file__).parent


def poll(predicate, timeout=60.0, what="condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.1)
    raise TimeoutError(f"timed out waiting for {what}")


class CliCluster(NamedTuple):
    address: str
    scheduler: subprocess.Popen  #: the `dask scheduler` process


def start_cli_cluster(folder: Path) -> tuple[CliCluster, list[subprocess.Popen]]:
    """A scheduler and a rollout and a trainer worker, each started with ``dask``.
    Returns the cluster and its processes (the scheduler first)."""
    sched_file = folder / "scheduler.json"
    env = {**os.environ, "DASK_DISTRIBUTED__LOGGING__DISTRIBUTED": "warning"}
    procs = [subprocess.Popen(
        [str(BIN / "dask"), "scheduler", "--host", "127.0.0.1", "--port", "0",
         "--dashboard-address", ":0", "--scheduler-file", str(sched_file),
         "--preload", "digenrl.schedulers.preload"], env=env,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)]
    try:
        poll(sched_file.exists, what="the scheduler file")
        poll(lambda: "address" in json.loads(sched_file.read_text() or "{}"),
             what="the scheduler address")
        address = json.loads(sched_file.read_text())["address"]
        for pool in ("rollout", "trainer"):
            procs.append(subprocess.Popen(
                [str(BIN / "dask"), "worker", address, "--nthreads", "2",
                 "--resources", f"GPU=1,{pool}=1", "--name", f"cli-{pool}",
                 "--no-dashboard"], env=env,
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        with Client(address) as c:
            c.wait_for_workers(2, timeout=60)
            assert "digenrl" in c.run_on_scheduler(lambda dask_scheduler: list(dask_scheduler.plugins))
    except BaseException:
        stop(procs)
        raise
    return CliCluster(address, procs[0]), procs


def stop(procs: list[subprocess.Popen]) -> None:
    """The workers first, while their scheduler still answers (a worker whose scheduler
    is gone waits for it before it exits), then the scheduler."""
    for group in (procs[1:], procs[:1]):
        for p in group:
            p.terminate()
        for p in group:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


@pytest.fixture(scope="module")
def cli_clusters(tmp_path_factory):
    """``get()``: this module's command-line cluster, started on first use and started
    again once a test has killed its scheduler (the tests share it: each run releases
    all it holds when it ends)."""
    started: list[tuple[CliCluster, list[subprocess.Popen]]] = []

    def get() -> CliCluster:
        if not started or started[-1][0].scheduler.poll() is not None:
            started.append(start_cli_cluster(tmp_path_factory.mktemp("cli-cluster")))
        return started[-1][0]

    yield get
    for _, procs in started:
        stop(procs)


@pytest.fixture
def cli_cluster(cli_clusters):
    return cli_clusters()


@pytest.mark.slow
def test_digenrl_run_on_a_command_line_cluster(cli_cluster, tmp_path):
    # The small config of the reliability tests (the default workflow's model is
    # exercised by tests/test_end_to_end.py), two iterations.
    config = tmp_path / "small.yaml"
    config.write_text(yaml.safe_dump(SMALL))
    out = tmp_path / "run.zarr"
    proc = subprocess.run(
        [str(BIN / "digenrl"), "run", str(config), "--out", str(out), "--scheduler",
         cli_cluster.address, "--iterations", "2", "--no-progress"],
        capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "iteration 2/2" in proc.stderr
    t = open_run(out)["tasks"].to_dataframe()
    assert set(t.worker_name) == {"cli-rollout", "cli-trainer"}
    # Training runs on the trainer, but for micro-steps lent to the idle rollout worker.
    training = t[t.kind.isin(["grad", "reduce", "optimize"])]
    assert not (training.pool.eq("rollout") & ~training.rat).any()
    assert set(training.kind[training.rat]) <= {"grad"}
    assert (t.pool[t.worker_name == "cli-rollout"] == "rollout").all()
    assert open_run(out)["metrics"].sizes["iteration"] == 2


@pytest.mark.slow
def test_a_killed_scheduler_stops_the_run_and_a_new_one_resumes_it(
        cli_cluster, cluster_1x1, reference_run, tmp_path):
    config = tmp_path / "small.yaml"
    config.write_text(yaml.safe_dump({**SMALL, "iterations": REFERENCE_ITERATIONS}))
    out = tmp_path / "run.zarr"
    proc = subprocess.Popen(
        [str(BIN / "digenrl"), "run", str(config), "--out", str(out), "--scheduler",
         cli_cluster.address, "--no-progress"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        wait_for_commits(proc, out, 1)
        cli_cluster.scheduler.kill()
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 1, err
    done = assert_complete(open_run(out))
    assert 1 <= done == committed(out)
    last = err.strip().splitlines()[-1]
    assert last.startswith(
        f"digenrl run: error: lost the Dask scheduler at {cli_cluster.address} "), err
    assert last.endswith(f"; {out} holds {done} complete iteration{'s' if done != 1 else ''}; "
                         f"start a scheduler and continue with: digenrl run --resume {out} "
                         "--scheduler NEW_ADDRESS"), err
    # (Dask's client may log a traceback of its own as it gives up reconnecting.)
    assert f'File "{PACKAGE}' not in err, err
    # On a new scheduler (the session's cluster), the run ends as if never stopped
    # (stopped before its last commit, or after it but before the final weights).
    if read_attrs(out).get("finished") != REFERENCE_ITERATIONS:
        assert resume(out, cluster_1x1) == 0
    assert_same_results(open_run(out), stored_weights(out), reference_run)
