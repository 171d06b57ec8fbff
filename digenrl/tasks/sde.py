"""The sampler step as pure functions (docs/algorithm.md): the SDE dynamics of the coupled
algorithms, each with its log-probability, and the ODE step.

Flow matching: x_sigma = (1 - sigma) x0 + sigma eps, sigma runs from 1 (noise) to 0;
the transformer predicts a velocity v. All arithmetic is float32 and stateless: given the
latent, the velocity and the two sigmas it returns the next latent, its log-probability,
the Gaussian mean and std; given a next latent it scores that latent instead of sampling.

The dynamics (``algorithm.dynamics``), with ``a = sampler.noise_level`` and
``dt = sigma_next - sigma < 0``:

* ``flow`` (Flow-GRPO): noise scale ``s = a sqrt(sigma / (1 - sigma))``;
* ``dance`` (DanceGRPO): a constant noise scale ``s = a``; both step to
  ``mean = x + v dt + (s^2 / (2 sigma)) (x + (1 - sigma) v) dt`` with
  ``std = s sqrt(-dt)``, and score with the Gaussian log-density;
* ``cps`` (coefficients-preserving sampling, FlowCPS): ``std = sigma_next sin(a pi / 2)``,
  ``mean = x0 (1 - sigma_next) + x1 sqrt(sigma_next^2 - std^2)`` with the predicted
  ``x0 = x - sigma v`` and ``x1 = x + (1 - sigma) v``, scored as FlowCPS and flow_grpo
  score it: ``-mean((next - mean)^2)``, the Gaussian log-density without its constants
  and its ``1 / (2 std^2)``;
* ``ode``: the Euler step ``x + v dt``, no log-probability.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from digenrl.algorithms import CPS, DANCE, FLOW, ODE

__all__ = ["SDEStep", "noise_scale", "sde_step", "euler_step", "gaussian_log_prob"]

_LOG_SQRT_2PI = 0.5 * math.log(2.0 * math.pi)


@dataclass(frozen=True)
class SDEStep:
    next_latent: torch.Tensor
    log_prob: torch.Tensor | None  # (batch,), mean over all other dims; None for an ODE step
    mean: torch.Tensor
    std: float    # the std of the next latent (s_t sqrt(-dt); CPS: sigma_next sin(a pi / 2))
    scale: float  # what the latent KL term divides by twice squared: s_t (CPS: its std)
    #: ``w`` of the log-probability ``-w mean((next - mean)^2) + const``: 1 / (2 std^2) for
    #: the Gaussian log-density, 1 for CPS's (GRPO-Guard's normalisation reads it).
    precision: float = 0.0
    dt: float = 0.0


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


def _squared_distance(value: torch.Tensor, mean: torch.Tensor) -> torch.Tensor:
    """``-mean((value - mean)^2)`` over all but the first dim (CPS's log-probability)."""
    lp = -((value.detach() - mean) ** 2)
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
    dynamics: str = FLOW,
) -> SDEStep:
    """One sampler step with ``dynamics`` (see the module's description).

    Pass ``noise`` (eps) to sample, or ``next_latent`` to score a given latent (it is
    treated as a constant; gradients flow through ``mean`` only). ``noise_level = 0``
    (or ``dynamics = "ode"``, or a CPS step to noise level 0, whose std is 0) is the
    Euler ODE step and has no log-probability.
    """
    if sigma_next >= sigma:
        raise ValueError(f"sigma_next: expected a value below sigma={sigma}, got {sigma_next}")
    if dynamics not in (FLOW, DANCE, CPS, ODE):
        raise ValueError(f"dynamics: expected one of {[FLOW, DANCE, CPS, ODE]}, got {dynamics!r}")
    dt = sigma_next - sigma
    if dynamics == CPS:
        std = sigma_next * math.sin(noise_level * math.pi / 2.0)
        if std == 0.0:
            mean = euler_step(x, v, sigma, sigma_next)
            return SDEStep(next_latent=mean, log_prob=None, mean=mean, std=0.0, scale=0.0, dt=dt)
        _needs_one(noise, next_latent)
        x0 = x - sigma * v
        x1 = x + (1.0 - sigma) * v
        mean = x0 * (1.0 - sigma_next) + x1 * math.sqrt(sigma_next ** 2 - std ** 2)
        if next_latent is None:
            assert noise is not None    # (_needs_one: one of the two)
            next_latent = mean.detach() + std * noise
        return SDEStep(next_latent=next_latent, log_prob=_squared_distance(next_latent, mean),
                       mean=mean, std=std, scale=std, precision=1.0, dt=dt)
    s = 0.0 if dynamics == ODE else (
        noise_level if dynamics == DANCE else noise_scale(sigma, sigma_next, noise_level))
    mean = x + v * dt + (s * s / (2.0 * sigma)) * (x + (1.0 - sigma) * v) * dt
    std = s * math.sqrt(-dt)
    if s == 0:
        return SDEStep(next_latent=mean, log_prob=None, mean=mean, std=0.0, scale=0.0, dt=dt)
    _needs_one(noise, next_latent)
    if next_latent is None:
        assert noise is not None        # (_needs_one: one of the two)
        next_latent = mean.detach() + std * noise
    return SDEStep(next_latent=next_latent, log_prob=gaussian_log_prob(next_latent, mean, std),
                   mean=mean, std=std, scale=s, precision=1.0 / (2.0 * std * std), dt=dt)


def _needs_one(noise: torch.Tensor | None, next_latent: torch.Tensor | None) -> None:
    if (noise is None) == (next_latent is None):
        raise ValueError("sde_step: pass exactly one of noise= (to sample) or "
                         "next_latent= (to score)")
