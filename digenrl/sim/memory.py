"""What one GPU holds, per role: the memory model of a cost profile's ``model`` section.

A profile that sets ``model.params`` (billions of parameters) and ``model.gpu_memory_gb``
is checked against its GPUs' memory:

* a rollout GPU holds the policy's weights in bf16 (2 bytes a parameter) and
  ``rollout_activations_gb`` beside them (activations, text encoders, VAE), plus
  ``sample_activations_gb`` per sample of its chunk (one sample's activations in a
  denoise forward; 0 unless set), divided by the context-parallel degree: each of a
  step's ``d`` GPUs holds ``1/d`` of the tokens;
* a trainer GPU holds 16 bytes a parameter (fp32 master weights, fp32 gradients and
  the two fp32 AdamW moments), divided among the ``k`` trainers with
  ``sharding: fsdp`` (each holds ``1/k`` of them) and whole without, plus
  ``trainer_activations_gb`` (the activations a micro-step keeps, and FSDP's
  gathered layers);
* a co-located GPU (the ``colocated`` mode, where every GPU generates and trains and
  FSDP shards over all of them) holds both.

Gigabytes are 1e9 bytes. A profile without ``model.params`` models no memory and
checks none.
"""

from __future__ import annotations

from dataclasses import dataclass
from digenrl.checks import require
from digenrl.vocabulary import GB

__all__ = ["Model", "MemoryPerGpu", "BF16_BYTES", "FP32_BYTES", "TRAINER_BYTES_PER_PARAM",
           "SHARDINGS"]

#: Bytes of one parameter in the weights a rollout GPU samples with (bf16).
BF16_BYTES = 2
#: Bytes of one parameter's gradient as FSDP reduces it (fp32).
FP32_BYTES = 4
#: Bytes a trainer holds per parameter: fp32 master weights, fp32 gradients and the two
#: fp32 AdamW moments.
TRAINER_BYTES_PER_PARAM = 16
#: ``model.sharding``: ``none`` (each trainer holds the whole state) or ``fsdp``.
SHARDINGS = ("none", "fsdp")


@dataclass(frozen=True)
class MemoryPerGpu:
    """Gigabytes one GPU holds in each role, and what it has."""

    rollout_gb: float
    trainer_gb: float
    colocated_gb: float
    gpu_memory_gb: float
    shards: int          # ranks the trainer state is divided among (disaggregated pools)
    colocated_shards: int

    def line(self) -> str:
        """One line for ``digenrl simulate``."""
        of = f" of {self.gpu_memory_gb:g} GB" if self.gpu_memory_gb else ""
        return (f"memory per GPU{of}: rollout {self.rollout_gb:.1f} GB, trainer "
                f"{self.trainer_gb:.1f} GB (state over {self.shards}), colocated "
                f"{self.colocated_gb:.1f} GB (state over {self.colocated_shards})")


@dataclass(frozen=True)
class Model:
    """A profile's ``model`` section: its size, how training shards it, its GPUs' memory."""

    params: float = 0.0                 # billions of parameters; 0: memory not modelled
    sharding: str = "none"              # none | fsdp
    gpu_memory_gb: float = 0.0          # per GPU; 0: not checked
    rollout_activations_gb: float = 0.0  # beside the bf16 weights on a rollout GPU
    trainer_activations_gb: float = 0.0  # beside the trainer state on a trainer GPU
    #: One sample's activations in a denoise forward (a rollout GPU holds a chunk's,
    #: split over the context-parallel degree); 0: counted in rollout_activations_gb.
    sample_activations_gb: float = 0.0

    @property
    def fsdp(self) -> bool:
        return self.sharding == "fsdp"

    @property
    def weight_bytes(self) -> float:
        """The bf16 weights of one policy version."""
        return BF16_BYTES * self.params * GB

    @property
    def grad_bytes(self) -> float:
        """The fp32 gradients of one optimizer step."""
        return FP32_BYTES * self.params * GB

    def rollout_gb(self, samples: int = 1, degree: int = 1) -> float:
        """A rollout GPU's gigabytes while a chunk of ``samples`` is denoised at
        context-parallel ``degree`` (its activations split over the ``degree`` GPUs)."""
        return (self.weight_bytes / GB + self.rollout_activations_gb
                + samples * self.sample_activations_gb / degree)

    def free_for_samples_gb(self) -> float:
        """What a rollout GPU has beside its weights and fixed activations for the
        chunk's samples (infinite when the GPU's memory is not given)."""
        if not self.gpu_memory_gb:
            return float("inf")
        return self.gpu_memory_gb - self.weight_bytes / GB - self.rollout_activations_gb

    def trainer_gb(self, ranks: int) -> float:
        """A trainer GPU's gigabytes when the trainer state is trained on ``ranks`` GPUs."""
        state = TRAINER_BYTES_PER_PARAM * self.params / (ranks if self.fsdp else 1)
        return state + self.trainer_activations_gb

    def per_gpu(self, rollout_workers: int, trainer_workers: int, *, samples: int = 1,
                degree: int = 1) -> MemoryPerGpu:
        """Each role's gigabytes on pools of these sizes (co-located: the state sharded
        over all of their GPUs), chunks of ``samples`` denoised at context-parallel
        ``degree``."""
        gpus = rollout_workers + trainer_workers
        rollout = self.rollout_gb(samples, degree)
        return MemoryPerGpu(
            rollout_gb=rollout, trainer_gb=self.trainer_gb(trainer_workers),
            colocated_gb=rollout + self.trainer_gb(gpus),
            gpu_memory_gb=self.gpu_memory_gb, shards=trainer_workers if self.fsdp else 1,
            colocated_shards=gpus if self.fsdp else 1)

    def check(self, rollout_workers: int, trainer_workers: int, *, colocated: bool,
              error: type[Exception], path: str = "profile.model", samples: int = 1,
              degree: int = 1) -> None:
        """Refuse, in one line naming ``gpu_memory_gb``, pools whose GPUs cannot hold
        their roles (``colocated``: both roles on each GPU; else each pool its own), with
        chunks of ``samples`` denoised at context-parallel ``degree``."""
        if not (self.params and self.gpu_memory_gb):
            return
        m = self.per_gpu(rollout_workers, trainer_workers, samples=samples, degree=degree)
        weights = f"{BF16_BYTES} bytes x {self.params:g}e9 params"
        per_sample = (f" + {samples} x {self.sample_activations_gb:g} GB / degree {degree}"
                      if self.sample_activations_gb else "")
        rollout = (f"{m.rollout_gb:.1f} GB a rollout GPU holds ({weights} + "
                   f"{self.rollout_activations_gb:g} GB{per_sample})")

        def trainer(gb: float, ranks: int) -> str:
            shard = f" / {ranks} ranks" if self.fsdp else ""
            return (f"{gb:.1f} GB a trainer GPU holds ({TRAINER_BYTES_PER_PARAM} bytes x "
                    f"{self.params:g}e9 params{shard} + {self.trainer_activations_gb:g} GB)")

        field = f"{path}.gpu_memory_gb"
        gpus = rollout_workers + trainer_workers
        if colocated:
            need = m.colocated_gb
            require(need <= self.gpu_memory_gb, field,
                    f"at least the {need:.1f} GB a co-located GPU holds: the "
                    f"{rollout} and the {trainer(self.trainer_gb(gpus), gpus)}",
                    self.gpu_memory_gb, error)
            return
        require(m.rollout_gb <= self.gpu_memory_gb, field, f"at least the {rollout}",
                self.gpu_memory_gb, error)
        require(m.trainer_gb <= self.gpu_memory_gb, field,
                f"at least the {trainer(m.trainer_gb, trainer_workers)}", self.gpu_memory_gb,
                error)

    def validate(self, error: type[Exception], path: str = "profile.model") -> None:
        """Refuse a sharding it does not know, or sharding or memory without a size."""
        require(self.sharding in SHARDINGS, f"{path}.sharding", f"one of {list(SHARDINGS)}",
                self.sharding, error)
        if self.fsdp or self.gpu_memory_gb:
            require(self.params > 0, f"{path}.params",
                    "a number > 0 (billions of parameters) with sharding fsdp or "
                    "gpu_memory_gb", self.params, error)
