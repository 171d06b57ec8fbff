"""The shape of an iteration's DAG as plain data (docs/architecture.md, "One iteration").

``encode`` (prompt group) -> ``noise`` (chunk) -> ``denoise`` (chunk, t) -> ... ->
``decode`` (chunk) -> ``reward`` (chunk) -> ``advantage`` (group) -> ``grad`` (chunk,
micro-step) -> ``reduce`` (a fixed tree, each node a chain adding one part at a time) ->
``optimize`` -> ``publish`` (the weights of version v+1, which later ``denoise`` and
``grad`` tasks read) and ``stats``.
With a reward that scores whole prompt groups, a ``group_reward`` (group) task reads the
decoded images of the group's chunks and its ``advantage`` reads it too.
A run on Dask checkpoints versions (each one, or those its retention rule,
:mod:`digenrl.graph.retention`, names) and publishes each from its state read back
(:func:`tail_nodes`).

The algorithm (:mod:`digenrl.algorithms`, the layout's ``algorithm``) says which
``denoise`` steps are SDE steps (each annotated ``sde``), which micro-steps a chunk has
and what each reads: a coupled algorithm's micro-step ``t`` reads the latents before and
after step ``t`` (the trained steps of the trajectory); a decoupled one's reads the
chunk's final latent only (its ``decode`` too), so the intermediate steps' results are
released as soon as the next step has them. An algorithm with a sampling copy
(DiffusionNFT) publishes the copy, and its micro-steps read the trained weights from a
``trained`` task besides the copy the chunk was sampled with.

A chunk the plan computes with context parallelism (:meth:`IterationPlan.degree` above
1) has each ``denoise`` step as a gang of that many members (:func:`_context_step`), one
per rollout worker computing it; member 0 keeps the step's key.

Each :class:`Node` names its operation, its annotation, and its arguments -- literals
and :class:`Dep` references to other keys. :mod:`digenrl.graph.build` binds operations
to task functions for Dask; the simulator reads the same nodes without torch or Dask.

Only the policy version the rollouts of an iteration read depends on the schedule:
iteration ``i`` trains with version ``i`` and generates its first ``stale_groups``
groups (all, by default) with version ``max(0, i - k)`` for the bounded staleness
``k``, the rest with version ``i``. Everything else about scheduling lives in the
annotations and the scheduler plugin.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Hashable

from digenrl.algorithms import Algorithm, FlowGRPO
from digenrl.graph.keys import (INIT_KEY, MAKING_STEP, PUBLISHING_STEP, Key, advantage_key,
                                checkpoint_key, decode_key, denoise_key, encode_key, eval_key,
                                eval_reward_key, context_gang_id, gang_id, grad_key,
                                group_reward_key,
                                member_key, noise_key, optimize_key, publish_key, reduce_key,
                                restore_key, reward_key, round_key, stats_key, task_meta,
                                trained_key)
from digenrl.graph.plan import IterationPlan
from digenrl.graph.retention import Retention
from digenrl.vocabulary import (ADVANTAGE, CHECKPOINT, DECODE, DENOISE, ENCODE, EVAL,
                                EVAL_REWARD, GRAD, GROUP_REWARD, INIT, NOISE, OPTIMIZE,
                                PUBLISH, REDUCE, RESTORE, REWARD, STATS, TRAINED)

__all__ = ["Dep", "Node", "GraphLayout", "init_nodes", "iteration_nodes", "encode_nodes",
           "rollout_nodes",
           "train_nodes", "tail_nodes", "restore_nodes", "rollout_version", "reduce_root_key",
           "group_reward_nodes", "iteration_shape", "eval_nodes", "eval_iteration", "eval_chunks",
           "advantage_nodes", "sharded_train_nodes", "sharded_tail_nodes", "making_nodes",
           "sharded_rounds", "train_outputs"]


def rollout_version(iteration: int, version_lag: int) -> int:
    return max(0, iteration - version_lag)


class Dep:
    """An argument that is the result of another task."""

    __slots__ = ("key",)

    def __init__(self, key: Key):
        self.key = key

    def __repr__(self) -> str:
        return f"Dep({self.key!r})"

    def __eq__(self, other: object) -> bool:
        return type(other) is Dep and other.key == self.key

    def __hash__(self) -> int:
        return hash((Dep, self.key))


class Node:
    """One task: its key, operation, annotation and arguments (``deps``: the keys of
    its :class:`Dep` arguments, in order)."""

    __slots__ = ("key", "op", "meta", "args", "deps")

    def __init__(self, key: Key, op: str, meta: dict[str, Any], args: tuple[Any, ...],
                 deps: list[Key] | None = None):
        self.key = key
        self.op = op
        self.meta = meta
        self.args = args
        # ``deps``: the builder's own list of the Dep keys in ``args`` (saves the scan).
        self.deps = [a.key for a in args if type(a) is Dep] if deps is None else deps

    def __repr__(self) -> str:
        return f"Node({self.key!r}, {self.op!r})"

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, Node) and self.key == other.key and self.op == other.op
                and self.meta == other.meta and self.args == other.args)

    __hash__ = None  # type: ignore[assignment]


def reduce_root_key(iteration: int, leaves: int, fanin: int) -> Key:
    """The key of the reduction tree's root over ``leaves`` micro-steps."""
    level, n = 0, leaves
    while True:
        n = -(-n // fanin)
        if n == 1:
            return reduce_key(iteration, level, 0)
        level += 1


@dataclass(frozen=True)
class GraphLayout:
    """The run settings that shape the DAG."""

    num_steps: int
    trained_steps: int
    advantage_std: str = "group"
    advantage_clip: float = 5.0
    reduce_fanin: int = 8
    #: The micro-steps read version 0's published weights: the frozen reference of a KL
    #: term or of online DPO (with LoRA the reference is the base model with its adapters
    #: off, and nothing is read).
    kl: bool = False
    reward_gpu: bool = False
    version_lag: int = 0
    stale_groups: int | None = None
    #: The algorithm's shape; None: Flow-GRPO with ``num_steps`` and ``trained_steps``.
    algorithm: Algorithm | None = None
    #: Every step's latent is stored (a coupled run's ``decode`` reads them all).
    save_latents: bool = False
    #: A reward scores whole prompt groups: a ``group_reward`` task per group, after its
    #: chunks' images, which its ``advantage`` reads (holding a GPU slot with
    #: ``group_reward_gpu``).
    group_rewards: bool = False
    group_reward_gpu: bool = False
    #: Each prompt group's conditioning is an ``encode`` task the group's chunks'
    #: ``noise`` tasks read (a run's graph always; a cost profile's only when it gives
    #: encoding a cost: ``costs.encode_per_group``).
    encode: bool = True
    #: Resume points a run writes the checkpoints of: every ``checkpoint_every``-th
    #: iteration (:attr:`retention`).
    checkpoint_every: int = 1
    #: Sharded training (``train.sharding: fsdp``): the size of the gang of trainers
    #: whose collective steps train (:func:`sharded_train_nodes`); 0: unsharded.
    shards: int = 0
    #: A sharded run publishes each version by collective broadcast
    #: (``train.weight_sync``) from its first trainer to every other worker of its
    #: group: the other trainers and ``receivers`` workers of the rollout pool.
    broadcast: bool = False
    receivers: int = 0

    def __post_init__(self) -> None:
        if self.algorithm is None:
            object.__setattr__(self, "algorithm", FlowGRPO(num_steps=self.num_steps,
                                                          trained_steps=self.trained_steps))
        elif self.algorithm.num_steps != self.num_steps:
            raise ValueError(f"algorithm: expected a shape of {self.num_steps} steps, got "
                             f"{self.algorithm.num_steps}")

    def units(self, plan: IterationPlan) -> list[tuple[int, list[int], list[int]]]:
        """The chunks that have micro-steps, each as ``(chunk, the chunks whose latents
        it reads, the groups whose advantages it reads)``: every chunk, reading itself;
        with a pairwise algorithm the first chunk of each group, reading every chunk of
        the groups it is the first of (their pairs are trained there)."""
        assert self.algorithm is not None  # (set when the layout is made)
        if not self.algorithm.pairwise:
            return [(c, [c], plan.groups_of_chunk(c)) for c in range(len(plan.chunks))]
        owned: dict[int, list[int]] = {}
        for g in range(plan.num_groups):
            owned.setdefault(plan.chunks_of_group(g)[0], []).append(g)
        return [(c, sorted({k for g in groups for k in plan.chunks_of_group(g)}), groups)
                for c, groups in sorted(owned.items())]

    def leaves(self, plan: IterationPlan) -> int:
        """How many micro-steps (``grad`` tasks, the reduction's leaves) ``plan`` has."""
        assert self.algorithm is not None  # (set when the layout is made)
        return len(self.units(plan)) * self.algorithm.micro_steps_per_chunk()

    def reduce_root(self, plan: IterationPlan) -> Key:
        """The key of the root of ``plan``'s reduction tree (its summed gradient)."""
        return reduce_root_key(plan.iteration, self.leaves(plan), self.reduce_fanin)

    def chunk_version(self, plan: IterationPlan, chunk: int) -> int:
        """The policy version chunk ``chunk`` of ``plan`` is generated with."""
        first_group = plan.groups_of_chunk(chunk)[0]
        if self.stale_groups is None or first_group < self.stale_groups:
            return rollout_version(plan.iteration, self.version_lag)
        return plan.iteration

    @property
    def retention(self) -> Retention:
        """The run's retention and resume rule (:class:`Retention`): which versions it
        keeps, which checkpoints it writes, where a resumed run starts. The methods
        below answer through it."""
        return Retention(self.version_lag, self.kl, self.checkpoint_every)

    def retains(self, version: int, iteration: int) -> bool:
        """:meth:`Retention.retains`."""
        return self.retention.retains(version, iteration)

    def retained_versions(self, iteration: int) -> list[int]:
        """:meth:`Retention.retained_versions`."""
        return self.retention.retained_versions(iteration)

    def writes_checkpoint(self, version: int, iterations: int) -> bool:
        """:meth:`Retention.writes_checkpoint`."""
        return self.retention.writes_checkpoint(version, iterations)

    def resume_point(self, committed: int, checkpointed: Callable[[int], bool]) -> int:
        """:meth:`Retention.resume_point`."""
        return self.retention.resume_point(committed, checkpointed)

    def keeps_checkpoint(self, version: int, committed: int, iterations: int) -> bool:
        """:meth:`Retention.keeps_checkpoint`."""
        return self.retention.keeps_checkpoint(version, committed, iterations)


def init_nodes(checkpoint: bool = False) -> list[Node]:
    """Version 0: the initial trainer state and its published weights (and, for runs
    that checkpoint, its checkpoint)."""
    nodes = [Node(INIT_KEY, INIT, task_meta(INIT, -1, 0), ()),
             Node(publish_key(0), PUBLISH, task_meta(PUBLISH, -1, 0), (Dep(INIT_KEY),))]
    if checkpoint:
        nodes.append(Node(checkpoint_key(0), CHECKPOINT, task_meta(CHECKPOINT, -1, 0),
                          (0, Dep(INIT_KEY))))
    return nodes


def restore_nodes(version: int, publish: bool = False, handoff: bool = False,
                  written: bool = True) -> list[Node]:
    """Read version ``version``'s state back from its checkpoint (a task with no inputs:
    lineage ends there), and optionally publish its weights from it.

    With ``handoff`` (the version is made in this run: by the optimizer step before it,
    or as the initial state) the read-back takes the state from the memory of the
    worker that made it when it runs there, which the scheduler arranges while the
    checkpoint is being written; the maker's key is a plain argument, not an input.
    Without ``written`` (a version whose checkpoint the run does not write) the
    maker's result is an input: lineage goes on through the optimizer step that made
    it, back to the newest version read from a checkpoint."""
    maker = optimize_key(version - 1)
    assert handoff or written, "a version read from no checkpoint is read from its maker"
    args = (version, maker if written else Dep(maker)) if handoff else (version,)
    nodes = [Node(restore_key(version), RESTORE,
                  task_meta(RESTORE, version - 1, version), args)]
    if publish:
        nodes.append(Node(publish_key(version), PUBLISH,
                          task_meta(PUBLISH, version - 1, version),
                          (Dep(restore_key(version)),)))
    return nodes


def iteration_nodes(layout: GraphLayout, plan: IterationPlan) -> list[Node]:
    """The whole DAG of iteration ``plan.iteration``, its optimizer step reading the
    previous iteration's state directly (as the simulator runs it)."""
    state = optimize_key(plan.iteration - 1)
    return (rollout_nodes(layout, plan) + train_nodes(layout, plan, state)
            + tail_nodes(layout, plan, state))


def iteration_shape(layout: GraphLayout, plan: IterationPlan) -> Hashable:
    """What :func:`iteration_nodes` depends on besides the iteration number itself.

    The builders are affine in the iteration within one shape: two iterations of the
    same shape have the same nodes in the same order, and each integer in their keys
    and annotations either is the same in both or moves with the iteration (a later
    iteration's keys, versions and inputs, shifted). Anything else a builder reads
    from the iteration -- the clamped version of a lagging rollout, whether the
    optimizer step reads the initial state, whether two inputs coincide (rollouts
    reading the KL reference's version) -- is part of the shape. The simulator
    relies on this to build one iteration per shape (:mod:`digenrl.sim.template`)."""
    i = plan.iteration
    versions = [layout.chunk_version(plan, c) for c in range(len(plan.chunks))]
    assert layout.algorithm is not None  # (set when the layout is made)
    return (dataclasses.replace(plan, iteration=0), tuple(v - i for v in versions),
            optimize_key(i - 1) == INIT_KEY,
            # The KL reference is version 0: the same input as rollouts of version 0.
            layout.kl and 0 in versions,
            # The SDE window drawn for the iteration.
            layout.algorithm.iteration_shape(i))


def encode_nodes(layout: GraphLayout, plan: IterationPlan) -> list[Node]:
    """An ``encode`` task per prompt group: the group's conditioning (with what else its
    prompt-file line gives it: a source image, a negative prompt), annotated with the
    group's first chunk and the version that chunk is generated with (it reads no
    weights). No inputs."""
    i = plan.iteration
    out = []
    for g in range(plan.num_groups):
        c = plan.chunks_of_group(g)[0]
        out.append(Node(encode_key(i, g), ENCODE,
                        task_meta(ENCODE, i, layout.chunk_version(plan, c), chunk=c, group=g,
                                  samples=plan.samples_per_prompt),
                        (plan.prompts[g], plan.inputs[g]) if plan.inputs else
                        (plan.prompts[g],), []))
    return out


def rollout_nodes(layout: GraphLayout, plan: IterationPlan) -> list[Node]:
    """(encode per group ->) noise -> denoise chain -> decode -> reward, per chunk (and,
    with group rewards, :func:`group_reward_nodes`). External inputs: the published
    weights of the versions the chunks read."""
    i = plan.iteration
    out = encode_nodes(layout, plan) if layout.encode else []
    append = out.append
    alg = layout.algorithm
    assert alg is not None  # (set when the layout is made)
    steps = range(layout.num_steps)
    sde = set(alg.sde_steps(i))
    last = layout.num_steps - 1
    for c in range(len(plan.chunks)):
        rv = layout.chunk_version(plan, c)
        ids = plan.sample_ids(c)
        prompts = plan.chunk_prompts(c)
        groups = plan.groups_of_chunk(c)
        common: dict[str, Any] = dict(chunk=c, group=groups[0], samples=len(ids))
        prev: Key = noise_key(i, c)
        inputs = plan.chunk_inputs(c)
        if layout.encode:
            # Sample s has the conditioning of its group, the chunk's (s's group - first).
            encoded = [encode_key(i, g) for g in groups]
            args = (i, ids, prompts, tuple(plan.group_of(s) - groups[0] for s in ids),
                    *(Dep(k) for k in encoded))
        else:
            encoded, args = [], (i, ids, prompts)
        append(Node(prev, NOISE, task_meta(NOISE, i, rv, **common), args, encoded))
        chain = [prev]
        weights = publish_key(rv)
        # The steps' annotations differ only in their timestep and kind of step.
        step_meta = task_meta(DENOISE, i, rv, timestep=0, **common)
        degree = plan.degree(c)
        # Each member's previous step (at degree 1 the step itself).
        before = [prev] * degree
        for t in steps:
            key = denoise_key(i, c, t)
            meta = step_meta.copy()
            meta["timestep"] = t
            meta["sde"] = t in sde
            if degree == 1:
                append(Node(key, DENOISE, meta, (Dep(weights), prompts, i, t, Dep(prev)),
                            [weights, prev]))
            else:
                before = _context_step(key, meta, degree, layout.num_steps, before,
                                       (Dep(weights), prompts, i, t), out)
            if layout.save_latents or t in sde or t == last:
                chain.append(key)
            prev = key
        if not alg.keeps_trajectory():
            chain = chain[-1:]  # the final latent: the other steps' results go at once
        # A context-parallel chunk's decoding waits for every member of its last step
        # (member 0 gives the latents; the others only end their part).
        reads = chain + before[1:] if degree > 1 else chain
        decoded = decode_key(i, c)
        append(Node(decoded, DECODE, task_meta(DECODE, i, rv, **common),
                    tuple(Dep(k) for k in reads), reads))
        append(Node(reward_key(i, c), REWARD,
                    task_meta(REWARD, i, rv, gpu=layout.reward_gpu, **common),
                    (prompts, Dep(decoded), plan.chunk_metadata(c), inputs), [decoded]))
    if layout.group_rewards:
        out += group_reward_nodes(layout, plan)
    return out


def _context_step(key: Key, meta: dict[str, Any], degree: int, num_steps: int,
                  before: list[Key], args: tuple, out: list[Node]) -> list[Key]:
    """A chunk's denoise step ``key`` computed with context parallelism: a gang of
    ``degree`` members, each reading ``args`` (the weights, prompts, iteration and
    timestep) and its own member's previous step (``before``; the chunk's noise before
    the first step), and each giving the step's whole result (but at the chunk's last
    step, which only member 0 gives). Member 0 keeps the step's key, so what reads the
    step reads it. Returns the members' keys."""
    i, c, t = meta["iteration"], meta["chunk"], meta["timestep"]
    gang = context_gang_id(i, c, t, num_steps)
    weights = args[0].key
    members = [key] + [member_key(key, m) for m in range(1, degree)]
    for m, (k, previous) in enumerate(zip(members, before)):
        out.append(Node(k, DENOISE, dict(meta, gang=(gang, m, degree)),
                        (*args, Dep(previous)), [weights, previous]))
    return members


def group_reward_nodes(layout: GraphLayout, plan: IterationPlan) -> list[Node]:
    """A ``group_reward`` task per prompt group, reading the decoded images and the
    rewards of the chunks holding its samples (a chunk may hold several groups, a group
    span several chunks), in pairs. It sits at its last chunk's place, with that chunk's
    version."""
    i = plan.iteration
    out = []
    for g in range(plan.num_groups):
        chunks = plan.chunks_of_group(g)
        last = chunks[-1]
        ids = plan.group_sample_ids(g)
        metadata = plan.metadata[g] if plan.metadata else ""
        inputs = plan.inputs[g] if plan.inputs else None
        out.append(Node(group_reward_key(i, g), GROUP_REWARD,
                        task_meta(GROUP_REWARD, i, layout.chunk_version(plan, last),
                                  gpu=layout.group_reward_gpu, chunk=last, group=g,
                                  samples=len(ids)),
                        (ids, plan.prompts[g], metadata, inputs,
                         *(Dep(k) for c in chunks for k in (decode_key(i, c),
                                                              reward_key(i, c))))))
    return out


def chain_keys_trained(layout: GraphLayout, plan: IterationPlan) -> list[Key]:
    """The rollout keys the micro-steps read: the latents before and after each trained
    step (coupled), or each chunk's final latent (decoupled)."""
    i = plan.iteration
    alg = layout.algorithm
    assert alg is not None  # (set when the layout is made)
    keys = []
    if not alg.keeps_trajectory():
        return [denoise_key(i, c, layout.num_steps - 1) for c in range(len(plan.chunks))]
    trained = alg.micro_steps(i)
    for c in range(len(plan.chunks)):
        mine = dict.fromkeys(k for t in trained
                             for k in (_before(i, c, t), denoise_key(i, c, t)))
        keys += list(mine)
    return keys


def _before(i: int, c: int, t: int) -> Key:
    """The latent step ``t`` of chunk ``c`` starts from."""
    return noise_key(i, c) if t == 0 else denoise_key(i, c, t - 1)


def train_nodes(layout: GraphLayout, plan: IterationPlan, state: Key | None = None
                ) -> list[Node]:
    """advantage per group, grad per chunk and micro-step, the reduction tree. External
    inputs: rewards and latents of the rollout, the weights of version i (and, for an
    algorithm with a sampling copy, the trainer state ``state`` they are taken from:
    version i's read back by default, as the driver submits it)."""
    i = plan.iteration
    out = advantage_nodes(layout, plan)
    leaves = _micro_steps(layout, plan, state, out)
    # A fixed reduction tree: sums in (chunk, micro-step) order whoever computes the parts.
    fanin = layout.reduce_fanin
    level, nodes = 0, leaves
    meta = task_meta(REDUCE, i, i)
    while True:
        parents = []
        for j in range(0, len(nodes), fanin):
            key = reduce_key(i, level, j // fanin)
            parents.append(key)
            out.extend(_summed_in_order(key, nodes[j:j + fanin], meta))
        nodes, level = parents, level + 1
        if len(nodes) == 1:
            break
    return out


def advantage_nodes(layout: GraphLayout, plan: IterationPlan) -> list[Node]:
    """An ``advantage`` task per prompt group, reading the rewards of its chunks (or, with
    ``advantage_std: batch``, of every chunk) and its group rewards."""
    i = plan.iteration
    n_chunks = len(plan.chunks)
    versions = {c: layout.chunk_version(plan, c) for c in range(n_chunks)}
    out = []
    batch = layout.advantage_std == "batch"
    for grp in range(plan.num_groups):
        chunks = range(n_chunks) if batch else plan.chunks_of_group(grp)
        scored = [reward_key(i, c) for c in chunks]
        if layout.group_rewards:
            scored += [group_reward_key(i, g)
                       for g in (range(plan.num_groups) if batch else [grp])]
        bv = min(versions[c] for c in plan.chunks_of_group(grp))
        out.append(Node(advantage_key(i, grp), ADVANTAGE,
                        task_meta(ADVANTAGE, i, i, group=grp, behaviour_version=bv,
                                  samples=plan.samples_per_prompt),
                        (grp, plan.group_sample_ids(grp), layout.advantage_std,
                         layout.advantage_clip, *(Dep(k) for k in scored))))
    return out


def _micro_steps(layout: GraphLayout, plan: IterationPlan, state: Key | None,
                 out: list[Node]) -> list[Key]:
    """Append the iteration's micro-steps (``grad`` tasks, each reading version i's
    weights first) to ``out``, with the ``trained`` task of an algorithm whose published
    weights are its sampling copy; their keys in (chunk, micro-step) order."""
    i = plan.iteration
    alg = layout.algorithm
    assert alg is not None  # (set when the layout is made)
    versions = {c: layout.chunk_version(plan, c) for c in range(len(plan.chunks))}
    weights = publish_key(i)
    if alg.sampling_copy and not layout.shards:
        # The version's trained weights (its published ones are the sampling copy).
        weights = trained_key(i)
        out.append(Node(weights, TRAINED, task_meta(TRAINED, i, i),
                        (Dep(restore_key(i) if state is None else state),)))
    reference = Dep(publish_key(0)) if layout.kl else None
    leaves: list[Key] = []
    if alg.keeps_trajectory():
        _coupled_grads(layout, plan, weights, reference, versions, out, leaves)
    else:
        _decoupled_grads(layout, plan, weights, reference, versions, out, leaves)
    return leaves


def sharded_train_nodes(layout: GraphLayout, plan: IterationPlan, made: Key) -> list[Node]:
    """advantage per group, then the iteration's micro-steps in rounds of one per member
    of the gang of ``layout.shards`` trainers (sharded training): member ``m`` of round
    ``r`` trains micro-step ``r k + m`` in (chunk, micro-step) order, or, past the last,
    takes part without contributing (reading round ``r``'s first micro-step's inputs).
    Each member's task reads its previous step's result -- the previous round's, or,
    in round 0, that of the gang that made version i (``made``: its key, whose members'
    keys are :func:`member_key`) -- so each rank runs its steps in order. No weights
    are read: the gang holds version i sharded. The last round's members are what the
    optimizer step (:func:`sharded_tail_nodes`) reads."""
    i, k = plan.iteration, layout.shards
    out = advantage_nodes(layout, plan)
    units: list[Node] = []      # (sharded: the micro-steps alone, no trained task)
    _micro_steps(layout, plan, None, units)
    rounds = sharded_rounds(layout, plan)
    for r in range(rounds):
        for m in range(k):
            u = r * k + m
            unit = units[u] if u < len(units) else units[r * k]
            previous = member_key(round_key(i, r - 1) if r else made, m)
            meta = dict(unit.meta, gang=(gang_id(i, r), m, k))
            if u >= len(units):
                meta["samples"] = 0
            # The unit's arguments after its weights (the gang holds them).
            out.append(Node(member_key(round_key(i, r), m), GRAD, meta,
                            (m, r, r == rounds - 1, u < len(units), Dep(previous),
                             *unit.args[1:])))
    return out


def sharded_rounds(layout: GraphLayout, plan: IterationPlan) -> int:
    """How many rounds of micro-steps a sharded iteration of ``plan`` has."""
    return -(-layout.leaves(plan) // layout.shards)


def train_outputs(layout: GraphLayout, plan: IterationPlan) -> list[Key]:
    """What an iteration's train piece leaves for its optimizer step: the reduction's
    root, or the last round's members (sharded)."""
    if not layout.shards:
        return [layout.reduce_root(plan)]
    last = round_key(plan.iteration, sharded_rounds(layout, plan) - 1)
    return [member_key(last, m) for m in range(layout.shards)]


def making_nodes(layout: GraphLayout, version: int, *, written: bool,
                 from_checkpoint: bool = False,
                 previous: list[Key] | None = None) -> list[Node]:
    """The gang that makes policy ``version`` on the ``layout.shards`` trainers, and the
    version's publish (member 0's gathered weights). Version 0 (``init`` members) and a
    resumed run's first version (``restore`` members, ``from_checkpoint``) are made from
    nothing the run computed; later versions by iteration ``version - 1``'s optimizer
    step (``optimize`` members), reading ``previous``: the last round's members.
    ``written``: the members write the version's sharded checkpoint. With
    ``layout.broadcast`` the version is published by a gang of every member of the
    group (``publish`` members), the ``publish`` task itself only a reference to the
    weights every worker of the group then holds."""
    k = layout.shards
    i = version - 1
    gang = gang_id(i, MAKING_STEP)
    # With a broadcast, the group spans the rollout workers that receive too: they join
    # it in the gang that forms it (members k and on, which only join).
    size = k + (layout.receivers if layout.broadcast else 0)
    nodes = []
    if previous is None:
        kind = RESTORE if from_checkpoint else INIT
        base = restore_key(version) if from_checkpoint else optimize_key(i)
        for m in range(size):
            nodes.append(Node(member_key(base, m), kind,
                              task_meta(kind, i, version, gpu=True, gang=(gang, m, size, k)),
                              (m, version, from_checkpoint, written)))
    else:
        base = optimize_key(i)
        for m in range(k):
            nodes.append(Node(member_key(base, m), OPTIMIZE,
                              task_meta(OPTIMIZE, i, i, gang=(gang, m, k)),
                              (m, i, written, Dep(previous[m]))))
    if not layout.broadcast:
        nodes.append(Node(publish_key(version), PUBLISH, task_meta(PUBLISH, i, version),
                          (Dep(member_key(base, 0)),)))
        return nodes
    # Every member of the group takes part in the broadcast: member 0 sends the weights
    # it gathered, the others receive them (reading member 0's manifest, and after a
    # gang that forms the group, their own part of it). The version's publish is done
    # once all have.
    cast = gang_id(i, PUBLISHING_STEP)
    made = previous is None
    for m in range(size):
        joined = (Dep(member_key(base, m)),) if made and m else ()
        nodes.append(Node(member_key(publish_key(version), m), PUBLISH,
                          task_meta(PUBLISH, i, version, gpu=True, gang=(cast, m, size, k)),
                          (m, version, Dep(member_key(base, 0)), *joined)))
    nodes.append(Node(publish_key(version), PUBLISH, task_meta(PUBLISH, i, version),
                      tuple(Dep(member_key(publish_key(version), m)) for m in range(size))))
    return nodes


def state_members(layout: GraphLayout, nodes: list[Node]) -> list[Key]:
    """The keys of the trainers' members among :func:`making_nodes`' ``nodes``: their
    results are the version's trainer state, by member (a broadcast's receivers and
    publish members hold none)."""
    return [n.key for n in nodes if n.op in (INIT, RESTORE, OPTIMIZE)
            and n.meta["gang"] is not None and n.meta["gang"][1] < layout.shards]


def sharded_tail_nodes(layout: GraphLayout, plan: IterationPlan, written: bool) -> list[Node]:
    """The sharded optimizer step of iteration i (making and publishing version i + 1,
    :func:`making_nodes`) and its statistics."""
    i = plan.iteration
    nodes = making_nodes(layout, i + 1, written=written,
                         previous=train_outputs(layout, plan))
    nodes.append(Node(stats_key(i), STATS, task_meta(STATS, i, i),
                      (Dep(member_key(optimize_key(i), 0)),)))
    return nodes


def _coupled_grads(layout: GraphLayout, plan: IterationPlan, weights: Key,
                   reference: Dep | None, versions: dict[int, int], out: list[Node],
                   leaves: list[Key]) -> None:
    """A coupled algorithm's micro-steps: chunk ``c`` at trained step ``t`` reads the
    latents before and after step ``t`` (and the step's log-probability with it)."""
    i = plan.iteration
    assert layout.algorithm is not None  # (set when the layout is made)
    trained = layout.algorithm.micro_steps(i)
    for c, _, groups in layout.units(plan):
        prompts = plan.chunk_prompts(c)
        advantages = [advantage_key(i, grp) for grp in groups]
        # The micro-steps' annotations differ only in their timestep.
        step_meta = task_meta(GRAD, i, i, timestep=0, chunk=c, group=groups[0],
                              behaviour_version=versions[c], samples=len(plan.sample_ids(c)))
        for t in trained:
            key = grad_key(i, c, t)
            leaves.append(key)
            before = _before(i, c, t)
            after = denoise_key(i, c, t)
            meta = step_meta.copy()
            meta["timestep"] = t
            deps = [weights, before, after, *advantages]
            if reference is not None:
                deps.insert(1, reference.key)
            out.append(Node(key, GRAD, meta,
                            (Dep(weights), reference, prompts, t, Dep(before), Dep(after),
                             *(Dep(a) for a in advantages)), deps))


def _decoupled_grads(layout: GraphLayout, plan: IterationPlan, weights: Key,
                     reference: Dep | None, versions: dict[int, int], out: list[Node],
                     leaves: list[Key]) -> None:
    """A decoupled algorithm's micro-steps: draw ``j`` of a unit (a chunk, or a pairwise
    algorithm's first chunk of its groups) reads the final latents of the chunks it
    trains and their groups' advantages; with a sampling copy also the copy that sampled
    them and, where that is an older version's, the copy of the version it trains (its
    loss's anchor); with ``reads_sampler`` the weights that sampled them, where older."""
    i = plan.iteration
    alg = layout.algorithm
    assert alg is not None  # (set when the layout is made)
    final = layout.num_steps - 1
    for c, reads, groups in layout.units(plan):
        bv = min(versions[k] for k in reads)
        sampling = anchor = None
        if alg.sampling_copy or (alg.reads_sampler and bv != i):
            sampling = Dep(publish_key(bv))
        if alg.sampling_copy and bv != i:
            anchor = Dep(publish_key(i))
        prompts = tuple(p for k in reads for p in plan.chunk_prompts(k))
        latents = tuple(Dep(denoise_key(i, k, final)) for k in reads)
        advantages = tuple(Dep(advantage_key(i, g)) for g in groups)
        samples = (2 * len(groups) if alg.pairwise
                   else sum(len(plan.sample_ids(k)) for k in reads))
        for j in alg.micro_steps(i):
            key = grad_key(i, c, j)
            leaves.append(key)
            meta = task_meta(GRAD, i, i, timestep=j, chunk=c, group=groups[0],
                             behaviour_version=bv, samples=samples)
            out.append(Node(key, GRAD, meta, (Dep(weights), sampling, anchor, reference,
                                              prompts, i, j, *latents, *advantages)))


def _summed_in_order(key: Key, parts: list[Key], meta: dict) -> list[Node]:
    """The tree node ``key`` summing ``parts`` left to right, as a chain of tasks that
    each add one part to the sum so far: ``(*key, k)`` sums the first ``k + 1`` parts
    and ``key`` all of them. The sum is the same bits as one task adding every part in
    that order, but each part is added as soon as it and the sum before it exist, so
    the node's last task adds only the last part to arrive (not all of them)."""
    if len(parts) <= 2:
        return [Node(key, REDUCE, meta, tuple(Dep(k) for k in parts))]
    out, total = [], parts[0]
    for k, part in enumerate(parts[1:], start=1):
        step = key if k == len(parts) - 1 else (*key, k)
        out.append(Node(step, REDUCE, meta, (Dep(total), Dep(part))))
        total = step
    return out


def tail_nodes(layout: GraphLayout, plan: IterationPlan, state: Key,
               checkpoint: bool = False, written: bool = True) -> list[Node]:
    """The optimizer step from trainer state ``state`` and the reduced gradient.

    Without ``checkpoint`` (the simulator's whole-iteration graph) it publishes version
    i + 1 from the optimizer step itself. With it (the driver's pieces, ``state`` being
    :func:`restore_key` ``(i)``, submitted apart) version i + 1 is published from its
    state read back (:func:`restore_nodes` ``(i + 1, publish=True)``), and the tail
    writes checkpoint i + 1 unless ``written`` is false (a version the run does not
    checkpoint, :meth:`GraphLayout.writes_checkpoint`): published weights of a
    checkpointed version then never need more than their own checkpoint to be
    recomputed."""
    i = plan.iteration
    root = layout.reduce_root(plan)
    stepped = optimize_key(i)
    out = [Node(stepped, OPTIMIZE, task_meta(OPTIMIZE, i, i), (Dep(state), Dep(root), i))]
    if not checkpoint:
        out.append(Node(publish_key(i + 1), PUBLISH, task_meta(PUBLISH, i, i + 1),
                        (Dep(stepped),)))
    elif written:
        out.append(Node(checkpoint_key(i + 1), CHECKPOINT,
                        task_meta(CHECKPOINT, i, i + 1), (i + 1, Dep(stepped))))
    out.append(Node(stats_key(i), STATS, task_meta(STATS, i, i), (Dep(stepped),)))
    return out


# ------------------------------------------------------------------ evaluation


def eval_iteration(version: int) -> int:
    """The iteration an evaluation of policy ``version`` belongs to (and is stored
    with): the one that published the version; version 0's is iteration 0."""
    return max(version - 1, 0)


def eval_chunks(count: int, chunk_size: int) -> list[tuple[int, int]]:
    """The held-out prompts ``0 .. count-1`` in consecutive ``[start, stop)`` chunks of
    ``chunk_size`` (the last one may hold fewer)."""
    return [(a, min(a + chunk_size, count)) for a in range(0, count, chunk_size)]


def eval_nodes(layout: GraphLayout, version: int, prompts: tuple[str, ...],
               metadata: tuple[str, ...], chunk_size: int, inputs: tuple = ()) -> list[Node]:
    """The evaluation of policy ``version`` on the held-out ``prompts``: per chunk an
    ``eval`` task (the whole ODE sampling loop from each prompt's fixed noise, then
    decoding) and an ``eval_reward`` task scoring its images. ``metadata``: each
    prompt's metadata as JSON text, or () when none has any; ``inputs``: each prompt's
    source images and negative prompt, or () when none has any. External input: the
    published weights of ``version``. Nothing of an iteration reads them."""
    i = eval_iteration(version)
    weights = publish_key(version)
    out = []
    for c, (a, b) in enumerate(eval_chunks(len(prompts), chunk_size)):
        ids = tuple(range(a, b))
        chunk_prompts = tuple(prompts[a:b])
        common: dict[str, Any] = dict(chunk=c, samples=len(ids))
        key = eval_key(version, c)
        chunk_inputs = tuple(inputs[a:b]) if inputs else ()
        out.append(Node(key, EVAL, task_meta(EVAL, i, version, **common),
                        (Dep(weights), ids, chunk_prompts, chunk_inputs)))
        out.append(Node(eval_reward_key(version, c), EVAL_REWARD,
                        task_meta(EVAL_REWARD, i, version, gpu=layout.reward_gpu, **common),
                        (chunk_prompts, Dep(key), tuple(metadata[a:b]) if metadata else (),
                         chunk_inputs)))
    return out
