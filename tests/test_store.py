"""The store: layout, appends, and what a reader sees when a writer stops midway."""

from pathlib import Path

import numpy as np
import pytest
import xarray as xr
import zarr

from digenrl.store.checkpoints import (complete_checkpoints, drop_checkpoints, read_checkpoint,
                                 read_weights, write_checkpoint, write_weights)
from digenrl.records import SIMULATED_COLUMNS, TASK_COLUMNS, task_columns
from digenrl.store import GROUPS, RunStore, StoreError, open_run, write_all


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


def test_a_task_column_new_to_a_store_fills_its_earlier_rows(store_path):
    # A run written before a task column existed, resumed by a version that records it.
    s = RunStore.create(store_path, {})
    s.append_iteration(rows(0))
    later = rows(1)
    later["tasks"]["transfer_start"] = np.array([0.5, 0.25])
    s.append_iteration(later)
    tasks = open_run(store_path)["tasks"]
    assert tasks.sizes["task"] == 4
    np.testing.assert_array_equal(tasks.transfer_start.values, [np.nan, np.nan, 0.5, 0.25])
    np.testing.assert_array_equal(tasks.start.values, [1.0, 2.0, 1.0, 2.0])


def test_task_records_are_stored_as_their_schema_says(store_path):
    ints = {"iteration": 0, "policy_version": 0, "chunk": 0, "nbytes": 12}
    records = [{"key": "('noise', 0, 0)", "kind": "noise", "start": 1.5, "stop": None,
                "timestep": -1, **ints},
               {"key": "('grad', 0, 0, 1)", "kind": "grad", "gpu": True, "start": 2.0,
                "stop": 3.0, "timestep": 1, **ints}]
    s = RunStore.create(store_path, {})
    s.append_iteration({**rows(0), "tasks": task_columns(records)})
    tasks = open_run(store_path)["tasks"]
    assert set(tasks.data_vars) == set(TASK_COLUMNS)
    for name, column in TASK_COLUMNS.items():
        kind = np.dtype(column.dtype).kind
        assert tasks[name].dtype.kind in ("UTO" if kind == "U" else kind), name
    np.testing.assert_array_equal(tasks.stop.values, [np.nan, 3.0])  # a missing time
    assert list(tasks.timestep.values) == [-1, 1] and list(tasks.gpu.values) == [False, True]
    assert set(SIMULATED_COLUMNS) < set(TASK_COLUMNS)


def write_uncommitted(store: RunStore, groups) -> None:
    """Write one iteration's rows (``groups``, as ``append_iteration`` takes them) as a
    writer does before it commits, and stop there, as a writer that dies does."""
    write_all(store._batch_writes([groups]))


def test_a_reader_never_sees_a_partial_iteration(store_path):
    s = RunStore.create(store_path, {})
    s.append_iteration(rows(0))
    # A writer that dies after writing part of the next iteration, before its commit.
    write_uncommitted(s, {"samples": {"reward": rows(1)["samples"]["reward"]},
                          "tasks": {"key": np.array(["x", "y", "z"])}})
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


def test_checkpoints_round_trip_bit_for_bit_and_drop(store_path):
    RunStore.create(store_path, {})
    rng = np.random.default_rng(0)
    shapes = {"a.weight": (3, 5), "a.bias": (5,), "scale": ()}
    parts = {p: {n: rng.standard_normal(s).astype(np.float32) for n, s in shapes.items()}
             for p in ("params", "exp_avg", "exp_avg_sq")}
    for v in (0, 1, 2):
        write_checkpoint(store_path, v, parts, step=v)
    back, step = read_checkpoint(store_path, 2)
    assert step == 2 and list(back) == list(parts)
    for p in parts:
        for n, a in parts[p].items():
            assert back[p][n].shape == a.shape and back[p][n].tobytes() == a.tobytes()
    assert complete_checkpoints(store_path) == [0, 1, 2]
    # A complete checkpoint stays as written (a restore may be reading it); one whose
    # writer died before marking it complete is replaced.
    other = {p: {n: a + 1 for n, a in arrays.items()} for p, arrays in parts.items()}
    write_checkpoint(store_path, 2, other, step=5)
    assert read_checkpoint(store_path, 2)[1] == 2
    zarr.open_group(str(store_path), mode="r+", use_consolidated=False)["checkpoints"]["v1"].attrs["complete"] = False
    write_checkpoint(store_path, 1, other, step=5)
    back, step = read_checkpoint(store_path, 1)
    assert step == 5 and back["params"]["a.bias"].tobytes() == other["params"]["a.bias"].tobytes()
    drop_checkpoints(store_path, lambda v: v < 2)
    assert complete_checkpoints(store_path) == [2]
    with pytest.raises(StoreError, match="policy version 1"):
        read_checkpoint(store_path, 1)
    bad = {"params": parts["params"], "exp_avg": {"a.bias": parts["exp_avg"]["a.bias"]}}
    with pytest.raises(StoreError, match=r"checkpoint\.exp_avg: expected the tensors"):
        write_checkpoint(store_path, 3, bad, step=3)
    # The run's groups still read back after checkpoints came and went.
    assert set(open_run(store_path)) == set(GROUPS)


def test_a_checkpoint_of_several_chunks_per_part_and_negative_zeros_reads_back_bit_for_bit(
        store_path, monkeypatch):
    """Each part's row spans several chunks, the last one partial, each written on its
    own; parts equal to the fill value (zeros, and -0.0) are stored as they are."""
    import digenrl.store.checkpoints as checkpoints
    monkeypatch.setattr(checkpoints, "_CHECKPOINT_CHUNK", 8)
    RunStore.create(store_path, {})
    rng = np.random.default_rng(2)
    shapes = {"a.weight": (3, 5), "a.bias": (5,), "scale": ()}   # 21 elements: 8 + 8 + 5
    parts = {"params": {n: rng.standard_normal(s).astype(np.float32) for n, s in shapes.items()},
             "exp_avg": {n: np.full(s, -0.0, np.float32) for n, s in shapes.items()},
             "exp_avg_sq": {n: np.zeros(s, np.float32) for n, s in shapes.items()}}
    write_checkpoint(store_path, 0, parts, step=0)
    back, _ = read_checkpoint(store_path, 0)
    for p in parts:
        for n, a in parts[p].items():
            assert back[p][n].shape == a.shape and back[p][n].tobytes() == a.tobytes(), (p, n)


def test_final_weights_round_trip_are_replaced_whole_and_read_in_the_old_layout(store_path):
    store = RunStore.create(store_path, {})
    assert read_weights(store_path) == (None, {})  # a run that has not finished
    rng = np.random.default_rng(1)
    tensors = {"b.weight": rng.standard_normal((4, 2)).astype(np.float32),
               "b.bias": rng.standard_normal(2).astype(np.float32)}
    write_weights(store.root, 3, tensors)
    store.commit()
    version, back = read_weights(store_path)
    assert version == 3 and list(back) == list(tensors)
    assert all(back[n].shape == a.shape and back[n].tobytes() == a.tobytes()
               for n, a in tensors.items())
    # One array, however many tensors: the store's commit stays cheap.
    assert list(zarr.open_group(str(store_path), mode="r")["weights"].array_keys()) == ["params"]
    # A resumed run's final weights replace the earlier ones, tensors and version.
    write_weights(store.root, 5, {"c": np.ones(3, np.float32)})
    assert read_weights(store_path)[0] == 5 and list(read_weights(store_path)[1]) == ["c"]
    # A store written with one array per tensor reads back as it was written.
    old = Path(store_path).with_name("old.zarr")
    grp = RunStore.create(old, {}).root.require_group("weights")
    for n, a in tensors.items():
        grp.create_array(n, shape=a.shape, dtype=a.dtype)[...] = a
    grp.attrs["policy_version"] = 2
    version, back = read_weights(old)
    assert version == 2 and {n: a.tobytes() for n, a in back.items()} == {
        n: a.tobytes() for n, a in tensors.items()}


def test_a_writer_stopped_in_its_first_append_leaves_nothing_behind(store_path):
    s = RunStore.create(store_path, {})
    # Iteration 0's first rows written, creating the variables, never committed.
    write_uncommitted(s, {"metrics": {"reward_mean": np.float64(0)},
                          "samples": {"reward": np.zeros(3)}})
    assert all(ds.sizes.get("iteration", 0) == 0 for ds in open_run(store_path).values())
    s2 = RunStore.open(store_path)
    assert s2.iterations_complete == 0 and "reward_mean" not in s2.root["metrics"]
    s2.append_iteration(rows(0))
    s2.append_iteration(rows(1))
    np.testing.assert_array_equal(open_run(store_path)["metrics"].reward_mean.values, [0, 1])


def test_attributes_change_in_place_in_the_committed_metadata(store_path):
    import json
    import warnings
    from pathlib import Path

    s = RunStore.create(store_path, {"config": {"seed": 1}})
    s.append_iteration(rows(0))
    write_uncommitted(s, {"samples": {"reward": rows(1)["samples"]["reward"]}})
    s.update_attrs(finished=1)
    root = json.loads((Path(store_path) / "zarr.json").read_text())
    assert root["consolidated_metadata"] is not None
    assert root["attributes"]["digenrl"]["finished"] == 1 and s.attrs["finished"] == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback to the uncommitted listing
        assert open_run(store_path)["samples"].reward.shape == (1, 3)
