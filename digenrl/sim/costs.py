"""What a task costs on a profile's GPUs: one model for the emulator and the simulator.

A task computes for the profile's seconds of its kind and sample count on a speed-1 GPU
(:meth:`~digenrl.sim.profile.Profile.task_seconds`, divided by the worker's speed and
multiplied by any slowdown in force), except that

* a ``reward`` scored remotely (``costs.reward_on: remote``) takes no GPU time;
* the gradient all-reduce among the trainers is paid once per iteration, by the
  reduction root (the other ``reduce`` tasks only sum).

On top of that, before a task starts its worker pays, in seconds not scaled by its speed
(network and memory traffic, not compute):

* in the disaggregated modes, on a rollout worker, the first task that reads a policy
  version waits for its weights (``weight_bytes / bandwidth``): a rollout task (an
  ``encode`` reads none), or a ``grad`` micro-step lent to it (rollout-assisted
  training);
* in the co-located mode, each switch between rollout and training work costs
  ``colocated.phase_switch``.

:class:`TaskCosts` holds the compute seconds; :class:`Extras` the extra costs, applied to
each worker's :class:`WorkerHeld`. The simulator calls both in-process; the emulator
computes the seconds where it builds the tasks and ships the :class:`Extras` with each
task to the worker that pays them, so both pay the same costs by construction.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from digenrl.graph.plan import IterationPlan
from digenrl.graph.structure import GraphLayout
from digenrl.sim.profile import Profile
from digenrl.vocabulary import (Key, GRAD, GROUP_REWARD, READS_NO_WEIGHTS, REDUCE, REWARD,
                                ROLLOUT_KINDS, TRAINING_KINDS)

__all__ = ["TaskCosts", "Extras", "WorkerHeld", "phase_of", "reduction_root"]



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
        self.allreduce = profile.allreduce_seconds()
        self.roots = {plan.iteration: reduction_root(layout, plan) for plan in plans}
        # (kind, samples) -> seconds: they depend on nothing else.
        self._seconds: dict[tuple[str, int], float] = {}

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


@dataclass
class WorkerHeld:
    """What a worker holds that the extra costs depend on."""

    versions: set[int] = field(default_factory=set)   # policy versions it has the weights of
    phase: str | None = None                           # co-located: rollout or train
    synced: float = 0.0                                # seconds it has waited for weights


@dataclass(frozen=True)
class Extras:
    """The extra costs of one mode of one profile (see the module's description)."""

    weight_sync: float = 0.0     # a rollout worker's first read of a policy version
    phase_switch: float = 0.0    # co-located: a switch between rollout and training work

    @classmethod
    def of(cls, profile: Profile, *, colocated: bool) -> "Extras":
        if colocated:
            return cls(phase_switch=profile.colocated.phase_switch)
        return cls(weight_sync=profile.weight_sync_seconds())

    def pay(self, held: WorkerHeld, kind: str, version: int, rollout_worker: bool) -> float:
        """Seconds a worker holding ``held`` pays before a task of ``kind`` reading policy
        ``version`` (``rollout_worker``: a worker of the rollout pool; trainers hold
        every version they publish). Updates ``held``."""
        extra = 0.0
        if (self.weight_sync and rollout_worker and kind not in READS_NO_WEIGHTS
                and (kind in ROLLOUT_KINDS or kind == GRAD) and version not in held.versions):
            held.versions.add(version)
            held.synced += self.weight_sync
            extra += self.weight_sync
        if self.phase_switch:
            phase = phase_of(kind)
            if phase is not None:
                if held.phase is not None and held.phase != phase:
                    extra += self.phase_switch
                held.phase = phase
        return extra
