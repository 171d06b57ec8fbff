"""The JPEG-compressibility reward behind a delay, as a judge answers after a while: the
reward ``peer_flow_grpo.py --reward-delay`` runs on digenrl's side (flow_grpo's gets the
same delay from that script's ``sitecustomize``).

A worker imports this module to find the reward (the script's folder is on the path its
worker processes start with); the delay is read from ``PEER_REWARD_DELAY``, which they
inherit.
"""

from __future__ import annotations

import os
import time

from digenrl.tasks.rewards import jpeg_compressibility, register_reward

NAME = "jpeg_compressibility_delayed"


@register_reward(NAME, device="wait")
def delayed_jpeg_compressibility(images, prompts):
    """JPEG compressibility after waiting ``PEER_REWARD_DELAY`` seconds (a ``wait``
    reward: its task holds no thread or GPU slot of the worker while it waits)."""
    time.sleep(float(os.environ.get("PEER_REWARD_DELAY", "0")))
    return jpeg_compressibility(images, prompts)
