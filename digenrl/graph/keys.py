"""Task keys and the annotations the scheduler plugin reads.

A key is a tuple whose first element is the task kind, so Dask's dashboard colours the
kinds apart and its per-prefix duration estimates stay meaningful. The plugin never
parses keys: everything it needs is in the ``digenrl`` annotation built here.
"""

from __future__ import annotations

from typing import Any

from digenrl.schedulers.options import PUBLISH_KIND, ROLLOUT, TRAINER

__all__ = ["KINDS", "KIND_POOL", "GPU_KINDS", "task_meta", "ANNOTATION"]

#: The annotation name carrying :func:`task_meta` on every task of a run.
ANNOTATION = "digenrl"

KINDS = ("init", "noise", "denoise", "decode", "reward", "advantage", "grad", "reduce",
         "optimize", PUBLISH_KIND, "stats", "checkpoint", "restore")

#: The pool each kind belongs to in the disaggregated modes.
KIND_POOL = {
    "noise": ROLLOUT, "denoise": ROLLOUT, "decode": ROLLOUT, "reward": ROLLOUT,
    "init": TRAINER, "advantage": TRAINER, "grad": TRAINER, "reduce": TRAINER,
    "optimize": TRAINER, PUBLISH_KIND: TRAINER, "stats": TRAINER,
    "checkpoint": TRAINER, "restore": TRAINER,
}

#: Kinds that occupy a GPU slot (a ``reward`` does too when a reward needs the GPU).
GPU_KINDS = frozenset({"denoise", "decode", "grad", "optimize"})


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
