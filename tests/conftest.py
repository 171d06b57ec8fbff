"""Shared fixtures: small real components and real local Dask clusters.

The clusters are kept between tests (starting worker processes costs seconds): the one
of a worker per pool for the session, those of several only while the files using them
run. Every run registers its own scheduler policy and worker state, so runs never see
each other's.

Torch computes with one thread in every process of the suite, as on a worker.

Every cluster of the suite -- the session's, the in-process ones, and those of the
``digenrl`` and ``dask`` processes the tests start -- runs with Dask's own state
validation on (each scheduler and worker transition checked), and a test fails if a
scheduler in this process logs an error while it runs.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any, NamedTuple

import dask
import pytest

from digenrl.config import ClusterConfig, config_from_dict

from inprocess import VALIDATING

os.environ.setdefault("PYTHONHASHSEED", "0")
# One torch (OpenMP) thread in each of the suite's processes and in those they start, as
# every worker runs (``cluster.torch_threads``): set before anything imports torch. The
# suite runs a process per core; with a thread per core in each, their threads waited on
# each other's cores (tests/test_families.py took two to five times the CPU-seconds).
os.environ.setdefault("OMP_NUM_THREADS", "1")
logging.getLogger("distributed").setLevel(logging.WARNING)
dask.config.set(VALIDATING)
for _key in ("distributed.scheduler.validate", "distributed.worker.validate"):
    # Processes the tests start (digenrl run, dask scheduler/worker) read it from here.
    os.environ["DASK_" + _key.upper().replace(".", "__").replace("-", "_")] = "True"


class _Errors(logging.Handler):
    """The errors the schedulers running in this process logged with an exception."""

    def __init__(self):
        super().__init__(logging.ERROR)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        # An invalid transition is logged with its exception ("Error transitioning ...");
        # a plain report, such as keys a client could not gather from a killed worker
        # before they were recomputed, is the cluster working as designed.
        if record.exc_info is not None or "transition" in record.getMessage():
            self.records.append(record)


SCHEDULER_ERRORS = _Errors()
logging.getLogger("distributed.scheduler").addHandler(SCHEDULER_ERRORS)


#: The fixtures giving a cluster of several workers per pool (below), and the files whose
#: tests use one (found as the tests are collected).
SEVERAL_WORKERS = ("cluster_2x2", "emulated_2x2")
_SEVERAL_WORKERS_FILES: set = set()


def pytest_collection_modifyitems(items):
    """The files holding a test marked ``first`` (the type check, a minute of one core
    that uses no cluster), then the files using a cluster of several workers per pool,
    then the other files holding slow tests, each file keeping its own order: the suite's
    processes (``-n 2 --dist loadfile --no-loadscope-reorder``) take whole files in this
    order, so that the long files start early and the processes end together instead of
    one finishing a long file alone, and so that each process runs the tests of those
    clusters back to back and then closes them (:func:`pytest_runtest_teardown`)."""
    def files(marker: str) -> set:
        return {item.path for item in items if item.get_closest_marker(marker)}

    first, slow = files("first"), files("slow")
    _SEVERAL_WORKERS_FILES.update(item.path for item in items
                                  if set(SEVERAL_WORKERS) & set(item.fixturenames))
    items.sort(key=lambda item: (item.path not in first,
                                 item.path not in _SEVERAL_WORKERS_FILES,
                                 item.path not in slow))


def pytest_runtest_teardown(item, nextitem):
    """Once the next test of this process is not of a file using the clusters of several
    workers (or there is none), close them: each costs about 0.06 of a core while it
    idles (its heartbeats and monitors), for as long as the suite runs after its last
    test."""
    if nextitem is None or nextitem.path not in _SEVERAL_WORKERS_FILES:
        _SEVERAL_WORKERS.close()


@pytest.fixture(autouse=True)
def no_scheduler_error():
    """A test fails if a scheduler logged an error while it ran: under validation, an
    invalid transition (the plugin's included) is logged and raised there, where the
    test would not see it."""
    start = len(SCHEDULER_ERRORS.records)
    yield
    new = SCHEDULER_ERRORS.records[start:]
    assert not new, "a scheduler logged errors: " + "; ".join(
        r.getMessage()[:300] for r in new)

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
    # Commits a second apart (10 s by default): a short run stopped part-way has
    # committed what it completed a second before, not ten.
    "store": {"commit_interval": 1.0},
}


def small_config(**overrides):
    """SMALL with dotted-key overrides, e.g. small_config(**{"schedule.mode": "colocated"})."""
    from digenrl.config import apply_overrides

    return config_from_dict(apply_overrides(SMALL, overrides))


def pipelined_config(**overrides):
    """small_config with work to pipeline: twelve chains (more than the clusters run at
    once), two of the six groups generated with the previous version, four iterations."""
    return small_config(**{"iterations": 4, "data.prompts_per_iteration": 6,
                           "rollout.chunk_size": 1, "schedule.stale_groups": 2, **overrides})


def checked_config(**overrides):
    """small_config checked against what it names (model folder, prompt files, rewards,
    LoRA targets), as every entry point checks a config before it starts a cluster."""
    from digenrl.run.world import check_world

    cfg = small_config(**overrides)
    check_world(cfg)
    return cfg


def _cluster(rollout: int, trainer: int):
    from digenrl.run.cluster import start_cluster

    return start_cluster(ClusterConfig(rollout_workers=rollout, trainer_workers=trainer,
                                       dashboard_address=":0"))


@pytest.fixture(scope="session")
def cluster_1x1():
    handle = _cluster(1, 1)
    yield handle
    handle.close()


class _Clusters:
    """Clusters started when a test first asks for them and closed together."""

    def __init__(self):
        self.handles: dict[str, Any] = {}

    def get(self, name: str, start):
        if name not in self.handles:
            self.handles[name] = start()
        return self.handles[name]

    def close(self) -> None:
        while self.handles:
            self.handles.popitem()[1].close()


_SEVERAL_WORKERS = _Clusters()


@pytest.fixture
def cluster_2x2():
    """Two rollout and two trainer workers, kept for the tests that use them (above)."""
    return _SEVERAL_WORKERS.get("cluster_2x2", lambda: _cluster(2, 2))


def small_emulated_profile(time_scale: float):
    """The heterogeneous FLUX-like profile's kind of work, small: 2 + 2 workers (rollout
    at half speed), 2 prompts of 4 images, 4 steps, tasks sleeping ``time_scale`` x
    their cost."""
    import dataclasses

    from digenrl.sim.profile import load_profile

    return dataclasses.replace(load_profile("flux12b-hetero-16gpu"), rollout_workers=2,
                               trainer_workers=2, prompts_per_iteration=2,
                               samples_per_prompt=4, chunk_size=2, num_steps=4,
                               trained_steps=2, time_scale=time_scale)


def _emulated_2x2():
    from digenrl.run.cluster import start_emulated_cluster
    from digenrl.vocabulary import ROLLOUT, TRAINER

    p = small_emulated_profile(1.0)
    return start_emulated_cluster(p.rollout_workers, p.trainer_workers,
                                  {ROLLOUT: p.rollout_speed, TRAINER: p.trainer_speed},
                                  dashboard_address=None)


@pytest.fixture
def emulated_2x2():
    """An emulated cluster for :func:`small_emulated_profile` (its pool speeds), kept
    for the tests that use it, as :func:`cluster_2x2`."""
    return _SEVERAL_WORKERS.get("emulated_2x2", _emulated_2x2)


@pytest.fixture
def store_path(tmp_path):
    return str(tmp_path / "run.zarr")


#: Iterations of the reference run the reliability tests reproduce.
REFERENCE_ITERATIONS = 4

#: Metrics that depend only on the config and seed (not on timing or placement).
DETERMINISTIC_METRICS = ("reward_mean", "reward_std", "loss", "kl", "clip_fraction",
                         "approx_kl", "ratio_dev", "importance_weight_mean",
                         "truncated_fraction", "staleness_mean", "grad_norm",
                         "dropped_samples", "policy_version", "weight_sync_bytes")


class SharedRun(NamedTuple):
    """A finished run shared by the tests that assert on it (they only read it; its
    store's ``config`` attribute is the first asker's spelling of the config)."""

    result: Any  #: the RunResult
    ds: Any  #: open_run of its store
    state: dict  #: the scheduler plugin's state right after the run
    timeline: list  #: the plugin's timeline of the run, read right after it


def _same_work_key(cluster, cfg) -> tuple[str, str]:
    """Two configs whose runs on one cluster do the same work map to the same key: the
    config with the schedule's switches resolved (a switch left null and one set to
    the mode's own value schedule alike)."""
    import json

    from digenrl.config import config_to_dict

    data = config_to_dict(cfg)
    data["schedule"] = {**data["schedule"], **cfg.schedule.options().as_dict()}
    return cluster.client.scheduler.address, json.dumps(data, sort_keys=True, default=str)


@pytest.fixture(scope="session")
def shared_runs(tmp_path_factory):
    """``shared_runs(cluster, config)``: a run of ``config`` on a session cluster, made
    the first time a test asks for it and reused by every later test that asks for the
    same work on the same cluster (runs are deterministic: the same config and seed
    give the same bits, so a second run would only repeat the first)."""
    from digenrl.run.runner import Runner
    from digenrl.store import open_run

    runs: dict[tuple[str, str], SharedRun] = {}

    def get(cluster, cfg) -> SharedRun:
        key = _same_work_key(cluster, cfg)
        if key not in runs:
            path = tmp_path_factory.mktemp("shared-run") / "run.zarr"
            result = Runner(cfg, str(path), cluster=cluster).run()
            client = cluster.client
            state = client.sync(client.scheduler.digenrl_state)
            timeline = client.sync(client.scheduler.digenrl_timeline, since=0.0)
            runs[key] = SharedRun(result, open_run(path), state, timeline)
        return runs[key]

    return get


@pytest.fixture(scope="session")
def reference_run(cluster_1x1, shared_runs):
    """An undisturbed run of ``small_config(iterations=4)`` (mode digenrl): what a run
    that loses a worker or its driver, or is resumed, must reproduce bit for bit.
    Returns (RunResult, open_run datasets)."""
    run = shared_runs(cluster_1x1, small_config(iterations=REFERENCE_ITERATIONS))
    return run.result, run.ds


def assert_same_results(ds, weights, reference) -> None:
    """``ds`` (open_run of a store) and ``weights`` (name -> tensor or array) hold the
    reference run's samples, log-probs, deterministic metrics and final weights, bit
    for bit; no sample is missing or dropped."""
    import numpy as np
    import torch

    ref_result, ref = reference
    s, r = ds["samples"], ref["samples"]
    assert s.sizes == r.sizes, (dict(s.sizes), dict(r.sizes))
    assert bool(s.valid.all()) and np.isfinite(s.reward.values).all()
    for name in ("reward", "advantage", "behaviour_version", "trained_version", "group",
                 "prompt"):
        assert np.array_equal(s[name].values, r[name].values), name
    assert np.array_equal(ds["steps"].log_prob.values, ref["steps"].log_prob.values)
    for name in DETERMINISTIC_METRICS:
        assert np.array_equal(ds["metrics"][name].values, ref["metrics"][name].values,
                              equal_nan=True), name
    expected = ref_result.final_weights.tensors
    assert set(weights) == set(expected)
    for name, t in expected.items():
        assert torch.equal(torch.as_tensor(np.asarray(weights[name])), t), name


def assert_complete(ds, *, valid: bool = True) -> int:
    """What a reader of a store (``open_run``) sees is whole: every group holds the same
    iterations, each one complete (every sample scored, unless ``valid`` is False, and
    its optimizer step recorded). Returns how many."""
    import numpy as np

    n = {g: ds[g].sizes.get("iteration", 0) for g in ("samples", "steps", "metrics")}
    assert len(set(n.values())) == 1, n
    k = n["metrics"]
    if k:
        s = ds["samples"]
        if valid:
            assert bool(s.valid.all()) and np.isfinite(s.reward.values).all()
        assert s.reward.shape[0] == k and np.array_equal(np.isfinite(s.reward.values),
                                                         s.valid.values)
        assert np.isfinite(ds["steps"].log_prob.values).all()
        assert np.isfinite(ds["metrics"].reward_mean.values).all()
        t = ds["tasks"]
        optimized = set(t.iteration.values[t.kind.values == "optimize"].tolist())
        assert optimized >= set(range(k)), (optimized, k)
    return k


class _Folders(Mapping):
    """Family name -> its tiny pipeline folder, each saved the first time it is asked
    for (a session that needs only some families builds only those)."""

    def __init__(self, root):
        from digenrl.testing.pipelines import SAVERS

        self.root, self.savers, self.saved = root, SAVERS, {}

    def __getitem__(self, name):
        if name not in self.saved:
            self.saved[name] = self.savers[name](self.root / name)
        return self.saved[name]

    def __iter__(self):
        return iter(self.savers)

    def __len__(self) -> int:
        return len(self.savers)


@pytest.fixture(scope="session")
def tiny_pipelines(tmp_path_factory):
    """A tiny saved pipeline folder of each supported family (each built once per
    session, when first asked for): family name (sd3, flux, wan, qwenimage,
    hunyuanvideo, qwenimage_edit, kontext) -> folder. See digenrl/testing/pipelines.py."""
    return _Folders(tmp_path_factory.mktemp("pipelines"))


def pipeline_config(folder, family: str, **overrides):
    """small_config on a tiny saved pipeline of ``family`` (its model settings set),
    checked against the folder as a run checks it."""
    from digenrl.testing.pipelines import MODEL_SETTINGS

    settings = {f"model.{k}": v for k, v in MODEL_SETTINGS[family].items()}
    return checked_config(**{"model.path": str(folder), **settings, **overrides})


def source_picture(height: int, width: int, seed: int):
    """A smooth random picture, uint8 (height, width, 3): an editing model's source."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    coarse = rng.integers(0, 256, (max(height // 8, 1), max(width // 8, 1), 3), dtype=np.uint8)
    return np.asarray(Image.fromarray(coarse).resize((width, height), Image.BILINEAR))


def write_prompt_lines(folder, lines, name: str = "prompts.jsonl") -> str:
    """A ``.jsonl`` prompt file in ``folder`` holding ``lines`` (dicts); an ``"image"``
    given as uint8 pixels is saved beside it as a PNG and named by its relative path."""
    import json
    from pathlib import Path

    import numpy as np
    from PIL import Image

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    out = []
    for n, line in enumerate(lines):
        line = dict(line)
        if isinstance(line.get("image"), np.ndarray):
            Image.fromarray(line["image"]).save(folder / f"source-{n}.png")
            line["image"] = f"source-{n}.png"
        out.append(json.dumps(line))
    path = folder / name
    path.write_text("\n".join(out) + "\n")
    return str(path)
