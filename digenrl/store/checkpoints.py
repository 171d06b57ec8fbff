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
more (:meth:`digenrl.graph.retention.Retention.retains`).

``weights/params``, the run's final trainable weights, has the same layout with one part
(``params``); the ``weights`` group's ``policy_version`` attribute, set last, says which
version they are. (Stores written before this layout kept one array per tensor in the
``weights`` group; :func:`read_weights` reads those too.)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Literal, Mapping

import numpy as np
import zarr

from digenrl.store import StoreError, subgroup, write_all

__all__ = ["write_checkpoint", "read_checkpoint", "complete_checkpoints", "drop_checkpoints",
           "checkpoint_group",
           "write_weights", "read_weights"]

_CHECKPOINT_CHUNK = 1 << 24


def checkpoint_group(path: str, mode: Literal["r", "r+"] = "r") -> zarr.Group:
    root = zarr.open_group(str(path), mode=mode, use_consolidated=False)
    return root.require_group("checkpoints") if mode != "r" else subgroup(root, "checkpoints")


def _flatten(parts: dict[str, dict[str, np.ndarray]]) -> tuple[np.ndarray, dict]:
    """``parts`` as one (part, element) array and the attributes that give its layout.
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
    return flat, {"parts": part_names, "names": names, "shapes": [list(s) for s in shapes]}


def _write_flat(grp: zarr.Group, name: str, flat: np.ndarray, attrs: dict) -> zarr.Array:
    """``flat`` as the new array ``grp/name``, uncompressed, with ``attrs`` (written with
    its metadata: one write, where setting them afterwards writes it once per key).

    Each chunk is its own write, all awaited together, and every chunk is stored: zarr
    then writes each chunk's bytes as they lie in ``flat``. (Handed a selection larger
    than a chunk it first copies each chunk into a new buffer, and by default it compares
    every chunk with the fill value to leave out empty ones: together most of a
    checkpoint's CPU beside the file writes.)"""
    step = max(1, min(flat.shape[1], _CHECKPOINT_CHUNK))
    z = grp.create_array(name, shape=flat.shape, dtype=flat.dtype, compressors=None,
                         chunks=(1, step), attributes=attrs, overwrite=True,
                         config={"write_empty_chunks": True})
    write_all([z.async_array.setitem((slice(row, row + 1), slice(start, start + step)),
                                     flat[row:row + 1, start:start + step])
               for row in range(flat.shape[0]) for start in range(0, flat.shape[1], step)])
    return z


def _unflatten(z: zarr.Array) -> dict[str, dict[str, np.ndarray]]:
    """The parts :func:`_flatten` made the array ``z`` of."""
    flat = np.asarray(z[...])
    attrs: Mapping[str, Any] = z.attrs
    parts = {}
    for row, part in enumerate(attrs["parts"]):
        offset, arrays = 0, {}
        for n, shape in zip(attrs["names"], attrs["shapes"]):
            size = int(np.prod(shape))
            arrays[n] = flat[row, offset:offset + size].reshape(shape)
            offset += size
        parts[part] = arrays
    return parts


def write_checkpoint(path: str | Path, version: int, parts: dict[str, dict[str, np.ndarray]],
                     step: int) -> None:
    """Write version ``version``'s state; ``complete`` is set last. A complete
    checkpoint of the version is kept as it is: a version's state is the same bits
    however often it is computed (a worker lost, a run resumed), and a restore task may
    be reading it. An incomplete one (its writer died) is replaced.

    Every part must hold the same tensor names and shapes, all of one dtype."""
    flat, layout = _flatten(parts)
    grp = checkpoint_group(str(path), "r+")
    name = f"v{version}"
    if name in grp and grp[name].attrs.get("complete"):
        return
    z = _write_flat(grp, name, flat, {**layout, "version": int(version), "step": int(step)})
    z.attrs["complete"] = True


def _version(z: zarr.Array) -> int:
    """The policy version whose state the checkpoint array ``z`` holds."""
    attrs: Mapping[str, Any] = z.attrs
    return int(attrs["version"])


def read_checkpoint(path: str | Path, version: int) -> tuple[dict[str, dict[str, np.ndarray]], int]:
    grp = checkpoint_group(str(path))
    z = grp.get(f"v{version}")
    if not isinstance(z, zarr.Array) or not z.attrs.get("complete"):
        raise StoreError(f"checkpoint: expected a complete checkpoint of policy version "
                         f"{version} in {str(path)!r}, found {complete_checkpoints(path)}")
    attrs: Mapping[str, Any] = z.attrs
    return _unflatten(z), int(attrs["step"])


def write_weights(root: zarr.Group, version: int, tensors: dict[str, np.ndarray]) -> None:
    """Store ``tensors`` as the run's final weights, policy version ``version``,
    replacing any the store holds (a resumed run that extends a finished one, or
    finishes one that stopped while writing them); ``policy_version`` is set last. The
    caller commits the store."""
    grp = root.require_group("weights")
    grp.attrs.pop("policy_version", None)
    for name in list(grp.array_keys()):  # weights of an earlier run in either layout
        if name != "params":
            del grp[name]
    flat, layout = _flatten({"params": tensors})
    _write_flat(grp, "params", flat, layout)
    grp.attrs["policy_version"] = int(version)


def read_weights(path: str | Path) -> tuple[int | None, dict[str, np.ndarray]]:
    """The run's final weights and their policy version; (None, {}) when the run has
    not stored them (it has not finished)."""
    root = zarr.open_group(str(path), mode="r", use_consolidated=False)
    if "weights" not in root or root["weights"].attrs.get("policy_version") is None:
        return None, {}
    grp = subgroup(root, "weights")
    attrs: Mapping[str, Any] = grp.attrs
    version = int(attrs["policy_version"])
    z = grp.get("params")
    if isinstance(z, zarr.Array) and "names" in z.attrs:
        return version, _unflatten(z)["params"]
    return version, {name: np.asarray(arr[...])  # one array per tensor
                     for name, arr in grp.arrays()}


def complete_checkpoints(path: str | Path) -> list[int]:
    try:
        grp = checkpoint_group(str(path))
    except KeyError:
        return []
    return sorted(_version(a) for _, a in grp.arrays() if a.attrs.get("complete"))


def drop_checkpoints(path: str | Path, drop: Callable[[int], bool]) -> None:
    """Delete the complete checkpoints whose version ``drop(version)`` says to."""
    grp = checkpoint_group(str(path), "r+")
    for name, a in list(grp.arrays()):
        if a.attrs.get("complete") and drop(_version(a)):
            del grp[name]
