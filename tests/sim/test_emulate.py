"""Emulated GPUs: the real graph, scheduler and plugin on tasks that only wait."""

import ast
import dataclasses

import pytest
import yaml

from digenrl.commands.bench import bench_profile, format_table
from digenrl.commands.cli import main
from digenrl.run.driver import Driver
from digenrl.schedulers.options import MODES, ScheduleOptions
from digenrl.sim.emulate import EmulatedWorkload
from digenrl.sim.simulate import measured_latencies, simulate_variants
from digenrl.store import open_run

from conftest import small_emulated_profile


@pytest.fixture(scope="module")
def small_profile():
    return small_emulated_profile(0.002)


def test_emulated_workers_declare_their_speed(emulated_2x2):
    info = emulated_2x2.client.scheduler_info(n_workers=-1)["workers"].values()
    speeds = {w["name"]: w["resources"].get("speed", 1.0) for w in info}
    assert speeds == {"rollout-0": 0.5, "rollout-1": 0.5, "trainer-0": 1.0, "trainer-1": 1.0}


def test_an_emulated_run_schedules_the_real_graph(emulated_2x2, small_profile, tmp_path):
    opts = ScheduleOptions(mode="digenrl", **MODES["digenrl"])
    # With an encoder's cost: an encode task per prompt group.
    encoding = dataclasses.replace(small_profile, costs=dataclasses.replace(
        small_profile.costs, encode_per_group=0.5))
    w = EmulatedWorkload(encoding, opts, 3)
    Driver(w, str(tmp_path / "e.zarr"), emulated_2x2).run()
    ds = open_run(tmp_path / "e.zarr")
    t = ds["tasks"].to_dataframe()
    assert ds["metrics"].sizes["iteration"] == 3
    # 4 chunks x (noise, 4 denoise, decode, reward, 2 grads) per iteration, and more.
    assert (t.kind == "denoise").sum() == 3 * 4 * 4 and (t.kind == "grad").sum() == 3 * 4 * 2
    # 2 groups (2 chunks each) per iteration: each encoded in a GPU slot before its
    # chunks' noise became ready (the scheduler's clock).
    enc = t[t.kind == "encode"]
    assert len(enc) == 3 * 2 and enc.gpu.all() and (enc.pool.eq("rollout") | enc.tag).all()
    noise = t[t.kind == "noise"].set_index("key")
    for _, e in enc.iterrows():
        i, g = ast.literal_eval(e.key)[1:]
        for c in (2 * g, 2 * g + 1):
            assert noise.loc[str(("noise", i, c)), "ready"] >= e.finished
    assert not t[t.kind.isin(["reduce", "optimize"])].pool.eq("rollout").any()
    # Grads on the rollout pool only as rollout-assisted training (on in mode digenrl).
    on_rollout = t[(t.kind == "grad") & t.pool.eq("rollout")]
    assert on_rollout.rat.all(), on_rollout.key.tolist()
    assert ds["tasks"].attrs["digenrl"]["workload"] == "emulated"


def test_bench_on_emulated_gpus(emulated_2x2, small_profile, tmp_path, capsys):
    results = bench_profile(small_profile, ["disaggregated", "digenrl"], tmp_path,
                            iterations=4, cluster=emulated_2x2, drain=1)
    for r in results:
        s = r.stats
        assert s.iterations == 2 and s.gpus == 4
        assert 0 < s.ideal_fraction <= 1.05  # profile time; a little scheduling noise
        assert r.overhead["tasks"] > 0
        assert (tmp_path / f"{r.name}.png").stat().st_size > 10_000
    assert "/digenrl" in format_table(results)

    # The simulator, validated against these emulated runs with the Dask latencies
    # measured in them.
    data = dataclasses.asdict(small_profile)
    data["sources"] = list(data["sources"])
    profile_file = tmp_path / "small.yaml"
    profile_file.write_text(yaml.safe_dump(data))
    assert main(["simulate", str(profile_file), "--iterations", "4", "--variants",
                 "disaggregated,digenrl", "--validate", str(tmp_path), "--reuse"]) == 0
    out = capsys.readouterr().out
    rows = {line.split()[0]: line.split() for line in out.splitlines()[2:4]}
    for r in results:
        emulated = float(rows[r.name][7])
        assert emulated == pytest.approx(r.stats.images_per_s, abs=5.1e-5)  # printed to 4 places
    assert "Dask latencies measured on the emulator" in out


def test_the_simulator_agrees_with_the_driver_it_stands_for(emulated_2x2, tmp_path):
    """The simulator (the policy in a discrete-event loop, whole iterations submitted in
    the staleness window) against the driver on Dask (its rollout, train and tail pieces,
    each version published from its state read back) on the same emulated profile: with
    the Dask latencies measured in the emulated run, the simulated images per second,
    the inverse of the mean iteration time, is within 5% of the run's. Both figures come
    from the one run, so the host's speed moves them together; at this time scale the
    latencies are a small part of each task's time (at 0.1 they were a third of it and
    the two differed by up to 7% on a loaded host)."""
    profile = small_emulated_profile(0.3)
    [run] = bench_profile(profile, ["digenrl"], tmp_path, iterations=4, cluster=emulated_2x2,
                          drain=1)
    [(_, simulated)] = simulate_variants(
        profile, ["digenrl"], 4, drain=1,
        latencies={"digenrl": measured_latencies(run.overhead, profile.time_scale)})
    emulated = run.stats.images_per_s
    assert simulated.images_per_s == pytest.approx(emulated, rel=0.05), \
        (simulated.images_per_s, emulated, run.overhead)
