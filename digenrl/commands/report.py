"""``digenrl report STORE``: PNG plots and a text summary of a finished or running run.

Writes ``reward.png`` (every sample's reward and the mean per iteration),
``timeline.png`` (one row per worker, a bar per task coloured by kind, hatched where a
trainer generated (TAG) and, cross-hatched, where a rollout worker trained (RAT)), ``utilisation.png`` (busy fraction of each pool over time) and
``staleness.png`` (how many versions old the trained samples were), ``profile.yaml`` (the
run's measured cost profile, for ``digenrl simulate``: :mod:`digenrl.sim.measured`), for a run with
held-out evaluation ``eval.png`` (the evaluation curve) and ``eval-v{N}.png`` per
evaluated policy version (its first ``eval.grid`` held-out samples, captioned), for an
instruction-editing run ``edits.png`` (the last iteration's first ``eval.grid`` samples,
each beside its source image; an edit in ``eval-v{N}.png`` likewise), plus
``summary.txt`` -- the summary is also returned for printing. A running store shows its
complete iterations.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import yaml

from digenrl.algorithms import ALGORITHMS, DEFAULT_ALGORITHM
from digenrl.figures.analysis import (busy_shares, dispatch_overhead, split_advice, store_pools,
                              window_stats)
from digenrl.schedulers.parallelism import memory_bound
from digenrl.sim.measured import measured_profile
from digenrl.config import EvalConfig, stored_section
from digenrl.store import (EVAL_GROUP, REWARD_COLUMN, SOURCES_ATTRIBUTE, open_run,
                           evaluation_reward_means, reward_column, reward_columns)
from digenrl.vocabulary import COLOCATED, ROLLOUT

__all__ = ["write_report", "summarise"]


def cpu_line(cpu: np.ndarray, model: np.ndarray) -> str:
    """What the run's processes spent on the CPU beside the model's arithmetic, per
    iteration after the first (which imports, loads and builds)."""
    total, in_model = float(np.nansum(cpu)), float(np.nansum(model))
    beside = total - in_model
    share = f"{beside / in_model:.0%} of the model's own" if in_model > 0 else "no model time"
    return (f"CPU per iteration after the first: {total / len(cpu):.2f} s in all processes "
            f"(driver, scheduler, workers, nannies), {in_model / len(cpu):.2f} s of it in "
            f"the model; beside the model {beside / len(cpu):.2f} s = {share}")


def summarise(ds, profile: Path | None = None) -> str:
    """The summary's lines; ``profile``: where the run's measured cost profile was
    written (named with the command that simulates other splits on it)."""
    attrs = ds["metrics"].attrs["digenrl"]
    m = ds["metrics"]
    n = m.sizes.get("iteration", 0)
    sched = attrs["schedule"]
    algorithm = attrs.get("algorithm", DEFAULT_ALGORITHM)
    coupled = algorithm not in ALGORITHMS or ALGORITHMS[algorithm].coupled
    lines = [f"run {attrs.get('run')}: {attrs.get('workload', 'rl')} workload, "
             f"algorithm {algorithm} ({'coupled' if coupled else 'decoupled'}), mode "
             f"{sched['mode']} (gap={sched['gap']} tsp={sched['tsp']} tag={sched['tag']} "
             f"rat={sched.get('rat', False)} max_staleness={sched['max_staleness']}), {n} complete iterations"]
    pools = store_pools(attrs)
    lines.append("workers: " + ", ".join(f"{len(w)} {p}" for p, w in pools.items()))
    if n == 0:
        return "\n".join(lines)
    if "reward_mean" in m:
        r = m.reward_mean.values
        k = min(5, n)
        lines.append(f"reward: first {k} iterations {np.nanmean(r[:k]):.4f}, last {k} "
                     f"{np.nanmean(r[-k:]):.4f} (change {np.nanmean(r[-k:]) - np.nanmean(r[:k]):+.4f})")
        if coupled:
            lines.append(f"ratio_dev (max |ratio - 1| at the first on-policy micro-step): "
                         f"{np.nanmax(m.ratio_dev.values):.2e}")
        else:  # no sampling log-probabilities: no trajectory, no policy ratio to check
            lines.append("trajectories: none kept (a decoupled algorithm trains on each "
                         "sample's final latent; no per-step log-probabilities)")
    s = ds["samples"]
    if "trained_version" in s:
        st = (s.trained_version - s.behaviour_version).values.ravel()
        values, counts = np.unique(st, return_counts=True)
        lines.append("staleness of trained samples: " + ", ".join(
            f"{v}: {c}" for v, c in zip(values, counts)))
    tasks = ds["tasks"].to_dataframe()
    if n >= 2 and len(tasks):
        ws = window_stats(tasks, pools, attrs["derived"]["images_per_iteration"], skip=1,
                          time_scale=float(attrs.get("time_scale", 1.0)))
        lines.append(f"throughput after the first iteration: {ws.images_per_s:.3f} images/s "
                     f"({ws.images_per_gpu_s:.4f} per GPU), {ws.ideal_fraction:.2f} of the "
                     f"ideal bound (GPU work / GPUs)")
        lines.append("utilisation: " + ", ".join(f"{p} {u:.2f}" for p, u in ws.utilisation.items())
                     + f"; trainer-assisted generation {ws.tag_s:.1f} GPU-s, "
                       f"rollout-assisted training {ws.rat_s:.1f} GPU-s")
        for pool in (ROLLOUT, COLOCATED):
            shares = busy_shares(tasks, pool)
            if shares:
                lines.append(f"{pool} pool's GPU-busy time by kind: " + ", ".join(
                    f"{k} {v:.3f}" for k, v in shares.items()))
        advice = split_advice(tasks, pools)
        if advice is not None:
            lines.append(advice.text())
        if profile is not None:
            # (Without --splits the simulator runs the profile's own split: the run's.)
            splits = "" if advice is None else " --splits " + ",".join(
                sorted({f"{r}:{t}" for r, t in (advice.current, advice.best)}))
            lines.append(f"measured costs: {profile} (other splits, modes and scales on "
                         f"this workload: digenrl simulate {profile}{splits} --variants "
                         f"digenrl,digenrl-no-rat,digenrl-no-tag,disaggregated)")
        o = dispatch_overhead(tasks)
        lines.append(f"GPU idle before a GPU task that could run: {o['overhead_ms']:.1f} ms, "
                     f"{o['dask_ms']:.1f} ms without fetching inputs; Dask's cost per denoise "
                     f"task {o['denoise_dask_ms']:.1f} ms (median "
                     f"{o['denoise_dask_median_ms']:.1f}) against a mean denoise task of "
                     f"{o['denoise_ms']:.1f} ms")
    if "context_parallel_mean" in m:
        mean, top = m.context_parallel_mean.values, m.context_parallel_max.values
        probed = [i for i, p in enumerate(m.context_parallel_probes.values) if p > 0]
        lines.append("context parallelism (auto), each iteration's mean and highest degree: "
                     + ", ".join(f"{a:g}/{b:g}" for a, b in zip(mean, top))
                     + (f"; a degree not measured before was probed in iterations {probed}"
                        if probed else "")
                     + _memory_bound(m))
    if n >= 2 and "cpu_seconds" in m:
        lines.append(cpu_line(m.cpu_seconds.values[1:], m.model_cpu_seconds.values[1:]))
    e = ds[EVAL_GROUP]
    if e.sizes.get("entry", 0):
        evals = [f"v{v} {np.nanmean(e[REWARD_COLUMN].values[e.version.values == v]):.4f}"
                 for v in np.unique(e.version.values)]
        lines.append("held-out evaluation (mean reward per policy version): "
                     + ", ".join(evals))
        rows = {c: e[c].values for c in e.data_vars if c != "image"}
        per_reward = evaluation_reward_means(rows)
        for name in reward_columns(rows):
            means = [f"v{v} {m[name]:.4f}" for v, m in per_reward.items() if name in m]
            if means:
                lines.append(f"held-out {reward_column(name)} (mean per policy version): "
                             + ", ".join(means))
    kinds = tasks.groupby("kind").size().to_dict() if len(tasks) else {}
    lines.append("tasks: " + ", ".join(f"{k} {v}" for k, v in sorted(kinds.items())))
    return "\n".join(lines)


def write_report(store: str | Path, out_dir: str | Path | None = None) -> tuple[list[Path], str]:
    from digenrl.figures import plots

    ds = open_run(store)
    out = Path(out_dir) if out_dir is not None else Path(str(store).rstrip("/") + "-report")
    out.mkdir(parents=True, exist_ok=True)
    attrs = ds["metrics"].attrs["digenrl"]
    written = []
    tasks = ds["tasks"].to_dataframe()
    if REWARD_COLUMN in ds["samples"] and ds["metrics"].sizes.get("iteration", 0):
        written.append(plots.reward_png(ds["metrics"], ds["samples"], out / "reward.png"))
    if len(tasks):
        written.append(plots.timeline_png(tasks, out / "timeline.png", pools=store_pools(attrs)))
        written.append(plots.utilisation_png(tasks, store_pools(attrs), out / "utilisation.png"))
    if "trained_version" in ds["samples"] and ds["samples"].sizes.get("iteration", 0):
        written.append(plots.staleness_png(ds["samples"], out / "staleness.png"))
    evaluation = ds[EVAL_GROUP]
    grid = stored_section(attrs.get("config"), EvalConfig).grid  # samples per grid
    if evaluation.sizes.get("entry", 0):
        written.append(plots.eval_png(evaluation, ds["metrics"], out / "eval.png"))
        for v in np.unique(evaluation["version"].values):
            written.append(plots.eval_grid_png(evaluation, int(v), grid,
                                               out / f"eval-v{int(v)}.png",
                                               attrs.get(SOURCES_ATTRIBUTE)))
    samples = ds["samples"]
    if ("source" in samples and "image" in samples
            and samples.sizes.get("iteration", 0)):
        written.append(plots.edits_png(samples, attrs[SOURCES_ATTRIBUTE], grid,
                                       out / "edits.png"))
    profile = None
    if ds["metrics"].sizes.get("iteration", 0) >= 2 and len(tasks):
        profile = out / "profile.yaml"
        profile.write_text(yaml.safe_dump(
            measured_profile(tasks, ds["metrics"], attrs, name=Path(str(store)).stem),
            sort_keys=False))
        written.append(profile)
    text = summarise(ds, profile)
    (out / "summary.txt").write_text(text + "\n")
    written.append(out / "summary.txt")
    return written, text


def _memory_bound(m) -> str:
    """The memory ``auto`` kept a chunk within, in its newest iteration (empty where no
    GPU memory was known)."""
    if "context_parallel_free_gb" not in m:
        return ""
    free, sample = m.context_parallel_free_gb.values, m.context_parallel_sample_gb.values
    known = np.isfinite(free) & np.isfinite(sample)
    if not known.any():
        return ""
    i = int(np.flatnonzero(known)[-1])
    return f"; {memory_bound(sample[i], free[i])} (iteration {i})"
