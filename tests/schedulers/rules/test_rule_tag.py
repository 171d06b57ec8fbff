"""The TAG rule alone (policy/rules/tag.py): an idle trainer generates while no
training is runnable, but keeps its slot for the optimizer step; the reasons noted."""

from __future__ import annotations

from digenrl.schedulers.policy.rules.tag import Tag
from digenrl.vocabulary import DECODE, DENOISE, GRAD

from rule_helpers import grads, info, opts, policy_with, said, steps


def test_an_idle_trainer_takes_one_rollout_task_while_no_training_is_runnable():
    p = policy_with(opts("digenrl"), rollout=1, trainer=1)
    p.add_tasks([info(("d", j), DENOISE, chunk=j, timestep=0) for j in range(4)])
    for j in range(4):
        p.task_ready(("d", j))
    on_trainer = [d for d in p.decide() if d.worker == "t0"]
    assert len(on_trainer) == 1 and on_trainer[0].tag
    key = on_trainer[0].key
    assert said(p, key) == [("released", "TAG", "trainer-0")]
    assert steps(p, key)[0].reason == "no runnable training work"
    # Training runnable: the trainer takes it, and no rollout task.
    p.add_tasks([info("g", GRAD, chunk=0, behaviour_version=0)])
    p.task_ready("g")
    p.task_done(key, "t0")
    assert [d.key for d in p.decide()] == ["g"]


def test_without_tag_trainers_never_generate():
    p = policy_with(opts("digenrl", tag=False), rollout=0, trainer=1)
    p.add_tasks([info("d", DENOISE, chunk=0, timestep=0)])
    p.task_ready("d")
    assert p.decide() == [] and p.trail_of("d") == []


def test_the_last_idle_trainer_keeps_its_slot_for_the_optimizer_step_and_says_so():
    p = policy_with(opts("digenrl", slots_per_worker=1), rollout=1, trainer=2)
    both = grads(2)
    decodes = [info(("decode", 1, c), DECODE, iteration=1, version=0, chunk=c)
               for c in range(3)]
    p.add_tasks(both + decodes)
    for g in both:
        p.task_ready(g.key)
    where = {d.key: d.worker for d in p.decide()}
    p.task_done(both[0].key, where[both[0].key], 1.0)
    for d in decodes:
        p.task_ready(d.key)
    # Every grad of iteration 0 is released, its optimizer step comes next, the decodes
    # can wait: the only idle trainer keeps its slot; the rollout worker decodes.
    assert [d.worker for d in p.decide()] == ["r0"]
    idle = next(w for w in p.workers.values() if w.pool == "trainer" and not w.inflight)
    kept = [s for d in decodes[1:] for s in steps(p, d.key) if s.verb == "kept"]
    assert kept and all((s.rule, s.worker) == ("TAG", idle.name) for s in kept)
    assert kept[0].reason.startswith("the trainer keeps its slot for the optimizer step: "
                                     "every grad of iteration 0 is released")
    assert p.rule(Tag).keeps_for_optimizer(idle, decodes[1])
