"""The model's own arithmetic, metered apart from everything else a task does.

Dask meters every task's execution on its worker (its fine performance metrics: CPU
seconds in the task thread, wall seconds off the CPU, (de)serialisation, transfers), by
task kind. :func:`model_time` marks the code inside it as the activity ``model`` of the
running task: the forward and backward passes of the transformer, the VAE's decoding and
the text encoders. Dask subtracts it from the task's other CPU seconds, so what a task
spends beside the model is its ``thread-cpu`` activity (``workflows/overhead.py`` prints
both). Outside a Dask task nothing is recorded.
"""

from __future__ import annotations

import os
import socket
import time

import psutil
from distributed.metrics import context_meter

__all__ = ["model_time", "CpuMeter", "process_cpu"]


def model_time():
    """A context manager: the CPU seconds of this thread inside it are the running
    task's ``model`` activity."""
    return context_meter.meter("model", func=time.thread_time)


def process_cpu() -> tuple[str, int, float]:
    """This process's host, pid and CPU seconds so far (user and system)."""
    t = psutil.Process().cpu_times()
    return socket.gethostname(), os.getpid(), t.user + t.system


def _scheduler_reading(dask_scheduler) -> tuple[tuple[str, int, float], float]:
    """On the scheduler: its process's CPU (:func:`process_cpu`) and the ``model``
    seconds of every task its workers have run."""
    model = sum(v for k, v in dask_scheduler.cumulative_worker_metrics.items()
                if isinstance(k, tuple) and len(k) == 4 and k[0] == "execute"
                and k[2] == "model" and k[3] == "seconds")
    return process_cpu(), model


class CpuMeter:
    """The CPU a run costs, beside the model's own arithmetic, between two readings.

    Each reading sums the CPU seconds of every process the run uses (this driver, the
    scheduler, every worker and every nanny, once each) and the seconds the tasks spent
    in the model (:func:`model_time`, from Dask's metrics), and returns both since the
    previous reading. A process that joined meanwhile counts from its start; one that
    left takes its last seconds with it.
    """

    def __init__(self, client) -> None:
        self.client = client
        self._seen: dict[tuple[str, int], float] = {}
        self._model = 0.0
        self.read()

    def read(self) -> tuple[float, float]:
        """``(cpu_seconds, model_seconds)`` since the previous reading."""
        client = self.client
        scheduler, model = client.run_on_scheduler(_scheduler_reading)
        found = [process_cpu(), scheduler]
        found += client.run(process_cpu, on_error="ignore").values()
        found += client.run(process_cpu, nanny=True, on_error="ignore").values()
        # (With the scheduler in this process, its reading and this one name one pid.)
        now = {(host, pid): s for host, pid, s in (v for v in found if isinstance(v, tuple))}
        cpu = sum(s - self._seen.get(p, 0.0) for p, s in now.items())
        spent = model - self._model
        self._seen, self._model = now, model
        return cpu, spent
