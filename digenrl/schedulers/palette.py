"""One colour per task kind, shared by the dashboard's task stream and progress bars,
the digenrl dashboard page and the report plots."""

from __future__ import annotations

from functools import wraps
from typing import Callable

from digenrl.vocabulary import (ADVANTAGE, CHECKPOINT, DECODE, DENOISE, ENCODE, EVAL,
                                EVAL_REWARD, GRAD, GROUP_REWARD, INIT, NOISE, OPTIMIZE, PUBLISH,
                                REDUCE, RESTORE,
                                REWARD, STATS, TRAINED)

__all__ = ["KIND_COLOURS", "use_kind_colours"]

KIND_COLOURS = {
    ENCODE: "#dbdb8d", NOISE: "#c7c7c7", DENOISE: "#1f77b4", DECODE: "#17becf",
    REWARD: "#2ca02c", GROUP_REWARD: "#98df8a",
    ADVANTAGE: "#bcbd22", GRAD: "#d62728", REDUCE: "#ff9896", OPTIMIZE: "#9467bd",
    PUBLISH: "#8c564b", TRAINED: "#c49c94", STATS: "#7f7f7f", INIT: "#e377c2",
    CHECKPOINT: "#393b79", RESTORE: "#637939", EVAL: "#ff7f0e", EVAL_REWARD: "#ffbb78",
}

_PATCHED = False


def use_kind_colours() -> bool:
    """Make the scheduler's dashboard colour digenrl's task kinds from KIND_COLOURS.

    Dask colours a key prefix by hashing its name into an 18-colour palette, which gives
    ``noise``, ``optimize`` and ``stats`` one colour and ``advantage`` and ``reduce``
    another. The dashboard modules look ``color_of`` up by module-level name each time;
    this wraps those names so the kinds get their own colours and every other prefix
    keeps Dask's. Returns False when the dashboard modules are not importable.
    """
    global _PATCHED
    if _PATCHED:
        return True
    try:
        import distributed.dashboard.components.scheduler as dash
        import distributed.diagnostics.progress_stream as progress
        import distributed.diagnostics.task_stream as stream
    except ImportError:
        return False

    def wrap(original: Callable) -> Callable:
        @wraps(original)
        def color_of(x, *args, **kwargs):
            return KIND_COLOURS.get(x) or original(x, *args, **kwargs)

        return color_of

    progress.color_of = wrap(progress.color_of)
    stream.color_of = wrap(stream.color_of)
    dash.color_of = wrap(dash.color_of)
    dash.ts_color_of = wrap(dash.ts_color_of)
    _PATCHED = True
    return True
