"""The pools rule alone (policy/rules/pools.py): which pool a worker serves, where a
task without a GPU goes, and the reasons noted."""

from __future__ import annotations

from digenrl.schedulers.policy import SchedulingPolicy
from digenrl.schedulers.policy.rules.pools import pool_problem, worker_pool
from digenrl.vocabulary import COLOCATED, DENOISE, GRAD, NOISE, REWARD, ROLLOUT, TRAINER

from rule_helpers import info, opts, policy_with, said, steps


def test_a_worker_serves_its_tagged_pool_and_untagged_ones_none():
    p = SchedulingPolicy(opts("digenrl"))
    assert worker_pool(ROLLOUT, p.options) == ROLLOUT
    assert worker_pool(None, p.options) is None and worker_pool("gpu", p.options) is None
    p.add_worker("x", "untagged", None, 1)
    assert p.workers == {}
    assert worker_pool(TRAINER, opts("colocated")) == COLOCATED


def test_a_task_of_no_pool_can_never_run():
    bad = info("x", DENOISE)
    bad.pool = "gpu"
    assert pool_problem(bad) == "pool: expected 'rollout' or 'trainer', got 'gpu'"
    assert pool_problem(info("y", DENOISE)) is None
    p = policy_with(opts("digenrl"))
    assert p.add_tasks([bad]) == {"x": pool_problem(bad)}


def test_each_task_goes_to_its_pool_and_says_why():
    p = policy_with(opts("digenrl", tag=False))
    p.add_tasks([info("d", DENOISE), info("g", GRAD, chunk=0, behaviour_version=0)])
    p.task_ready("d")
    p.task_ready("g")
    assert {d.key: d.worker for d in p.decide()} == {"d": "r0", "g": "t0"}
    assert said(p, "d") == [("released", "pools", "rollout-0")]
    assert steps(p, "d")[0].reason == ("the most urgent rollout task; no single worker holds "
                                       "its inputs")
    assert said(p, "g") == [("released", "pools", "trainer-0")]
    assert steps(p, "g")[0].reason == "the most urgent training task (iteration 0)"


def test_a_step_goes_where_its_inputs_are():
    p = policy_with(opts("digenrl", tag=False), rollout=2)
    p.add_tasks([info(c, DENOISE, chunk=c, timestep=1) for c in range(2)])
    p.task_ready(0, {"r1": 100, "r0": 10})
    p.task_ready(1, {"r0": 100})
    assert {d.key: d.worker for d in p.decide()} == {0: "r1", 1: "r0"}
    [s] = steps(p, 0)
    assert (s.verb, s.rule, s.worker) == ("released", "pools", "rollout-1")
    assert s.reason == "its inputs are on this worker (100 bytes)"


def test_a_task_without_a_gpu_goes_where_most_of_its_bytes_are_else_in_turn():
    p = policy_with(opts("digenrl"), rollout=2)
    p.add_tasks([info(("n", j), REWARD, gpu=False) for j in range(3)])
    p.task_ready(("n", 0), {"r1": 5, "r0": 2})
    p.task_ready(("n", 1), {})
    p.task_ready(("n", 2), {})
    assert {d.key: d.worker for d in p.decide()} == {("n", 0): "r1", ("n", 1): "r0",
                                                     ("n", 2): "r1"}
    [by_bytes], [in_turn] = steps(p, ("n", 0)), steps(p, ("n", 1))
    assert (by_bytes.verb, by_bytes.rule, by_bytes.worker) == ("placed", "pools", "rollout-1")
    assert by_bytes.reason == "it holds most of the task's input bytes (5 bytes)"
    assert in_turn.reason == "no input on the pool: the next worker in turn"


def test_a_chunks_noise_is_dealt_in_turn_wherever_its_conditioning_is():
    """Its groups' conditioning (its input) moves to it: without rebalancing the chunk
    stays where its noise is drawn, so each worker gets an equal share of the chunks."""
    p = policy_with(opts("digenrl"), rollout=2)
    p.add_tasks([info(("n", j), NOISE, gpu=False) for j in range(3)])
    for j in range(3):
        p.task_ready(("n", j), {"r1": 5})
    assert {d.key: d.worker for d in p.decide()} == {("n", 0): "r0", ("n", 1): "r1",
                                                     ("n", 2): "r0"}
    [s] = steps(p, ("n", 1))
    assert (s.verb, s.rule, s.worker) == ("placed", "pools", "rollout-1")
    assert s.reason == "a chunk's noise: dealt to the next worker in turn"


def test_a_task_of_a_pool_without_workers_waits_and_says_so():
    p = policy_with(opts("digenrl"), rollout=0, trainer=1)
    p.add_tasks([info("n", NOISE, gpu=False)])
    p.task_ready("n")
    assert p.decide() == []
    [s] = steps(p, "n")
    assert (s.verb, s.rule, s.reason) == ("waits", "pools", "no worker serves its pool")
    p.add_worker("r0", "rollout-0", ROLLOUT, 1)
    assert [d.worker for d in p.decide()] == ["r0"]
