"""The words every part of a run shares: task kinds, worker pools, what each kind is, and
the unit memory is given in.

The graph builders write them into each task's ``digenrl`` annotation; the scheduling
policy, the Dask plugin, the simulator, the emulator and the analysis of a run's task
records read them from here. Plain data, importing nothing of the project, so the graph
and the scheduler both depend on it and not on each other.
"""

from __future__ import annotations

from typing import Any

__all__ = ["Key", "ROLLOUT", "TRAINER", "COLOCATED", "POOLS", "ANNOTATION", "CONTEXT_METADATA",
           "INIT", "ENCODE", "NOISE", "DENOISE", "DECODE", "REWARD", "ADVANTAGE", "GRAD",
           "REDUCE",
           "OPTIMIZE", "PUBLISH", "TRAINED", "STATS", "CHECKPOINT", "RESTORE", "EVAL",
           "EVAL_REWARD", "GROUP_REWARD",
           "KINDS", "KIND_POOL", "GPU_KINDS", "ROLLOUT_KINDS", "TRAINING_KINDS",
           "BACKGROUND_KINDS", "READS_NO_WEIGHTS", "stage_of", "GB"]

#: Bytes in a gigabyte wherever memory is given in GB (cost profiles,
#: ``cluster.gpu_memory_gb``, a GPU's total, the metrics of a run).
GB = 1e9

# ----------------------------------------------------------------------- pools

ROLLOUT = "rollout"
TRAINER = "trainer"
#: The one pool every GPU worker serves when a mode uses no pools.
COLOCATED = "colocated"
#: The pools a worker can be tagged with (a resource of that name).
POOLS = (ROLLOUT, TRAINER)

#: The annotation carrying a task's kind, pool, iteration, versions... on every task.
ANNOTATION = "digenrl"
#: The scheduler metadata under which each released context-parallel gang's placement is
#: kept for its members, by gang id: its workers' names by member, and how many such
#: steps had failed before it.
CONTEXT_METADATA = "digenrl-context"

# ----------------------------------------------------------------------- kinds

#: A task key: a tuple whose first element is its kind (``("denoise", 3, 1, 5)``).
Key = tuple[Any, ...]

INIT = "init"                # the trainer state of version 0
#: A prompt group's conditioning: its prompt (and, for an editing family, its source
#: image) through the family's encoders, once per worker and prompt (cached); what the
#: group's chunks' ``noise`` tasks read.
ENCODE = "encode"
NOISE = "noise"              # a chunk's starting latents
DENOISE = "denoise"          # one sampler step of a chunk
DECODE = "decode"            # a chunk's latents to images, with their log-probs
REWARD = "reward"            # a chunk's images scored
#: A prompt group's images scored together (a ranking or preference within the group),
#: by the rewards that score a whole group at once; only where the run has one.
GROUP_REWARD = "group_reward"
ADVANTAGE = "advantage"      # a prompt group's rewards normalised
GRAD = "grad"                # the gradient of one chunk at one trained timestep
REDUCE = "reduce"            # a node of the fixed gradient-sum tree
OPTIMIZE = "optimize"        # the optimizer step of an iteration
#: Its completion makes a new policy version available (the weights are its output: what
#: the rollouts sample with).
PUBLISH = "publish"
#: The trained weights of a version whose algorithm samples with a copy of its own
#: (DiffusionNFT): what the micro-steps of the version's iteration differentiate; its
#: ``publish`` is the sampling copy.
TRAINED = "trained"
STATS = "stats"              # an iteration's statistics: the iteration is complete
CHECKPOINT = "checkpoint"    # a version's trainer state written to the store
RESTORE = "restore"          # a version's trainer state read back from the store
#: Held-out evaluation of a policy version: a chunk of held-out prompts sampled with the
#: ODE sampler from fixed noise and decoded, then (``eval_reward``) scored.
EVAL = "eval"
EVAL_REWARD = "eval_reward"

#: The pool each kind belongs to in the modes that use pools.
KIND_POOL = {
    INIT: TRAINER, ENCODE: ROLLOUT, NOISE: ROLLOUT, DENOISE: ROLLOUT, DECODE: ROLLOUT,
    REWARD: ROLLOUT, GROUP_REWARD: ROLLOUT, ADVANTAGE: TRAINER, GRAD: TRAINER, REDUCE: TRAINER,
    OPTIMIZE: TRAINER,
    PUBLISH: TRAINER, TRAINED: TRAINER, STATS: TRAINER, CHECKPOINT: TRAINER, RESTORE: TRAINER,
    EVAL: ROLLOUT, EVAL_REWARD: ROLLOUT,
}
KINDS = tuple(KIND_POOL)

#: Kinds that hold a GPU slot (a ``reward``, ``group_reward`` or ``eval_reward`` does too
#: when its reward needs the GPU).
GPU_KINDS = frozenset({ENCODE, DENOISE, DECODE, GRAD, OPTIMIZE, EVAL})

#: Work that runs only in GPU slots nothing else can use: never part of an iteration's
#: rollout or training, never counted towards its staleness or its barrier.
BACKGROUND_KINDS = frozenset({EVAL, EVAL_REWARD})

#: A chunk's generation: the kinds of the rollout pool (held-out evaluation aside).
ROLLOUT_KINDS = frozenset(k for k, pool in KIND_POOL.items()
                          if pool == ROLLOUT and k not in BACKGROUND_KINDS)
#: The training phase: the trainer-pool kinds that work on samples and the trainer
#: state (the others are bookkeeping: versions, statistics, checkpoints).
TRAINING_KINDS = frozenset({ADVANTAGE, GRAD, REDUCE, OPTIMIZE})

#: Rollout kinds that read no policy version (their ``policy_version`` is the one the
#: chunks they feed are generated with): no weights move for them.
READS_NO_WEIGHTS = frozenset({ENCODE})

# A chunk's order of work: its groups' ``encode``, ``noise``, then its steps in timestep
# order, then ``decode`` and ``reward`` (a ``group_reward`` sits at the place of its
# group's last chunk, after that chunk's reward). A ``denoise`` or ``grad`` sits at its
# timestep, every other kind at 0.
_AFTER_THE_STEPS = 1_000_000
_STAGE = {ENCODE: -2, NOISE: -1, DECODE: _AFTER_THE_STEPS, REWARD: _AFTER_THE_STEPS + 1,
          GROUP_REWARD: _AFTER_THE_STEPS + 2}


def stage_of(kind: str, timestep: int | None) -> int:
    """Where a task of ``kind`` at ``timestep`` sits in its chunk's order of work."""
    return _STAGE.get(kind, timestep or 0)
