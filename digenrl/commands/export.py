"""``digenrl export``: a trained policy version from a run's store, in the form diffusers
loads.

* LoRA runs (``train.lora_rank`` > 0): ``DIR/pytorch_lora_weights.safetensors``, written by
  the family pipeline's own ``save_lora_weights`` (adapter names as peft's
  ``get_peft_model_state_dict`` gives them, under ``transformer.``, with the adapter's
  rank, alpha and targets as metadata), so ``pipeline.load_lora_weights(DIR)`` applies it
  to the pipeline the run trained.
* Full fine-tuning: ``DIR/transformer/`` (config and safetensors weights) from the
  transformer's ``save_pretrained``, so ``<TransformerClass>.from_pretrained(DIR,
  subfolder="transformer")`` loads it (and a copy of the pipeline folder with that
  ``transformer/`` in place is the trained pipeline).

Weights are written in float32 (how the run holds its trained tensors). The versions a
store holds are its final weights, its complete checkpoints and its complete sharded
checkpoints (:mod:`digenrl.store.sharded`, read whole in this process whatever number of
ranks wrote them); the default is the newest.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from digenrl.config import RunConfig, config_from_dict
from digenrl.models.lora import build_policy, trainable_spec
from digenrl.models import family, model_seed
from digenrl.store.checkpoints import complete_checkpoints, read_checkpoint, read_weights
from digenrl.store.sharded import read_sharded, sharded_checkpoints
from digenrl.store import StoreError, read_attrs

if TYPE_CHECKING:
    from diffusers import ModelMixin

__all__ = ["Exported", "export", "stored_versions", "LORA_WEIGHTS"]

#: The file name ``load_lora_weights(DIR)`` looks for.
LORA_WEIGHTS = "pytorch_lora_weights.safetensors"
#: The pipeline class whose LoRA format the built-in (SD3-shaped) model uses.
_TINY_PIPELINE = "StableDiffusion3Pipeline"


@dataclass
class Exported:
    version: int
    lora: bool
    path: Path  # the file (LoRA) or folder (full) written


def stored_versions(store: str) -> list[int]:
    """The policy versions whose trainable weights ``store`` holds."""
    final, _ = read_weights(store)
    return sorted(set(complete_checkpoints(store)) | set(sharded_checkpoints(store))
                  | ({final} if final is not None else set()))


def stored_config(store: str) -> RunConfig:
    if not (Path(store) / "zarr.json").is_file():
        raise StoreError(f"store: expected an existing digenrl store, got {store!r}")
    attrs = read_attrs(store)
    if "config" not in attrs:
        raise StoreError(f"store: {store!r} holds no digenrl run config")
    return config_from_dict(attrs["config"])


def version_weights(store: str, version: int | None) -> tuple[int, dict[str, torch.Tensor]]:
    """``version`` (default: the newest the store holds) and its trainable tensors."""
    versions = stored_versions(store)
    if not versions:
        raise StoreError(f"store: expected a run with at least one complete policy version, "
                         f"got none in {store!r}")
    if version is None:
        version = versions[-1]
    if version not in versions:
        raise StoreError(f"--version: expected one of the versions {store!r} holds "
                         f"{versions}, got {version}")
    final, arrays = read_weights(store)
    if version != final and version not in complete_checkpoints(store):
        return version, read_sharded(store, version)[0]["params"]
    if version != final:
        arrays = read_checkpoint(store, version)[0]["params"]
    return version, {n: torch.from_numpy(np.array(a)) for n, a in arrays.items()}


def policy_module(config: RunConfig, tensors: dict[str, torch.Tensor]) -> torch.nn.Module:
    """The run's transformer (float32) holding ``tensors``: what the run computes with."""
    module = build_policy(config.model, trainable_spec(config.model, config.train),
                          model_seed(config.model, config.seed))
    missing = set(tensors) - set(module.state_dict())
    if missing:
        raise StoreError(f"store: expected weights of the run's transformer, got unknown "
                         f"tensors {sorted(missing)[:3]}")
    module.load_state_dict(tensors, strict=False)
    return module.eval()


def pipeline_class(config: RunConfig):
    import diffusers

    return getattr(diffusers, family(config.model).pipeline_class or _TINY_PIPELINE)


def export(store: str, out: str | Path, version: int | None = None) -> Exported:
    """Write ``version`` of the run in ``store`` to the folder ``out``."""
    config = stored_config(str(store))
    version, tensors = version_weights(str(store), version)
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise StoreError(f"DIR: expected a new or empty folder, got {str(out)!r}")
    module: ModelMixin = policy_module(config, tensors)
    if trainable_spec(config.model, config.train).lora:
        from peft.utils import get_peft_model_state_dict

        layers = get_peft_model_state_dict(module)
        metadata = module.peft_config["default"].to_dict()
        pipeline_class(config).save_lora_weights(out, transformer_lora_layers=layers,
                                                 transformer_lora_adapter_metadata=metadata)
        return Exported(version, True, out / LORA_WEIGHTS)
    module.save_pretrained(out / "transformer")
    return Exported(version, False, out / "transformer")
