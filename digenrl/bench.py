"""``digenrl bench``: every mode and ablation on the same work and cluster, in one go.

Each variant is the base config with a few schedule switches changed; all run on the
one cluster the benchmark starts, one after another, and are measured over the same
window (after the first iteration, which includes start-up). The table gives images/s,
images/GPU/s, the fraction of the ideal bound (GPU work / GPU slots), utilisation and
idle GPU-seconds per pool, and each variant's ratio to the others.
"""

from __future__ import annotations

import csv
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

from digenrl.analysis import WindowStats, window_stats
from digenrl.config import RunConfig, apply_overrides, config_from_dict, config_to_dict
from digenrl.schedulers.options import COLOCATED, ROLLOUT, TRAINER
from digenrl.store import open_run

__all__ = ["VARIANTS", "BenchResult", "run_bench", "format_table", "measure_store"]

logger = logging.getLogger("digenrl")

#: Named variants: schedule overrides on top of the base config.
VARIANTS: dict[str, dict[str, Any]] = {
    "colocated": {"schedule.mode": "colocated"},
    "disaggregated": {"schedule.mode": "disaggregated"},
    "digenrl": {"schedule.mode": "digenrl"},
    # Each technique alone, on top of the synchronous disaggregated design.
    "gap": {"schedule.mode": "disaggregated", "schedule.gap": True},
    "tsp": {"schedule.mode": "disaggregated", "schedule.tsp": True},
    "tag": {"schedule.mode": "disaggregated", "schedule.tag": True},
    "staleness-1": {"schedule.mode": "disaggregated", "schedule.max_staleness": 1},
    # DigenRL without asynchrony, and with it only for the tail bubble.
    "digenrl-sync": {"schedule.mode": "digenrl", "schedule.max_staleness": 0},
    "digenrl-tail": {"schedule.mode": "digenrl", "schedule.stale_groups": 1},
}
DEFAULT_VARIANTS = ("colocated", "disaggregated", "digenrl", "gap", "tsp", "tag",
                    "staleness-1")


@dataclass
class BenchResult:
    name: str
    overrides: dict[str, Any]
    stats: WindowStats
    store: str


def measure_store(path: str | Path, skip: int = 1) -> WindowStats:
    """The window statistics of a finished run's store."""
    ds = open_run(path)
    attrs = ds["tasks"].attrs["digenrl"]
    pools = attrs["cluster"]["pools"]
    if attrs["schedule"]["pools"]:
        by_pool = {ROLLOUT: pools.get(ROLLOUT, []), TRAINER: pools.get(TRAINER, [])}
    else:
        by_pool = {COLOCATED: pools.get(ROLLOUT, []) + pools.get(TRAINER, [])}
    tasks = ds["tasks"].to_dataframe()
    return window_stats(tasks, by_pool, attrs["derived"]["images_per_iteration"], skip)


def run_bench(base: RunConfig, variants: Sequence[str], out_dir: str | Path, *,
              cluster=None, skip: int = 1,
              extra: Mapping[str, Mapping[str, Any]] | None = None) -> list[BenchResult]:
    """Run ``variants`` of ``base`` on one cluster; stores go to ``out_dir``."""
    from digenrl.cluster import start_cluster
    from digenrl.runner import Runner

    table = {**VARIANTS, **(extra or {})}
    unknown = [v for v in variants if v not in table]
    if unknown:
        raise ValueError(f"variants: expected names from {sorted(table)}, got {unknown}")
    configs = {v: config_from_dict(apply_overrides(config_to_dict(base), table[v]))
               for v in variants}  # every variant is validated before any work starts
    if base.iterations <= skip:
        raise ValueError(f"iterations: expected more than the {skip} warm-up iteration(s), "
                         f"got {base.iterations}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    handle = cluster or start_cluster(base.cluster, pools=True)
    results = []
    try:
        for name in variants:
            store = out / f"{name}.zarr"
            logger.info("bench: %s %s", name, table[name])
            Runner(configs[name], str(store), overwrite=True, cluster=handle).run()
            results.append(BenchResult(name, dict(table[name]), measure_store(store, skip),
                                       str(store)))
    finally:
        if cluster is None:
            handle.close()
    _write_csv(results, out / "results.csv")
    return results


def _write_csv(results: Sequence[BenchResult], path: Path) -> None:
    pools = sorted({p for r in results for p in r.stats.utilisation})
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["variant", "images_per_s", "images_per_gpu_s", "ideal_fraction",
                    "gpu_work_s", "seconds", "tag_s"]
                   + [f"utilisation_{p}" for p in pools] + [f"idle_s_{p}" for p in pools])
        for r in results:
            s = r.stats
            w.writerow([r.name, s.images_per_s, s.images_per_gpu_s, s.ideal_fraction,
                        s.gpu_work_s, s.seconds, s.tag_s]
                       + [s.utilisation.get(p, "") for p in pools]
                       + [s.idle_s.get(p, "") for p in pools])


def format_table(results: Sequence[BenchResult]) -> str:
    """One row per variant plus its throughput ratio to every other variant."""
    names = [r.name for r in results]
    head = (f"{'variant':<14}{'img/s':>8}{'img/GPU/s':>11}{'ideal':>7}"
            f"{'util r/t/c':>16}{'idle s r/t/c':>18}{'TAG s':>7}  " +
            "".join(f"{'/' + n:>{max(8, len(n) + 2)}}" for n in names))
    lines = [head, "-" * len(head)]

    def triple(d, fmt):
        return "/".join(fmt.format(d[p]) if p in d else "-" for p in (ROLLOUT, TRAINER, COLOCATED))

    for r in results:
        s = r.stats
        ratios = "".join(f"{s.images_per_s / o.stats.images_per_s:>{max(8, len(o.name) + 2)}.2f}"
                         for o in results)
        lines.append(f"{r.name:<14}{s.images_per_s:>8.2f}{s.images_per_gpu_s:>11.3f}"
                     f"{s.ideal_fraction:>7.2f}{triple(s.utilisation, '{:.2f}'):>16}"
                     f"{triple(s.idle_s, '{:.1f}'):>18}{s.tag_s:>7.1f}  {ratios}")
    return "\n".join(lines)
