"""Rollout tasks: a prompt group's conditioning, a chunk's starting noise, one denoising
step of a chunk, decoding.

Random draws are per sample: sample ``s`` of iteration ``i`` draws its starting noise
from ``(seed, "noise", i, s)`` and its step-``t`` SDE noise from ``(seed, "sde", i, s, t)``
(an ODE step draws nothing); held-out prompt ``j`` starts every evaluation from
``(seed, "eval-noise", j)``. How samples are chunked into tasks, or which worker runs a
task, never changes a draw. Which steps are SDE steps, and their dynamics, is the
algorithm's (:mod:`digenrl.algorithms`): every step with Flow-GRPO's SDE by default, an
SDE window's steps, or none for a decoupled algorithm.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from digenrl.algorithms import Algorithm, FlowGRPO
from digenrl.config import ModelConfig, SamplerConfig
from digenrl.models.lora import Trainable
from digenrl.models import Conditioning, decode_latents, latent_shape, predict_velocity
from digenrl.prompts import PromptInputs
from digenrl.seeding import EVAL_NOISE_DRAW, GROUP_NOISE_DRAW, NOISE_DRAW, SDE_DRAW, stable_seed
from digenrl.tasks.footprint import measured_step
from digenrl.tasks.resident import resident
from digenrl.tasks.sde import euler_step, sde_step
from digenrl.tasks.slowdown import stretch
from digenrl.tasks.types import DecodeOut, Latents, PolicyWeights, StepOut

__all__ = ["RolloutSpec", "draw_normal", "encode", "noise", "encoded_noise", "denoise", "decode", "evaluate"]


@dataclass(frozen=True)
class RolloutSpec:
    """Static per run; small enough to travel inside every rollout task."""

    model: ModelConfig
    sampler: SamplerConfig
    seed: int          # the run seed: every random draw of the sampler
    model_seed: int    # builds the resident VAE (and the transformer before weights load)
    sigmas: tuple[float, ...]
    samples_per_prompt: int
    same_noise_in_group: bool = False
    save_latents: bool = False
    trainable: Trainable = Trainable()  # what of the transformer a version carries
    #: The algorithm's shape (None: Flow-GRPO, every step an SDE step).
    shape: Algorithm | None = None
    #: Keep each SDE step's mean in its result (GRPO-Guard's training reads it).
    keep_means: bool = False

    @property
    def algorithm(self) -> Algorithm:
        if self.shape is not None:
            return self.shape
        return FlowGRPO(num_steps=len(self.sigmas) - 1,
                        trained_steps=self.sampler.trained_steps)


def draw_normal(shape: tuple[int, ...], *parts) -> torch.Tensor:
    g = torch.Generator().manual_seed(stable_seed(*parts))
    return torch.randn(shape, generator=g, dtype=torch.float32)


def encode(spec: RolloutSpec, prompt: str, inputs: PromptInputs | None = None
           ) -> Conditioning:
    """A prompt group's conditioning: its prompt through this worker's text encoders
    (and its negative prompt with guidance), on the CPU. ``inputs``: what else its
    prompt-file line gives the group (an editing family's source image, its own negative
    prompt), or None. The encoder's cache keeps each prompt (with its source image) it
    encoded, so a prompt this worker has seen costs nothing."""
    return resident(spec.model, spec.model_seed, spec.trainable).conditioning(
        (prompt,), spec.sampler.guidance_scale, (inputs,) if inputs else ())


def noise(spec: RolloutSpec, iteration: int, sample_ids: tuple[int, ...],
          prompts: tuple[str, ...], picks: tuple[int, ...], *groups: Conditioning) -> Latents:
    """x_0 for each sample: pure noise (shared within a group if asked), and the
    conditioning of each sample's prompt: sample ``k`` has the one of ``groups[picks[k]]``
    (``groups``: the conditioning of each prompt group the chunk's samples belong to, in
    order, from their ``encode`` tasks)."""
    shape = latent_shape(spec.model)
    rows = []
    for s in sample_ids:
        ident = s // spec.samples_per_prompt if spec.same_noise_in_group else s
        what = GROUP_NOISE_DRAW if spec.same_noise_in_group else NOISE_DRAW
        rows.append(draw_normal(shape, spec.seed, what, iteration, ident))
    assert len(picks) == len(prompts) and all(
        groups[j].prompts == (p,) for j, p in zip(picks, prompts)), \
        "a chunk's noise task reads the conditioning of each of its groups, in order"
    cond = Conditioning.of_groups(groups, picks)
    return Latents(sample_ids=tuple(sample_ids), x=torch.stack(rows), cond=cond)


def encoded_noise(spec: RolloutSpec, iteration: int, sample_ids: tuple[int, ...],
                  prompts: tuple[str, ...]) -> Latents:
    """What a chunk's ``encode`` tasks and its ``noise`` task compute, one after the
    other in this process (each distinct prompt taken as a group): for tools and tests
    that sample outside a graph."""
    distinct = list(dict.fromkeys(prompts))
    groups = [encode(spec, p) for p in distinct]
    return noise(spec, iteration, sample_ids, prompts,
                 tuple(distinct.index(p) for p in prompts), *groups)


def chunk_conditioning(prompts: tuple[str, ...], data: Latents | StepOut):
    """The conditioning a chunk's data carries, checked against the task's prompts."""
    cond = data.cond
    assert cond is not None and cond.prompts == tuple(prompts), \
        "a chunk's conditioning must come from its noise task, for its prompts"
    return cond


def denoise(spec: RolloutSpec, weights: PolicyWeights, prompts: tuple[str, ...],
            iteration: int, t: int, previous: Latents | StepOut) -> StepOut:
    """One step of a chunk under policy ``weights``: x_t -> x_{t+1}, with its log-prob
    when the algorithm samples step ``t`` of this iteration with an SDE (an ODE step
    records none)."""
    started = time.perf_counter()
    models = resident(spec.model, spec.model_seed, spec.trainable)
    dev = models.device
    x = (previous.x if isinstance(previous, Latents) else previous.latent).to(dev)
    sigma, sigma_next = spec.sigmas[t], spec.sigmas[t + 1]
    cond = chunk_conditioning(prompts, previous)
    alg = spec.algorithm
    log_prob = mean = None
    model = models.policy(weights)
    with torch.no_grad(), measured_step(spec.model, tuple(x.shape), models):
        v = predict_velocity(spec.model, model, x, sigma, cond.to(dev),
                             spec.sampler.guidance_scale)
        if t in alg.sde_steps(iteration):
            # Drawn on the CPU from per-sample seeds: the same numbers on any device.
            eps = torch.stack([draw_normal(tuple(x.shape[1:]), spec.seed, SDE_DRAW, iteration,
                                           s, t) for s in previous.sample_ids]).to(dev)
            step = sde_step(x, v, sigma, sigma_next, spec.sampler.noise_level, noise=eps,
                            dynamics=alg.dynamics)
            assert step.log_prob is not None    # (a step with noise: noise_level > 0)
            nxt, log_prob = step.next_latent, step.log_prob.cpu()
            mean = step.mean.cpu() if spec.keep_means else None
        else:
            nxt = euler_step(x, v, sigma, sigma_next)
    out = StepOut(sample_ids=previous.sample_ids, timestep=t, latent=nxt.cpu(),
                  log_prob=log_prob, version=weights.version, cond=cond, mean=mean)
    stretch(started)  # an injected slowdown (drills, tests); none by default
    return out


def decode(spec: RolloutSpec, *parts: Latents | StepOut) -> DecodeOut:
    """Decode a chunk's final latents to images (videos for a video family); collect the
    log-probs its SDE steps recorded (NaN at ODE steps; none at all for a decoupled
    algorithm, which reads only the final step). ``parts``: the chunk's starting noise
    and the steps the graph gives it (every step when its latents are stored)."""
    models = resident(spec.model, spec.model_seed, spec.trainable)
    steps = sorted((p for p in parts if isinstance(p, StepOut)), key=lambda s: s.timestep)
    n_steps = len(spec.sigmas) - 1
    assert steps and steps[-1].timestep == n_steps - 1, "missing the final step"
    images = decode_latents(spec.model, models.vae, steps[-1].latent.to(models.device))
    ids = steps[-1].sample_ids
    if spec.algorithm.keeps_trajectory():
        log_probs = np.full((len(ids), n_steps), np.nan, np.float32)
        for s in steps:
            if s.log_prob is not None:
                log_probs[:, s.timestep] = s.log_prob.numpy()
    else:
        log_probs = np.zeros((len(ids), 0), np.float32)
    latents = None
    if spec.save_latents:
        start = parts[0]
        assert isinstance(start, Latents) and [s.timestep for s in steps] == list(
            range(n_steps)), "stored latents need every step"
        latents = torch.stack([start.x] + [s.latent for s in steps], dim=1).numpy()
    versions = {s.version for s in steps}
    assert len(versions) == 1, f"a trajectory mixed policy versions {versions}"
    return DecodeOut(sample_ids=ids, images=images, log_probs=log_probs,
                     behaviour_version=versions.pop(), latents=latents)


def evaluate(spec: RolloutSpec, weights: PolicyWeights, prompt_ids: tuple[int, ...],
             prompts: tuple[str, ...], inputs: tuple = ()) -> DecodeOut:
    """An evaluation chunk: held-out prompts ``prompt_ids`` sampled by policy ``weights``
    with the ODE sampler (noise level 0: deterministic), each from its own fixed noise so
    every version is compared on the same starting points, then decoded. ``spec``: the
    evaluation's sampler (its own step count and guidance) and sigmas; ``inputs``: as
    :func:`noise`'s."""
    started = time.perf_counter()
    models = resident(spec.model, spec.model_seed, spec.trainable)
    dev = models.device
    shape = latent_shape(spec.model)
    x = torch.stack([draw_normal(shape, spec.seed, EVAL_NOISE_DRAW, j) for j in prompt_ids])
    x = x.to(dev)
    guidance = spec.sampler.guidance_scale
    cond = models.conditioning(tuple(prompts), guidance, inputs).to(dev)
    with torch.no_grad():
        model = models.policy(weights)
        for sigma, sigma_next in zip(spec.sigmas, spec.sigmas[1:]):
            v = predict_velocity(spec.model, model, x, sigma, cond, guidance)
            x = sde_step(x, v, sigma, sigma_next, 0.0).next_latent
    images = decode_latents(spec.model, models.vae, x)
    stretch(started)
    return DecodeOut(sample_ids=tuple(prompt_ids), images=images,
                     log_probs=np.zeros((len(prompt_ids), 0), np.float32),
                     behaviour_version=weights.version)
