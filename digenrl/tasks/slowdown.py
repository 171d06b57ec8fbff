"""Injected slowness: one worker made ``factor`` times slower, for drills and for the
tests of the scheduler's straggler rebalancing.

``client.run(set_slowdown, 4.0, workers=[address])`` makes every model step on that
worker take four times its compute time (the task sleeps for the difference after
computing, so its results are unchanged); the emulator's tasks honour the same factor.
``set_slowdown(1.0)`` ends it.
"""

from __future__ import annotations

import threading
import time

from digenrl.tasks.worker import current_worker

__all__ = ["set_slowdown", "slowdown", "stretch", "reset"]

_FACTORS: dict[str, float] = {}
_LOCK = threading.Lock()


def this_worker() -> str:
    """The name of the Dask worker running the caller (``local`` outside one)."""
    worker = current_worker()
    return str(worker.name) if worker is not None else "local"


def set_slowdown(factor: float, dask_worker=None) -> float:
    """Make this worker ``factor`` times slower (run it with ``client.run``)."""
    factor = float(factor)
    if not factor > 0:
        raise ValueError(f"factor: expected a number > 0, got {factor!r}")
    name = str(dask_worker.name) if dask_worker is not None else this_worker()
    with _LOCK:
        _FACTORS[name] = factor
    return factor


def slowdown(name: str | None = None) -> float:
    """The injected factor of worker ``name`` (this worker by default); 1 if none."""
    return _FACTORS.get(this_worker() if name is None else name, 1.0)


def stretch(started: float) -> None:
    """Called at the end of a task that began at ``time.perf_counter() == started``:
    sleep so that it took ``slowdown()`` times as long."""
    f = slowdown()
    if f > 1.0:
        time.sleep((f - 1.0) * (time.perf_counter() - started))


def reset() -> None:
    with _LOCK:
        _FACTORS.clear()
