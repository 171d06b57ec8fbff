"""Prompt sets and the seeded choice of each iteration's prompts."""

from __future__ import annotations

import numpy as np

from digenrl.seeding import stable_seed

__all__ = ["PROMPT_SETS", "prompt_pool", "draw_prompts"]

# The animal list DDPO trains its compressibility rewards on (ImageNet animal classes).
_SIMPLE_ANIMALS = (
    "cat", "dog", "horse", "monkey", "rabbit", "zebra", "spider", "bird", "sheep",
    "deer", "cow", "goat", "lion", "tiger", "bear", "raccoon", "fox", "wolf", "lizard",
    "beetle", "ant", "butterfly", "fish", "shark", "whale", "dolphin", "squirrel",
    "mouse", "rat", "snake", "turtle", "frog", "chicken", "duck", "goose", "bee", "pig",
    "turkey", "fly", "llama", "camel", "bat", "gorilla", "hedgehog", "kangaroo",
)

PROMPT_SETS: dict[str, tuple[str, ...]] = {
    "simple_animals": _SIMPLE_ANIMALS,
    "animal_photos": tuple(f"a photo of a {a}" for a in _SIMPLE_ANIMALS),
}


def prompt_pool(prompt_set: str, prompts: tuple[str, ...] = ()) -> tuple[str, ...]:
    if prompts:
        return tuple(prompts)
    return PROMPT_SETS[prompt_set]


def draw_prompts(pool: tuple[str, ...], count: int, seed: int, iteration: int) -> list[str]:
    """The prompts of one iteration: drawn with replacement, seeded by the iteration."""
    rng = np.random.default_rng(stable_seed(seed, "prompts", iteration))
    return [pool[i] for i in rng.integers(0, len(pool), size=count)]
