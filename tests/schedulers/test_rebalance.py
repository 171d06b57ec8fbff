"""Straggler rebalancing in the scheduling policy, driven without any cluster."""

from __future__ import annotations

import pytest

from digenrl.schedulers.options import MODES, ScheduleOptions
from digenrl.schedulers.policy import SchedulingPolicy, TaskInfo


def opts(**kw):
    base = {**MODES["digenrl"], "tag": False, "slots_per_worker": 1, **kw}
    return ScheduleOptions(mode="digenrl", **base)


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def step(key, chunk, t=0, samples=4):
    return TaskInfo(key=key, kind="denoise", pool="rollout", iteration=0, policy_version=0,
                    gpu=True, timestep=t, chunk=chunk, samples=samples)


def setup(options, speeds=(1.0, 1.0), trainers=0, measured=(0.1, 1.0)):
    """Rollout workers r0, r1 (and trainers t0..): each has finished one 4-sample step
    taking ``measured[j]`` seconds per sample (None: nothing measured)."""
    clock = Clock()
    p = SchedulingPolicy(options, clock=clock)
    for j, s in enumerate(speeds):
        p.add_worker(f"r{j}", f"rollout-{j}", "rollout", 1, s)
    for j in range(trainers):
        p.add_worker(f"t{j}", f"trainer-{j}", "trainer", 1)
    p.version = 0
    warm = {("warm", j): per_sample for j, per_sample in enumerate(measured)
            if per_sample is not None}
    for key in warm:
        p.add_tasks([step(key, chunk=100 + key[1])])
        p.task_ready(key, {f"r{key[1]}": 10})
    assert {d.key: d.worker for d in p.decide()} == {k: f"r{k[1]}" for k in warm}
    for key, per_sample in warm.items():
        p.task_done(key, f"r{key[1]}", per_sample * 4)
    return p, clock


def occupy(p, worker):
    """Make ``worker``'s only slot busy with a step of its own chunk, the other rollout
    workers free (each runs and finishes one step of its own meanwhile, at its pace)."""
    rollout = [a for a, w in p.workers.items() if w.pool == "rollout"]
    for j, a in enumerate(rollout):
        p.add_tasks([step(("busy", a), chunk=50 + j)])
        p.task_ready(("busy", a), {a: 10})
    assert {d.key: d.worker for d in p.decide()} == {("busy", a): a for a in rollout}
    for a in rollout:
        if a != worker:
            st = p.workers[a].step_time
            p.task_done(("busy", a), a, None if st is None else st * 4)


def waiting_step(p, holder, nbytes=1000, chunk=0, t=3):
    key = ("d", chunk, t)
    p.add_tasks([step(key, chunk, t)])
    p.task_ready(key, {holder: nbytes})
    return key


def test_step_times_are_learned_from_finished_denoise_steps():
    p, _ = setup(opts(), measured=(0.1, 1.0))
    assert p.workers["r0"].step_time == pytest.approx(0.1)
    assert p.workers["r1"].step_time == pytest.approx(1.0)
    # A worker without measurements is estimated from its declared speed.
    p.add_worker("r2", "rollout-2", "rollout", 1, 0.5)
    ref = p.facts.step_time(p.workers["r2"]) * 0.5
    assert 0.1 < ref < 1.0


def test_a_step_moves_off_a_slow_worker_to_an_idle_fast_one():
    p, _ = setup(opts(), measured=(0.1, 1.0))
    occupy(p, "r1")
    key = waiting_step(p, "r1")
    [d] = p.decide()
    assert (d.key, d.worker, d.stolen) == (key, "r0", True)


def test_without_rebalancing_the_step_waits_for_the_worker_holding_its_latents():
    p, _ = setup(opts(rebalance=False), measured=(0.1, 1.0))
    occupy(p, "r1")
    key = waiting_step(p, "r1")
    assert p.decide() == []
    p.task_done(("busy", "r1"), "r1", 4.0)
    assert [(d.key, d.worker) for d in p.decide()] == [(key, "r1")]


def test_a_transfer_dearer_than_the_step_keeps_it_in_place():
    # 10 GB at 1 GB/s: 10 s to move a step the slow worker computes in 4 s.
    p, _ = setup(opts(transfer_bandwidth=1e9), measured=(0.1, 1.0))
    occupy(p, "r1")
    waiting_step(p, "r1", nbytes=10_000_000_000)
    assert p.decide() == []
    assert p.counters["kept"] == 1


def test_a_much_slower_worker_leaves_the_step_to_its_owner():
    # r1 needs 40 s for a step its owner r0 finishes in 0.4 s once its slot frees.
    p, _ = setup(opts(), measured=(0.1, 10.0))
    occupy(p, "r0")
    key = waiting_step(p, "r0")
    assert p.decide() == []
    p.task_done(("busy", "r0"), "r0", 0.4)
    assert [(d.key, d.worker) for d in p.decide()] == [(key, "r0")]


def test_before_any_measurement_an_idle_worker_takes_waiting_steps():
    p, _ = setup(opts(), measured=(None, None))
    occupy(p, "r1")
    key = waiting_step(p, "r1")
    assert [(d.key, d.worker) for d in p.decide()] == [(key, "r0")]


def test_an_idle_trainer_takes_a_step_off_a_slow_rollout_worker_with_tag():
    p, _ = setup(opts(tag=True), speeds=(1.0,), trainers=1, measured=(1.0,))
    occupy(p, "r0")
    key = waiting_step(p, "r0")
    [d] = p.decide()
    assert (d.key, d.worker, d.tag, d.stolen) == (key, "t0", True, True)


def test_busy_until_follows_released_and_finished_work():
    p, clock = setup(opts(), measured=(0.1, 1.0))
    clock.now = 10.0
    occupy(p, "r1")
    assert p.workers["r1"].busy_until == pytest.approx(14.0)  # 4 samples x 1 s
    clock.now = 12.0
    p.task_done(("busy", "r1"), "r1", 2.0)
    assert p.workers["r1"].busy_until == pytest.approx(12.0)


def _noise_then_first_step(p, chunk, worker):
    """A chunk's noise drawn on ``worker``; its first step becomes ready."""
    noise = TaskInfo(key=("noise", chunk), kind="noise", pool="rollout", iteration=0,
                     policy_version=0, gpu=False, chunk=chunk, samples=4)
    p.add_tasks([noise])
    p.task_ready(noise.key, {})
    p.decide()
    p.task_done(noise.key, worker)
    key = ("d", chunk, 0)
    p.add_tasks([step(key, chunk, t=0)])
    p.task_ready(key, {worker: 10})
    return key


def test_with_rebalancing_a_chunk_starts_on_whichever_worker_is_free():
    p, _ = setup(opts(), measured=(0.1, 1.0))
    occupy(p, "r1")
    key = _noise_then_first_step(p, chunk=7, worker="r1")
    assert [(d.key, d.worker, d.stolen) for d in p.decide()] == [(key, "r0", False)]


def test_without_rebalancing_a_chunk_starts_where_its_noise_was_drawn():
    p, _ = setup(opts(rebalance=False), measured=(0.1, 1.0))
    occupy(p, "r1")
    key = _noise_then_first_step(p, chunk=7, worker="r1")
    assert p.decide() == []
    p.task_done(("busy", "r1"), "r1", 4.0)
    assert [(d.key, d.worker) for d in p.decide()] == [(key, "r1")]
