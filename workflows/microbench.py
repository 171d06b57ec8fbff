"""Micro-benchmarks behind two statements in docs/.

    python workflows/microbench.py dispatch   # a chain hop: parked-and-released vs plain Dask
    python workflows/microbench.py malloc     # a forward pass under Dask's nanny malloc setting

``dispatch`` runs a chain of dependent no-op tasks on a local cluster of one rollout and
one trainer worker, once as plain Dask tasks and once annotated as digenrl tasks (parked
by the plugin and released by the policy), alternating, and prints milliseconds per hop.
``malloc`` times the default transformer's forward pass in fresh processes with and
without ``MALLOC_TRIM_THRESHOLD_=65536`` (what Dask's nanny exports), and with that
variable plus the allocator tuning the worker plugin applies.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time


def _inc(x):
    return x + 1


def dispatch(hops: int, rounds: int) -> None:
    import logging

    from dask._task_spec import Task, TaskRef
    from dask.highlevelgraph import HighLevelGraph, MaterializedLayer

    from digenrl.cluster import start_cluster
    from digenrl.config import ClusterConfig
    from digenrl.graph.keys import ANNOTATION, task_meta
    from digenrl.schedulers.options import MODES, ScheduleOptions

    logging.getLogger("distributed").setLevel(logging.ERROR)
    handle = start_cluster(ClusterConfig(dashboard_address=None))
    c = handle.client
    opts = ScheduleOptions(mode="digenrl", **MODES["digenrl"])
    c.sync(c.scheduler.digenrl_begin_run, run="microbench", options=opts.as_dict())

    def chain(name: str, annotate: bool):
        dsk, meta = {}, {}
        for i in range(hops):
            key = (name, i)
            dsk[key] = Task(key, _inc, TaskRef((name, i - 1)) if i else 0)
            meta[key] = task_meta("advantage", 0, 0)  # a trainer-pool task with no GPU
        ann = {ANNOTATION: meta.get} if annotate else None
        return HighLevelGraph({name: MaterializedLayer(dsk, annotations=ann)}, {name: set()})

    times = {"plain": [], "digenrl": []}
    try:
        for r in range(rounds):
            for label in ("plain", "digenrl"):
                g = chain(f"{label}-{r}", label == "digenrl")
                t0 = time.perf_counter()
                [f] = c.get(g, [(f"{label}-{r}", hops - 1)], sync=False)
                assert f.result() == hops
                times[label].append((time.perf_counter() - t0) / hops * 1000)
                del f
    finally:
        handle.close()
    for label, ts in times.items():
        print(f"{label:>8}: {statistics.median(ts):.2f} ms per hop "
              f"(median of {rounds} chains of {hops}; min {min(ts):.2f}, max {max(ts):.2f})")
    print(f"   ratio: {statistics.median(times['digenrl']) / statistics.median(times['plain']):.3f}")


_FORWARD = """
import sys, time, torch
if sys.argv[1] == "tuned":
    from digenrl.tasks.resident import tune_malloc
    assert tune_malloc()
torch.set_num_threads(1)
from digenrl.config import ModelConfig
from digenrl.models import build_transformer
m = build_transformer(ModelConfig(), 0)
x = torch.randn(4, 4, 16, 16); e = torch.randn(4, 8, 64); p = torch.randn(4, 32)
ts = torch.full((4,), 500.0)
with torch.no_grad():
    for _ in range(3):
        m(x, e, p, ts)
    t = time.perf_counter()
    for _ in range(20):
        m(x, e, p, ts)
print((time.perf_counter() - t) / 20 * 1000)
"""


def malloc() -> None:
    cases = [("no MALLOC_TRIM_THRESHOLD_", {}, "plain"),
             ("MALLOC_TRIM_THRESHOLD_=65536 (Dask nanny)", {"MALLOC_TRIM_THRESHOLD_": "65536"},
              "plain"),
             ("same + digenrl allocator tuning", {"MALLOC_TRIM_THRESHOLD_": "65536"}, "tuned")]
    base = {k: v for k, v in os.environ.items() if k != "MALLOC_TRIM_THRESHOLD_"}
    results = {}
    for label, extra, mode in cases:
        runs = []
        for _ in range(3):
            out = subprocess.run([sys.executable, "-c", _FORWARD, mode], env={**base, **extra},
                                 capture_output=True, text=True, check=True)
            runs.append(float(out.stdout.strip().splitlines()[-1]))
        results[label] = statistics.median(runs)
        print(f"{label:<42} {results[label]:6.1f} ms per forward pass (median of 3 processes)")
    first = next(iter(results.values()))
    for label, v in results.items():
        print(f"{label:<42} {v / first:6.2f}x")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("what", choices=["dispatch", "malloc"])
    p.add_argument("--hops", type=int, default=300)
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    if args.what == "dispatch":
        dispatch(args.hops, args.rounds)
    else:
        malloc()


if __name__ == "__main__":
    main()
