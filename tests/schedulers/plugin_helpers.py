"""Small annotated graphs for plugin tests (plain functions, no model)."""

from __future__ import annotations

from dask._task_spec import Task, TaskRef
from dask.highlevelgraph import HighLevelGraph, MaterializedLayer

from digenrl.graph.keys import task_meta
from digenrl.vocabulary import ANNOTATION


def annotated(tasks: dict, name: str = "g") -> HighLevelGraph:
    """``tasks``: key -> (func, args, meta); args that are keys of ``tasks`` become refs."""
    dsk, meta = {}, {}
    for key, (func, args, m) in tasks.items():
        dsk[key] = Task(key, func, *[TaskRef(a) if a in tasks else a for a in args])
        meta[key] = m
    resources = {k: {"GPU": 1} for k, m in meta.items() if m["gpu"]}
    return HighLevelGraph({name: MaterializedLayer(dsk, annotations={
        ANNOTATION: meta.get, "resources": resources.get})}, {name: set()})


def worker_name(*args):
    from distributed import get_worker

    return get_worker().name


def wait_for_event(name):
    from distributed import Event

    Event(name).wait()
    return name


__all__ = ["annotated", "task_meta", "worker_name", "wait_for_event"]
