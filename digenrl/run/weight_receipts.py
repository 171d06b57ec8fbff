"""How long workers spend receiving policy weights.

A policy version is the output of its ``publish`` task; Dask moves it to every worker
that runs a task reading it. :class:`WeightReceipts` is a worker plugin that times each
such move on the worker receiving it (the task's ``flight`` state: from the fetch's
start until the bytes are in memory), or, for a version published by broadcast, the
worker's receiving member of the broadcast (its ``executing`` state), and :func:`drain` hands a worker's total to the
driver, which stores the sum over workers per iteration as ``weight_sync_seconds``
beside ``weight_sync_bytes``.
"""

from __future__ import annotations

import time

from distributed import WorkerPlugin

from digenrl.graph.keys import kind_of
from digenrl.vocabulary import PUBLISH

__all__ = ["WeightReceipts", "drain", "PLUGIN_NAME"]

PLUGIN_NAME = "digenrl-weight-receipts"


class WeightReceipts(WorkerPlugin):
    """Seconds this worker spent receiving ``publish`` results, since the last drain."""

    name = PLUGIN_NAME

    def __init__(self) -> None:
        self.seconds = 0.0
        self.received = 0
        self._since: dict = {}

    def setup(self, worker) -> None:
        self.seconds, self.received, self._since = 0.0, 0, {}

    def transition(self, key, start, finish, **kwargs) -> None:
        if not (isinstance(key, tuple) and key and kind_of(key) == PUBLISH):
            return
        if finish == "flight" or (finish == "executing" and _receives(key)):
            # (A fetch may go back to ``fetch`` and fly again: it is timed from the first.)
            self._since.setdefault(key, time.monotonic())
        elif finish == "memory" and start in ("flight", "executing"):
            began = self._since.pop(key, None)
            if began is not None:
                self.seconds += time.monotonic() - began
                self.received += 1
        elif finish in ("released", "forgotten"):
            self._since.pop(key, None)


def _receives(key: tuple) -> bool:
    """Whether ``key`` is a broadcast's receiving member (``member_key(publish_key(v),
    m)``, m > 0): its computing is this worker receiving the version."""
    return len(key) == 3 and isinstance(key[2], int) and key[2] > 0


def drain(dask_worker) -> tuple[float, int]:
    """This worker's receiving seconds and versions received since the last call (run
    through ``Client.run``), then zero."""
    plugin = dask_worker.plugins.get(PLUGIN_NAME)
    if not isinstance(plugin, WeightReceipts):
        return 0.0, 0
    out = (plugin.seconds, plugin.received)
    plugin.seconds, plugin.received = 0.0, 0
    return out
