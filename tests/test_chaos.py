"""Chaos: random slowdowns injected into workers while the real scheduler and plugin
schedule a run (emulated GPUs: the real graph, tasks that only wait).

However slow or fast each worker gets, and whenever that changes, the scheduler keeps
the rules the task records are checked against (``tests/invariants.py``): pools and TAG,
the staleness bound, the GPU slots; and the run completes with every task of every
iteration.
"""

from __future__ import annotations

import random
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from digenrl.run.driver import Driver
from digenrl.schedulers.options import MODES, ScheduleOptions
from digenrl.sim.emulate import EmulatedWorkload, set_slowdown
from digenrl.store import open_run

from conftest import small_emulated_profile
from invariants import assert_schedule_invariants

ITERATIONS = 4
#: Slowdown factors drawn for a worker (1 is its declared speed).
FACTORS = (0.25, 0.5, 1.0, 1.0, 2.0, 4.0, 8.0)


@pytest.fixture(scope="module")
def profile():
    # Tasks of a few to a few tens of milliseconds, so slowdowns reorder them.
    return small_emulated_profile(0.02)


class Chaos:
    """Sets a random worker's slowdown to a random factor each time a few more tasks
    have completed (seeded: the same sequence of choices for the same seed)."""

    def __init__(self, client, seed: int, every: int = 6):
        self.client, self.rng, self.every = client, random.Random(seed), every
        self.workers = sorted(client.scheduler_info(n_workers=-1)["workers"])
        self.injected: list[tuple[str, float]] = []
        self.stop = threading.Event()

    def loop(self) -> None:
        seen, run = 0, None
        while not self.stop.wait(0.01):
            state = self.client.sync(self.client.scheduler.digenrl_state)
            if not state["active"]:
                continue  # before this run began (the plugin still shows the last one)
            if state["run"] != run:
                seen, run = 0, state["run"]
            done = state["records"]
            if done >= seen + self.every:
                seen = done
                worker = self.rng.choice(self.workers)
                factor = self.rng.choice(FACTORS)
                self.client.run(set_slowdown, factor, workers=[worker])
                self.injected.append((worker, factor))


@pytest.mark.parametrize("seed,switches", [
    (1, {"rat": True}),
    (2, {"max_staleness": 2, "rat": False}),
    (3, {"tsp": False, "rat": True}),
    (4, {"max_staleness": 0, "rat": True}),
])
def test_slowdowns_never_break_the_scheduling_rules(emulated_2x2, profile, tmp_path, seed,
                                                    switches):
    options = ScheduleOptions(mode="digenrl", **{**MODES["digenrl"], **switches})
    stale_groups = 1 if options.max_staleness > 1 else None
    workload = EmulatedWorkload(profile, options, ITERATIONS, stale_groups=stale_groups)
    chaos = Chaos(emulated_2x2.client, seed)
    out = tmp_path / "run.zarr"
    with ThreadPoolExecutor(1) as pool:
        injecting = pool.submit(chaos.loop)
        try:
            Driver(workload, str(out), emulated_2x2).run()
        finally:
            chaos.stop.set()
            injecting.result()
    assert len(chaos.injected) >= 5, chaos.injected
    assert len({f for _, f in chaos.injected}) >= 2

    ds = open_run(out)
    assert ds["metrics"].sizes["iteration"] == ITERATIONS
    t = ds["tasks"].to_dataframe()
    chunks = len(workload.plan(0).chunks)
    # Every task of every iteration ran (once: nothing was lost, nothing recomputed).
    for kind, per_chunk in (("denoise", profile.num_steps), ("grad", profile.trained_steps),
                            ("reward", 1)):
        done = t[t.kind == kind]
        assert done.key.is_unique and len(done) == ITERATIONS * chunks * per_chunk, kind
    assert_schedule_invariants(t, options)
