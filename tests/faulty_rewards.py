"""Rewards that fail on purpose, for the bad-reward tests.

Each scores brightness, except for the samples whose prompt contains :data:`MARKER`:
``faulty_raises`` raises (a reward server that refuses the request), ``faulty_nonfinite``
returns NaN and inf for them, ``faulty_wrong_shape`` returns one value too many. A worker
running a reward task imports this module when it unpickles the function the task
carries, so no worker needs it registered in advance.
"""

from __future__ import annotations

import numpy as np

from digenrl.tasks.rewards import brightness, register_reward

MARKER = "broken"
#: The prompts of the runs: a broken one among plain ones.
PROMPTS = ("a calm lake", "a quiet street", "a broken window")


def _broken(prompts) -> np.ndarray:
    return np.array([MARKER in p for p in prompts], dtype=bool)


@register_reward("faulty_raises")
def raises(images, prompts):
    """Brightness; raises for a batch holding a broken prompt."""
    if _broken(prompts).any():
        raise ConnectionError("reward server refused the request")
    return brightness(images, prompts)


@register_reward("faulty_nonfinite")
def nonfinite(images, prompts):
    """Brightness; NaN for the first broken sample of a batch, inf for the others."""
    out = brightness(images, prompts)
    bad = np.flatnonzero(_broken(prompts))
    out[bad[:1]] = np.nan
    out[bad[1:]] = np.inf
    return out


@register_reward("faulty_wrong_shape")
def wrong_shape(images, prompts):
    """Brightness; one value too many for a batch holding a broken prompt."""
    out = brightness(images, prompts)
    return np.append(out, 0.0) if _broken(prompts).any() else out
