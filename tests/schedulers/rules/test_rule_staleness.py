"""The staleness rule alone (policy/rules/staleness.py): rollout held past the bound,
training held behind the barrier without GAP, stale training rejected; the reasons noted."""

from __future__ import annotations

from digenrl.schedulers.policy.rules.staleness import Staleness
from digenrl.schedulers.policy.rules.staleness import stale_training
from digenrl.vocabulary import ADVANTAGE, DENOISE, EVAL, GRAD, PUBLISH

from rule_helpers import info, opts, policy_with, said, steps


def _publish(p, v):
    key = (PUBLISH, v)
    p.add_tasks([info(key, PUBLISH, iteration=v - 1, version=v, gpu=False)])
    p.task_done(key)


def test_a_denoise_step_past_the_bound_is_held_until_its_version_is_published():
    p = policy_with(opts("digenrl", max_staleness=1))
    # Iteration 3 reading version 0 (a faulty graph): the bound needs version 2.
    p.add_tasks([info("d", DENOISE, iteration=3, version=0, chunk=0, timestep=0)])
    p.task_ready("d")
    assert p.decide() == [] and p.rule(Staleness).held() == {"staleness": 1, "barrier": 0}
    [held] = steps(p, "d")
    assert (held.verb, held.rule, held.worker) == ("held", "staleness", "")
    assert held.reason == "iteration 3 waits for version 2 (published: 0)"
    _publish(p, 1)
    assert p.decide() == [] and len(steps(p, "d")) == 1
    _publish(p, 2)
    assert [d.key for d in p.decide()] == ["d"]
    assert said(p, "d") == [("held", "staleness", ""), ("eligible", "staleness", ""),
                            ("released", "rebalance", "rollout-0")]
    assert steps(p, "d")[1].reason == "version 2 published"
    assert p.rule(Staleness).held() == {"staleness": 0, "barrier": 0}


def test_background_work_is_never_held():
    p = policy_with(opts("digenrl", max_staleness=0), trainer=0)
    p.add_tasks([info("e", EVAL, iteration=7, version=0, chunk=0)])
    p.task_ready("e")
    assert [d.key for d in p.decide()] == ["e"]
    assert ("held", "staleness", "") not in said(p, "e")


def test_without_gap_training_waits_behind_the_barrier():
    p = policy_with(opts("disaggregated", slots_per_worker=1))
    p.add_tasks([info("d0", DENOISE, chunk=0), info("d1", DENOISE, chunk=1),
                 info("a", ADVANTAGE, gpu=False, behaviour_version=0)])
    for key in ("d0", "d1", "a"):
        p.task_ready(key)
    assert [d.key for d in p.decide()] == ["d0"]
    assert p.held()["barrier"] == 1 == p.rule(Staleness).held()["barrier"]
    [held] = steps(p, "a")
    assert (held.verb, held.rule) == ("held", "barrier")
    assert held.reason == "without GAP iteration 0's training waits for its rollout work " \
                          "(2 tasks left)"
    p.task_done("d0", "r0")
    p.decide()
    p.task_done("d1", "r0")
    assert [d.key for d in p.decide()] == ["a"]
    assert said(p, "a")[1:] == [("eligible", "barrier", ""), ("placed", "pools", "trainer-0")]
    assert steps(p, "a")[1].reason == "iteration 0's rollout work is done"


def test_training_more_stale_than_the_bound_is_rejected_when_added():
    o = opts("digenrl", max_staleness=1)
    stale = info("g", GRAD, iteration=3, version=3, behaviour_version=1)
    assert stale_training(stale, o) == ("task 'g' would train samples of policy version 1 at "
                                        "version 3: staleness 2 exceeds max_staleness=1")
    older = info("h", GRAD, iteration=3, version=1, behaviour_version=2)
    assert "at the older version 1" in stale_training(older, o)
    assert stale_training(info("ok", GRAD, version=1, behaviour_version=0), o) is None
    p = policy_with(o)
    assert p.add_tasks([stale]) == {"g": stale_training(stale, o)}
