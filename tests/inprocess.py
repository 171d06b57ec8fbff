"""A whole Dask cluster in one event loop, with Dask's own state validation on.

``distributed.utils_test.gen_cluster`` does the same, but it also terminates every child
process of the test process before and after each test: under ``pytest -n`` a test
process may host the session's worker-process clusters (``tests/conftest.py``), which
that would kill. :func:`pooled_cluster` starts and closes only what it owns.
"""

from __future__ import annotations

import asyncio

import dask
from distributed import Client, Worker
from distributed.utils_test import start_cluster

#: What the upstream test helpers switch on: every transition checked by the scheduler
#: and the workers, a fast admin tick, no profiler.
VALIDATING = {
    "distributed.scheduler.validate": True,
    "distributed.worker.validate": True,
    "distributed.admin.tick.interval": "500 ms",
    "distributed.worker.profile.enabled": False,
    "distributed.admin.system-monitor.gil.enabled": False,
}


def pooled_cluster(nthreads, config: dict | None = None, timeout: float = 60.0,
                   worker_class: type = Worker):
    """Decorate ``async def test(c, s, *workers)``: it runs against a scheduler and one
    in-process worker per ``(host, nthreads[, worker kwargs])`` entry, with a client, all
    closed afterwards; it fails after ``timeout`` seconds. ``worker_class``: the workers'
    class (one of the upstream test workers that hold a step until the test lets it go,
    such as ``distributed.utils_test.BlockedGatherDep``)."""

    def decorator(test):
        async def body():
            s, workers = await start_cluster(nthreads, "127.0.0.1", Worker=worker_class)
            try:
                async with Client(s.address, asynchronous=True) as c:
                    await asyncio.wait_for(test(c, s, *workers), timeout)
            finally:
                await asyncio.gather(*(w.close(timeout=5) for w in workers))
                await s.close()

        def run():
            with dask.config.set({**VALIDATING, **(config or {})}):
                asyncio.run(body())

        run.__name__, run.__qualname__ = test.__name__, test.__qualname__
        run.__doc__, run.__module__ = test.__doc__, test.__module__
        return run

    return decorator
