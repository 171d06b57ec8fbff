"""The progress watchdog's decisions, without a cluster."""

from __future__ import annotations

from digenrl.schedulers.options import MODES, ScheduleOptions
from digenrl.schedulers.policy import SchedulingPolicy, TaskInfo
from digenrl.schedulers.watchdog import (STALL_FACTOR, STALL_FLOOR, Processing, Watchdog,
                                         stall_timeout)

A, B = "tcp://a:1", "tcp://b:1"


def test_a_task_on_a_worker_that_runs_nothing_is_taken_back_after_its_grace():
    dog = Watchdog(floor=5.0, factor=10.0)
    dog.observe(0.0, {A: False})
    task = Processing("t", A, since=0.0, expected=2.0)   # grace: 10 x 2 s = 20 s
    assert dog.overdue(19.0, [task], {A: True}) == []
    [t] = dog.overdue(21.0, [task], {A: True})
    assert (t.key, t.worker) == ("t", A)
    assert "processing for 21 s" in t.why and "expected 2 s" in t.why
    assert "executed nothing for 21 s" in t.why


def test_a_task_on_a_worker_the_scheduler_no_longer_lists_is_taken_back_at_once():
    dog = Watchdog(floor=5.0)
    dog.observe(0.0, {B: False})
    orphan, waiting = Processing("t", A, since=0.0), Processing("u", B, since=0.0)
    [t] = dog.overdue(0.1, [orphan, waiting], {B: True})
    assert (t.key, t.worker, t.orphan) == ("t", A, True)
    assert "no longer lists" in t.why


def test_the_floor_applies_when_nothing_was_measured():
    dog = Watchdog(floor=5.0)
    dog.observe(0.0, {A: False})
    task = Processing("t", A, since=0.0)
    assert dog.overdue(4.9, [task], {A: True}) == []
    [t] = dog.overdue(5.1, [task], {A: True})
    assert "expected unknown" in t.why


def test_a_worker_that_executes_something_is_progressing():
    dog = Watchdog(floor=5.0)
    task = Processing("t", A, since=0.0)
    dog.observe(0.0, {A: True})
    dog.observe(50.0, {A: True})
    assert dog.overdue(50.0, [task], {A: True}) == []
    # Idle since 50: the task waited long, but its worker only just stopped executing.
    dog.observe(51.0, {A: False})
    assert dog.overdue(54.0, [task], {A: True}) == []
    assert [t.key for t in dog.overdue(56.5, [task], {A: True})] == ["t"]


def test_a_paused_worker_is_left_alone():
    dog = Watchdog(floor=5.0)
    dog.observe(0.0, {A: False, B: False})
    tasks = [Processing("a", A, 0.0), Processing("b", B, 0.0)]
    assert [t.key for t in dog.overdue(10.0, tasks, {A: False, B: True})] == ["b"]


def test_a_worker_that_left_and_came_back_starts_idle_afresh():
    dog = Watchdog(floor=5.0)
    dog.observe(0.0, {A: False})
    dog.observe(10.0, {})                    # A left
    dog.observe(10.0, {A: False})            # and a worker at its address joined
    task = Processing("t", A, since=0.0)
    assert dog.overdue(12.0, [task], {A: True}) == []
    assert dog.overdue(15.5, [task], {A: True})


def test_the_stall_timeout_is_the_configured_one_or_many_times_the_longest_task():
    assert stall_timeout(7.5, 100.0) == 7.5
    assert stall_timeout(None, None) == STALL_FLOOR
    assert stall_timeout(None, 1.0) == STALL_FLOOR
    assert stall_timeout(None, 60.0) == STALL_FACTOR * 60.0


def test_expected_times_come_from_the_measured_step_times():
    opts = ScheduleOptions(mode="digenrl", **MODES["digenrl"])
    now = [0.0]
    p = SchedulingPolicy(opts, clock=lambda: now[0])
    p.add_worker(A, "a", "rollout", 1)
    infos = [TaskInfo(("denoise", 0, c, 0), "denoise", "rollout", 0, 0, True, timestep=0,
                      chunk=c, samples=4) for c in range(2)]
    p.add_tasks(infos)
    p.version = 0
    first, second = (info.key for info in infos)
    p.task_ready(first)
    # The second step's input (1 GB) lies elsewhere: moving it is expected to take 1 s.
    p.task_ready(second, {"tcp://elsewhere:1": opts.transfer_bandwidth})
    assert {d.key for d in p.decide()} == {first, second}
    assert p.expected_seconds(first) is None and p.longest_expected() is None
    p.task_done(first, A, duration=2.0)             # 0.5 s per sample-step
    assert p.expected_seconds(second) == 1.0 + 2.0
    assert p.longest_expected() == 2.0
    assert p.expected_seconds(first) is None        # finished: not released anywhere
