"""Advantage-weighted matching (AWM, arXiv 2509.25050): the flow-matching loss of the
clean samples, noised afresh, weighted by their advantages.

ODE sampling; each micro-step's log-likelihood stand-in is the negative flow-matching
error of a sample at a noise level drawn for it, trained with the policy-gradient
objective of the coupled family (clipped ratio, the off-policy correction against the
policy that sampled the chunk). The math: :mod:`digenrl.tasks.algorithms.awm`.
"""

from __future__ import annotations

from dataclasses import dataclass

from digenrl.algorithms.base import ODE, Algorithm

__all__ = ["AWM"]


@dataclass(frozen=True)
class AWM(Algorithm):
    name = "awm"
    paper = "2509.25050"
    coupled = False
    dynamics_choices = (ODE,)
    reads_sampler = True
    defaults = {"train.learning_rate": 5e-3}
