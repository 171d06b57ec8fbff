"""The tasks of a run that trains sharded (``train.sharding: fsdp``): each a gang member's
part of a collective step over the trainers' group (docs/architecture.md, "Sharded
runs").

A gang of ``k`` members (one task per trainer, member ``i`` on the ``i``-th worker of the
pool that trains, rank ``i`` of the group) makes each policy version:

* :func:`make` (version 0's, or a resumed run's version read from its sharded checkpoint)
  joins the collective group of the run's generation, builds the sharded transformer and
  keeps its :class:`~digenrl.tasks.sharding.ShardedTrainer` in the worker process, where
  the later steps of that generation find it;
* :func:`micro_step`, one per member and round of an iteration's micro-steps (member
  ``i`` of round ``r`` trains the iteration's micro-step ``r k + i``, or, past the last,
  takes part with no contribution), accumulates gradients without communicating; the
  last round's reduce-scatters their sum;
* :func:`optimizer_step` steps each shard, writes the version's sharded checkpoint where
  the run keeps one, and gathers the new version's weights on member 0.

Member 0's result carries the weights (and the optimizer step's statistics), which
:func:`published` and :func:`statistics` hand to the rollout workers and the driver
through Dask as an unsharded run's are. Publishing by broadcast (``ShardSpec.broadcast``),
the group spans every worker of the run and member 0's result carries only the version's
manifest: :func:`publish_member`, a gang of every member, sends the weights from member 0
to the others' resident transformers, and :func:`announced` is the version's reference
once all hold it (docs/architecture.md, "Publishing by broadcast"). Each member's result is a small
:class:`ShardedOut`, which the member's next step reads: it orders the steps of each
member, so every rank runs the same collectives in the same order.

The trainer state lives only in the gang's processes, so a gang step is never computed
again within its generation: Dask recomputing a lost member's result from its lineage
would rebuild version 0 or run a micro-step twice. Every failure of a gang step is a
:class:`GangLost` instead, with one line saying why: a member's worker lost (its
collectives fail, gloo at once and NCCL within ``cluster.collective_timeout``), a step
asked to run again (the gang that made the generation's trainers records each member in
the scheduler's metadata once made, and a member's later step checks the version and
round it continues from), a worker holding no trainer. The run then forms its gang anew,
as a newer generation of the group on the pool's workers at that time, and continues
from its newest sharded checkpoint (:class:`~digenrl.run.runner.Runner`,
``cluster.gang_restarts``).
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

from digenrl.models.lora import trainable_parameters
from digenrl.tasks import broadcast, collective
from digenrl.tasks.broadcast import BUCKET_MB, Manifest
from digenrl.tasks.collective import CollectiveError
from digenrl.tasks.resident import resident, sharded_weights
from digenrl.tasks.sharding import ShardedTrainer, sharded_policy
from digenrl.tasks.train import TrainSpec
from digenrl.tasks.types import IterationStats, PolicyWeights, travels

__all__ = ["ShardSpec", "ShardedOut", "GangLost", "make", "micro_step", "optimizer_step",
           "published", "publish_member", "announced", "statistics", "read_published",
           "held_trainer", "leave", "TRAINING"]

#: The subgroup of the trainers in a group that spans the rollout workers too.
TRAINING = "training"


class GangLost(CollectiveError):
    """A gang step of a sharded run failed: its generation's trainer state can no longer
    be trusted whole, and the run forms a new gang from its newest sharded checkpoint."""


@dataclass(frozen=True)
class ShardSpec:
    """The gang a run trains on: its collective group and where its checkpoints go."""

    #: The collective group's name and generation (a run's own: a resumed run, or one
    #: after a member was replaced, forms a newer one).
    name: str
    generation: int
    #: The members' worker names, in the order of the pool that trains (rank = index).
    members: tuple[str, ...]
    backend: str            # cluster.collective_backend
    timeout: float          # cluster.collective_timeout
    store: str              # the run's store: its sharded checkpoints
    #: Versions are published by collective broadcast (``train.weight_sync``) from
    #: member 0 to every other worker of the group: the other trainers and ``receivers``,
    #: the rollout pool's workers (in its order), which the group then spans.
    broadcast: bool = False
    receivers: tuple[str, ...] = ()
    bucket_mb: float = BUCKET_MB   # train.sync_bucket_mb

    @property
    def size(self) -> int:
        """The trainers: the gang of every training step."""
        return len(self.members)

    @property
    def everyone(self) -> tuple[str, ...]:
        """The group's workers: the trainers, then the receivers."""
        return self.members + self.receivers


@dataclass
class ShardedOut:
    """What a gang member's step leaves for the next: the member and the trainer's
    version after the step (and where the step's round of the iteration is, for a
    micro-step); on member 0 of a step that made a version, its published weights and
    (the optimizer step's) statistics."""

    member: int
    version: int
    round: int = -1
    weights: PolicyWeights | None = None
    stats: IterationStats | None = None
    #: With a broadcast: the version's manifest (member 0 holds the weights).
    manifest: Manifest | None = None


travels(ShardedOut)

#: This process's sharded trainer, by group name: (generation, trainer).
_HELD: dict[str, tuple[int, ShardedTrainer]] = {}
_LOCK = threading.Lock()


@contextmanager
def gang_step(shard: ShardSpec, member: int, what: str) -> Iterator[None]:
    """Run member ``member``'s part of a gang step (``what``), turning every failure of
    the group (a collective error, a lost peer, a member in the wrong state) into
    :class:`GangLost`; other errors (the step's own) pass as they are. A member whose
    step failed so leaves the group's generation: its connections close, so the members
    still waiting in a collective with it fail at once rather than at the timeout."""
    try:
        yield
    except GangLost:
        leave(shard.name, shard.generation)
        raise
    except (CollectiveError, RuntimeError) as e:
        if not collective.failed(e):
            raise
        leave(shard.name, shard.generation)
        raise GangLost(f"{what} of member {member} ({shard.everyone[member]!r}) of "
                       f"{shard.name!r} generation {shard.generation} failed: "
                       f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from e


def held_trainer(shard: ShardSpec, member: int, version: int) -> ShardedTrainer:
    """This worker's sharded trainer of ``shard``'s generation, at policy ``version``, as
    member ``member``; :class:`GangLost` saying what is wrong otherwise."""
    group = collective.group(shard.name, shard.generation)  # (raises if stale or absent)
    if group.rank != member:
        raise GangLost(f"sharded step: member {member} of {shard.name!r} runs on rank "
                       f"{group.rank}: the gang's order is the group's")
    with _LOCK:
        held = _HELD.get(shard.name)
    if held is None or held[0] != shard.generation:
        raise GangLost(f"sharded step: worker {shard.members[member]!r} holds no sharded "
                       f"trainer of {shard.name!r} generation {shard.generation} (its "
                       f"process restarted, or a member was lost)")
    trainer = held[1]
    if trainer.version != version:
        raise GangLost(f"sharded step: expected the trainer at policy version {version} on "
                       f"worker {shard.members[member]!r}, found version {trainer.version} "
                       f"(a step asked to run again after a member was lost)")
    return trainer


def _made_key(shard: ShardSpec, member: int) -> list[str]:
    """Where the scheduler's metadata records that ``member`` of the generation was made."""
    return [collective.METADATA, shard.name, str(shard.generation), "made", str(member)]


def _once(shard: ShardSpec, member: int) -> None:
    """A generation's trainers are made once: a second make of a member (Dask
    recomputing a lost result) is :class:`GangLost`."""
    from distributed import get_client

    if get_client().get_metadata(_made_key(shard, member), default=False):
        raise GangLost(f"sharded step: member {member} of {shard.name!r} generation "
                       f"{shard.generation} was made before: its trainer state was lost "
                       f"with a worker, and is not built again within a generation")


def make(spec: TrainSpec, shard: ShardSpec, member: int, version: int,
         from_checkpoint: bool, written: bool) -> ShardedOut:
    """Member ``member`` joins the gang's group and builds its sharded trainer at policy
    ``version``: version 0's initial weights, or (``from_checkpoint``) the version's
    sharded checkpoint in the store, on however many ranks wrote it. ``written``: write
    the version's sharded checkpoint (version 0 of a new run)."""
    from distributed import get_client
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    if version != 0 and not from_checkpoint:
        raise ValueError(f"version: a sharded trainer starts at version 0 or from a "
                         f"checkpoint, got version {version} without one")
    with gang_step(shard, member, f"making version {version}"):
        _once(shard, member)
        group = collective.join(shard.name, shard.everyone, shard.generation,
                                backend=shard.backend, timeout=shard.timeout,
                                subgroups={TRAINING: shard.members} if shard.receivers else None)
        if group.rank != member:
            raise GangLost(f"sharded step: member {member} of {shard.name!r} joined as "
                           f"rank {group.rank}: the gang's order is the group's")
        if member >= shard.size:   # a receiver of the broadcasts: it only joins
            get_client().set_metadata(_made_key(shard, member), True)
            return ShardedOut(member, version)
        if shard.receivers:
            mesh = DeviceMesh.from_group(group.subgroup(TRAINING), group.device.type)
        else:
            mesh = init_device_mesh(group.device.type, (group.size,))
        trainer = ShardedTrainer(spec, sharded_policy(spec, mesh))
        if from_checkpoint:
            trainer.load_checkpoint(shard.store, version)
        if written:
            trainer.save_checkpoint(shard.store)
        with _LOCK:
            _HELD[shard.name] = (shard.generation, trainer)
        get_client().set_metadata(_made_key(shard, member), True)
        return _made(spec, shard, member, trainer)


def _made(spec: TrainSpec, shard: ShardSpec, member: int, trainer: ShardedTrainer,
          stats: IterationStats | None = None) -> ShardedOut:
    """Member ``member``'s result of a step that made the trainer's version: on member 0
    the version's weights (gathered; every member takes part), or with a broadcast their
    manifest, the weights loaded into this worker's resident transformer for
    :func:`publish_member` to send."""
    weights = trainer.published()
    if weights is None or not shard.broadcast:
        return ShardedOut(member, trainer.version, weights=weights, stats=stats)
    module = resident(spec.model, spec.seed, spec.trainable).policy(weights)
    manifest = Manifest.of(trainer.version, _tensors(module), shard.bucket_mb)
    return ShardedOut(member, trainer.version, stats=stats, manifest=manifest)


def _tensors(module) -> dict:
    """What a broadcast carries of a resident transformer: its trainable tensors."""
    return {n: p.data for n, p in trainable_parameters(module).items()}


def micro_step(spec: TrainSpec, shard: ShardSpec, member: int, round_: int, last: bool,
               contributes: bool, previous: ShardedOut, *args) -> ShardedOut:
    """Member ``member``'s micro-step of round ``round_``: ``args`` are an unsharded
    micro-step's arguments after its weights (coupled: the reference, prompts, the
    trained step, the latents before and after it, the advantages; decoupled: the
    sampling weights, the anchor, the reference, prompts, iteration, draw, final latents
    and advantages), the modules of the weights it names taken from the worker's
    resident models. ``last``: the iteration's last round (its backward reduce-scatters);
    without ``contributes`` the member only takes part."""
    models = resident(spec.model, spec.seed, spec.trainable)

    def module(weights: PolicyWeights | None):
        return models.policy(weights) if weights is not None else None

    with gang_step(shard, member, f"micro-step round {round_}"):
        trainer = held_trainer(shard, member, previous.version)
        expected = previous.round + 1
        if round_ != expected:
            raise GangLost(f"sharded step: expected round {expected} on worker "
                           f"{shard.members[member]!r}, got round {round_}")
        if spec.algorithm.coupled:
            reference, prompts, t, before, after, *advantages = args
            trainer.grad(module(reference), prompts, t, before, after, *advantages,
                         last=last, contributes=contributes)
        else:
            sampling, anchor, reference, prompts, iteration, j, *inputs = args
            trainer.matching_grad(module(sampling), module(anchor), module(reference),
                                  prompts, iteration, j, *inputs, last=last,
                                  contributes=contributes)
        return ShardedOut(member, trainer.version, round=-1 if last else round_)


def optimizer_step(spec: TrainSpec, shard: ShardSpec, member: int, iteration: int,
                   written: bool, previous: ShardedOut) -> ShardedOut:
    """Member ``member``'s part of iteration ``iteration``'s optimizer step: each shard's
    AdamW step (version + 1), the version's sharded checkpoint where ``written``, and
    the new version's weights gathered on member 0."""
    with gang_step(shard, member, f"the optimizer step of iteration {iteration}"):
        trainer = held_trainer(shard, member, previous.version)
        if previous.round != -1:
            raise GangLost(f"sharded step: the optimizer step of iteration {iteration} on "
                           f"worker {shard.members[member]!r} follows round "
                           f"{previous.round}, not the iteration's last")
        stats = trainer.optimize(iteration)
        if written:
            trainer.save_checkpoint(shard.store)
        return _made(spec, shard, member, trainer, stats if member == 0 else None)


def published(out: ShardedOut) -> PolicyWeights:
    """The weights member 0 of a gang gathered for the version it made."""
    if out.weights is None:
        raise ValueError(f"publish: expected member 0's result of the step that made the "
                         f"version, got member {out.member}'s")
    return out.weights


def publish_member(spec: TrainSpec, shard: ShardSpec, member: int, version: int,
                   made: ShardedOut, *joined: ShardedOut) -> ShardedOut:
    """Member ``member``'s part of broadcasting ``version`` (``made``: member 0's result
    of the step that made it, with its manifest; ``joined``: the member's own part of a
    gang that formed the group): member 0 sends the weights it holds, every other member
    receives them into its resident transformer, in place."""
    with gang_step(shard, member, f"the broadcast of version {version}"):
        group = collective.group(shard.name, shard.generation)
        if group.rank != member:
            raise GangLost(f"sharded step: member {member} of {shard.name!r} runs on rank "
                           f"{group.rank}: the gang's order is the group's")
        manifest = made.manifest
        if manifest is None or manifest.version != version:
            raise GangLost(f"sharded step: the broadcast of version {version} expected its "
                           f"manifest from member 0, got "
                           f"{'none' if manifest is None else manifest.version}")
        models = resident(spec.model, spec.seed, spec.trainable)
        copy = spec.algorithm.sampling_copy
        if member == 0:
            module = models.held(version, copy)
            if module is None:
                raise GangLost(f"sharded step: worker {shard.everyone[0]!r} holds version "
                               f"{version} no more: it cannot send it")
            broadcast.send(group, _tensors(module), manifest)
        else:
            models.receive(version, copy,
                           lambda into: broadcast.receive(group, manifest, into))
        return ShardedOut(member, version)


def announced(spec: TrainSpec, shard: ShardSpec, *members: ShardedOut) -> PolicyWeights:
    """A broadcast version, once every member of the group holds it: what the tasks that
    compute with it read (no tensors travel)."""
    return PolicyWeights(version=members[0].version, tensors={},
                         sampling_copy=spec.algorithm.sampling_copy, held=True,
                         store=shard.store)


def statistics(out: ShardedOut) -> IterationStats:
    """The optimizer step's statistics (member 0's result)."""
    if out.stats is None:
        raise ValueError(f"stats: expected member 0's result of an optimizer step, got "
                         f"member {out.member}'s")
    return out.stats


def read_published(store: str, sampling_copy: bool, version: int) -> ShardedOut:
    """Version ``version``'s published weights read whole from its sharded checkpoint in
    one process (an older version a resumed run retains: the KL reference, the weights
    its first stale rollouts read)."""
    return ShardedOut(0, version, weights=sharded_weights(store, version, sampling_copy))


def leave(name: str, generation: int | None = None) -> str | None:
    """Drop this process's sharded trainer of group ``name`` and leave the group (the
    run is over), or only of its ``generation`` (a failed step's: a task of an older
    generation leaves a newer group alone)."""
    with _LOCK:
        held = _HELD.get(name)
        if held is not None and (generation is None or held[0] == generation):
            del _HELD[name]
    return collective.leave(name, generation)
