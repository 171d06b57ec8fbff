"""The rebalancing rule alone (policy/rules/rebalance.py): a step stolen off a slow
worker, or kept where its latents are; the reasons noted. (Its decisions in detail:
tests/schedulers/test_rebalance.py.)"""

from __future__ import annotations

from digenrl.schedulers.policy.rules.rebalance import Rebalance
from digenrl.vocabulary import DENOISE, NOISE

from rule_helpers import Clock, info, opts, policy_with, steps


def _measured(transfer_bandwidth=1e9):
    """r0 measured at 0.1 s per sample-step, r1 at 1 s; r1 busy with its own step."""
    clock = Clock()
    p = policy_with(opts("digenrl", tag=False, slots_per_worker=1,
                         transfer_bandwidth=transfer_bandwidth), rollout=2, trainer=0,
                    clock=clock)
    warm = [info(("warm", j), DENOISE, chunk=100 + j, timestep=1, samples=4) for j in range(2)]
    p.add_tasks(warm)
    for j, w in enumerate(warm):
        p.task_ready(w.key, {f"r{j}": 10})
    p.decide()
    p.task_done(warm[0].key, "r0", 0.4)
    p.task_done(warm[1].key, "r1", 4.0)
    busy = [info(("busy", j), DENOISE, chunk=50 + j, timestep=1, samples=4)
            for j in range(2)]
    p.add_tasks(busy)
    for j, b in enumerate(busy):
        p.task_ready(b.key, {f"r{j}": 10})
    assert {d.key: d.worker for d in p.decide()} == {("busy", 0): "r0", ("busy", 1): "r1"}
    p.task_done(("busy", 0), "r0", 0.4)
    return p


def test_a_step_moves_off_a_slow_worker_and_says_why():
    p = _measured()
    step = info(("d", 0, 3), DENOISE, chunk=0, timestep=3, samples=4)
    p.add_tasks([step])
    p.task_ready(step.key, {"r1": 1000})
    [d] = p.decide()
    assert (d.worker, d.stolen) == ("r0", True)
    [s] = steps(p, step.key)
    assert (s.verb, s.rule, s.worker) == ("stolen", "rebalance", "rollout-0")
    assert s.reason == ("from rollout-1: finishes in 0.4 s here against 8 s there (+ 1 steps "
                        "of 4 s allowed); moving takes 1e-06 s")


def test_a_step_whose_move_costs_more_than_it_gains_stays_and_says_why():
    p = _measured(transfer_bandwidth=1e9)
    step = info(("d", 0, 3), DENOISE, chunk=0, timestep=3, samples=4)
    p.add_tasks([step])
    p.task_ready(step.key, {"r1": 10_000_000_000})     # 10 s to move a 4 s step
    assert p.decide() == []
    assert p.counters["kept"] == 1
    [s] = steps(p, step.key)
    assert (s.verb, s.rule, s.worker) == ("kept", "rebalance", "rollout-0")
    assert s.reason.startswith("the move costs more than it gains: moving takes 10 s for a "
                               "4 s step")


def test_a_chunks_first_step_starts_on_whichever_worker_frees_first():
    p = _measured()
    noise = info(("noise", 7), NOISE, gpu=False, chunk=7, samples=4)
    first = info(("d", 7, 0), DENOISE, chunk=7, timestep=0, samples=4)
    p.add_tasks([noise, first])
    p.task_ready(noise.key, {})
    p.decide()
    p.task_done(noise.key, "r1")
    assert p.rule(Rebalance).chunk_home == {(0, 7): "r1"}
    assert p.rule(Rebalance).first_step_home(first) is None        # with rebalancing: nowhere
    p.task_ready(first.key, {"r1": 10})
    assert [(d.key, d.worker) for d in p.decide()] == [(first.key, "r0")]
    [s] = steps(p, first.key)
    assert (s.verb, s.rule, s.reason) == (
        "released", "rebalance", "a chunk's first step starts on whichever worker frees first")
