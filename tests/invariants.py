"""The scheduling rules, checked on the task records of a finished run.

Each record is one completed task as the scheduler plugin saw it (the store's ``tasks``
group): its kind, the worker and pool that ran it, its iteration and policy version,
whether it was a TAG or RAT release, and on the scheduler's clock when it became ready, when it
was released to its worker and when it finished. The checks hold for any timing, so the
same functions serve the runs of real models, the runs whose workers were killed, and
emulated runs with injected slowdowns.
"""

from __future__ import annotations

import pandas as pd

from digenrl.schedulers.options import ScheduleOptions
from digenrl.vocabulary import (COLOCATED, DENOISE, ENCODE, GRAD, PUBLISH, ROLLOUT,
                                ROLLOUT_KINDS, TRAINER, TRAINING_KINDS)


def assert_pool_rules(t: pd.DataFrame, options: ScheduleOptions) -> None:
    """Training on trainers, except grads lent to rollout workers (RAT); rollout work on
    a trainer only as a TAG release, and TAG only with TAG on, only on trainers, only
    for rollout kinds, only while no grad task was runnable on that trainer (any grad
    with TSP; without it, the grads of the chunks mapped to it) and only to a trainer
    with no GPU task in flight. RAT only with RAT (and TSP) on, only grads, only on
    rollout workers, and only to a worker with no GPU task in flight unless ahead of
    work that can wait for the version change: a decode (or GPU reward) ready and not
    yet released then, whose generation had released every denoise step."""
    rat = t[t.rat] if "rat" in t else t.iloc[:0]
    if not options.pools:
        assert t.pool.eq(COLOCATED).all(), sorted(set(t.pool))
        assert not t.tag.any() and rat.empty
        return
    on_rollout = t[t.kind.isin(TRAINING_KINDS) & t.pool.eq(ROLLOUT)]
    assert on_rollout.index.isin(rat.index).all(), on_rollout.key.tolist()
    if not (options.rat and options.tsp):
        assert rat.empty, rat.key.tolist()
    assert rat.kind.eq(GRAD).all() and rat.pool.eq(ROLLOUT).all(), rat.key.tolist()
    gpu = t[t.gpu]
    steps = gpu[(gpu.kind == DENOISE) & (gpu.pool == ROLLOUT)]
    steps_out = steps.groupby("iteration").released.max()
    finishing = gpu[gpu.kind.isin(ROLLOUT_KINDS - {DENOISE, ENCODE})]
    for row in rat.itertuples():
        r = row.released
        busy = gpu[(gpu.worker == row.worker) & (gpu.released < r) & (gpu.finished > r)]
        if busy.empty:
            continue
        waits = finishing[(finishing.ready <= r) & (finishing.released >= r)]
        waits = waits[waits.iteration.map(steps_out).le(r)]
        assert not waits.empty, (row.key, busy.key.tolist())
    on_trainers = t[t.kind.isin(ROLLOUT_KINDS) & t.pool.eq(TRAINER)]
    assert on_trainers.tag.all(), on_trainers[~on_trainers.tag].key.tolist()
    tag = t[t.tag]
    if not options.tag:
        assert tag.empty and on_trainers.empty, tag.key.tolist()
        return
    assert tag.pool.eq(TRAINER).all() and set(tag.kind) <= ROLLOUT_KINDS
    grads = t[t.kind == GRAD]
    if not options.tsp:
        # Without TSP a chunk's micro-steps run only on the trainer it maps to (by name),
        # so only those are runnable on that trainer.
        trainers = sorted(set(t.worker_name[t.pool == TRAINER]))
        grads = grads.assign(runs_on=[trainers[c % len(trainers)] for c in grads.chunk])
    for row in tag.itertuples():
        r = row.released
        waiting = grads[(grads.ready <= r) & (grads.released > r)]
        if not options.tsp:
            waiting = waiting[waiting.runs_on == row.worker_name]
        assert waiting.empty, (row.key, waiting.key.tolist())
        if row.gpu:
            busy = gpu[(gpu.worker == row.worker) & (gpu.released < r) & (gpu.finished > r)]
            assert busy.empty, (row.key, busy.key.tolist())


def assert_staleness_bound(t: pd.DataFrame, options: ScheduleOptions) -> None:
    """No chunk is trained more than ``max_staleness`` versions after the version that
    generated it, and no rollout task of iteration i is released before version
    i - max_staleness is published."""
    k = options.max_staleness
    rollout = t[t.kind.isin(ROLLOUT_KINDS)]
    grads = t[t.kind == GRAD]
    behaviour = rollout.groupby(["iteration", "chunk"]).policy_version.agg(["min", "max"])
    assert (behaviour["min"] == behaviour["max"]).all(), "a chunk generated with two versions"
    trained = grads.groupby(["iteration", "chunk"]).policy_version.agg(["min", "max"])
    assert (trained["min"] == trained["max"]).all(), "a chunk trained at two versions"
    staleness = (trained["max"] - behaviour["max"]).dropna()
    assert len(staleness) == len(trained), "a trained chunk without its rollout records"
    assert ((staleness >= 0) & (staleness <= k)).all(), staleness[staleness > k].to_dict()
    published = t[t.kind == PUBLISH].groupby("policy_version").finished.min()
    for row in rollout.itertuples():
        need = row.iteration - k
        if need < 0:
            continue  # nothing to wait for: version 0 is enough for iterations 0..k
        assert need in published.index, (row.key, need)
        assert row.released >= published[need], (row.key, row.released, published[need])


def assert_slots(t: pd.DataFrame, options: ScheduleOptions) -> None:
    """At no moment does a worker hold more released, unfinished GPU tasks than its
    slots (``slots_per_worker`` per GPU; every worker here has one GPU)."""
    gpu = t[t.gpu]
    for worker, rows in gpu.groupby("worker"):
        events = sorted([(f, 0) for f in rows.finished] + [(r, 1) for r in rows.released])
        inflight = peak = 0
        for _, release in events:  # finishes before releases at the same instant
            inflight += 1 if release else -1
            peak = max(peak, inflight)
        assert peak <= options.slots_per_worker, (worker, peak)


def assert_schedule_invariants(t: pd.DataFrame, options: ScheduleOptions) -> None:
    """Every rule above: pools, TAG and RAT, the staleness bound, the GPU slots."""
    assert_pool_rules(t, options)
    assert_staleness_bound(t, options)
    assert_slots(t, options)
