"""The OCR reward's parts: the text a sample should show, its score, and the reader.

An ``ocr`` reward model (``reward.models.NAME: {kind: ocr}``) scores how well an image
renders its target text, as Flow-GRPO's OCR reward does (``flow_grpo/ocr.py``,
docs/sources.md):

* **The target** (:func:`ocr_target`): the ``text`` key of the sample's prompt-file line
  when it has one, else the text between the first pair of double quotes of its prompt
  (``A sign that says "Open Late"`` -> ``Open Late``; typographic quotes “...” count too).
  A prompt with neither, or a target of nothing but spaces, is refused before any work
  starts (:func:`target_problem`, which :func:`digenrl.run.world.check_world` asks of every
  prompt an OCR reward scores).
* **The score** (:func:`ocr_score`): spaces removed and case folded from both the target
  and the recognised text (the image's lines joined in reading order); 1 when the
  target occurs inside the recognised text, else ``1 - min(d, len(target)) / len(target)``
  with ``d`` the Levenshtein distance between them (rapidfuzz). So a score lies in
  [0, 1]: a blank image, or one showing unrelated text, scores 0.
* **The reader** (:class:`OcrReader`): RapidOCR's PP-OCR detection and recognition
  models (ONNX files inside the ``rapidocr`` wheel, run by onnxruntime: no torch, no
  download), with PaddleOCR's defaults that flow_grpo's ``PaddleOCR(use_angle_cls=False)``
  runs with: no angle classifier, images larger than 960 pixels on their longer side
  scaled down to it (never up), lines recognised with a confidence under 0.5 dropped.
  The models differ: RapidOCR 3's PP-OCRv6 small models (Chinese and English in one
  model) where flow_grpo's PaddleOCR 2.9 runs PP-OCRv4's English ones.

Threads and devices: onnxruntime computes with as many intra-op threads as torch has in
the process (``cluster.torch_threads`` on a worker: the task's share of the cores), on
the CUDA execution provider when onnxruntime-gpu provides it and the process has a GPU.
Images are read in passes of ``batch_size``: on the CUDA provider a pass's detection is
one forward pass of all its images (those of one size); on the CPU each image's
detection runs alone, which is faster there (stacking 8 images of 512 pixels costs 1.2
times as much per image on a 2-core x86 machine: docs/performance.md). Recognition runs
per image, on its text lines in RapidOCR's batches. A score does not depend on the
images that share its pass except through floating-point rounding in the detector's
batched forward pass, which can move only a confidence that lies at 0.5 or a box's
edge by a pixel.

Install with ``pip install -e ".[ocr]"``; :func:`check_installed` says in one line what
is missing.
"""

from __future__ import annotations

import re
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from digenrl.checks import ConfigError

__all__ = ["TEXT_KEY", "OCR_EXTRA", "ocr_target", "target_problem", "ocr_score",
           "check_installed", "model_files", "OcrReader", "QUOTES"]

#: The key of a ``.jsonl`` prompt-file line that names the text to render (its other keys
#: reach the rewards as metadata; this one is read by the OCR reward).
TEXT_KEY = "text"
#: What installs the OCR reward's libraries.
OCR_EXTRA = 'pip install -e ".[ocr]"'
#: The pairs of quotes a prompt may put its text between: ASCII double quotes (what
#: flow_grpo's prompts use) and typographic ones.
QUOTES = (('"', '"'), ("\u201c", "\u201d"))
_QUOTED = [re.compile(re.escape(a) + r"(.*?)" + re.escape(b), re.S) for a, b in QUOTES]
#: The modules the reward imports, each with the distribution that provides it.
_MODULES = (("rapidocr", "rapidocr"), ("onnxruntime", "onnxruntime"),
            ("rapidfuzz", "rapidfuzz"))
#: PaddleOCR 2.x's defaults (flow_grpo's PaddleOCR): a detection input's longer side at
#: most 960 pixels (never scaled up), and lines of a confidence under 0.5 dropped.
DET_LIMIT_SIDE, DET_LIMIT_TYPE, DROP_SCORE = 960, "max", 0.5
#: The model files the ``rapidocr`` wheel ships (its default PP-OCRv6 small models).
_DET_MODEL, _REC_MODEL = "PP-OCRv6_det_small.onnx", "PP-OCRv6_rec_small.onnx"


def _quoted(prompt: str) -> str | None:
    """The text between the first pair of quotes of ``prompt`` (of whichever kind opens
    first), or None."""
    found = [m for m in (q.search(prompt) for q in _QUOTED) if m is not None]
    if not found:
        return None
    return min(found, key=lambda m: m.start()).group(1)


def ocr_target(prompt: str, metadata: Mapping[str, Any] | None = None) -> str:
    """The text a sample of ``prompt`` should render: ``metadata["text"]`` when given,
    else the prompt's first quoted text. Raises ValueError saying what is missing."""
    problem = target_problem(prompt, metadata)
    if problem is not None:
        raise ValueError(f"expected {problem[0]}, got {problem[1]}")
    if metadata and TEXT_KEY in metadata:
        return metadata[TEXT_KEY]
    return _quoted(prompt)  # type: ignore[return-value]


def target_problem(prompt: str, metadata: Mapping[str, Any] | None = None,
                   keyed: bool = True) -> tuple[str, str] | None:
    """None when ``prompt`` (with its line's ``metadata``) names a text to render, else
    (what was expected, what arrived) for a one-line error; ``keyed``: the prompt comes
    from a ``.jsonl`` line, which could name its text in a ``text`` key instead."""
    if metadata and TEXT_KEY in metadata:
        text = metadata[TEXT_KEY]
        if not isinstance(text, str):
            return (f'a "{TEXT_KEY}" key holding the text to render (a string)',
                    f"{type(text).__name__} {text!r}")
        if not text.replace(" ", ""):
            return (f'a "{TEXT_KEY}" key holding text other than spaces', repr(text))
        return None
    text = _quoted(prompt)
    if text is None:
        key = f' or a "{TEXT_KEY}" key' if keyed else ""
        return (f'the text to render in double quotes (as in \'A sign that says "Open '
                f'Late"\'){key}', repr(prompt))
    if not text.replace(" ", ""):
        return ("quoted text other than spaces to render", repr(prompt))
    return None


def _fold(text: str) -> str:
    return text.replace(" ", "").lower()


def ocr_score(recognised: str, target: str) -> float:
    """Flow-GRPO's OCR reward of an image whose recognised text is ``recognised``: 1
    when the folded target occurs in the folded text, else 1 minus their Levenshtein
    distance, capped at the target's length, over that length."""
    from rapidfuzz.distance import Levenshtein

    gt, rec = _fold(target), _fold(recognised)
    if not gt:
        raise ValueError(f"expected a target text other than spaces, got {target!r}")
    distance = 0 if gt in rec else min(Levenshtein.distance(rec, gt), len(gt))
    return 1.0 - distance / len(gt)


def check_installed(field: str) -> None:
    """The OCR reward's libraries import and the rapidocr wheel holds its models; else a
    :class:`~digenrl.checks.ConfigError` naming ``field`` (the reward's ``kind``) in one
    line saying what is missing and how to install it."""
    for module, dist in _MODULES:
        try:
            __import__(module)
        except ImportError as e:
            why = " ".join(str(e).split())[:160]
            raise ConfigError(f"{field}: expected the {dist} package (the OCR reward's "
                              f"extra: {OCR_EXTRA}), got an ImportError: {why}") from None
    missing = [str(p) for p in model_files() if not p.is_file()]
    if missing:
        raise ConfigError(f"{field}: expected the rapidocr wheel's detection and recognition "
                          f"models (reinstall it: {OCR_EXTRA}), got none at {missing[0]}")


def model_files() -> tuple[Path, Path]:
    """The detection and recognition models inside the installed rapidocr wheel."""
    import rapidocr

    root = Path(rapidocr.__file__).resolve().parent / "models"
    return root / _DET_MODEL, root / _REC_MODEL


def _cuda_provider() -> bool:
    """Whether onnxruntime offers its CUDA provider and this process has a GPU."""
    import onnxruntime

    if "CUDAExecutionProvider" not in onnxruntime.get_available_providers():
        return False
    import torch

    return torch.cuda.is_available()


@dataclass
class _Pass:
    """One image on its way through the reader: the resized image and its op record."""

    image: np.ndarray
    record: dict


class OcrReader:
    """RapidOCR's detector and recogniser with the settings the module's docstring
    gives, ``threads`` intra-op threads each; :meth:`read` the recognised text of each
    image."""

    def __init__(self, threads: int, batch_size: int, cuda: bool | None = None):
        from rapidocr import RapidOCR

        det, rec = model_files()
        self.cuda = _cuda_provider() if cuda is None else cuda
        self.batch_size = batch_size
        device = 0
        if self.cuda:
            import torch

            device = torch.cuda.current_device()
        self.engine = RapidOCR(params={
            "Global.use_cls": False, "Global.text_score": DROP_SCORE,
            "Global.log_level": "error",
            "Det.model_path": str(det), "Rec.model_path": str(rec),
            "Det.limit_side_len": DET_LIMIT_SIDE, "Det.limit_type": DET_LIMIT_TYPE,
            "EngineConfig.onnxruntime.intra_op_num_threads": threads,
            "EngineConfig.onnxruntime.inter_op_num_threads": 1,
            "EngineConfig.onnxruntime.use_cuda": self.cuda,
            "EngineConfig.onnxruntime.cuda_ep_cfg.device_id": device})
        self.detector = self.engine._load_det_model()
        self.engine._load_rec_model()
        # Where the detector runs (RapidOCR falls back to the CPU, with a warning, when the
        # CUDA provider does not start).
        self.cuda = "CUDAExecutionProvider" in self.detector.session.session.get_providers()
        self.device = "cuda" if self.cuda else "cpu"
        # RapidOCR keeps per-call state (its preprocessing op); one read at a time.
        self._lock = threading.Lock()

    def read(self, images: np.ndarray, stack: bool | None = None) -> list[str]:
        """Each uint8 ``(h, w, 3)`` RGB image's recognised lines, joined in reading order
        (an empty string when it shows none). ``stack``: detect each pass's images in
        one forward pass (default: on the CUDA provider only)."""
        stack = self.cuda if stack is None else stack
        texts: list[str] = []
        with self._lock:
            for a in range(0, len(images), self.batch_size):
                texts.extend(self._read_pass(images[a:a + self.batch_size], stack))
        return texts

    def _read_pass(self, images: np.ndarray, stack: bool) -> list[str]:
        from rapidocr.utils.process_img import apply_vertical_padding

        engine = self.engine
        passes = []
        for image in images:
            bgr = np.ascontiguousarray(image[..., ::-1])  # RapidOCR reads OpenCV's BGR
            resized, record = engine.preprocess_img(bgr)
            padded, record = apply_vertical_padding(resized, record, engine.width_height_ratio,
                                                    engine.min_height)
            passes.append(_Pass(padded, record))
        maps = self._detect([p.image for p in passes], stack)
        texts = []
        for p, pred in zip(passes, maps):
            if pred is None:  # an image the detector cannot take (too small): no text
                texts.append("")
                continue
            boxes, scores = self.detector.postprocess_op(pred, p.image.shape[:2])
            if len(boxes) == 0:
                texts.append("")
                continue
            boxes = self.detector.sorted_boxes(boxes)
            crops = engine.crop_text_regions(p.image, boxes)
            rec = engine.recognize_txt(crops)
            texts.append("".join(t for t, s in zip(rec.txts or (), rec.scores or ())
                                 if t.strip() and s >= DROP_SCORE))
        return texts

    def _detect(self, images: Sequence[np.ndarray], stack: bool) -> list[np.ndarray | None]:
        """The detector's probability map of each image (``(1, 1, H, W)`` each; None for
        one its preprocessing refuses): one forward pass per run of equally sized images
        when ``stack``, else one each."""
        pre = self.detector.get_preprocess()
        inputs = [pre(image) for image in images]
        if not stack:
            return [None if x is None else self.detector.session(x) for x in inputs]
        maps: list[np.ndarray | None] = []
        a = 0
        while a < len(inputs):
            if inputs[a] is None:
                maps.append(None)
                a += 1
                continue
            b = a + 1
            while b < len(inputs) and inputs[b] is not None and \
                    inputs[b].shape == inputs[a].shape:
                b += 1
            out = self.detector.session(np.concatenate(inputs[a:b]))
            maps.extend(out[i:i + 1] for i in range(b - a))
            a = b
        return maps
