"""Where each worker idles while the policy version changes, from a run's task records.

    python workflows/version_waits.py runs/modes/digenrl.zarr

With one-step bounded staleness every version change is a point both pools meet at:
the next iteration's micro-steps and the generation after them both read the version
the optimizer step is about to publish. For each iteration but the first and the last,
and for each worker, this takes the time from the end of the worker's last rollout step
or grad before the version is published to the start of its first GPU task after, and
splits the worker's idle GPU time in it (time without a GPU task of its own) at the
moments that bound it:

* ``training``: until the iteration's last grad stopped (on whichever worker);
* ``reduction``: until the optimizer step started (the gradient sum's last nodes);
* ``optimizer``: during the optimizer step;
* ``publish``: until the version's publish task stopped (its state read back, its
  weights published);
* ``start``: until the worker's first GPU task of the new version started (drawing the
  noise, fetching the weights and inputs, dispatch).

It prints the mean idle milliseconds per iteration of each pool's workers in each part,
and their sum against the mean iteration (from one optimizer step's end to the next).
Times are the workers' clocks (one host's clock on a local cluster).
"""

from __future__ import annotations

import argparse

import numpy as np

from digenrl.figures.analysis import busy_seconds, store_pools
from digenrl.store import open_run
from digenrl.vocabulary import GRAD, OPTIMIZE, PUBLISH, ROLLOUT_KINDS

PARTS = ("training", "reduction", "optimizer", "publish", "start")


def version_waits(store: str) -> tuple[dict[str, dict[str, float]], float, int]:
    """Mean idle seconds per iteration of a pool's worker in each part, the mean
    iteration's seconds, and how many iterations were measured."""
    ds = open_run(store)
    t = ds["tasks"].to_dataframe()
    pool_of = {str(w): pool for pool, ws in store_pools(ds["tasks"].attrs["digenrl"]).items()
               for w in ws}
    gpu = t[t.gpu]
    iterations = sorted(int(i) for i in t[t.kind == OPTIMIZE].iteration)
    idle: dict[str, dict[str, list[float]]] = {}
    for i in iterations[1:-1]:
        grads = t[(t.kind == GRAD) & (t.iteration == i)]
        opt = t[(t.kind == OPTIMIZE) & (t.iteration == i)].iloc[0]
        pub = t[(t.kind == PUBLISH) & (t.policy_version == i + 1)]
        if grads.empty or pub.empty:
            continue
        bounds = [grads.stop.max(), opt.start, opt.stop, pub.stop.min()]
        for worker, mine in gpu.groupby("worker_name"):
            work = mine[mine.kind.isin(ROLLOUT_KINDS | {GRAD})]
            before = work[work.start < bounds[-1]]
            after = mine[mine.start >= bounds[-1]]
            if before.empty or after.empty:
                continue
            edges = [before.stop.max(), *bounds, after.start.min()]
            parts = idle.setdefault(pool_of.get(worker, "?"), {p: [] for p in PARTS})
            for part, lo, hi in zip(PARTS, edges[:-1], edges[1:]):
                lo, hi = max(lo, edges[0]), min(max(hi, edges[0]), edges[-1])
                span = max(hi - lo, 0.0)
                parts[part].append(span - busy_seconds(mine, lo, hi).get(worker, 0.0))
    stops = np.sort(t[t.kind == OPTIMIZE].stop.values)
    period = float(np.mean(np.diff(stops[1:-1]))) if len(stops) > 3 else float("nan")
    means = {pool: {p: float(np.sum(v)) / max(len(v), 1) for p, v in parts.items()}
             for pool, parts in idle.items()}
    counted = max((len(v) for parts in idle.values() for v in parts.values()), default=0)
    return means, period, counted


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("store", help="a run's store (digenrl run --out, or one of bench's)")
    args = ap.parse_args()
    means, period, n = version_waits(args.store)
    print(f"mean idle ms per worker and iteration across a version change ({n} "
          f"iteration-workers measured; mean iteration {1000 * period:.0f} ms)")
    print(f"{'pool':10s}" + "".join(f"{p:>11s}" for p in PARTS) + f"{'total':>9s}{'/iter':>7s}")
    for pool, parts in sorted(means.items()):
        total = sum(parts.values())
        print(f"{pool:10s}" + "".join(f"{1000 * parts[p]:11.0f}" for p in PARTS)
              + f"{1000 * total:9.0f}{total / period:7.2f}")


if __name__ == "__main__":
    main()
