"""The output store: one Zarr (v3) store per run, readable with ``xarray.open_zarr``.

Groups (DESIGN.md section 6): ``samples`` (iteration, sample), ``steps`` (iteration,
sample, step), ``metrics`` (iteration) and ``tasks`` (task). The run appends one iteration
at a time. Each append first writes the new rows (beyond the arrays' committed shapes)
and then commits by rewriting the consolidated metadata at the root -- a single atomic
file replacement. Readers that use the consolidated metadata (xarray and zarr do by
default) therefore only ever see complete iterations, whenever the writer stops.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any, Mapping

import numpy as np
import xarray as xr
import zarr

__all__ = ["RunStore", "open_run", "GROUPS", "StoreError"]

GROUPS = ("samples", "steps", "metrics", "tasks")
FORMAT_VERSION = 1

_DIMS = {
    "samples": ("iteration", "sample"),
    "steps": ("iteration", "sample", "step"),
    "metrics": ("iteration",),
    "tasks": ("task",),
}
# Extra trailing dimensions of some variables.
_EXTRA_DIMS = {
    ("samples", "image"): ("y", "x", "rgb"),
    ("steps", "latent"): ("channel", "latent_y", "latent_x"),
}
_TASK_CHUNK = 4096


class StoreError(ValueError):
    pass


def _quiet_consolidate(path: str) -> None:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*[Cc]onsolidated metadata.*")
        zarr.consolidate_metadata(path)


class RunStore:
    """Append-only writer of one run's store."""

    def __init__(self, path: str | Path, root: zarr.Group):
        self.path = str(path)
        self.root = root

    # ------------------------------------------------------------------ create/open

    @classmethod
    def create(cls, path: str | Path, attrs: Mapping[str, Any], *,
               overwrite: bool = False) -> "RunStore":
        p = Path(path)
        if p.exists() and not overwrite:
            raise StoreError(f"out: expected a path that does not exist yet (or --overwrite, "
                             f"or --resume to continue it), got {str(path)!r}")
        root = zarr.open_group(str(p), mode="w", zarr_format=3)
        root.attrs["digenrl"] = json.loads(json.dumps(
            {"format_version": FORMAT_VERSION, **attrs}, default=str))
        for g in GROUPS:
            root.create_group(g)
        _quiet_consolidate(str(p))
        return cls(p, zarr.open_group(str(p), mode="r+", zarr_format=3,
                                      use_consolidated=False))

    @classmethod
    def open(cls, path: str | Path) -> "RunStore":
        """Open an existing store for appending; anything beyond the last commit is cut."""
        p = Path(path)
        if not (p / "zarr.json").is_file():
            raise StoreError(f"store: expected an existing digenrl store, got {str(path)!r}")
        committed = zarr.open_group(str(p), mode="r")
        if "digenrl" not in committed.attrs:
            raise StoreError(f"store: {str(path)!r} is a Zarr store but not a digenrl run")
        shapes = {}
        for g in GROUPS:
            grp = committed[g]
            for name, arr in grp.arrays():
                shapes[(g, name)] = arr.shape
        root = zarr.open_group(str(p), mode="r+", zarr_format=3, use_consolidated=False)
        store = cls(p, root)
        for (g, name), shape in shapes.items():
            arr = root[g][name]
            if arr.shape != shape:
                arr.resize(shape)
        return store

    # ------------------------------------------------------------------ metadata

    @property
    def attrs(self) -> dict[str, Any]:
        return dict(self.root.attrs["digenrl"])

    def update_attrs(self, **values: Any) -> None:
        current = self.attrs
        current.update(json.loads(json.dumps(values, default=str)))
        self.root.attrs["digenrl"] = current

    @property
    def iterations_complete(self) -> int:
        return _length(self.root["metrics"], "iteration")

    @property
    def tasks_complete(self) -> int:
        return _length(self.root["tasks"], "task")

    # ------------------------------------------------------------------ writing

    def set_static(self, group: str, name: str, values: np.ndarray, dims: tuple[str, ...]) -> None:
        """A variable written once (e.g. the sigma of each step)."""
        grp = self.root[group]
        if name in grp:
            return
        arr = grp.create_array(name, shape=values.shape, dtype=values.dtype,
                               dimension_names=dims)
        arr[...] = values

    def _append(self, group: str, name: str, values: np.ndarray) -> None:
        grp = self.root[group]
        dims = _DIMS[group]
        extra = _EXTRA_DIMS.get((group, name), ())
        values = np.asarray(values)
        if values.dtype.kind in ("U", "O", "T"):
            values = values.astype(str)
            dtype: Any = str
        else:
            dtype = values.dtype
        lead = 1 if group != "tasks" else len(values)
        if group != "tasks":
            values = values[None]
        ndim_expected = len(dims) + len(extra)
        if values.ndim != ndim_expected:
            raise StoreError(f"{group}.{name}: expected {ndim_expected} dimensions "
                             f"{dims + extra}, got shape {values.shape}")
        if name not in grp:
            chunks = (1 if group != "tasks" else _TASK_CHUNK,) + tuple(max(1, s) for s in values.shape[1:])
            fill = np.nan if values.dtype.kind == "f" else None
            grp.create_array(name, shape=(0,) + values.shape[1:], chunks=chunks, dtype=dtype,
                             dimension_names=dims + extra, fill_value=fill)
        arr = grp[name]
        if arr.shape[1:] != values.shape[1:]:
            raise StoreError(f"{group}.{name}: expected rows of shape {arr.shape[1:]}, "
                             f"got {values.shape[1:]}")
        n = arr.shape[0]
        if lead == 0:
            return
        arr.resize((n + lead,) + arr.shape[1:])
        arr[n:n + lead] = values

    def append_iteration(self, groups: Mapping[str, Mapping[str, np.ndarray]]) -> None:
        """Write one iteration's rows of every group, then commit them atomically."""
        expected = self.iterations_complete
        for group in ("samples", "steps", "metrics"):
            for name, arr in self.root[group].arrays():
                if _first_dim(arr) == "iteration" and arr.shape[0] != expected:
                    raise StoreError(f"{group}.{name}: has {arr.shape[0]} iterations, "
                                     f"expected {expected}")
        for group, variables in groups.items():
            if group not in _DIMS:
                raise StoreError(f"group: expected one of {list(_DIMS)}, got {group!r}")
            for name, values in variables.items():
                self._append(group, name, values)
        self.commit()

    def commit(self) -> None:
        _quiet_consolidate(self.path)


def _first_dim(arr: zarr.Array) -> str | None:
    names = arr.metadata.dimension_names
    return names[0] if names else None


def _length(group: zarr.Group, dim: str) -> int:
    for _, arr in group.arrays():
        if _first_dim(arr) == dim:
            return arr.shape[0]
    return 0


def open_run(path: str | Path) -> dict[str, xr.Dataset]:
    """Every group of a store as an xarray Dataset (committed iterations only)."""
    p = str(path)
    if not (Path(p) / "zarr.json").is_file():
        raise StoreError(f"store: expected an existing digenrl store, got {p!r}")
    out = {}
    for g in GROUPS:
        out[g] = xr.open_zarr(p, group=g, chunks=None)
    attrs = zarr.open_group(p, mode="r").attrs.get("digenrl")
    if attrs is None:
        raise StoreError(f"store: {p!r} is a Zarr store but not a digenrl run")
    for ds in out.values():
        ds.attrs["digenrl"] = attrs
    return out
