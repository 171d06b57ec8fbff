"""Rollout tasks: starting noise and the prompts' conditioning, one denoising step of a
chunk, decoding.

Random draws are per sample: sample ``s`` of iteration ``i`` draws its starting noise
from ``(seed, "noise", i, s)`` and its step-``t`` SDE noise from ``(seed, "sde", i, s, t)``;
held-out prompt ``j`` starts every evaluation from ``(seed, "eval-noise", j)``.
How samples are chunked into tasks, or which worker runs a task, never changes a draw.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from digenrl.config import ModelConfig, SamplerConfig
from digenrl.lora import Trainable
from digenrl.models import decode_latents, latent_shape, predict_velocity
from digenrl.seeding import EVAL_NOISE_DRAW, GROUP_NOISE_DRAW, NOISE_DRAW, SDE_DRAW, stable_seed
from digenrl.tasks.resident import resident
from digenrl.tasks.sde import sde_step
from digenrl.tasks.slowdown import stretch
from digenrl.tasks.types import DecodeOut, Latents, PolicyWeights, StepOut

__all__ = ["RolloutSpec", "draw_normal", "noise", "denoise", "decode", "evaluate"]


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


def draw_normal(shape: tuple[int, ...], *parts) -> torch.Tensor:
    g = torch.Generator().manual_seed(stable_seed(*parts))
    return torch.randn(shape, generator=g, dtype=torch.float32)


def noise(spec: RolloutSpec, iteration: int, sample_ids: tuple[int, ...],
          prompts: tuple[str, ...]) -> Latents:
    """x_0 for each sample: pure noise (shared within a group if asked), and the
    conditioning of each sample's prompt from this worker's text encoders."""
    shape = latent_shape(spec.model)
    rows = []
    for s in sample_ids:
        ident = s // spec.samples_per_prompt if spec.same_noise_in_group else s
        what = GROUP_NOISE_DRAW if spec.same_noise_in_group else NOISE_DRAW
        rows.append(draw_normal(shape, spec.seed, what, iteration, ident))
    cond = resident(spec.model, spec.model_seed, spec.trainable).conditioning(prompts,
                                                              spec.sampler.guidance_scale)
    return Latents(sample_ids=tuple(sample_ids), x=torch.stack(rows), cond=cond)


def chunk_conditioning(prompts: tuple[str, ...], data: Latents | StepOut):
    """The conditioning a chunk's data carries, checked against the task's prompts."""
    cond = data.cond
    assert cond is not None and cond.prompts == tuple(prompts), \
        "a chunk's conditioning must come from its noise task, for its prompts"
    return cond


def denoise(spec: RolloutSpec, weights: PolicyWeights, prompts: tuple[str, ...],
            iteration: int, t: int, previous: Latents | StepOut) -> StepOut:
    """One SDE step of a chunk under policy ``weights``: x_t -> x_{t+1} and its log-prob."""
    started = time.perf_counter()
    models = resident(spec.model, spec.model_seed, spec.trainable)
    dev = models.device
    x = (previous.x if isinstance(previous, Latents) else previous.latent).to(dev)
    sigma, sigma_next = spec.sigmas[t], spec.sigmas[t + 1]
    cond = chunk_conditioning(prompts, previous)
    with torch.no_grad():
        model = models.policy(weights)
        v = predict_velocity(spec.model, model, x, sigma, cond.to(dev),
                             spec.sampler.guidance_scale)
        # Drawn on the CPU from per-sample seeds: the same numbers on any device.
        eps = torch.stack([draw_normal(tuple(x.shape[1:]), spec.seed, SDE_DRAW, iteration, s, t)
                           for s in previous.sample_ids]).to(dev)
        step = sde_step(x, v, sigma, sigma_next, spec.sampler.noise_level, noise=eps)
    out = StepOut(sample_ids=previous.sample_ids, timestep=t, latent=step.next_latent.cpu(),
                  log_prob=step.log_prob.cpu(), version=weights.version, cond=cond)
    stretch(started)  # an injected slowdown (drills, tests); none by default
    return out


def decode(spec: RolloutSpec, start: Latents, *steps: StepOut) -> DecodeOut:
    """Decode a chunk's final latents to images (videos for a video family); collect its
    per-step log-probs."""
    models = resident(spec.model, spec.model_seed, spec.trainable)
    steps = sorted(steps, key=lambda s: s.timestep)
    assert [s.timestep for s in steps] == list(range(len(steps))), "missing steps"
    images = decode_latents(spec.model, models.vae, steps[-1].latent.to(models.device))
    log_probs = torch.stack([s.log_prob for s in steps], dim=1).numpy().astype(np.float32)
    latents = None
    if spec.save_latents:
        latents = torch.stack([start.x] + [s.latent for s in steps], dim=1).numpy()
    versions = {s.version for s in steps}
    assert len(versions) == 1, f"a trajectory mixed policy versions {versions}"
    return DecodeOut(sample_ids=start.sample_ids, images=images, log_probs=log_probs,
                     behaviour_version=versions.pop(), latents=latents)


def evaluate(spec: RolloutSpec, weights: PolicyWeights, prompt_ids: tuple[int, ...],
             prompts: tuple[str, ...]) -> DecodeOut:
    """An evaluation chunk: held-out prompts ``prompt_ids`` sampled by policy ``weights``
    with the ODE sampler (noise level 0: deterministic), each from its own fixed noise so
    every version is compared on the same starting points, then decoded. ``spec``: the
    evaluation's sampler (its own step count and guidance) and sigmas."""
    started = time.perf_counter()
    models = resident(spec.model, spec.model_seed, spec.trainable)
    dev = models.device
    shape = latent_shape(spec.model)
    x = torch.stack([draw_normal(shape, spec.seed, EVAL_NOISE_DRAW, j) for j in prompt_ids])
    x = x.to(dev)
    guidance = spec.sampler.guidance_scale
    cond = models.conditioning(tuple(prompts), guidance).to(dev)
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
