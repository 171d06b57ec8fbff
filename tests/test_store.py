"""The store: layout, appends, and what a reader sees when a writer stops midway."""

import numpy as np
import pytest
import xarray as xr

from digenrl.store import RunStore, StoreError, open_run


def rows(i, n=3):
    return {
        "samples": {"reward": np.arange(n, dtype=np.float64) + i,
                    "prompt": np.array([f"p{i}"] * n)},
        "steps": {"log_prob": np.full((n, 2), i, np.float32)},
        "metrics": {"reward_mean": np.float64(i)},
        "tasks": {"key": np.array([f"k{i}a", f"k{i}b"]), "start": np.array([1.0, 2.0])},
    }


def test_append_and_read_back(store_path):
    s = RunStore.create(store_path, {"config": {"seed": 1}})
    for i in range(3):
        s.append_iteration(rows(i))
    runs = open_run(store_path)
    assert runs["samples"].reward.shape == (3, 3)
    assert list(runs["samples"].prompt.values[:, 0]) == ["p0", "p1", "p2"]
    assert runs["steps"].log_prob.dims == ("iteration", "sample", "step")
    assert runs["tasks"].sizes["task"] == 6
    assert runs["metrics"].attrs["digenrl"]["config"] == {"seed": 1}
    ds = xr.open_zarr(store_path, group="metrics")
    np.testing.assert_array_equal(ds.reward_mean.values, [0, 1, 2])


def test_a_reader_never_sees_a_partial_iteration(store_path):
    s = RunStore.create(store_path, {})
    s.append_iteration(rows(0))
    # A writer that dies after writing part of the next iteration, before its commit.
    s._append("samples", "reward", rows(1)["samples"]["reward"])
    s._append("tasks", "key", np.array(["x", "y", "z"]))
    for group in ("samples", "steps", "metrics", "tasks"):
        ds = xr.open_zarr(store_path, group=group)
        assert ds.sizes.get("iteration", 1) == 1
    assert xr.open_zarr(store_path, group="tasks").sizes["task"] == 2
    # Reopening for appending cuts the uncommitted rows and continues cleanly.
    s2 = RunStore.open(store_path)
    assert s2.iterations_complete == 1 and s2.tasks_complete == 2
    s2.append_iteration(rows(1))
    runs = open_run(store_path)
    np.testing.assert_array_equal(runs["samples"].reward.values[1], [1, 2, 3])
    assert list(runs["tasks"].key.values) == ["k0a", "k0b", "k1a", "k1b"]


def test_refuses_to_overwrite_and_checks_shapes(store_path, tmp_path):
    RunStore.create(store_path, {})
    with pytest.raises(StoreError, match="does not exist yet"):
        RunStore.create(store_path, {})
    s = RunStore.create(store_path, {}, overwrite=True)
    s.append_iteration(rows(0))
    bad = rows(1)
    bad["samples"]["reward"] = np.zeros(4)
    with pytest.raises(StoreError, match=r"samples.reward: expected rows of shape \(3,\)"):
        s.append_iteration(bad)
    with pytest.raises(StoreError, match="expected an existing digenrl store"):
        open_run(tmp_path / "missing.zarr")
