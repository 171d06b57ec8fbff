"""What the algorithms' micro-steps share: the clipped policy-gradient loss, the inputs of
a decoupled (forward-process) micro-step, the velocities it computes, and the KL terms.

A decoupled micro-step noises each clean latent ``x0`` at a noise level ``sigma`` drawn
for it, ``x_sigma = (1 - sigma) x0 + sigma eps``, whose flow-matching velocity target is
``u = eps - x0``; ``sigma`` is one of the sampler's noise levels (the schedule's
``num_steps`` levels above 0, drawn uniformly), seeded by the sample (or the prompt group
of a pair) and the micro-step, so a recomputed micro-step draws the same numbers
wherever it runs.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Sequence

import torch

from digenrl.models.lora import adapters_off
from digenrl.models import Conditioning, predict_velocity
from digenrl.seeding import stable_seed

__all__ = ["policy_loss", "Draws", "draw_forward_process", "noised", "Policies",
           "rows_of", "velocity_kl", "MicroResult", "mean_over_latent"]


def policy_loss(logp: torch.Tensor, logp_b: torch.Tensor, adv: torch.Tensor,
                clip_range: float, correction: str, cap: float, *,
                ratio_log: torch.Tensor | None = None, weight_log: torch.Tensor | None = None):
    """Per-sample clipped policy loss; returns (loss, ratio, weight, truncated).

    ``correction``: ``decoupled`` (the proximal log-prob is the trainer's own,
    ``logp.detach()``, ``ratio = exp(logp - logp_prox)``, and the sample is weighted by
    ``min(exp(logp_prox - logp_b), cap)``) or ``clip`` (``ratio = exp(logp - logp_b)``).
    ``ratio_log`` / ``weight_log``: those log-ratios formed otherwise (GRPO-Guard's
    normalisation), instead of the plain differences."""
    if correction == "decoupled":
        prox = logp.detach()
        raw_w = torch.exp(prox - logp_b if weight_log is None else weight_log)
        weight = raw_w.clamp(max=cap)
        truncated = raw_w > cap
        ratio = torch.exp(logp - prox if ratio_log is None else ratio_log)
    else:
        weight = torch.ones_like(logp)
        truncated = torch.zeros_like(logp, dtype=torch.bool)
        ratio = torch.exp(logp - logp_b if ratio_log is None else ratio_log)
    unclipped = -adv * ratio
    clipped = -adv * torch.clamp(ratio, 1.0 - clip_range, 1.0 + clip_range)
    return weight * torch.maximum(unclipped, clipped), ratio, weight, truncated


def mean_over_latent(t: torch.Tensor) -> torch.Tensor:
    """The mean over every dimension but the first (one value per sample)."""
    return t.mean(dim=tuple(range(1, t.ndim)))


# ------------------------------------------------------------------ forward process


@dataclass
class Draws:
    """A micro-step's draws for its rows: the noise level of each (float64, one of the
    sampler's) and its noise."""

    sigma: torch.Tensor   # (n,) float64
    noise: torch.Tensor   # (n, *latent) float32


def draw_forward_process(seed: int, level_draw: str, noise_draw: str, iteration: int,
                         idents: Sequence[int], j: int, levels: Sequence[float],
                         shape: tuple[int, ...]) -> Draws:
    """Each identity's (a sample's, or a pair's group) noise level, uniform over
    ``levels``, from ``(seed, level_draw, iteration, ident, j)``, and its noise from
    ``(seed, noise_draw, iteration, ident, j)``; drawn on the CPU."""
    picks, noises = [], []
    for ident in idents:
        g = torch.Generator().manual_seed(stable_seed(seed, level_draw, iteration, ident, j))
        picks.append(levels[int(torch.randint(len(levels), (1,), generator=g))])
        g = torch.Generator().manual_seed(stable_seed(seed, noise_draw, iteration, ident, j))
        noises.append(torch.randn(shape, generator=g, dtype=torch.float32))
    return Draws(torch.tensor(picks, dtype=torch.float64), torch.stack(noises))


def noised(x0: torch.Tensor, draws: Draws) -> torch.Tensor:
    """``x_sigma = (1 - sigma) x0 + sigma eps`` for each row (float32)."""
    s = draws.sigma.to(x0.device, torch.float32).reshape((-1,) + (1,) * (x0.ndim - 1))
    return (1.0 - s) * x0 + s * draws.noise.to(x0.device)


def rows_of(cond: Conditioning, index: Sequence[int]) -> Conditioning:
    """The conditioning of rows ``index`` of ``cond`` (a shared negative row as it is,
    per-sample negative rows picked too)."""
    return cond.rows(torch.as_tensor(list(index), dtype=torch.long))


class Policies:
    """The velocities a micro-step computes at ``(x, sigma)``: the trained weights' (with
    gradients), the sampling policy's and the frozen reference's (without)."""

    def __init__(self, model_cfg, guidance: float, current: torch.nn.Module,
                 sampler: torch.nn.Module | None, reference: torch.nn.Module | None,
                 lora: bool, anchor: torch.nn.Module | None = None):
        self.model_cfg, self.guidance = model_cfg, guidance
        self._current, self._sampler, self._reference = current, sampler, reference
        self._anchor = anchor
        self._lora = lora

    def current(self, x: torch.Tensor, sigma, cond: Conditioning) -> torch.Tensor:
        return predict_velocity(self.model_cfg, self._current, x, sigma, cond, self.guidance)

    def sampler(self, x: torch.Tensor, sigma, cond: Conditioning) -> torch.Tensor | None:
        """The sampling policy's velocity; None when the samples came from the trained
        weights themselves (on-policy, without a sampling copy)."""
        if self._sampler is None:
            return None
        with torch.no_grad():
            return predict_velocity(self.model_cfg, self._sampler, x, sigma, cond,
                                    self.guidance)

    def anchor(self, x: torch.Tensor, sigma, cond: Conditioning) -> torch.Tensor | None:
        """The velocity of the sampling copy of the trained version, where an older copy
        sampled the chunk (DiffusionNFT); None otherwise."""
        if self._anchor is None:
            return None
        with torch.no_grad():
            return predict_velocity(self.model_cfg, self._anchor, x, sigma, cond,
                                    self.guidance)

    def reference(self, x: torch.Tensor, sigma, cond: Conditioning) -> torch.Tensor:
        """The reference's velocity: version 0's weights, or with LoRA the base model (the
        trained module with its adapters switched off: no copy)."""
        module = self._reference if self._reference is not None else self._current
        switch = adapters_off(module) if self._reference is None and self._lora \
            else nullcontext()
        with torch.no_grad(), switch:
            return predict_velocity(self.model_cfg, module, x, sigma, cond, self.guidance)


def velocity_kl(v: torch.Tensor, v_ref: torch.Tensor) -> torch.Tensor:
    """The velocity-space KL term of each row: ``mean((v - v_ref)^2)``."""
    return mean_over_latent((v - v_ref) ** 2)


@dataclass
class MicroResult:
    """What an algorithm's micro-step computed, per trained row (a sample, or a pair):
    its loss (with gradients), KL term, and the statistics of its policy ratio."""

    loss: torch.Tensor
    valid: torch.Tensor
    kl: torch.Tensor | None = None
    ratio: torch.Tensor | None = None
    weight: torch.Tensor | None = None
    truncated: torch.Tensor | None = None
    approx_kl: torch.Tensor | None = None
    extra: dict = field(default_factory=dict)
