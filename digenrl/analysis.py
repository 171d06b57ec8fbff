"""Figures computed from a run's ``tasks`` records: throughput, the ideal bound,
pool utilisation and idle time ("bubbles").

The measured window runs from the end of iteration ``skip - 1`` (its optimizer step) to
the end of the last iteration, so start-up (worker warm-up, the first version) is left
out. The ideal bound is the total GPU work done in that window divided by the number of
GPU slots: a pipeline with no idle time at all.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

import numpy as np

__all__ = ["WindowStats", "window_stats", "busy_seconds", "utilisation_timeline", "GPU_KINDS"]

#: Kinds that hold a GPU slot (a reward does too when its reward needs the GPU).
GPU_KINDS = ("denoise", "decode", "grad", "optimize")


def _overlap(start: np.ndarray, stop: np.ndarray, t0: float, t1: float) -> np.ndarray:
    return np.clip(np.minimum(stop, t1) - np.maximum(start, t0), 0.0, None)


def busy_seconds(tasks, t0: float, t1: float) -> dict[str, float]:
    """GPU-busy seconds of each worker (by name) within ``[t0, t1]``."""
    g = tasks[tasks["gpu"]] if "gpu" in tasks else tasks[tasks["kind"].isin(GPU_KINDS)]
    out: dict[str, float] = {}
    for name, rows in g.groupby("worker_name"):
        out[str(name)] = float(_overlap(rows["start"].to_numpy(), rows["stop"].to_numpy(),
                                        t0, t1).sum())
    return out


@dataclass
class WindowStats:
    iterations: int
    seconds: float
    images: int
    images_per_s: float
    gpus: int
    gpu_work_s: float
    ideal_images_per_s: float
    ideal_fraction: float
    utilisation: dict[str, float] = field(default_factory=dict)   # pool -> busy fraction
    idle_s: dict[str, float] = field(default_factory=dict)        # pool -> idle GPU-seconds
    tag_s: float = 0.0                                            # TAG GPU-seconds

    @property
    def images_per_gpu_s(self) -> float:
        return self.images_per_s / self.gpus if self.gpus else float("nan")

    def as_dict(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        d["images_per_gpu_s"] = self.images_per_gpu_s
        return d


def window_stats(tasks, pools: Mapping[str, Iterable[str]], images_per_iteration: int,
                 skip: int = 1) -> WindowStats:
    """Throughput and utilisation of a run from its tasks table (a DataFrame).

    ``pools`` maps pool name -> worker names (from the store's cluster description).
    """
    opt = tasks[tasks["kind"] == "optimize"].sort_values("iteration")
    ends = opt.groupby("iteration")["stop"].max()
    its = sorted(int(i) for i in ends.index)
    if len(its) <= skip:
        raise ValueError(f"skip: expected fewer than the {len(its)} finished iterations, "
                         f"got {skip}")
    t0, t1 = float(ends[its[skip - 1]]) if skip else float(tasks["start"].min()), float(ends[its[-1]])
    n_it = len(its) - skip
    seconds = t1 - t0
    busy = busy_seconds(tasks, t0, t1)
    workers = {p: [str(w) for w in ws] for p, ws in pools.items() if ws}
    gpus = sum(len(ws) for ws in workers.values())
    work = sum(busy.values())
    images = images_per_iteration * n_it
    ideal = images / (work / gpus) if work > 0 else float("nan")
    util, idle = {}, {}
    for pool, ws in workers.items():
        b = sum(busy.get(w, 0.0) for w in ws)
        util[pool] = b / (len(ws) * seconds)
        idle[pool] = len(ws) * seconds - b
    tag = tasks[tasks["tag"]] if "tag" in tasks else tasks.iloc[:0]
    tag_s = float(_overlap(tag["start"].to_numpy(), tag["stop"].to_numpy(), t0, t1).sum())
    return WindowStats(iterations=n_it, seconds=seconds, images=images,
                       images_per_s=images / seconds, gpus=gpus, gpu_work_s=work,
                       ideal_images_per_s=ideal, ideal_fraction=(images / seconds) / ideal,
                       utilisation=util, idle_s=idle, tag_s=tag_s)


def utilisation_timeline(tasks, pools: Mapping[str, Iterable[str]], bins: int = 100):
    """Busy fraction of each pool over time: ``(bin_starts, {pool: fractions})``."""
    t0, t1 = float(tasks["start"].min()), float(tasks["stop"].max())
    edges = np.linspace(t0, t1, bins + 1)
    width = edges[1] - edges[0]
    g = tasks[tasks["gpu"]] if "gpu" in tasks else tasks[tasks["kind"].isin(GPU_KINDS)]
    out = {}
    for pool, ws in pools.items():
        ws = [str(w) for w in ws]
        if not ws:
            continue
        rows = g[g["worker_name"].astype(str).isin(ws)]
        s, e = rows["start"].to_numpy(), rows["stop"].to_numpy()
        frac = np.array([_overlap(s, e, a, a + width).sum() for a in edges[:-1]])
        out[pool] = frac / (len(ws) * width)
    return edges[:-1], out
