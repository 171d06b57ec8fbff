"""The decision trail (digenrl/schedulers/policy/trail.py): bounded, repeats counted,
formatted only when read, off without cost; the simulator records it when asked and
its schedules stay the same."""

from __future__ import annotations

import dataclasses
import math

from digenrl.schedulers.options import MODES, ScheduleOptions
from digenrl.schedulers.policy import SchedulingPolicy, TaskInfo
from digenrl.schedulers.policy.trail import (TRAIL_LENGTH, Entry, note, parse_trail, story,
                                             trail_text)
from digenrl.sim.profile import load_profile
from digenrl.sim.simulate import simulate
from digenrl.figures.variants import variant_schedule
from digenrl.vocabulary import DENOISE, GRAD, ROLLOUT, TRAINER


def _entry(t, verb="declined", reason="{} s", *args):
    return Entry(t, verb, "RAT", "rollout-0", reason, args or (t,))


def test_the_same_decision_again_is_counted_not_repeated():
    trail = note(None, _entry(1.0))
    trail = note(trail, _entry(2.0))
    trail = note(trail, _entry(3.0))
    assert len(trail) == 1 and trail[0].repeats == 2 and trail[0].last == 3.0
    assert trail[0].time == 1.0 and trail[0].args == (1.0,)   # the first one's reason
    trail = note(trail, _entry(4.0, "lent"))
    assert [e.verb for e in trail] == ["declined", "lent"]


def test_a_task_keeps_its_last_decisions():
    trail = None
    for j in range(TRAIL_LENGTH + 5):
        trail = note(trail, _entry(float(j), "held" if j % 2 else "eligible"))
    assert len(trail) == TRAIL_LENGTH and trail[0].time == 5.0


def test_a_trail_reads_back_from_its_text_with_its_reasons_formatted():
    trail = [_entry(1.5, "lent", "mine {:.3g} s <= theirs {:.3g} s", 0.21, 0.35),
             Entry(2.0, "lost", "", "", "tab\there\nand a line", ())]
    trail = note(trail, Entry(2.5, "lost", "", "", "tab\there\nand a line", ()))
    text = trail_text(trail)
    assert len(text.splitlines()) == 2
    lent, lost = parse_trail(text)
    assert (lent.time, lent.verb, lent.rule, lent.worker) == (1.5, "lent", "RAT", "rollout-0")
    assert lent.reason == "mine 0.21 s <= theirs 0.35 s" and math.isnan(lent.last)
    assert (lost.reason, lost.repeats, lost.last) == ("tab here and a line", 1, 2.5)
    assert lent.line(1.0) == ("     0.500 s  lent to rollout-0: RAT -- mine 0.21 s <= theirs "
                              "0.35 s")
    assert lost.line(1.0).endswith("lost: tab here and a line (taken again 1 times, last at "
                                   "1.500 s)")
    assert trail_text(None) == "" and parse_trail("") == []


def test_a_story_tells_times_worker_and_decisions_in_order():
    record = {"key": "('grad', 3, 1, 2)", "kind": GRAD, "iteration": 3, "policy_version": 3,
              "worker_name": "rollout-1", "pool": ROLLOUT, "rat": True, "tag": False,
              "ready": 10.0, "eligible": 10.0, "released": 10.5, "start": 10.6, "stop": 11.0,
              "decisions": trail_text([
                  _entry(10.2, "declined", "a trainer finishes it sooner"),
                  Entry(10.5, "lent", "RAT", "rollout-1", "every trainer busy", ())])}
    text = story(record, t0=10.0)
    assert text.splitlines() == [
        "('grad', 3, 1, 2): grad of iteration 3 (policy version 3)",
        "  ran on rollout-1 (rollout pool) [rat]",
        "  ready 0.000 s  eligible 0.000 s  released 0.500 s  start 0.600 s  stop 1.000 s",
        "       0.200 s  declined by rollout-0: RAT -- a trainer finishes it sooner",
        "       0.500 s  lent to rollout-1: RAT -- every trainer busy"]
    del record["decisions"]
    assert story(record, 10.0).endswith("(no decision trail recorded for this task)")


def _policy(trail):
    o = ScheduleOptions(mode="digenrl", **MODES["digenrl"])
    p = SchedulingPolicy(o, clock=lambda: 0.0, trail=trail)
    p.add_worker("r0", "rollout-0", ROLLOUT, 1)
    p.add_worker("t0", "trainer-0", TRAINER, 1)
    p.version = 0
    tasks = [TaskInfo(("d", j), DENOISE, ROLLOUT, 1, 0, True, timestep=0, chunk=j)
             for j in range(3)]
    tasks.append(TaskInfo(("d", 9), DENOISE, ROLLOUT, 5, 0, True, timestep=0, chunk=9))
    p.add_tasks(tasks)
    for t in tasks:
        p.ready(t, {})
    return p, tasks, [(d.key, d.worker) for d in p.decide()]


def test_without_a_trail_nothing_is_recorded_and_nothing_decided_differently():
    on, tasks_on, decided_on = _policy(TRAIL_LENGTH)
    off, tasks_off, decided_off = _policy(0)
    assert decided_on == decided_off
    assert all(t.trail for t in tasks_on)          # released or held, each says why
    assert all(t.trail is None for t in tasks_off)


def test_lost_and_retried_tasks_say_so():
    p, tasks, decided = _policy(TRAIL_LENGTH)
    key = decided[0][0]
    p.task_lost(key)
    p.task_ready(key, {})
    [again] = p.decide()
    p.release_failed([again.key])
    verbs = [s.verb for s in parse_trail(trail_text(p.trail_of(key)))]
    assert verbs == ["released", "lost", "released", "retried"]


def test_the_simulator_records_a_trail_when_asked_and_schedules_the_same():
    p = load_profile("flux12b-16gpu")
    p = dataclasses.replace(p, prompts_per_iteration=max(1, p.prompts_per_iteration // 4))
    s = variant_schedule("digenrl")

    def run(trail):
        report = simulate(p, s.options(), 3, stale_groups=s.stale_groups, trail=trail)
        return report.result.records

    off, on = run(0), run(TRAIL_LENGTH)
    assert [(r.key, r.worker, r.start) for r in on] == [(r.key, r.worker, r.start)
                                                       for r in off]
    assert all(r.decisions == "" for r in off)
    # Every GPU task says which rule sent it to the worker that ran it.
    sent = {"released", "lent", "stolen"}
    for r in on:
        if r.gpu:
            went = [s for s in parse_trail(r.decisions) if s.verb in sent]
            assert went and went[-1].worker == r.worker, (r.key, r.decisions)
    # A step stolen at a timestep boundary tells why it moved.
    stolen = [r for r in on if any(s.verb == "stolen" for s in parse_trail(r.decisions))]
    assert stolen
    text = story(stolen[0]._asdict())
    assert "stolen by " in text and ": rebalance -- from " in text and "finishes in" in text
    # And a grad lent to a rollout worker why it was.
    lent = next(r for r in on if r.rat)
    assert f"lent to {lent.worker}: RAT -- " in story(lent._asdict())
