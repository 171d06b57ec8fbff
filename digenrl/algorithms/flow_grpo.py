"""Flow-GRPO and the coupled family (arXiv 2505.05470): SDE sampling, the clipped policy
ratio of each trained step's log-probability, group-relative advantages.

Its options, all of this one algorithm: the dynamics (``flow``: Flow-GRPO's SDE;
``dance``: DanceGRPO's constant noise, arXiv 2505.07818; ``cps``: coefficients-preserving
sampling, arXiv 2509.05952), an SDE window (``algorithm.sde_steps`` /
``num_sde_steps``: SDE on a few steps drawn per iteration, ODE elsewhere, only those
trained, as Flow-GRPO-Fast and MixGRPO, arXiv 2507.21802) and GRPO-Guard's regulated
clipping (``algorithm.guard``, arXiv 2510.22319). The math: :mod:`digenrl.tasks.sde`
and :mod:`digenrl.tasks.algorithms.flow_grpo`.
"""

from __future__ import annotations

from dataclasses import dataclass

from digenrl.algorithms.base import CPS, DANCE, FLOW, Algorithm

__all__ = ["FlowGRPO"]


@dataclass(frozen=True)
class FlowGRPO(Algorithm):
    name = "flow_grpo"
    paper = "2505.05470"
    coupled = True
    dynamics_choices = (FLOW, DANCE, CPS)
    defaults = {"train.learning_rate": 1.5e-3}
    dynamics_defaults = {DANCE: {"train.learning_rate": 2.5e-3},
                         CPS: {"train.learning_rate": 2.5e-3}}
