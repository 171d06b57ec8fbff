"""Work that can wait for the version change (the policy's facts, policy/state.py Facts), what
the GAP, TAG and RAT rules read."""

from __future__ import annotations

from digenrl.vocabulary import DECODE, DENOISE, PUBLISH, REWARD

from rule_helpers import grads, info, opts, policy_with


def test_finishing_work_of_a_released_generation_for_an_unpublished_version_can_wait():
    p = policy_with(opts("digenrl", tag=False, rat=False))
    step = info(("d", 1, 0, 3), DENOISE, iteration=1, version=0, chunk=0, timestep=3)
    dec = info(("decode", 1, 0), DECODE, iteration=1, version=0, chunk=0)
    reward = info(("reward", 1, 0), REWARD, iteration=1, version=0, chunk=0)
    p.add_tasks([step, dec, reward])
    changes = p.facts
    # A step of the generation is not released yet: its finishing work cannot wait.
    assert changes.left(DENOISE, 1) and not changes.can_wait(dec)
    p.task_ready(step.key)
    p.decide()
    assert not changes.left(DENOISE, 1)
    assert changes.can_wait(dec) and changes.can_wait(reward)
    assert not changes.can_wait(step)                 # a denoise step never waits
    # Version 1 published: its training may need them now.
    p.add_tasks([info(("publish", 1), PUBLISH, iteration=0, version=1, gpu=False)])
    p.task_done(("publish", 1))
    assert not changes.can_wait(dec)


def test_a_lost_step_is_left_again():
    p = policy_with(opts("digenrl", tag=False, rat=False))
    step = info(("d", 1, 0, 0), DENOISE, iteration=1, version=0, chunk=0, timestep=0)
    p.add_tasks([step])
    p.task_ready(step.key)
    p.decide()
    assert not p.facts.left(DENOISE, 1)
    p.task_lost(step.key)
    assert p.facts.left(DENOISE, 1)


def test_the_grads_of_the_iteration_being_trained_are_all_released():
    p = policy_with(opts("digenrl", tag=False, rat=False, slots_per_worker=1), trainer=1)
    two = grads(2)
    p.add_tasks(two)
    changes = p.facts
    assert changes.grads_from is None and not changes.grads_all_released()
    for g in two:
        p.task_ready(g.key)
    p.decide()
    assert changes.grads_from == 0 and not changes.grads_all_released()
    p.task_done(two[0].key, "t0", 1.0)
    p.decide()
    assert changes.grads_all_released()
