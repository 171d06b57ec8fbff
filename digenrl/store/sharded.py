"""Sharded checkpoints: a policy version's trainer state as the ranks of a sharded gang
hold it, written and read with ``torch.distributed.checkpoint`` (DCP).

``sharded/v{N}/`` in the run's store is DCP's folder for version N: each rank writes the
shards it holds (``__{rank}_0.distcp``) and the coordinator writes ``.metadata``, which maps
every tensor's chunks to the files. The state is a flat dict of tensors: ``{part}/{name}``
for each trainable parameter and AdamW moment (parts ``params``, ``exp_avg``,
``exp_avg_sq``: the zarr checkpoint's parts, :mod:`digenrl.store.checkpoints`), each a
``DTensor`` sharded over the gang, and ``step`` and ``version`` (0-d tensors). Loading onto
another number of ranks reads, for each rank's shard, the chunks that overlap it (DCP
reshards), and a single process can read the full tensors (:func:`read_sharded`).

Complete versions are recorded in the ``checkpoints`` group's ``sharded`` attribute (its
version, the ranks that wrote it and the optimizer step), beside the zarr checkpoints: the
ranks write into ``sharded/.v{N}.partial``, and only after every rank has finished does
rank 0 rename that folder to ``sharded/v{N}`` and record it. A save that dies anywhere
before leaves a folder that is not recorded, which nothing lists or loads and the next
save of the version replaces.
"""

from __future__ import annotations

import shutil
import warnings
from pathlib import Path
from typing import Any, Callable, Mapping

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import zarr

from digenrl.store import SHARDED_FOLDER, StoreError
from digenrl.store.checkpoints import checkpoint_group

__all__ = ["SHARDED_FOLDER", "PARTS", "sharded_folder", "sharded_checkpoints",
           "save_sharded", "load_sharded", "read_sharded", "drop_sharded", "state_key"]

#: The parts of every sharded checkpoint's state, as the zarr checkpoint names them (an
#: algorithm with a sampling copy adds the copy's part, named as there too).
PARTS = ("params", "exp_avg", "exp_avg_sq")
#: The ``checkpoints`` group attribute recording the complete sharded checkpoints.
_RECORD = "sharded"


def state_key(part: str, name: str) -> str:
    """The key of tensor ``name`` of ``part`` in a sharded checkpoint's state."""
    return f"{part}/{name}"


def sharded_folder(path: str | Path, version: int) -> Path:
    """Version ``version``'s sharded checkpoint folder in the store at ``path``."""
    return Path(path) / SHARDED_FOLDER / f"v{version}"


def _partial_folder(path: str | Path, version: int) -> Path:
    return Path(path) / SHARDED_FOLDER / f".v{version}.partial"


def _records(path: str | Path) -> dict[str, Any]:
    try:
        grp = checkpoint_group(str(path))
    except KeyError:
        return {}
    attrs: Mapping[str, Any] = grp.attrs
    return dict(attrs.get(_RECORD, {}))


def sharded_checkpoints(path: str | Path) -> dict[int, dict[str, int]]:
    """The complete sharded checkpoints in the store: version -> ``{"ranks", "step"}``
    (recorded, and their folder present)."""
    return {int(v): dict(r) for v, r in sorted(_records(path).items(), key=lambda x: int(x[0]))
            if sharded_folder(path, int(v)).is_dir()}


def _complete(path: str | Path, version: int) -> Path:
    """The folder of ``version``'s complete sharded checkpoint; one line naming what the
    store holds where it has none."""
    if version not in sharded_checkpoints(path):
        raise StoreError(f"sharded checkpoint: expected a complete sharded checkpoint of "
                         f"policy version {version} in {str(path)!r}, found "
                         f"{sorted(sharded_checkpoints(path))}")
    return sharded_folder(path, version)


def _barrier(group) -> None:
    dist.barrier(group=group)


def save_sharded(path: str | Path, version: int, state: dict[str, torch.Tensor], step: int,
                 group=None) -> None:
    """Every rank of ``group`` writes its shards of ``state`` (:func:`state_key` keys,
    DTensors over the group) as version ``version``'s sharded checkpoint (optimizer step
    ``step``) in the store at ``path``; rank 0 renames the folder and records it once
    every rank has written. A complete checkpoint of the version is kept as it is (the
    same bits however often the version is computed)."""
    if version in sharded_checkpoints(path):
        return
    rank, ranks = dist.get_rank(group), dist.get_world_size(group)
    partial, final = _partial_folder(path, version), sharded_folder(path, version)
    if rank == 0:
        shutil.rmtree(partial, ignore_errors=True)  # a save that died
        partial.mkdir(parents=True)
    _barrier(group)
    state = {**state, "step": torch.tensor(int(step)), "version": torch.tensor(int(version))}
    dcp.save(state, checkpoint_id=partial, process_group=group)
    _barrier(group)
    if rank == 0:
        shutil.rmtree(final, ignore_errors=True)  # renamed, but its save died unrecorded
        partial.rename(final)
        grp = checkpoint_group(str(path), "r+")
        grp.attrs[_RECORD] = {**_records(path),
                              str(int(version)): {"ranks": ranks, "step": int(step)}}
    _barrier(group)


def load_sharded(path: str | Path, version: int, state: dict[str, torch.Tensor],
                 group=None) -> int:
    """Read version ``version``'s sharded checkpoint into ``state`` in place (its tensors
    as this rank holds them: DTensors over ``group``, any number of ranks); returns the
    optimizer step. Refused in one line unless the checkpoint is complete."""
    folder = _complete(path, version)
    counters = {"step": torch.tensor(0), "version": torch.tensor(0)}
    full = {**state, **counters}
    dcp.load(full, checkpoint_id=folder, process_group=group)
    if int(full["version"]) != version:
        raise StoreError(f"sharded checkpoint: expected policy version {version} in "
                         f"{str(folder)!r}, got {int(full['version'])}")
    return int(full["step"])


def read_sharded(path: str | Path, version: int) -> tuple[dict[str, dict[str, torch.Tensor]], int]:
    """Version ``version``'s full state in this process (no process group): part -> name
    -> tensor, and the optimizer step."""
    folder = _complete(path, version)
    metadata = dcp.FileSystemReader(str(folder)).read_metadata()
    state = {k: torch.empty(tuple(m.size), dtype=m.properties.dtype)
             for k, m in metadata.state_dict_metadata.items()
             if isinstance(m, dcp.metadata.TensorStorageMetadata)}
    with warnings.catch_warnings():  # that it reads in one process: what it is asked
        warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single")
        dcp.load(state, checkpoint_id=folder, no_dist=True)
    parts: dict[str, dict[str, torch.Tensor]] = {p: {} for p in PARTS}
    for key, tensor in state.items():
        part, _, name = key.partition("/")
        if name:    # (an algorithm's sampling copy is a part of its own)
            parts.setdefault(part, {})[name] = tensor
    return parts, int(state["step"])


def drop_sharded(path: str | Path, drop: Callable[[int], bool]) -> None:
    """Delete the complete sharded checkpoints whose version ``drop(version)`` says to
    (the record first, then the folder)."""
    records = _records(path)
    gone = [v for v in records if drop(int(v))]
    if not gone:
        return
    grp: zarr.Group = checkpoint_group(str(path), "r+")
    grp.attrs[_RECORD] = {v: r for v, r in records.items() if v not in gone}
    for v in gone:
        shutil.rmtree(sharded_folder(path, int(v)), ignore_errors=True)
