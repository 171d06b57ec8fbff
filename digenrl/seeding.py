"""Stable seeds derived from the run seed and a task's identity.

Every random draw in a run comes from a generator seeded by :func:`stable_seed` of the
run seed and the identity of what is drawn (a sample and a timestep, an iteration's prompt
choice, ...), never from process state. A result recomputed on another worker, or in a
run that chunked the samples differently, draws exactly the same numbers.
"""

from __future__ import annotations

import hashlib
from typing import Hashable

__all__ = ["stable_seed", "NOISE_DRAW", "GROUP_NOISE_DRAW", "SDE_DRAW", "EVAL_NOISE_DRAW",
           "PROMPTS_DRAW", "PROMPT_ORDER_DRAW", "INIT_DRAW", "PROMPT_ENCODER_DRAW",
           "SDE_WINDOW_DRAW", "TRAIN_LEVEL_DRAW", "TRAIN_NOISE_DRAW", "PAIR_LEVEL_DRAW",
           "PAIR_NOISE_DRAW"]

# The names of the draws: what a draw is of, after the run seed in its identity. They
# are part of every seed, so renaming one changes every result drawn with it.
#: A sample's starting noise: ``(seed, NOISE_DRAW, iteration, sample)``.
NOISE_DRAW = "noise"
#: A group's shared starting noise (``data.same_noise_in_group``):
#: ``(seed, GROUP_NOISE_DRAW, iteration, group)``.
GROUP_NOISE_DRAW = "group-noise"
#: A sample's SDE noise at step t: ``(seed, SDE_DRAW, iteration, sample, t)``.
SDE_DRAW = "sde"
#: Held-out prompt j's starting noise in every evaluation: ``(seed, EVAL_NOISE_DRAW, j)``.
EVAL_NOISE_DRAW = "eval-noise"
#: An iteration's prompts from a prompt list: ``(seed, PROMPTS_DRAW, iteration)``.
PROMPTS_DRAW = "prompts"
#: The order of a prompt file's lines in epoch e: ``(seed, PROMPT_ORDER_DRAW, e)``.
PROMPT_ORDER_DRAW = "prompt_order"
#: Initial weights: ``(model seed, INIT_DRAW, part)`` (``"lora"`` for the adapters).
INIT_DRAW = "init"
#: The built-in model's hash prompt encoder: a word's embedding row, and the positional
#: and pooled rows, ``(PROMPT_ENCODER_DRAW, what, word)``.
PROMPT_ENCODER_DRAW = "prompt-encoder"
#: Which candidate steps of an SDE window iteration i samples with the SDE
#: (``algorithm.sde_steps``): each candidate ``c`` is ranked by
#: ``(seed, SDE_WINDOW_DRAW, iteration, c)`` and the first ``num_sde_steps`` are taken.
SDE_WINDOW_DRAW = "sde-window"
#: A decoupled algorithm's micro-step ``j`` of sample ``s``: the noise level it is trained
#: at, ``(seed, TRAIN_LEVEL_DRAW, iteration, s, j)``, and the forward-process noise that
#: noises its clean latent there, ``(seed, TRAIN_NOISE_DRAW, iteration, s, j)``.
TRAIN_LEVEL_DRAW = "train-level"
TRAIN_NOISE_DRAW = "train-noise"
#: The same for a preference pair of prompt group ``g`` (online DPO: both images of the
#: pair are noised alike): ``(seed, PAIR_LEVEL_DRAW, iteration, g, j)`` and
#: ``(seed, PAIR_NOISE_DRAW, iteration, g, j)``.
PAIR_LEVEL_DRAW = "pair-level"
PAIR_NOISE_DRAW = "pair-noise"


def stable_seed(*parts: Hashable) -> int:
    """A 63-bit seed from the repr of ``parts`` (stable across processes and runs)."""
    text = repr(tuple(parts)).encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little") >> 1
