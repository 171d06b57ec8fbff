"""DiffusionNFT (arXiv 2509.16117): negative-aware fine-tuning on the forward process.

ODE sampling with the policy's sampling copy (a slowly moving average of the trained
weights); each micro-step noises the clean samples at noise levels drawn per sample and
trains the implicit positive and negative policies, centred on the velocity of the copy
that sampled the chunk and apart by ``algorithm.nft_beta`` times the current velocity's
offset from the copy of the version trained, weighted by each sample's optimality
probability. The math: :mod:`digenrl.tasks.algorithms.diffusion_nft`.
"""

from __future__ import annotations

from dataclasses import dataclass

from digenrl.algorithms.base import ODE, Algorithm

__all__ = ["DiffusionNFT"]


@dataclass(frozen=True)
class DiffusionNFT(Algorithm):
    name = "diffusion_nft"
    paper = "2509.16117"
    coupled = False
    dynamics_choices = (ODE,)
    sampling_copy = True
    # On-policy unless the config sets a staleness: with one-version-stale chunks it
    # learned on one built-in prompt set and lost reward on the other (docs/algorithm.md,
    # "Stale chunks"); every other overlap of the mode (GAP, TSP, TAG, RAT) stays.
    defaults = {"train.learning_rate": 3e-3, "algorithm.nft_beta": 1.0,
                "algorithm.ema_ramp": 0.001, "algorithm.ema_max": 0.5,
                "schedule.max_staleness": 0}
