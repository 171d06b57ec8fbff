"""The hand-off rule alone (policy/rules/handoff.py): a version's read-back goes to the
worker holding its state, else waits for its checkpoint; the reasons noted."""

from __future__ import annotations

from digenrl.schedulers.policy.rules.handoff import Handoff
from digenrl.schedulers.policy.rules.handoff import MAKERS
from digenrl.vocabulary import CHECKPOINT, INIT, OPTIMIZE, RESTORE

from rule_helpers import info, opts, policy_with, said, steps


def _handoff(p):
    made = info(("optimize", 0), OPTIMIZE)
    ckpt = info(("checkpoint", 1), CHECKPOINT, version=1, gpu=False)
    read = info(("restore", 1), RESTORE, version=1, gpu=False)
    p.add_tasks([made, ckpt, read])
    p.task_ready(read.key)            # no inputs: ready at once
    return made, ckpt, read


def test_the_state_is_read_back_on_its_maker_and_it_says_why():
    assert MAKERS == {INIT, OPTIMIZE}
    p = policy_with(opts("digenrl"), trainer=2)
    made, ckpt, read = _handoff(p)
    assert p.decide() == [] and p.decide() == []
    [waits] = steps(p, read.key)
    assert (waits.verb, waits.rule, waits.repeats) == ("waits", "hand-off", 1)
    assert waits.reason == ("no worker holds version 1's state (not made yet, or its maker "
                            "is gone) and its checkpoint is not written yet")
    p.task_ready(made.key)
    [d] = p.decide()
    p.task_done(made.key, d.worker, 0.1)
    assert p.rule(Handoff).made_on == {1: d.worker}
    assert [(x.key, x.worker) for x in p.decide()] == [(read.key, d.worker)]
    maker = p.workers[d.worker].name
    assert said(p, read.key)[-1] == ("placed", "hand-off", maker)
    assert steps(p, read.key)[-1].reason == "it made version 1's state and holds it in memory"


def test_with_the_maker_gone_the_checkpoint_is_read_once_written():
    p = policy_with(opts("digenrl"), trainer=2)
    made, ckpt, read = _handoff(p)
    p.task_ready(made.key)
    [d] = p.decide()
    p.task_done(made.key, d.worker, 0.1)
    p.remove_worker(d.worker)
    assert p.rule(Handoff).made_on == {}
    p.task_ready(ckpt.key, {})
    [w] = p.decide()
    assert w.key == ckpt.key
    p.task_done(ckpt.key, w.worker)
    [x] = p.decide()
    assert (x.key, x.worker) == (read.key, w.worker)
    assert steps(p, read.key)[-1].reason == ("no worker holds version 1's state: it reads "
                                             "the checkpoint")
