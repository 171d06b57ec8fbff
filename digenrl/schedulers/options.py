"""Scheduling switches. Pure data: the plugin, the policy and the simulator share it."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

__all__ = ["ScheduleOptions", "MODES"]


@dataclass(frozen=True)
class ScheduleOptions:
    """What the scheduling policy does: a mode's preset with any switch overridden.

    ``pools``: rollout tasks only on rollout workers and training tasks only on
    trainers (otherwise every GPU worker is one ``colocated`` pool).
    ``gap``: a group's training starts as soon as it is scored, and denoising finishes
    groups one after another (otherwise training waits for the whole iteration).
    ``tsp``: any trainer takes any micro-step (otherwise a chunk's micro-steps all run
    on the trainer the chunk is assigned to, as in data-parallel training).
    ``tag``: idle trainers take rollout tasks while no training work is runnable.
    ``rat``: rollout-assisted training: an idle rollout worker with no runnable rollout
    work takes one ``grad`` micro-step at a time when every trainer is busy and it is
    expected to finish the step no later than the trainers would (its input transfer
    counted); reductions, optimizer steps and the rest stay on trainers.
    ``max_staleness``: rollouts of iteration i start only once version i - k exists.
    ``slots_per_worker``: GPU tasks released to one worker at once (one runs, the rest
    wait on the worker and hide the scheduler round trip).
    ``rebalance``: a worker with nothing of its own to generate takes a rollout step
    whose latents sit on another rollout worker only when it is expected to finish it
    sooner there, counting the transfer of the inputs it lacks at
    ``transfer_bandwidth`` bytes/s, and a chunk starts on whichever worker frees first
    (off: a chunk runs on the worker that drew its noise, dealt round-robin).
    ``stall_timeout``: seconds without a finished GPU task after which a run that the
    progress watchdog cannot help stops (None: many times the longest expected task).
    """

    mode: str
    pools: bool
    gap: bool
    tsp: bool
    tag: bool
    max_staleness: int
    slots_per_worker: int = 2
    rebalance: bool = True
    rat: bool = False
    transfer_bandwidth: float = 1.0e9
    stall_timeout: float | None = None

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "ScheduleOptions":
        return cls(**data)


#: Each mode is a preset of the scheduling switches; the graph is the same for all.
MODES: dict[str, dict[str, Any]] = {
    "colocated": dict(pools=False, gap=False, tsp=False, tag=False, max_staleness=0,
                      rebalance=True, rat=False),
    "disaggregated": dict(pools=True, gap=False, tsp=False, tag=False, max_staleness=0,
                          rebalance=True, rat=False),
    "digenrl": dict(pools=True, gap=True, tsp=True, tag=True, max_staleness=1,
                    rebalance=True, rat=True),
}
