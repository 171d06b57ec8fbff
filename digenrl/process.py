"""Settings of a long-running digenrl process: the allocator of a worker process and the
cyclic garbage collector of every process (driver, scheduler, workers).

Both pause or slow a process without showing as work of its own: a worker's tensors
mapped and unmapped on every allocation, and the collector's full passes, which walk
every tracked object of the process while holding the interpreter lock. Neither needs
torch, so the scheduler's process uses this module too.
"""

from __future__ import annotations

import ctypes
import gc
import sys

__all__ = ["tune_malloc", "freeze_collector"]


def tune_malloc() -> bool:
    """Undo the allocator setting Dask's nanny gives worker processes.

    The nanny exports ``MALLOC_TRIM_THRESHOLD_=65536``; with any trim threshold set,
    glibc stops adapting its mmap threshold, so every tensor buffer of 128 kB or more is
    mmap-ed and unmapped again, page faults included: the default model's forward pass
    is 1.7x slower (``python workflows/microbench.py malloc``). Raising both thresholds
    restores heap reuse. Linux/glibc only; elsewhere a no-op.
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3
    ok = libc.mallopt(m_mmap_threshold, 64 << 20) == 1
    return ok and libc.mallopt(m_trim_threshold, 256 << 20) == 1


#: How many objects this process froze (:func:`freeze_collector`); None before it did.
_frozen: int | None = None


def freeze_collector() -> int:
    """Keep what this process holds after its start-up out of the collector's full
    passes; returns how many objects the first call kept out.

    A process that has imported torch, diffusers and transformers holds about half a
    million objects that live as long as it does (modules, functions, classes). Python's
    collector walks all of them in each full pass, and it starts one whenever the
    objects that survived earlier passes have grown by a quarter: here a pass takes
    0.25 s in a process that has imported what a worker imports (``python
    workflows/microbench.py collector``) and 0.3 to 0.45 s in the driver's process of
    the default run. In the scheduler's process that is a pause of the whole cluster's
    dispatch, in a worker's one of its GPU. After a collection of what is already garbage,
    :func:`gc.freeze` moves every object left to a generation no pass walks.

    Only the first call freezes: objects made later (a run's) are collected as before,
    so a reference cycle a run leaves behind is still freed. (A frozen object, too, is
    freed as soon as nothing refers to it; only a cycle among frozen objects stays.)"""
    global _frozen
    if _frozen is None:
        gc.collect()
        gc.freeze()
        # (Counted once: counting walks every frozen object, tens of CPU-ms.)
        _frozen = gc.get_freeze_count()
    return _frozen
