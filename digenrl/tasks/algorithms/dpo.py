"""Online Diffusion-DPO's micro-step (arXiv 2311.12908), with the flow-matching error in
place of the noise-prediction error (docs/algorithm.md).

Each prompt group with two valid samples of different advantage gives a pair: its best
sample (the winner ``w``) and its worst (the loser ``l``). Both are noised with the same
noise level and noise, drawn for the group; with ``err = mean((v - u)^2)`` of the current
velocity and ``err_ref`` of the frozen reference's, the pair's loss is
``-log sigmoid(-beta / 2 ((err_w - err_ref_w) - (err_l - err_ref_l)))``, the paper's
``T omega(lambda_t)`` folded into ``beta = algorithm.dpo_beta``.
"""

from __future__ import annotations

import numpy as np
import torch

from digenrl.algorithms import OnlineDPO
from digenrl.seeding import PAIR_LEVEL_DRAW, PAIR_NOISE_DRAW
from digenrl.tasks.algorithms.common import (MicroResult, Policies, draw_forward_process,
                                             mean_over_latent, noised, rows_of, velocity_kl)

__all__ = ["ALGORITHM", "micro_step", "pairs", "dpo_loss"]

ALGORITHM = OnlineDPO


def pairs(parts) -> list[tuple[int, int, int]]:
    """``(group, winner, loser)`` sample ids of each group in ``parts`` (its
    :class:`~digenrl.tasks.types.AdvantageOut`): its highest and lowest advantage among
    its valid samples; none where fewer than two are valid or all are alike."""
    out = []
    for p in parts:
        valid = np.flatnonzero(np.asarray(p.valid, bool))
        if len(valid) < 2:
            continue
        adv = np.asarray(p.advantages, np.float64)[valid]
        best, worst = valid[int(np.argmax(adv))], valid[int(np.argmin(adv))]
        if adv.max() > adv.min():
            out.append((p.group, p.sample_ids[best], p.sample_ids[worst]))
    return out


def dpo_loss(err_w: torch.Tensor, ref_w: torch.Tensor, err_l: torch.Tensor,
             ref_l: torch.Tensor, beta: float) -> torch.Tensor:
    """``-log sigmoid(-beta / 2 ((err_w - ref_w) - (err_l - ref_l)))`` per pair."""
    return torch.nn.functional.softplus(0.5 * beta * ((err_w - ref_w) - (err_l - ref_l)))


def micro_step(spec, policies: Policies, batch, iteration: int, j: int) -> MicroResult:
    found = pairs(batch.parts)
    if not found:
        empty = batch.x0.new_zeros(0)
        return MicroResult(loss=empty, valid=torch.zeros(0, dtype=torch.bool,
                                                        device=batch.x0.device))
    row = {s: k for k, s in enumerate(batch.ids)}
    groups = [g for g, _, _ in found]
    rows = [row[w] for _, w, _ in found] + [row[lo] for _, _, lo in found]
    draws = draw_forward_process(spec.draw_seed, PAIR_LEVEL_DRAW, PAIR_NOISE_DRAW,
                                 iteration, groups, j, spec.sigmas[:-1],
                                 tuple(batch.x0.shape[1:]))
    both = type(draws)(torch.cat([draws.sigma, draws.sigma]),
                       torch.cat([draws.noise, draws.noise]))
    x0 = batch.x0[rows]
    x_t = noised(x0, both)
    target = both.noise.to(x0.device) - x0
    sigma = both.sigma.to(x0.device)
    cond = rows_of(batch.cond, rows)
    v_ref = policies.reference(x_t, sigma, cond)
    v = policies.current(x_t, sigma, cond)
    err = mean_over_latent((v - target) ** 2)
    err_ref = mean_over_latent((v_ref - target) ** 2)
    n = len(found)
    loss = dpo_loss(err[:n], err_ref[:n], err[n:], err_ref[n:], spec.dpo_beta)
    kl = None
    if spec.kl_beta > 0:
        per_row = velocity_kl(v, v_ref)
        kl = 0.5 * (per_row[:n] + per_row[n:])
    return MicroResult(loss=loss, valid=torch.ones(n, dtype=torch.bool, device=x0.device),
                       kl=kl, extra={"margin": (err_ref - err).detach()})
