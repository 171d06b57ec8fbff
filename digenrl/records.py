"""The task record: one finished task, and the columns of the store's ``tasks`` group.

The scheduler plugin keeps a record per finished task (:mod:`digenrl.schedulers.telemetry`),
the driver appends them to the store as columns (:func:`task_columns`), and the
simulator records the columns it models (:class:`SimRecord`, whose fields are
:data:`SIMULATED_COLUMNS`). Every column is named and typed here once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Mapping, NamedTuple

import numpy as np

from digenrl.vocabulary import Key

__all__ = ["Column", "TASK_COLUMNS", "SimRecord", "SIMULATED_COLUMNS", "task_columns"]


@dataclass(frozen=True)
class Column:
    """A column of the task records: the dtype the store keeps and what it holds."""

    dtype: Any
    doc: str


#: Every column of a task record, in the store's order. Times are seconds since the
#: epoch: ``start``/``stop`` on the worker's clock (shifted by Dask's estimate of its
#: offset), ``ready`` to ``finished`` on the scheduler's, so compare those four for what
#: happened before what. Missing times are NaN; a task without a timestep or chunk has -1.
TASK_COLUMNS: dict[str, Column] = {
    "key": Column(str, "the task's key, as text"),
    "kind": Column(str, "the task kind (the key's first element)"),
    "gpu": Column(bool, "whether it held a GPU slot"),
    "worker": Column(str, "the address of the worker that ran it"),
    "worker_name": Column(str, "that worker's name"),
    "pool": Column(str, "the pool that worker served in (empty when none)"),
    "start": Column(np.float64, "when it started computing (worker clock)"),
    "stop": Column(np.float64, "when it stopped computing (worker clock)"),
    "iteration": Column(np.int32, "its iteration"),
    "policy_version": Column(np.int32, "the policy version it read or produced"),
    "timestep": Column(np.int32, "its sampler step (-1: none)"),
    "chunk": Column(np.int32, "its chunk (-1: none)"),
    "ready": Column(np.float64, "when its inputs last became ready (scheduler clock)"),
    "eligible": Column(np.float64, "when the policy last stopped holding it back"),
    "released": Column(np.float64, "when the policy released it to its worker"),
    "finished": Column(np.float64, "when the scheduler heard it finished"),
    "tag": Column(bool, "whether it was trainer-assisted generation"),
    "stolen": Column(bool, "whether it moved to another worker at a timestep boundary"),
    "rat": Column(bool, "whether it was a micro-step lent to a rollout worker (RAT)"),
    "nbytes": Column(np.int64, "the size of its result"),
    "transfer": Column(np.float64, "seconds of fetches from other workers Dask attached to it"),
    "transfer_start": Column(np.float64, "when the first of those fetches started"),
    "transfer_stop": Column(np.float64, "when the last of those fetches stopped"),
    "decisions": Column(str, "the scheduling policy's decisions on it, one a line: time "
                             "(scheduler clock), what it did, rule, worker, reason, times "
                             "taken again, when last (tab-separated; digenrl why prints "
                             "them)"),
}

class SimRecord(NamedTuple):
    """One task as the simulator ran it: the columns it models (it has no worker
    addresses apart from names, no clock offsets and no data sizes): a worker's name
    stands in its ``worker`` column, and the key is the task's own, not its text."""

    key: Key
    kind: str
    worker: str
    pool: str
    iteration: int
    policy_version: int
    timestep: int
    chunk: int
    ready: float
    released: float
    start: float
    stop: float
    tag: bool
    gpu: bool
    rat: bool
    decisions: str


#: The columns the simulator records: :class:`SimRecord`'s fields.
SIMULATED_COLUMNS: tuple[str, ...] = SimRecord._fields


def task_columns(records: Iterable[Mapping[str, Any]]) -> dict[str, np.ndarray]:
    """Task records as the store's columns (a missing time becomes NaN)."""
    records = list(records)
    out = {}
    for name, column in TASK_COLUMNS.items():
        vals = [r.get(name) for r in records]
        if column.dtype is np.float64:
            vals = [np.nan if v is None else v for v in vals]
        out[name] = (np.asarray(vals, dtype=column.dtype) if records
                     else np.zeros(0, column.dtype))
    return out
