"""The algorithms, by the name ``algorithm.name`` selects (plain data: no torch).

Adding an algorithm is one module here with an :class:`~digenrl.algorithms.base.Algorithm`
subclass (its shape) and one entry in :data:`ALGORITHMS`, plus its torch math in
:mod:`digenrl.tasks.algorithms` (found there by the same name).
"""

from __future__ import annotations

from digenrl.algorithms.awm import AWM
from digenrl.algorithms.base import (CPS, DANCE, DYNAMICS, FLOW, KL_SPACES, LATENT, ODE,
                                     VELOCITY, Algorithm)
from digenrl.algorithms.diffusion_nft import DiffusionNFT
from digenrl.algorithms.dpo import OnlineDPO
from digenrl.algorithms.flow_grpo import FlowGRPO

__all__ = ["ALGORITHMS", "DEFAULT_ALGORITHM", "Algorithm", "FlowGRPO", "DiffusionNFT",
           "AWM", "OnlineDPO", "DYNAMICS", "FLOW", "DANCE", "CPS", "ODE", "KL_SPACES",
           "LATENT", "VELOCITY"]

#: ``algorithm.name`` -> the algorithm's shape.
ALGORITHMS: dict[str, type[Algorithm]] = {
    a.name: a for a in (FlowGRPO, DiffusionNFT, AWM, OnlineDPO)
}
#: The algorithm of a config that names none.
DEFAULT_ALGORITHM = FlowGRPO.name
