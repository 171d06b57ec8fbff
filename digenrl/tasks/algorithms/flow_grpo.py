"""Flow-GRPO's micro-step (the coupled family): the trained step scored again under the
current weights, the clipped policy ratio against the log-probability recorded at
rollout, and the KL term (docs/algorithm.md).

With ``algorithm.guard`` (GRPO-Guard, arXiv 2510.22319) every log-ratio of the step is
formed as ``(logp_a - logp_b + w mean((mean_a - mean_b)^2)) / (2 w std)``, ``w`` the
log-probability's precision (``1 / (2 std^2)`` for the Gaussian log-density: the paper's
``(log p_a - log p_b + ||mean_a - mean_b||^2 / (2 std^2)) std``), which removes the
ratio's mean shift below 1 and gives every step the same spread, and the step's loss is
weighted by ``1 / |dt|``.
"""

from __future__ import annotations

import torch

from digenrl.algorithms import LATENT, FlowGRPO
from digenrl.tasks.algorithms.common import (MicroResult, Policies, mean_over_latent,
                                             policy_loss, velocity_kl)
from digenrl.tasks.sde import sde_step
from digenrl.tasks.types import StepOut

__all__ = ["ALGORITHM", "micro_step", "guard_log_ratio"]

ALGORITHM = FlowGRPO


def guard_log_ratio(logp_a: torch.Tensor, logp_b: torch.Tensor, mean_a: torch.Tensor,
                    mean_b: torch.Tensor, precision: float, std: float) -> torch.Tensor:
    """GRPO-Guard's normalised log-ratio of policy a to policy b at one step: the plain
    log-ratio plus its expected shift, ``w mean((mean_a - mean_b)^2)``, scaled by
    ``1 / (2 w std)`` (``w``: the log-probability's precision)."""
    mse = mean_over_latent((mean_a - mean_b) ** 2)
    return (logp_a - logp_b + precision * mse) / (2.0 * precision * std)


def micro_step(spec, policies: Policies, x: torch.Tensor, cond, sigma: float,
               sigma_next: float, after: StepOut, adv: torch.Tensor, valid: torch.Tensor,
               v_ref: torch.Tensor | None) -> MicroResult:
    """The loss of one chunk at one trained step ``sigma -> sigma_next``: ``after`` is the
    step as sampled (its latent, log-probability and, for GRPO-Guard, mean), ``v_ref`` the
    reference's velocity at ``x`` (None without a KL term)."""
    tc, alg = spec.train, spec.algorithm
    dev = x.device
    next_latent = after.latent.to(dev)
    v = policies.current(x, sigma, cond)
    step = sde_step(x, v, sigma, sigma_next, spec.sampler.noise_level,
                    next_latent=next_latent, dynamics=alg.dynamics)
    # (A trained step is an SDE step: it has log-probabilities, and its mean with guard.)
    assert step.log_prob is not None and after.log_prob is not None
    logp, logp_b = step.log_prob, after.log_prob.to(dev)
    ratio_log = weight_log = None
    if spec.guard:
        assert after.mean is not None
        mean_b = after.mean.to(dev)

        def norm(a, b, mean_a, mean_b_):
            return guard_log_ratio(a, b, mean_a, mean_b_, step.precision, step.std)

        held = step.mean.detach()
        if tc.off_policy_correction == "decoupled":
            ratio_log = norm(logp, logp.detach(), step.mean, held)
            weight_log = norm(logp.detach(), logp_b, held, mean_b)
        else:
            ratio_log = norm(logp, logp_b, step.mean, mean_b)
    per_sample, ratio, weight, truncated = policy_loss(
        logp, logp_b, adv, tc.clip_range, tc.off_policy_correction, tc.importance_weight_cap,
        ratio_log=ratio_log, weight_log=weight_log)
    if spec.guard:
        per_sample = per_sample / abs(step.dt)
    kl = None
    if v_ref is not None:
        if spec.kl_space == LATENT:
            mean_ref = sde_step(x, v_ref, sigma, sigma_next, spec.sampler.noise_level,
                                next_latent=next_latent, dynamics=alg.dynamics).mean
            kl = mean_over_latent((step.mean - mean_ref) ** 2) / (2.0 * step.scale ** 2)
        else:
            kl = velocity_kl(v, v_ref)
    return MicroResult(loss=per_sample, valid=valid, kl=kl, ratio=ratio, weight=weight,
                       truncated=truncated,
                       approx_kl=(0.5 * (logp - logp_b) ** 2).detach(),
                       extra={"log_ratio": (logp - logp_b).detach()})
