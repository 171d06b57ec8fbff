"""Group-relative advantages (GRPO) and the reward task."""

from __future__ import annotations

from typing import Sequence

import numpy as np
from distributed import get_worker, secede

from digenrl.prompts import read_source
from digenrl.tasks.rewards import RewardSpec, decode_metadata, evaluate_rewards, rewards_wait
from digenrl.tasks.types import AdvantageOut, DecodeOut, RewardOut

__all__ = ["score", "group_advantages", "advantage"]

STD_EPS = 1e-4


def score(rewards: Sequence[tuple[RewardSpec, float]], on_error: str, iteration: int,
          prompts: Sequence[str], decoded: DecodeOut,
          metadata: Sequence[str] = (), inputs: Sequence = ()) -> RewardOut:
    """The reward task: the weighted reward of each decoded image of a chunk.

    ``rewards`` are :func:`~digenrl.tasks.reward_sources.resolve_rewards` pairs: the task
    carries the reward functions themselves. ``metadata`` is each sample's prompt
    metadata as JSON text (none when empty); ``inputs`` each sample's
    :class:`~digenrl.prompts.PromptInputs` (none when empty), whose source image reaches
    the rewards that take ``sources`` (read here only when one does). When a reward
    waits for something outside the worker (``device="wait"``: a reward server, a
    judge), the task first leaves the worker's thread pool, so that its wait holds no
    thread other tasks need."""
    if rewards_wait(rewards):
        _leave_thread_pool()
    sources = None
    if inputs and any(spec.takes_sources for spec, _ in rewards):
        sources = [read_source(i.images[0]) if i.images else None for i in inputs]
    total, per, valid, problems = evaluate_rewards(
        decoded.images, prompts, decoded.sample_ids, rewards, on_error, iteration,
        decode_metadata(metadata, len(decoded.images)), sources)
    return RewardOut(sample_ids=decoded.sample_ids, rewards=total, components=per,
                     valid=valid, problems=problems)


def _leave_thread_pool() -> None:
    """Secede from the Dask worker's thread pool (nothing outside a worker)."""
    try:
        get_worker()
    except ValueError:
        return
    secede()


def group_advantages(rewards: np.ndarray, valid: np.ndarray, clip: float,
                     std: float | None = None) -> np.ndarray:
    """A = (r - mean_group) / (std + 1e-4), clipped to +-clip; 0 where invalid.

    ``std`` is the group's own (GAP needs it: the batch is not complete yet) unless the
    batch's is passed. A group with fewer than two valid samples carries no signal and
    gets zero advantages.
    """
    out = np.zeros(len(rewards), dtype=np.float32)
    r = rewards[valid]
    if len(r) < 2:
        return out
    s = r.std() if std is None else std
    out[valid] = np.clip((r - r.mean()) / (s + STD_EPS), -clip, clip)
    return out


def advantage(group: int, sample_ids: tuple[int, ...], std_scope: str, clip: float,
              *parts: RewardOut) -> AdvantageOut:
    """The advantage task of one prompt group.

    ``parts`` are the reward outputs of the chunks holding the group's samples (or of the
    whole iteration when ``std_scope == "batch"``).
    """
    by_id = {}
    for p in parts:
        for i, s in enumerate(p.sample_ids):
            by_id[s] = (p.rewards[i], p.valid[i])
    rewards = np.array([by_id[s][0] for s in sample_ids], dtype=np.float64)
    valid = np.array([by_id[s][1] for s in sample_ids], dtype=bool)
    batch_std = None
    if std_scope == "batch":
        everything = np.array([r for r, v in by_id.values() if v], dtype=np.float64)
        batch_std = float(everything.std()) if len(everything) else 0.0
    adv = group_advantages(rewards, valid, clip, batch_std)
    return AdvantageOut(group=group, sample_ids=tuple(sample_ids), advantages=adv, valid=valid)
