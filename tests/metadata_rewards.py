"""A reward that reads each sample's prompt metadata, for the prompt-file and reward
server tests (a worker or a server imports this module to find it)."""

from __future__ import annotations

import numpy as np

from digenrl.tasks.rewards import register_reward


@register_reward("metadata_score")
def metadata_score(images, prompts, metadata):
    """The ``score`` key of each sample's metadata (0 without one) plus the image's
    mean pixel / 1000, so the images count too."""
    pixels = images.reshape(len(images), -1).mean(axis=1) / 1000.0
    return np.array([float(m.get("score", 0.0)) for m in metadata]) + pixels
