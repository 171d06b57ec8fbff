"""Helpers of the rule tests: a pure policy on named workers, tasks from their kind, and
the decisions noted on a task as its story reads them."""

from __future__ import annotations

from digenrl.schedulers.options import MODES, ScheduleOptions
from digenrl.schedulers.policy import SchedulingPolicy, TaskInfo
from digenrl.schedulers.policy.trail import Step, parse_trail, trail_text
from digenrl.vocabulary import KIND_POOL, ROLLOUT, TRAINER


class Clock:
    """A clock the test moves."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def opts(mode: str = "digenrl", **kw) -> ScheduleOptions:
    return ScheduleOptions(mode=mode, **{**MODES[mode], **kw})


def info(key, kind, iteration=0, version=0, gpu=True, **kw) -> TaskInfo:
    return TaskInfo(key=key, kind=kind, pool=KIND_POOL[kind], iteration=iteration,
                    policy_version=version, gpu=gpu, **kw)


def policy_with(options, rollout=1, trainer=1, version=0, clock=None) -> SchedulingPolicy:
    """Rollout workers r0.. (rollout-0..) and trainers t0.. (trainer-0..), one GPU each,
    version ``version`` published, a decision trail kept."""
    p = SchedulingPolicy(options, clock=clock or (lambda: 0.0))
    for j in range(rollout):
        p.add_worker(f"r{j}", f"rollout-{j}", ROLLOUT, 1)
    for j in range(trainer):
        p.add_worker(f"t{j}", f"trainer-{j}", TRAINER, 1)
    p.version = version
    return p


def steps(p: SchedulingPolicy, key) -> list[Step]:
    """The decisions noted on ``key`` so far, as a store would give them back."""
    return parse_trail(trail_text(p.trail_of(key)))


def said(p: SchedulingPolicy, key) -> list[tuple[str, str, str]]:
    """(verb, rule, worker) of each decision noted on ``key``."""
    return [(s.verb, s.rule, s.worker) for s in steps(p, key)]


def grads(n, iteration=0):
    return [info(("g", iteration, j), "grad", iteration=iteration, version=iteration,
                 chunk=j, timestep=0, behaviour_version=iteration) for j in range(n)]
