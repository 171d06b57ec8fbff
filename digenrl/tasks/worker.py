"""The Dask worker a task computes for."""

from __future__ import annotations

from distributed import Worker, get_worker

__all__ = ["current_worker"]


def current_worker() -> Worker | None:
    """The Dask worker whose task this thread computes, or None outside one (the driver,
    a test, a plain process)."""
    try:
        return get_worker()
    except ValueError:
        return None
