"""The algorithms' torch math, found by the algorithm's name in the one registry of
:data:`digenrl.algorithms.ALGORITHMS` (its shape): each module here names the shape it is
the math of (``ALGORITHM``) and computes one micro-step (``micro_step``).

:mod:`digenrl.tasks.train` runs them: ``grad`` the coupled family's micro-step (a chunk at
one trained step of its trajectory), ``matching_grad`` a decoupled one's (a chunk's clean
latents at freshly drawn noise levels).
"""

from __future__ import annotations

from types import ModuleType

from digenrl.algorithms import ALGORITHMS, Algorithm
from digenrl.tasks.algorithms import awm, diffusion_nft, dpo, flow_grpo

__all__ = ["MATH", "math_of"]

#: The math of each registered algorithm, by its name.
MATH: dict[str, ModuleType] = {m.ALGORITHM.name: m
                               for m in (flow_grpo, diffusion_nft, awm, dpo)}
assert set(MATH) == set(ALGORITHMS), "every registered algorithm has its math"


def math_of(algorithm: Algorithm) -> ModuleType:
    """The module computing ``algorithm``'s micro-steps."""
    return MATH[algorithm.name]
