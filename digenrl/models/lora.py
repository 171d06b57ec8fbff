"""What of the transformer trains: all its weights, or LoRA adapters through peft.

With ``train.lora_rank`` 0 every parameter of the transformer trains (full fine-tuning).
With a rank above 0, peft LoRA adapters are added to the modules ``train.lora_targets``
names (the family's attention projections by default) and only they train: each
targeted linear layer ``W`` computes ``W x + (alpha / r) B A x``. The adapters start as
peft initialises them, ``A`` kaiming-uniform random and ``B`` zero, so version 0 equals
the base model; ``A``'s draw is seeded by the model seed, so version 0 is the same bits
on every run with that seed.

The frozen base weights are loaded once per worker and never travel: a policy version
(``PolicyWeights``), a checkpoint and the gradients hold the trainable tensors only.
Frozen weights and the forward pass run in ``model.dtype``; the trainable tensors stay
float32 (so do the AdamW moments, and the SDE step, log-probs and loss downstream).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING

import torch

from digenrl.config import ConfigError, ModelConfig, TrainConfig
from digenrl.models import build_transformer, family
from digenrl.models.parts import BUILDING, TORCH_DTYPES
from digenrl.seeding import INIT_DRAW, stable_seed

if TYPE_CHECKING:
    from diffusers import ModelMixin

__all__ = ["Trainable", "trainable_spec", "build_policy", "trainable_parameters",
           "cast_for_forward", "check_targets", "lora_config", "adapters_off"]


@dataclass(frozen=True)
class Trainable:
    """What trains and how the training forward pass runs (static per run)."""

    lora_rank: int = 0  # 0: every weight trains
    lora_alpha: float = 0.0
    lora_targets: tuple[str, ...] = ()
    gradient_checkpointing: bool = False

    @property
    def lora(self) -> bool:
        return self.lora_rank > 0


def trainable_spec(model: ModelConfig, train: TrainConfig) -> Trainable:
    """The run's :class:`Trainable`: the configured targets, else those of the family's
    default the transformer has (a one-block SD3 has no ``to_add_out``)."""
    if train.lora_rank == 0:
        return Trainable(gradient_checkpointing=train.gradient_checkpointing)
    targets = train.lora_targets or tuple(
        t for t in family(model).lora_targets if _matches(t, _module_names(model)))
    alpha = train.lora_alpha if train.lora_alpha is not None else float(train.lora_rank)
    return Trainable(train.lora_rank, float(alpha), tuple(targets),
                     train.gradient_checkpointing)


def lora_config(spec: Trainable):
    """The peft ``LoraConfig`` of ``spec`` (peft's default init: A kaiming, B zero)."""
    from peft import LoraConfig

    return LoraConfig(r=spec.lora_rank, lora_alpha=spec.lora_alpha,
                      target_modules=list(spec.lora_targets), init_lora_weights=True)


def build_policy(model: ModelConfig, spec: Trainable, seed: int) -> torch.nn.Module:
    """The transformer in float32 with version 0's trainable weights: the model's own,
    or with zero-effect LoRA adapters (``A`` drawn from the model seed) added."""
    with BUILDING:
        module: ModelMixin = build_transformer(model, seed)
        if spec.lora:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(stable_seed(seed, INIT_DRAW, "lora"))
                module.add_adapter(lora_config(spec))  # freezes everything but the adapters
    if spec.gradient_checkpointing:
        module.enable_gradient_checkpointing()
    return module


@contextmanager
def adapters_off(module: ModelMixin):
    """``module`` computing as its base model: its LoRA adapters switched off (peft's
    switch, through diffusers' ``disable_adapters``) and on again after, so the frozen
    reference of a KL term or of DPO needs no copy of any weight. Switching them off also
    stops their gradients (peft), so call this before the forward pass that trains."""
    module.disable_adapters()
    try:
        yield module
    finally:
        module.enable_adapters()


def trainable_parameters(module: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """The parameters that train, by name: the adapters, or all without LoRA."""
    return {n: p for n, p in module.named_parameters() if p.requires_grad}


def cast_for_forward(module: torch.nn.Module, model: ModelConfig,
                     spec: Trainable, parameters: bool = True) -> torch.nn.Module:
    """Frozen weights (and, in full fine-tuning, the working copy of the trained ones) in
    ``model.dtype``, except the modules the diffusers class keeps in float32
    (``_keep_in_fp32_modules``); LoRA adapters stay float32. With ``parameters`` False
    only the buffers (a sharded module's parameters are cast as they are gathered).
    Returns ``module``."""
    dtype = TORCH_DTYPES[model.dtype]
    if dtype == torch.float32:
        return module
    adapters = set(trainable_parameters(module)) if spec.lora else set()
    keep = set(getattr(module, "_keep_in_fp32_modules", None) or ())
    tensors = (list(module.named_parameters()) if parameters else []) \
        + list(module.named_buffers())
    for name, t in tensors:
        if t.is_floating_point() and name not in adapters \
                and not keep.intersection(name.split(".")):
            t.data = t.data.to(dtype)
    return module


def _matches(target: str, names) -> list[str]:
    """The module names ``target`` selects, as peft matches a list of names."""
    return [n for n in names if n == target or n.endswith("." + target)]


@lru_cache(maxsize=16)
def _module_names(model: ModelConfig) -> dict[str, type]:
    """Every module of the transformer by name, built without weights."""
    fam = family(model)
    with BUILDING, torch.device("meta"):
        module = fam.transformer_class.from_config(fam.transformer_config())
    return {n: type(m) for n, m in module.named_modules()}


def check_targets(model: ModelConfig, train: TrainConfig) -> None:
    """Every ``train.lora_targets`` entry names linear layers the transformer has (as
    peft matches them: the module's full name or its last dotted parts)."""
    if train.lora_rank == 0:
        return
    names = _module_names(model)
    supported = (torch.nn.Linear, torch.nn.Conv2d, torch.nn.Conv3d)
    field = "train.lora_targets"
    for target in trainable_spec(model, train).lora_targets:
        hits = _matches(target, names)
        if not hits:
            raise ConfigError(f"{field}: expected names of modules the transformer has "
                              f"(e.g. {', '.join(family(model).lora_targets[:3])}), got "
                              f"{target!r} (no such module)")
        bad = [n for n in hits if not issubclass(names[n], supported)]
        if bad:
            raise ConfigError(f"{field}: expected linear or convolution layers, got "
                              f"{target!r} ({bad[0]} is a {names[bad[0]].__name__})")
