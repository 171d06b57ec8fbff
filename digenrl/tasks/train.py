"""Training tasks: the initial state, gradient micro-steps, the fixed-order reduction,
the AdamW step that publishes the next policy version.

Loss (Flow-GRPO, docs/algorithm.md), per sample and trained timestep, with
``logp`` under the trainer's weights and ``logp_b`` recorded at rollout:

* ``off_policy_correction = "decoupled"`` (default; AReaL's decoupled PPO objective):
  the proximal log-prob is the trainer's own, ``logp_prox = logp.detach()``;
  ``ratio = exp(logp - logp_prox)`` is clipped to ``1 +- clip_range``, and the sample is
  weighted by the truncated importance weight ``w = min(exp(logp_prox - logp_b), cap)``
  towards the behaviour policy. On-policy samples have ``w = 1`` exactly.
* ``"clip"``: Flow-GRPO's own objective, ``ratio = exp(logp - logp_b)`` clipped, no weight
  (what flow_grpo does for its second inner optimizer step, one version stale).

``loss = w * max(-A ratio, -A clip(ratio))`` plus, with ``kl_beta > 0``,
``kl_beta * mean((mean_theta - mean_ref)^2) / (2 s_t^2)`` against version 0.
Gradients are normalised by samples x trained timesteps, so the reduced sum is the
gradient of the mean loss.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from digenrl.config import ModelConfig, SamplerConfig, TrainConfig
from digenrl.metering import model_time
from digenrl.lora import Trainable, build_policy, trainable_parameters
from digenrl.models import predict_velocity
from digenrl.tasks.resident import resident
from digenrl.tasks.rollout import chunk_conditioning
from digenrl.tasks.sde import sde_step
from digenrl.tasks.types import (AdvantageOut, GradOut, IterationStats, Latents, MicroStats,
                                 PolicyWeights, StepOut, TrainerState, travels)

__all__ = ["TrainSpec", "OptimizeOut", "init_state", "publish", "iteration_stats",
           "grad", "reduce", "optimize", "adamw_update", "policy_loss"]


@dataclass(frozen=True)
class TrainSpec:
    model: ModelConfig
    sampler: SamplerConfig
    train: TrainConfig
    seed: int  # the model seed: builds version 0 and the resident transformer
    sigmas: tuple[float, ...]
    normaliser: int  # samples per iteration x trained timesteps
    trainable: Trainable = Trainable()  # all weights, or LoRA adapters (digenrl/lora.py)


@dataclass
class OptimizeOut:
    state: TrainerState
    stats: IterationStats | None


travels(OptimizeOut)  # to the checkpoint, statistics and read-back tasks


def init_state(spec: TrainSpec) -> OptimizeOut:
    """Version 0: the initial trainable weights (float32) and a zero AdamW state."""
    model = build_policy(spec.model, spec.trainable, spec.seed)
    params = {n: p.detach().clone() for n, p in trainable_parameters(model).items()}
    zeros = {n: torch.zeros_like(p) for n, p in params.items()}
    return OptimizeOut(TrainerState(version=0, params=params, exp_avg=zeros,
                                    exp_avg_sq={n: z.clone() for n, z in zeros.items()}),
                       None)


def publish(out: OptimizeOut) -> PolicyWeights:
    """The weights of the version ``out`` holds, as the rollout workers receive them."""
    return PolicyWeights(version=out.state.version, tensors=out.state.params)


def iteration_stats(out: OptimizeOut) -> IterationStats:
    assert out.stats is not None
    return out.stats


def policy_loss(logp: torch.Tensor, logp_b: torch.Tensor, adv: torch.Tensor,
                clip_range: float, correction: str, cap: float):
    """Per-sample clipped policy loss; returns (loss, ratio, weight, truncated)."""
    if correction == "decoupled":
        prox = logp.detach()
        raw_w = torch.exp(prox - logp_b)
        weight = raw_w.clamp(max=cap)
        truncated = raw_w > cap
        ratio = torch.exp(logp - prox)
    else:
        weight = torch.ones_like(logp)
        truncated = torch.zeros_like(logp, dtype=torch.bool)
        ratio = torch.exp(logp - logp_b)
    unclipped = -adv * ratio
    clipped = -adv * torch.clamp(ratio, 1.0 - clip_range, 1.0 + clip_range)
    return weight * torch.maximum(unclipped, clipped), ratio, weight, truncated


def _chunk_advantages(sample_ids, parts: tuple[AdvantageOut, ...]):
    by_id = {}
    for p in parts:
        for i, s in enumerate(p.sample_ids):
            by_id[s] = (float(p.advantages[i]), bool(p.valid[i]))
    adv = torch.tensor([by_id[s][0] for s in sample_ids], dtype=torch.float32)
    valid = torch.tensor([by_id[s][1] for s in sample_ids], dtype=torch.bool)
    return adv, valid


def grad(spec: TrainSpec, weights: PolicyWeights, reference: PolicyWeights | None,
         prompts: tuple[str, ...], t: int, before: Latents | StepOut, after: StepOut,
         *advantages: AdvantageOut) -> GradOut:
    """One micro-step: the gradient of the loss of one chunk at one timestep."""
    cfg, tc = spec.sampler, spec.train
    models = resident(spec.model, spec.seed, spec.trainable)
    dev = models.device
    model = models.policy(weights)
    x = (before.x if isinstance(before, Latents) else before.latent).to(dev)
    sigma, sigma_next = spec.sigmas[t], spec.sigmas[t + 1]
    # The conditioning arrives with the chunk's latents: trainers load no text encoder.
    cond = chunk_conditioning(prompts, after).to(dev)
    adv, valid = _chunk_advantages(after.sample_ids, advantages)
    adv, valid = adv.to(dev), valid.to(dev)
    next_latent = after.latent.to(dev)

    v = predict_velocity(spec.model, model, x, sigma, cond, cfg.guidance_scale)
    step = sde_step(x, v, sigma, sigma_next, cfg.noise_level, next_latent=next_latent)
    logp, logp_b = step.log_prob, after.log_prob.to(dev)
    per_sample, ratio, weight, truncated = policy_loss(
        logp, logp_b, adv, tc.clip_range, tc.off_policy_correction, tc.importance_weight_cap)
    kl = torch.zeros_like(per_sample)
    if tc.kl_beta > 0:
        assert reference is not None
        with torch.no_grad():
            v_ref = predict_velocity(spec.model, models.policy(reference), x, sigma, cond,
                                     cfg.guidance_scale)
            mean_ref = sde_step(x, v_ref, sigma, sigma_next, cfg.noise_level,
                                next_latent=next_latent).mean
        kl = ((step.mean - mean_ref) ** 2).mean(dim=tuple(range(1, x.ndim))) \
            / (2.0 * step.scale ** 2)
    mask = valid.to(torch.float32)
    total = ((per_sample + tc.kl_beta * kl) * mask).sum() / spec.normaliser
    params = trainable_parameters(model)
    grads = _gradients(total, params, spec.model.dtype)

    staleness = weights.version - after.version
    with torch.no_grad():
        r_b = torch.exp(logp - logp_b)[valid]
        n_valid = int(valid.sum())
        stats = MicroStats(
            count=n_valid,
            loss_sum=float(per_sample[valid].sum()),
            kl_sum=float(kl[valid].sum()),
            approx_kl_sum=float((0.5 * (logp - logp_b) ** 2)[valid].sum()),
            clipped=int(((ratio - 1.0).abs() > tc.clip_range)[valid].sum()),
            importance_weight_sum=float(weight[valid].sum()),
            truncated=int(truncated[valid].sum()),
            staleness_sum=staleness * n_valid,
        )
        if t == 0 and staleness == 0 and n_valid:
            stats.ratio_dev = float((r_b - 1.0).abs().max())
            stats.ratio_dev_count = n_valid
    return GradOut(grads=grads, stats=stats)


#: The first loss scale of a float16 backward pass, then halved until every gradient is
#: finite (see :func:`_gradients`).
FLOAT16_LOSS_SCALE = 2.0 ** 16


def _gradients(total: torch.Tensor, params: dict[str, torch.Tensor],
               dtype: str) -> dict[str, torch.Tensor]:
    """The gradients of ``total`` for ``params``, in float32 on the CPU whatever the
    forward's dtype (the trained tensors and AdamW are float32).

    A float16 forward pass is back-propagated through float16 activations, where the
    small gradients of a mean loss underflow to zero (half of a tiny model's LoRA B
    gradients at version 0). So with ``float16`` the loss is scaled by
    :data:`FLOAT16_LOSS_SCALE` (a power of two: scaling and unscaling are exact) and the
    gradients divided by the scale again; where some gradient overflowed, the same graph
    is back-propagated again at half the scale. The scale is found anew for every
    micro-step from its own inputs, so a recomputed micro-step returns the same bits
    and no scale state has to be kept or checkpointed. bfloat16 has float32's range and
    needs no scaling.
    """
    scale = FLOAT16_LOSS_SCALE if dtype == "float16" else 1.0
    while True:
        with model_time():
            raw = torch.autograd.grad(total * scale, list(params.values()),
                                      allow_unused=True, retain_graph=scale > 1.0)
        grads = {n: (g if g is not None else torch.zeros_like(p)).detach().float().cpu()
                 for (n, p), g in zip(params.items(), raw)}
        if scale == 1.0 or all(torch.isfinite(g).all() for g in grads.values()):
            break
        scale /= 2.0
    if scale != 1.0:
        grads = {n: g / scale for n, g in grads.items()}
    return grads


def reduce(*parts: GradOut) -> GradOut:
    """Sum gradients left to right in the given order (the graph fixes it), so the
    result is the same bits whichever workers computed the parts and in whatever order
    they ended, and the same as summing a prefix first and then the rest. (The first
    addition makes the new tensors; the parts are results other tasks may still read.)"""
    first = parts[0]
    if len(parts) == 1:
        return GradOut(grads={n: g.clone() for n, g in first.grads.items()}, stats=first.stats)
    second = parts[1]
    out = {n: g + second.grads[n] for n, g in first.grads.items()}
    stats = first.stats.combine(second.stats)
    for p in parts[2:]:
        for n, g in p.grads.items():
            out[n] += g
        stats = stats.combine(p.stats)
    return GradOut(grads=out, stats=stats)


def adamw_update(params, exp_avg, exp_avg_sq, grads, step: int, tc: TrainConfig):
    """Functional AdamW (as torch.optim.AdamW), returning new tensors."""
    b1, b2 = tc.adam_beta1, tc.adam_beta2
    bc1 = 1.0 - b1 ** step
    bc2_sqrt = math.sqrt(1.0 - b2 ** step)
    new_p, new_m, new_v = {}, {}, {}
    for n, p in params.items():
        g = grads[n]
        m = exp_avg[n] * b1 + g * (1.0 - b1)
        v = exp_avg_sq[n] * b2 + g * g * (1.0 - b2)
        q = p * (1.0 - tc.learning_rate * tc.weight_decay)
        denom = v.sqrt() / bc2_sqrt + tc.adam_eps
        new_p[n] = q - (tc.learning_rate / bc1) * (m / denom)
        new_m[n], new_v[n] = m, v
    return new_p, new_m, new_v


def optimize(spec: TrainSpec, previous: OptimizeOut, total: GradOut,
             iteration: int) -> OptimizeOut:
    """Clip the gradient norm, take one AdamW step, produce version + 1."""
    state = previous.state
    grads = total.grads
    norm = float(torch.linalg.vector_norm(
        torch.stack([torch.linalg.vector_norm(g) for g in grads.values()])))
    coef = min(1.0, spec.train.max_grad_norm / (norm + 1e-6))
    if coef < 1.0:
        grads = {n: g * coef for n, g in grads.items()}
    step = state.step + 1
    params, m, v = adamw_update(state.params, state.exp_avg, state.exp_avg_sq, grads, step,
                                spec.train)
    new = TrainerState(version=state.version + 1, params=params, exp_avg=m, exp_avg_sq=v,
                       step=step)
    return OptimizeOut(new, IterationStats(iteration=iteration, version=new.version,
                                           micro=total.stats, grad_norm=norm,
                                           weight_bytes=PolicyWeights(new.version, params).nbytes))
