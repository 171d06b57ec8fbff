"""Where a run's CPU goes: the model's arithmetic against everything else, per process,
thread and task kind.

    python workflows/overhead.py workflows/configs/tiny.yaml --iterations 8

Starts the config's local cluster, runs two iterations to warm it up (imports, models
built, the first version), then the measured run, and prints, for that run:

* per process and thread, the CPU seconds spent (``psutil``): the driver's main thread
  (graph building, result collection, store writes), its event-loop thread (on a local
  cluster the Dask scheduler and the digenrl plugin run there, beside the client), the
  workers' event loops (Dask's communication, (de)serialisation of results) and their
  task threads;
* per task kind, from Dask's own fine performance metrics (each worker meters every
  task's execution): the CPU seconds inside the model's forward and backward passes
  (metered by the task code as ``model``), the task's other CPU seconds, and its wall
  seconds not on a CPU (waiting for the GIL, the other process, I/O); and the seconds
  Dask spent (de)serialising and moving data for it;
* the model's share: model CPU seconds over all CPU seconds, and what beside the model
  costs, as a fraction of the model's own.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import threading
import time

import psutil


def thread_times() -> dict[str, float]:
    """CPU seconds of each thread of this process, by the thread's name (Python's name
    where Python started it; ``other`` for the rest)."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    out: dict[str, float] = collections.defaultdict(float)
    for t in psutil.Process().threads():
        name = names.get(t.id, "other")
        # Dask's task threads are named "Dask-Default-Threads-<pid>-<n>".
        if "Dask-Default-Threads" in name:
            name = "task threads"
        elif name == "MainThread":
            name = "main"
        elif name.startswith("IO loop") or "loop" in name.lower():
            name = "event loop"
        out[name] += t.user_time + t.system_time
    return dict(out)


def _thread_group(name: str) -> str:
    """Threads of one pool counted together (``asyncio_3`` -> ``asyncio_*``)."""
    head, _, tail = name.rpartition("_")
    return f"{head}_*" if head and tail.isdigit() else name


def snapshot(client) -> dict[str, dict[str, float]]:
    """Every process's thread CPU seconds (this process as ``driver``), and Dask's
    cumulative worker metrics."""
    procs = {"driver": thread_times()}
    for addr, times in client.run(thread_times).items():
        procs[addr] = times
    metrics = client.run_on_scheduler(
        lambda dask_scheduler: dict(dask_scheduler.cumulative_worker_metrics))
    return {"procs": procs, "metrics": metrics}


def diff(a: dict, b: dict) -> dict:
    return {k: b[k] - a.get(k, 0.0) for k in b}


def main(argv: list[str] | None = None) -> int:
    from digenrl.run.cluster import start_cluster
    from digenrl.config import load_config
    from digenrl.run.runner import Runner

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("config")
    p.add_argument("--iterations", type=int, default=8)
    p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE")
    p.add_argument("--out", default="runs/overhead")
    p.add_argument("--dask", action="append", default=[], metavar="KEY=VALUE",
                   help="a Dask setting for the cluster, e.g. distributed.worker.profile."
                        "enabled=false")
    args = p.parse_args(argv)
    import dask
    import yaml

    dask.config.set({k: yaml.safe_load(v) for k, v in (s.split("=", 1) for s in args.dask)})

    overrides = {k: yaml.safe_load(v) for k, v in (s.split("=", 1) for s in args.set)}
    config = load_config(args.config, {**overrides, "iterations": args.iterations,
                                       "cluster.dashboard_address": None})
    cluster = start_cluster(config.cluster)
    client = cluster.client
    names = {a: w["name"] for a, w in client.scheduler_info(n_workers=-1)["workers"].items()}
    try:
        warm = load_config(args.config, {**overrides, "iterations": 2,
                                         "cluster.dashboard_address": None})
        Runner(warm, os.path.join(args.out, "warm.zarr"), cluster=cluster,
               overwrite=True).run()
        before = snapshot(client)
        started = time.time()
        Runner(config, os.path.join(args.out, "run.zarr"), cluster=cluster,
               overwrite=True).run()
        wall = time.time() - started
        after = snapshot(client)
    finally:
        cluster.close()

    n = args.iterations
    print(f"{n} iterations in {wall:.1f} s ({wall / n:.2f} s each); CPU seconds per "
          f"iteration:\n")
    print(f"{'process':<14}{'thread':<24}{'CPU s/it':>10}")
    total_cpu = 0.0
    for proc, times in after["procs"].items():
        d = diff(before["procs"].get(proc, {}), times)
        label = "driver" if proc == "driver" else names.get(proc, proc)
        groups: dict[str, float] = collections.defaultdict(float)
        for thread, s in d.items():
            groups[_thread_group(thread)] += s
        for thread, s in sorted(groups.items(), key=lambda kv: -kv[1]):
            if s / n >= 0.001:
                print(f"{label:<14}{thread:<24}{s / n:>10.3f}")
        print(f"{label:<14}{'(all)':<24}{sum(d.values()) / n:>10.3f}")
        total_cpu += sum(d.values())
    m = diff(before["metrics"], after["metrics"])
    per_kind: dict[str, dict[str, float]] = collections.defaultdict(
        lambda: collections.defaultdict(float))
    other: dict[tuple, float] = collections.defaultdict(float)
    for key, value in m.items():
        if not isinstance(key, tuple) or len(key) != 4 or key[3] != "seconds" or not value:
            continue
        context, prefix, activity, _ = key
        if context == "execute":
            per_kind[prefix][activity] += value
        else:
            other[(context, activity)] += value
    print(f"\n{'task kind':<14}{'model':>9}{'other cpu':>11}{'not on cpu':>12}"
          f"{'(de)serial':>12}   (seconds per iteration, Dask's metrics)")
    model = 0.0
    for kind, acts in sorted(per_kind.items(), key=lambda kv: -sum(kv[1].values())):
        ser = sum(v for a, v in acts.items() if "serial" in a)
        print(f"{kind:<14}{acts.get('model', 0) / n:>9.3f}{acts.get('thread-cpu', 0) / n:>11.3f}"
              f"{acts.get('thread-noncpu', 0) / n:>12.3f}{ser / n:>12.3f}")
        model += acts.get("model", 0.0)
    print(f"\n{'context':<14}{'activity':<22}{'s/it':>8}")
    for (context, activity), v in sorted(other.items(), key=lambda kv: -kv[1]):
        if v / n >= 0.002:
            print(f"{context:<14}{activity:<22}{v / n:>8.3f}")
    print(f"\nall CPU {total_cpu / n:.3f} s/it; in the model {model / n:.3f} s/it "
          f"({model / total_cpu:.0%}); beside the model {(total_cpu - model) / n:.3f} s/it = "
          f"{(total_cpu - model) / model:.0%} of the model's own")
    return 0


if __name__ == "__main__":
    sys.exit(main())
