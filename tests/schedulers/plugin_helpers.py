"""Small annotated graphs for plugin tests (plain functions, no model)."""

from __future__ import annotations

from dask._task_spec import Task, TaskRef
from dask.highlevelgraph import HighLevelGraph, MaterializedLayer

from digenrl.graph.keys import task_meta
from digenrl.vocabulary import ANNOTATION


def annotated(tasks: dict, name: str = "g") -> HighLevelGraph:
    """``tasks``: key -> (func, args, meta); args that are keys of ``tasks`` become refs.
    A task whose meta is a plain dict of resources (``{"resources": {...}}``) instead of
    a task annotation is a plain Dask task, in a layer of its own, restricted to those
    resources."""
    dsk, meta, plain, plain_resources = {}, {}, {}, {}
    for key, (func, args, m) in tasks.items():
        task = Task(key, func, *[TaskRef(a) if a in tasks else a for a in args])
        if set(m) == {"resources"}:
            plain[key], plain_resources[key] = task, m["resources"]
        else:
            dsk[key], meta[key] = task, m
    resources = {k: {"GPU": 1} for k, m in meta.items() if m["gpu"]}
    layers = {name: MaterializedLayer(dsk, annotations={
        ANNOTATION: meta.get, "resources": resources.get})}
    dependencies = {name: set()}
    if plain:
        layers[f"{name}-plain"] = MaterializedLayer(
            plain, annotations={"resources": plain_resources.get})
        dependencies = {name: {f"{name}-plain"}, f"{name}-plain": set()}
    return HighLevelGraph(layers, dependencies)


def worker_name(*args):
    from distributed import get_worker

    return get_worker().name


def wait_for_event(name):
    from distributed import Event

    Event(name).wait()
    return name


__all__ = ["annotated", "task_meta", "worker_name", "wait_for_event"]
