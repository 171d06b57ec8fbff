"""Loading a pipeline folder's parts the way diffusers does: ``model_index.json`` names
each part's library and class; the part is that class's ``from_pretrained`` of its
subfolder."""

from __future__ import annotations

import importlib
import json
from functools import lru_cache
from pathlib import Path
from typing import Any, Sequence

import torch

from digenrl.config import ConfigError

__all__ = ["part_class", "load_part", "TORCH_DTYPES", "check_tokens", "load_tokenizer",
           "read_json"]

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16,
                "float16": torch.float16}


def read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())


def part_class(folder: Path, part: str):
    library, name = read_json(folder / "model_index.json")[part]
    return getattr(importlib.import_module(library), name)


def load_part(folder: Path, part: str, **kwargs):
    """``part`` of the pipeline folder, e.g. ``text_encoder_2`` or ``tokenizer``."""
    return part_class(folder, part).from_pretrained(folder / part, **kwargs)


@lru_cache(maxsize=32)
def load_tokenizer(folder: Path, part: str):
    """A tokenizer of the folder (cached: config validation reads them repeatedly)."""
    return load_part(folder, part)


def check_tokens(tokenizer, part: str, named: Sequence[tuple[str, str]],
                 max_length: int | None = None) -> None:
    """Every ``(field, prompt)`` tokenizes without unknown tokens (and, with
    ``max_length``, within that many tokens): a prompt the text encoder would see as
    noise fails here, naming its field."""
    unk = tokenizer.unk_token_id
    for field, prompt in named:
        ids = tokenizer(prompt).input_ids
        # Without special tokens: CLIP's unknown token is also its end-of-text token.
        if unk is not None and unk in tokenizer(prompt, add_special_tokens=False).input_ids:
            raise ConfigError(
                f"{field}: expected text the folder's {part} ({type(tokenizer).__name__}) "
                f"can encode, got {prompt!r} (it has unknown tokens)")
        if max_length is not None and len(ids) > max_length:
            raise ConfigError(
                f"{field}: expected at most {max_length} tokens of {part} "
                f"(model.max_sequence_length), got {prompt!r} ({len(ids)} tokens)")
