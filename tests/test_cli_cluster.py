"""A cluster started from the command line, as README.md documents, runs a workflow."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from distributed import Client

from digenrl.store import open_run


BIN = Path(sys.executable).parent
TINY = Path(__file__).resolve().parents[1] / "workflows" / "configs" / "tiny.yaml"


def poll(predicate, timeout=60.0, what="condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.1)
    raise TimeoutError(f"timed out waiting for {what}")


@pytest.fixture
def cli_cluster(tmp_path):
    sched_file = tmp_path / "scheduler.json"
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
        yield address
    finally:
        # The workers first, while their scheduler still answers (a worker whose
        # scheduler is gone waits for it before it exits), then the scheduler.
        for group in (procs[1:], procs[:1]):
            for p in group:
                p.terminate()
            for p in group:
                try:
                    p.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()


@pytest.mark.slow
def test_digenrl_run_on_a_command_line_cluster(cli_cluster, tmp_path):
    # The default workflow (README.md), shortened to two iterations.
    out = tmp_path / "run.zarr"
    proc = subprocess.run(
        [str(BIN / "digenrl"), "run", str(TINY), "--out", str(out), "--scheduler", cli_cluster,
         "--iterations", "2", "--no-progress"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "iteration 2/2" in proc.stderr
    t = open_run(out)["tasks"].to_dataframe()
    assert set(t.worker_name) == {"cli-rollout", "cli-trainer"}
    assert not t[t.kind.isin(["grad", "reduce", "optimize"])].pool.eq("rollout").any()
    assert (t.pool[t.worker_name == "cli-rollout"] == "rollout").all()
    assert open_run(out)["metrics"].sizes["iteration"] == 2
