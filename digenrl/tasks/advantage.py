"""Group-relative advantages (GRPO), the reward task and the group reward task."""

from __future__ import annotations

from typing import Sequence, cast

import numpy as np
from distributed import secede

from digenrl.prompts import PromptInputs, read_source
from digenrl.tasks.rewards import RewardSpec, decode_metadata, evaluate_rewards, rewards_wait
from digenrl.tasks.types import AdvantageOut, DecodeOut, RewardOut
from digenrl.tasks.worker import current_worker

__all__ = ["score", "score_group", "scored_samples", "group_advantages", "advantage"]

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
    total, per, valid, problems = evaluate_rewards(
        decoded.images, prompts, decoded.sample_ids, rewards, on_error, iteration,
        decode_metadata(metadata, len(decoded.images)), _sources(rewards, inputs))
    return RewardOut(sample_ids=decoded.sample_ids, rewards=total, components=per,
                     valid=valid, problems=problems)


def _sources(rewards: Sequence[tuple[RewardSpec, float]], inputs: Sequence
             ) -> list | None:
    """Each sample's source image (None where it has none), read here only when some
    reward takes ``sources``; None when none does or no sample has inputs."""
    if not inputs or not any(spec.takes_sources for spec, _ in rewards):
        return None
    return [read_source(i.images[0]) if i.images else None for i in inputs]


def score_group(rewards: Sequence[tuple[RewardSpec, float]], on_error: str, iteration: int,
                sample_ids: tuple[int, ...], prompt: str, metadata: str,
                inputs: PromptInputs | None, *chunks: DecodeOut | RewardOut) -> RewardOut:
    """The group reward task: the weighted group rewards of one prompt group's samples
    ``sample_ids``, scored together. ``chunks`` are the decode and reward outputs of the
    chunks holding them, in pairs (a chunk may hold other groups' samples too);
    ``metadata`` is the prompt's metadata as JSON text (empty for none); ``inputs`` what
    else its prompt-file line gives it (its source image reaches the rewards that take
    ``sources``), or None. A sample the
    chunk's rewards left invalid (``reward.on_error: drop``) is left out: the group is
    scored without it, and it stays invalid."""
    if rewards_wait(rewards):
        _leave_thread_pool()
    decoded = cast("tuple[DecodeOut, ...]", chunks[0::2])   # (in pairs: decode, reward)
    scored = cast("tuple[RewardOut, ...]", chunks[1::2])
    where = {s: (d, j) for d in decoded for j, s in enumerate(d.sample_ids)}
    valid_ids = {s for r in scored for s, v in zip(r.sample_ids, r.valid) if v}
    kept = [s for s in sample_ids if s in valid_ids]
    n = len(sample_ids)
    total, valid = np.full(n, np.nan), np.zeros(n, bool)
    per = {spec.name: np.full(n, np.nan) for spec, _ in rewards}
    problems: list[str] = []
    if kept:
        images = np.stack([where[s][0].images[where[s][1]] for s in kept])
        k = len(kept)
        got, got_per, got_valid, problems = evaluate_rewards(
            images, [prompt] * k, kept, rewards, on_error, iteration,
            decode_metadata([metadata] * k if metadata else (), k),
            _sources(rewards, [inputs] * k if inputs else ()))
        at = [sample_ids.index(s) for s in kept]
        total[at], valid[at] = got, got_valid
        for name, values in got_per.items():
            per[name][at] = values
    return RewardOut(sample_ids=tuple(sample_ids), rewards=total, components=per,
                     valid=valid, problems=problems)


def scored_samples(parts: Sequence[RewardOut]) -> tuple[list[int], np.ndarray, np.ndarray]:
    """The samples ``parts`` score (in the order first met), each one's reward and
    whether it is valid: the sum of its rewards over the parts holding it (its chunk's
    weighted reward, plus its group's weighted group reward where the run has group
    rewards), valid where every one of them is."""
    by_id: dict[int, list] = {}
    for p in parts:
        for i, s in enumerate(p.sample_ids):
            held = by_id.get(s)
            if held is None:
                by_id[s] = [p.rewards[i], bool(p.valid[i])]
            else:
                held[0] = held[0] + p.rewards[i]
                held[1] = held[1] and bool(p.valid[i])
    ids = list(by_id)
    return (ids, np.array([by_id[s][0] for s in ids], dtype=np.float64),
            np.array([by_id[s][1] for s in ids], dtype=bool))


def _leave_thread_pool() -> None:
    """Secede from the Dask worker's thread pool (nothing outside a worker)."""
    if current_worker() is not None:
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

    ``parts`` are the reward outputs of the chunks holding the group's samples, then
    (with group rewards) the group's group reward output; of the whole iteration when
    ``std_scope == "batch"``. A sample's reward is their sum (:func:`scored_samples`).
    """
    ids, summed, ok = scored_samples(parts)
    at = {s: j for j, s in enumerate(ids)}
    pick = [at[s] for s in sample_ids]
    rewards = summed[pick]
    valid = ok[pick]
    batch_std = None
    if std_scope == "batch":
        everything = summed[ok]
        batch_std = float(everything.std()) if len(everything) else 0.0
    adv = group_advantages(rewards, valid, clip, batch_std)
    return AdvantageOut(group=group, sample_ids=tuple(sample_ids), advantages=adv, valid=valid)
