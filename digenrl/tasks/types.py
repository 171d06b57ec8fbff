"""What travels between tasks: latents, log-probs, rewards, gradients, weight versions."""

from __future__ import annotations

from dataclasses import dataclass, field, fields, is_dataclass

import numpy as np
import torch
from dask.sizeof import sizeof

from digenrl.models.base import Conditioning
from digenrl.serving import wire

__all__ = ["PolicyWeights", "TrainerState", "Latents", "StepOut", "DecodeOut", "RewardOut",
           "AdvantageOut", "MicroStats", "GradOut", "IterationStats", "Conditioning"]


@dataclass
class PolicyWeights:
    """The trainable weights of one policy version.

    They travel as Dask data: every weight of the transformer in full fine-tuning (a
    few MB for the default model), only the LoRA adapters with ``train.lora_rank``. A
    large model trained in full is to be broadcast from the trainers instead
    (:mod:`digenrl.tasks.broadcast`), only its manifest travelling through Dask.
    """

    version: int
    tensors: dict[str, torch.Tensor]
    #: These are a sampling copy (DiffusionNFT's slowly moving average, what the version's
    #: rollouts sample with), not the trained weights of the version.
    sampling_copy: bool = False
    #: The weights were broadcast (``train.weight_sync``): no tensors travel, every worker
    #: of the run's collective group holds the version in its resident transformer. A
    #: worker outside it reads the version from its sharded checkpoint in ``store``.
    held: bool = False
    store: str | None = None

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


@dataclass
class TrainerState:
    """Weights plus AdamW state: what ``optimize`` consumes and produces; with an
    algorithm that samples with a copy of its own (DiffusionNFT), that copy too."""

    version: int
    params: dict[str, torch.Tensor]
    exp_avg: dict[str, torch.Tensor]
    exp_avg_sq: dict[str, torch.Tensor]
    step: int = 0
    sampling: dict[str, torch.Tensor] | None = None


@dataclass
class Latents:
    """The starting noise x_0 of a chunk's samples, and their prompts' conditioning
    (encoded on the rollout worker that drew the noise; it travels with the chunk)."""

    sample_ids: tuple[int, ...]
    x: torch.Tensor
    cond: Conditioning | None = None


@dataclass
class StepOut:
    """One denoising step of a chunk: the next latent and, for an SDE step, its
    log-probability (None for an ODE step)."""

    sample_ids: tuple[int, ...]
    timestep: int
    latent: torch.Tensor
    log_prob: torch.Tensor | None
    version: int
    cond: Conditioning | None = None  # the chunk's conditioning, passed along the chain
    #: The SDE step's mean, where the training reads it (GRPO-Guard); else None.
    mean: torch.Tensor | None = None


@dataclass
class DecodeOut:
    sample_ids: tuple[int, ...]
    images: np.ndarray            # (n, H, W, 3) uint8; videos (n, F, H, W, 3)
    log_probs: np.ndarray         # (n, num_steps) float32 at rollout, NaN at ODE steps;
                                  # (n, 0) for a decoupled algorithm
    behaviour_version: int
    latents: np.ndarray | None = None  # (n, num_steps + 1, C, h, w) when asked for


@dataclass
class RewardOut:
    sample_ids: tuple[int, ...]
    rewards: np.ndarray           # (n,) float64, NaN where invalid
    components: dict[str, np.ndarray]
    valid: np.ndarray             # (n,) bool
    problems: list[str] = field(default_factory=list)


@dataclass
class AdvantageOut:
    group: int
    sample_ids: tuple[int, ...]
    advantages: np.ndarray        # (n,) float32, 0 where invalid
    valid: np.ndarray             # (n,) bool


@dataclass
class MicroStats:
    """Sums and maxima over the samples of micro-steps, combined by ``reduce``."""

    count: int = 0
    loss_sum: float = 0.0
    kl_sum: float = 0.0
    approx_kl_sum: float = 0.0
    clipped: int = 0
    importance_weight_sum: float = 0.0
    truncated: int = 0
    staleness_sum: int = 0
    ratio_dev: float = 0.0          # max |ratio - 1| at the first micro-step, on-policy
    ratio_dev_count: int = 0        # how many samples that maximum was taken over

    def combine(self, other: "MicroStats") -> "MicroStats":
        return MicroStats(
            count=self.count + other.count,
            loss_sum=self.loss_sum + other.loss_sum,
            kl_sum=self.kl_sum + other.kl_sum,
            approx_kl_sum=self.approx_kl_sum + other.approx_kl_sum,
            clipped=self.clipped + other.clipped,
            importance_weight_sum=self.importance_weight_sum + other.importance_weight_sum,
            truncated=self.truncated + other.truncated,
            staleness_sum=self.staleness_sum + other.staleness_sum,
            ratio_dev=max(self.ratio_dev, other.ratio_dev),
            ratio_dev_count=self.ratio_dev_count + other.ratio_dev_count,
        )


@dataclass
class GradOut:
    grads: dict[str, torch.Tensor]
    stats: MicroStats


@dataclass
class IterationStats:
    iteration: int
    version: int                  # the version this iteration published
    micro: MicroStats
    grad_norm: float
    weight_bytes: int = 0         # bytes of the published version (what travels to workers)


def payload_bytes(value) -> int:
    """The bytes of the tensors and arrays ``value`` carries (in dataclasses, mappings and
    sequences, exactly: no sampling). What Dask counts as the size of a result of these
    types -- its memory, its transfer cost, the scheduler plugin's input locality and
    the ``tasks`` records' ``nbytes`` -- rather than the few dozen bytes of the Python
    object holding them."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, np.ndarray):
        return int(value.nbytes)
    if is_dataclass(value) and not isinstance(value, type):
        return sum(payload_bytes(getattr(value, f.name)) for f in fields(value))
    if isinstance(value, dict):
        return sum(payload_bytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(payload_bytes(v) for v in value)
    return 0  # a number, a string, None: nothing next to the tensors


def travels(*classes: type) -> None:
    """``classes`` are results that travel between workers: Dask sizes each by the
    tensors it carries and sends it as those tensors' bytes plus a plain-data header
    (``wire.py``), never pickled."""
    for cls in classes:
        sizeof.register(cls)(payload_bytes)
    wire.register(*classes)


#: The results of these types that travel (the optimizer step's, in ``train.py``, too).
TRAVELLING = (PolicyWeights, TrainerState, Latents, StepOut, DecodeOut, RewardOut,
              AdvantageOut, GradOut, IterationStats, Conditioning, MicroStats)

travels(*TRAVELLING)
