"""The output store: one Zarr (v3) store per run, readable with ``xarray.open_zarr``.

Groups (README.md, "Output store"): ``samples`` (iteration, sample), ``steps`` (iteration,
sample, step), ``metrics`` (iteration), ``tasks`` (task) and ``eval`` (entry: one per
evaluated policy version and held-out prompt). The run appends one iteration
at a time. Each append first writes the new rows (beyond the arrays' committed shapes)
and then commits by rewriting the consolidated metadata at the root -- a single atomic
file replacement. Readers that use the consolidated metadata (xarray and zarr do by
default) therefore only ever see complete iterations, whenever the writer stops; run
attributes are changed in that same file, in place, so readers never lose that view.
Reopening a store to append (a resumed run) first cuts whatever the last commit did not
hold. The trainer checkpoints a run keeps in the same store are :mod:`digenrl.store.checkpoints`'s.
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Coroutine, Mapping, Sequence

import numpy as np
import xarray as xr
import zarr
import zarr.api.asynchronous
from zarr.core.sync import sync as zarr_sync

__all__ = ["RunStore", "StoreWriter", "open_run", "read_attrs", "committed_iterations",
           "write_all", "GROUPS", "EVAL_GROUP", "REWARD_COLUMN", "ADVANTAGE_COLUMN",
           "SOURCES_ATTRIBUTE", "StoreError", "frame_strip", "STRIP_FRAMES",
           "evaluation_means", "evaluation_reward_means", "reward_column", "reward_columns",
           "subgroup", "SAMPLING_PART"]

# Names of the store that are also the words of task kinds, named here once.
#: The held-out evaluations: a row per evaluated policy version and held-out prompt.
EVAL_GROUP = "eval"
#: A sample's (``samples``) or an evaluated prompt's (``eval``) weighted reward.
REWARD_COLUMN = "reward"


def reward_column(name: str) -> str:
    """The column of reward ``name``'s own score (``samples`` and ``eval``), beside the
    weighted sum in :data:`REWARD_COLUMN`."""
    return f"{REWARD_COLUMN}_{name}"


def reward_columns(columns) -> dict[str, str]:
    """Reward name -> its column, of the per-reward columns among ``columns``."""
    prefix = reward_column("")
    return {c[len(prefix):]: c for c in columns if c.startswith(prefix)}


#: A sample's advantage (``samples``).
ADVANTAGE_COLUMN = "advantage"
#: The run attribute listing the source images of an editing run (each one's path and
#: SHA-256, once); a sample's or evaluated prompt's ``source`` is its position there.
SOURCES_ATTRIBUTE = "source_images"

GROUPS = ("samples", "steps", "metrics", "tasks", EVAL_GROUP)
FORMAT_VERSION = 1

_DIMS = {
    "samples": ("iteration", "sample"),
    "steps": ("iteration", "sample", "step"),
    "metrics": ("iteration",),
    "tasks": ("task",),
    EVAL_GROUP: ("entry",),
}
#: The groups whose rows are not iterations: each iteration appends any number of rows,
#: chunked this many at a time.
_ROW_CHUNKS = {"tasks": 4096, EVAL_GROUP: 16}
# Extra trailing dimensions of some variables.
_EXTRA_DIMS = {
    ("samples", "image"): ("y", "x", "rgb"),
    ("samples", "video"): ("frame", "y", "x", "rgb"),
    ("steps", "latent"): ("channel", "latent_y", "latent_x"),
    (EVAL_GROUP, "image"): ("y", "x", "rgb"),
}


#: The frames of an evaluated video the store keeps, side by side.
STRIP_FRAMES = 4


def frame_strip(images: np.ndarray, frames: int = STRIP_FRAMES) -> np.ndarray:
    """Images as they are; videos ``(n, F, H, W, 3)`` as a strip of ``frames`` evenly
    spaced frames side by side, ``(n, H, frames x W, 3)`` (first and last included):
    what an evaluation keeps of a video."""
    if images.ndim == 4:
        return images
    picks = np.unique(np.linspace(0, images.shape[1] - 1, min(frames, images.shape[1]))
                      .round().astype(int))
    return np.concatenate([images[:, f] for f in picks], axis=2)


class StoreError(ValueError):
    pass


def write_all(writes: Sequence[Coroutine[Any, Any, None]]) -> None:
    """Await ``writes`` (zarr's asynchronous writes) together on zarr's event loop (its
    synchronous API's loop); once all have ended, raise the first one's error, if any.
    (An error in a commit's writes leaves rows beyond the last commit, which readers
    never see and reopening cuts; in a checkpoint's, a checkpoint never marked
    complete.)"""
    async def together() -> list:
        return await asyncio.gather(*writes, return_exceptions=True)

    for outcome in zarr_sync(together()):
        if isinstance(outcome, BaseException):
            raise outcome


#: The folder of a run's sharded checkpoints in its store (``digenrl.store.sharded``):
#: files of ``torch.distributed.checkpoint``, beside the Zarr groups.
SHARDED_FOLDER = "sharded"
#: The part of a checkpoint (Zarr or sharded) holding an algorithm's sampling copy.
SAMPLING_PART = "sampling"


def _quiet_consolidate(path: str) -> None:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*[Cc]onsolidated metadata.*")
        # (What the sharded checkpoints' folder is: not Zarr's, and not to be listed.)
        warnings.filterwarnings("ignore", message=f"Object at {SHARDED_FOLDER} is not "
                                "recognized as a component of a Zarr hierarchy")
        zarr.consolidate_metadata(path)


class RunStore:
    """Append-only writer of one run's store."""

    def __init__(self, path: str | Path, root: zarr.Group):
        self.path = str(path)
        self.root = root
        #: Every array of the groups, by (group, name), read once: this writer is the
        #: store's only one, so an array's metadata stays true (its resizes are its own).
        self._arrays: dict[tuple[str, str], zarr.Array] = {
            (g, name): arr for g in GROUPS if g in root for name, arr in subgroup(root, g).arrays()}

    # ------------------------------------------------------------------ create/open

    @classmethod
    def create(cls, path: str | Path, attrs: Mapping[str, Any], *,
               overwrite: bool = False) -> "RunStore":
        p = Path(path)
        if p.exists() and not overwrite:
            raise StoreError(f"out: expected a path that does not exist yet (or --overwrite, "
                             f"or --resume to continue it), got {str(path)!r}")
        root = zarr.open_group(str(p), mode="w", zarr_format=3)
        # The groups first, committed; the attributes that make it a digenrl store last:
        # a reader (or a resume) never finds a digenrl store without its groups.
        for g in GROUPS:
            root.create_group(g)
        _quiet_consolidate(str(p))
        _write_run_attrs(p, json.loads(json.dumps(
            {"format_version": FORMAT_VERSION, **attrs}, default=str)))
        return cls(p, zarr.open_group(str(p), mode="r+", zarr_format=3,
                                      use_consolidated=False))

    @classmethod
    def open(cls, path: str | Path) -> "RunStore":
        """Open an existing store for appending; anything beyond the last commit is cut:
        rows past the committed shapes, and variables the last commit did not hold yet
        (a writer stopped while appending the first rows of one)."""
        p = Path(path)
        committed = _open_committed(p)
        shapes = {}
        for g in GROUPS:
            if g not in committed:
                continue  # a group new to this version (created below)
            grp = subgroup(committed, g)
            for name, arr in grp.arrays():
                shapes[(g, name)] = arr.shape
        root = zarr.open_group(str(p), mode="r+", zarr_format=3, use_consolidated=False)
        for g in GROUPS:
            grp = root.require_group(g)
            for name, arr in list(grp.arrays()):
                shape = shapes.get((g, name))
                if shape is None:
                    del grp[name]
                elif arr.shape != shape:
                    arr.resize(shape)
        return cls(p, root)

    # ------------------------------------------------------------------ metadata

    @property
    def attrs(self) -> dict[str, Any]:
        return _run_attrs(self.root)

    def update_attrs(self, **values: Any) -> None:
        """Set run attributes, in place in the committed root metadata (one atomic
        write): the committed iterations readers see are unchanged, and they never
        fall back to the uncommitted listing."""
        current = self.attrs
        current.update(json.loads(json.dumps(values, default=str)))
        _write_run_attrs(Path(self.path), current)
        self.root = zarr.open_group(self.path, mode="r+", zarr_format=3,
                                    use_consolidated=False)

    @property
    def iterations_complete(self) -> int:
        return self._length("metrics")

    @property
    def tasks_complete(self) -> int:
        return self._length("tasks")

    # ------------------------------------------------------------------ writing

    def set_static(self, group: str, name: str, values: np.ndarray, dims: tuple[str, ...]) -> None:
        """A variable written once (e.g. the sigma of each step)."""
        grp = subgroup(self.root, group)
        if name in grp:
            return
        arr = grp.create_array(name, shape=values.shape, dtype=values.dtype,
                               dimension_names=dims)
        arr[...] = values
        self._arrays[group, name] = arr

    def _array(self, group: str, name: str) -> zarr.Array | None:
        """The array ``group.name`` (None while there is none)."""
        return self._arrays.get((group, name))

    def _write(self, group: str, name: str, block: np.ndarray,
               rows: int = 0) -> Coroutine[Any, Any, None]:
        """The write (to await) that appends ``block``, whose first dimension is the
        group's (iterations, tasks or entries), to ``group.name``, making the array when
        it is new (its first ``rows`` rows then hold the fill value). The block is
        checked here, before anything is written."""
        dims = _DIMS[group]
        extra = _EXTRA_DIMS.get((group, name), ())
        if block.dtype.kind in ("U", "O", "T"):
            block = block.astype(str)
            dtype: Any = str
        else:
            dtype = block.dtype
        ndim_expected = len(dims) + len(extra)
        if block.ndim != ndim_expected:
            raise StoreError(f"{group}.{name}: expected {ndim_expected} dimensions "
                             f"{dims + extra}, got shape {block.shape}")
        arr = self._array(group, name)
        if arr is not None and arr.shape[1:] != block.shape[1:]:
            raise StoreError(f"{group}.{name}: expected rows of shape {arr.shape[1:]}, "
                             f"got {block.shape[1:]}")
        return self._write_rows(group, name, arr, block, dtype, dims + extra, rows)

    async def _write_rows(self, group: str, name: str, arr: zarr.Array | None,
                          block: np.ndarray, dtype: Any, dimension_names: tuple[str, ...],
                          rows: int) -> None:
        lead = block.shape[0]
        if arr is None:
            chunks = (_ROW_CHUNKS.get(group, 1),) + tuple(max(1, s) for s in block.shape[1:])
            # A column new to this version, appended to an older run's store (or an
            # evaluation's column first written after some were stored): its earlier
            # rows hold the fill value (NaN), so every column keeps one length. Made at
            # its new length at once (one metadata write, not two); overwrite: nothing
            # uncommitted is kept (RunStore.open cut it), so no check that it is new.
            new = await zarr.api.asynchronous.create_array(
                self.root.store, name=f"{group}/{name}", shape=(rows + lead,) + block.shape[1:],
                chunks=chunks, dtype=dtype, dimension_names=dimension_names,
                fill_value=_fill_value(block), overwrite=True)
            self._arrays[group, name] = zarr.Array(new)
            n = rows
        else:
            new = arr.async_array
            n = arr.shape[0]
            if lead:
                await new.resize((n + lead,) + arr.shape[1:])
        if lead:
            await new.setitem(slice(n, n + lead), block)

    def append_iteration(self, groups: Mapping[str, Mapping[str, np.ndarray]]) -> None:
        """Write one iteration's rows of every group, then commit them atomically."""
        self.append_iterations([groups])

    def append_iterations(self, batch: Sequence[Mapping[str, Mapping[str, np.ndarray]]]
                          ) -> None:
        """Write the rows of consecutive iterations (each as :meth:`append_iteration`
        takes one), then commit them atomically: each array is written once for all of
        them. A row group's column one iteration lacks holds the fill value in that
        iteration's rows; an iteration group's variable must be in every iteration."""
        expected = self.iterations_complete
        for (group, name), arr in self._arrays.items():
            if _first_dim(arr) == "iteration" and arr.shape[0] != expected:
                raise StoreError(f"{group}.{name}: has {arr.shape[0]} iterations, "
                                 f"expected {expected}")
        writes = self._batch_writes(batch)
        # Every array's write at once (each is a few files): a commit's cost was mostly
        # zarr's per-operation round trips, paid once per array in turn.
        write_all(writes)
        self.commit()

    def _batch_writes(self, batch: Sequence[Mapping[str, Mapping[str, np.ndarray]]]
                      ) -> list[Coroutine[Any, Any, None]]:
        """The writes of :meth:`append_iterations`, each block checked: a bad one raises
        here, before anything is written."""
        writes: list[Coroutine[Any, Any, None]] = []
        try:
            for group in dict.fromkeys(g for groups in batch for g in groups):
                if group not in _DIMS:
                    raise StoreError(f"group: expected one of {list(_DIMS)}, got {group!r}")
                parts = [{k: np.asarray(v) for k, v in groups.get(group, {}).items()}
                         for groups in batch]
                names = list(dict.fromkeys(n for variables in parts for n in variables))
                if group in _ROW_CHUNKS:
                    before = self._length(group)
                    counts = [_rows(variables) for variables in parts]
                    for name in names:
                        like = next(v[name] for v in parts if name in v)
                        block = [v[name] if name in v else _filled(like, n)
                                 for v, n in zip(parts, counts)]
                        writes.append(self._write(group, name, np.concatenate(block), before))
                else:
                    for name in names:
                        missing = [k for k, v in enumerate(parts) if name not in v]
                        if missing:
                            raise StoreError(f"{group}.{name}: expected a value in every "
                                             f"iteration, missing in {len(missing)} of "
                                             f"{len(parts)}")
                        writes.append(self._write(group, name,
                                                  np.stack([v[name] for v in parts])))
        except BaseException:
            for w in writes:
                w.close()  # never started
            raise
        return writes

    def _length(self, group: str) -> int:
        """The rows of ``group`` (its first dimension's length) as written so far."""
        dim = _DIMS[group][0]
        for (g, _), arr in self._arrays.items():
            if g == group and _first_dim(arr) == dim:
                return arr.shape[0]
        return 0

    def commit(self) -> None:
        _quiet_consolidate(self.path)


class StoreWriter:
    """Commits a run's complete iterations to its store from a thread of its own.

    :meth:`submit` hands over one iteration's rows (and what to do once they are
    committed) and returns at once. The thread appends and commits what it was handed
    as soon as ``interval`` seconds have passed since its last commit, all iterations
    handed over meanwhile together (:meth:`RunStore.append_iterations`: each array
    written once for them), so the cost of a commit, mostly per array, is paid once per
    interval rather than once per iteration; with ``interval`` 0 every iteration is
    committed on its own as soon as it is handed over. A reader sees complete
    iterations only, as always. :meth:`flush` returns once everything handed over is
    committed; a failure to write is raised by the next :meth:`submit` or
    :meth:`flush`, and nothing is written after it."""

    def __init__(self, store: RunStore, interval: float):
        self.store = store
        self.interval = interval
        self._pending: list[tuple[Mapping[str, Mapping[str, np.ndarray]],
                                  Callable[[], None] | None]] = []
        self._writing = False
        self._flushing = False
        self._closed = False
        self._error: BaseException | None = None
        self._last = float("-inf")     # when the last commit was made
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._loop, name="digenrl-store-writer",
                                        daemon=True)
        self._thread.start()

    def submit(self, groups: Mapping[str, Mapping[str, np.ndarray]],
               after: Callable[[], None] | None = None) -> None:
        """Hand over one iteration's rows; ``after()`` runs once they are committed."""
        with self._cond:
            self._raise()
            self._pending.append((groups, after))
            self._cond.notify_all()

    def flush(self) -> None:
        """Commit everything handed over now, and wait until it is."""
        with self._cond:
            self._flushing = True
            self._cond.notify_all()
            while (self._pending or self._writing) and self._error is None:
                self._cond.wait()
            self._flushing = False
            self._raise()

    def close(self) -> None:
        """:meth:`flush`, then end the thread (also after a failure to write)."""
        try:
            self.flush()
        finally:
            with self._cond:
                self._closed = True
                self._cond.notify_all()
            self._thread.join()

    def _raise(self) -> None:
        if self._error is not None:
            raise StoreError(f"store: writing {self.store.path!r} failed: "
                             f"{self._error!r}") from self._error

    def _due(self) -> bool:
        return bool(self._pending) and (
            self._flushing or time.monotonic() - self._last >= self.interval)

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._due() and not self._closed:
                    wait = (self.interval - (time.monotonic() - self._last)
                            if self._pending else None)
                    self._cond.wait(timeout=wait)
                if not self._pending and self._closed:
                    return
                batch, self._pending = self._pending, []
                self._writing = True
            try:
                self.store.append_iterations([groups for groups, _ in batch])
                for _, after in batch:
                    if after is not None:
                        after()
            except BaseException as e:  # noqa: BLE001 -- handed to the caller
                with self._cond:
                    self._error = e
            with self._cond:
                self._last = time.monotonic()
                self._writing = False
                self._cond.notify_all()
                if self._error is not None:
                    return


def _write_run_attrs(path: Path, attrs: dict[str, Any]) -> None:
    """Set the root's ``digenrl`` attribute by replacing its ``zarr.json`` in one atomic
    write that keeps the consolidated metadata (the last commit) as it is. (Zarr's own
    attribute update rewrites that file without it until the next consolidation, and a
    reader in between would list uncommitted rows.)"""
    meta = path / "zarr.json"
    doc = json.loads(meta.read_text())
    doc.setdefault("attributes", {})["digenrl"] = attrs
    tmp = meta.with_name(f".zarr.json.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(doc))
    os.replace(tmp, meta)


def _fill_value(values: np.ndarray) -> Any:
    """What a new column's rows before its first value hold: NaN for floats, the
    dtype's zero otherwise."""
    return np.nan if values.dtype.kind == "f" else None


def _filled(like: np.ndarray, rows: int) -> np.ndarray:
    """``rows`` rows of ``like``'s shape holding :func:`_fill_value` (zero for others)."""
    fill = _fill_value(like)
    return np.full((rows,) + like.shape[1:], 0 if fill is None else fill, dtype=like.dtype)


def _rows(variables: Mapping[str, np.ndarray]) -> int:
    """How many rows a row group's variables hold (they hold as many each)."""
    lengths = {len(v) for v in variables.values()}
    if len(lengths) > 1:
        raise StoreError(f"rows: expected every column to hold as many rows, got "
                         f"{sorted(lengths)}")
    return lengths.pop() if lengths else 0


def _first_dim(arr: zarr.Array) -> str | None:
    meta = arr.metadata
    names = meta.dimension_names if meta.zarr_format == 3 else None   # (v2: none)
    return names[0] if names else None


def _length(group: zarr.Group, dim: str) -> int:
    for _, arr in group.arrays():
        if _first_dim(arr) == dim:
            return arr.shape[0]
    return 0


def _open_committed(path: str | Path) -> zarr.Group:
    """The store's root as of its last commit (its consolidated metadata)."""
    p = Path(path)
    if not (p / "zarr.json").is_file():
        raise StoreError(f"store: expected an existing digenrl store, got {str(path)!r}")
    root = zarr.open_group(str(p), mode="r")
    if "digenrl" not in root.attrs:
        raise StoreError(f"store: {str(path)!r} is a Zarr store but not a digenrl run")
    return root


def subgroup(root: zarr.Group, name: str) -> zarr.Group:
    """The group ``name`` of ``root``."""
    node = root[name]
    if not isinstance(node, zarr.Group):
        raise StoreError(f"store: expected {name!r} to be a group, got an array")
    return node


def _run_attrs(root: zarr.Group) -> dict[str, Any]:
    """A copy of the run attributes of a store's root (a JSON object)."""
    attrs: Mapping[str, Any] = root.attrs
    return dict(attrs["digenrl"])


def read_attrs(path: str | Path) -> dict[str, Any]:
    """The run attributes of a store (config, versions, cluster, ...), read-only."""
    return _run_attrs(_open_committed(path))


def _committed_lengths(root: zarr.Group) -> tuple[int, int, int]:
    evals = _length(subgroup(root, EVAL_GROUP), "entry") if EVAL_GROUP in root else 0
    return (_length(subgroup(root, "metrics"), "iteration"),
            _length(subgroup(root, "tasks"), "task"), evals)


def committed_iterations(path: str | Path) -> int:
    """How many complete iterations a store holds (safe while a run is writing it)."""
    return _committed_lengths(_open_committed(path))[0]


def open_run(path: str | Path, *, attempts: int = 20) -> dict[str, xr.Dataset]:
    """Every group of a store as an xarray Dataset (committed iterations only).

    Each group is opened from the consolidated metadata, which a running writer
    replaces at every commit; if a commit lands while the groups are being opened they
    are opened again, so all groups always show the same complete iterations."""
    p = str(path)
    before = _committed_lengths(_open_committed(p))
    for _ in range(attempts):
        root = _open_committed(p)
        # (A store written before a group existed has none: an empty Dataset stands in.)
        out = {g: xr.open_zarr(p, group=g, chunks=None) if g in root else xr.Dataset()
               for g in GROUPS}
        root = _open_committed(p)
        after = _committed_lengths(root)
        if after == before:
            break
        before = after
    else:
        raise StoreError(f"store: {p!r} changed under every one of {attempts} attempts "
                         f"to read it")
    attrs = root.attrs["digenrl"]
    for ds in out.values():
        ds.attrs["digenrl"] = attrs
    return out


def evaluation_means(rows: Mapping[str, np.ndarray] | None) -> list[tuple[int, float, int]]:
    """Each evaluation in an iteration's ``eval`` rows: its version, the mean of its
    valid rewards, and the prompts it scored."""
    if not rows or not len(rows["version"]):
        return []
    out = []
    for v in np.unique(rows["version"]):
        mine = rows["version"] == v
        good = rows[REWARD_COLUMN][mine & rows["valid"]]
        out.append((int(v), float(good.mean()) if len(good) else float("nan"),
                    int(mine.sum())))
    return out


def evaluation_reward_means(rows: Mapping[str, np.ndarray] | None
                            ) -> dict[int, dict[str, float]]:
    """Each evaluated version's mean of each reward's own column (``reward_NAME``: an
    OCR reward's is the held-out OCR accuracy) over its valid rows; a reward without a
    finite score there (a group reward, left out of evaluation) is left out."""
    if not rows or not len(rows["version"]):
        return {}
    out: dict[int, dict[str, float]] = {}
    for v in np.unique(rows["version"]):
        mine = (rows["version"] == v) & rows["valid"]
        means = {}
        for name, column in reward_columns(rows).items():
            scores = np.asarray(rows[column], dtype=np.float64)[mine]
            if np.isfinite(scores).any():
                means[name] = float(np.nanmean(scores))
        out[int(v)] = means
    return out
