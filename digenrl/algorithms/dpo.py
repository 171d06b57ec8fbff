"""Online Diffusion-DPO (arXiv 2311.12908): preference pairs formed within each prompt
group, trained against a frozen reference.

ODE sampling; each group's best and worst samples (by reward) are a pair, both noised
with one noise and level per micro-step, and the loss prefers the policy whose
flow-matching error improves on the reference's more for the better sample. A
micro-step trains the pairs of the groups whose first sample its chunk holds, reading
every chunk of those groups. The math: :mod:`digenrl.tasks.algorithms.dpo`.
"""

from __future__ import annotations

from dataclasses import dataclass

from digenrl.algorithms.base import ODE, Algorithm

__all__ = ["OnlineDPO"]


@dataclass(frozen=True)
class OnlineDPO(Algorithm):
    name = "dpo"
    paper = "2311.12908"
    coupled = False
    dynamics_choices = (ODE,)
    pairwise = True
    reference = True
    # On-policy unless the config sets a staleness, as AWM: at 4e-3 every cell of the
    # learning matrix learns on-policy, while no rate tried learned every cell with
    # one-version-stale chunks (docs/algorithm.md, "AWM's and DPO's rates"); every other
    # overlap of the mode (GAP, TSP, TAG, RAT) stays.
    defaults = {"train.learning_rate": 4e-3, "algorithm.dpo_beta": 100.0,
                "schedule.max_staleness": 0}
