"""Training tasks: the initial state, gradient micro-steps, the fixed-order reduction,
the AdamW step that publishes the next policy version.

A micro-step's loss is its algorithm's (:mod:`digenrl.tasks.algorithms`, found by the
name of ``spec.algorithm``): :func:`grad` runs the coupled family's (Flow-GRPO: a chunk at
one trained step of its trajectory, scored again under the current weights; the clipped
policy loss with the off-policy correction below), :func:`matching_grad` a decoupled
one's (DiffusionNFT, AWM, online DPO: a chunk's clean latents noised at freshly drawn
noise levels). Flow-GRPO's loss (docs/algorithm.md), per sample and trained timestep,
with ``logp`` under the trainer's weights and ``logp_b`` recorded at rollout:

* ``off_policy_correction = "decoupled"`` (default; AReaL's decoupled PPO objective):
  the proximal log-prob is the trainer's own, ``logp_prox = logp.detach()``;
  ``ratio = exp(logp - logp_prox)`` is clipped to ``1 +- clip_range``, and the sample is
  weighted by the truncated importance weight ``w = min(exp(logp_prox - logp_b), cap)``
  towards the behaviour policy. On-policy samples have ``w = 1`` exactly.
* ``"clip"``: Flow-GRPO's own objective, ``ratio = exp(logp - logp_b)`` clipped, no weight
  (what flow_grpo does for its second inner optimizer step, one version stale).

``loss = w * max(-A ratio, -A clip(ratio))`` plus, with ``kl_beta > 0``,
``kl_beta * mean((mean_theta - mean_ref)^2) / (2 s_t^2)`` against the reference (or the
velocity-space ``kl_beta * mean((v - v_ref)^2)``). Gradients are normalised by the
iteration's trained rows (samples, or pairs) x micro-steps, so the reduced sum is the
gradient of the mean loss.

A policy version of an algorithm with a sampling copy (DiffusionNFT) keeps the copy in its
trainer state beside the trained weights: :func:`publish` gives the rollouts the copy,
:func:`trained` the micro-steps the weights, and :func:`optimize` moves the copy towards
the new weights after each step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Mapping

import torch

from digenrl.algorithms import Algorithm, FlowGRPO
from digenrl.config import AlgorithmConfig, ModelConfig, SamplerConfig, TrainConfig
from digenrl.metering import model_time
from digenrl.models.lora import Trainable, build_policy, trainable_parameters
from digenrl.models import Conditioning
from digenrl.tasks.algorithms import math_of
from digenrl.tasks.algorithms.common import MicroResult, Policies, policy_loss
from digenrl.tasks.resident import resident
from digenrl.tasks.rollout import chunk_conditioning
from digenrl.tasks.types import (AdvantageOut, GradOut, IterationStats, Latents, MicroStats,
                                 PolicyWeights, StepOut, TrainerState, travels)

__all__ = ["TrainSpec", "OptimizeOut", "init_state", "publish", "trained", "iteration_stats",
           "grad", "matching_grad", "coupled_result", "decoupled_result", "micro_loss",
           "reduce", "optimize", "adamw_update", "grad_norm_clip", "policy_loss",
           "sampling_copy_update"]


@dataclass(frozen=True)
class TrainSpec:
    model: ModelConfig
    sampler: SamplerConfig
    train: TrainConfig
    seed: int  # the model seed: builds version 0 and the resident transformer
    sigmas: tuple[float, ...]
    normaliser: int  # trained rows (samples, or pairs) per iteration x micro-steps per chunk
    trainable: Trainable = Trainable()  # all weights, or LoRA adapters (digenrl/models/lora.py)
    #: The algorithm's shape (None: Flow-GRPO with the sampler's trained steps) and its
    #: settings.
    shape: Algorithm | None = None
    settings: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    draw_seed: int = 0  # the run seed: a decoupled micro-step's draws

    @property
    def algorithm(self) -> Algorithm:
        if self.shape is not None:
            return self.shape
        return FlowGRPO(num_steps=self.sampler.num_steps,
                        trained_steps=self.sampler.trained_steps)

    @property
    def guard(self) -> bool:
        return self.settings.guard

    @property
    def kl_space(self) -> str:
        return self.settings.kl

    @property
    def kl_beta(self) -> float:
        return self.train.kl_beta

    @property
    def nft_beta(self) -> float:
        return self.settings.nft_beta

    @property
    def dpo_beta(self) -> float:
        return self.settings.dpo_beta


@dataclass
class OptimizeOut:
    state: TrainerState
    stats: IterationStats | None


travels(OptimizeOut)  # to the checkpoint, statistics and read-back tasks


def init_state(spec: TrainSpec) -> OptimizeOut:
    """Version 0: the initial trainable weights (float32) and a zero AdamW state (and,
    for an algorithm with a sampling copy, the copy: the same weights)."""
    model = build_policy(spec.model, spec.trainable, spec.seed)
    params = {n: p.detach().clone() for n, p in trainable_parameters(model).items()}
    zeros = {n: torch.zeros_like(p) for n, p in params.items()}
    sampling = ({n: p.clone() for n, p in params.items()}
                if spec.algorithm.sampling_copy else None)
    return OptimizeOut(TrainerState(version=0, params=params, exp_avg=zeros,
                                    exp_avg_sq={n: z.clone() for n, z in zeros.items()},
                                    sampling=sampling),
                       None)


def publish(out: OptimizeOut) -> PolicyWeights:
    """The weights of the version ``out`` holds, as the rollout workers receive them: its
    sampling copy where it keeps one, else the trained weights."""
    state = out.state
    if state.sampling is not None:
        return PolicyWeights(version=state.version, tensors=state.sampling, sampling_copy=True)
    return PolicyWeights(version=state.version, tensors=state.params)


def trained(out: OptimizeOut) -> PolicyWeights:
    """The trained weights of the version ``out`` holds (what its iteration's micro-steps
    differentiate, where they are not what the version publishes)."""
    return PolicyWeights(version=out.state.version, tensors=out.state.params)


def iteration_stats(out: OptimizeOut) -> IterationStats:
    assert out.stats is not None
    return out.stats


def _chunk_advantages(sample_ids, parts: tuple[AdvantageOut, ...]):
    by_id = {}
    for p in parts:
        for i, s in enumerate(p.sample_ids):
            by_id[s] = (float(p.advantages[i]), bool(p.valid[i]))
    adv = torch.tensor([by_id[s][0] for s in sample_ids], dtype=torch.float32)
    valid = torch.tensor([by_id[s][1] for s in sample_ids], dtype=torch.bool)
    return adv, valid


def _policies(spec: TrainSpec, models, model: torch.nn.Module,
              sampling: PolicyWeights | None, reference: PolicyWeights | None,
              anchor: PolicyWeights | None = None) -> Policies:
    return Policies(spec.model, spec.sampler.guidance_scale, model,
                    models.policy(sampling) if sampling is not None else None,
                    models.policy(reference) if reference is not None else None,
                    spec.trainable.lora,
                    models.policy(anchor) if anchor is not None else None)


def grad(spec: TrainSpec, weights: PolicyWeights, reference: PolicyWeights | None,
         prompts: tuple[str, ...], t: int, before: Latents | StepOut, after: StepOut,
         *advantages: AdvantageOut) -> GradOut:
    """One micro-step of the coupled family: the gradient of the loss of one chunk at
    one trained timestep (:mod:`digenrl.tasks.algorithms.flow_grpo`)."""
    models = resident(spec.model, spec.seed, spec.trainable)
    model = models.policy(weights)
    policies = _policies(spec, models, model, None, reference)
    result = coupled_result(spec, policies, models.device, prompts, t, before, after,
                            advantages)
    return _grad_out(spec, model, result, weights.version - after.version)


def coupled_result(spec: TrainSpec, policies: Policies, dev: torch.device,
                   prompts: tuple[str, ...], t: int, before: Latents | StepOut,
                   after: StepOut, advantages: tuple[AdvantageOut, ...]) -> MicroResult:
    """What a coupled micro-step computes of one chunk at trained step ``t`` with
    ``policies`` (on ``dev``): its rows' losses, with gradients to the trained module."""
    x = (before.x if isinstance(before, Latents) else before.latent).to(dev)
    sigma, sigma_next = spec.sigmas[t], spec.sigmas[t + 1]
    # The conditioning arrives with the chunk's latents: trainers load no text encoder.
    cond = chunk_conditioning(prompts, after).to(dev)
    adv, valid = _chunk_advantages(after.sample_ids, advantages)
    adv, valid = adv.to(dev), valid.to(dev)
    # The reference first: with LoRA it is this module with its adapters switched off.
    v_ref = policies.reference(x, sigma, cond) if spec.kl_beta > 0 else None
    return math_of(spec.algorithm).micro_step(spec, policies, x, cond, sigma, sigma_next,
                                              after, adv, valid, v_ref)


def matching_grad(spec: TrainSpec, weights: PolicyWeights, sampling: PolicyWeights | None,
                  anchor: PolicyWeights | None, reference: PolicyWeights | None,
                  prompts: tuple[str, ...], iteration: int, j: int,
                  *inputs: StepOut | AdvantageOut) -> GradOut:
    """Micro-step ``j`` of a decoupled algorithm on the final latents of the chunks in
    ``inputs`` (their ``StepOut``), with their groups' advantages (the ``AdvantageOut``
    in ``inputs``). ``weights``: the trained weights; ``sampling``: the weights the chunks
    were sampled with, where the algorithm reads them and they are other weights;
    ``anchor``: DiffusionNFT's sampling copy of the trained version, where an older copy
    sampled the chunks (None otherwise);
    ``reference``: version 0's, where the micro-step reads a frozen reference (None with
    LoRA: the base model)."""
    models = resident(spec.model, spec.seed, spec.trainable)
    model = models.policy(weights)
    policies = _policies(spec, models, model, sampling, reference, anchor)
    result, behaviour = decoupled_result(spec, policies, models.device, prompts, iteration,
                                         j, inputs)
    return _grad_out(spec, model, result, weights.version - behaviour)


def decoupled_result(spec: TrainSpec, policies: Policies, dev: torch.device,
                     prompts: tuple[str, ...], iteration: int, j: int,
                     inputs: tuple[StepOut | AdvantageOut, ...]) -> tuple[MicroResult, int]:
    """What decoupled micro-step ``j`` computes of the chunks in ``inputs`` with
    ``policies`` (on ``dev``): its rows' losses, with gradients to the trained module, and
    the oldest version that sampled them."""
    finals = [p for p in inputs if isinstance(p, StepOut)]
    parts = tuple(p for p in inputs if isinstance(p, AdvantageOut))
    batch = _Batch.of(prompts, finals, parts, dev)
    result = math_of(spec.algorithm).micro_step(spec, policies, batch, iteration, j)
    return result, min(f.version for f in finals)


@dataclass
class _Batch:
    """A decoupled micro-step's samples: their ids, clean (final) latents, conditioning,
    advantages and whether each is valid, and the advantage parts themselves."""

    ids: tuple[int, ...]
    x0: torch.Tensor
    cond: Conditioning
    adv: torch.Tensor
    valid: torch.Tensor
    parts: tuple[AdvantageOut, ...]

    @classmethod
    def of(cls, prompts, finals: list[StepOut], parts: tuple[AdvantageOut, ...], dev):
        ids = tuple(s for f in finals for s in f.sample_ids)
        conds = [f.cond for f in finals if f.cond is not None]
        assert len(conds) == len(finals) and \
            tuple(p for c in conds for p in c.prompts) == tuple(prompts), \
            "a chunk's conditioning must come from its noise task, for its prompts"
        cond = Conditioning.concat(conds)
        adv, valid = _chunk_advantages(ids, parts)
        x0 = torch.cat([f.latent for f in finals]).to(dev)
        return cls(ids, x0, cond.to(dev), adv.to(dev), valid.to(dev), parts)


def _grad_out(spec: TrainSpec, model: torch.nn.Module, r: MicroResult,
              staleness: int) -> GradOut:
    """The gradient of a micro-step's summed loss (over its valid rows, normalised) and
    its statistics."""
    total, stats = micro_loss(spec, r, staleness)
    grads = _gradients(total, trainable_parameters(model), spec.model.dtype)
    return GradOut(grads=grads, stats=stats)


def micro_loss(spec: TrainSpec, r: MicroResult,
               staleness: int) -> tuple[torch.Tensor, MicroStats]:
    """A micro-step's summed loss over its valid rows, normalised by the iteration's
    trained rows x micro-steps (the tensor differentiated, by ``torch.autograd.grad``
    here and by ``backward`` in the sharded step, :mod:`digenrl.tasks.sharding`), and its
    statistics."""
    tc = spec.train
    kl = r.kl if r.kl is not None else torch.zeros_like(r.loss)
    mask = r.valid.to(torch.float32)
    total = ((r.loss + tc.kl_beta * kl) * mask).sum() / spec.normaliser
    valid = r.valid
    with torch.no_grad():
        n_valid = int(valid.sum())
        stats = MicroStats(count=n_valid, loss_sum=float(r.loss[valid].sum()),
                           kl_sum=float(kl[valid].sum()), staleness_sum=staleness * n_valid)
        if r.weight is not None:
            stats.importance_weight_sum = float(r.weight[valid].sum())
            assert r.truncated is not None      # (given with the weight)
            stats.truncated = int(r.truncated[valid].sum())
        else:  # no policy ratio: every row counts with weight 1
            stats.importance_weight_sum = float(n_valid)
        if r.approx_kl is not None:
            stats.approx_kl_sum = float(r.approx_kl[valid].sum())
        if r.ratio is not None:
            stats.clipped = int(((r.ratio - 1.0).abs() > tc.clip_range)[valid].sum())
        log_ratio = r.extra.get("log_ratio")
        if log_ratio is not None and staleness == 0 and n_valid:
            # On-policy: the rollout and the trainer scored the same step with the same
            # weights, so the ratio is exactly 1.
            stats.ratio_dev = float((torch.exp(log_ratio) - 1.0)[valid].abs().max())
            stats.ratio_dev_count = n_valid
    return total, stats


#: The first loss scale of a float16 backward pass, then halved until every gradient is
#: finite (see :func:`_gradients`).
FLOAT16_LOSS_SCALE = 2.0 ** 16


def _gradients(total: torch.Tensor, params: Mapping[str, torch.Tensor],
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


def grad_norm_clip(norm: float, tc: TrainConfig) -> float:
    """The factor the gradients are multiplied by for a global norm ``norm``: at most 1,
    so that the clipped norm is at most ``train.max_grad_norm``."""
    return min(1.0, tc.max_grad_norm / (norm + 1e-6))


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
    """Clip the gradient norm, take one AdamW step, produce version + 1 (and move a
    sampling copy: ``copy = eta_i copy + (1 - eta_i) params``, DiffusionNFT's schedule
    ``eta_i = min(algorithm.ema_ramp x i, algorithm.ema_max)``)."""
    state = previous.state
    grads = total.grads
    norm = float(torch.linalg.vector_norm(
        torch.stack([torch.linalg.vector_norm(g) for g in grads.values()])))
    coef = grad_norm_clip(norm, spec.train)
    if coef < 1.0:
        grads = {n: g * coef for n, g in grads.items()}
    step = state.step + 1
    params, m, v = adamw_update(state.params, state.exp_avg, state.exp_avg_sq, grads, step,
                                spec.train)
    sampling = None
    if state.sampling is not None:
        sampling = sampling_copy_update(state.sampling, params,
                                        spec.settings.sampling_copy_decay(iteration))
    new = TrainerState(version=state.version + 1, params=params, exp_avg=m, exp_avg_sq=v,
                       step=step, sampling=sampling)
    published = sampling if sampling is not None else params
    return OptimizeOut(new, IterationStats(iteration=iteration, version=new.version,
                                           micro=total.stats, grad_norm=norm,
                                           weight_bytes=PolicyWeights(new.version,
                                                                      published).nbytes))


def sampling_copy_update(copy: dict[str, torch.Tensor], params: dict[str, torch.Tensor],
                         eta: float) -> dict[str, torch.Tensor]:
    """``eta copy + (1 - eta) params``, new tensors."""
    return {n: eta * c + (1.0 - eta) * params[n] for n, c in copy.items()}
