"""Figures computed from a run's ``tasks`` records: throughput, the ideal bound,
pool utilisation and idle time ("bubbles").

The measured window runs from the end of iteration ``skip - 1`` (its optimizer step) to
the end of iteration ``n - 1 - drain``, so start-up (worker warm-up, the first version)
and, with ``drain``, the run's last iteration are left out.

The ideal bound is the throughput of a pipeline with no idle time at all: the GPU work
done, in seconds of a speed-1 GPU, spread over the GPUs' capacity (the sum of their
speeds). Every figure of it -- a measured run's, an emulated run's, a cost profile's, the
simulator's -- comes from :func:`ideal_bound`, and the fraction of it a run reaches from
:func:`ideal_fraction`. :func:`split_advice` compares it with what fixed pools allow, to
advise a rollout/trainer split.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

import numpy as np

from digenrl.vocabulary import (COLOCATED, DENOISE, GPU_KINDS, OPTIMIZE, ROLLOUT,
                                ROLLOUT_KINDS, TRAINER, TRAINING_KINDS)

__all__ = ["ideal_seconds", "ideal_bound", "ideal_fraction", "gpu_capacity", "WindowStats",
           "window_stats", "window_metrics", "optimize_stop", "busy_seconds", "busy_shares",
           "utilisation_timeline", "dispatch_overhead", "pools_served", "store_pools",
           "SplitAdvice", "split_advice"]


def ideal_seconds(gpu_work_s: float, capacity: float) -> float:
    """How long ``gpu_work_s`` seconds of GPU work (at speed 1) take on GPUs of summed
    speed ``capacity`` when none of them is ever idle: the work spread evenly."""
    return gpu_work_s / capacity


def ideal_bound(images: float, gpu_work_s: float, capacity: float) -> float:
    """The ideal bound in images/s: ``images`` made with ``gpu_work_s`` seconds of GPU
    work in their :func:`ideal_seconds` on ``capacity``. NaN without work."""
    if gpu_work_s <= 0:
        return float("nan")
    return images / ideal_seconds(gpu_work_s, capacity)


def ideal_fraction(images_per_s: float, ideal_images_per_s: float) -> float:
    """The fraction of the ideal bound (:func:`ideal_bound`) a throughput reaches."""
    return images_per_s / ideal_images_per_s


def gpu_capacity(workers: Iterable[str], speeds: Mapping[str, float] | None = None) -> float:
    """The capacity of ``workers`` for :func:`ideal_bound`: the sum of their speeds
    (``speeds`` by worker name; 1 for a worker it does not name)."""
    speeds = speeds or {}
    return sum(speeds.get(str(w), 1.0) for w in workers)


def pools_served(tagged: Mapping[str, Iterable[str]], pooled: bool) -> dict[str, list[str]]:
    """Worker names by the pool they serve: the ``rollout`` and ``trainer`` tags as they
    are when the mode uses pools, otherwise every tagged worker in one ``colocated`` pool."""
    if pooled:
        return {p: list(tagged.get(p, [])) for p in (ROLLOUT, TRAINER)}
    return {COLOCATED: [w for p in (ROLLOUT, TRAINER) for w in tagged.get(p, [])]}


def store_pools(attrs: Mapping[str, Any]) -> dict[str, list[str]]:
    """:func:`pools_served` for a run, from its store's attributes."""
    return pools_served(attrs["cluster"]["pools"], bool(attrs["schedule"]["pools"]))


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


def busy_shares(tasks, pool: str) -> dict[str, float]:
    """Each task kind's share of the GPU-busy seconds of the workers serving ``pool``
    (their GPU tasks, by the records' ``pool`` column), largest first; empty when they
    ran none."""
    g = tasks[tasks["gpu"]] if "gpu" in tasks else tasks[tasks["kind"].isin(GPU_KINDS)]
    g = g[g["pool"] == pool]
    seconds = (g["stop"] - g["start"]).groupby(g["kind"]).sum()
    total = float(seconds.sum())
    if not total > 0:
        return {}
    return {str(k): float(v) / total for k, v in seconds.sort_values(ascending=False).items()}


def window_metrics(records: list[dict], pools: Mapping[str, Iterable[str]], t0: float,
                   t1: float) -> dict[str, float]:
    """Per-pool GPU utilisation, TAG GPU-seconds and the mean wait of GPU tasks from
    ready to released, over an iteration's window ``[t0, t1]`` (the driver stores them
    with each iteration's metrics). ``records``: task records (:mod:`digenrl.records`)
    of the tasks that may overlap the window; ``pools``: worker names by pool."""
    import pandas as pd

    out = {f"utilisation_{p}": float("nan") for p in (ROLLOUT, TRAINER, COLOCATED)}
    out.update({"tag_seconds": 0.0, "gpu_wait_mean": float("nan")})
    if not records or t1 <= t0:
        return out
    df = pd.DataFrame(records).dropna(subset=["start", "stop"])
    busy = busy_seconds(df, t0, t1)
    for pool, names in pools.items():
        names = list(names)
        if names:
            out[f"utilisation_{pool}"] = sum(busy.get(w, 0.0) for w in names) / (
                len(names) * (t1 - t0))
    tag = df[df["tag"]]
    out["tag_seconds"] = float(_overlap(tag["start"].to_numpy(), tag["stop"].to_numpy(),
                                        t0, t1).sum())
    gpu = df[df["gpu"] & (df["finished"] > t0) & (df["finished"] <= t1)]
    if len(gpu):
        out["gpu_wait_mean"] = float((gpu["released"] - gpu["ready"]).mean())
    return out


def optimize_stop(records: Iterable[Mapping[str, Any]], iteration: int) -> float | None:
    """When iteration ``iteration``'s optimizer step stopped, if ``records`` hold it:
    the end of that iteration's window."""
    for r in records:
        if r["kind"] == OPTIMIZE and r["iteration"] == iteration and r["stop"]:
            return float(r["stop"])
    return None


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
    rat_s: float = 0.0                                            # RAT GPU-seconds

    @property
    def images_per_gpu_s(self) -> float:
        return self.images_per_s / self.gpus if self.gpus else float("nan")

    def as_dict(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        d["images_per_gpu_s"] = self.images_per_gpu_s
        return d


def window_stats(tasks, pools: Mapping[str, Iterable[str]], images_per_iteration: int,
                 skip: int = 1, *, drain: int = 0, time_scale: float = 1.0,
                 speeds: Mapping[str, float] | None = None,
                 ideal_images_per_s: float | None = None) -> WindowStats:
    """Throughput and utilisation of a run from its tasks table (a DataFrame).

    ``pools`` maps pool name -> worker names (from the store's cluster description);
    ``speeds`` worker name -> relative speed (1 when absent): a busy second of a worker
    of speed ``s`` is ``s`` seconds of speed-1 GPU work, and the ideal bound divides the
    work by the sum of the speeds (:func:`ideal_bound`). Emulated runs pass their
    ``time_scale`` (figures are then in the profile's time) and the profile's own ideal
    bound.
    """
    speeds = speeds or {}
    opt = tasks[tasks["kind"] == OPTIMIZE].sort_values("iteration")
    ends = opt.groupby("iteration")["stop"].max()
    its = sorted(int(i) for i in ends.index)
    if len(its) <= skip + drain:
        raise ValueError(f"skip + drain: expected fewer than the {len(its)} finished "
                         f"iterations, got {skip} + {drain}")
    its = its[:len(its) - drain]
    t0 = float(ends[its[skip - 1]]) if skip else float(tasks["start"].min())
    t1 = float(ends[its[-1]])
    n_it = len(its) - skip
    seconds = (t1 - t0) / time_scale
    busy = {w: b / time_scale for w, b in busy_seconds(tasks, t0, t1).items()}
    workers = {p: [str(w) for w in ws] for p, ws in pools.items() if ws}
    all_workers = [w for ws in workers.values() for w in ws]
    gpus = len(all_workers)
    work = sum(b * speeds.get(w, 1.0) for w, b in busy.items())
    images = images_per_iteration * n_it
    ideal = ideal_images_per_s or ideal_bound(images, work, gpu_capacity(all_workers, speeds))
    util, idle = {}, {}
    for pool, ws in workers.items():
        b = sum(busy.get(w, 0.0) for w in ws)
        util[pool] = b / (len(ws) * seconds)
        idle[pool] = len(ws) * seconds - b
    lent = {}
    for column in ("tag", "rat"):
        rows = tasks[tasks[column]] if column in tasks else tasks.iloc[:0]
        lent[column] = float(_overlap(rows["start"].to_numpy(), rows["stop"].to_numpy(),
                                      t0, t1).sum()) / time_scale
    return WindowStats(iterations=n_it, seconds=seconds, images=images,
                       images_per_s=images / seconds, gpus=gpus, gpu_work_s=work,
                       ideal_images_per_s=ideal,
                       ideal_fraction=ideal_fraction(images / seconds, ideal),
                       utilisation=util, idle_s=idle, tag_s=lent["tag"], rat_s=lent["rat"])


@dataclass
class SplitAdvice:
    """The rollout/trainer split the ideal bound favours for a workload.

    With the pools as walls an iteration takes at least ``max(rollout_s / R,
    training_s / T)`` on ``R`` rollout and ``T`` trainer GPUs, against the ideal
    ``(rollout_s + training_s) / (R + T)``; the best split minimises the former.
    """

    rollout_s: float          # GPU-seconds of rollout work per iteration (speed 1)
    training_s: float         # GPU-seconds of training work per iteration (speed 1)
    current: tuple[int, int]  # (rollout, trainer) GPUs of the run
    best: tuple[int, int]     # the split with the highest bound

    @staticmethod
    def bound(rollout_s: float, training_s: float, split: tuple[int, int]) -> float:
        """The fraction of the ideal bound reachable with ``split`` as walls: an
        iteration's :func:`ideal_seconds` over its time with the walls."""
        r, t = split
        return ideal_seconds(rollout_s + training_s, r + t) / max(rollout_s / r, training_s / t)

    @classmethod
    def of(cls, rollout_s: float, training_s: float, current: tuple[int, int]) -> "SplitAdvice":
        n = sum(current)
        best = max(((r, n - r) for r in range(1, n)),
                   key=lambda s: (cls.bound(rollout_s, training_s, s), -abs(s[0] - current[0])))
        return cls(rollout_s, training_s, current, best)

    def text(self) -> str:
        (r, t), (br, bt) = self.current, self.best
        share = self.rollout_s / (self.rollout_s + self.training_s)
        return (f"pool sizing: rollout work {share:.0%} of the GPU work; with pools as walls "
                f"{r} rollout + {t} trainer reach at most "
                f"{self.bound(self.rollout_s, self.training_s, self.current):.2f} of the ideal "
                f"bound, {br} + {bt} (the split the bound favours) "
                f"{self.bound(self.rollout_s, self.training_s, self.best):.2f}; TAG and RAT "
                f"lend the difference")


def split_advice(tasks, pools: Mapping[str, Iterable[str]],
                 speeds: Mapping[str, float] | None = None) -> SplitAdvice | None:
    """:class:`SplitAdvice` from a run's measured task times (every GPU task, weighed by
    its worker's speed, counted as rollout or training work by its kind wherever it
    ran); None without both pools."""
    speeds = speeds or {}
    r, t = len(list(pools.get(ROLLOUT, []))), len(list(pools.get(TRAINER, [])))
    if not r or not t:
        return None
    g = tasks[tasks["gpu"]] if "gpu" in tasks else tasks[tasks["kind"].isin(GPU_KINDS)]
    seconds = (g["stop"] - g["start"]) * g["worker_name"].astype(str).map(
        lambda w: speeds.get(w, 1.0))
    its = max(int(g["iteration"].max()) + 1, 1) if len(g) else 1
    rollout = float(seconds[g["kind"].isin(ROLLOUT_KINDS)].sum()) / its
    training = float(seconds[g["kind"].isin(TRAINING_KINDS)].sum()) / its
    if rollout <= 0 or training <= 0:
        return None
    return SplitAdvice.of(rollout, training, (r, t))


def dispatch_overhead(tasks, t0: float | None = None, t1: float | None = None) -> dict[str, float]:
    """What scheduling costs each GPU task in GPU time, measured (wall-clock ms).

    A task's *idle* is the time its worker's GPU stayed free before it although it could
    have run: from the later of the worker finishing its previous GPU task and the task
    becoming eligible (inputs done, past every hold of the policy) until its start.

    * ``overhead_ms``: the mean idle of every GPU task -- hearing that the worker is free,
      deciding, the message to the worker, fetching inputs, the worker picking it up;
    * ``dask_ms``: the same without the time the worker spent fetching data from other
      workers meanwhile (a new policy version's weights, a chunk's latents: data the
      design moves, paid on any system): Dask's own cost, of which
      ``denoise_dask_ms`` is the mean (and ``denoise_dask_median_ms`` the median) over
      denoise tasks -- what a denoising step pays for being scheduled;
    * ``queued_ms`` / ``fresh_ms``: the mean idle of tasks released while the worker's
      previous GPU task still ran (they wait in its second slot, so only the worker's
      own hand-over shows) and of the others (released to a free GPU: the whole round
      trip) -- the two latencies the simulator models;
    * ``notify_ms``: task stop to the scheduler handling its completion; ``denoise_ms``:
      the mean denoise task.
    """
    g = tasks[tasks["gpu"]] if "gpu" in tasks else tasks[tasks["kind"].isin(GPU_KINDS)]
    g = g.sort_values(["worker_name", "start"])
    prev_stop = g.groupby("worker_name")["stop"].shift(1).fillna(-np.inf).to_numpy()
    eligible = g["eligible"].to_numpy() if "eligible" in g else g["released"].to_numpy()
    could_start = np.maximum(eligible, prev_stop)
    idle = np.clip(g["start"].to_numpy() - could_start, 0.0, None)
    if "transfer_start" in tasks and "transfer_stop" in tasks:
        fetch = _fetching(tasks, g["worker_name"].to_numpy(), could_start, g["start"].to_numpy())
    elif "transfer" in g:
        fetch = np.nan_to_num(g["transfer"].to_numpy())
    else:
        fetch = np.zeros(len(g))
    dask = np.clip(idle - fetch, 0.0, None)
    queued = g["released"].to_numpy() < prev_stop
    notify = g["finished"].to_numpy() - g["stop"].to_numpy()
    mask = np.ones(len(g), bool)
    if t0 is not None:
        mask &= g["stop"].to_numpy() > t0
    if t1 is not None:
        mask &= g["stop"].to_numpy() <= t1
    den = mask & (g["kind"] == DENOISE).to_numpy()

    def ms(values, m, f=np.mean):
        return float(f(values[m]) * 1000) if m.any() else float("nan")

    durations = g["stop"].to_numpy() - g["start"].to_numpy()
    return {
        "tasks": int(mask.sum()),
        "overhead_ms": ms(idle, mask),
        "dask_ms": ms(dask, mask),
        "denoise_dask_ms": ms(dask, den),
        "denoise_dask_median_ms": ms(dask, den, np.median),
        "queued_ms": ms(idle, mask & queued),
        "fresh_ms": ms(idle, mask & ~queued),
        "notify_ms": ms(notify, mask),
        "denoise_ms": ms(durations, den),
    }


def _fetching(tasks, workers: np.ndarray, t0: np.ndarray, t1: np.ndarray) -> np.ndarray:
    """Seconds of ``[t0, t1]`` in which each worker was fetching data from others.

    Dask attaches a fetch to one dependent of the fetched data, not necessarily the task
    that waited for it (a new policy version's weights are read by every step of the
    iteration), so the fetches of all a worker's tasks are pooled: the union of their
    spans, measured over each window.
    """
    out = np.zeros(len(workers))
    spans = tasks.dropna(subset=["transfer_start", "transfer_stop"])
    names = spans["worker_name"].to_numpy()
    starts, stops = spans["transfer_start"].to_numpy(), spans["transfer_stop"].to_numpy()
    for name in np.unique(workers):
        rows = names == name
        s, e = starts[rows], stops[rows]
        if not len(s):
            continue
        order = np.argsort(s)
        merged: list[list[float]] = []
        for a, b in zip(s[order], e[order]):
            if merged and a <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], b)
            else:
                merged.append([a, b])
        m = np.asarray(merged)
        before = np.concatenate([[0.0], np.cumsum(m[:, 1] - m[:, 0])])

        def covered(x: np.ndarray) -> np.ndarray:
            # Fetching seconds up to time x: whole spans before it, part of the one it is in.
            i = np.searchsorted(m[:, 0], x, side="right")
            j = np.maximum(i - 1, 0)
            part = np.where(i > 0, np.clip(x - m[j, 0], 0.0, m[j, 1] - m[j, 0]), 0.0)
            return before[j] * (i > 0) + part

        sel = workers == name
        out[sel] = np.clip(covered(t1[sel]) - covered(t0[sel]), 0.0, None)
    return out


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
