"""Prompt sets, prompt files and the seeded choice of each iteration's prompts.

The built-in sets and ``data.prompts`` are drawn with replacement, seeded by the
iteration. A prompt file (``data.prompt_file``) is visited in epochs instead: epoch ``e``
is a permutation of the file's lines seeded by ``(seed, "prompt_order", e)``, and the
iterations take consecutive prompts of that sequence of epochs. Both are functions of
the seed and the iteration alone, so a resumed run continues the same order with no
state stored.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np

from digenrl.config import ConfigError, DataConfig
from digenrl.seeding import PROMPT_ORDER_DRAW, PROMPTS_DRAW, stable_seed

__all__ = ["PROMPT_SETS", "HELD_OUT_SETS", "PROMPT_FILE_SUFFIXES", "HeldOut",
           "has_held_out_prompts", "held_out_prompts", "PromptFile", "PromptSource",
           "SourceFile", "PromptInputs", "read_source", "source_table", "load_prompt_file",
           "prompt_source", "prompt_pool", "draw_prompts", "epoch_order", "epoch_indices"]

# The animal list DDPO trains its compressibility rewards on (ImageNet animal classes).
_SIMPLE_ANIMALS = (
    "cat", "dog", "horse", "monkey", "rabbit", "zebra", "spider", "bird", "sheep",
    "deer", "cow", "goat", "lion", "tiger", "bear", "raccoon", "fox", "wolf", "lizard",
    "beetle", "ant", "butterfly", "fish", "shark", "whale", "dolphin", "squirrel",
    "mouse", "rat", "snake", "turtle", "frog", "chicken", "duck", "goose", "bee", "pig",
    "turkey", "fly", "llama", "camel", "bat", "gorilla", "hedgehog", "kangaroo",
)

# Text rendering, as Flow-GRPO's OCR task words its prompts: a scene showing a short text
# in double quotes (the text the OCR reward reads for). Made here, every template with
# every word.
_OCR_TEMPLATES = (
    'A sign that says "{}"',
    'A storefront with "{}" painted above the door',
    'A neon sign glowing with the words "{}"',
    'A chalkboard menu that reads "{}"',
    'A coffee mug with "{}" printed on it',
    'A T-shirt with the slogan "{}"',
    'A book cover titled "{}"',
    'A birthday cake with "{}" written in icing',
)
_OCR_WORDS = (
    "Open Late", "Hello World", "Fresh Bread", "Good Morning", "Coffee", "Welcome Home",
    "Sale", "Exit", "Stay Curious", "Happy Birthday", "Night Market", "Dream Big",
    "Free Wifi", "Keep Calm", "Sunset Cafe", "Bookshop", "Ocean Drive", "Best Friends",
    "Hot Pizza", "Thank You", "Open 24 Hours", "Garden Party", "Lucky Star", "Go Team",
)

PROMPT_SETS: dict[str, tuple[str, ...]] = {
    "simple_animals": _SIMPLE_ANIMALS,
    "animal_photos": tuple(f"a photo of a {a}" for a in _SIMPLE_ANIMALS),
    "ocr": tuple(t.format(w) for w in _OCR_WORDS for t in _OCR_TEMPLATES),
}

# Held out: animals none of the sets above name, so an evaluation measures how the
# training carries over to prompts the policy never trained on.
_HELD_OUT_ANIMALS = ("penguin", "giraffe", "panda", "koala", "parrot", "crab", "peacock",
                     "swan")
# Held out of ocr: texts none of its prompts shows, one in each template.
_HELD_OUT_WORDS = ("Moon River", "Jazz Night", "Green Tea", "Paper Kite", "Winter Sale",
                   "Blue Lagoon", "Tiny Robot", "Fresh Start")

#: Each built-in prompt set's held-out prompts, worded as the set words its own.
HELD_OUT_SETS: dict[str, tuple[str, ...]] = {
    "simple_animals": _HELD_OUT_ANIMALS,
    "animal_photos": tuple(f"a photo of a {a}" for a in _HELD_OUT_ANIMALS),
    "ocr": tuple(t.format(w) for t, w in zip(_OCR_TEMPLATES, _HELD_OUT_WORDS)),
}

#: The prompt file formats: one prompt per line, or one JSON object per line.
PROMPT_FILE_SUFFIXES = (".txt", ".jsonl")


def prompt_pool(prompt_set: str, prompts: tuple[str, ...] = ()) -> tuple[str, ...]:
    if prompts:
        return tuple(prompts)
    return PROMPT_SETS[prompt_set]


def draw_prompts(pool: tuple[str, ...], count: int, seed: int, iteration: int) -> list[str]:
    """The prompts of one iteration: drawn with replacement, seeded by the iteration."""
    rng = np.random.default_rng(stable_seed(seed, PROMPTS_DRAW, iteration))
    return [pool[i] for i in rng.integers(0, len(pool), size=count)]


# ------------------------------------------------------------------- prompt files

#: The keys of a ``.jsonl`` line that condition its samples rather than reach the
#: rewards as metadata: the source image(s) an editing model edits, and the negative
#: prompt classifier-free guidance steers away from.
IMAGE_KEY, IMAGES_KEY, NEGATIVE_KEY = "image", "images", "negative_prompt"


@dataclass(frozen=True)
class SourceFile:
    """A source image of a prompt-file line: its absolute path and the SHA-256 of its
    bytes when the file was checked (the workers that read it check they read the same)."""

    path: str
    sha256: str


@dataclass(frozen=True)
class PromptInputs:
    """What a prompt-file line gives its samples besides the prompt: its source images
    (an editing model's) and its own negative prompt (None: ``model.negative_prompt``).
    Small: it travels with the prompt in the tasks of the line's prompt group."""

    images: tuple[SourceFile, ...] = ()
    negative: str | None = None

    def __bool__(self) -> bool:
        return bool(self.images) or self.negative is not None


NO_INPUTS = PromptInputs()


@dataclass(frozen=True)
class PromptFile:
    """The lines of a prompt file: each line's prompt, its inputs (source images and
    negative prompt, from ``.jsonl`` lines) and, for ``.jsonl``, the line's other keys
    (the metadata rewards receive; empty for ``.txt``)."""

    path: str
    prompts: tuple[str, ...]
    metadata: tuple[Mapping[str, Any], ...]
    #: The SHA-256 of the file's bytes: a resumed run checks it reads the same lines.
    sha256: str = ""
    #: Each line's :class:`PromptInputs` (empty when no line has any).
    inputs: tuple[PromptInputs, ...] = ()

    def __len__(self) -> int:
        return len(self.prompts)

    def inputs_of(self, line: int) -> PromptInputs:
        """The inputs of line ``line`` (0-based)."""
        return self.inputs[line] if self.inputs else NO_INPUTS

    def lines_with(self, what) -> list[int]:
        """The 1-based numbers of the lines whose inputs ``what`` (a predicate) holds for."""
        return [n + 1 for n in range(len(self)) if what(self.inputs_of(n))]


def load_prompt_file(path: str, field: str = "data.prompt_file") -> PromptFile:
    """Read and check a prompt file; a bad one is a :class:`ConfigError` naming
    ``field``, the file and the line. Read once per version of the file (its path,
    size and modification time), however often it is asked for."""
    try:
        st = os.stat(path)
    except OSError as e:
        raise ConfigError(f"{field}: expected an existing prompt file, got {path!r} "
                          f"({e.strerror})") from None
    return _load(os.path.abspath(path), field, st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=8)
def _load(path: str, field: str, size: int, mtime_ns: int) -> PromptFile:
    suffix = os.path.splitext(path)[1].lower()
    if suffix not in PROMPT_FILE_SUFFIXES:
        raise ConfigError(f"{field}: expected a .txt (one prompt per line) or .jsonl "
                          f"({{\"prompt\": ...}} per line) file, got {path!r}")
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise ConfigError(f"{field}: expected a readable prompt file, got {path!r} "
                          f"({e.strerror})") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        number = raw.count(b"\n", 0, e.start) + 1
        raise ConfigError(f"{field}: line {number} of {path}: expected UTF-8 text, got "
                          f"byte {raw[e.start:e.start + 1]!r}") from None
    digest = hashlib.sha256(raw).hexdigest()
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()  # the newline that ends the last line
    if not lines:
        raise ConfigError(f"{field}: expected at least one prompt, got an empty file {path!r}")

    def bad(n: int, expected: str, got: Any) -> ConfigError:
        return ConfigError(f"{field}: line {n} of {path}: expected {expected}, got {got}")

    lines = [line.rstrip("\r") for line in lines]
    for n, line in enumerate(lines, 1):
        if not line.strip():
            raise bad(n, "a prompt", "an empty line")
    empty: Mapping[str, Any] = {}
    if suffix == ".txt":
        return PromptFile(path, tuple(lines), (empty,) * len(lines), digest)
    records = _json_lines(lines, bad)
    prompts: list[str] = []
    metadata: list[Mapping[str, Any]] = []
    inputs: list[PromptInputs] = []
    for n, record in enumerate(records, 1):
        if not isinstance(record, dict):
            raise bad(n, "a JSON object", type(record).__name__)
        prompt = record.pop("prompt", None)
        if not isinstance(prompt, str) or not prompt.strip():
            raise bad(n, 'a "prompt" key holding a non-empty string',
                      "no \"prompt\" key" if prompt is None else repr(prompt))
        prompts.append(prompt)
        inputs.append(_line_inputs(record, os.path.dirname(path), lambda e, g, n=n: bad(n, e, g)))
        metadata.append(record or empty)
    return PromptFile(path, tuple(prompts), tuple(metadata), digest,
                      tuple(inputs) if any(inputs) else ())


def _line_inputs(record: dict, folder: str, bad) -> PromptInputs:
    """The line's :class:`PromptInputs`, popped from ``record``: ``"image"`` (a path
    relative to the prompt file's folder) or ``"images"`` (a list of them), each an
    existing file PIL decodes; ``"negative_prompt"``, a string."""
    if IMAGE_KEY in record and IMAGES_KEY in record:
        raise bad(f'"{IMAGE_KEY}" or "{IMAGES_KEY}"', "both")
    names: list = []
    if IMAGE_KEY in record:
        names = [record.pop(IMAGE_KEY)]
        if not isinstance(names[0], str) or not names[0]:
            raise bad(f'"{IMAGE_KEY}" holding a path to an image', repr(names[0]))
    elif IMAGES_KEY in record:
        names = record.pop(IMAGES_KEY)
        if not isinstance(names, list) or not names or not all(
                isinstance(x, str) and x for x in names):
            raise bad(f'"{IMAGES_KEY}" holding a non-empty list of paths to images',
                      repr(names))
    negative = record.pop(NEGATIVE_KEY, None)
    if negative is not None and not isinstance(negative, str):
        raise bad(f'"{NEGATIVE_KEY}" holding a string', repr(negative))
    images = tuple(_source_file(folder, name, bad) for name in names)
    return PromptInputs(images, negative)


def _source_file(folder: str, name: str, bad) -> SourceFile:
    """The image ``name`` (relative to ``folder``), read and decoded once to check it."""
    path = os.path.normpath(os.path.join(folder, os.path.expanduser(name)))
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise bad(f"an existing image file at {name!r}", f"{path} ({e.strerror})") from None
    try:
        _decode(raw)
    except Exception as e:  # PIL raises many kinds for a file that is no image
        from PIL import UnidentifiedImageError

        why = ("not an image format PIL reads" if isinstance(e, UnidentifiedImageError)
               else f"{type(e).__name__}: {' '.join(str(e).split())[:200]}")
        raise bad(f"an image PIL decodes at {name!r}", f"{path} ({why})") from None
    return SourceFile(path, hashlib.sha256(raw).hexdigest())


def _decode(raw: bytes) -> np.ndarray:
    """Image bytes as uint8 RGB pixels ``(height, width, 3)``."""
    import io

    from PIL import Image

    with Image.open(io.BytesIO(raw)) as image:
        return np.asarray(image.convert("RGB"), dtype=np.uint8)


@functools.lru_cache(maxsize=64)
def read_source(source: SourceFile) -> np.ndarray:
    """The pixels of ``source`` (uint8 ``(height, width, 3)``, read-only), read where a
    task needs them (the prompt file's folder must be readable there, as ``model.path``
    is); a file that changed since the prompt file was checked is refused."""
    with open(source.path, "rb") as f:
        raw = f.read()
    digest = hashlib.sha256(raw).hexdigest()
    if digest != source.sha256:
        raise ValueError(f"source image {source.path}: expected the file the prompt file "
                         f"named when the run started (SHA-256 {source.sha256[:12]}...), "
                         f"got other bytes (SHA-256 {digest[:12]}...)")
    pixels = _decode(raw)
    pixels.setflags(write=False)
    return pixels


def _json_lines(lines: list[str], bad) -> list[Any]:
    """Each line's JSON value: parsed as one array (twice as fast as line by line), or,
    when that fails, line by line to find the first bad line."""
    try:
        values = json.loads("[" + ",".join(lines) + "]")
        if len(values) == len(lines):  # a line such as `1, 2` would hold two values
            return values
    except ValueError:
        pass
    values = []
    for n, line in enumerate(lines, 1):
        try:
            values.append(json.loads(line))
        except ValueError as e:
            raise bad(n, "a JSON object", f"bad JSON ({e})") from None
    raise AssertionError("unreachable: the lines parse one by one but not as an array")


@functools.lru_cache(maxsize=4)
def epoch_order(n: int, seed: int, epoch: int) -> np.ndarray:
    """The order in which epoch ``epoch`` visits the ``n`` lines of a prompt file."""
    order = np.random.default_rng(stable_seed(seed, PROMPT_ORDER_DRAW, epoch)).permutation(n)
    order.setflags(write=False)
    return order


def epoch_indices(n: int, count: int, seed: int, iteration: int) -> list[int]:
    """The lines iteration ``iteration`` takes: positions ``iteration * count`` to
    ``(iteration + 1) * count - 1`` of the epochs laid end to end."""
    out = []
    for position in range(iteration * count, (iteration + 1) * count):
        epoch, k = divmod(position, n)
        out.append(int(epoch_order(n, seed, epoch)[k]))
    return out


# ------------------------------------------------------------------ prompt sources


@dataclass(frozen=True)
class PromptSource:
    """Where a run's prompts come from: a prompt file (``file``) or a pool drawn with
    replacement."""

    pool: tuple[str, ...] = ()
    file: PromptFile | None = None

    def draw(self, count: int, seed: int, iteration: int
             ) -> tuple[list[str], list[str], list[PromptInputs]]:
        """The prompts of iteration ``iteration``, each one's metadata as JSON text
        (empty when it has none) and its :class:`PromptInputs`."""
        if self.file is None:
            prompts = draw_prompts(self.pool, count, seed, iteration)
            return prompts, [""] * len(prompts), [NO_INPUTS] * len(prompts)
        lines = epoch_indices(len(self.file), count, seed, iteration)
        return ([self.file.prompts[j] for j in lines],
                [json.dumps(self.file.metadata[j]) if self.file.metadata[j] else ""
                 for j in lines],
                [self.file.inputs_of(j) for j in lines])


def prompt_source(data: DataConfig) -> PromptSource:
    """The prompts ``data`` configures (``data.prompt_file`` first)."""
    if data.prompt_file is not None:
        return PromptSource(file=load_prompt_file(data.prompt_file, "data.prompt_file"))
    return PromptSource(pool=prompt_pool(data.prompt_set, data.prompts))


def source_table(data: DataConfig, evaluation: bool) -> tuple[SourceFile, ...]:
    """Each source image the training prompt file (and, with ``evaluation``, the
    held-out one) names, once, in line order: what a run's store lists, and what the
    ``source`` column of its samples counts in."""
    files = [data.prompt_file] + ([data.eval_prompt_file] if evaluation else [])
    seen: dict[SourceFile, None] = {}
    for path in files:
        if path is not None:
            for inputs in load_prompt_file(path).inputs:
                seen.update(dict.fromkeys(inputs.images))
    return tuple(seen)


# ----------------------------------------------------------------- held-out prompts


@dataclass(frozen=True)
class HeldOut:
    """The held-out prompts of an evaluation, each one's metadata as JSON text (empty
    when it has none) and its :class:`PromptInputs` (empty when none has any)."""

    prompts: tuple[str, ...]
    metadata: tuple[str, ...]
    inputs: tuple[PromptInputs, ...] = ()


def has_held_out_prompts(data: DataConfig) -> bool:
    """Whether ``data`` has held-out prompts: a ``data.eval_prompt_file``, or training
    prompts from a built-in set (whose held-out prompts are :data:`HELD_OUT_SETS`)."""
    return data.eval_prompt_file is not None or (data.prompt_file is None
                                                 and not data.prompts)


def held_out_prompts(data: DataConfig) -> HeldOut:
    """The held-out prompts ``data`` configures (see :func:`has_held_out_prompts`)."""
    if data.eval_prompt_file is not None:
        f = load_prompt_file(data.eval_prompt_file, "data.eval_prompt_file")
        return HeldOut(f.prompts, tuple(json.dumps(m) if m else "" for m in f.metadata),
                       f.inputs)
    if not has_held_out_prompts(data):
        raise ConfigError("eval.every: expected held-out prompts (data.eval_prompt_file), "
                          "got none")
    prompts = HELD_OUT_SETS[data.prompt_set]
    return HeldOut(prompts, ("",) * len(prompts))
