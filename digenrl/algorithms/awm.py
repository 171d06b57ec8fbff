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
    # On-policy unless the config sets a staleness: with one-version-stale chunks some
    # cells of the learning matrix did not learn at 5e-3 nor at 3e-3 (docs/algorithm.md,
    # "Each algorithm's defaults"); every other overlap of the mode (GAP, TSP, TAG, RAT)
    # stays.
    defaults = {"train.learning_rate": 3e-3, "schedule.max_staleness": 0}
