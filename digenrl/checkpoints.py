"""The checkpoint format: the trainer state of each policy version in a run's store.

``checkpoints/v{N}`` holds the trainer state that policy version N was published with:
one uncompressed (bit-exact) array of shape (part, element) whose rows are the flattened
tensors of ``params``, ``exp_avg`` and ``exp_avg_sq`` (and ``sampling``, the sampling copy
of an algorithm that keeps one), chunked in runs of at most
``_CHECKPOINT_CHUNK`` elements. Its attributes give the layout (tensor names, shapes), the
``version``, the optimizer ``step`` and ``complete`` (set last). One array per version
keeps writes and the store's metadata commit cheap however many tensors the model has.
A trainer task writes it (:mod:`digenrl.tasks.checkpoint`); a ``restore`` task reads it
back, which the version is published from and the next optimizer step starts from (a
resumed run's too). The driver drops versions no pipeline stage can read or recompute any
more (:meth:`digenrl.graph.structure.GraphLayout.retains`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import numpy as np
import zarr

from digenrl.store import StoreError

__all__ = ["write_checkpoint", "read_checkpoint", "complete_checkpoints", "drop_checkpoints"]

_CHECKPOINT_CHUNK = 1 << 24


def _checkpoint_group(path: str, mode: str = "r"):
    root = zarr.open_group(str(path), mode=mode, use_consolidated=False)
    return root.require_group("checkpoints") if mode != "r" else root["checkpoints"]


def write_checkpoint(path: str | Path, version: int, parts: dict[str, dict[str, np.ndarray]],
                     step: int) -> None:
    """Write version ``version``'s state; ``complete`` is set last. A complete
    checkpoint of the version is kept as it is: a version's state is the same bits
    however often it is computed (a worker lost, a run resumed), and a restore task may
    be reading it. An incomplete one (its writer died) is replaced.

    Every part must hold the same tensor names and shapes, all of one dtype."""
    part_names = list(parts)
    if not part_names:
        raise StoreError("checkpoint: expected at least one part, got none")
    names = list(parts[part_names[0]])
    shapes = [tuple(np.shape(parts[part_names[0]][n])) for n in names]
    dtypes = {np.asarray(a).dtype for arrays in parts.values() for a in arrays.values()}
    if len(dtypes) != 1:
        raise StoreError(f"checkpoint: expected tensors of one dtype, got {sorted(map(str, dtypes))}")
    for part, arrays in parts.items():
        if list(arrays) != names or [tuple(np.shape(arrays[n])) for n in names] != shapes:
            raise StoreError(f"checkpoint.{part}: expected the tensors {names} with shapes "
                             f"{shapes}, got {[(n, tuple(np.shape(a))) for n, a in arrays.items()]}")
    total = int(sum(int(np.prod(s)) for s in shapes))
    flat = np.empty((len(part_names), total), dtype=dtypes.pop())
    for row, part in enumerate(part_names):
        offset = 0
        for n in names:
            a = np.asarray(parts[part][n]).reshape(-1)
            flat[row, offset:offset + a.size] = a
            offset += a.size
    grp = _checkpoint_group(str(path), "r+")
    name = f"v{version}"
    if name in grp:
        if grp[name].attrs.get("complete"):
            return
        del grp[name]
    z = grp.create_array(name, shape=flat.shape, dtype=flat.dtype, compressors=None,
                         chunks=(1, max(1, min(total, _CHECKPOINT_CHUNK))))
    z[...] = flat
    z.attrs.update({"parts": part_names, "names": names, "shapes": [list(s) for s in shapes],
                    "version": int(version), "step": int(step)})
    z.attrs["complete"] = True


def read_checkpoint(path: str | Path, version: int) -> tuple[dict[str, dict[str, np.ndarray]], int]:
    grp = _checkpoint_group(str(path))
    name = f"v{version}"
    if name not in grp or not grp[name].attrs.get("complete"):
        raise StoreError(f"checkpoint: expected a complete checkpoint of policy version "
                         f"{version} in {str(path)!r}, found {complete_checkpoints(path)}")
    z = grp[name]
    flat = z[...]
    attrs = z.attrs
    parts = {}
    for row, part in enumerate(attrs["parts"]):
        offset, arrays = 0, {}
        for n, shape in zip(attrs["names"], attrs["shapes"]):
            size = int(np.prod(shape))
            arrays[n] = flat[row, offset:offset + size].reshape(shape)
            offset += size
        parts[part] = arrays
    return parts, int(attrs["step"])


def complete_checkpoints(path: str | Path) -> list[int]:
    try:
        grp = _checkpoint_group(str(path))
    except KeyError:
        return []
    return sorted(int(a.attrs["version"]) for _, a in grp.arrays() if a.attrs.get("complete"))


def drop_checkpoints(path: str | Path, drop: Callable[[int], bool]) -> None:
    """Delete the complete checkpoints whose version ``drop(version)`` says to."""
    grp = _checkpoint_group(str(path), "r+")
    for name, a in list(grp.arrays()):
        if a.attrs.get("complete") and drop(int(a.attrs["version"])):
            del grp[name]
