"""A reward that compares each edit with its source image, for the editing-run tests
(a worker imports this module to find it)."""

from __future__ import annotations

import numpy as np
from PIL import Image

from digenrl.tasks.rewards import register_reward


def closeness(image: np.ndarray, source: np.ndarray) -> float:
    """Minus the mean absolute difference (0-1 scale) between ``image`` and ``source``
    resized to the image's size."""
    h, w = image.shape[:2]
    resized = np.asarray(Image.fromarray(source).resize((w, h), Image.BILINEAR), np.float64)
    return -float(np.abs(image.astype(np.float64) - resized).mean() / 255.0)


@register_reward("source_closeness")
def source_closeness(images, prompts, sources):
    """How close each edit stays to its source image (:func:`closeness`)."""
    return np.array([closeness(image, source) for image, source in zip(images, sources)])
