"""Cluster start-up: pool tags, and the fallback when GPUs are asked for but absent."""

import logging
import time

import pytest
from distributed import get_task_stream

from digenrl.run.cluster import pool_counts, start_cluster
from digenrl.config import ClusterConfig

try:
    import dask_cuda  # noqa: F401

    HAVE_DASK_CUDA = True
except Exception:
    HAVE_DASK_CUDA = False


@pytest.mark.skipif(HAVE_DASK_CUDA, reason="dask-cuda imports here; this tests its absence")
def test_gpus_without_dask_cuda_fall_back_to_the_cpu_cluster(caplog):
    caplog.set_level(logging.WARNING, logger="digenrl.run.cluster")
    handle = start_cluster(ClusterConfig(gpus=True, rollout_workers=1, trainer_workers=2,
                                         dashboard_address=":0"))
    try:
        assert "falling back to a CPU LocalCluster" in caplog.text
        assert "pip install 'digenrl[cuda]'" in caplog.text
        assert handle.description["kind"] == "local"
        counts = pool_counts(handle.client)
        assert counts["rollout"] == ["rollout-0"]
        assert sorted(counts["trainer"]) == ["trainer-0", "trainer-1"]
        resources = {w["name"]: w["resources"] for w in
                     handle.client.scheduler_info(n_workers=-1)["workers"].values()}
        assert resources["trainer-1"] == {"GPU": 1, "trainer": 1}
    finally:
        handle.close()


def _listening_ports() -> set[int]:
    """The TCP ports this process listens on (a local cluster's scheduler runs here)."""
    import psutil

    return {c.laddr.port for c in psutil.Process().net_connections(kind="inet")
            if c.status == psutil.CONN_LISTEN}


@pytest.mark.slow
def test_a_local_cluster_without_a_dashboard_opens_no_http_port(tmp_path, caplog):
    """cluster.dashboard_address: null. Dask's scheduler would still listen for HTTP (on
    8787, or any free port) and the run would log a link to a page that is not there:
    here the scheduler opens only its own port (the nannies, which run in this process
    too, their comm ports), lists no dashboard, and a run on it logs no dashboard line."""
    from digenrl.run.cluster import HeadlessScheduler
    from digenrl.run.runner import Runner

    from conftest import small_config

    before = _listening_ports()
    handle = start_cluster(ClusterConfig(rollout_workers=1, trainer_workers=1,
                                         dashboard_address=None))
    try:
        scheduler = handle.cluster.scheduler
        assert isinstance(scheduler, HeadlessScheduler)
        nannies = {nanny.port for nanny in handle.cluster.workers.values()}
        assert len(nannies) == 2  # the workers' nannies run here too, on their comm ports
        assert _listening_ports() - before == {scheduler.port} | nannies
        assert "dashboard" not in handle.client.scheduler_info()["services"]
        assert handle.dashboard_link is None
        with caplog.at_level(logging.INFO, logger="digenrl"):
            Runner(small_config(iterations=1), str(tmp_path / "run.zarr"),
                   cluster=handle).run()
    finally:
        handle.close()
    lines = [r.getMessage() for r in caplog.records]
    assert any(line.startswith("workers: ") for line in lines), lines  # the run logged
    assert not [line for line in lines if "dashboard" in line or ":8787" in line]


def test_an_emulated_cluster_without_a_dashboard_gives_no_link_and_listens_on_loopback():
    """The emulated cluster's scheduler runs in a process Dask starts, whose HTTP server
    cannot be left out: with the dashboard off it listens on 127.0.0.1 only, on a free
    port (not 8787), serves no dashboard page, and the handle gives no link."""
    import urllib.error
    import urllib.request

    import psutil

    from digenrl.run.cluster import start_emulated_cluster

    handle = start_emulated_cluster(1, 1, {}, dashboard_address=None)
    try:
        assert handle.dashboard_link is None
        scheduler = psutil.Process(handle.cluster.scheduler.process.pid)
        listening = {(c.laddr.ip, c.laddr.port) for c in scheduler.net_connections("inet")
                     if c.status == psutil.CONN_LISTEN}
        http_port = handle.client.scheduler_info()["services"]["dashboard"]
        assert {ip for ip, _ in listening} == {"127.0.0.1"}, listening
        assert ("127.0.0.1", http_port) in listening and http_port != 8787
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(f"http://127.0.0.1:{http_port}/status", timeout=10)
        assert e.value.code == 404
    finally:
        handle.close()


def _heartbeat_running(dask_worker) -> bool:
    return dask_worker.periodic_callbacks["heartbeat"].is_running()


def test_a_started_clusters_workers_stop_their_heartbeats_before_it_closes():
    """ClusterHandle.close stops every worker's heartbeat before the scheduler goes: a
    heartbeat under way while it closes logs Dask's "Failed to communicate with
    scheduler during heartbeat" traceback after the command's output."""
    from digenrl.run.cluster import start_emulated_cluster, stop_heartbeats

    handle = start_emulated_cluster(1, 1, {}, dashboard_address=None)
    try:
        running = handle.client.run(_heartbeat_running)
        assert len(running) == 2 and all(running.values())
        stop_heartbeats(handle.client)
        assert handle.client.run(_heartbeat_running) == dict.fromkeys(running, False)
    finally:
        handle.close()


def _offset_as_a_heartbeat_sets_it(dask_worker) -> float:
    dask_worker.scheduler_delay = 0.25  # a heartbeat's estimate of the clocks' offset
    return dask_worker.scheduler_delay


def _now() -> float:
    return time.time()


def test_a_local_clusters_workers_report_the_hosts_clock(cluster_1x1):
    """All processes of a local cluster read one clock, so a worker reports the times it
    reads (``digenrl.run.cluster.OneClockWorker``): a task's compute span, as the task
    records get it, holds the time the task read while it ran, whatever offset a
    heartbeat estimated. Dask's own worker would shift the span by that estimate."""
    client = cluster_1x1.client
    assert set(client.run(_offset_as_a_heartbeat_sets_it).values()) == {0.0}
    with get_task_stream(client) as stream:
        inside = client.submit(_now, pure=False).result()
    [computed] = [ss for task in stream.data for ss in task["startstops"]
                  if ss["action"] == "compute"]
    assert computed["start"] <= inside <= computed["stop"], (computed, inside)


def test_a_gpu_workers_memory_is_what_dasks_nvml_diagnostics_report():
    """The scheduler's worker information: a worker started on a GPU carries Dask's NVML
    startup information (``gpu``: ``memory-total`` in bytes); one on the CPU none."""
    from digenrl.run.cluster import gpu_memory_of

    workers = {"tcp://a:1": {"name": "rollout-0", "gpu": {"name": "NVIDIA H200",
                                                         "memory-total": 143771566080}},
               "tcp://b:1": {"name": "trainer-0"}}
    assert gpu_memory_of(workers) == {"rollout-0": 143.77156608}
