"""The GAP rule alone (policy/rules/gap.py): the order of ready work, and a decode kept
for the version change while grads wait; the reasons noted."""

from __future__ import annotations

from digenrl.schedulers.policy.rules.gap import Gap
from digenrl.vocabulary import DECODE, DENOISE, PUBLISH

from rule_helpers import grads, info, opts, policy_with, said, steps


def _decode_then_step(options):
    """One rollout worker with one slot; chunk 0's decode and chunk 1's first step of
    iteration 0 ready at once."""
    p = policy_with(options)
    dec = info(("decode", 0, 0), DECODE, chunk=0)
    step = info(("d", 0, 1, 0), DENOISE, chunk=1, timestep=0)
    p.add_tasks([dec, step])
    p.task_ready(step.key)
    p.task_ready(dec.key)
    return p, dec, step


def test_with_gap_a_chunk_finishes_before_the_next_one_starts():
    p, dec, step = _decode_then_step(opts("digenrl", tag=False, rat=False,
                                          slots_per_worker=1))
    assert [d.key for d in p.decide()] == [dec.key]
    assert p.rule(Gap).entry(dec, 0) < p.rule(Gap).entry(step, 0)


def test_without_gap_rollout_goes_breadth_first():
    p, dec, step = _decode_then_step(opts("disaggregated", slots_per_worker=1))
    assert [d.key for d in p.decide()] == [step.key]
    assert p.rule(Gap).entry(step, 0) < p.rule(Gap).entry(dec, 0)


def test_a_decode_waits_for_the_version_change_while_grads_wait():
    """Chunk 0's decode of iteration 1 (its training reads version 1, not published)
    becomes ready while grads wait for the busy trainer: it goes after chunk 1's step,
    and back to its place once version 1 is published."""
    p = policy_with(opts("digenrl", tag=False, rat=False, slots_per_worker=1))
    waiting = grads(3)
    dec = info(("decode", 1, 0), DECODE, iteration=1, version=0, chunk=0)
    later = [info(("d", 1, 1, t), DENOISE, iteration=1, version=0, chunk=1, timestep=t)
             for t in range(2)]
    publish = info(("publish", 1), PUBLISH, iteration=0, version=1, gpu=False)
    p.add_tasks(waiting + [dec, publish] + later)
    for g in waiting:
        p.task_ready(g.key)
    assert [d.worker for d in p.decide()] == ["t0"]
    p.task_ready(dec.key)
    p.task_ready(later[0].key)
    assert [d.key for d in p.decide()] == [later[0].key]
    [deferred] = steps(p, dec.key)
    assert (deferred.verb, deferred.rule) == ("deferred", "GAP")
    assert deferred.reason == ("a decode kept for the version change while grads wait (its "
                               "training reads version 1, published: 0)")
    assert list(p.rule(Gap).deferred) == [1]
    p.task_ready(publish.key)
    p.decide()
    p.task_done(publish.key, "t0")
    assert not p.rule(Gap).deferred
    p.task_done(later[0].key, "r0", 0.1)
    p.task_ready(later[1].key)
    assert [d.key for d in p.decide()] == [dec.key]
    assert said(p, dec.key) == [("deferred", "GAP", ""), ("requeued", "GAP", ""),
                                ("released", "pools", "rollout-0")]
    assert steps(p, dec.key)[1].reason == "version 1 published: back at its chunk's place"


def test_a_decode_ready_while_the_trainers_keep_up_is_not_deferred():
    p = policy_with(opts("digenrl", tag=False, rat=False, slots_per_worker=1))
    dec = info(("decode", 1, 0), DECODE, iteration=1, version=0, chunk=0)
    p.add_tasks([dec])
    p.task_ready(dec.key)
    assert [d.key for d in p.decide()] == [dec.key]
    assert [s.verb for s in steps(p, dec.key)] == ["released"]
