"""What a task costs on a profile's GPUs: one model for the emulator and the simulator.

A task computes for the profile's seconds of its kind and sample count on a speed-1 GPU
(:meth:`~digenrl.sim.profile.Profile.task_seconds`, divided by the worker's speed and
multiplied by any slowdown in force), except that

* a ``reward`` scored remotely (``costs.reward_on: remote``) takes no GPU time;
* a ``denoise`` step at context-parallel degree ``d`` (a gang of ``d`` members, each on
  its own rollout worker, all held for the step) computes the degree-1 seconds divided
  by ``d x cp_efficiency ** log2(d)`` and, on top (network time, not scaled by speed),
  Ulysses' all-to-alls: per attention layer four (q, k, v and the output), each moving
  ``(d-1)/d`` of a GPU's ``tokens/d x hidden x 2`` bytes, over NVLink within a node
  (:func:`cp_step_seconds`); which chunks run at which degree is
  :func:`chunk_degrees`' choice;
* the gradient all-reduce among the trainers is paid once per iteration, by the
  reduction root (the other ``reduce`` tasks only sum); with ``model.sharding: fsdp``
  it is a reduce-scatter of the fp32 gradients (:class:`Collectives`).

On top of that, before a task starts its worker pays, in seconds not scaled by its speed
(network and memory traffic, not compute):

* in the disaggregated modes, on a rollout worker, the first task that reads a policy
  version waits for its weights (``weight_bytes / bandwidth``): a rollout task (an
  ``encode`` reads none), or a ``grad`` micro-step lent to it (rollout-assisted
  training);
* in the co-located mode, each switch between rollout and training work costs
  ``colocated.phase_switch``;
* with ``model.sharding: fsdp`` (:class:`Collectives`), every micro-step of a worker in
  the sharded group (a trainer; in the co-located mode, every GPU) pays the all-gather
  of the weights for its forward and its backward; a rollout worker's first read of a
  version waits for the bucketed broadcast of the weights from the trainers instead of
  ``weight_bytes / bandwidth``, and in the co-located mode every GPU's first rollout
  read of a version waits for the all-gather of the bf16 weights it samples with.

:class:`TaskCosts` holds the compute seconds; :class:`Extras` the extra costs, applied to
each worker's :class:`WorkerHeld`. The simulator calls both in-process; the emulator
computes the seconds where it builds the tasks and ships the :class:`Extras` with each
task to the worker that pays them, so both pay the same costs by construction.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Sequence

from digenrl.graph.plan import IterationPlan
from digenrl.graph.structure import GraphLayout
from digenrl.schedulers.parallelism import (DEGREES, ParallelChoice, choose_parallelism,
                                            degree_plan, speedup)
from digenrl.sim.network import (FatTree, MESSAGE_LATENCY, NVLINK_BANDWIDTH, Placement,
                                 allgather_time, bucketed_broadcast_time)
from digenrl.config import AUTO
from digenrl.sim.profile import Profile
from digenrl.vocabulary import (Key, DECODE, DENOISE, GRAD, GROUP_REWARD, READS_NO_WEIGHTS,
                                REDUCE, REWARD, ROLLOUT_KINDS, TRAINING_KINDS)

__all__ = ["TaskCosts", "Extras", "WorkerHeld", "Collectives", "phase_of", "reduction_root",
           "cp_step_seconds", "sample_chain_seconds", "choose_degree",
           "chunk_degrees", "planned", "ULYSSES_ALL_TO_ALLS"]

#: All-to-alls per attention layer in Ulysses: q, k and v from tokens to heads, the
#: output back (DeepSpeed-Ulysses; diffusers' ``_all_to_all_single`` calls).
ULYSSES_ALL_TO_ALLS = 4
#: GPUs of one node: a gang within it exchanges over NVLink.
GPUS_PER_NODE = FatTree.gpus_per_node


def cp_step_seconds(profile: Profile, samples: int, degree: int) -> tuple[float, float]:
    """(compute on a speed-1 GPU, all-to-all network seconds) of one ``denoise`` step
    of a chunk of ``samples`` at context-parallel ``degree``, on each of its GPUs."""
    one = profile.task_seconds(DENOISE, samples)
    if degree <= 1:
        return one, 0.0
    c = profile.costs
    local = c.tokens_per_sample / degree * c.hidden_size * 2 * samples * c.cfg_factor
    moved = ULYSSES_ALL_TO_ALLS * c.attention_layers * (degree - 1) / degree * local
    bandwidth = NVLINK_BANDWIDTH if degree <= GPUS_PER_NODE else profile.network.bandwidth
    messages = ULYSSES_ALL_TO_ALLS * c.attention_layers * (degree - 1)
    network = moved / bandwidth + messages * MESSAGE_LATENCY
    return one / speedup(degree, profile.costs.cp_efficiency), network


def sample_chain_seconds(profile: Profile, degree: int) -> float:
    """One sample's generation at ``degree``: its steps, then its decode and reward on
    one GPU (what :func:`choose_degree` compares)."""
    compute, network = cp_step_seconds(profile, 1, degree)
    tail = profile.task_seconds(DECODE, 1)
    if profile.costs.reward_on == "gpu":
        tail += profile.task_seconds(REWARD, 1)
    return profile.num_steps * (compute + network) + tail


def choose_degree(profile: Profile, samples: int, workers: int,
                  measured: dict[int, float] | None = None) -> ParallelChoice:
    """``auto``'s choice for ``samples`` left on ``workers`` free rollout workers: the
    profile's predicted chain seconds per degree (``measured`` where given), its chunk
    size, the memory a sample's activations need on its rollout GPUs."""
    model = profile.model
    return choose_parallelism(
        samples, workers, predicted={d: sample_chain_seconds(profile, d) for d in DEGREES},
        measured=measured, sizes=(profile.chunk_size,),
        sample_gb=model.sample_activations_gb, free_gb=model.free_for_samples_gb())


def chunk_degrees(profile: Profile, chunks: int) -> list[int]:
    """The degree of each of an iteration's ``chunks``: the profile's fixed degree, or
    with ``auto`` :func:`choose_degree`'s for the iteration's chunks on the rollout
    pool, widened onto the workers its gangs leave idle (:func:`degree_plan`)."""
    workers = profile.rollout_workers
    if profile.context_parallel != AUTO:
        return [int(profile.context_parallel)] * chunks
    return degree_plan(chunks, workers,
                       choose_degree(profile, chunks * profile.chunk_size, workers))

#: MiB: ``network.sync_bucket_mb`` in bytes.
MIB = 2**20


def planned(profile: Profile, iterations: int) -> list[IterationPlan]:
    """The profile's first ``iterations`` plans, each chunk at its degree
    (:func:`chunk_degrees`): the graph computes a chunk at a degree above 1 as gangs."""
    plans = profile.plans(iterations)
    degrees = tuple(chunk_degrees(profile, len(plans[0].chunks))) if plans else ()
    if max(degrees, default=1) <= 1:
        return plans
    return [dataclasses.replace(p, context_parallel=degrees) for p in plans]


@dataclass(frozen=True)
class Collectives:
    """Seconds of the collectives a profile with ``model.sharding: fsdp`` pays, on the
    fat-tree of :mod:`digenrl.sim.network` (its GPUs 8 to a node, trainers first, NICs
    at ``network.bandwidth``), with ``ranks`` GPUs in the sharded group.

    ``allgather``: per micro-step, the bf16 weights gathered for the forward and again
    for the backward (``2 x (ranks-1)/ranks x weight_bytes`` per rank);
    ``reduce_scatter``: per iteration, the fp32 gradients (``(ranks-1)/ranks x
    grad_bytes`` per rank); ``publish``: per version, the bf16 weights to the rollout
    workers (disaggregated: a bucketed broadcast; co-located: an all-gather on every
    GPU)."""

    ranks: int
    allgather: float
    reduce_scatter: float
    publish: float

    @classmethod
    def of(cls, profile: Profile, *, colocated: bool) -> "Collectives | None":
        """None unless ``profile`` shards its training with FSDP."""
        if not profile.model.fsdp:
            return None
        net, c = profile.network, profile.costs
        fabric = FatTree(nic_bandwidth=net.bandwidth, latency=net.latency)
        ranks = profile.gpus if colocated else profile.trainer_workers
        gather = allgather_time(fabric, ranks, c.weight_bytes).seconds
        if colocated:
            publish = gather
        else:
            publish = bucketed_broadcast_time(
                Placement.of(profile, fabric.gpus_per_node), fabric, c.weight_bytes,
                net.sync_bucket_mb * MIB)
        return cls(ranks=ranks, allgather=2 * gather,
                   reduce_scatter=allgather_time(fabric, ranks, c.grad_bytes).seconds,
                   publish=publish)



def reduction_root(layout: GraphLayout, plan: IterationPlan) -> Key:
    """The key of the reduction root of ``plan``'s iteration: the ``reduce`` task that
    carries the all-reduce."""
    return layout.reduce_root(plan)


def phase_of(kind: str) -> str | None:
    """``rollout`` or ``train``: the phase a co-located worker is in while it runs a task
    of ``kind``; None for the bookkeeping kinds, which belong to neither."""
    if kind in ROLLOUT_KINDS:
        return "rollout"
    if kind in TRAINING_KINDS:
        return "train"
    return None


class TaskCosts:
    """Compute seconds of a task on a speed-1 GPU, for the iterations of ``plans``."""

    def __init__(self, profile: Profile, layout: GraphLayout, plans: Sequence[IterationPlan],
                 *, colocated: bool):
        self.profile = profile
        self.colocated = colocated
        self.remote_reward = profile.costs.reward_on == "remote"
        collectives = Collectives.of(profile, colocated=colocated)
        self.allreduce = (profile.allreduce_seconds() if collectives is None
                          else collectives.reduce_scatter)
        self.roots = {plan.iteration: reduction_root(layout, plan) for plan in plans}
        # (kind, samples) -> seconds: they depend on nothing else.
        self._seconds: dict[tuple[str, int], float] = {}
        # (samples, degree) -> a context-parallel step's (compute, network) seconds.
        self._steps: dict[tuple[int, int], tuple[float, float]] = {}

    def seconds(self, kind: str, samples: int, key: Key, iteration: int) -> float:
        """Seconds of the task ``key`` of ``kind`` over ``samples`` samples."""
        if kind == REDUCE:
            return self.allreduce if self.roots.get(iteration) == key else 0.0
        seconds = self._seconds.get((kind, samples))
        if seconds is None:
            if kind in (REWARD, GROUP_REWARD) and self.remote_reward:
                seconds = 0.0
            else:
                seconds = self.profile.task_seconds(kind, samples, colocated=self.colocated)
            self._seconds[(kind, samples)] = seconds
        return seconds

    def task(self, kind: str, samples: int, key: Key, iteration: int,
             gang: tuple[int, ...] | None) -> tuple[float, float]:
        """(compute, network) seconds of a task: a context-parallel step's member
        (``gang`` set on a ``denoise`` task) at its gang's degree (:meth:`step`), any
        other task its :meth:`seconds` and no network time."""
        if gang is not None and kind == DENOISE:
            return self.step(samples, gang[2])
        return self.seconds(kind, samples, key, iteration), 0.0

    def step(self, samples: int, degree: int) -> tuple[float, float]:
        """A member's (compute, network) seconds of a ``denoise`` step of ``samples``
        at context-parallel ``degree`` (:func:`cp_step_seconds`)."""
        s = self._steps.get((samples, degree))
        if s is None:
            s = self._steps[(samples, degree)] = cp_step_seconds(self.profile, samples,
                                                                 degree)
        return s


@dataclass
class WorkerHeld:
    """What a worker holds that the extra costs depend on."""

    versions: set[int] = field(default_factory=set)   # policy versions it has the weights of
    phase: str | None = None                           # co-located: rollout or train
    synced: float = 0.0                                # seconds it has waited for weights
    gathered: float = 0.0                              # seconds in FSDP's all-gathers


@dataclass(frozen=True)
class Extras:
    """The extra costs of one mode of one profile (see the module's description)."""

    weight_sync: float = 0.0     # a rollout worker's first read of a policy version
    phase_switch: float = 0.0    # co-located: a switch between rollout and training work
    allgather: float = 0.0       # fsdp: a micro-step on a worker of the sharded group
    every_worker_syncs: bool = False  # co-located fsdp: every GPU gathers each version

    @classmethod
    def of(cls, profile: Profile, *, colocated: bool) -> "Extras":
        fsdp = Collectives.of(profile, colocated=colocated)
        if colocated:
            if fsdp is None:
                return cls(phase_switch=profile.colocated.phase_switch)
            return cls(phase_switch=profile.colocated.phase_switch, weight_sync=fsdp.publish,
                       allgather=fsdp.allgather, every_worker_syncs=True)
        if fsdp is None:
            return cls(weight_sync=profile.weight_sync_seconds())
        return cls(weight_sync=fsdp.publish, allgather=fsdp.allgather)

    def pay(self, held: WorkerHeld, kind: str, version: int, rollout_worker: bool) -> float:
        """Seconds a worker holding ``held`` pays before a task of ``kind`` reading policy
        ``version`` (``rollout_worker``: a worker of the rollout pool; trainers hold
        every version they publish). Updates ``held``."""
        extra = 0.0
        if self.every_worker_syncs:  # co-located: every GPU samples from its own gather
            reads = kind in ROLLOUT_KINDS and kind not in READS_NO_WEIGHTS
        else:
            reads = (rollout_worker and kind not in READS_NO_WEIGHTS
                     and (kind in ROLLOUT_KINDS or kind == GRAD))
        if self.weight_sync and reads and version not in held.versions:
            held.versions.add(version)
            held.synced += self.weight_sync
            extra += self.weight_sync
        if self.allgather and kind == GRAD and (self.every_worker_syncs or not rollout_worker):
            # A micro-step in the sharded group gathers the weights for its forward and
            # its backward (a rollout worker lent one holds the version's weights whole).
            held.gathered += self.allgather
            extra += self.allgather
        if self.phase_switch:
            phase = phase_of(kind)
            if phase is not None:
                if held.phase is not None and held.phase != phase:
                    extra += self.phase_switch
                held.phase = phase
        return extra
