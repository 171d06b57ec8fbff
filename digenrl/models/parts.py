"""Loading a pipeline folder's parts the way diffusers does: ``model_index.json`` names
each part's library and class; the part is that class's ``from_pretrained`` of its
subfolder."""

from __future__ import annotations

import importlib
import json
import threading
from functools import lru_cache
from pathlib import Path
from typing import Any, Sequence

import torch

from digenrl.config import ConfigError

__all__ = ["part_class", "load_part", "TORCH_DTYPES", "check_tokens", "load_tokenizer",
           "tokenizer_of", "read_json", "BUILDING"]

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16,
                "float16": torch.float16}


#: Held while a process builds or loads a model. Building is not thread-safe: while one
#: thread is in a ``from_pretrained``, diffusers (through accelerate's
#: ``init_empty_weights``) and transformers patch ``torch.nn`` for the whole process to
#: build on the meta device and skip the initialisers, so a module another thread builds
#: meanwhile gets meta tensors ("Cannot copy out of meta tensor") or other weights; and
#: the tiny model draws its weights from torch's global generator after seeding it. A
#: worker runs a GPU task and another task at once (a trainer building its policy beside
#: a decode it was lent, a reward model loading beside the VAE), so every build of a
#: model, an adapter or a reward model takes this lock.
BUILDING = threading.RLock()


def read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())


def part_class(folder: Path, part: str):
    library, name = read_json(folder / "model_index.json")[part]
    return getattr(importlib.import_module(library), name)


def load_part(folder: Path, part: str, **kwargs):
    """``part`` of the pipeline folder, e.g. ``text_encoder_2`` or ``tokenizer``."""
    with BUILDING:
        return part_class(folder, part).from_pretrained(folder / part, **kwargs)


#: The classes transformers 5 builds a SentencePiece-style (Metaspace) tokenizer with,
#: whatever the folder's ``tokenizer.json`` declares.
_METASPACE_CLASSES = ("LlamaTokenizer", "LlamaTokenizerFast")


def tokenizer_of(folder: Path, part: str):
    """The folder's tokenizer ``part``.

    A byte-level BPE ``tokenizer.json`` under a Llama tokenizer class (the LLaVA-Llama-3
    tokenizer of HunyuanVideo) is read as that file declares it: transformers 5's
    ``LlamaTokenizer`` replaces the file's byte-level pre-tokenizer with SentencePiece's
    Metaspace and so splits (and drops) text differently from the tokenizer the text
    encoder was trained with."""
    library, name = read_json(folder / "model_index.json")[part]
    if library == "transformers" and name in _METASPACE_CLASSES and _byte_level(folder / part):
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(folder / part)
    return load_part(folder, part)


@lru_cache(maxsize=32)
def load_tokenizer(folder: Path, part: str):
    """:func:`tokenizer_of`, cached: config validation reads them repeatedly."""
    return tokenizer_of(folder, part)


def _byte_level(folder: Path) -> bool:
    """Whether ``folder/tokenizer.json`` declares a byte-level pre-tokenizer."""
    f = folder / "tokenizer.json"
    return f.is_file() and '"ByteLevel"' in json.dumps(read_json(f).get("pre_tokenizer"))


def check_tokens(tokenizer, part: str, named: Sequence[tuple[str, str, str]],
                 max_length: int | None = None, dropped: int = 0) -> None:
    """Every ``(field, prompt, text)`` -- ``text`` what the tokenizer sees of ``prompt``
    -- tokenizes without unknown tokens (and, with ``max_length``, within that many
    tokens after the first ``dropped``, a template's prefix the encoder drops): a prompt
    the text encoder would see as noise fails here, naming its field."""
    unk = tokenizer.unk_token_id
    for field, prompt, text in named:
        ids = tokenizer(text).input_ids
        # Without special tokens: CLIP's unknown token is also its end-of-text token.
        if unk is not None and unk in tokenizer(text, add_special_tokens=False).input_ids:
            raise ConfigError(
                f"{field}: expected text the folder's {part} ({type(tokenizer).__name__}) "
                f"can encode, got {prompt!r} (it has unknown tokens)")
        if max_length is not None and len(ids) - dropped > max_length:
            raise ConfigError(
                f"{field}: expected at most {max_length} tokens of {part} "
                f"(model.max_sequence_length), got {prompt!r} ({len(ids) - dropped} tokens)")
