"""Shared fixtures: small real components and real local Dask clusters.

The clusters are session-scoped (starting worker processes costs seconds); every run
registers its own scheduler policy and worker state, so runs never see each other's.
"""

from __future__ import annotations

import logging
import os

import pytest

from digenrl.config import ClusterConfig, config_from_dict

os.environ.setdefault("PYTHONHASHSEED", "0")
logging.getLogger("distributed").setLevel(logging.WARNING)

#: A small model and iteration so cluster tests take seconds; every mechanism is real.
SMALL = {
    "seed": 3,
    "iterations": 3,
    "model": {"image_size": 32, "vae_channels": [8, 16, 16], "transformer_layers": 2,
              "attention_heads": 2, "attention_head_dim": 16, "prompt_tokens": 4,
              "prompt_embed_dim": 16, "pooled_embed_dim": 8},
    "sampler": {"num_steps": 4, "timestep_fraction": 0.5},
    "data": {"prompts_per_iteration": 2, "samples_per_prompt": 2},
    "rollout": {"chunk_size": 2},
    "train": {"learning_rate": 1e-3},
    "cluster": {"dashboard_address": None},
}


def small_config(**overrides):
    """SMALL with dotted-key overrides, e.g. small_config(**{"schedule.mode": "colocated"})."""
    from digenrl.config import apply_overrides

    return config_from_dict(apply_overrides(SMALL, overrides))


def _cluster(rollout: int, trainer: int):
    from digenrl.cluster import start_cluster

    return start_cluster(ClusterConfig(rollout_workers=rollout, trainer_workers=trainer,
                                       dashboard_address=":0"))


@pytest.fixture(scope="session")
def cluster_1x1():
    handle = _cluster(1, 1)
    yield handle
    handle.close()


@pytest.fixture(scope="session")
def cluster_2x2():
    handle = _cluster(2, 2)
    yield handle
    handle.close()


@pytest.fixture
def store_path(tmp_path):
    return str(tmp_path / "run.zarr")
