"""A reward that waits, as a judge behind a server does, for the waiting-reward tests
(a worker imports this module to find it)."""

from __future__ import annotations

import time

from digenrl.tasks.rewards import brightness, register_reward

#: Seconds each call waits before it scores.
DELAY = 3.0


@register_reward("slow_brightness", device="wait")
def slow_brightness(images, prompts):
    """Brightness, after waiting :data:`DELAY` seconds (holding no CPU)."""
    time.sleep(DELAY)
    return brightness(images, prompts)
