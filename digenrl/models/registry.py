"""Model families by the pipeline class a folder's ``model_index.json`` names.

Adding a family is one module with a :class:`~digenrl.models.base.ModelFamily`
subclass and one entry in :data:`FAMILIES`.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

from digenrl.config import ConfigError, ModelConfig
from digenrl.models.base import ModelFamily
from digenrl.models.flux import FluxFamily
from digenrl.models.hunyuanvideo import HunyuanVideoFamily
from digenrl.models.kontext import FluxKontextFamily
from digenrl.models.parts import read_json
from digenrl.models.qwenimage import QwenImageEditFamily, QwenImageFamily
from digenrl.models.sd3 import SD3Family
from digenrl.models.tiny import TinyFamily
from digenrl.models.wan import WanFamily

__all__ = ["FAMILIES", "family", "family_class"]

#: ``model_index.json`` ``_class_name`` -> family.
FAMILIES: dict[str, type[ModelFamily]] = {
    f.pipeline_class: f for f in (SD3Family, FluxFamily, WanFamily, QwenImageFamily,
                                  HunyuanVideoFamily, QwenImageEditFamily, FluxKontextFamily)
}


def family_class(cfg: ModelConfig) -> type[ModelFamily]:
    """The family of ``cfg``: the built-in model without a folder (or for a folder of
    parts without ``model_index.json``), else the folder's pipeline class's."""
    if cfg.path is None:
        return TinyFamily
    index = Path(cfg.path).expanduser() / "model_index.json"
    if not index.is_file():
        return TinyFamily
    try:
        name = read_json(index).get("_class_name")
    except ValueError as e:
        raise ConfigError(f"model.path: expected a readable model_index.json in "
                          f"{cfg.path!r}, got invalid JSON ({e})") from None
    if name not in FAMILIES:
        raise ConfigError(f"model.path: expected a pipeline folder of class "
                          f"{' / '.join(sorted(FAMILIES))}, got {name!r} in {cfg.path!r}")
    return FAMILIES[name]


@lru_cache(maxsize=16)
def family(cfg: ModelConfig) -> ModelFamily:
    """The family adapter for ``cfg`` (one per config and process)."""
    return family_class(cfg)(cfg)
