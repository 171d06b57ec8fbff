"""Run configuration: one frozen dataclass per component, validated at construction.

Every check names the field (dotted path from the top of the config), what was expected
and what arrived. The checks here are the config's own: types, ranges and rules between
fields. What a config names elsewhere (a model folder's family, prompt sets and files,
registered rewards, LoRA target modules, the tokenizers' view of the prompts) is
checked by :func:`digenrl.run.world.check_world`, which every entry point calls before it
starts any cluster. Nothing here imports torch, Dask or another digenrl module but the
schedule's switches and the algorithms' shapes (plain data, :mod:`digenrl.algorithms`),
so the scheduler plugin and the simulator can read a configuration too.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import math
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

import yaml

from digenrl.algorithms import (ALGORITHMS, DEFAULT_ALGORITHM, KL_SPACES, LATENT, VELOCITY,
                                Algorithm)
from digenrl.checks import (ConfigError, choice, fail, finite, is_int, positive_int, require,
                            sub_path)
from digenrl.schedulers.options import MODES, ScheduleOptions, check_fields
from digenrl.schedulers.switches import DEFAULT_MODE, MODE_NAMES, SWITCHES, Switch, switches

__all__ = [
    "ConfigError",
    "COLLECTIVE_BACKENDS",
    "ModelConfig",
    "SamplerConfig",
    "AlgorithmConfig",
    "DataConfig",
    "RolloutConfig",
    "RewardConfig",
    "RemoteRewardConfig",
    "RewardModelConfig",
    "GroupRewardConfig",
    "TrainConfig",
    "ScheduleConfig",
    "ScheduleOptions",
    "ClusterConfig",
    "StoreConfig",
    "EvalConfig",
    "TrackingConfig",
    "TRACKERS",
    "RunConfig",
    "MODES",
    "load_config",
    "config_from_dict",
    "config_to_dict",
    "stored_section",
    "apply_overrides",
]


#: ``[HOST]:PORT`` (or a bare port), as Dask reads a dashboard address.
_ADDRESS = re.compile(r"^(?:[A-Za-z0-9_.\-]*|\[[0-9A-Fa-f:.]+\]):(?P<port>\d{1,5})$"
                      r"|^(?P<bare>\d{1,5})$")
#: A scheduler address: ``[SCHEME://]HOST[:PORT]``, with a scheme or a port.
_SCHEMES = ("tcp", "tls", "ucx", "ws", "wss")
_SCHEDULER = re.compile(rf"^(?:(?P<scheme>{'|'.join(_SCHEMES)})://)?"
                        r"(?P<host>[A-Za-z0-9_.\-]+|\[[0-9A-Fa-f:.]+\])(?::(?P<port>\d{1,5}))?$")
#: A byte size as Dask's ``parse_bytes`` reads it: a number and an optional unit.
#: The process-group backends a collective group may ask for (``cluster.collective_backend``):
#: ``auto`` is NCCL on a worker whose torch sees a CUDA device, gloo elsewhere.
COLLECTIVE_BACKENDS = ("auto", "gloo", "nccl")
_BYTES = re.compile(r"^\s*(\d+(\.\d*)?|\.\d+)([eE][+-]?\d+)?\s*(b|[kmgtp]i?b?)?\s*$",
                    re.IGNORECASE)


#: The dtypes a model (the policy, its text encoders, a reward model) may compute in.
DTYPES = ("float32", "bfloat16", "float16")


# --------------------------------------------------------------------------- model


@dataclass(frozen=True)
class ModelConfig:
    """The policy (a diffusers flow-matching transformer), the VAE and the text encoders.

    With ``path`` unset, the built-in tiny model is built from the sizes below with
    seeded random weights (nothing is downloaded) and prompts go through a hash encoder.
    With ``path`` set, the local diffusers pipeline folder is loaded by the family its
    ``model_index.json`` names (``StableDiffusion3Pipeline``, ``FluxPipeline``,
    ``WanPipeline``, ``QwenImagePipeline``, ``HunyuanVideoPipeline``, and the editing
    ``FluxKontextPipeline`` and ``QwenImageEditPipeline``): its transformer (trained),
    VAE, scheduler config, tokenizers and text encoders; the tiny-model sizes (the fields
    from ``image_size`` on, each marked "tiny model only") do not apply, and a config
    file or ``--set`` naming one together with ``path`` is refused. The folder must be
    readable from every worker.
    """

    # ---------------------------------------------- the fields every family reads
    path: str | None = None
    """A local diffusers pipeline folder (SD3/SD3.5, FLUX.1, Wan2.1, Qwen-Image, HunyuanVideo, FLUX.1 Kontext or Qwen-Image-Edit, by its model_index.json) loaded with from_pretrained; null builds the tiny model below with seeded random weights. A folder without model_index.json loads transformer/ and vae/ of an SD3-shaped model and encodes prompts with the hash encoder."""
    height: int | None = None
    """With path: image (or video) height in pixels; null is the pipeline's default (SD3: transformer sample_size x VAE factor; FLUX, Kontext, Qwen-Image and its edit: 1024; Wan: 480; HunyuanVideo: 720). A size the transformer cannot take (off its patch grid, past its rotary or positional table) is refused."""
    width: int | None = None
    """With path: image (or video) width in pixels; null is the pipeline's default (SD3: as height; FLUX, Kontext, Qwen-Image and its edit: 1024; Wan: 832; HunyuanVideo: 1280)."""
    num_frames: int | None = None
    """With a video pipeline: frames per video, 4k + 1; null is the pipeline's default (Wan 81, HunyuanVideo 129). An image model refuses it."""
    negative_prompt: str = ""
    """The prompt classifier-free guidance steers away from (sampler.guidance_scale > 1; SD3, Wan, Qwen-Image and its edit)."""
    source_area: int | None = None
    """With an editing pipeline folder (FLUX.1 Kontext, Qwen-Image-Edit): pixels each source image is resized to before the VAE (and Qwen-Image-Edit's vision-language encoder) sees it, at the image's aspect ratio: width sqrt(area x aspect) and height width / aspect, each rounded to the nearest multiple of the packed latent patch (VAE factor x 2: 16 for both released pipelines; at least one such multiple). Its tokens go through the transformer beside the edit's at every step, so a smaller area is faster (e.g. 512 x 512 = 262144 for 512 x 512 edits). Null is the pipeline's own resizing: Kontext, the preferred Kontext resolution nearest the aspect ratio (about 1 megapixel); Qwen-Image-Edit, about 1024 x 1024 pixels in multiples of 32."""
    max_sequence_length: int | None = None
    """With path: tokens of the T5/UMT5 prompt encoding, or of a language model's after its template (Qwen-Image, HunyuanVideo); null is the pipeline's default (SD3 256, FLUX 512, Wan 512, Qwen-Image 512, HunyuanVideo 256). A longer prompt is refused."""
    text_encoder_dtype: str | None = None
    """With path: dtype of the text encoders' weights and forward pass on the workers that run encode tasks (float32, bfloat16, float16); null is model.dtype."""
    text_encoder_offload: bool = False
    """With path: keep the text encoders on the CPU between encode tasks and move them to the worker's device only while an encode task computes (cached prompts move nothing): their device memory is free for the transformer the rest of the time."""
    dtype: str = "float32"
    """dtype of the transformer's frozen weights and forward pass (float32, bfloat16, float16); trained tensors, AdamW moments, the SDE step, log-probs and loss stay float32 (docs/algorithm.md)."""
    init_seed: int | None = None
    """Seed of the initial weights (the tiny model's, and the A matrices of LoRA adapters); null uses the run seed."""

    # ------------------------------------- tiny model only (path null): its sizes
    image_size: int = 64
    """Tiny model only: image height and width in pixels."""
    latent_channels: int = 4
    """Tiny model only: channels of the VAE latent (and of the transformer's input and output)."""
    vae_channels: tuple[int, ...] = (32, 64, 64)
    """Tiny model only: block widths of the VAE; the latent is image_size / 2^(len - 1) pixels wide."""
    vae_layers_per_block: int = 1
    """Tiny model only: ResNet layers per VAE block."""
    transformer_layers: int = 8
    """Tiny model only: SD3 transformer blocks."""
    attention_heads: int = 4
    """Tiny model only: attention heads per block."""
    attention_head_dim: int = 32
    """Tiny model only: width of each attention head (hidden size = heads x head dim)."""
    patch_size: int = 2
    """Tiny model only: latent patch size of the transformer's patch embedding."""
    prompt_tokens: int = 8
    """Tiny model only (and the hash encoder of a folder without model_index.json): tokens of the prompt encoder's sequence (longer prompts are cut)."""
    prompt_embed_dim: int = 64
    """Tiny model only: width of the prompt token embeddings (the transformer's joint_attention_dim)."""
    pooled_embed_dim: int = 32
    """Tiny model only: width of the pooled prompt embedding."""

    def validate(self, p: str) -> None:
        choice(self.dtype, f"{p}.dtype", DTYPES)
        if self.text_encoder_dtype is not None:
            choice(self.text_encoder_dtype, f"{p}.text_encoder_dtype", DTYPES)
        require(isinstance(self.text_encoder_offload, bool), f"{p}.text_encoder_offload",
                 "true or false", self.text_encoder_offload)
        require(isinstance(self.negative_prompt, str), f"{p}.negative_prompt",
                 "a string", self.negative_prompt)
        if self.source_area is not None:  # whether the model edits images: run/world.py
            positive_int(self.source_area, f"{p}.source_area")
        if self.path is not None:
            require(isinstance(self.path, str) and self.path != "", f"{p}.path",
                     "a path to a local diffusers pipeline folder", self.path)
            folder = Path(self.path).expanduser()
            require(folder.is_dir(), f"{p}.path", "an existing folder", self.path)
            for name in ("height", "width", "num_frames", "max_sequence_length"):
                v = getattr(self, name)
                if v is not None:
                    positive_int(v, f"{p}.{name}")
            if self.num_frames is not None:
                require((self.num_frames - 1) % 4 == 0, f"{p}.num_frames",
                         "4k + 1 frames (the video VAE's temporal factor)", self.num_frames)
            return  # the folder's own checks: digenrl.run.world.check_world
        positive_int(self.latent_channels, f"{p}.latent_channels")
        require(isinstance(self.vae_channels, tuple) and len(self.vae_channels) >= 1
                 and all(is_int(c) and c > 0 and c % 8 == 0 for c in self.vae_channels),
                 f"{p}.vae_channels", "a non-empty list of positive multiples of 8",
                 self.vae_channels)
        positive_int(self.vae_layers_per_block, f"{p}.vae_layers_per_block")
        positive_int(self.image_size, f"{p}.image_size", 8)
        factor = self.vae_scale_factor
        require(self.image_size % factor == 0, f"{p}.image_size",
                 f"a multiple of the VAE scale factor {factor} (2 ^ (number of "
                 f"{p}.vae_channels - 1))", self.image_size)
        positive_int(self.patch_size, f"{p}.patch_size")
        require(self.latent_size % self.patch_size == 0, f"{p}.image_size",
                 f"a latent size (image_size / {factor}) divisible by {p}.patch_size "
                 f"({self.patch_size})", self.image_size)
        positive_int(self.transformer_layers, f"{p}.transformer_layers")
        positive_int(self.attention_heads, f"{p}.attention_heads")
        positive_int(self.attention_head_dim, f"{p}.attention_head_dim")
        positive_int(self.prompt_tokens, f"{p}.prompt_tokens")
        positive_int(self.prompt_embed_dim, f"{p}.prompt_embed_dim")
        positive_int(self.pooled_embed_dim, f"{p}.pooled_embed_dim")
        if self.init_seed is not None:
            require(is_int(self.init_seed) and self.init_seed >= 0, f"{p}.init_seed",
                     "a non-negative integer or null", self.init_seed)

    @property
    def encoder_dtype(self) -> str:
        """The text encoders' dtype: ``text_encoder_dtype``, or the model's when unset."""
        return self.text_encoder_dtype or self.dtype

    @property
    def vae_scale_factor(self) -> int:
        return 2 ** (len(self.vae_channels) - 1)

    @property
    def latent_size(self) -> int:
        return self.image_size // self.vae_scale_factor


def tiny_model_fields() -> tuple[str, ...]:
    """The fields of :class:`ModelConfig` that size the built-in model alone: those from
    ``image_size`` on."""
    names = [f.name for f in dataclasses.fields(ModelConfig)]
    return tuple(names[names.index("image_size"):])


def _check_tiny_fields(data: Mapping[str, Any], model: ModelConfig) -> None:
    """A tiny-model field given together with ``model.path`` is refused: the folder's
    model has its own sizes (``prompt_tokens`` is read for a folder without
    model_index.json, whose prompts go through the hash encoder)."""
    given = data.get("model")
    if model.path is None or not isinstance(given, Mapping):
        return
    pipeline = (Path(model.path).expanduser() / "model_index.json").is_file()
    for name in tiny_model_fields():
        if name in given and (pipeline or name != "prompt_tokens"):
            fail(f"model.{name}", "no tiny-model field together with model.path (the "
                  "folder's model has its own sizes: set model.height, model.width, "
                  "model.num_frames)", given[name])


# ------------------------------------------------------------------------- sampler

#: The most sampling steps: the flow-matching scheduler's training timesteps.
MAX_STEPS = 1000


@dataclass(frozen=True)
class SamplerConfig:
    """The Flow-GRPO SDE sampler (docs/algorithm.md)."""

    num_steps: int = 8
    """Denoising steps per sample, 2 to 1000 (sigmas from FlowMatchEulerDiscreteScheduler over its 1000 training timesteps)."""
    shift: float = 3.0
    """The flow-matching timestep shift."""
    noise_level: float = 0.7
    """a in the SDE noise scale s_t = a sqrt(sigma / (1 - sigma)) (Flow-GRPO: 0.7)."""
    guidance_scale: float = 1.0
    """Classifier-free guidance in sampling and training; 1 turns it off."""
    timestep_fraction: float = 0.5
    """Fraction of the steps trained: the first int(num_steps x fraction); never the last."""

    def validate(self, p: str) -> None:
        require(is_int(self.num_steps) and 2 <= self.num_steps <= MAX_STEPS,
                 f"{p}.num_steps", f"an integer from 2 to {MAX_STEPS} (the sampler's "
                 f"training timesteps)", self.num_steps)
        finite(self.shift, f"{p}.shift", 0.0, lo_open=True)
        finite(self.noise_level, f"{p}.noise_level", 0.0, lo_open=True)
        finite(self.guidance_scale, f"{p}.guidance_scale", 1.0)
        finite(self.timestep_fraction, f"{p}.timestep_fraction", 0.0, 1.0, lo_open=True)
        n = self.trained_steps
        require(1 <= n <= self.num_steps - 1, f"{p}.timestep_fraction",
                 f"a fraction leaving 1..{self.num_steps - 1} trained steps of "
                 f"{p}.num_steps = {self.num_steps} (the last, near-clean step is never "
                 f"trained)", f"{self.timestep_fraction} ({n} steps)")

    @property
    def trained_steps(self) -> int:
        return int(self.num_steps * self.timestep_fraction)


# ----------------------------------------------------------------------- algorithm


@dataclass(frozen=True)
class AlgorithmConfig:
    """Which algorithm trains the policy (docs/algorithm.md): flow_grpo, the coupled family (SDE sampling; the trained steps' log-probabilities in a clipped policy ratio), or diffusion_nft, awm and dpo, the decoupled one (any ODE sampler without log-probabilities; the clean samples noised afresh and a velocity regressed). The fields of sampler, train and data keep their meaning under every algorithm; each field here says which algorithms read it."""

    name: str = DEFAULT_ALGORITHM
    """flow_grpo (coupled), diffusion_nft, awm or dpo (decoupled)."""
    dynamics: str | None = None
    """The sampler's dynamics: flow (Flow-GRPO's SDE, noise scale sampler.noise_level x sqrt(sigma / (1 - sigma))), dance (DanceGRPO's constant noise scale sampler.noise_level), cps (coefficients-preserving sampling: std sigma_next x sin(noise_level x pi / 2)); ode for the decoupled algorithms. null: the algorithm's own (flow for flow_grpo, ode for the others)."""
    sde_steps: tuple[int, ...] = ()
    """flow_grpo: an SDE window's candidate steps (0-based, never the last): each iteration samples num_sde_steps of them, drawn from (seed, iteration), with the SDE and every other step with the ODE, and trains exactly those (Flow-GRPO-Fast, MixGRPO; sampler.timestep_fraction is then not read). Empty: every step is an SDE step and the first int(num_steps x timestep_fraction) are trained."""
    num_sde_steps: int | None = None
    """flow_grpo with sde_steps: how many of them each iteration samples with the SDE (and trains); null: all of them."""
    guard: bool = False
    """flow_grpo: GRPO-Guard's regulated clipping: each step's log-ratio shifted by its mean and scaled by the step's std before the clip, each step's loss weighted by 1 / |dt|."""
    kl_space: str | None = None
    """Where the KL term of train.kl_beta is measured against the reference (version 0; with LoRA the base model, adapters off): latent (the SDE step's means, flow_grpo only) or velocity (the predicted velocities). null: latent for flow_grpo, velocity for the others."""
    train_timesteps: int | None = None
    """diffusion_nft, awm, dpo: the micro-steps of a chunk, each training every sample (or pair) at a noise level and noise drawn for it; null: sampler.timestep_fraction's trained steps, int(num_steps x timestep_fraction)."""
    nft_beta: float = 1.0
    """diffusion_nft: beta of the implicit policies, v+ = (1 - beta) v_old + beta v and v- = (1 + beta) v_old - beta v."""
    ema_ramp: float = 0.001
    """diffusion_nft: the sampling copy moves as old = eta_i old + (1 - eta_i) new after iteration i, eta_i = min(ema_ramp x i, ema_max)."""
    ema_max: float = 0.5
    """diffusion_nft: the largest eta_i (see ema_ramp); 0 samples with the trained weights."""
    dpo_beta: float = 100.0
    """dpo: beta, the inverse temperature of the preference loss -log sigmoid(-beta / 2 x ((err - err_ref)_winner - (err - err_ref)_loser))."""

    def validate(self, p: str) -> None:
        choice(self.name, f"{p}.name", ALGORITHMS)
        alg = ALGORITHMS[self.name]
        named = f"{p}.name {self.name!r}"
        if self.dynamics is not None:
            if alg.coupled:
                why = "its stochastic dynamics"
            else:
                why = "it samples with the ODE and needs no log-probabilities"
            require(self.dynamics in alg.dynamics_choices, f"{p}.dynamics",
                     f"one of {list(alg.dynamics_choices)} or null with {named} ({why})",
                     self.dynamics)
        require(isinstance(self.sde_steps, tuple)
                 and all(is_int(t) and t >= 0 for t in self.sde_steps)
                 and len(set(self.sde_steps)) == len(self.sde_steps), f"{p}.sde_steps",
                 "a list of distinct step numbers >= 0", list(self.sde_steps)
                 if isinstance(self.sde_steps, tuple) else self.sde_steps)
        if self.num_sde_steps is not None:
            positive_int(self.num_sde_steps, f"{p}.num_sde_steps")
            require(len(self.sde_steps) > 0, f"{p}.num_sde_steps",
                     f"null without {p}.sde_steps (the window's candidate steps)",
                     self.num_sde_steps)
            require(self.num_sde_steps <= len(self.sde_steps), f"{p}.num_sde_steps",
                     f"at most the {len(self.sde_steps)} candidate steps of {p}.sde_steps",
                     self.num_sde_steps)
        require(isinstance(self.guard, bool), f"{p}.guard", "true or false", self.guard)
        if self.kl_space is not None:
            choice(self.kl_space, f"{p}.kl_space", KL_SPACES)
        if self.train_timesteps is not None:
            positive_int(self.train_timesteps, f"{p}.train_timesteps")
        finite(self.nft_beta, f"{p}.nft_beta", 0.0, lo_open=True)
        finite(self.ema_ramp, f"{p}.ema_ramp", 0.0)
        finite(self.ema_max, f"{p}.ema_max", 0.0, 1.0, hi_open=True)
        finite(self.dpo_beta, f"{p}.dpo_beta", 0.0, lo_open=True)
        if alg.coupled:
            require(self.train_timesteps is None, f"{p}.train_timesteps",
                     f"null with {named} (its micro-steps are the trained steps of the "
                     f"trajectory)", self.train_timesteps)
            return
        why = "(it samples with the ODE: a decoupled algorithm has no SDE steps)"
        require(not self.sde_steps, f"{p}.sde_steps", f"an empty list with {named} {why}",
                 list(self.sde_steps))
        require(self.num_sde_steps is None, f"{p}.num_sde_steps", f"null with {named} {why}",
                 self.num_sde_steps)
        require(not self.guard, f"{p}.guard", f"false with {named} (GRPO-Guard "
                 f"normalises the policy ratio of SDE log-probabilities)", self.guard)
        require(self.kl_space != LATENT, f"{p}.kl_space", f"velocity or null with {named} "
                 f"(the latent KL compares the means of SDE steps)", self.kl_space)

    @property
    def coupled(self) -> bool:
        return ALGORITHMS[self.name].coupled

    @property
    def kl(self) -> str:
        """The space of the KL term: ``kl_space``, or the algorithm family's."""
        if self.kl_space is not None:
            return self.kl_space
        return LATENT if self.coupled else VELOCITY

    def shape(self, sampler: "SamplerConfig", seed: int) -> Algorithm:
        """The algorithm's shape for a run with ``sampler`` and run ``seed``."""
        alg = ALGORITHMS[self.name]
        steps = sampler.trained_steps
        if not alg.coupled and self.train_timesteps is not None:
            steps = self.train_timesteps
        return alg(num_steps=sampler.num_steps, trained_steps=steps,
                   dynamics=self.dynamics or "", sde_candidates=tuple(self.sde_steps),
                   num_sde_steps=self.num_sde_steps, seed=seed)

    def sampling_copy_decay(self, iteration: int) -> float:
        """eta_i of DiffusionNFT's sampling copy after iteration ``iteration``."""
        return min(self.ema_ramp * iteration, self.ema_max)


# ---------------------------------------------------------------------------- data


@dataclass(frozen=True)
class DataConfig:
    """Which prompts each iteration draws and how many images per prompt."""

    prompts_per_iteration: int = 4
    """Prompt groups per iteration."""
    samples_per_prompt: int = 4
    """Images per prompt (the GRPO group size); at least 2."""
    prompt_set: str = "simple_animals"
    """A built-in prompt list (simple_animals, animal_photos; ocr: 192 text-rendering prompts, 8 templates x 24 texts in double quotes, for an OCR reward), used when prompts is empty."""
    prompts: tuple[str, ...] = ()
    """Your own prompts; each iteration draws prompts_per_iteration of them (seeded)."""
    prompt_file: str | None = None
    """A prompt file, used instead of prompts and prompt_set: .txt (one prompt per line) or .jsonl (one {"prompt": ..., other keys} object per line; the other keys reach rewards as metadata). Each epoch visits every line once in a seeded order."""
    eval_prompt_file: str | None = None
    """Held-out prompts for evaluation (the eval section), in the same formats as prompt_file, metadata included (checked at start). Without it, a run training on a built-in prompt_set evaluates on that set's held-out prompts."""
    same_noise_in_group: bool = False
    """Start every sample of a group from the same noise (as DanceGRPO does)."""

    def validate(self, p: str) -> None:
        positive_int(self.prompts_per_iteration, f"{p}.prompts_per_iteration")
        positive_int(self.samples_per_prompt, f"{p}.samples_per_prompt", 2)
        require(isinstance(self.prompts, tuple)
                 and all(isinstance(s, str) and s.strip() for s in self.prompts),
                 f"{p}.prompts", "a list of non-empty strings", self.prompts)
        for name in ("prompt_file", "eval_prompt_file"):
            path = getattr(self, name)
            if path is not None:
                require(isinstance(path, str) and path != "", f"{p}.{name}",
                         "a path to a .txt or .jsonl prompt file, or null", path)
        if self.prompt_file is not None:
            require(not self.prompts, f"{p}.prompts",
                     f"an empty list when {p}.prompt_file is set", self.prompts)
        require(isinstance(self.same_noise_in_group, bool), f"{p}.same_noise_in_group",
                 "true or false", self.same_noise_in_group)

    @property
    def samples_per_iteration(self) -> int:
        return self.prompts_per_iteration * self.samples_per_prompt


#: The field of a chunk's context-parallel degree (``rollout.context_parallel``).
CONTEXT_PARALLEL_FIELD = "rollout.context_parallel"
#: ``rollout.context_parallel: auto``: each iteration's degrees chosen by the run.
AUTO = "auto"


@dataclass(frozen=True)
class RolloutConfig:
    """How samples are batched into denoise tasks."""

    chunk_size: int = 4
    """Samples one denoise task advances together (a divisor or multiple of samples_per_prompt); with adaptive chunking, the size until the first iterations are measured."""
    chunking: str = "fixed"
    """fixed: every chunk holds chunk_size samples (results bit-identical across clusters). adaptive: each iteration's chunk size is chosen from measured step times and per-task costs so every generating slot holds a chain (results equal up to floating-point summation order)."""
    max_chunk_size: int = 16
    """Adaptive chunking: the most samples one denoise task may hold (its memory bound); lowered to the samples whose measured activations fit what a rollout GPU has free, where its memory is known (cluster.gpu_memory_gb)."""
    context_parallel: int | str = 1
    """Processes that compute one chunk's denoise step together (Ulysses context parallelism through diffusers: each holds the whole transformer and 1/degree of the tokens; the transformer's attention heads must divide by it, and its family must have a plan: every family but HunyuanVideo). 1: each step on one worker. Above 1: each step of every chunk is a gang of that many denoise tasks, placed on any that many workers of the rollout pool and released together (docs/architecture.md, "Context parallelism"); decoding stays per chunk. auto: the run chooses each iteration's degrees (powers of two the heads divide, at most the rollout workers at the time) from each degree's measured step seconds, predicting a degree not yet measured from a measured one (probing it when chosen), the chunks, the rollout workers and a sample's measured activations (a chunk's, over the degree, within what a rollout GPU has free: cluster.gpu_memory_gb where workers report no GPU): degree 1 while chunks outnumber the workers, a higher one when an iteration has fewer chunks than workers (a few long videos), some chunks widened onto the workers its gangs leave idle (docs/architecture.md, "Context parallelism")."""

    def validate(self, p: str) -> None:
        positive_int(self.chunk_size, f"{p}.chunk_size")
        degree = self.context_parallel
        require(degree == AUTO or (isinstance(degree, int) and is_int(degree) and degree >= 1),
                f"{p}.context_parallel", f"an integer >= 1 or {AUTO!r}", degree)
        choice(self.chunking, f"{p}.chunking", ("fixed", "adaptive"))
        positive_int(self.max_chunk_size, f"{p}.max_chunk_size")
        if self.chunking == "adaptive":
            require(self.max_chunk_size >= self.chunk_size, f"{p}.max_chunk_size",
                     f"at least {p}.chunk_size ({self.chunk_size}) with adaptive chunking",
                     self.max_chunk_size)


# -------------------------------------------------------------------------- reward


#: Wire formats of a remote reward: JSON (images as base64 PNG), MessagePack (PNG bytes),
#: or pickle for servers written for flow_grpo's convention (unpickling runs code); or
#: openai, a VLM judge's chat completions (digenrl.serving.judges).
REMOTE_PROTOCOLS = ("json", "msgpack", "pickle", "openai")
#: How a VLM judge's answer becomes a score (digenrl.serving.judges).
JUDGE_SCORES = ("logprobs", "number")
#: The most requests a judge reward keeps in flight (and connections kept per server).
REMOTE_MAX_CONCURRENCY = 64
#: The most top logprobs an OpenAI-compatible server returns per token.
MAX_TOP_LOGPROBS = 20


@dataclass(frozen=True)
class RemoteRewardConfig:
    """A reward scored by a reward server over HTTP (``digenrl reward-server`` or any
    server of the same convention): each request POSTs ``{"images", "prompts",
    "metadata"}`` and is answered ``{"scores": [...]}``. Named under ``reward.remote``
    and weighted in ``reward.components`` like a registered reward."""

    url: str = ""
    """The server's URL, http:// or https://."""
    protocol: str = "json"
    """json: images as base64 PNG in JSON; msgpack: PNG bytes in MessagePack (smaller; both safe to parse); pickle: a pickled request and answer, for an existing flow_grpo-style server (unpickling runs code: use it only with a server you trust)."""
    timeout: float = 60.0
    """Seconds one request may take before it is retried."""
    retries: int = 3
    """Further attempts after a request fails (no connection, timeout, or a 5xx or 429 answer); a 4xx answer is not retried."""
    backoff: float = 1.0
    """Seconds before the first retry, doubling with each further one (at most 30)."""
    batch_size: int = 32
    """The most images one request carries; a reward task sends its chunk in requests of this size."""
    token_env: str | None = None
    """An environment variable of the run's process holding a bearer token sent with every request; null sends none."""
    model: str | None = None
    """protocol openai (a VLM judge served by vLLM, SGLang or any OpenAI-compatible server; url is its base URL, e.g. http://host:8000/v1): the served model's name, as the server lists it under /v1/models. Required with openai, null otherwise."""
    question: str | None = None
    """protocol openai: the text sent with each image; {prompt} is the sample's prompt, {KEY} a key of its metadata; a question without {prompt} judges the image alone. null asks whether the image matches the prompt (yes or no), or with score number for a rating from 0 to 10."""
    score: str = "logprobs"
    """protocol openai: logprobs: p(yes) / (p(yes) + p(no)) over the first generated token's top logprobs (case and spaces ignored); number: the first number of the answer's text, scaled by number_range."""
    number_range: tuple[float, ...] = (0.0, 10.0)
    """protocol openai, score number: [LOW, HIGH], where the judge's number lies; the score is (number - LOW) / (HIGH - LOW), and a number outside the range is a failure."""
    max_tokens: int | None = None
    """protocol openai: the most tokens the judge generates; null: 1 with score logprobs (only the first token is read), 32 with number."""
    top_logprobs: int = 20
    """protocol openai, score logprobs: how many of the first token's likeliest tokens the answer lists (at most 20; vLLM's --max-logprobs must allow it)."""
    concurrency: int = 8
    """protocol openai: requests in flight at once per reward task (one image each; at most 64)."""

    def validate(self, p: str) -> None:
        require(isinstance(self.url, str) and bool(re.match(r"^https?://[^\s/]+", self.url)),
                 f"{p}.url", "an http:// or https:// URL of a reward server", self.url)
        choice(self.protocol, f"{p}.protocol", REMOTE_PROTOCOLS)
        if self.protocol == "openai":
            require(isinstance(self.model, str) and bool(self.model.strip()), f"{p}.model",
                     "the served model's name (protocol openai asks a judge model)",
                     self.model)
        else:
            for name in ("model", "question", "max_tokens"):
                require(getattr(self, name) is None, f"{p}.{name}",
                         "null (only protocol openai asks a judge)", getattr(self, name))
        if self.question is not None:
            require(_is_template(self.question), f"{p}.question",
                     "text whose {fields} are names ({prompt} or metadata keys; {{ and }} "
                     "for braces)", self.question)
        choice(self.score, f"{p}.score", JUDGE_SCORES)
        lo_hi = self.number_range
        require(isinstance(lo_hi, tuple) and len(lo_hi) == 2 and all(
            isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
            for v in lo_hi) and lo_hi[0] < lo_hi[1], f"{p}.number_range",
            "[LOW, HIGH], two finite numbers with LOW < HIGH", list(lo_hi)
            if isinstance(lo_hi, tuple) else lo_hi)
        if self.max_tokens is not None:
            positive_int(self.max_tokens, f"{p}.max_tokens")
        require(is_int(self.top_logprobs) and 1 <= self.top_logprobs <= MAX_TOP_LOGPROBS,
                 f"{p}.top_logprobs", f"an integer from 1 to {MAX_TOP_LOGPROBS}",
                 self.top_logprobs)
        require(is_int(self.concurrency) and 1 <= self.concurrency <= REMOTE_MAX_CONCURRENCY,
                 f"{p}.concurrency", f"an integer from 1 to {REMOTE_MAX_CONCURRENCY}",
                 self.concurrency)
        finite(self.timeout, f"{p}.timeout", 0.0, lo_open=True)
        positive_int(self.retries, f"{p}.retries", 0)
        finite(self.backoff, f"{p}.backoff", 0.0)
        positive_int(self.batch_size, f"{p}.batch_size")
        if self.token_env is not None:
            require(isinstance(self.token_env, str) and bool(
                re.match(r"^[A-Za-z_][A-Za-z0-9_]*$", self.token_env)), f"{p}.token_env",
                "the name of an environment variable, or null", self.token_env)


def _is_template(text: Any) -> bool:
    """Whether ``text`` is a str.format template whose fields are plain names."""
    import string

    if not isinstance(text, str):
        return False
    try:
        fields = [f for _, f, _, _ in string.Formatter().parse(text) if f is not None]
    except ValueError:  # an unmatched brace
        return False
    return all(f.isidentifier() for f in fields)


#: Kinds of reward model: a CLIP preference score, an aesthetic head on CLIP's image
#: embedding, CLIP's consistency of an edit with its source, or OCR of the text an image
#: renders (digenrl.tasks.reward_models implements each).
REWARD_MODEL_KINDS = ("clip", "aesthetic", "clip_consistency", "ocr")
#: The kinds whose models ship with their library (no path, processor or head).
BUNDLED_MODEL_KINDS = ("ocr",)
#: The files a transformers model folder keeps its weights in (any one of them).
_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                 "pytorch_model.bin.index.json")
#: The suffixes of an aesthetic head's weights file.
HEAD_SUFFIXES = (".safetensors", ".pth", ".pt")


@dataclass(frozen=True)
class RewardModelConfig:
    """A reward that owns a torch model: loaded once per worker process (on its GPU when
    it has one, in ``dtype``) and kept there, so a reward task only scores. Named under
    ``reward.models`` and weighted in ``reward.components`` like a registered reward;
    its tasks hold a GPU slot. Nothing is downloaded: download the public weights on a
    machine with network access (e.g. ``huggingface-cli download
    yuvalkirstain/PickScore_v1 --local-dir /models/PickScore_v1``), copy the folders where
    every worker reads them, and point the fields at them. PickScore: ``kind: clip``,
    ``path`` the folder of ``yuvalkirstain/PickScore_v1``, ``processor`` the folder of
    ``laion/CLIP-ViT-H-14-laion2B-s32B-b79K``. CLIP score: ``kind: clip``, ``path`` the
    folder of ``openai/clip-vit-large-patch14`` (its logit scale is 100, so the score is
    100 x cosine, without CLIPScore's clipping at 0). LAION's aesthetic predictor:
    ``kind: aesthetic``, ``path`` the folder of ``openai/clip-vit-large-patch14``,
    ``head`` the file ``sac+logos+ava1-l14-linearMSE.pth`` of LAION's
    improved-aesthetic-predictor repository (a head on ViT-L/14's 768-wide embedding).
    Source consistency of an edit: ``kind: clip_consistency``, ``path`` a CLIP model
    folder (e.g. ``openai/clip-vit-large-patch14``'s); it needs a source image for every
    sample (an editing run's prompt-file lines). OCR of rendered text (Flow-GRPO's text
    rendering reward): ``kind: ocr`` and nothing else: its PP-OCR models ship inside the
    ``rapidocr`` wheel (``pip install -e ".[ocr]"``), so ``path``, ``processor`` and
    ``head`` stay unset; each sample's target text is its prompt's quoted text or its
    prompt-file line's ``text`` key."""

    kind: str = "clip"
    """clip: logit_scale x the cosine of CLIP's image and prompt embeddings, as PickScore and CLIP score compute it; aesthetic: an MLP head on the normalised CLIP image embedding (LAION's improved aesthetic predictor); clip_consistency: the cosine of CLIP's embeddings of the edited image and its source image (instruction editing: how much of the source an edit keeps); ocr: Flow-GRPO's OCR score in [0, 1] of the text the image renders against the prompt's quoted text (or its line's "text" key): 1 when the target occurs in the recognised text (spaces removed, case folded), else 1 - min(edit distance, target length) / target length (RapidOCR's PP-OCR models on onnxruntime)."""
    path: str = ""
    """A local folder holding a transformers CLIPModel (config.json and model.safetensors or pytorch_model.bin), as save_pretrained writes it; readable from every worker. ocr: unset (its models ship in the rapidocr wheel)."""
    processor: str | None = None
    """A local folder holding its processor (preprocessor_config.json or processor_config.json and, for clip, the tokenizer: tokenizer.json or vocab.json with merges.txt), as CLIPImageProcessor's or CLIPProcessor's save_pretrained writes it; null: path."""
    head: str | None = None
    """aesthetic: the MLP head's weights (.safetensors, or .pth/.pt read with torch.load(weights_only=True)), keys layers.0 ... layers.7 as LAION's predictor saves them; clip: null."""
    dtype: str = "float32"
    """dtype of the CLIP model's weights and forward pass (float32, bfloat16, float16); scores are returned as float64. ocr: float32 (its ONNX models')."""
    batch_size: int = 32
    """The most images one forward pass scores (ocr: one pass of its text detector on a GPU; on a CPU its images are read one by one)."""

    def validate(self, p: str) -> None:
        choice(self.kind, f"{p}.kind", REWARD_MODEL_KINDS)
        choice(self.dtype, f"{p}.dtype", DTYPES)
        positive_int(self.batch_size, f"{p}.batch_size")
        if self.kind in BUNDLED_MODEL_KINDS:
            why = f"for kind {self.kind} (its models ship in its library's wheel)"
            require(self.path == "", f"{p}.path", f"no path {why}", self.path)
            for name in ("processor", "head"):
                require(getattr(self, name) is None, f"{p}.{name}", f"null {why}",
                         getattr(self, name))
            require(self.dtype == "float32", f"{p}.dtype",
                     f"float32 for kind {self.kind} (its models compute in float32)",
                     self.dtype)
            return
        require(isinstance(self.path, str) and self.path != "", f"{p}.path",
                 "a path to a local CLIPModel folder", self.path)
        _check_folder(self.path, f"{p}.path", [("config.json",), _WEIGHT_FILES],
                      "a CLIPModel folder")
        processor = self.processor if self.processor is not None else self.path
        where = f"{p}.processor" if self.processor is not None else f"{p}.path"
        require(isinstance(processor, str) and processor != "", where,
                 "a path to a local processor folder, or null", processor)
        # transformers 5's processors save processor_config.json (the image processor's
        # settings inside it); image processors and older saves, preprocessor_config.json.
        needs = [("preprocessor_config.json", "processor_config.json")]
        if self.kind == "clip":
            needs.append(("tokenizer.json", "vocab.json"))
        _check_folder(processor, where, needs, "a CLIP processor folder")
        if self.kind == "aesthetic":
            require(isinstance(self.head, str) and self.head != "", f"{p}.head",
                     f"a path to the aesthetic head's weights ({', '.join(HEAD_SUFFIXES)})",
                     self.head)
            assert self.head is not None    # (required just above)
            require(Path(self.head).expanduser().is_file(), f"{p}.head", "an existing file",
                     self.head)
            require(self.head.endswith(HEAD_SUFFIXES), f"{p}.head",
                     f"a file ending in one of {list(HEAD_SUFFIXES)}", self.head)
        else:
            require(self.head is None, f"{p}.head", "null (only an aesthetic reward has a "
                                                     "head)", self.head)


def _check_folder(path: str, field_path: str, needs: Sequence[tuple[str, ...]],
                  what: str) -> None:
    """``path`` is a folder holding, for each entry of ``needs``, one of its files."""
    folder = Path(path).expanduser()
    require(folder.is_dir(), field_path, f"an existing folder ({what})", path)
    for names in needs:
        if not any((folder / n).is_file() for n in names):
            fail(field_path, f"{what} holding {' or '.join(names)}", path)


#: How a group reward turns another reward's scores within a prompt group into its own
#: (digenrl.tasks.rewards implements each).
GROUP_REWARD_METHODS = ("rank", "win_rate")


@dataclass(frozen=True)
class GroupRewardConfig:
    """A reward that scores a whole prompt group at once: another reward's scores ranked
    within each group. Named under ``reward.group`` and weighted in ``reward.components``
    like any reward; its task (``group_reward``) runs once the group's images exist, and
    its weighted score is added to each sample's weighted sum of the others. It needs
    ``data.samples_per_prompt`` >= 2 and is left out of held-out evaluation (one image
    per prompt there): its ``reward_NAME`` column of the evaluations is NaN."""

    of: str = ""
    """The reward whose scores are ranked: a registered reward that scores each sample alone, or one of reward.remote or reward.models (a CLIP/PickScore or aesthetic model)."""
    method: str = "rank"
    """rank: the sample's rank in its group scaled to [0, 1] (the fraction of the others it beats, a tie counting half); win_rate: its mean probability of being preferred to each other sample of its group, sigmoid((score - other) / temperature), as PickScore's pairwise preference is."""
    temperature: float = 1.0
    """win_rate: the score difference that makes a preference e (about 2.7) times as likely (1 for PickScore's logit-scaled scores)."""

    def validate(self, p: str) -> None:
        require(isinstance(self.of, str) and self.of != "", f"{p}.of",
                 "the name of the reward whose scores are ranked", self.of)
        choice(self.method, f"{p}.method", GROUP_REWARD_METHODS)
        finite(self.temperature, f"{p}.temperature", lo=0, lo_open=True)


@dataclass(frozen=True)
class RewardConfig:
    """A weighted sum of registered rewards, e.g. ``{jpeg_compressibility: 1.0}``.

    ``on_error``: ``raise`` stops the run with an error naming the reward and the
    samples; ``drop`` leaves such samples out of training and counts them.
    """

    components: Mapping[str, float] = field(
        default_factory=lambda: {"jpeg_compressibility": 1.0})
    """Reward name -> weight; the reward is the weighted sum (see digenrl.tasks.rewards). A name is a registered reward or one of reward.remote, reward.models or reward.group."""
    on_error: str = "raise"
    """raise: a failing reward stops the run naming the reward and samples; drop: those samples are left out and counted."""
    remote: Mapping[str, RemoteRewardConfig] = field(default_factory=dict)
    """Name -> a reward scored by a reward server (the fields below); the name is then usable in components."""
    models: Mapping[str, RewardModelConfig] = field(default_factory=dict)
    """Name -> a reward that owns a model, resident on the workers (the fields below); the name is then usable in components."""
    group: Mapping[str, GroupRewardConfig] = field(default_factory=dict)
    """Name -> a reward that scores a whole prompt group at once, ranking another reward's scores within the group (the fields below); the name is then usable in components."""

    def validate(self, p: str) -> None:
        for group, cls, what, fields in (
                ("remote", RemoteRewardConfig, "server settings", "url, protocol, ..."),
                ("models", RewardModelConfig, "model settings", "kind, path, ..."),
                ("group", GroupRewardConfig, "group reward settings", "of, method, ...")):
            named = getattr(self, group)
            require(isinstance(named, Mapping), f"{p}.{group}",
                     f"a mapping of reward name to {what}", named)
            for name, settings in named.items():
                sub = sub_path(f"{p}.{group}", name)
                # The name becomes the store's reward_NAME column.
                require(isinstance(name, str) and bool(re.match(r"^[A-Za-z0-9_.\-]+$", name)),
                         sub, "a name of letters, digits, '_', '-' and '.'", name)
                require(group == "remote" or name not in self.remote, sub,
                         "a name that is not also under reward.remote", name)
                require(group != "group" or name not in self.models, sub,
                         "a name that is not also under reward.models", name)
                require(isinstance(settings, cls), sub, f"a mapping of {what} ({fields})",
                         settings)
                settings.validate(sub)
        require(isinstance(self.components, Mapping) and len(self.components) > 0,
                 f"{p}.components", "a non-empty mapping of reward name to weight",
                 self.components)
        for name, weight in self.components.items():
            finite(weight, f"{p}.components.{name}")
        choice(self.on_error, f"{p}.on_error", ("raise", "drop"))

    def __hash__(self) -> int:
        return hash((tuple(sorted(self.components.items())), self.on_error,
                     tuple(sorted(self.remote.items())), tuple(sorted(self.models.items())),
                     tuple(sorted(self.group.items()))))


# --------------------------------------------------------------------------- train

#: ``train.sharding``: the trainer state whole on every trainer, or sharded (FSDP2).
SHARDINGS = ("none", "fsdp")
#: ``train.weight_sync``: how a new version's weights reach the workers that generate.
WEIGHT_SYNCS = ("auto", "dask", "broadcast")


@dataclass(frozen=True)
class TrainConfig:
    """Flow-GRPO loss and the AdamW step that publishes each policy version."""

    learning_rate: float = 1.5e-3
    """AdamW learning rate. Unset in a config: its algorithm's default, with the sampling dynamics the config names (docs/algorithm.md, "Each algorithm's defaults"; digenrl run --check prints the values a run gets)."""
    adam_beta1: float = 0.9
    """AdamW beta1."""
    adam_beta2: float = 0.999
    """AdamW beta2."""
    adam_eps: float = 1e-8
    """AdamW epsilon."""
    weight_decay: float = 1e-4
    """AdamW decoupled weight decay."""
    max_grad_norm: float = 1.0
    """Gradients are scaled down to this total norm before the step."""
    clip_range: float = 1e-4
    """PPO ratio clip epsilon (Flow-GRPO: 1e-4)."""
    advantage_clip: float = 5.0
    """Advantages are clipped to plus or minus this."""
    advantage_std: str = "group"
    """group: normalise by the group's reward std (needed for GAP); batch: by the iteration's (Flow-GRPO's default)."""
    kl_beta: float = 0.0
    """Weight of the KL term to the initial weights; 0 turns it off."""
    off_policy_correction: str = "decoupled"
    """decoupled (AReaL) or clip (Flow-GRPO's own) for samples from an older version; see docs/algorithm.md."""
    importance_weight_cap: float = 2.0
    """Truncation of the behaviour importance weight (decoupled correction)."""
    reduce_fanin: int = 8
    """Gradients summed per node of the fixed reduction tree (each node adds its parts one at a time, in order, as they arrive)."""
    lora_rank: int = 0
    """LoRA rank (peft adapters on lora_targets; only they train and travel); 0 trains every weight of the transformer."""
    lora_alpha: float | None = None
    """LoRA alpha (the adapter's output is scaled by alpha / rank); null is the rank (scale 1)."""
    lora_targets: tuple[str, ...] = ()
    """Module names that get adapters, matched as peft does (full name or its last dotted parts, e.g. to_q); empty is the model family's attention projections."""
    gradient_checkpointing: bool = False
    """Recompute each transformer block's activations in the backward pass instead of keeping them (less memory, more compute)."""
    sharding: str = "none"
    """none: every trainer holds the whole trainer state; fsdp: weights, gradients and AdamW moments sharded (FSDP2) over the workers that train (the trainer pool, at least 2 workers; in colocated mode every worker), each micro-step, optimizer step and checkpoint a collective step of all of them (docs/algorithm.md, "Sharded training (FSDP2)"). Full-parameter training only (lora_rank 0)."""
    weight_sync: str = "auto"
    """How each new version's weights reach the workers that generate with it. dask: as Dask data from the trainer that made it (LoRA adapters, the built-in model); broadcast: over the sharded gang's collective group, which then spans every worker of the run, from the first trainer to every other worker in buckets of sync_bucket_mb, each loading them into its resident transformer in place, only the version and its manifest travelling through Dask (docs/architecture.md, "Publishing by broadcast"); needs sharding fsdp. auto: broadcast with sharding fsdp, dask otherwise."""
    sync_bucket_mb: float = 512.0
    """With weight_sync broadcast: MiB of weights per broadcast bucket (one is filled while the last is in flight)."""
    context_parallel: int = 1
    """Processes that compute one micro-step together over a context-parallel axis (beside FSDP's data-parallel one). Only 1 is offered: micro-steps are computed whole on each trainer; a sample whose backward does not fit one GPU needs gradient checkpointing (train.gradient_checkpointing) or more memory."""

    def validate(self, p: str) -> None:
        finite(self.learning_rate, f"{p}.learning_rate", 0.0, lo_open=True)
        finite(self.adam_beta1, f"{p}.adam_beta1", 0.0, 1.0, hi_open=True)
        finite(self.adam_beta2, f"{p}.adam_beta2", 0.0, 1.0, hi_open=True)
        finite(self.adam_eps, f"{p}.adam_eps", 0.0, lo_open=True)
        finite(self.weight_decay, f"{p}.weight_decay", 0.0)
        finite(self.max_grad_norm, f"{p}.max_grad_norm", 0.0, lo_open=True)
        finite(self.clip_range, f"{p}.clip_range", 0.0, 1.0, lo_open=True)
        finite(self.advantage_clip, f"{p}.advantage_clip", 0.0, lo_open=True)
        choice(self.advantage_std, f"{p}.advantage_std", ("group", "batch"))
        finite(self.kl_beta, f"{p}.kl_beta", 0.0)
        choice(self.off_policy_correction, f"{p}.off_policy_correction",
                ("decoupled", "clip"))
        finite(self.importance_weight_cap, f"{p}.importance_weight_cap", 1.0)
        positive_int(self.reduce_fanin, f"{p}.reduce_fanin", 2)
        positive_int(self.lora_rank, f"{p}.lora_rank", 0)
        if self.lora_alpha is not None:
            finite(self.lora_alpha, f"{p}.lora_alpha", 0.0, lo_open=True)
        require(all(isinstance(t, str) and t for t in self.lora_targets), f"{p}.lora_targets",
                 "a list of module names", list(self.lora_targets))
        choice(self.sharding, f"{p}.sharding", SHARDINGS)
        choice(self.weight_sync, f"{p}.weight_sync", WEIGHT_SYNCS)
        require(self.weight_sync != "broadcast" or self.sharding == "fsdp",
                f"{p}.weight_sync", "dask or auto without sharding fsdp (a broadcast goes "
                "from a sharded gang's first trainer)", self.weight_sync)
        finite(self.sync_bucket_mb, f"{p}.sync_bucket_mb", 0.0, lo_open=True)
        require(self.context_parallel == 1, f"{p}.context_parallel", "1 (micro-steps are "
                "computed whole on each trainer: a context-parallel axis of the trainers' "
                "mesh is not offered; rollout.context_parallel splits generation)",
                self.context_parallel)

    @property
    def broadcasts(self) -> bool:
        """Whether new versions are published by collective broadcast (weight_sync)."""
        return self.weight_sync == "broadcast" or (self.weight_sync == "auto"
                                                   and self.sharding == "fsdp")


# ------------------------------------------------------------------------ schedule


class _ScheduleChecks:
    """The checks and the options of the ``schedule`` section, from the switches'
    declarations (:mod:`digenrl.schedulers.switches`)."""

    mode: str   # (ScheduleConfig's field)

    def validate(self, p: str = "schedule") -> None:
        choice(self.mode, f"{p}.mode", MODES)
        for s in _SCHEDULE_FIELDS:
            _check_switch(s, getattr(self, s.name), f"{p}.{s.name}")
        for s in _SCHEDULE_FIELDS:
            reason = s.fixed.get(self.mode)
            value = getattr(self, s.name)
            if reason is not None:
                assert s.modes is not None      # (a mode that fixes it: a preset)
                preset = s.modes[self.mode]
                require(value is None or value == preset, f"{p}.{s.name}",
                         f"{json_default(preset)} or null in {self.mode} mode ({p}.mode; "
                         f"{reason})", value)

    def options(self) -> ScheduleOptions:
        """The policy's options: the mode's preset with the switches set here."""
        values: dict[str, Any] = dict(MODES[self.mode])
        for s in _SCHEDULE_FIELDS:
            value = getattr(self, s.name)
            if not s.scheduling or (s.preset and value is None):
                continue
            values[s.name] = float(value) if s.type is float and value is not None else value
        return ScheduleOptions(mode=self.mode, **values)


def _check_switch(s: Switch, value: Any, path: str) -> None:
    """``value`` is of the switch's type and within its bounds (or null, where null is
    the mode's or a value of its own)."""
    nullable = s.preset or s.nullable
    if value is None and nullable:
        return
    or_null = " or null" if nullable else ""
    if s.type is bool:
        require(isinstance(value, bool), path,
                 ("true, false" + or_null) if nullable else "true or false", value)
    elif s.type is int:
        ok = is_int(value) and (s.low is None or value >= s.low) and (
            s.high is None or value <= s.high)
        if s.low is not None and s.high is not None:
            bounds = f"an integer from {s.low:g} to {s.high:g}"
        elif s.low is not None or s.high is not None:
            bounds = f"an integer >= {s.low:g}" if s.high is None else f"an integer <= {s.high:g}"
        else:
            bounds = "an integer"
        require(ok, path, bounds + or_null, value)
    else:
        finite(value, path, s.low, s.high, lo_open=s.low_open)


def _schedule_doc(s: Switch) -> str:
    """The configuration reference's line of switch ``s``."""
    if not s.preset:
        return s.help
    assert s.modes is not None      # (a preset)
    values = ", ".join(f"{mode} {json_default(v)}" for mode, v in s.modes.items())
    return f"{s.help} null: the mode's ({values})."


#: The switches the ``schedule`` section sets (all but those only a mode sets).
_SCHEDULE_FIELDS = tuple(s for s in switches() if s.configurable)


# Each field but ``mode`` is the switch of its name (digenrl.schedulers.switches says
# what it does and how its values are checked): a mode preset is null (the mode's) unless
# set, a plain setting has the switch's default. check_fields below refuses any other.
@dataclass(frozen=True)
class ScheduleConfig(_ScheduleChecks):
    """Mode and the switches that ablate it. ``null`` keeps the mode's preset.

    ``stale_groups``: with ``max_staleness = k > 0``, how many leading prompt groups of
    iteration ``i`` are generated with version ``i - k`` (so they can start before the
    trainer finishes iteration ``i - 1``, filling its tail bubble); the other groups are
    generated with version ``i``. ``null``: all groups (every sample ``k`` versions old).
    The choice is static, so a run's numbers never depend on timing.
    """

    mode: str = DEFAULT_MODE
    max_staleness: int | None = None
    gap: bool | None = None
    tsp: bool | None = None
    tag: bool | None = None
    rebalance: bool | None = None
    rat: bool | None = None
    transfer_bandwidth: float = SWITCHES["transfer_bandwidth"].default
    stale_groups: int | None = SWITCHES["stale_groups"].default
    slots_per_worker: int = SWITCHES["slots_per_worker"].default
    context_parallel_wait: float = SWITCHES["context_parallel_wait"].default
    stall_timeout: float | None = SWITCHES["stall_timeout"].default


check_fields(ScheduleConfig, _SCHEDULE_FIELDS,
             field_type=lambda s: s.type | None if s.preset or s.nullable else s.type,
             field_default=lambda s: None if s.preset else s.default)


def _schedule_docs() -> dict[str, str]:
    """The reference's meaning of each ``schedule`` field (the switches' own words)."""
    return {"mode": f"{', '.join(MODE_NAMES[:-1])} or {MODE_NAMES[-1]}: a preset of the "
                    f"switches below.",
            **{s.name: _schedule_doc(s) for s in _SCHEDULE_FIELDS}}


# ------------------------------------------------------------------------- cluster


@dataclass(frozen=True)
class ClusterConfig:
    """Where the run executes.

    No ``scheduler``: an embedded LocalCluster of worker processes, each advertising one
    emulated ``GPU`` slot, ``rollout_workers`` tagged ``rollout`` and ``trainer_workers``
    tagged ``trainer``. ``gpus``: a dask-cuda LocalCUDACluster, one worker per GPU.
    ``scheduler``: an existing cluster whose workers carry the pool tags.
    """

    scheduler: str | None = None
    """Address of an existing scheduler; null starts a local cluster."""
    gpus: bool = False
    """Start a dask-cuda LocalCUDACluster, one worker per GPU (needs digenrl[cuda])."""
    rollout_workers: int = 1
    """Worker processes (one emulated or real GPU each) in the rollout pool."""
    trainer_workers: int = 1
    """Worker processes in the trainer pool."""
    threads_per_worker: int = 2
    """Threads per worker: one runs GPU tasks, the others the light tasks."""
    torch_threads: int = 1
    """torch intra-op threads per worker (1 keeps runs bit-identical across machines' core counts)."""
    dashboard_address: str | None = ":8787"
    """Address of the local cluster's dashboard; null turns it off."""
    memory_limit: str = "auto"
    """Memory limit per local worker (Dask syntax, e.g. 4GiB, or auto)."""
    gpu_memory_gb: float = 0.0
    """GPU memory of each worker, in GB (1e9 bytes), for workers that report none (a worker on a GPU reports its device's total through Dask's NVML diagnostics): 90% of it is what rollout.context_parallel auto and adaptive chunking keep a chunk's measured activations within, beside what the worker keeps resident. 0: not bounded (the emulated GPU slots of a local CPU cluster have no memory of their own)."""
    connect_timeout: float = 10.0
    """Seconds to wait for an existing scheduler."""
    collective_timeout: float = 300.0
    """Seconds a collective group (torch.distributed among workers, digenrl.tasks.collective) waits: for its members to meet through the scheduler, and for each collective, which fails after that long when a member is lost instead of hanging."""
    gang_restarts: int = 3
    """How many times a run trained sharded (train.sharding fsdp) forms its gang of trainers anew after a gang step failed (a member's worker lost, a collective that timed out), continuing from its newest sharded checkpoint on the pool's workers at that time; 0 stops the run at the first failure (resume it with digenrl run --resume)."""
    collective_backend: str = "auto"
    """The collective groups' torch.distributed backend: gloo, nccl, or auto (nccl on a worker whose torch sees a CUDA device, gloo elsewhere). A backend a worker cannot run is refused in one line naming this field."""

    def validate(self, p: str) -> None:
        if self.scheduler is not None:
            m = isinstance(self.scheduler, str) and _SCHEDULER.match(self.scheduler)
            require(isinstance(m, re.Match) and (m.group("scheme") or m.group("port")) is not None
                     and int(m.group("port") or 0) <= 65535, f"{p}.scheduler",
                     "a scheduler address such as tcp://host:8786 (schemes: "
                     f"{', '.join(_SCHEMES)})", self.scheduler)
            require(not self.gpus, f"{p}.gpus",
                     f"false when {p}.scheduler is given (the cluster exists)", self.gpus)
        require(isinstance(self.gpus, bool), f"{p}.gpus", "true or false", self.gpus)
        positive_int(self.rollout_workers, f"{p}.rollout_workers")
        positive_int(self.trainer_workers, f"{p}.trainer_workers")
        positive_int(self.threads_per_worker, f"{p}.threads_per_worker")
        positive_int(self.torch_threads, f"{p}.torch_threads")
        finite(self.gpu_memory_gb, f"{p}.gpu_memory_gb", 0.0)
        finite(self.connect_timeout, f"{p}.connect_timeout", 0.0, lo_open=True)
        finite(self.collective_timeout, f"{p}.collective_timeout", 0.0, lo_open=True)
        choice(self.collective_backend, f"{p}.collective_backend", COLLECTIVE_BACKENDS)
        positive_int(self.gang_restarts, f"{p}.gang_restarts", 0)
        if self.dashboard_address is not None:
            m = isinstance(self.dashboard_address, str) and _ADDRESS.match(self.dashboard_address)
            require(isinstance(m, re.Match) and int(m.group("port") or m.group("bare")) <= 65535,
                     f"{p}.dashboard_address",
                     "an address such as ':8787' or 'localhost:8787' (port 0 picks a free "
                     "one), or null", self.dashboard_address)
        require(isinstance(self.memory_limit, str) and (
            self.memory_limit == "auto" or bool(_BYTES.match(self.memory_limit))),
            f"{p}.memory_limit", "'auto' or a size such as '4GiB', '500MB' or '0' (no limit)",
            self.memory_limit)

    @property
    def total_workers(self) -> int:
        return self.rollout_workers + self.trainer_workers


@dataclass(frozen=True)
class StoreConfig:
    """What the output store keeps besides the always-written arrays."""

    save_images: bool = True
    """Store every generated image in samples.image."""
    save_latents: bool = False
    """Store every sample's latents at every step in steps.latent."""
    save_videos: bool = False
    """Video models: store every whole video in samples.video (samples.image holds each video's middle frame either way)."""
    commit_interval: float = 10.0
    """Seconds between two commits of complete iterations to the store: the iterations completed meanwhile are committed together, each array written once for them (a commit costs about the same for one iteration as for several). 0 commits every iteration as soon as it is complete. Readers see complete iterations only either way; a driver that dies loses the iterations not committed yet, which --resume computes again, bit for bit."""

    checkpoint_every: int = 1
    """Iterations between two resume points whose trainer state (weights and optimizer moments) is checkpointed in the store: with N, the versions a run resumed at iteration N, 2N, ... (and at its last iteration) restores -- version mN, and with bounded staleness k the k versions before it. 1 checkpoints every version. The other versions live in the trainer's memory only: a lost trainer recomputes them from the newest checkpoint before them (the scheduler keeps the task graph of the iterations since then for that), and a run resumed after its driver died starts computing again at the last resume point it stored, bit for bit, storing only the iterations it did not hold yet. Each checkpoint of full weights costs a write of three times the weights' size."""

    def validate(self, p: str) -> None:
        for name in ("save_images", "save_latents", "save_videos"):
            v = getattr(self, name)
            require(isinstance(v, bool), f"{p}.{name}", "true or false", v)
        finite(self.commit_interval, f"{p}.commit_interval", 0.0)
        positive_int(self.checkpoint_every, f"{p}.checkpoint_every")


# ---------------------------------------------------------------------------- eval


@dataclass(frozen=True)
class EvalConfig:
    """Held-out evaluation: the policy samples every held-out prompt once, from the same noise each time, with the ODE sampler (no noise), and the configured rewards score the images (the eval group of the store; digenrl report plots the curve and a grid per version). Held-out prompts come from data.eval_prompt_file or, when the run trains on a built-in data.prompt_set, from that set's eight held-out prompts, worded as the set words its prompts: eight animals none of the training prompts names (penguin, giraffe, panda, koala, parrot, crab, peacock, swan), or for ocr eight texts none of its prompts shows, one in each of its templates. With your own prompts and no eval_prompt_file, evaluation is refused."""

    every: int = 0
    """Evaluate policy version v, published by iteration v - 1, when v is a multiple of every; 0 turns evaluation off. The evaluations run in GPU slots nothing else can use."""
    before_first: bool = False
    """Also evaluate version 0 (the initial policy) before the first iteration trains."""
    num_steps: int | None = None
    """ODE steps of an evaluation sample; null: sampler.num_steps."""
    guidance_scale: float | None = None
    """Classifier-free guidance of an evaluation sample; null: sampler.guidance_scale."""
    grid: int = 8
    """How many held-out prompts digenrl report shows per evaluated version (the first ones)."""

    def validate(self, p: str) -> None:
        require(is_int(self.every) and self.every >= 0, f"{p}.every",
                 "an integer >= 0 (0: no evaluation)", self.every)
        require(isinstance(self.before_first, bool), f"{p}.before_first", "true or false",
                 self.before_first)
        require(not self.before_first or self.every > 0, f"{p}.before_first",
                 f"false while {p}.every is 0 (evaluation off)", self.before_first)
        if self.num_steps is not None:
            require(is_int(self.num_steps) and 2 <= self.num_steps <= MAX_STEPS,
                     f"{p}.num_steps", f"null or an integer from 2 to {MAX_STEPS}",
                     self.num_steps)
        if self.guidance_scale is not None:
            finite(self.guidance_scale, f"{p}.guidance_scale", 1.0)
        positive_int(self.grid, f"{p}.grid")

    @property
    def on(self) -> bool:
        return self.every > 0

    def evaluates(self, version: int) -> bool:
        """Whether policy version ``version`` is evaluated."""
        if not self.on:
            return False
        return version % self.every == 0 and (version > 0 or self.before_first)

    def sampler(self, sampler: SamplerConfig) -> SamplerConfig:
        """The sampler of an evaluation sample: the run's, with evaluation's own step
        count and guidance."""
        return dataclasses.replace(
            sampler,
            num_steps=sampler.num_steps if self.num_steps is None else self.num_steps,
            guidance_scale=(sampler.guidance_scale if self.guidance_scale is None
                            else self.guidance_scale))


# ------------------------------------------------------------------------ tracking

#: The experiment trackers a run can log to, each through its own library (an optional
#: extra of the package of the same name: ``pip install 'digenrl[wandb]'``).
TRACKERS = ("tensorboard", "wandb", "mlflow")
#: The modes of a W&B run digenrl starts.
WANDB_MODES = ("online", "offline")


@dataclass(frozen=True)
class TrackingConfig:
    """Experiment trackers the run logs to besides its store, after each iteration is committed: every metric of the iteration (metrics/NAME at step = iteration), the held-out evaluation (eval/reward_mean, and each reward's own mean as eval/rewards/NAME, e.g. an OCR reward's held-out accuracy, at step = the evaluated policy version), captioned sample grids, and the resolved config as hyperparameters. The run's tracker runs are kept in the store's attributes, so digenrl run --resume continues them. A tracker that cannot start stops the run before any cluster starts; one that fails later is a warning and the run goes on."""

    backends: tuple[str, ...] = ()
    """The trackers to log to: any of tensorboard, wandb, mlflow (each needs its library: pip install 'digenrl[tensorboard]', [wandb] or [mlflow]); empty logs to the store only."""
    dir: str | None = None
    """Where the trackers write locally: TensorBoard's event files (tensorboard/NAME-TIME/), W&B's run files (wandb/) and, with no mlflow_uri, MLflow's database and artifacts; null: next to the store, STORE-tracking/."""
    project: str = "digenrl"
    """The W&B project and the MLflow experiment the run is logged under."""
    name: str | None = None
    """The tracker run's name (W&B and MLflow display name, TensorBoard run folder prefix); null: the store's name without its extension."""
    image_every: int = 10
    """Log a grid of the iteration's samples (prompt and reward captions) every this many iterations, from iteration 0, and one of each held-out evaluation; 0: no images. Needs store.save_images (a video's samples show as a strip of frames)."""
    images: int = 8
    """Samples per grid: evenly spread over the iteration's samples (the held-out evaluation's: the first prompts)."""
    wandb_mode: str | None = None
    """W&B's mode: online or offline (written locally under dir, for wandb sync later); null: W&B's own setting (WANDB_MODE, else online)."""
    mlflow_uri: str | None = None
    """MLflow's tracking URI (an MLflow server's http(s):// address, a database URI, databricks); null: a SQLite database in dir (sqlite:///DIR/mlflow.db, artifacts in DIR/mlflow-artifacts/; mlflow ui --backend-store-uri shows it)."""

    def validate(self, p: str) -> None:
        require(isinstance(self.backends, tuple), f"{p}.backends", "a list", self.backends)
        for i, name in enumerate(self.backends):
            choice(name, f"{p}.backends[{i}]", TRACKERS)
        require(len(set(self.backends)) == len(self.backends), f"{p}.backends",
                 "each tracker once", list(self.backends))
        for name in ("dir", "name", "mlflow_uri"):
            v = getattr(self, name)
            require(v is None or (isinstance(v, str) and v.strip() != ""), f"{p}.{name}",
                     "null or a non-empty string", v)
        require(isinstance(self.project, str) and self.project.strip() != "",
                 f"{p}.project", "a non-empty string", self.project)
        require(is_int(self.image_every) and self.image_every >= 0, f"{p}.image_every",
                 "an integer >= 0 (0: no images)", self.image_every)
        positive_int(self.images, f"{p}.images")
        if self.wandb_mode is not None:
            choice(self.wandb_mode, f"{p}.wandb_mode", WANDB_MODES)
        for name, tracker in (("wandb_mode", "wandb"), ("mlflow_uri", "mlflow")):
            require(getattr(self, name) is None or tracker in self.backends, f"{p}.{name}",
                     f"null while {p}.backends names no {tracker}", getattr(self, name))

    def logs_images(self, iteration: int) -> bool:
        """Whether iteration ``iteration``'s samples are logged as a grid."""
        return self.image_every > 0 and iteration % self.image_every == 0


# ----------------------------------------------------------------------------- run


@dataclass(frozen=True)
class RunConfig:
    seed: int = 0
    """Seeds every random draw (with the identity of what is drawn)."""
    iterations: int = 40
    """Iterations to run (each publishes one policy version)."""
    model: ModelConfig = field(default_factory=ModelConfig)
    sampler: SamplerConfig = field(default_factory=SamplerConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    store: StoreConfig = field(default_factory=StoreConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        require(is_int(self.seed) and self.seed >= 0, "seed", "a non-negative integer",
                 self.seed)
        positive_int(self.iterations, "iterations")
        for name in _SECTIONS:
            getattr(self, name).validate(name)
        spp = self.data.samples_per_prompt
        chunk = self.rollout.chunk_size
        require(spp % chunk == 0 or chunk % spp == 0, "rollout.chunk_size",
                 f"a divisor or a multiple of data.samples_per_prompt ({spp})", chunk)
        total = self.data.samples_per_iteration
        require(total % chunk == 0, "rollout.chunk_size",
                 f"a divisor of the samples per iteration (data.prompts_per_iteration x "
                 f"data.samples_per_prompt = {total})", chunk)
        a, n = self.algorithm, self.sampler.num_steps
        require(all(t <= n - 2 for t in a.sde_steps), "algorithm.sde_steps",
                 f"steps from 0 to {n - 2} (sampler.num_steps = {n}; the last, near-clean "
                 f"step is never an SDE step of a window)", list(a.sde_steps))
        if self.train.sharding == "fsdp":
            self._check_sharding()
        if self.rollout.context_parallel != 1:
            self._check_context_parallel()
        if not a.coupled:
            require(not self.store.save_latents, "store.save_latents",
                     f"false with algorithm.name {a.name!r} (a decoupled run keeps no "
                     f"trajectory: only each chunk's final latent)", self.store.save_latents)

    def _check_sharding(self) -> None:
        """``train.sharding: fsdp`` needs a gang of at least two workers that train (the
        trainer pool; in colocated mode every worker) and trains every weight. (The
        pools of a cluster the run does not start here are counted when it starts.)"""
        c = self.cluster
        if c.scheduler is None and not c.gpus and self.schedule.options().pools:
            # (In colocated mode its rollout and trainer workers make at least two.)
            require(c.trainer_workers >= 2, "train.sharding",
                     "at least 2 trainer workers for fsdp (cluster.trainer_workers)",
                     c.trainer_workers)
        require(self.train.lora_rank == 0, "train.lora_rank",
                 "0 with train.sharding fsdp (it shards every weight; LoRA adapters train "
                 "unsharded)", self.train.lora_rank)

    def _check_context_parallel(self) -> None:
        """``rollout.context_parallel`` above 1: no more processes than a local cluster
        the run starts gives generation (the rollout pool; in colocated mode every
        worker), and not with a broadcast publish (a process is in one collective group
        at a time, and a broadcast's group spans the rollout workers). What the model
        decides (a plan, heads the degree divides) is the family's check
        (``ModelFamily.check_context_parallel``), which needs its folder."""
        c, degree = self.cluster, self.rollout.context_parallel
        if c.scheduler is None and not c.gpus and degree != AUTO:
            workers = c.rollout_workers if self.schedule.options().pools else c.total_workers
            pools = "cluster.rollout_workers" + (
                "" if self.schedule.options().pools else " + cluster.trainer_workers")
            require(int(degree) <= workers, CONTEXT_PARALLEL_FIELD,
                    f"at most {workers}, the workers that generate in the cluster the run "
                    f"starts ({pools})", degree)
        require(not self.train.broadcasts, CONTEXT_PARALLEL_FIELD,
                "1 when versions are published by collective broadcast (train.weight_sync "
                f"{self.train.weight_sync!r} with train.sharding {self.train.sharding!r}: "
                "its group spans the rollout workers; set train.weight_sync: dask)", degree)

    # Derived totals, logged at start.
    @property
    def chunks_per_iteration(self) -> int:
        return self.data.samples_per_iteration // self.rollout.chunk_size

    @property
    def algorithm_shape(self) -> Algorithm:
        """The algorithm's shape for this run (:mod:`digenrl.algorithms`)."""
        return self.algorithm.shape(self.sampler, self.seed)

    @property
    def micro_steps_per_chunk(self) -> int:
        return self.algorithm_shape.micro_steps_per_chunk()

    @property
    def micro_steps_per_iteration(self) -> int:
        units = self.chunks_per_iteration
        if self.algorithm_shape.pairwise:  # each group's first chunk trains its pairs
            units = min(units, self.data.prompts_per_iteration)
        return units * self.micro_steps_per_chunk

    @property
    def denoise_tasks_per_iteration(self) -> int:
        return self.chunks_per_iteration * self.sampler.num_steps

    def derived(self) -> dict[str, int]:
        return {
            "images_per_iteration": self.data.samples_per_iteration,
            "chunks_per_iteration": self.chunks_per_iteration,
            "denoise_tasks_per_iteration": self.denoise_tasks_per_iteration,
            "micro_steps_per_iteration": self.micro_steps_per_iteration,
            "trained_steps": self.micro_steps_per_chunk,
        }


# ------------------------------------------------------------------ dict <-> config

#: Each section of a run config (a field of RunConfig holding a dataclass) by name.
_SECTIONS: dict[str, type] = {
    f.name: hint for f in dataclasses.fields(RunConfig)
    if isinstance(hint := typing.get_type_hints(RunConfig)[f.name], type)
    and dataclasses.is_dataclass(hint)}


def _coerce(value: Any, hint: Any, path: str) -> Any:
    """Convert a YAML value to the field's declared type, or fail naming the field."""
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        non_none = [a for a in args if a is not type(None)]
        errors = []
        for a in non_none:
            try:
                return _coerce(value, a, path)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0])
    if hint is Any:
        return value
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return _build(hint, value, path)
    if origin is tuple:
        require(isinstance(value, (list, tuple)), path, "a list", value)
        item = args[0] if args else Any
        return tuple(_coerce(v, item, f"{path}[{i}]") for i, v in enumerate(value))
    if origin in (collections.abc.Mapping, dict) or hint in (dict, Mapping):
        require(isinstance(value, Mapping), path, "a mapping", value)
        vt = args[1] if len(args) == 2 else Any
        return {str(k): _coerce(v, vt, sub_path(path, k)) for k, v in value.items()}
    if hint is bool:
        require(isinstance(value, bool), path, "true or false", value)
        return value
    if hint is int:
        require(is_int(value), path, "an integer", value)
        return value
    if hint is float:
        if isinstance(value, str):
            # YAML 1.1 reads 1e-4 (no dot) as a string; accept what float() accepts.
            try:
                return float(value)
            except ValueError:
                pass
        require(isinstance(value, (int, float)) and not isinstance(value, bool), path,
                 "a number", value)
        return float(value)
    if hint is str:
        require(isinstance(value, str), path, "a string", value)
        return value
    if hint is type(None):
        require(value is None, path, "null", value)
        return None
    return value


def _build(cls: type, data: Any, path: str) -> Any:
    require(isinstance(data, Mapping), path or "config", "a mapping", data)
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in data.items():
        sub = sub_path(path, key)
        if key not in names:
            raise ConfigError(f"{sub}: unknown field; valid fields of "
                              f"{path or 'the config'} are {sorted(names)}")
        if cls is RunConfig and key in _SECTIONS:
            kwargs[key] = _build(_SECTIONS[key], value if value is not None else {}, key)
        else:
            kwargs[key] = _coerce(value, hints[key], sub)
    return cls(**kwargs)


def algorithm_defaults(data: Mapping[str, Any]) -> dict[str, Any]:
    """The settings of the algorithm ``data`` names (``algorithm.name``, else the default
    algorithm) that ``data`` leaves unset, as dotted fields and the algorithm's values
    with the dynamics ``data`` names (``Algorithm.defaults_for``). An unknown name has
    none (validation names it)."""
    section = data.get("algorithm") if isinstance(data, Mapping) else None
    section = {} if section is None else section
    name = section.get("name", DEFAULT_ALGORITHM) if isinstance(section, Mapping) else None
    alg = ALGORITHMS.get(name) if isinstance(name, str) else None
    if alg is None:
        return {}
    out = {}
    for dotted, value in alg.defaults_for(section.get("dynamics")).items():
        *sections, leaf = dotted.split(".")
        node: Any = data
        for part in sections:
            node = node.get(part) if isinstance(node, Mapping) else None
        # A section that is not a mapping is left for validation to name.
        if node is None or (isinstance(node, Mapping) and node.get(leaf) is None):
            out[dotted] = value
    return out


def config_from_dict(data: Mapping[str, Any]) -> RunConfig:
    """Build and validate a :class:`RunConfig` from nested plain data, each setting it
    leaves unset that its algorithm has a default for taking that default
    (:func:`algorithm_defaults`)."""
    unset = algorithm_defaults(data)
    if unset:
        data = apply_overrides(dict(data), unset)
    return _build(RunConfig, data, "")


def stored_section(data: Mapping[str, Any] | None, cls: type) -> Any:
    """Section ``cls`` (e.g. :class:`EvalConfig`) of a stored config's plain data: its
    fields that data has, the defaults for the others (a field it does not know is
    left out), and nothing else of the config read or checked -- for reading a store
    where the run's folders and files may not be."""
    name = next(n for n, c in _SECTIONS.items() if c is cls)
    section = (data or {}).get(name) or {}
    known = {f.name for f in dataclasses.fields(cls)}
    return _build(cls, {k: v for k, v in section.items() if k in known}, name)


def _plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, tuple):
        return [_plain(v) for v in value]
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    return value


def config_to_dict(config: RunConfig) -> dict[str, Any]:
    """The resolved configuration as plain data (saved with every run)."""
    return _plain(config)


def apply_overrides(data: dict[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """Set dotted keys (``train.learning_rate``) in nested plain config data."""
    out = {k: (dict(v) if isinstance(v, Mapping) else v) for k, v in data.items()}
    for dotted, value in overrides.items():
        parts = dotted.split(".")
        require(all(p.strip() == p and p for p in parts), dotted,
                 "a field path such as train.learning_rate", dotted)
        node = out
        for part in parts[:-1]:
            child = node.get(part)
            if child is None:
                child = {}
            elif not isinstance(child, Mapping):
                raise ConfigError(f"{dotted}: {part!r} is not a section")
            node[part] = child = dict(child)
            node = child
        node[parts[-1]] = value
    return out


def load_config(path: str | Path | None = None,
                overrides: Mapping[str, Any] | None = None) -> RunConfig:
    """Read a YAML config (or the defaults), apply dotted overrides, validate."""
    data: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config: expected an existing YAML file, got {str(path)!r}")
        try:
            loaded = yaml.safe_load(p.read_text())
        except yaml.YAMLError as e:
            raise ConfigError(f"config: expected valid YAML in {str(path)!r}: {e}") from None
        if loaded is not None:
            require(isinstance(loaded, Mapping), "config", "a YAML mapping at the top",
                     type(loaded).__name__)
            data = dict(loaded)
    if overrides:
        data = apply_overrides(data, overrides)
    config = config_from_dict(data)
    _check_tiny_fields(data, config.model)
    return config


# ---------------------------------------------------------------- reference docs


def field_docs() -> dict[str, dict[str, str]]:
    """Each config dataclass's field -> the docstring under it (read from this source;
    the ``schedule`` section's from the switches' declarations)."""
    import ast
    import inspect

    tree = ast.parse(inspect.getsource(__import__(__name__, fromlist=["_"])))
    out: dict[str, dict[str, str]] = {}
    for node in tree.body:
        if not isinstance(node, ast.ClassDef):
            continue
        docs: dict[str, str] = {}
        body = node.body
        for a, b in zip(body, body[1:]):
            if isinstance(a, ast.AnnAssign) and isinstance(a.target, ast.Name) and \
                    isinstance(b, ast.Expr) and isinstance(b.value, ast.Constant) and \
                    isinstance(b.value.value, str):
                docs[a.target.id] = " ".join(b.value.value.split())
        out[node.name] = docs
    out["ScheduleConfig"] = _schedule_docs()
    return out


def reference_markdown() -> str:
    """docs/configuration.md: every section and field, its type, default and meaning."""
    docs = field_docs()
    lines = ["# Configuration reference", "",
             "Generated from the dataclasses in `digenrl/config.py` and the switches "
             "declared in `digenrl/schedulers/switches.py` "
             "(`python -c \"from digenrl.config import reference_markdown; "
             "print(reference_markdown())\" > docs/configuration.md`). A YAML config sets "
             "any of these; `digenrl run --set SECTION.FIELD=VALUE` overrides one.", ""]
    top = [f for f in dataclasses.fields(RunConfig) if f.name not in _SECTIONS]
    sections: list[tuple[str, type, Sequence[dataclasses.Field]]] = [
        ("(top level)", RunConfig, top)]
    for name, cls in _SECTIONS.items():
        sections.append((name, cls, dataclasses.fields(cls)))
        # A mapping of name -> settings (reward.remote): its settings get a table too.
        for f in dataclasses.fields(cls):
            args = typing.get_args(typing.get_type_hints(cls)[f.name])
            if len(args) == 2 and isinstance(args[1], type) and dataclasses.is_dataclass(args[1]):
                sections.append((f"{name}.{f.name}.NAME", args[1],
                                 dataclasses.fields(args[1])))
    for title, cls, fields in sections:
        lines += [f"## `{title}`" if title != "(top level)" else "## top level", ""]
        doc = " ".join((cls.__doc__ or "").split()) if cls is not RunConfig else ""
        if doc:
            lines += [doc, ""]
        lines += ["| field | type | default | meaning |", "|---|---|---|---|"]
        hints = typing.get_type_hints(cls)
        for f in fields:
            if f.default is not dataclasses.MISSING:
                default = f.default
            else:
                assert callable(f.default_factory)  # (every field has a default)
                default = f.default_factory()
            shown = json_default(default)
            kind = (str(hints[f.name]).replace("typing.", "").replace("<class '", "")
                    .replace("'>", "").replace("digenrl.config.", "").replace("|", "\\|"))
            lines.append(f"| `{f.name}` | `{kind}` | `{shown}` | "
                         f"{docs.get(cls.__name__, {}).get(f.name, '')} |")
        lines.append("")
    return "\n".join(lines)


def json_default(value: Any) -> str:
    import json

    return json.dumps(_plain(value))
