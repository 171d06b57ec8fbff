"""The RAT rule alone (policy/rules/rat.py): every lending decision in Rat.lend, for an
idle rollout worker and ahead of work that can wait; the reasons noted."""

from __future__ import annotations

from digenrl.schedulers.policy.rules.rat import Rat
from digenrl.vocabulary import DECODE, DENOISE

from rule_helpers import grads, info, opts, policy_with, said, steps


def _busy_trainer(p, n=6, loc=None):
    """Iteration 0's grads: the trainer busy with them, one measured (1 s)."""
    gs = grads(n)
    p.add_tasks(gs)
    p.task_ready(gs[0].key, dict(loc or {}))
    [first] = p.decide()
    for g in gs[1:]:
        p.task_ready(g.key, dict(loc or {}))
    p.decide()
    p.task_done(first.key, "t0", 1.0)
    return gs


def test_rat_applies_with_pools_and_tsp_only():
    assert policy_with(opts("digenrl")).rule(Rat).on
    assert not policy_with(opts("digenrl", tsp=False)).rule(Rat).on
    assert not policy_with(opts("colocated", rat=True)).rule(Rat).on


def test_an_idle_rollout_worker_is_lent_a_grad_and_it_says_why():
    p = policy_with(opts("digenrl", tag=False))
    _busy_trainer(p)
    lent = [d for d in p.decide() if d.rat]
    assert [d.worker for d in lent] == ["r0"]
    assert said(p, lent[0].key) == [("lent", "RAT", "rollout-0")]
    assert steps(p, lent[0].key)[0].reason == (
        "the worker is idle and every trainer busy; it finishes the grad in 1 s <= 3 s on "
        "the first trainer to free")


def test_a_grad_is_not_lent_when_a_trainer_finishes_it_sooner():
    p = policy_with(opts("digenrl", tag=False))
    # Moving 10 GB at 1 GB/s costs more than waiting for the trainer.
    _busy_trainer(p, loc={"t0": 10 ** 10})
    assert all(d.worker == "t0" for d in p.decide())
    top = p.queues.training.peek().info
    declined = [s for s in steps(p, top.key) if s.verb == "declined"]
    assert [(s.rule, s.worker) for s in declined] == [("RAT", "rollout-0")]
    assert declined[0].reason == ("a trainer finishes it sooner: 11 s here > 3 s on the "
                                  "first trainer to free")


def test_an_idle_rollout_worker_is_kept_for_a_chunk_that_may_start():
    p = policy_with(opts("digenrl", tag=False))
    owed = info(("d", 1, 0, 0), DENOISE, iteration=1, version=0, chunk=0, timestep=0)
    p.add_tasks([owed])
    _busy_trainer(p)
    assert p.rule(Rat).owed_chunks() == 1
    assert [d.worker for d in p.decide()] == ["t0"]
    top = p.queues.training.peek().info
    [s] = [s for s in steps(p, top.key) if s.verb == "declined"]
    assert (s.rule, s.worker) == ("RAT", "rollout-0")
    assert s.reason == "the worker is kept free for a chunk that may start (1 chunks may)"
    assert p.counters["rat_declined"] == 1


def test_a_grad_goes_ahead_of_work_that_can_wait():
    """The rollout worker runs its generation's last step; the decode after it can wait
    for the version change its training needs: a grad is lent first."""
    p = policy_with(opts("digenrl", tag=False))
    last = info(("d", 1, 1, 7), DENOISE, iteration=1, version=0, chunk=1, timestep=7)
    dec = info(("decode", 1, 0), DECODE, iteration=1, version=0, chunk=0)
    p.add_tasks([last, dec])
    p.task_ready(last.key)
    p.decide()
    _busy_trainer(p)
    p.task_ready(dec.key)
    assert p.facts.can_wait(dec)
    [lent] = [d for d in p.decide() if d.worker == "r0"]
    assert lent.rat and lent.key != dec.key
    [s] = steps(p, lent.key)
    assert (s.verb, s.rule, s.worker) == ("lent", "RAT", "rollout-0")
    assert s.reason.startswith("ahead of ('decode', 1, 0), which can wait for the version "
                               "change; it finishes the grad in")
    # Nothing goes ahead of a denoise step: generation cannot wait.
    assert p.rule(Rat).lend(p.workers["r0"], last) is None


def test_a_lent_grads_gradient_is_copied_to_the_least_loaded_trainer():
    p = policy_with(opts("digenrl", tag=False), trainer=2)
    gs = grads(7)
    p.add_tasks(gs)
    for g in gs:
        p.task_ready(g.key)
    out = p.decide()
    p.task_done(out[0].key, out[0].worker, 1.0)
    [lent] = [d for d in p.decide() if d.rat]
    assert p.take_copies() == []
    p.task_done(lent.key, "r0", 1.0)
    assert p.take_copies() == [(lent.key, "t0")]
    assert p.facts.ref_grad == 1.0
