"""The simulator: the plugin's policy on simulated clusters (deterministic figures)."""

import pytest

from digenrl.commands.cli import main
from digenrl.schedulers.options import MODES, ScheduleOptions
from digenrl.sim.profile import load_profile
from digenrl.sim.simulate import simulate


def opts(mode, **kw):
    return ScheduleOptions(mode=mode, **{**MODES[mode], **kw})


@pytest.fixture(scope="module")
def flux():
    return load_profile("flux12b-16gpu")


def test_simulated_throughput_never_beats_the_ideal_bound(flux):
    for mode in MODES:
        r = simulate(flux, opts(mode), 5)
        assert 0 < r.ideal_fraction <= 1.0
        assert r.tasks == len(r.result.records)


def test_digenrl_overlaps_what_the_synchronous_designs_serialise(flux):
    dis = simulate(flux, opts("disaggregated"), 6)
    dig = simulate(flux, opts("digenrl"), 6)
    # Rollout and training are balanced in this profile: the synchronous design leaves
    # each pool idle half the time, DigenRL keeps both busy.
    assert dis.ideal_fraction < 0.55 and dig.ideal_fraction > 0.9
    assert dig.images_per_s > 1.8 * dis.images_per_s
    assert dig.utilisation["rollout"] > 0.9 and dig.utilisation["trainer"] > 0.9


def test_weight_sync_is_paid_once_per_version_per_rollout_worker(flux):
    r = simulate(flux, opts("digenrl", rat=False), 4)
    # Versions 0..3 are read by rollouts of iterations 0..3 (with one-step staleness,
    # versions 0, 0, 1, 2): at most 3 distinct versions reach each of 5 rollout workers,
    # plus any a trainer reads while generating (trainers hold every version).
    assert r.weight_sync_s <= 3 * 5 * flux.weight_sync_seconds() + 1e-9
    assert r.weight_sync_s >= 2 * 5 * flux.weight_sync_seconds() - 1e-9
    # A micro-step lent to a rollout worker reads the version it trains against (that of
    # its iteration, 0..3): at most one more version per rollout worker.
    lent = simulate(flux, opts("digenrl"), 4)
    assert lent.weight_sync_s <= 4 * 5 * flux.weight_sync_seconds() + 1e-9
    assert simulate(flux, opts("colocated"), 4).weight_sync_s == 0


def test_a_straggler_slows_its_pool(flux):
    base = simulate(flux, opts("digenrl"), 4)
    slow = simulate(flux, opts("digenrl"), 4,
                    slowdown=lambda worker, now: 5.0 if worker == "trainer-0" else 1.0)
    assert slow.images_per_s < base.images_per_s


def test_the_simulation_is_deterministic(flux):
    a = simulate(flux, opts("digenrl"), 4)
    b = simulate(flux, opts("digenrl"), 4)
    assert a.images_per_s == b.images_per_s
    assert [(r.key, r.worker, r.start) for r in a.result.records] == \
           [(r.key, r.worker, r.start) for r in b.result.records]


def test_the_simulation_does_not_depend_on_hash_randomisation(tmp_path):
    """Ties between equally urgent tasks are broken by arrival, not by set order, so
    two interpreters with different string hashes make the same decisions."""
    import os
    import subprocess
    import sys

    code = ("from digenrl.sim.profile import load_profile\n"
            "from digenrl.sim.simulate import simulate\n"
            "from digenrl.schedulers.options import MODES, ScheduleOptions\n"
            "o = ScheduleOptions(mode='disaggregated', **MODES['disaggregated'])\n"
            "r = simulate(load_profile('flux12b-16gpu'), o, 3)\n"
            "print(hash('digenrl'), [(x.key, x.worker, x.start) for x in r.result.records])\n")
    outs = []
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                             text=True, check=True).stdout
        outs.append(out.split(" ", 1))
    assert outs[0][0] != outs[1][0], "the two interpreters should hash strings differently"
    assert outs[0][1] == outs[1][1]


def test_queued_hand_over_costs_throughput(flux):
    base = simulate(flux, opts("digenrl"), 4)
    slower = simulate(flux, opts("digenrl"), 4, queued_latency=0.1)
    assert slower.images_per_s < base.images_per_s
    # A task queued on its worker starts queued_latency after the GPU frees.
    by_worker = {}
    for r in sorted(slower.result.records, key=lambda r: r.start):
        if r.gpu:
            by_worker.setdefault(r.worker, []).append(r)
    back_to_back = [b.start - a.stop for rs in by_worker.values() for a, b in zip(rs, rs[1:])
                    if b.released < a.stop]
    assert back_to_back and min(back_to_back) >= 0.1 - 1e-9


def test_finished_iterations_are_forgotten_but_their_state_is_kept(flux):
    from digenrl.sim.engine import Simulator
    from digenrl.sim.simulate import _workers

    o = opts("digenrl")
    sim = Simulator(o, _workers(flux), lambda info, w: 1.0 if info.gpu else 0.0)
    result = sim.run(flux.layout(o.max_staleness), flux.plans(4))
    assert len(result.records) == sim.added
    # Only the optimizer state and the published weights of finished iterations remain
    # (and whatever the last iterations still hold); the policy forgot the rest.
    old = [k for k in sim.tasks if isinstance(k, tuple) and len(k) > 1 and k[1] == 0]
    assert sorted(old, key=repr) == [("optimize", 0), ("publish", 0)]
    assert ("publish", 1) in sim.tasks
    assert not any(k[0] == "denoise" and k[1] < 3 for k in sim.policy.tasks)


def test_busy_time_is_the_records_gpu_time_clipped_to_the_window(flux):
    r = simulate(flux, opts("digenrl"), 4).result
    t0, t1 = r.completed[0], r.completed[2]
    expected: dict = {}
    for rec in r.records:
        if rec.gpu:
            span = min(rec.stop, t1) - max(rec.start, t0)
            if span > 0:
                expected[rec.worker] = expected.get(rec.worker, 0.0) + span
    busy = r.busy(t0, t1)
    assert busy.keys() == expected.keys() and len(busy) > 1
    assert all(busy[w] == pytest.approx(expected[w], abs=1e-9) for w in busy)


def test_a_finished_simulation_is_freed_by_reference_counting(flux):
    """Nothing a run makes refers back to the simulator and finished tasks hold no links
    to one another, so a run's millions of objects go when the result is dropped, not
    at some later pass of the cyclic collector."""
    import gc
    import weakref

    from digenrl.sim.engine import Simulator, _Task, collector_off
    from digenrl.sim.simulate import _workers

    def tasks_alive():
        return sum(type(o) is _Task for o in gc.get_objects())

    o = opts("digenrl")
    with collector_off():
        before = tasks_alive()
        sim = Simulator(o, _workers(flux), lambda info, w: 1.0 if info.gpu else 0.0)
        result = sim.run(flux.layout(o.max_staleness), flux.plans(4))
        assert len(result.records) == sim.added
        assert tasks_alive() >= before + sim.added
        gone = weakref.ref(sim)
        del sim, result
        assert gone() is None
        assert tasks_alive() <= before


def test_rollout_assisted_training_recovers_a_split_too_large_for_rollout(flux):
    wrong = flux.with_pools(11, 5)
    assert (wrong.rollout_workers, wrong.trainer_workers, wrong.gpus) == (11, 5, 16)
    on = simulate(wrong, opts("digenrl"), 4)
    off = simulate(wrong, opts("digenrl", rat=False), 4)
    assert on.ideal_fraction > off.ideal_fraction + 0.2, (on.ideal_fraction, off.ideal_fraction)
    lent = [r for r in on.result.records if r.rat]
    assert lent and {r.kind for r in lent} == {"grad"} and {r.pool for r in lent} == {"rollout"}
    assert not any(r.rat for r in off.result.records)


def test_split_advice_is_the_split_that_balances_the_pools():
    from digenrl.figures.analysis import SplitAdvice

    advice = SplitAdvice.of(3.0, 1.0, (8, 8))
    assert advice.best == (12, 4)
    assert SplitAdvice.bound(3.0, 1.0, (8, 8)) == pytest.approx(0.25 / 0.375)
    assert SplitAdvice.bound(3.0, 1.0, (12, 4)) == pytest.approx(1.0)
    assert "12 + 4" in advice.text()


def test_simulate_over_splits(capsys):
    assert main(["simulate", "flux12b-16gpu", "--iterations", "3", "--splits", "11:5,3:13",
                 "--variants", "digenrl-no-rat"]) == 0
    out = capsys.readouterr().out
    assert "11 rollout + 5 trainer" in out and "3 rollout + 13 trainer" in out
    assert "best split for digenrl-no-rat: 3 rollout + 13 trainer" in out


def test_simulate_command(capsys):
    assert main(["simulate", "flux12b-16gpu", "--gpus", "64", "--iterations", "3",
                 "--variants", "disaggregated,digenrl"]) == 0
    out = capsys.readouterr().out
    assert "digenrl" in out and "64" in out


def test_simulate_compares_context_parallel_degrees(capsys):
    assert main(["simulate", "wan14b-32gpu", "--gpus", "16", "--iterations", "3",
                 "--variants", "digenrl", "--context-parallel", "1,2"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()
            if line.startswith("digenrl")]
    assert [r[1] for r in rows] == ["1", "2"] and [r[-1] for r in rows] == ["32x1", "32x2"]


@pytest.mark.parametrize("argv,message", [
    (["simulate", "nope"], "profile: expected a YAML file or one of"),
    (["simulate", "flux12b-16gpu", "--variants", "fast"], "--variants: expected names from"),
    (["simulate", "flux12b-16gpu", "--gpus", "1"], "--gpus: expected at least 2, got 1"),
    (["simulate", "flux12b-16gpu", "--splits", "11-5"],
     "--splits: expected ROLLOUT:TRAINER pairs of positive integers"),
    (["simulate", "wan14b-32gpu", "--context-parallel", "1,3"],
     "--context-parallel: context_parallel: expected 'auto' or one of [1, 2, 4, 8] (at most "
     "the 10 rollout workers), got 3"),
    (["simulate", "qwenimage20b-32gpu", "--context-parallel", "auto"],
     "--context-parallel: profile.costs.tokens_per_sample: expected a number > 0 with "
     "context_parallel auto"),
])
def test_simulate_refuses_bad_input(capsys, argv, message):
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_dispatch_overhead_separates_transfers_and_queued_tasks():
    import pandas as pd

    from digenrl.figures.analysis import dispatch_overhead

    # One worker: a task released to a free GPU (waits 10 ms, 4 of them fetching inputs),
    # then one queued behind it (starts 2 ms after the first stops).
    tasks = pd.DataFrame({
        "kind": ["denoise", "denoise"], "gpu": [True, True], "worker_name": ["w", "w"],
        "eligible": [0.0, 0.05], "released": [0.001, 0.06], "start": [0.010, 0.102],
        "stop": [0.100, 0.200], "finished": [0.101, 0.201], "transfer": [0.004, 0.0]})
    o = dispatch_overhead(tasks)
    assert o["fresh_ms"] == pytest.approx(10.0) and o["queued_ms"] == pytest.approx(2.0)
    assert o["overhead_ms"] == pytest.approx(6.0)
    assert o["denoise_dask_ms"] == pytest.approx((6.0 + 2.0) / 2)
    assert o["denoise_ms"] == pytest.approx(94.0)


def test_dispatch_overhead_pools_a_workers_fetches_by_time():
    import pandas as pd

    from digenrl.figures.analysis import dispatch_overhead

    # Worker w fetches new weights from 0.010 to 0.050 while its first task waits to
    # start; Dask attached the fetch to the second task (another reader of the weights).
    # Worker v's fetch, during the same window, is not w's.
    nan = float("nan")
    tasks = pd.DataFrame({
        "kind": ["denoise", "denoise", "denoise"], "gpu": [True, True, True],
        "worker_name": ["w", "w", "v"],
        "eligible": [0.0, 0.0, 0.0], "released": [0.001, 0.001, 0.001],
        "start": [0.060, 0.200, 0.060], "stop": [0.150, 0.300, 0.150],
        "finished": [0.151, 0.301, 0.151], "transfer": [0.0, 0.040, 0.040],
        "transfer_start": [nan, 0.010, 0.010], "transfer_stop": [nan, 0.050, 0.050]})
    o = dispatch_overhead(tasks)
    # w's first task: 60 ms idle, 40 of them fetching; its second waited 50 ms after the
    # first stopped with no fetch in that window; v's task: 60 ms, 40 fetching.
    assert o["overhead_ms"] == pytest.approx((60 + 50 + 60) / 3)
    assert o["dask_ms"] == pytest.approx((20 + 50 + 20) / 3)


def test_per_worker_speeds_set_the_heterogeneous_ideal_bound(flux):
    half = {f"rollout-{j}": 0.5 for j in range(3)}
    base = simulate(flux, opts("digenrl"), 4)
    hetero = simulate(flux, opts("digenrl"), 4, speeds=half)
    capacity = flux.gpus - 3 * 0.5
    assert hetero.ideal_images_per_s == pytest.approx(base.ideal_images_per_s * capacity / flux.gpus)
    assert hetero.images_per_s < base.images_per_s
    assert 0 < hetero.ideal_fraction <= 1.0
    with pytest.raises(ValueError, match=r"speeds: expected names of the profile's workers"):
        simulate(flux, opts("digenrl"), 3, speeds={"rollout-99": 0.5})


def test_encode_tasks_hold_a_rollout_slot_before_their_groups_chunks(flux):
    """A language-model encoder's cost (``encode_per_group``): one encode task per prompt
    group and iteration, holding a GPU slot on a rollout worker (or a trainer lent to
    generation), each before its group's noise tasks, counted in the ideal bound; a
    profile that leaves encoding at 0 has none."""
    import dataclasses

    from digenrl.graph.plan import IterationPlan

    small = dataclasses.replace(flux, prompts_per_iteration=6)
    encoding = dataclasses.replace(small, costs=dataclasses.replace(small.costs,
                                                                    encode_per_group=2.0))
    r = simulate(encoding, opts("digenrl"), 3)
    records = r.result.records
    encodes = [t for t in records if t.kind == "encode"]
    assert sorted(t.key for t in encodes) == [("encode", i, g) for i in range(3)
                                              for g in range(6)]
    assert all(t.gpu for t in encodes)
    assert all(t.pool == "rollout" or t.tag for t in encodes)
    speeds = encoding.speeds()
    for t in encodes:
        assert t.stop - t.start == pytest.approx(2.0 / speeds[t.worker])
    noise = {t.key: t for t in records if t.kind == "noise"}
    plan = IterationPlan.uniform(0, ("p",) * 6, small.samples_per_prompt, small.chunk_size)
    for t in encodes:
        for c in plan.chunks_of_group(t.key[2]):
            assert noise[("noise", t.key[1], c)].start >= t.stop
    assert encoding.gpu_seconds_per_iteration() == pytest.approx(
        small.gpu_seconds_per_iteration() + 6 * 2.0)
    assert not [t for t in simulate(small, opts("digenrl"), 3).result.records
                if t.kind == "encode"]
