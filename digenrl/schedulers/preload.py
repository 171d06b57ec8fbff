"""Install the digenrl scheduler plugin at scheduler start::

    dask scheduler --preload digenrl.schedulers.preload

A preload's ``dask_setup`` runs while the scheduler starts, just before the scheduler
starts every plugin it holds, so the plugin is only added here: starting it here as
well (``register_scheduler_plugin``) would start it twice.
"""

from __future__ import annotations

from digenrl.schedulers.plugin import DigenRLSchedulerPlugin


async def dask_setup(scheduler) -> None:
    scheduler.add_plugin(DigenRLSchedulerPlugin(), idempotent=True)
