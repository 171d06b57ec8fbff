"""Context-parallel degrees on emulated GPUs: a cost profile's variants at fixed degrees
and with ``auto``, each run by the real graph (each chunk's steps gangs of its degree),
scheduler and plugin on worker processes whose tasks sleep for the profile's costs
(``digenrl bench --emulate``), beside the simulator's figure for the same run.

    python workflows/cp_emulated.py wan14b-720p-tail-16gpu --out runs/cp-emu

Prints, per variant and degree, the iteration's seconds in the profile's time (the
iterations after the first and before the last), the fraction of the ideal bound, the
chunks by degree, the simulated iteration seconds, and each variant's ``auto`` against
its best fixed degree. One emulated cluster serves every run.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from digenrl.commands.bench import bench_profile
from digenrl.run.cluster import start_emulated_cluster
from digenrl.sim.costs import chunk_degrees
from digenrl.sim.profile import load_profile
from digenrl.sim.simulate import degree_runs, simulate_variants


def degree(text: str) -> int | str:
    return text if text == "auto" else int(text)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("profile", help="a shipped profile's name or a YAML file")
    p.add_argument("--out", required=True, help="folder for the runs' stores")
    p.add_argument("--degrees", default="1,2,4,auto")
    p.add_argument("--variants", default="disaggregated,digenrl")
    p.add_argument("--iterations", type=int, default=6)
    p.add_argument("--time-scale", type=float, help="default: the profile's")
    args = p.parse_args()
    profile = load_profile(args.profile)
    profiles = [profile.with_context_parallel(degree(d)) for d in args.degrees.split(",")]
    variants = args.variants.split(",")
    handle = start_emulated_cluster(profile.rollout_workers, profile.trainer_workers,
                                    profile.speeds(), None)
    rows = []
    try:
        for q in profiles:
            chunks = chunk_degrees(q, q.images_per_iteration // q.chunk_size)
            simulated = dict(simulate_variants(q, variants, args.iterations))
            for r in bench_profile(q, variants, Path(args.out) / f"cp-{q.context_parallel}",
                                   iterations=args.iterations, time_scale=args.time_scale,
                                   cluster=handle, skip=1, drain=1):
                seconds = q.images_per_iteration / r.stats.images_per_s
                rows.append((r.name, q.context_parallel, seconds, r.stats.ideal_fraction,
                             degree_runs(chunks), simulated[r.name].iteration_s))
    finally:
        handle.close()
    print(f"{'variant':<14}{'cp':>6}{'iteration s':>13}{'ideal':>7}{'simulated s':>13}"
          f"  chunks x degree")
    for name, d, seconds, ideal, chunks, sim in rows:
        print(f"{name:<14}{str(d):>6}{seconds:>13.1f}{ideal:>7.3f}{sim:>13.1f}  {chunks}")
    for v in variants:
        fixed = {d: s for name, d, s, *_ in rows if name == v and d != "auto"}
        auto = [s for name, d, s, *_ in rows if name == v and d == "auto"]
        if fixed and auto:
            best = min(fixed, key=fixed.__getitem__)
            print(f"{v}: auto {auto[0]:.1f} s against the best fixed degree ({best}) "
                  f"{fixed[best]:.1f} s: {auto[0] / fixed[best]:.3f}x")


if __name__ == "__main__":
    main()
