"""AWM's micro-step (advantage-weighted matching, arXiv 2509.25050): the policy gradient of
the coupled family with the flow-matching error as the log-likelihood (docs/algorithm.md).

For each sample, at the noise level and noise drawn for it: ``logp = -mean((v - u)^2)``
with the current velocity ``v`` and the target ``u = eps - x0``; the behaviour's,
``logp_b``, is the same with the velocity of the policy that sampled the chunk (on-policy
samples: ``logp`` itself, held constant), and the loss is the clipped policy loss of
:func:`~digenrl.tasks.algorithms.common.policy_loss` with the run's off-policy
correction: on-policy its gradient is ``A grad mean((v - u)^2)``, the flow-matching
gradient weighted by the advantage.
"""

from __future__ import annotations

import torch

from digenrl.algorithms import AWM
from digenrl.seeding import TRAIN_LEVEL_DRAW, TRAIN_NOISE_DRAW
from digenrl.tasks.algorithms.common import (MicroResult, Policies, draw_forward_process,
                                             mean_over_latent, noised, policy_loss,
                                             velocity_kl)

__all__ = ["ALGORITHM", "micro_step", "matching_log_prob"]

ALGORITHM = AWM


def matching_log_prob(v: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """``-mean((v - target)^2)`` of each row: the flow-matching log-likelihood stand-in."""
    return -mean_over_latent((v - target) ** 2)


def micro_step(spec, policies: Policies, batch, iteration: int, j: int) -> MicroResult:
    tc = spec.train
    draws = draw_forward_process(spec.draw_seed, TRAIN_LEVEL_DRAW, TRAIN_NOISE_DRAW,
                                 iteration, batch.ids, j, spec.sigmas[:-1],
                                 tuple(batch.x0.shape[1:]))
    x0 = batch.x0
    x_t = noised(x0, draws)
    target = draws.noise.to(x0.device) - x0
    sigma = draws.sigma.to(x0.device)
    v_ref = policies.reference(x_t, sigma, batch.cond) if spec.kl_beta > 0 else None
    v = policies.current(x_t, sigma, batch.cond)
    logp = matching_log_prob(v, target)
    v_b = policies.sampler(x_t, sigma, batch.cond)
    logp_b = logp.detach() if v_b is None else matching_log_prob(v_b, target)
    loss, ratio, weight, truncated = policy_loss(
        logp, logp_b, batch.adv, tc.clip_range, tc.off_policy_correction,
        tc.importance_weight_cap)
    kl = velocity_kl(v, v_ref) if v_ref is not None else None
    return MicroResult(loss=loss, valid=batch.valid, kl=kl, ratio=ratio, weight=weight,
                       truncated=truncated,
                       approx_kl=(0.5 * (logp - logp_b) ** 2).detach())
