"""Sharded checkpoints (``torch.distributed.checkpoint``): version 1's state saved by 2
gloo ranks after one optimizer step, loaded by 2 ranks (the next step the same bits as
the uninterrupted run) and by 1 rank (resharded: the same state, the next step within
float tolerance); a half-written one neither listed nor loaded; and ``digenrl export`` of
one as a diffusers ``transformer/`` folder."""

from __future__ import annotations

import shutil

import pytest
import torch

from digenrl.commands.export import export, stored_versions
from digenrl.models import family
from digenrl.models.base import diffusers_class
from digenrl.store import StoreError
from digenrl.store.sharded import (PARTS, drop_sharded, load_sharded, read_sharded, sharded_checkpoints,
                                   sharded_folder, state_key)

import sharded_ranks as sr
from test_sharding import TIMEOUT_S, relative


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """(the store, what rank 0 gathered at 2 ranks, what it gathered alone): from the
    ranks launched once for this file and tests/test_sharding.py."""
    launch = sr.shared_launch(tmp_path_factory, TIMEOUT_S)
    got = launch.result()
    return launch.store, got["two"], got["one"]


def test_a_sharded_checkpoint_is_recorded_in_the_store(runs):
    store, two, _ = runs
    assert sharded_checkpoints(store) == {1: {"ranks": 2, "step": 1}}
    assert (sharded_folder(store, 1) / ".metadata").is_file()
    parts, step = read_sharded(store, 1)
    assert step == 1 and set(parts) == set(PARTS)
    for part, tensors in parts.items():
        for n, t in tensors.items():
            assert torch.equal(t, two["saved"][state_key(part, n)])
    assert sum(float(t.abs().sum()) for t in parts["exp_avg"].values()) > 0


def test_loaded_at_the_same_ranks_the_next_step_is_the_same_bits(runs):
    _, two, _ = runs
    assert (two["version"], two["step"], two["resumed_version"]) == (1, 1, 2)
    assert all(torch.equal(two["loaded"][k], t) for k, t in two["saved"].items())
    want = two["uninterrupted"]
    assert set(two["resumed"]) == set(want)
    assert all(torch.equal(two["resumed"][n], want[n]) for n in want)
    assert any(not torch.equal(want[n], two["saved"][state_key("params", n)]) for n in want)


def test_loaded_at_other_ranks_the_state_is_resharded(runs):
    """One rank reads the two ranks' shards: the same state bit for bit, and its next
    step (every chunk on one rank: other reduction order) within float tolerance."""
    _, two, one = runs
    assert (one["version"], one["step"], one["resumed_version"]) == (1, 1, 2)
    assert set(one["loaded"]) == set(two["saved"])
    assert all(torch.equal(one["loaded"][k], t) for k, t in two["saved"].items())
    assert relative(one["resumed"], two["uninterrupted"]) < 1e-5


def test_a_half_written_checkpoint_is_neither_listed_nor_loaded(runs, tmp_path):
    """A save that died before its rename (the temporary folder) or before its record
    (the final name, unrecorded): DCP's files are all there, and still neither counts."""
    store, _, _ = runs
    copy = tmp_path / "run.zarr"
    shutil.copytree(store, copy)
    shutil.copytree(sharded_folder(copy, 1), sharded_folder(copy, 2).with_name(".v2.partial"))
    shutil.copytree(sharded_folder(copy, 1), sharded_folder(copy, 3))
    assert list(sharded_checkpoints(copy)) == [1]
    assert stored_versions(str(copy)) == [1]
    for version in (2, 3):
        with pytest.raises(StoreError) as e:
            load_sharded(copy, version, {})
        assert str(e.value) == (f"sharded checkpoint: expected a complete sharded checkpoint "
                                f"of policy version {version} in {str(copy)!r}, found [1]")
        with pytest.raises(StoreError):
            read_sharded(copy, version)
    drop_sharded(copy, lambda v: v == 1)
    assert sharded_checkpoints(copy) == {} and not sharded_folder(copy, 1).exists()


def test_export_writes_the_sharded_checkpoint_as_a_diffusers_folder(runs, tmp_path):
    store, two, _ = runs
    done = export(str(store), tmp_path / "out")
    assert (done.version, done.lora) == (1, False)
    cls = diffusers_class(family(sr.config("flow_grpo", 3).model).transformer_class_name)
    module = cls.from_pretrained(tmp_path / "out", subfolder="transformer")
    state = module.state_dict()
    params = {k.partition("/")[2]: t for k, t in two["saved"].items() if k.startswith("params/")}
    assert params and all(torch.equal(state[n], t) for n, t in params.items())
