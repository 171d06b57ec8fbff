"""The scheduling policy, driven without any cluster."""

from __future__ import annotations

from collections import defaultdict

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from digenrl.graph.structure import GraphLayout, init_nodes, iteration_nodes
from digenrl.schedulers.options import MODES, ScheduleOptions
from digenrl.schedulers.policy import SchedulingPolicy, TaskInfo, validate_task
from digenrl.schedulers.policy.core import RULES
from digenrl.schedulers.policy.rules import Rule
from digenrl.schedulers.policy.rules.staleness import Staleness
from digenrl.seeding import stable_seed
from digenrl.sim.engine import SimWorker, Simulator, uniform_plans
from digenrl.vocabulary import (ADVANTAGE, CHECKPOINT, DECODE, DENOISE, EVAL, GPU_KINDS, GRAD,
                                KIND_POOL, KINDS, NOISE, OPTIMIZE, PUBLISH, RESTORE, REWARD, ROLLOUT,
                                ROLLOUT_KINDS, TRAINER)

#: The training kinds that hold a GPU slot.
TRAIN_GPU = frozenset(k for k in GPU_KINDS if KIND_POOL[k] == TRAINER)


def graph_keys(layout, plans):
    """The key of every task of the run's graph, as the graph builders make it."""
    nodes = init_nodes() + [n for plan in plans for n in iteration_nodes(layout, plan)]
    return [n.key for n in nodes]


def opts(mode="digenrl", **kw):
    return ScheduleOptions(mode=mode, **{**MODES[mode], **kw})


def info(key, kind, iteration=0, version=0, gpu=True, **kw):
    return TaskInfo(key=key, kind=kind, pool=KIND_POOL[kind], iteration=iteration,
                    policy_version=version, gpu=gpu, **kw)


def policy_with(options, rollout=1, trainer=1):
    """One GPU per worker; ``options.slots_per_worker`` tasks released to each at once."""
    p = SchedulingPolicy(options, clock=lambda: 0.0)
    for j in range(rollout):
        p.add_worker(f"r{j}", f"rollout-{j}", ROLLOUT, 1)
    for j in range(trainer):
        p.add_worker(f"t{j}", f"trainer-{j}", TRAINER, 1)
    p.version = 0
    return p


# ---------------------------------------------------------------- single rules


def test_pools_route_tasks_to_their_workers():
    p = policy_with(opts("digenrl", tag=False))
    p.add_tasks([info("d", DENOISE), info("g", GRAD, chunk=0,
                                                       behaviour_version=0)])
    p.task_ready("d")
    p.task_ready("g")
    where = {d.key: d.worker for d in p.decide()}
    assert where == {"d": "r0", "g": "t0"}


def test_a_decision_carries_the_task_and_counters_count_releases():
    p = policy_with(opts("digenrl", tag=False))
    tasks = [info("d", DENOISE), info("g", GRAD, chunk=0,
                                                   behaviour_version=0)]
    p.add_tasks(tasks)
    p.task_ready("d")
    p.task_ready("g")
    decisions = p.decide()
    assert {d.key: d.info for d in decisions} == {"d": tasks[0], "g": tasks[1]}
    assert all(d.info is t for d in decisions for t in tasks if t.key == d.key)
    assert p.counters["released"] == 2 and p.counters["stolen"] == 0
    assert p.snapshot()["counters"]["released"] == 2


def test_events_by_key_and_by_the_held_task_are_the_same_events():
    """The plugin reports events by key, the simulator with the task it holds
    (``ready``/``done``): one policy fed each way decides the same."""
    def tasks():
        return [info(("d", j), DENOISE, chunk=j, timestep=0) for j in range(6)] + [
            info(("g", 0), GRAD, chunk=0, behaviour_version=0),
            info(("late", 0), GRAD, version=5, chunk=0, behaviour_version=0)]

    def drive(by_key):
        p = policy_with(opts("digenrl"), rollout=2, trainer=1)
        held = tasks()
        rejected = p.add_tasks(held)
        log = []
        ready, done = (p.task_ready, p.task_done) if by_key else (p.ready, p.done)
        for t in held:
            for _ in range(2):   # a repeated event changes nothing
                ready(t.key if by_key else t, {})
        log.append([(d.key, d.worker) for d in p.decide()])
        for t in held[:2]:
            done(t.key if by_key else t, "r0", 0.5)
        log.append([(d.key, d.worker) for d in p.decide()])
        return rejected, log, p.snapshot()

    rejected, log, snapshot = drive(by_key=True)
    assert list(rejected) == [("late", 0)] and log[0] and log[1]
    assert drive(by_key=False) == (rejected, log, snapshot)


def _grads(n, iteration=0):
    return [info(("g", iteration, j), GRAD, iteration=iteration, version=iteration, chunk=j,
                 timestep=0, behaviour_version=iteration) for j in range(n)]


def test_rat_lends_an_idle_rollout_worker_one_grad_while_every_trainer_is_busy():
    p = policy_with(opts("digenrl", tag=False), rollout=1, trainer=1)
    grads = _grads(6)
    p.add_tasks(grads)
    p.task_ready(grads[0].key)
    [first] = p.decide()
    assert first.worker == "t0" and not first.rat
    # Nothing measured yet: the rollout worker does not guess what a grad costs.
    for g in grads[1:]:
        p.task_ready(g.key)
    assert {d.worker for d in p.decide()} == {"t0"}
    p.task_done(first.key, "t0", 1.0)
    out = p.decide()
    # The trainer takes its slot back; its slots are full, so the idle rollout worker
    # takes one grad (one only) and records it.
    lent = [d for d in out if d.worker == "r0"]
    assert len(lent) == 1 and lent[0].rat and not lent[0].tag
    assert p.counters["rat_released"] == 1
    assert p.snapshot()["pools"][ROLLOUT]["rat"] == 1
    assert p.decide() == []
    # A rollout step that becomes runnable takes the worker's next release.
    p.add_tasks([info("d", DENOISE, chunk=0, timestep=0)])
    p.task_ready("d")
    assert [(d.key, d.worker) for d in p.decide()] == [("d", "r0")]


def test_a_lent_grads_gradient_is_copied_to_a_trainer_as_soon_as_it_is_computed():
    p = policy_with(opts("digenrl", tag=False), rollout=1, trainer=2)
    grads = _grads(7)
    p.add_tasks(grads)
    for g in grads:
        p.task_ready(g.key)
    out = p.decide()
    assert {d.worker for d in out} == {"t0", "t1"}   # nothing measured: nothing lent
    p.task_done(out[0].key, out[0].worker, 1.0)
    lent = [d for d in p.decide() if d.rat]
    assert [d.worker for d in lent] == ["r0"]
    assert p.take_copies() == []          # a trainer's own gradient stays where it is
    p.task_done(lent[0].key, "r0", 1.0)
    # The trainer that copies it is the least loaded one: out[0]'s trainer took one
    # grad back for the one it finished, so both hold two, and the first by name copies.
    assert p.take_copies() == [(lent[0].key, "t0")]
    assert p.take_copies() == []          # handed over once


def test_every_rollout_worker_fetches_a_version_as_soon_as_it_is_published():
    p = policy_with(opts("digenrl"), rollout=2, trainer=1)
    pub = info(("publish", 1), PUBLISH, iteration=0, version=1, gpu=False)
    p.add_tasks([pub])
    p.task_ready(pub.key)
    p.decide()
    p.task_done(pub.key, "t0")
    assert p.version == 1
    assert p.take_copies() == [(pub.key, "r0"), (pub.key, "r1")]


def _handoff(p, version=1):
    """Version ``version``'s optimizer step, its checkpoint and its read-back, added."""
    made = info(("optimize", version - 1), OPTIMIZE, iteration=version - 1,
                version=version - 1)
    ckpt = info(("checkpoint", version), CHECKPOINT, iteration=version - 1, version=version,
                gpu=False)
    read = info(("restore", version), RESTORE, iteration=version - 1, version=version,
                gpu=False)
    p.add_tasks([made, ckpt, read])
    p.task_ready(read.key)   # it has no inputs: ready at once
    return made, ckpt, read


def test_a_state_is_read_back_on_the_worker_that_made_it_before_its_checkpoint_is_written():
    p = policy_with(opts("digenrl"), trainer=3)
    made, ckpt, read = _handoff(p)
    assert p.decide() == []               # the state does not exist yet
    p.task_ready(made.key)
    [d] = p.decide()
    p.task_done(made.key, d.worker, 0.1)
    p.task_ready(ckpt.key, {d.worker: 100})
    out = {x.key: x.worker for x in p.decide()}
    assert out == {read.key: d.worker, ckpt.key: d.worker}


def test_with_its_maker_gone_a_state_is_read_back_only_once_its_checkpoint_is_written():
    p = policy_with(opts("digenrl"), trainer=2)
    made, ckpt, read = _handoff(p)
    p.task_ready(made.key)
    [d] = p.decide()
    p.task_done(made.key, d.worker, 0.1)
    p.task_ready(ckpt.key, {d.worker: 100})
    assert {x.worker for x in p.decide()} == {d.worker}
    # The maker dies with the read-back and the checkpoint on it: both come back.
    p.remove_worker(d.worker)
    p.task_lost(read.key)
    p.task_lost(ckpt.key)
    p.task_lost(made.key)
    p.task_ready(read.key)
    assert p.decide() == []           # nobody holds the state, nothing has written it
    p.task_ready(made.key)
    [again] = p.decide()
    other = again.worker
    p.task_done(made.key, other, 0.1)
    p.remove_worker(other)            # gone again before the read-back was placed
    p.add_worker("t9", "trainer-9", TRAINER, 1)
    assert p.decide() == []
    p.task_ready(ckpt.key, {})
    [w] = p.decide()
    p.task_done(ckpt.key, w.worker)
    assert [(x.key, x.worker) for x in p.decide()] == [(read.key, "t9")]


def test_a_resumed_runs_state_is_read_back_anywhere():
    p = policy_with(opts("digenrl"), trainer=1)
    read = info(("restore", 4), RESTORE, iteration=3, version=4, gpu=False)
    p.add_tasks([read])
    p.task_ready(read.key)
    assert [(x.key, x.worker) for x in p.decide()] == [(read.key, "t0")]


def test_rat_leaves_a_rollout_worker_to_the_generation_it_owes():
    p = policy_with(opts("digenrl", tag=False), rollout=1, trainer=1)
    grads = _grads(6)
    # Iteration 1's chunk reads version 0, which is published: it starts as soon as its
    # noise exists. Iteration 2's reads version 1, which the trainers have yet to publish.
    owed = info(("d", 1, 0, 0), DENOISE, iteration=1, version=0, chunk=0, timestep=0)
    later = info(("d", 2, 0, 0), DENOISE, iteration=2, version=1, chunk=0, timestep=0)
    p.add_tasks(grads + [owed, later])
    p.task_ready(grads[0].key)
    [first] = p.decide()
    for g in grads[1:]:
        p.task_ready(g.key)
    p.decide()
    p.task_done(first.key, "t0", 1.0)
    # The trainer is busy and a grad is measured, but the chunk about to start would
    # wait behind a lent grad: the rollout worker stays free for it.
    assert [d.worker for d in p.decide()] == ["t0"]
    assert not p.counters["rat_released"] and p.counters["rat_declined"] == 1
    p.task_ready(owed.key)
    assert [(d.key, d.worker, d.rat) for d in p.decide()] == [(owed.key, "r0", False)]
    # Once the chunk has run, the next generation waits for version 1: the worker lends.
    p.task_done(owed.key, "r0", 0.1)
    [lent] = p.decide()
    assert lent.worker == "r0" and lent.rat and lent.info.kind == GRAD


def test_rat_declines_when_a_trainer_would_finish_the_grad_sooner_or_when_off():
    for options, loc in ((opts("digenrl", tag=False, rat=False), {}),
                         # Moving 10 GB at 1 GB/s costs more than waiting for the trainer.
                         (opts("digenrl", tag=False), {"t0": 10 ** 10})):
        p = policy_with(options, rollout=1, trainer=1)
        grads = _grads(6)
        p.add_tasks(grads)
        p.task_ready(grads[0].key, dict(loc))
        [first] = p.decide()
        for g in grads[1:]:
            p.task_ready(g.key, dict(loc))
        p.decide()
        p.task_done(first.key, "t0", 1.0)
        assert all(d.worker == "t0" for d in p.decide()), options
        assert not p.counters["rat_released"]
    assert p.counters["rat_declined"] > 0


def _finishing(decode_iteration=1, steps_left=0, grad_inputs=None):
    """A rollout worker running a generation's last denoise step while the trainer is
    busy with iteration 0's grads (one measured) and more wait: iteration 1's chunk 0 is
    decoded next. ``steps_left`` more of the generation's steps are not released yet;
    ``grad_inputs``: where the grads' input bytes are."""
    p = policy_with(opts("digenrl", tag=False), rollout=1, trainer=1)
    grads = _grads(6)
    last = info(("d", 1, 1, 7), DENOISE, iteration=1, version=0, chunk=1, timestep=7)
    left = [info(("d", 1, 2 + j, 0), DENOISE, iteration=1, version=0, chunk=2 + j,
                 timestep=0) for j in range(steps_left)]
    dec = info(("decode", decode_iteration, 0), DECODE, iteration=decode_iteration,
               version=decode_iteration - 1, chunk=0)
    p.add_tasks(grads + [last, dec] + left)
    p.task_ready(grads[0].key, dict(grad_inputs or {}))
    [first] = p.decide()
    for g in grads[1:]:
        p.task_ready(g.key, dict(grad_inputs or {}))
    p.decide()
    p.task_ready(last.key)
    assert [(d.key, d.worker) for d in p.decide()] == [(last.key, "r0")]
    p.task_done(first.key, "t0", 1.0)
    assert [d.worker for d in p.decide()] == ["t0"]   # the step in flight: none lent yet
    p.task_ready(dec.key)
    return p, dec


def test_a_rollout_worker_lends_a_grad_before_finishing_work_that_can_wait():
    """A decode of a generation whose every step has been released feeds only training
    that reads the next version, which waits for the grads: the grad goes first."""
    p, dec = _finishing()
    [lent] = p.decide()
    assert lent.worker == "r0" and lent.rat and lent.info.kind == GRAD
    # The trainer's slots hold two grads: the worker's own step in flight and a lent
    # grad (counted as two grads) end before the trainer would reach a third.
    assert p.counters["rat_released"] == 1
    p.task_done(("d", 1, 1, 7), "r0", 0.5)
    [again] = p.decide()
    assert again.rat and again.worker == "r0"
    # Both done: the worker takes the last grad of the queue, then, nothing left to
    # lend, the decode in its second slot.
    p.task_done(lent.key, "r0", 1.0)
    p.task_done(again.key, "r0", 1.0)
    out = [(d.info.kind, d.worker, d.rat) for d in p.decide()]
    assert out == [(GRAD, "r0", True), (DECODE, "r0", False)]


def test_finishing_work_goes_first_when_it_cannot_wait_or_no_grad_would_gain():
    # A step of the generation is still to be released: the worker owes it, the decode
    # cannot wait, and no grad goes ahead of it.
    p, dec = _finishing(steps_left=1)
    assert [(d.key, d.rat) for d in p.decide()] == [(dec.key, False)]
    # The decode's iteration trains on version 0, published: training may need it now.
    p, dec = _finishing(decode_iteration=0)
    assert [(d.key, d.rat) for d in p.decide()] == [(dec.key, False)]
    # Moving a grad's 10 GB of inputs at 1 GB/s takes longer than the trainer needs to
    # reach it: nothing is lent, the decode goes.
    p, dec = _finishing(grad_inputs={"t0": 10 ** 10})
    assert [(d.key, d.rat) for d in p.decide()] == [(dec.key, False)]
    assert p.counters["rat_declined"] > 0


def _decode_and_steps(waiting_grads):
    """A rollout worker with one slot, chunk 0 of iteration 1 ready to decode and chunk
    1's first step ready, while the trainer runs one of iteration 0's grads and
    ``waiting_grads`` more wait; version 0 is published, the decode's training reads
    version 1."""
    p = policy_with(opts("digenrl", tag=False, rat=False, slots_per_worker=1))
    grads = _grads(1 + waiting_grads)
    dec = info(("decode", 1, 0), DECODE, iteration=1, version=0, chunk=0)
    steps = [info(("d", 1, 1, t), DENOISE, iteration=1, version=0, chunk=1, timestep=t)
             for t in range(2)]
    publish = info(("publish", 1), PUBLISH, iteration=0, version=1, gpu=False)
    p.add_tasks(grads + [dec, publish] + steps)
    for g in grads:
        p.task_ready(g.key)
    assert [d.worker for d in p.decide()] == ["t0"]
    p.task_ready(dec.key)
    p.task_ready(steps[0].key)
    return p, dec, steps, publish


def test_a_decode_for_an_unpublished_version_waits_behind_its_generation_while_grads_wait():
    """While grads wait for the trainer, a chunk's decode whose training reads a version
    not yet published goes after the generation's later steps (the rollout worker keeps
    it for the version change); once that version is published, or with no grad
    waiting, it goes at its chunk's place, before the later chunk's steps."""
    p, dec, steps, publish = _decode_and_steps(waiting_grads=2)
    assert [d.key for d in p.decide()] == [steps[0].key]
    # Version 1 is published while the step runs: the decode is queued at its chunk's
    # place again and goes before chunk 1's next step.
    p.task_ready(publish.key)
    p.decide()
    p.task_done(publish.key, "t0")
    p.task_done(steps[0].key, "r0", 0.1)
    p.task_ready(steps[1].key)
    assert [d.key for d in p.decide()] == [dec.key]
    # No grad waits: the trainers are not behind, and the decode goes first at once.
    p, dec, steps, publish = _decode_and_steps(waiting_grads=0)
    assert [d.key for d in p.decide()] == [dec.key]


def test_the_last_idle_trainer_keeps_its_slot_for_the_optimizer_step():
    """An idle trainer does not take rollout work that can wait (decodes of a generation
    whose steps are all released) once every grad of the iteration is released, unless
    another trainer is idle for the optimizer step."""
    p = policy_with(opts("digenrl", slots_per_worker=1), rollout=1, trainer=2)
    grads = _grads(2)
    decodes = [info(("decode", 1, c), DECODE, iteration=1, version=0, chunk=c)
               for c in range(4)]
    p.add_tasks(grads + decodes)
    for g in grads:
        p.task_ready(g.key)
    where = {d.key: d.worker for d in p.decide()}
    assert sorted(where.values()) == ["t0", "t1"]
    p.task_done(grads[0].key, where[grads[0].key], 1.0)
    for d in decodes:
        p.task_ready(d.key)
    # One idle trainer, the only one: it keeps its slot. The rollout worker decodes.
    assert [d.worker for d in p.decide()] == ["r0"]
    p.task_done(grads[1].key, where[grads[1].key], 1.0)
    # Two idle trainers: one decodes, the other keeps its slot.
    [tagged] = p.decide()
    assert tagged.tag and tagged.info.kind == DECODE
    # A denoise step is generation something may be waiting for: the last idle
    # trainer takes it.
    p = policy_with(opts("digenrl", slots_per_worker=1, max_staleness=2), rollout=0,
                    trainer=2)
    step = info(("d", 2, 0, 0), DENOISE, iteration=2, version=0, chunk=0, timestep=0)
    [last] = _grads(1)
    p.add_tasks([last, step])
    p.task_ready(last.key)
    [busy] = p.decide()
    p.task_ready(step.key)
    [tagged] = p.decide()
    assert tagged.tag and tagged.key == step.key and tagged.worker != busy.worker


def test_tag_takes_rollout_work_only_while_no_training_is_runnable():
    p = policy_with(opts("digenrl"), rollout=1, trainer=1)
    p.add_tasks([info(("d", j), DENOISE, chunk=j, timestep=0) for j in range(5)])
    for j in range(5):
        p.task_ready(("d", j))
    first = p.decide()
    on_trainer = [d for d in first if d.worker == "t0"]
    assert len(on_trainer) == 1 and on_trainer[0].tag  # one at a time on a trainer
    assert sum(d.worker == "r0" for d in first) == 2   # the rollout worker's two slots
    p.add_tasks([info("g", GRAD, chunk=0, behaviour_version=0)])
    p.task_ready("g")
    p.task_done(on_trainer[0].key, "t0")
    second = p.decide()
    assert [d.key for d in second] == ["g"]  # training first; no new TAG task


def test_without_tag_trainers_never_generate():
    p = policy_with(opts("digenrl", tag=False))
    p.add_tasks([info(("d", j), DENOISE, chunk=j) for j in range(3)])
    for j in range(3):
        p.task_ready(("d", j))
    assert {d.worker for d in p.decide()} == {"r0"}


def test_rollouts_wait_for_the_staleness_bound_even_in_a_bad_graph():
    p = policy_with(opts("digenrl", max_staleness=1))
    # Iteration 3 reading version 0: older than the bound allows (3 - 1 = 2).
    p.add_tasks([info("bad", DENOISE, iteration=3, version=0)])
    p.task_ready("bad")
    assert p.decide() == [] and p.held()["staleness"] == 1
    p.add_tasks([info((PUBLISH, v), PUBLISH, iteration=v - 1, version=v,
                      gpu=False) for v in (1, 2)])
    p.task_done((PUBLISH, 1))
    assert p.decide() == []
    p.task_done((PUBLISH, 2))
    assert [d.key for d in p.decide()] == ["bad"]


def test_training_beyond_the_bound_is_rejected():
    o = opts("digenrl", max_staleness=1)
    bad = info("g", GRAD, iteration=3, version=3, behaviour_version=1)
    assert "staleness 2 exceeds max_staleness=1" in validate_task(bad, o)
    p = policy_with(o)
    assert p.add_tasks([bad]) == {"g": validate_task(bad, o)}
    p.task_ready("g")
    assert p.decide() == []


def test_without_gap_training_waits_for_the_whole_iteration():
    p = policy_with(opts("disaggregated", slots_per_worker=1))
    p.add_tasks([info("d0", DENOISE, chunk=0), info("d1", DENOISE, chunk=1),
                 info("a0", ADVANTAGE, gpu=False, behaviour_version=0)])
    p.task_ready("d0")
    p.task_ready("d1")
    p.task_ready("a0")
    assert {d.key for d in p.decide()} == {"d0"}
    p.task_done("d0", "r0")
    assert [d.key for d in p.decide()] == ["d1"]
    p.task_done("d1", "r0")
    assert [d.key for d in p.decide()] == ["a0"]


def test_a_lost_task_waits_until_it_is_ready_again():
    p = policy_with(opts("digenrl"))
    p.add_tasks([info("n", NOISE, gpu=False), info("d", DENOISE)])
    p.task_ready("n", {"r0": 10})
    p.task_ready("d", {"r0": 10})
    # Both lose an input before the next decision (the worker holding it died).
    p.task_lost("n")
    p.task_lost("d")
    assert p.decide() == []
    assert p.ready_since("n") is None and p.eligible_since("d") is None
    p.task_ready("n", {})
    assert [d.key for d in p.decide()] == ["n"]


def test_without_tsp_a_chunk_trains_on_its_own_trainer():
    p = policy_with(opts("disaggregated", slots_per_worker=4), trainer=2)
    grads = [info(("g", c, t), GRAD, chunk=c, timestep=t, behaviour_version=0)
             for c in range(2) for t in range(2)]
    p.add_tasks(grads)
    p.rule(Staleness).barrier_open.add(0)
    for g in grads:
        p.task_ready(g.key)
    where = {d.key: d.worker for d in p.decide()}
    assert where == {("g", 0, 0): "t0", ("g", 0, 1): "t0", ("g", 1, 0): "t1", ("g", 1, 1): "t1"}


def test_chains_stay_on_the_worker_that_holds_their_latent():
    p = policy_with(opts("digenrl", tag=False, slots_per_worker=1), rollout=2)
    p.add_tasks([info(("d", c, 1), DENOISE, chunk=c, timestep=1) for c in range(2)])
    p.task_ready(("d", 0, 1), {"r1": 100, "r0": 10})
    p.task_ready(("d", 1, 1), {"r0": 100})
    assert {d.key: d.worker for d in p.decide()} == {("d", 0, 1): "r1", ("d", 1, 1): "r0"}


def test_slots_limit_gpu_tasks_in_flight_and_cpu_tasks_go_by_locality():
    p = policy_with(opts("digenrl", tag=False), rollout=2)
    p.add_tasks([info(("d", j), DENOISE, chunk=j) for j in range(6)]
                + [info("n", REWARD, gpu=False)])
    for j in range(6):
        p.task_ready(("d", j))
    p.task_ready("n", {"r1": 5})
    ds = p.decide()
    per = defaultdict(int)
    for d in ds:
        if d.key != "n":
            per[d.worker] += 1
    assert dict(per) == {"r0": 2, "r1": 2}
    assert next(d.worker for d in ds if d.key == "n") == "r1"


def test_a_lost_worker_gives_its_tasks_back():
    p = policy_with(opts("digenrl", tag=False, slots_per_worker=1), rollout=2)
    p.add_tasks([info("d", DENOISE)])
    p.task_ready("d")
    [d] = p.decide()
    assert p.remove_worker(d.worker) == ["d"]
    p.task_ready("d")
    [again] = p.decide()
    assert again.worker != d.worker


# ------------------------------------------------------------- property based


def check_trace(result, options, layout, workers):
    """Every invariant of the scheduling rules, checked on a finished trace."""
    recs = {r.key: r for r in result.records}
    by_iter = defaultdict(list)
    for r in result.records:
        by_iter[r.iteration].append(r)
    pool_of = {w.name: w.pool for w in workers}
    trainers = sorted(w.name for w in workers if w.pool == TRAINER)
    for r in result.records:
        assert r.released >= r.ready
        if options.pools:
            if r.kind in ROLLOUT_KINDS:
                assert pool_of[r.worker] == ROLLOUT or (options.tag and r.tag), r
            else:
                assert pool_of[r.worker] == TRAINER or (options.rat and r.rat
                                                        and r.kind == GRAD), r
        assert not r.rat or (options.rat and r.kind == GRAD), r
        if r.kind in ROLLOUT_KINDS and r.iteration - options.max_staleness >= 0:
            published = recs[(PUBLISH, r.iteration - options.max_staleness)].stop
            assert r.released >= published, r
        if r.kind == GRAD:
            assert r.policy_version == r.iteration
    # Bounded staleness of every trained sample.
    for it, rs in by_iter.items():
        behaviour = {r.chunk: r.policy_version for r in rs if r.kind == DENOISE}
        for r in rs:
            if r.kind == GRAD:
                assert 0 <= r.policy_version - behaviour[r.chunk] <= options.max_staleness
    # Without GAP, training waits for every rollout task of its iteration.
    barrier = {it: max((r.stop for r in rs if r.kind in ROLLOUT_KINDS), default=0.0)
               for it, rs in by_iter.items()}
    if not options.gap:
        for r in result.records:
            if r.iteration >= 0 and r.kind not in ROLLOUT_KINDS:
                assert r.released >= barrier[r.iteration], r
    # GPU slots: never more in flight on a worker than it advertises; TAG one at a
    # time, released only to a worker with nothing in flight. A grad is lent to a
    # rollout worker with work in flight only ahead of a chunk's finishing work that
    # can wait: a decode or reward ready then, whose generation had released every
    # denoise step.
    events = defaultdict(list)
    for r in result.records:
        if r.gpu:
            events[r.worker].append((r.released, 1, r))
            events[r.worker].append((r.stop, -1, r))
    steps_out = defaultdict(float)      # iteration -> its last denoise step's release
    for r in result.records:
        if r.kind == DENOISE and r.pool == ROLLOUT:
            steps_out[r.iteration] = max(steps_out[r.iteration], r.released)
    finishing = [r for r in result.records if r.kind in ROLLOUT_KINDS - {DENOISE, NOISE}]
    slots = {w.name: w.gpus * options.slots_per_worker for w in workers}
    for w, evs in events.items():
        inflight = tagged = 0
        for t, delta, r in sorted(evs, key=lambda e: (e[0], e[1])):
            if delta > 0 and r.tag:
                assert inflight == 0, (w, t)
            if delta > 0 and r.rat and inflight:
                assert any(f.ready <= t <= f.released and steps_out[f.iteration] <= t
                           for f in finishing), (w, r)
            inflight += delta
            tagged += delta if r.tag else 0
            assert inflight <= slots[w]
            assert tagged <= 1
    # TAG: a rollout task goes to a trainer only while no training task is runnable there.
    for r in result.records:
        if not r.tag:
            continue
        for g in result.records:
            if g.kind not in TRAIN_GPU:
                continue
            if not options.tsp and g.chunk >= 0 and trainers[g.chunk % len(trainers)] != r.worker:
                continue
            runnable = max(g.ready, barrier.get(g.iteration, 0.0) if not options.gap else 0.0)
            assert not (runnable <= r.released < g.released), (r, g)


@st.composite
def scenarios(draw):
    mode = draw(st.sampled_from(sorted(MODES)))
    switches = {} if mode == "colocated" else dict(
        gap=draw(st.booleans()), tsp=draw(st.booleans()), tag=draw(st.booleans()),
        rat=draw(st.booleans()), max_staleness=draw(st.integers(0, 2)))
    options = opts(mode, slots_per_worker=draw(st.integers(1, 3)), **switches)
    num_steps = draw(st.integers(2, 4))
    spp = draw(st.sampled_from([2, 4]))
    layout = GraphLayout(num_steps=num_steps, trained_steps=draw(st.integers(1, num_steps - 1)),
                         reduce_fanin=draw(st.integers(2, 4)),
                         version_lag=options.max_staleness,
                         stale_groups=draw(st.one_of(st.none(), st.integers(0, 2))))
    plans = uniform_plans(draw(st.integers(1, 3)), draw(st.integers(1, 3)), spp,
                          draw(st.sampled_from([1, 2, spp])))
    workers = [SimWorker(f"rollout-{j}", ROLLOUT, draw(st.integers(1, 2)))
               for j in range(draw(st.integers(1, 3)))]
    workers += [SimWorker(f"trainer-{j}", TRAINER, draw(st.integers(1, 2)))
                for j in range(draw(st.integers(1, 3)))]
    durations = {k: draw(st.floats(0.01, 1.0)) for k in KINDS}
    jitter = draw(st.lists(st.floats(0.5, 2.0), min_size=7, max_size=7))
    return options, layout, plans, workers, durations, jitter


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_every_schedule_completes_and_keeps_the_rules(scenario):
    options, layout, plans, workers, durations, jitter = scenario

    def cost(info, worker):
        # (A stable hash: the same example draws the same durations in any interpreter.)
        j = jitter[stable_seed(info.key, worker.name) % len(jitter)]
        return durations[info.kind] * (j if info.gpu else 0.1)

    sim = Simulator(options, workers, cost, dispatch_latency=0.001)
    result = sim.run(layout, plans)
    # Every task of the graph was added and ran, once each (liveness).
    keys = graph_keys(layout, plans)
    assert sim.added == len(keys)
    assert sorted(repr(r.key) for r in result.records) == sorted(map(repr, keys)), \
        "a task never ran, or ran twice (liveness)"
    assert sorted(result.completed) == list(range(len(plans)))
    check_trace(result, options, layout, workers)


def test_evaluation_takes_only_a_slot_nothing_else_wants():
    """An eval task waits while rollout work is runnable, goes to an idle rollout worker
    only (never a trainer), is not held by the staleness bound, and counts as no
    iteration's rollout work (the barrier without GAP opens without it)."""
    p = policy_with(opts("digenrl", tag=True, rat=False, max_staleness=0))
    p.add_tasks([info("e", EVAL, iteration=5, version=0, chunk=0),
                 info("d", DENOISE, chunk=0, timestep=0)])
    p.task_ready("e")
    p.task_ready("d")
    # The rollout worker takes the denoise step; the idle trainer never takes the eval.
    assert [(d.key, d.worker) for d in p.decide()] == [("d", "r0")]
    assert p.decide() == []          # nothing taken behind the step in flight
    p.task_done("d", "r0")
    assert [(d.key, d.worker) for d in p.decide()] == [("e", "r0")]
    # Released while version 0 is the newest: no staleness hold for iteration 5.
    assert p.rule(Staleness).rollout_pending.get(5) is None


def test_evaluation_waits_for_a_grad_an_idle_rollout_worker_may_be_lent():
    p = policy_with(opts("digenrl", rat=True, slots_per_worker=1))
    p.add_tasks([info("g", GRAD, chunk=0, behaviour_version=0),
                 info("busy", GRAD, chunk=1, behaviour_version=0),
                 info("e", EVAL, chunk=0)])
    p.task_ready("busy")
    assert [d.key for d in p.decide()] == ["busy"]   # the trainer is full now
    p.task_ready("g")
    p.task_ready("e")
    # A grad waits that the idle rollout worker might be lent: no evaluation yet.
    assert p.decide() == []
    p.task_done("busy", "t0")
    assert [(d.key, d.worker) for d in p.decide()] == [("g", "t0")]
    # No grad waits any more: the idle rollout worker is looked at again.
    assert [(d.key, d.worker) for d in p.decide()] == [("e", "r0")]


# ------------------------------------------------------------- the rule interface

def test_a_rule_is_called_only_for_the_events_it_defines_and_in_the_lists_order():
    calls = []

    class Holds(Rule):
        """Holds back every decode (a rule of one event)."""

        __slots__ = ()

        def holds(self, info):
            calls.append(info.key)
            return info.kind == DECODE

    p = SchedulingPolicy(opts(), rules=(Holds,) + RULES)
    p.add_worker("r0", "rollout-0", ROLLOUT, 1)
    p.version = 0
    p.add_tasks([info("dec", DECODE, chunk=0), info("step", DENOISE, chunk=0, timestep=1)])
    p.task_ready("dec")
    p.task_ready("step")
    assert calls == ["dec", "step"]
    assert [d.key for d in p.decide()] == ["step"]           # the decode stays held
    assert [type(r) for r in p.rules] == [Holds, *RULES]
    assert p._on["holds"][0].__self__ is p.rules[0]           # asked first
    assert all(type(m.__self__).holds is not Rule.holds for m in p._on["holds"])


def test_a_rule_whose_attribute_hides_an_event_is_refused():
    class Hides(Rule):
        __slots__ = ("done",)

        def __init__(self, policy):
            super().__init__(policy)
            self.done = {}

    try:
        SchedulingPolicy(opts(), rules=RULES + (Hides,))
    except TypeError as e:
        assert str(e) == "Hides.done: expected the event's method, got a dict"
    else:
        raise AssertionError("accepted")
