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

import time

from distributed.metrics import context_meter

__all__ = ["model_time"]


def model_time():
    """A context manager: the CPU seconds of this thread inside it are the running
    task's ``model`` activity."""
    return context_meter.meter("model", func=time.thread_time)
