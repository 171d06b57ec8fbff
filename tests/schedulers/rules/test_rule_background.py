"""The background rule alone (policy/rules/background.py): evaluation takes only a
slot nothing else wants; the reasons noted."""

from __future__ import annotations

from digenrl.schedulers.policy.rules.background import Background
from digenrl.vocabulary import DENOISE, EVAL

from rule_helpers import info, opts, policy_with, said, steps


def test_evaluation_goes_to_an_idle_rollout_worker_after_everything_else():
    p = policy_with(opts("digenrl", tag=True, rat=False))
    p.add_tasks([info("e", EVAL, iteration=2, chunk=0), info("d", DENOISE, chunk=0,
                                                               timestep=0)])
    p.task_ready("e")
    p.task_ready("d")
    # The step first; the idle trainer never takes the evaluation.
    assert [(d.key, d.worker) for d in p.decide()] == [("d", "r0")]
    assert p.rule(Background).take(p.workers["r0"], 0.0) is None      # something in flight
    assert p.trail_of("e") == []
    p.task_done("d", "r0")
    assert [(d.key, d.worker) for d in p.decide()] == [("e", "r0")]
    assert said(p, "e") == [("released", "background", "rollout-0")]
    assert steps(p, "e")[0].reason == ("nothing else for this idle worker: no rollout step "
                                       "is ready and no grad waits to be lent")


def test_an_idle_worker_is_looked_at_again_while_evaluation_waits():
    p = policy_with(opts("digenrl", rat=False))
    candidates: set[str] = set()
    p.rule(Background).wake(candidates)
    assert candidates == set()                # nothing waits
    p.add_tasks([info("e", EVAL, chunk=0)])
    p.task_ready("e")
    p.rule(Background).wake(candidates)
    assert candidates == {"r0"}               # the idle rollout worker, never the trainer
