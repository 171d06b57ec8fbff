"""DiffusionNFT (arXiv 2509.16117): negative-aware fine-tuning on the forward process.

ODE sampling with the policy's sampling copy (a slowly moving average of the trained
weights); each micro-step noises the clean samples at noise levels drawn per sample and
trains the implicit positive and negative policies built from the velocity of the copy
of the version it trains (whichever version sampled the chunk) and the current one with
``algorithm.nft_beta``, weighted by each sample's optimality probability. The math: :mod:`digenrl.tasks.algorithms.diffusion_nft`.
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
