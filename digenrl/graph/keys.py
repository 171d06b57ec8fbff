"""Task keys and the annotation the scheduler plugin reads on every task.

A key is a tuple whose first element is the task kind, so Dask's dashboard colours the
kinds apart and its per-prefix duration estimates stay meaningful. Every key is made by
one of the constructors here, in the words of :mod:`digenrl.vocabulary`. The plugin
never parses keys: everything it needs is in the ``digenrl`` annotation built here
(:func:`task_meta`).
"""

from __future__ import annotations

from typing import Any

from digenrl.vocabulary import (Key, ADVANTAGE, CHECKPOINT, DECODE, DENOISE, ENCODE, EVAL,
                                EVAL_REWARD, GPU_KINDS, GRAD, GROUP_REWARD, INIT, KIND_POOL,
                                KINDS, NOISE, OPTIMIZE, PUBLISH, REDUCE, RESTORE, REWARD, STATS,
                                TRAINED)

__all__ = ["Key", "task_meta", "kind_of", "INIT_KEY", "encode_key", "noise_key",
           "denoise_key", "decode_key", "reward_key", "group_reward_key", "advantage_key",
           "grad_key", "reduce_key", "optimize_key", "publish_key", "trained_key",
           "checkpoint_key", "restore_key", "stats_key", "eval_key", "eval_reward_key",
           "member_key", "round_key", "gang_id", "context_gang_id", "MAKING_STEP",
           "PUBLISHING_STEP", "CONTEXT_STEPS"]


#: The trainer state of version 0.
INIT_KEY: Key = (INIT,)


def kind_of(key: Key) -> str:
    """The task kind of ``key``."""
    return key[0]


def encode_key(iteration: int, group: int) -> Key:
    """Prompt group ``group``'s conditioning (its prompt through the text encoders)."""
    return (ENCODE, iteration, group)


def noise_key(iteration: int, chunk: int) -> Key:
    """A chunk's starting latents (and its samples' conditioning, from its groups')."""
    return (NOISE, iteration, chunk)


def denoise_key(iteration: int, chunk: int, t: int) -> Key:
    """Sampler step ``t`` of a chunk."""
    return (DENOISE, iteration, chunk, t)


def decode_key(iteration: int, chunk: int) -> Key:
    return (DECODE, iteration, chunk)


def reward_key(iteration: int, chunk: int) -> Key:
    return (REWARD, iteration, chunk)


def group_reward_key(iteration: int, group: int) -> Key:
    """A prompt group's images scored by the rewards that score a whole group at once."""
    return (GROUP_REWARD, iteration, group)


def advantage_key(iteration: int, group: int) -> Key:
    return (ADVANTAGE, iteration, group)


def grad_key(iteration: int, chunk: int, t: int) -> Key:
    """The micro-step of a chunk at trained timestep ``t``."""
    return (GRAD, iteration, chunk, t)


def reduce_key(iteration: int, level: int, node: int) -> Key:
    """Node ``node`` of level ``level`` of the reduction tree (its partial sums extend
    the key by the count of parts added so far)."""
    return (REDUCE, iteration, level, node)


def optimize_key(iteration: int) -> Key:
    """The trainer state after ``iteration``'s optimizer step; before iteration 0, the
    initial state."""
    return INIT_KEY if iteration < 0 else (OPTIMIZE, iteration)


def publish_key(version: int) -> Key:
    """The published weights of policy ``version``."""
    return (PUBLISH, version)


def trained_key(version: int) -> Key:
    """The trained weights of policy ``version``, where they differ from its published
    (sampling) weights."""
    return (TRAINED, version)


def checkpoint_key(version: int) -> Key:
    return (CHECKPOINT, version)


def restore_key(version: int) -> Key:
    """The trainer state of ``version`` read back from its checkpoint."""
    return (RESTORE, version)


def stats_key(iteration: int) -> Key:
    return (STATS, iteration)


def eval_key(version: int, chunk: int) -> Key:
    """A chunk of held-out prompts sampled by policy ``version``."""
    return (EVAL, version, chunk)


def eval_reward_key(version: int, chunk: int) -> Key:
    return (EVAL_REWARD, version, chunk)


def member_key(key: Key, member: int) -> Key:
    """Member ``member``'s part of the collective step ``key`` (a gang: one task per
    member of the sharded trainers' group): ``optimize_key(i)``'s members make version
    ``i + 1`` (``optimize_key(-1)``'s, version 0), a :func:`round_key`'s train one round
    of micro-steps."""
    return (*key, member)


def round_key(iteration: int, round_: int) -> Key:
    """Round ``round_`` of iteration ``iteration``'s sharded micro-steps: one micro-step
    per member of the gang (its members' keys by :func:`member_key`)."""
    return (GRAD, iteration, "round", round_)


#: The step of :func:`gang_id` that makes a policy version (the optimizer step, or the
#: initial state); the rounds of micro-steps are steps ``0 ..`` below it.
MAKING_STEP = 999_999
#: The step of :func:`gang_id` that publishes a policy version by collective broadcast.
PUBLISHING_STEP = MAKING_STEP - 1
#: The first step of :func:`gang_id` of a chunk's context-parallel denoise steps
#: (:func:`context_gang_id`); the rounds of micro-steps are the steps below it.
CONTEXT_STEPS = 500_000


def gang_id(iteration: int, step: int) -> int:
    """The id of the gang of ``iteration``'s collective step ``step`` (a round of
    micro-steps, or :data:`MAKING_STEP`: the optimizer step, before iteration 0 the
    initial state), unique within a run."""
    if not 0 <= step <= MAKING_STEP:
        raise ValueError(f"step: expected 0 .. {MAKING_STEP}, got {step}")
    return (iteration + 1) * (MAKING_STEP + 1) + step


def context_gang_id(iteration: int, chunk: int, timestep: int, num_steps: int) -> int:
    """The id of the gang computing chunk ``chunk``'s denoise step ``timestep`` (of
    ``num_steps``) of iteration ``iteration`` with context parallelism."""
    step = CONTEXT_STEPS + chunk * num_steps + timestep
    if step >= PUBLISHING_STEP:
        raise ValueError(f"chunk: expected fewer than "
                         f"{(PUBLISHING_STEP - CONTEXT_STEPS) // num_steps} chunks computed "
                         f"with context parallelism in an iteration, got chunk {chunk}")
    return gang_id(iteration, step)


def task_meta(kind: str, iteration: int, policy_version: int, *, gpu: bool | None = None,
              timestep: int | None = None, chunk: int | None = None,
              group: int | None = None, behaviour_version: int | None = None,
              samples: int = 0, sde: bool | None = None,
              gang: tuple[int, ...] | None = None) -> dict[str, Any]:
    """The annotation of one task (plain data: it travels to the scheduler). ``sde``: of
    a ``denoise`` step, whether it is an SDE step (recording a log-probability) or an
    ODE step (None for every other kind). ``gang``: ``(gang id, member index, size)``
    of a task that is one member's part of a collective step: the scheduler releases a
    gang's ``size`` members together, member ``i`` to the ``i``-th worker of its pool
    (docs/scheduling.md, "Gangs"); ``(gang id, member index, size, trainers)`` for a gang
    spanning both pools: its first ``trainers`` members on the trainer pool's workers,
    the others on the rollout pool's, each in order."""
    if kind not in KIND_POOL:
        raise ValueError(f"kind: expected one of {list(KINDS)}, got {kind!r}")
    if gang is not None and not (
            isinstance(gang, (tuple, list)) and len(gang) in (3, 4)
            and all(type(x) is int for x in gang) and 0 <= gang[1] < gang[2]
            and (len(gang) == 3 or 0 < gang[3] <= gang[2])):
        raise ValueError(f"gang: expected (gang id, member index, size[, trainers]) as "
                         f"integers with 0 <= member index < size and 0 < trainers <= "
                         f"size, got {gang!r}")
    return {
        "kind": kind,
        "pool": KIND_POOL[kind],
        "iteration": iteration,
        "policy_version": policy_version,
        "gpu": kind in GPU_KINDS if gpu is None else gpu,
        "timestep": timestep,
        "chunk": chunk,
        "group": group,
        "behaviour_version": behaviour_version,
        "samples": samples,
        "sde": sde,
        "gang": None if gang is None else tuple(gang),
    }
