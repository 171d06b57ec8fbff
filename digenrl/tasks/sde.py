"""The Flow-GRPO sampler step as pure functions (docs/algorithm.md).

Flow matching: x_sigma = (1 - sigma) x0 + sigma eps, sigma runs from 1 (noise) to 0;
the transformer predicts a velocity v. All arithmetic is float32 and stateless: given the
latent, the velocity and the two sigmas it returns the next latent, its log-probability,
the Gaussian mean and std; given a next latent it scores that latent instead of sampling.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = ["SDEStep", "noise_scale", "sde_step", "euler_step", "gaussian_log_prob"]

_LOG_SQRT_2PI = 0.5 * math.log(2.0 * math.pi)


@dataclass(frozen=True)
class SDEStep:
    next_latent: torch.Tensor
    log_prob: torch.Tensor | None  # (batch,), mean over all other dims; None for a = 0
    mean: torch.Tensor
    std: float    # s_t * sqrt(-dt), the std of the next latent
    scale: float  # s_t, the noise scale (the KL term divides by 2 s_t^2)


def noise_scale(sigma: float, sigma_next: float, noise_level: float) -> float:
    """s_t = a * sqrt(sigma / (1 - sigma)); at sigma = 1 the next sigma is used below."""
    denom = 1.0 - (sigma_next if sigma >= 1.0 else sigma)
    return noise_level * math.sqrt(sigma / denom)


def euler_step(x: torch.Tensor, v: torch.Tensor, sigma: float, sigma_next: float) -> torch.Tensor:
    """The plain flow-matching ODE (Euler) step: x + v * dt."""
    return x + v * (sigma_next - sigma)


def gaussian_log_prob(value: torch.Tensor, mean: torch.Tensor, std: float) -> torch.Tensor:
    """Log-density of ``value`` under N(mean, std^2), averaged over all but the first dim."""
    lp = -((value.detach() - mean) ** 2) / (2.0 * std * std) - math.log(std) - _LOG_SQRT_2PI
    return lp.mean(dim=tuple(range(1, lp.ndim)))


def sde_step(
    x: torch.Tensor,
    v: torch.Tensor,
    sigma: float,
    sigma_next: float,
    noise_level: float,
    *,
    noise: torch.Tensor | None = None,
    next_latent: torch.Tensor | None = None,
) -> SDEStep:
    """One Flow-GRPO SDE step.

    mean = x + v dt + (s_t^2 / (2 sigma)) (x + (1 - sigma) v) dt,
    next = mean + s_t sqrt(-dt) eps,   dt = sigma_next - sigma < 0.

    Pass ``noise`` (eps) to sample, or ``next_latent`` to score a given latent (it is
    treated as a constant; gradients flow through ``mean`` only). ``noise_level = 0``
    is the Euler ODE step and has no log-probability.
    """
    if sigma_next >= sigma:
        raise ValueError(f"sigma_next: expected a value below sigma={sigma}, got {sigma_next}")
    if (noise is None) == (next_latent is None) and noise_level > 0:
        raise ValueError("sde_step: pass exactly one of noise= (to sample) or "
                         "next_latent= (to score)")
    dt = sigma_next - sigma
    s = noise_scale(sigma, sigma_next, noise_level)
    mean = x + v * dt + (s * s / (2.0 * sigma)) * (x + (1.0 - sigma) * v) * dt
    std = s * math.sqrt(-dt)
    if noise_level == 0:
        return SDEStep(next_latent=mean, log_prob=None, mean=mean, std=0.0, scale=0.0)
    if next_latent is None:
        next_latent = mean.detach() + std * noise
    return SDEStep(next_latent=next_latent, log_prob=gaussian_log_prob(next_latent, mean, std),
                   mean=mean, std=std, scale=s)
