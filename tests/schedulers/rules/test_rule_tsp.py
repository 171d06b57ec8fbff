"""The TSP rule alone (policy/rules/tsp.py): any trainer takes any micro-step, or
without TSP a chunk trains on its own trainer; the reasons noted."""

from __future__ import annotations

from digenrl.schedulers.policy.rules.tsp import Tsp
from digenrl.vocabulary import GRAD

from rule_helpers import info, opts, policy_with, said, steps


def _micro_steps():
    return [info(("g", c, t), GRAD, chunk=c, timestep=t, behaviour_version=0)
            for c in range(2) for t in range(2)]


def test_without_tsp_a_chunk_trains_on_its_own_trainer_and_says_so():
    p = policy_with(opts("digenrl", tsp=False, tag=False, slots_per_worker=4), trainer=2)
    micro = _micro_steps()
    p.add_tasks(micro)
    for g in micro:
        p.task_ready(g.key)
    where = {d.key: d.worker for d in p.decide()}
    assert where == {("g", 0, 0): "t0", ("g", 0, 1): "t0", ("g", 1, 0): "t1",
                     ("g", 1, 1): "t1"}
    [s] = steps(p, ("g", 1, 0))
    assert (s.verb, s.rule, s.worker) == ("released", "TSP", "trainer-1")
    assert s.reason == "TSP is off: chunk 1 trains on this trainer"


def test_without_tsp_waiting_micro_steps_follow_the_trainers_that_remain():
    p = policy_with(opts("digenrl", tsp=False, tag=False, slots_per_worker=1), trainer=2)
    micro = _micro_steps()
    p.add_tasks(micro)
    for g in micro:
        p.task_ready(g.key)
    first = {d.key: d.worker for d in p.decide()}
    assert first == {("g", 0, 0): "t0", ("g", 1, 0): "t1"}
    assert p.rule(Tsp).pin_of(micro[3]) == "t1"
    p.remove_worker("t1")
    assert p.rule(Tsp).pin_of(micro[3]) == "t0"
    p.task_done(("g", 0, 0), "t0")
    assert [d.key for d in p.decide()] == [("g", 0, 1)]
    p.task_done(("g", 0, 1), "t0")
    assert [(d.key, d.worker) for d in p.decide()] == [(("g", 1, 1), "t0")]


def test_with_tsp_any_trainer_takes_any_micro_step():
    p = policy_with(opts("digenrl", tag=False, rat=False, slots_per_worker=1), trainer=2)
    micro = _micro_steps()[:2]            # chunk 0's two micro-steps
    p.add_tasks(micro)
    for g in micro:
        p.task_ready(g.key)
    assert sorted(d.worker for d in p.decide()) == ["t0", "t1"]
    assert {said(p, g.key)[0][:2] for g in micro} == {("released", "pools")}
