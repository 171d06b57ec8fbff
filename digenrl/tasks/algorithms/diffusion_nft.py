"""DiffusionNFT's micro-step (arXiv 2509.16117): negative-aware fine-tuning on the
forward process (docs/algorithm.md).

For each sample, at the noise level and noise drawn for it, ``x_sigma`` and the target
``x0``: the optimality probability ``r = 1/2 + 1/2 clip(A / A_max, -1, 1)`` of its
advantage (``A_max = train.advantage_clip``); the implicit positive and negative
policies ``v+ = (1 - beta) v_old + beta v`` and ``v- = (1 + beta) v_old - beta v`` from the
sampling policy's velocity ``v_old`` (no gradient) and the current one ``v``; and the
loss ``(r ||x0+ - x0||^2 / d+ + (1 - r) ||x0- - x0||^2 / d-) / beta`` on their clean-sample
predictions ``x0+- = x_sigma - sigma v+-``, each mean squared error divided by its own mean
absolute error ``d+-`` held constant (clipped at 1e-5: the self-normalised weighting of the
reference implementation, which makes every noise level count alike).
"""

from __future__ import annotations

import torch

from digenrl.algorithms import DiffusionNFT
from digenrl.seeding import TRAIN_LEVEL_DRAW, TRAIN_NOISE_DRAW
from digenrl.tasks.algorithms.common import (MicroResult, Policies, draw_forward_process,
                                             mean_over_latent, noised, velocity_kl)

__all__ = ["ALGORITHM", "micro_step", "optimality", "nft_loss"]

ALGORITHM = DiffusionNFT

#: The smallest mean absolute error a loss is divided by.
MIN_WEIGHT = 1e-5


def optimality(adv: torch.Tensor, adv_max: float) -> torch.Tensor:
    """``r = 1/2 + 1/2 clip(A / A_max, -1, 1)``: the probability a sample is better than
    its group's (0 for the worst the clip allows, 1 for the best)."""
    return 0.5 + 0.5 * torch.clamp(adv / adv_max, -1.0, 1.0)


def _normalised_error(pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    err = pred - target
    scale = mean_over_latent(err.detach().abs()).clamp(min=MIN_WEIGHT)
    return mean_over_latent(err ** 2) / scale


def nft_loss(x_t: torch.Tensor, sigma: torch.Tensor, x0: torch.Tensor, v: torch.Tensor,
             v_old: torch.Tensor, r: torch.Tensor, beta: float) -> torch.Tensor:
    """Each row's DiffusionNFT loss (see the module's description)."""
    s = sigma.to(x_t.device, x_t.dtype).reshape((-1,) + (1,) * (x_t.ndim - 1))
    v_pos = beta * v + (1.0 - beta) * v_old
    v_neg = (1.0 + beta) * v_old - beta * v
    pos = _normalised_error(x_t - s * v_pos, x0)
    neg = _normalised_error(x_t - s * v_neg, x0)
    return (r * pos + (1.0 - r) * neg) / beta


def micro_step(spec, policies: Policies, batch, iteration: int, j: int) -> MicroResult:
    """Micro-step ``j`` of a chunk's samples (``batch``: their clean latents, ids,
    conditioning, advantages)."""
    draws = draw_forward_process(spec.draw_seed, TRAIN_LEVEL_DRAW, TRAIN_NOISE_DRAW,
                                 iteration, batch.ids, j, spec.sigmas[:-1],
                                 tuple(batch.x0.shape[1:]))
    x0 = batch.x0
    x_t = noised(x0, draws)
    sigma = draws.sigma.to(x0.device)
    v_ref = policies.reference(x_t, sigma, batch.cond) if spec.kl_beta > 0 else None
    v = policies.current(x_t, sigma, batch.cond)
    v_old = policies.sampler(x_t, sigma, batch.cond)
    assert v_old is not None    # (DiffusionNFT keeps a sampling copy)
    r = optimality(batch.adv, spec.train.advantage_clip)
    loss = nft_loss(x_t, draws.sigma, x0, v, v_old, r, spec.nft_beta)
    kl = velocity_kl(v, v_ref) if v_ref is not None else None
    return MicroResult(loss=loss, valid=batch.valid, kl=kl)
