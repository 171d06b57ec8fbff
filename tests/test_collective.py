"""Collective groups among Dask workers (digenrl.tasks.collective) on a real local
cluster: the two trainer workers of ``cluster_2x2`` join torch.distributed groups (gloo)
from inside tasks pinned to them, meeting through the scheduler."""

from __future__ import annotations

import time
import uuid

import pytest
import torch
import torch.distributed as dist
from distributed import wait

from digenrl.config import ConfigError
from digenrl.run.cluster import pool_counts
from digenrl.tasks import collective
from digenrl.vocabulary import TRAINER

#: Long enough for two processes of a loaded machine to meet; the failure tests use SHORT.
TIMEOUT = 60.0
SHORT = 3.0
#: How long a test waits for a task that must end by itself within SHORT.
BOUND = 60.0


# ------------------------------------------------------------------ tasks (on workers)


def _join_and_sum(name, members, generation, timeout, subgroups=None):
    g = collective.join(name, members, generation, backend="auto", timeout=timeout,
                        subgroups=subgroups)
    t = torch.tensor([float(g.rank + 1)])
    dist.all_reduce(t, group=g.process_group)
    return g.rank, g.formation, g.backend, t.item()


def _sum_again(name, generation):
    g = collective.group(name, generation)
    t = torch.tensor([float(10 * (g.rank + 1))])
    dist.all_reduce(t, group=g.process_group)
    return g.rank, g.formation, g.uses, t.item()


def _sum_on_subgroup(name, generation, sub):
    g = collective.group(name, generation)
    t = torch.tensor([float(g.rank + 1)])
    dist.all_reduce(t, group=g.subgroup(sub))
    return t.item()


def _join(name, members, generation, timeout, backend="auto"):
    collective.join(name, members, generation, backend=backend, timeout=timeout)


def _join_while_wanted(name, members, generation, timeout, flag):
    """Join, giving up once the scheduler's metadata ``flag`` says the generation is
    no longer wanted (as a context-parallel member does once its gang is placed anew)."""
    from distributed import get_client

    def stale() -> bool:
        return bool(get_client().get_metadata([flag], default=False))

    collective.join(name, members, generation, backend="auto", timeout=timeout, stale=stale)


def _leave():
    return collective.leave()


# ---------------------------------------------------------------------------- helpers


@pytest.fixture
def trainers(cluster_2x2):
    """(client, the trainer workers' names in their pool's order, name -> address);
    every group the test formed is left afterwards."""
    client = cluster_2x2.client
    names = sorted(pool_counts(client)[TRAINER])
    workers = client.scheduler_info(n_workers=-1)["workers"]
    addresses = {str(w["name"]): a for a, w in workers.items()}
    yield client, names, addresses
    if client.status == "running":     # (else the cluster and its groups are gone)
        on_each(client, addresses, names, _leave)


def on_each(client, addresses, names, fn, *args):
    """``fn(*args)`` in a task on each named worker, and there only."""
    futures = [client.submit(fn, *args, workers=[addresses[n]], allow_other_workers=False,
                             pure=False) for n in names]
    return client.gather(futures)


def failure(future) -> BaseException:
    """The exception of a task that must fail by itself (waited for, within BOUND)."""
    wait([future], timeout=BOUND)
    assert future.status == "error", future.status
    return future.exception()


def group_name() -> str:
    return f"test-{uuid.uuid4().hex[:8]}"


# ------------------------------------------------------------------------------ tests


def test_members_form_a_group_that_later_tasks_reuse(trainers):
    """Both trainers join generation 1, all-reduce, and a second task on each uses the
    same group: the same formation, no second rendezvous; a join again forms anew."""
    client, members, addresses = trainers
    name = group_name()
    first = on_each(client, addresses, members, _join_and_sum, name, members, 1, TIMEOUT)
    assert [r[0] for r in first] == [0, 1]
    assert [r[3] for r in first] == [3.0, 3.0]          # 1 + 2 on both ranks
    assert {r[2] for r in first} == {"gloo"}            # CPU workers
    formation = first[0][1]
    assert first[1][1] == formation
    again = on_each(client, addresses, members, _sum_again, name, 1)
    assert again == [(0, formation, 1, 30.0), (1, formation, 1, 30.0)]
    # Joining the same generation again is a new formation, on a new store: the second
    # member never takes the first formation's address, still published when it arrives.
    rejoined = on_each(client, addresses, members, _join_and_sum, name, members, 1, TIMEOUT)
    assert [r[3] for r in rejoined] == [3.0, 3.0]
    assert rejoined[0][1] == rejoined[1][1] != formation


def test_a_member_that_never_arrives_fails_the_join_within_the_timeout(trainers):
    """Rank 0 waiting for a member that never announces itself, and a member waiting for
    a rank 0 that never publishes its store, each give up after the timeout."""
    client, members, addresses = trainers
    alone_first = client.submit(_join, group_name(), members, 1, SHORT,
                                workers=[addresses[members[0]]], allow_other_workers=False)
    alone_second = client.submit(_join, group_name(), members, 1, SHORT,
                                 workers=[addresses[members[1]]], allow_other_workers=False)
    e = failure(alone_first)
    assert isinstance(e, collective.RendezvousTimeout), repr(e)
    assert f"members [{members[1]!r}] did not arrive" in str(e)
    e = failure(alone_second)
    assert isinstance(e, collective.RendezvousTimeout), repr(e)
    assert f"rank 0 ({members[0]!r}) published no store" in str(e)


def test_a_collective_fails_within_the_timeout_when_a_member_is_missing(trainers):
    """A formed group whose second member never takes part: the first member's
    all-reduce raises once the group's timeout passes instead of hanging."""
    client, members, addresses = trainers
    name = group_name()
    on_each(client, addresses, members, _join_and_sum, name, members, 1, SHORT)
    lone = client.submit(_sum_again, name, 1, workers=[addresses[members[0]]],
                         allow_other_workers=False, pure=False)
    e = failure(lone)
    # gloo's own error: "Timed out waiting 3000ms for recv operation to complete"
    assert isinstance(e, RuntimeError) and f"{SHORT * 1000:.0f}ms" in str(e), repr(e)


def test_a_newer_generation_rebuilds_the_group_and_the_older_one_is_refused(trainers):
    """Generation 2 with the same members is a new formation that works (with a declared
    subgroup), and a task of generation 1 afterwards raises StaleGeneration; a group of
    another name cannot be joined beside it."""
    client, members, addresses = trainers
    name = group_name()
    first = on_each(client, addresses, members, _join_and_sum, name, members, 1, TIMEOUT)
    second = on_each(client, addresses, members, _join_and_sum, name, members, 2, TIMEOUT,
                     {"second": [members[1]]})
    assert [r[3] for r in second] == [3.0, 3.0]
    assert second[0][1] == second[1][1] != first[0][1]
    # The subgroup holds the second member only: its all-reduce sums rank 1's value alone.
    assert on_each(client, addresses, members[1:], _sum_on_subgroup, name, 2, "second") \
        == [2.0]
    with pytest.raises(collective.CollectiveError, match="not a member of subgroup"):
        on_each(client, addresses, members[:1], _sum_on_subgroup, name, 2, "second")
    stale = client.submit(_sum_again, name, 1, workers=[addresses[members[0]]],
                          allow_other_workers=False, pure=False)
    with pytest.raises(collective.StaleGeneration, match="generation 1 cannot run on the "
                                                         "live generation 2"):
        stale.result(timeout=BOUND)
    with pytest.raises(collective.StaleGeneration):
        on_each(client, addresses, members[:1], _join, name, members, 1, TIMEOUT)
    # Another group beside it is refused at once: one default process group per process.
    with pytest.raises(collective.CollectiveError, match="in one collective group at a time"):
        on_each(client, addresses, members[:1], _join, group_name(), members, 1, TIMEOUT)
    # The live group is unharmed by the refused tasks.
    assert on_each(client, addresses, members, _sum_again, name, 2) == [
        (0, second[0][1], 2, 30.0), (1, second[0][1], 2, 30.0)]


def test_a_backend_the_worker_cannot_run_is_refused_before_any_rendezvous(trainers):
    """NCCL on a worker whose torch sees no CUDA device: one line naming the field,
    at once (no wait for the other member)."""
    client, members, addresses = trainers
    if torch.cuda.is_available():
        pytest.skip("this machine's torch sees a CUDA device")
    with pytest.raises(ConfigError, match=r"^cluster\.collective_backend: expected a "
                                          r"backend the workers can run"):
        on_each(client, addresses, members[:1], _join, group_name(), members, 1, TIMEOUT,
                "nccl")


def test_a_group_is_joined_from_inside_a_task():
    with pytest.raises(collective.CollectiveError, match="from inside a Dask task"):
        collective.join("trainer", ["trainer-0"], 1, backend="gloo", timeout=1.0)


def _executing(dask_worker) -> int:
    return len(dask_worker.state.executing)


def test_a_member_waiting_for_its_peers_ends_once_its_task_is_taken_back(trainers):
    """A member at the rendezvous whose peers never come, its timeout far off: once the
    scheduler takes its task back (cancelled: a peer's worker lost, the step placed
    anew), it stops waiting at once (:class:`collective.TakenBack`), which frees its
    worker's thread for the step run again, rather than holding it until the timeout."""
    client, members, addresses = trainers
    address = addresses[members[0]]
    waiting = client.submit(_join, group_name(), members, 1, 600.0, workers=[address],
                            allow_other_workers=False, pure=False)
    collective.poll(lambda: client.run(_executing, workers=[address])[address] or None,
                    time.monotonic() + BOUND, lambda: "the member never started")
    waiting.cancel()
    collective.poll(lambda: client.run(_executing, workers=[address])[address] == 0 or None,
                    time.monotonic() + BOUND,
                    lambda: "the member still waits after its task was taken back")


def test_a_member_stops_waiting_once_its_generation_is_no_longer_wanted(trainers):
    """A member at the rendezvous whose peer forms another generation (its gang placed
    anew meanwhile), its timeout far off: once the caller's ``stale`` says so, it stops
    waiting (:class:`collective.TakenBack`) instead of waiting for a peer that never
    comes."""
    client, members, addresses = trainers
    flag = f"stale-{group_name()}"
    waiting = client.submit(_join_while_wanted, group_name(), members, 1, 600.0, flag,
                            workers=[addresses[members[0]]], allow_other_workers=False,
                            pure=False)
    address = addresses[members[0]]
    collective.poll(lambda: client.run(_executing, workers=[address])[address] or None,
                    time.monotonic() + BOUND, lambda: "the member never started")
    client.set_metadata([flag], True)
    with pytest.raises(collective.TakenBack, match="no longer wants it"):
        waiting.result(timeout=BOUND)


def test_rank_0_answers_a_member_that_announced_itself_again(trainers):
    """A member's announcement given up (its task taken back and sent again while rank 0
    waited, as when the scheduler fails a step and releases it anew) is still on the
    scheduler when rank 0 reads it; the member's new announcement is answered anew, with
    the same store, and the group forms within the bound, its timeout far off."""
    client, members, addresses = trainers
    name = group_name()
    key = [collective.METADATA, name, "1"]
    client.set_metadata(key + ["arrived", members[1]], "a-token-given-up")
    first = client.submit(_join_and_sum, name, members, 1, 600.0,
                          workers=[addresses[members[0]]], allow_other_workers=False,
                          pure=False)
    published = collective.poll(
        lambda: client.get_metadata(key + ["store"], default=None),
        time.monotonic() + BOUND, lambda: "rank 0 published no store")
    assert published["tokens"][members[1]] == "a-token-given-up"
    second = client.submit(_join_and_sum, name, members, 1, 600.0,
                           workers=[addresses[members[1]]], allow_other_workers=False,
                           pure=False)
    results = [f.result(timeout=BOUND) for f in (first, second)]  # (not the 600 s timeout)
    assert [r[3] for r in results] == [3.0, 3.0]
    assert results[0][1] == results[1][1] == published["formation"]
