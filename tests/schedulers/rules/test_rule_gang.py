"""The gang rule alone (policy/rules/gang.py): a gang's members are released together,
each on its own worker, never moved by TAG, RAT or rebalancing, and taken back together
when one is lost; the reasons noted. Plus a property: a gang is never partly released."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from digenrl.graph.keys import task_meta
from digenrl.schedulers.policy import SchedulingPolicy, TaskInfo
from digenrl.schedulers.policy.rules.gang import Gang
from digenrl.schedulers.policy.state import DONE, RELEASED
from digenrl.vocabulary import DENOISE, GRAD, ROLLOUT, TRAINER

from rule_helpers import Clock, grads, info, opts, policy_with, said, steps


def gang(gid, size, kind=GRAD, iteration=0, trainers=None):
    """The members of gang ``gid``: one ``kind`` task per member (with ``trainers``: a
    gang spanning both pools, its first ``trainers`` members on the trainer pool)."""
    extra = {"behaviour_version": iteration} if kind == GRAD else {"timestep": 1}
    span = () if trainers is None else (trainers,)
    return [info(("m", gid, j), kind, iteration=iteration, version=iteration, chunk=j,
                 gang=(gid, j, size, *span), **extra) for j in range(size)]


def test_the_annotation_carries_the_gang_and_a_bad_one_is_refused_in_one_line():
    meta = task_meta(GRAD, 0, 0, gang=(7, 1, 2))
    assert TaskInfo.from_meta("k", {**meta, "gang": [7, 1, 2]}).gang == (7, 1, 2)
    assert TaskInfo.from_meta("k", task_meta(GRAD, 0, 0)).gang is None
    assert TaskInfo.from_meta("k", task_meta(GRAD, 0, 0, gang=(7, 1, 3, 2))).gang == (7, 1, 3, 2)
    expected = (r"^gang: expected \(gang id, member index, size\[, trainers\]\) as integers "
                r"with 0 <= member index < size and 0 < trainers <= size, got ")
    with pytest.raises(ValueError, match=expected + r"\(7, 2, 2\)$"):
        task_meta(GRAD, 0, 0, gang=(7, 2, 2))
    with pytest.raises(ValueError, match=expected + r"\(7, 1, 2, 3\)$"):
        task_meta(GRAD, 0, 0, gang=(7, 1, 2, 3))


def test_a_gang_spanning_both_pools_puts_its_first_members_on_the_trainers():
    """A sharded run's broadcast: its first members on the trainers, the others on the
    rollout workers, each in its pool's order, all released together and none lent."""
    p = policy_with(opts("digenrl", tag=True, rat=True), rollout=2, trainer=2)
    members = gang(3, 4, trainers=2)
    p.add_tasks(members)
    for m in members[:3]:
        p.task_ready(m.key)
    assert p.decide() == []
    p.task_ready(members[3].key)
    out = p.decide()
    assert [(d.key, d.worker) for d in sorted(out, key=lambda d: d.info.gang[1])] == [
        (members[0].key, "t0"), (members[1].key, "t1"), (members[2].key, "r0"),
        (members[3].key, "r1")]
    assert not any(d.tag or d.rat or d.stolen for d in out)
    # One rollout worker fewer: the gang waits, saying for what.
    p = policy_with(opts("digenrl"), rollout=1, trainer=2)
    members = gang(4, 4, trainers=2)
    p.add_tasks(members)
    for m in members:
        p.task_ready(m.key)
    assert p.decide() == []
    assert steps(p, members[0].key)[-1].reason == (
        "gang 4 needs 2 workers of the trainer pool and 2 of the rollout pool: 2 and 1 "
        "serve them")


def test_members_wait_until_every_one_is_ready_then_go_together_each_to_its_worker():
    p = policy_with(opts("digenrl"), rollout=1, trainer=2)
    members = gang(0, 2)
    p.add_tasks(members)
    p.task_ready(members[1].key)
    assert p.decide() == []                              # one of two: nothing moves
    assert said(p, members[1].key) == [("waits", "gang", "")]
    assert steps(p, members[1].key)[0].reason == "member 1 of gang 0: 1 of 2 members ready"
    p.task_ready(members[0].key)
    out = p.decide()
    assert sorted((d.key, d.worker) for d in out) == [(members[0].key, "t0"),
                                                      (members[1].key, "t1")]
    assert not any(d.tag or d.rat or d.stolen for d in out)
    assert said(p, members[0].key)[-1] == ("released", "gang", "trainer-0")
    assert steps(p, members[0].key)[-1].reason == (
        "all 2 members of gang 0 can take their part: released together, member 0 to "
        "worker 0 of its pool")


def test_a_busy_member_worker_is_drained_and_the_other_kept_free_for_the_gang():
    p = policy_with(opts("digenrl", slots_per_worker=2), rollout=0, trainer=2)
    busy, other = grads(2)
    members = gang(1, 2)
    p.add_tasks([busy, other] + members)
    p.task_ready(busy.key)
    [first] = p.decide()
    for m in members:
        p.task_ready(m.key)
    assert p.decide() == []            # a member's worker is busy: the gang waits
    p.task_ready(other.key)
    # Both trainers are kept for the gang: the free slots take no other grad.
    assert p.decide() == []
    kept = [s for s in steps(p, other.key) if s.verb == "kept"]
    assert kept and kept[0].rule == "gang"
    assert kept[0].reason == ("the worker is kept for gang 1, released once its members' "
                              "workers are all free")
    p.task_done(first.key, first.worker, 1.0)
    out = p.decide()
    assert sorted(d.key for d in out[:2]) == sorted(m.key for m in members)
    assert {d.worker for d in out[:2]} == {"t0", "t1"}


def test_no_rule_moves_a_member_an_idle_worker_of_another_pool_never_takes_one():
    # RAT and TAG on, every worker idle: the trainers' gang is too wide for its pool
    # (one trainer); neither the rollout worker nor anybody else runs a member.
    p = policy_with(opts("digenrl"), rollout=2, trainer=1)
    members = gang(2, 2) + gang(3, 3, kind=DENOISE)
    p.add_tasks(members)
    for m in members:
        p.task_ready(m.key)
    assert p.decide() == []
    assert steps(p, members[0].key)[-1].reason == ("gang 2 needs 2 workers of its pool: 1 "
                                                   "serve it")
    assert steps(p, members[2].key)[-1].reason == ("gang 3 needs 3 workers of its pool: 2 "
                                                   "serve it")
    # One more rollout worker: the rollout gang goes, each member to its worker.
    p.add_worker("r2", "rollout-2", ROLLOUT, 1)
    out = p.decide()
    assert sorted((d.key[2], d.worker) for d in out) == [(0, "r0"), (1, "r1"), (2, "r2")]


def released_gang(p, gang_id: int, size: int):
    """A training gang of ``size`` added, ready and released whole."""
    members = gang(gang_id, size)
    p.add_tasks(members)
    for m in members:
        p.task_ready(m.key)
    assert len(p.decide()) == size
    return members


def test_a_member_lost_mid_gang_takes_the_others_back_and_the_gang_runs_again_whole():
    p = policy_with(opts("digenrl"), rollout=0, trainer=3)
    members = released_gang(p, 4, 3)
    p.task_done(members[0].key, "t0", 1.0)
    p.task_lost(members[1].key)
    # The finished member and the running one are taken back: the step runs again.
    assert sorted(p.take_withdrawn()) == [members[0].key, members[2].key]
    assert all(m.state is not RELEASED and m.state is not DONE for m in members)
    lost = steps(p, members[2].key)[-1]
    assert (lost.verb, lost.rule) == ("lost", "gang")
    assert lost.reason == ("member 1 of gang 4 must run again: the gang's step fails, and "
                           "runs again together")
    # Noted once, for a driver whose gang keeps state between steps.
    assert p.rule(Gang).failed == [f"gang 4's step failed: member 1 ({members[1].key!r}) "
                                   f"must run again after the others ran"]
    for m in members[:2]:
        p.task_ready(m.key)
    assert p.decide() == []                              # two of three ready
    p.task_ready(members[2].key)
    assert sorted(d.key for d in p.decide()) == sorted(m.key for m in members)


def test_a_member_worker_leaving_fails_the_step_at_once():
    p = policy_with(opts("digenrl"), rollout=0, trainer=2)
    members = released_gang(p, 5, 2)
    assert p.remove_worker("t1") == [members[1].key]
    assert p.take_withdrawn() == [members[0].key]
    assert members[0].state is not RELEASED and not p.workers["t0"].inflight


# ------------------------------------------------------------------ the property

def _member_worker(p: SchedulingPolicy, m: TaskInfo) -> str:
    _, index, size, *span = m.gang
    trainers = span[0] if span else size
    if index < trainers:
        return p.pool_workers(m.pool)[index].address
    return p.pool_workers(ROLLOUT)[index - trainers].address


def event(p: SchedulingPolicy, action: str, n: int, tasks: list[TaskInfo],
          recomputable: list[TaskInfo], names: dict[str, tuple[str, str]]) -> None:
    """One of the events the gang properties draw, on the ``n``-th of its candidates: a
    running task ``done`` or ``lose``-t, a finished one's result lost and needed again
    (``recompute``, among ``recomputable``), a worker (of ``names``: address -> (name,
    pool)) that leaves with what runs on it, or that joins again."""
    running = [t for t in tasks if t.state is RELEASED]
    addresses = sorted(names)
    if action == "done" and running:
        t = running[n % len(running)]
        p.task_done(t.key, t.where, 1.0)
    elif action == "lose" and running:
        p.task_lost(running[n % len(running)].key)
    elif action == "recompute" and recomputable:
        p.task_ready(recomputable[n % len(recomputable)].key, {})
    elif action == "leave":
        for key in p.remove_worker(addresses[n % len(addresses)]):
            p.task_lost(key)
    elif action == "join":
        rejoin(p, names, [addresses[n % len(addresses)]])


def rejoin(p: SchedulingPolicy, names: dict[str, tuple[str, str]], addresses) -> None:
    """The workers at ``addresses`` that are gone join again."""
    for a in addresses:
        if a not in p.workers:
            name, pool = names[a]
            p.add_worker(a, name, pool, 1)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rollout=st.integers(1, 3), trainer=st.integers(1, 3),
       slots=st.integers(1, 2), tag=st.booleans(), rat=st.booleans(),
       sizes=st.lists(st.tuples(st.sampled_from([ROLLOUT, TRAINER, "both"]),
                                st.integers(1, 3)), min_size=1, max_size=3),
       plain=st.integers(0, 4),
       actions=st.lists(st.tuples(st.sampled_from(["ready", "ready all", "done", "lose",
                                                   "recompute", "leave", "join"]),
                                  st.integers(0, 50)), max_size=40))
def test_a_gang_is_never_partly_released(rollout, trainer, slots, tag, rat, sizes, plain,
                                         actions):
    """Random pools, gangs and plain work, tasks lost, recomputed and finished, workers
    leaving and joining, TAG and RAT lending: after every event no gang is partly
    released; each release puts every member on its own worker at once, never lent or
    stolen; and once every task is ready and every worker there, all of them finish."""
    p = policy_with(opts("digenrl", slots_per_worker=slots, tag=tag, rat=rat),
                    rollout=rollout, trainer=trainer)
    # ("both": a gang over the trainers and then the rollout workers, as a broadcast's.)
    gangs = [gang(g, size + 1, trainers=size) if pool == "both" else
             gang(g, size, kind=GRAD if pool == TRAINER else DENOISE)
             for g, (pool, size) in enumerate(sizes)]
    members = [m for g in gangs for m in g]
    others = grads(plain) + [info(("d", j), DENOISE, chunk=j, timestep=1) for j in range(plain)]
    tasks = members + others
    p.add_tasks(tasks)
    names = {f"r{j}": (f"rollout-{j}", ROLLOUT) for j in range(rollout)}
    names.update({f"t{j}": (f"trainer-{j}", TRAINER) for j in range(trainer)})

    def settle():
        out = p.decide()
        by_gang: dict[int, set] = {}
        on: dict[int, set] = {}
        for d in out:
            m = d.info
            if m.gang is not None:
                assert not (d.tag or d.rat or d.stolen)
                if m.kind == DENOISE:    # placed: any worker of its pool, one each
                    assert d.worker in {w.address for w in p.pool_workers(m.pool)}
                else:
                    assert d.worker == _member_worker(p, m)
                by_gang.setdefault(m.gang[0], set()).add(m.gang[1])
                on.setdefault(m.gang[0], set()).add(d.worker)
        for gid, released in by_gang.items():
            assert released == set(range(len(gangs[gid])))      # every member at once
            assert len(on[gid]) == len(gangs[gid])              # each on its own worker
        for key in p.take_withdrawn():
            p.task_lost(key)                                     # as Dask reports it
        for g in gangs:
            states = [m.state for m in g]
            if RELEASED in states:
                assert all(s is RELEASED or s is DONE for s in states), states
        return out

    for action, n in actions:
        if action == "ready":
            p.task_ready(tasks[n % len(tasks)].key, {})
        elif action == "ready all":
            for r in tasks:
                if r.state is not DONE:
                    p.task_ready(r.key, {})
        else:
            event(p, action, n, tasks, [r for r in tasks if r.state is DONE], names)
        settle()
    # Every worker back, every task ready: everything finishes (no gang waits forever).
    rejoin(p, names, names)
    for t in tasks:
        if t.state is not DONE:
            p.task_ready(t.key, {})
    for _ in range(4 * len(tasks) + 4):
        settle()
        running = [t for t in tasks if t.state is RELEASED]
        if not running:
            break
        for t in running:
            p.task_done(t.key, t.where, 1.0)
    fit = [m for g in gangs if len(p.pool_workers(g[0].pool)) >= len(g) for m in g]
    assert [t.key for t in others + fit if t.state is not DONE] == []
    assert not p.rule(Gang).reserved                     # nothing kept once all is done


def kept_off(p: SchedulingPolicy, task: TaskInfo, reason: str) -> bool:
    """``task``, added and ready, is released nowhere, and its trail says why."""
    p.add_tasks([task])
    p.task_ready(task.key)
    return p.decide() == [] and any(s.reason.startswith(reason) for s in steps(p, task.key))


def placed_gang_released():
    """A policy with two rollout workers of two slots each that released gang 9, a
    context-parallel step of two members: (policy, members, the decisions)."""
    p = policy_with(opts("digenrl", slots_per_worker=2), rollout=2, trainer=0)
    p.rule(Gang).handing = True
    members = gang(9, 2, kind=DENOISE)
    p.add_tasks(members)
    for m in members:
        p.task_ready(m.key)
    return p, members, p.decide()


def test_a_placed_gang_hands_over_its_workers_and_a_failed_step_runs_again_a_count_up():
    """A context-parallel step (a gang of denoise members): its release is noted with
    its members' workers for the plugin to hand over; lost mid-step, it is counted as
    retried (not as a failure a driver must act on), and its next release carries the
    count; while a member computes, its worker takes no other GPU task."""
    p, members, out = placed_gang_released()
    assert sorted(d.key for d in out) == sorted(m.key for m in members)
    formed, ended = p.rule(Gang).take_formations()
    workers = sorted(d.worker for d in out)
    assert [(gid, sorted(a), n) for gid, a, n in formed] == [(9, workers, 0)] and not ended
    # Beside a member, its worker's second slot takes no other GPU task.
    other = info(("d", 5), DENOISE, chunk=5, timestep=1)
    assert kept_off(p, other, "the worker computes its part of gang 9")
    # Lost mid-step: the other member is taken back, the step counted and run again.
    p.task_lost(members[0].key)
    assert p.take_withdrawn() == [members[1].key]
    assert p.rule(Gang).failed == [] and p.rule(Gang).retried == 1
    for m in members:
        p.task_ready(m.key)
    out = p.decide()
    assert sorted(d.key for d in out if d.info.gang) == sorted(m.key for m in members)
    formed, _ = p.rule(Gang).take_formations()
    assert [(gid, n) for gid, _, n in formed] == [(9, 1)]


def test_a_members_word_that_its_group_failed_runs_the_step_again_once():
    """A member whose group failed where nothing is lost (its rendezvous timed out)
    says so: every member is taken back and the step runs again, counted; the other
    member's word of the same release, and a word of an older release, change
    nothing. A release the adapter could not apply is no failed step: none ran."""
    p, members, out = placed_gang_released()
    p.release_failed([d.key for d in out])
    assert p.rule(Gang).retried == 0 and p.take_withdrawn() == []
    assert sorted(d.key for d in p.decide()) == sorted(m.key for m in members)
    p.task_done(members[1].key, members[1].where, 1.0)
    assert not p.rule(Gang).rerun(9, 1)                   # not this release's count
    assert p.rule(Gang).rerun(9, 0)
    assert sorted(p.take_withdrawn()) == sorted(m.key for m in members)
    assert p.rule(Gang).retried == 1 and p.rule(Gang).failed == []
    assert not p.rule(Gang).rerun(9, 0)                   # the other member's word
    for m in members:
        p.task_ready(m.key)
    assert sorted(d.key for d in p.decide()) == sorted(m.key for m in members)
    formed = p.rule(Gang).take_formations()[0]
    assert [(gid, n) for gid, _, n in formed] == [(9, 0), (9, 0), (9, 1)]


def test_a_chunks_workers_are_kept_for_its_next_step_while_its_step_ends():
    """A member of a chunk's context-parallel step is done while the other still runs:
    its worker takes no other chunk's step (nor a micro-step) but stays for the chunk's
    next step, which is released there once both are done; the chunk's last step keeps
    nothing."""
    p = policy_with(opts("digenrl", slots_per_worker=1), rollout=3, trainer=0)
    first = [info(("s", 0, m), DENOISE, chunk=0, timestep=0, gang=(20, m, 2)) for m in (0, 1)]
    second = [info(("s", 1, m), DENOISE, chunk=0, timestep=1, gang=(21, m, 2)) for m in (0, 1)]
    other = info(("d", 7), DENOISE, chunk=7, timestep=0)
    p.add_tasks(first + second + [other])
    for t in first + [other]:
        p.task_ready(t.key)
    workers = {d.key: d.worker for d in p.decide()}
    free = workers.pop(other.key)
    p.task_done(first[0].key, workers[first[0].key], 1.0)
    # Another chunk's step ready now: not on the kept worker, though it is idle.
    late = info(("d", 8), DENOISE, chunk=8, timestep=0)
    assert kept_off(p, late, "the worker is kept for gang 21")
    p.task_done(other.key, free, 1.0)
    assert [d.worker for d in p.decide()] == [free]
    p.task_done(first[1].key, workers[first[1].key], 1.0)
    for m in second:
        p.task_ready(m.key)
    p.task_done(late.key, free, 1.0)
    out = {d.key: d.worker for d in p.decide()}
    assert out == {second[0].key: workers[first[0].key], second[1].key: workers[first[1].key]}
    assert p.rule(Gang).kept_for == {}


def test_a_step_computed_again_keeps_no_worker_for_a_next_step_already_computed():
    """A chunk's two steps are done; the first one's result is lost and needed again (a
    micro-step still reads it), the second's is not. The first step runs again and
    keeps no worker for the second, which will not run again: another chunk's step
    takes both workers."""
    p = policy_with(opts("digenrl", slots_per_worker=1), rollout=2, trainer=0)
    first = [info(("s", 0, m), DENOISE, chunk=0, timestep=0, gang=(20, m, 2)) for m in (0, 1)]
    second = [info(("s", 1, m), DENOISE, chunk=0, timestep=1, gang=(21, m, 2)) for m in (0, 1)]
    p.add_tasks(first + second)
    for step in (first, second):
        for m in step:
            p.task_ready(m.key)
        for d in p.decide():
            p.task_done(d.key, d.worker, 1.0)
    p.task_ready(first[0].key)          # (lost with its worker; Dask computes it again)
    assert p.take_withdrawn() == [first[1].key]
    p.task_ready(first[1].key)
    again = p.decide()
    assert sorted(d.key for d in again) == sorted(m.key for m in first)
    for d in again:
        p.task_done(d.key, d.worker, 1.0)
    assert p.rule(Gang).kept_for == {}
    other = [info(("o", m), DENOISE, chunk=5, iteration=1, timestep=0, gang=(30, m, 2))
             for m in (0, 1)]
    p.add_tasks(other)
    for m in other:
        p.task_ready(m.key)
    assert sorted(d.worker for d in p.decide()) == ["r0", "r1"]


def test_chunks_whose_next_steps_keep_each_others_workers_go_on_oldest_first():
    """Three rollout workers, chunks of steps of three members; one worker leaves, and
    after ``context_parallel_wait`` each chunk's first step runs at degree 1 on a worker
    of its own, which it keeps for its next step. The worker back, each next step needs
    all three workers, one of them kept for the other chunk: the older chunk's goes
    first, then the other's."""
    clock = Clock()
    p = policy_with(opts("digenrl", slots_per_worker=1, context_parallel_wait=10.0),
                    rollout=3, trainer=0, clock=clock)
    steps_of = [[[info(("s", c, t, m), DENOISE, chunk=c, timestep=t,
                       gang=(10 * c + t, m, 3)) for m in range(3)] for t in range(2)]
                for c in range(2)]
    p.add_tasks([m for chunk in steps_of for step in chunk for m in step])
    p.remove_worker("r0")
    for c in range(2):
        for m in steps_of[c][0]:
            p.task_ready(m.key)
    assert p.decide() == []
    clock.now = 10.0
    first_steps = steps_of[0][0] + steps_of[1][0]
    for _ in range(6):           # (each member runs after its leader, one at a time)
        p.decide()
        for m in first_steps:
            if m.state is RELEASED:
                p.task_done(m.key, m.where, 1.0)
    assert all(m.state is DONE for m in first_steps)
    assert sorted(p.rule(Gang).kept_for.values()) == [(1, 0, 0), (11, 0, 1)]
    p.add_worker("r0", "rollout-0", ROLLOUT, 1)
    for c in range(2):
        for m in steps_of[c][1]:
            p.task_ready(m.key)
    assert sorted(d.key for d in p.decide()) == sorted(m.key for m in steps_of[0][1])
    for m in steps_of[0][1]:
        p.task_done(m.key, m.where, 1.0)
    assert sorted(d.key for d in p.decide()) == sorted(m.key for m in steps_of[1][1])


def test_a_placed_gang_short_of_workers_waits_then_runs_at_a_lower_degree():
    """A chunk's step of 4 members with 2 rollout workers left: it waits
    ``context_parallel_wait`` seconds for the pool to grow back (the policy's deadline
    says when), then runs at degree 2: members 0 and 1 on the two workers, together;
    members 2 and 3 each after its leader (member ``i % 2``) on its worker. The next step
    finds the pool whole again and runs at degree 4."""
    now = [0.0]
    p = policy_with(opts("digenrl", slots_per_worker=1, context_parallel_wait=30.0),
                    rollout=4, trainer=0, clock=lambda: now[0])
    p.rule(Gang).handing = True
    first = [info(("s", 0, m), DENOISE, chunk=0, timestep=0, gang=(30, m, 4)) for m in range(4)]
    second = [info(("s", 1, m), DENOISE, chunk=0, timestep=1, gang=(31, m, 4))
              for m in range(4)]
    p.add_tasks(first + second)
    p.remove_worker("r3")
    p.remove_worker("r2")
    for m in first:
        p.task_ready(m.key)
    assert p.decide() == [] and p.deadline() == 30.0
    assert any(s.reason == "gang 30 needs 4 workers of its pool: 2 serve it"
               for s in steps(p, first[0].key))
    now[0] = 29.9
    assert p.decide() == []
    now[0] = 30.0
    out = {d.key: d.worker for d in p.decide()}
    assert out == {first[0].key: "r0", first[1].key: "r1"} and p.deadline() is None
    formed, _ = p.rule(Gang).take_formations()
    assert formed == [(30, ["r0", "r1", "r0", "r1"], 0)] and p.rule(Gang).lowered == 1
    assert any("runs at degree 2 on the 2 workers it has" in s.reason
               for s in steps(p, first[0].key))
    p.task_done(first[1].key, "r1", 1.0)
    assert {d.key: d.worker for d in p.decide()} == {first[3].key: "r1"}
    p.task_done(first[0].key, "r0", 1.0)
    assert {d.key: d.worker for d in p.decide()} == {first[2].key: "r0"}
    p.task_done(first[2].key, "r0", 0.0)
    p.task_done(first[3].key, "r1", 0.0)
    p.add_worker("r2", "rollout-2", ROLLOUT, 1)
    p.add_worker("r3", "rollout-3", ROLLOUT, 1)
    for m in second:
        p.task_ready(m.key)
    out = {d.key: d.worker for d in p.decide()}
    assert sorted(out) == sorted(m.key for m in second)
    assert out[second[0].key] == "r0" and out[second[1].key] == "r1"
    assert sorted(out.values()) == ["r0", "r1", "r2", "r3"]


def test_a_lower_degrees_follower_lost_with_its_leaders_worker_runs_the_step_again():
    """Its leader done, a follower waits to run on the leader's worker; that worker
    leaves: the step fails and, with every member ready again, runs again whole."""
    p = policy_with(opts("digenrl", slots_per_worker=1, context_parallel_wait=0.0),
                    rollout=2, trainer=0)
    members = [info(("s", 0, m), DENOISE, chunk=0, timestep=0, gang=(40, m, 4))
               for m in range(4)]
    p.add_tasks(members)
    p.remove_worker("r1")
    for m in members:
        p.task_ready(m.key)
    assert {d.key: d.worker for d in p.decide()} == {members[0].key: "r0"}
    # Degree 1: the three others run after member 0 on its worker, which leaves first.
    p.task_done(members[0].key, "r0", 1.0)
    p.remove_worker("r0")
    assert p.take_withdrawn() == [members[0].key]
    assert p.rule(Gang).retried == 1 and p.decide() == []
    p.add_worker("r2", "rollout-2", ROLLOUT, 1)
    p.task_ready(members[0].key)
    assert {d.key: d.worker for d in p.decide()} == {members[0].key: "r2"}
    p.task_done(members[0].key, "r2", 1.0)
    assert sorted(d.key for d in p.decide()) == sorted(m.key for m in members[1:])


def test_a_follower_forgotten_before_its_turn_is_never_released():
    """A run given up (its tasks forgotten) between a leader's end and its follower's
    turn: the follower is not released."""
    p = policy_with(opts("digenrl", slots_per_worker=1, context_parallel_wait=0.0),
                    rollout=1, trainer=0)
    members = [info(("s", 0, m), DENOISE, chunk=0, timestep=0, gang=(50, m, 2))
               for m in range(2)]
    p.add_tasks(members)
    for m in members:
        p.task_ready(m.key)
    assert [d.key for d in p.decide()] == [members[0].key]
    p.task_done(members[0].key, "r0", 1.0)
    p.task_forgotten(members[1].key)
    assert p.decide() == []


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rollout=st.integers(1, 5), size=st.integers(1, 4), chunks=st.integers(1, 3),
       length=st.integers(2, 3), plain=st.integers(0, 2),
       actions=st.lists(st.tuples(st.sampled_from(["done", "lose", "recompute", "leave",
                                                   "join", "wait", "refuse", "rerun"]),
                                  st.integers(0, 50)), max_size=40))
def test_chunks_computed_with_context_parallelism_always_finish(rollout, size, chunks,
                                                                length, plain, actions):
    """Chunks of ``length`` context-parallel steps (a placed gang of ``size`` members
    each; a step is ready once its chunk's previous step is done) beside plain steps;
    steps lost while they run, results lost and computed again (a micro-step still reads
    them; the steps after them keep theirs), workers leaving and joining, the pool short
    for longer than ``context_parallel_wait``, a round's releases refused by the adapter,
    a member's word that its group failed: once every worker is back, every step
    finishes, and no worker stays kept or reserved."""
    clock = Clock()
    p = policy_with(opts("digenrl", slots_per_worker=1, context_parallel_wait=10.0),
                    rollout=rollout, trainer=0, clock=clock)
    steps_of = [[[info(("s", c, t, m), DENOISE, chunk=c, timestep=t,
                       gang=(100 * c + t, m, size)) for m in range(size)]
                 for t in range(length)] for c in range(chunks)]
    others = [info(("d", j), DENOISE, chunk=10 + j, timestep=0) for j in range(plain)]
    tasks = [m for chunk in steps_of for step in chunk for m in step] + others
    p.add_tasks(tasks)
    names = {f"r{j}": (f"rollout-{j}", ROLLOUT) for j in range(rollout)}

    def inputs_held(t: TaskInfo) -> bool:
        return t.gang is None or t.timestep == 0 or all(
            m.state is DONE for m in steps_of[t.chunk][t.timestep - 1])

    refuse = [False]

    def settle():
        """Dask's part: what the policy took back waits again; then every task whose
        inputs are held and that waits is ready; the policy's releases are sent (or,
        once, refused)."""
        for key in p.take_withdrawn():
            p.task_lost(key)
        for t in tasks:
            if t.state == "added" and inputs_held(t):
                p.task_ready(t.key, {})
        out = p.decide()
        if refuse[0]:
            p.release_failed([d.key for d in out])
            refuse[0] = False

    settle()
    gang_rule = p.rule(Gang)
    for action, n in actions:
        running = [t for t in tasks if t.state is RELEASED and t.gang is not None]
        if action == "wait":
            clock.now += 6.0
        elif action == "refuse":
            refuse[0] = True
        elif action == "rerun" and running:
            gid = running[n % len(running)].gang[0]
            gang_rule.rerun(gid, gang_rule.gangs[gid].released_after)
        else:
            event(p, action, n, tasks,
                  [t for t in tasks if t.state is DONE and inputs_held(t)], names)
        settle()
    rejoin(p, names, names)
    for _ in range(4 * len(tasks) + 4):
        settle()
        running = [t for t in tasks if t.state is RELEASED]
        if not running and all(t.state is DONE for t in tasks):
            break
        for t in running:
            p.task_done(t.key, t.where, 1.0)
        clock.now += 6.0
    if size <= rollout:
        assert [t.key for t in tasks if t.state is not DONE] == []
    assert p.rule(Gang).kept_for == {} and p.rule(Gang).reserved == {}
