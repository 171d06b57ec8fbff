"""``digenrl bench``: every mode and ablation on the same work and cluster, in one go.

Each variant (:mod:`digenrl.figures.variants`) is the base work with some schedule switches
changed; all run on the one cluster the benchmark starts, one after another, and are
measured over the same window (after the first iteration, which includes start-up).
The table gives images/s, images/GPU/s, the fraction of the ideal bound (GPU work /
GPU slots), utilisation and idle GPU-seconds per pool, the Dask overhead per task, and
each variant's throughput ratio to the others. With ``--emulate PROFILE`` the work is a
cost profile's, on emulated GPUs (figures are then in the profile's time, not the
emulator's).
"""

from __future__ import annotations

import csv
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from digenrl.figures.analysis import (WindowStats, dispatch_overhead, gpu_capacity, ideal_bound,
                              store_pools, window_stats)
from digenrl.config import (ConfigError, RunConfig, apply_overrides, config_from_dict,
                            config_to_dict)
from digenrl.store import open_run
from digenrl.figures.variants import VARIANTS, variant_schedule
from digenrl.vocabulary import COLOCATED, ROLLOUT, TRAINER

__all__ = ["BenchResult", "bench_config", "bench_profile", "format_table", "measure_store"]

logger = logging.getLogger("digenrl")


@dataclass
class BenchResult:
    name: str
    overrides: dict[str, Any]
    stats: WindowStats
    store: str
    overhead: dict[str, float] = field(default_factory=dict)


def measure_store(path: str | Path, skip: int = 1,
                  drain: int = 0) -> tuple[WindowStats, dict[str, float]]:
    """Window statistics and Dask overhead of a finished run's store."""
    ds = open_run(path)
    attrs = ds["tasks"].attrs["digenrl"]
    tasks = ds["tasks"].to_dataframe()
    pool_names = attrs["cluster"]["pools"]
    speeds = {}
    for name, speed in (attrs["cluster"].get("speeds") or {}).items():
        # Speeds by worker name; stores of earlier versions kept them by pool.
        for w in pool_names.get(name) or [name]:
            speeds[str(w)] = float(speed)
    scale = float(attrs.get("time_scale", 1.0))
    derived = attrs["derived"]
    ideal = None
    if attrs.get("workload") == "emulated":
        # An emulated run's bound is its profile's: the profile's GPU work per iteration.
        workers = [w for ws in pool_names.values() for w in ws or ()]
        ideal = ideal_bound(derived["images_per_iteration"],
                            derived["gpu_seconds_per_iteration"], gpu_capacity(workers, speeds))
    stats = window_stats(tasks, store_pools(attrs), derived["images_per_iteration"],
                         skip, drain=drain, time_scale=scale, speeds=speeds,
                         ideal_images_per_s=ideal)
    return stats, dispatch_overhead(tasks)


def _run_variants(variants: Sequence[str], out_dir: str | Path, make: Callable, handle,
                  skip: int, drain: int, table: Mapping[str, Mapping[str, Any]]
                  ) -> list[BenchResult]:
    from digenrl.run.driver import Driver

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    results = []
    for name in variants:
        store = out / f"{name}.zarr"
        logger.info("bench: %s %s", name, table[name])
        Driver(make(name), str(store), handle, overwrite=True).run()
        stats, overhead = measure_store(store, skip, drain)
        results.append(BenchResult(name, dict(table[name]), stats, str(store), overhead))
        _timeline(store, out / f"{name}.png", name)
    _write_csv(results, out / "results.csv")
    return results


def _timeline(store: Path, png: Path, name: str) -> None:
    from digenrl.figures.plots import timeline_png

    ds = open_run(store)
    attrs = ds["tasks"].attrs["digenrl"]
    timeline_png(ds["tasks"].to_dataframe(), png, pools=store_pools(attrs),
                 title=f"{name}: tasks by worker (hatched: trainer-assisted generation)")


def _check_variants(variants, table, skip, drain, iterations) -> None:
    unknown = [v for v in variants if v not in table]
    if unknown:
        raise ConfigError(f"variants: expected names from {sorted(table)}, got {unknown}")
    if iterations <= skip + drain:
        raise ConfigError(f"iterations: expected more than the {skip} warm-up and {drain} "
                          f"drain iteration(s), got {iterations}")


def bench_config(base: RunConfig, variants: Sequence[str], out_dir: str | Path, *,
                 cluster=None, skip: int = 1, drain: int = 0,
                 extra: Mapping[str, Mapping[str, Any]] | None = None) -> list[BenchResult]:
    """Variants of a Flow-GRPO config on one cluster (the real model)."""
    from digenrl.run.cluster import start_cluster
    from digenrl.run.runner import RLWorkload

    table = {**VARIANTS, **(extra or {})}
    _check_variants(variants, table, skip, drain, base.iterations)
    configs = {v: config_from_dict(apply_overrides(config_to_dict(base), table[v]))
               for v in variants}  # every variant is validated before any work starts
    handle = cluster or start_cluster(base.cluster, pools=True)
    try:
        return _run_variants(variants, out_dir, lambda v: RLWorkload(configs[v]),
                             handle, skip, drain, table)
    finally:
        if cluster is None:
            handle.close()


def bench_profile(profile, variants: Sequence[str], out_dir: str | Path, *, iterations: int,
                  time_scale: float | None = None, cluster=None, skip: int = 1,
                  drain: int = 0, dashboard_address: str | None = ":8787") -> list[BenchResult]:
    """Variants on emulated GPUs following a cost profile."""
    from digenrl.run.cluster import start_emulated_cluster
    from digenrl.sim.emulate import EmulatedWorkload

    _check_variants(variants, VARIANTS, skip, drain, iterations)
    schedules = {v: variant_schedule(v) for v in variants}
    for sched in schedules.values():  # each variant's GPUs hold the model, before any cluster
        profile.check_memory(colocated=not sched.options().pools)
    handle = cluster or start_emulated_cluster(
        profile.rollout_workers, profile.trainer_workers, profile.speeds(), dashboard_address)

    def make(v):
        s = schedules[v]
        return EmulatedWorkload(profile, s.options(), iterations, time_scale=time_scale,
                                stale_groups=s.stale_groups)

    try:
        return _run_variants(variants, out_dir, make, handle, skip, drain, VARIANTS)
    finally:
        if cluster is None:
            handle.close()


def _write_csv(results: Sequence[BenchResult], path: Path) -> None:
    pools = sorted({p for r in results for p in r.stats.utilisation})
    overhead = list(dict.fromkeys(k for r in results for k in r.overhead if k != "tasks"))
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["variant", "images_per_s", "images_per_gpu_s", "ideal_images_per_s",
                    "ideal_fraction", "gpu_work_s", "seconds", "tag_s", "rat_s", *overhead]
                   + [f"utilisation_{p}" for p in pools] + [f"idle_s_{p}" for p in pools])
        for r in results:
            s, o = r.stats, r.overhead
            w.writerow([r.name, s.images_per_s, s.images_per_gpu_s, s.ideal_images_per_s,
                        s.ideal_fraction, s.gpu_work_s, s.seconds, s.tag_s, s.rat_s,
                        *(o.get(k, "") for k in overhead)]
                       + [s.utilisation.get(p, "") for p in pools]
                       + [s.idle_s.get(p, "") for p in pools])


def format_table(results: Sequence[BenchResult]) -> str:
    """One row per variant plus its throughput ratio to every other variant."""
    names = [r.name for r in results]
    head = (f"{'variant':<14}{'img/s':>9}{'img/GPU/s':>11}{'ideal':>7}"
            f"{'util r/t/c':>16}{'idle s r/t/c':>20}{'TAG s':>8}{'RAT s':>8}{'wait ms':>9}{'Dask ms':>9}"
            f"{'%step':>7}  " +
            "".join(f"{'/' + n:>{max(8, len(n) + 2)}}" for n in names))
    lines = [head, "-" * len(head)]

    def triple(d, fmt):
        return "/".join(fmt.format(d[p]) if p in d else "-" for p in (ROLLOUT, TRAINER, COLOCATED))

    for r in results:
        s, o = r.stats, r.overhead
        nan = float("nan")
        wait_ms = o.get("overhead_ms", nan)
        dask_ms = o.get("denoise_dask_ms", nan)
        share = 100 * dask_ms / o.get("denoise_ms", nan)
        ratios = "".join(f"{s.images_per_s / x.stats.images_per_s:>{max(8, len(x.name) + 2)}.2f}"
                         for x in results)
        lines.append(f"{r.name:<14}{s.images_per_s:>9.3f}{s.images_per_gpu_s:>11.4f}"
                     f"{s.ideal_fraction:>7.2f}{triple(s.utilisation, '{:.2f}'):>16}"
                     f"{triple(s.idle_s, '{:.0f}'):>20}{s.tag_s:>8.0f}{s.rat_s:>8.0f}{wait_ms:>9.1f}{dask_ms:>9.1f}"
                     f"{share:>7.1f}  {ratios}")
    return "\n".join(lines)
