"""The annotation the scheduler plugin reads on every task.

A key is a tuple whose first element is the task kind, so Dask's dashboard colours the
kinds apart and its per-prefix duration estimates stay meaningful. The plugin never
parses keys: everything it needs is in the ``digenrl`` annotation built here, in the
words of :mod:`digenrl.vocabulary`.
"""

from __future__ import annotations

from typing import Any

from digenrl.vocabulary import GPU_KINDS, KIND_POOL, KINDS

__all__ = ["task_meta"]


def task_meta(kind: str, iteration: int, policy_version: int, *, gpu: bool | None = None,
              timestep: int | None = None, chunk: int | None = None,
              group: int | None = None, behaviour_version: int | None = None,
              samples: int = 0) -> dict[str, Any]:
    """The annotation of one task (plain data: it travels to the scheduler)."""
    if kind not in KIND_POOL:
        raise ValueError(f"kind: expected one of {list(KINDS)}, got {kind!r}")
    return {
        "kind": kind,
        "pool": KIND_POOL[kind],
        "iteration": iteration,
        "policy_version": policy_version,
        "gpu": kind in GPU_KINDS if gpu is None else gpu,
        "timestep": timestep,
        "chunk": chunk,
        "group": group,
        "behaviour_version": behaviour_version,
        "samples": samples,
    }
