"""Install the digenrl scheduler plugin at scheduler start::

    dask scheduler --preload digenrl.schedulers.preload
"""

from __future__ import annotations

from digenrl.schedulers.plugin import DigenRLSchedulerPlugin


async def dask_setup(scheduler) -> None:
    await scheduler.register_scheduler_plugin(DigenRLSchedulerPlugin(), idempotent=True)
