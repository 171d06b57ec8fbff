"""Cluster start-up: pool tags, and the fallback when GPUs are asked for but absent."""

import logging

import pytest

from digenrl.cluster import pool_counts, start_cluster
from digenrl.config import ClusterConfig

try:
    import dask_cuda  # noqa: F401

    HAVE_DASK_CUDA = True
except Exception:
    HAVE_DASK_CUDA = False


@pytest.mark.skipif(HAVE_DASK_CUDA, reason="dask-cuda imports here; this tests its absence")
def test_gpus_without_dask_cuda_fall_back_to_the_cpu_cluster(caplog):
    caplog.set_level(logging.WARNING, logger="digenrl.cluster")
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
