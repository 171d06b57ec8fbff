"""PNG plots of a run: per-worker timelines by task kind, reward curve, pool utilisation,
staleness histogram, the held-out evaluation curve and sample grids. Matplotlib with the
non-interactive Agg backend."""

from __future__ import annotations

from pathlib import Path
from typing import Iterable, Mapping

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
import numpy as np  # noqa: E402

from digenrl.figures.analysis import utilisation_timeline  # noqa: E402
from digenrl.schedulers.palette import KIND_COLOURS  # noqa: E402
from digenrl.store import REWARD_COLUMN  # noqa: E402

#: The tasks records' columns of work lent across pools, and their hatch: rollout tasks
#: on trainers (TAG) and grads on rollout workers (RAT).
LENT_HATCHES = {"tag": "//", "rat": "xx"}

__all__ = ["KIND_COLOURS", "timeline_png", "reward_png", "utilisation_png", "staleness_png",
           "eval_png", "eval_grid_png", "captioned_grid", "grid_image", "CAPTION_CHARS",
           "EVAL_GRID_TITLE", "beside_sources", "edits_png"]


def timeline_png(tasks, path: str | Path, *, title: str = "",
                 pools: Mapping[str, Iterable[str]] | None = None) -> Path:
    """One row per worker (grouped by pool), a bar per task coloured by its kind;
    TAG tasks hatched ``//``, RAT tasks ``xx``. White space is idle time."""
    t0 = float(tasks["start"].min())
    names = list(dict.fromkeys(
        [str(w) for ws in (pools or {}).values() for w in ws]
        + sorted(map(str, tasks["worker_name"].unique()))))
    row = {n: i for i, n in enumerate(names)}
    fig, ax = plt.subplots(figsize=(14, max(3.2, 0.45 * len(names) + 1.6)))
    for kind, g in tasks.groupby("kind"):
        colour = KIND_COLOURS.get(kind, "#000000")
        gpu = g[g["gpu"]] if "gpu" in g else g
        cpu = g.drop(gpu.index)
        for part, height in ((gpu, 0.8), (cpu, 0.3)):
            if part.empty:
                continue
            y = [row[str(w)] for w in part["worker_name"]]
            ax.barh(y, part["stop"] - part["start"], left=part["start"] - t0, height=height,
                    color=colour, label=kind if height == 0.8 or gpu.empty else None,
                    linewidth=0)
        for column, hatch in LENT_HATCHES.items():
            if column not in g:
                continue
            lent = g[g[column]]
            if not lent.empty:
                ax.barh([row[str(w)] for w in lent["worker_name"]], lent["stop"] - lent["start"],
                        left=lent["start"] - t0, height=0.8, fill=False, hatch=hatch,
                        edgecolor="black", linewidth=0)
    ax.set_yticks(range(len(names)), names)
    ax.invert_yaxis()
    ax.set_xlabel("seconds since the run's first task")
    ax.set_title(title or "tasks by worker (hatched //: trainer-assisted generation, "
                          "xx: rollout-assisted training)")
    handles, labels = ax.get_legend_handles_labels()
    uniq = dict(zip(labels, handles))
    # Beside the axes, so it never hides the bars or the axis label.
    ax.legend(uniq.values(), uniq.keys(), ncol=1 if len(names) >= 8 else 2,
              loc="upper left", bbox_to_anchor=(1.005, 1.0), fontsize=8, frameon=False)
    fig.tight_layout()
    return _save(fig, path)


def reward_png(metrics, samples, path: str | Path, *, title: str = REWARD_COLUMN) -> Path:
    fig, ax = plt.subplots(figsize=(7, 4))
    it = metrics["iteration"].values if "iteration" in metrics.coords else np.arange(
        metrics.sizes["iteration"])
    r = samples[REWARD_COLUMN].values
    ax.scatter(np.repeat(it, r.shape[1]), r.ravel(), s=4, alpha=0.3, color="#1f77b4",
               label="samples")
    ax.plot(it, metrics["reward_mean"].values, color="#d62728", label="mean")
    ax.set_xlabel("iteration")
    ax.set_ylabel(REWARD_COLUMN)
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    return _save(fig, path)


def utilisation_png(tasks, pools: Mapping[str, Iterable[str]], path: str | Path,
                    bins: int = 120) -> Path:
    starts, frac = utilisation_timeline(tasks, pools, bins)
    fig, ax = plt.subplots(figsize=(9, 3.5))
    t0 = starts[0]
    for pool, f in frac.items():
        ax.plot(starts - t0, f, label=pool, drawstyle="steps-post")
    ax.set_ylim(0, 1.05)
    ax.set_xlabel("seconds since the run's first task")
    ax.set_ylabel("GPU busy fraction")
    ax.set_title("pool utilisation")
    ax.legend()
    fig.tight_layout()
    return _save(fig, path)


def staleness_png(samples, path: str | Path) -> Path:
    s = (samples["trained_version"] - samples["behaviour_version"]).values.ravel()
    fig, ax = plt.subplots(figsize=(5, 3.5))
    values, counts = np.unique(s, return_counts=True)
    ax.bar(values, counts, color="#9467bd")
    ax.set_xticks(values)
    ax.set_xlabel("staleness (trained version - behaviour version)")
    ax.set_ylabel("trained samples")
    ax.set_title("staleness of trained samples")
    fig.tight_layout()
    return _save(fig, path)


def eval_png(evaluation, metrics, path: str | Path) -> Path:
    """The held-out evaluation: each prompt's reward and the mean per evaluated policy
    version, with each iteration's training reward (its SDE samples, mostly of the
    policy version of the same number) for comparison."""
    version = evaluation["version"].values
    reward = evaluation[REWARD_COLUMN].values
    valid = evaluation["valid"].values
    versions = np.unique(version)
    means = [np.mean(reward[(version == v) & valid]) if ((version == v) & valid).any()
             else np.nan for v in versions]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.scatter(version[valid], reward[valid], s=6, alpha=0.35, color="#ff7f0e",
               label="held-out prompts")
    ax.plot(versions, means, marker="o", color="#d62728", label="evaluation mean (ODE)")
    if "reward_mean" in metrics and metrics.sizes.get("iteration", 0):
        ax.plot(np.arange(metrics.sizes["iteration"]), metrics["reward_mean"].values,
                color="#1f77b4", alpha=0.8, label="training mean (iteration = version)")
    ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    ax.set_xlabel("policy version")
    ax.set_ylabel(REWARD_COLUMN)
    ax.set_title("held-out evaluation")
    ax.legend()
    fig.tight_layout()
    return _save(fig, path)


#: The title of an evaluated version's grid.
EVAL_GRID_TITLE = "policy version {version}: held-out samples (ODE)"
#: The characters of a prompt a grid caption shows.
CAPTION_CHARS = 28


def _caption(prompt: str, reward: float, valid: bool) -> str:
    text = prompt if len(prompt) <= CAPTION_CHARS else prompt[:CAPTION_CHARS - 1] + "\u2026"
    return f"{text}\n{reward:.4f}" if valid else f"{text}\n(no reward)"


def beside_sources(images: np.ndarray, index: np.ndarray, table: list[dict]) -> np.ndarray:
    """Edited images ``(n, H, W, 3)`` each with its source image on its left, resized to
    ``H x W`` (``index``: each one's position in the run's source table of ``path`` and
    ``sha256``; -1 for none). A source that cannot be read as the run read it -- moved,
    or changed since -- shows as grey."""
    from PIL import Image

    from digenrl.prompts import SourceFile, read_source

    n, h, w = images.shape[:3]
    left = np.full((n, h, w, 3), 128, np.uint8)
    for k, j in enumerate(np.asarray(index).tolist()):
        if j < 0:
            continue
        try:
            pixels = read_source(SourceFile(table[j]["path"], table[j]["sha256"]))
        except (OSError, ValueError):
            continue
        left[k] = np.asarray(Image.fromarray(pixels).resize((w, h), Image.Resampling.BICUBIC))
    return np.concatenate([left, images], axis=2)


def edits_png(samples, table: list[dict], count: int, path: str | Path) -> Path:
    """The last stored iteration's first ``count`` samples, each beside its source image
    (left) and captioned with its prompt (truncated) and reward: what an editing run
    made of its sources."""
    i = samples.sizes["iteration"] - 1
    last = samples.isel(iteration=i)
    pick = np.arange(min(count, last.sizes["sample"]))
    return _save(captioned_grid(beside_sources(last["image"].values[pick],
                                               last["source"].values[pick], table),
                                last["prompt"].values[pick], last[REWARD_COLUMN].values[pick],
                                last["valid"].values[pick],
                                f"iteration {i}: source | edit"), path)


def eval_grid_png(evaluation, version: int, count: int, path: str | Path,
                  sources: list[dict] | None = None) -> Path:
    """The first ``count`` held-out prompts' samples of one evaluated ``version``, each
    captioned with its prompt (truncated) and reward; a video's sample is the strip of
    frames the store keeps; an edit (with the run's source table ``sources``) beside its
    source image."""
    mine = np.flatnonzero(evaluation["version"].values == version)
    mine = mine[np.argsort(evaluation["prompt_index"].values[mine], kind="stable")][:count]
    images = evaluation["image"].values[mine]
    if sources and "source" in evaluation:
        images = beside_sources(images, evaluation["source"].values[mine], sources)
    return _save(captioned_grid(images,
                                evaluation["prompt"].values[mine],
                                evaluation[REWARD_COLUMN].values[mine],
                                evaluation["valid"].values[mine],
                                EVAL_GRID_TITLE.format(version=version)), path)


def captioned_grid(images: np.ndarray, prompts, rewards, valid, title: str) -> Figure:
    """Samples ``(n, H, W, 3)`` in rows of up to four, each captioned with its prompt
    (truncated) and reward. A figure of its own, outside pyplot's state: a thread may
    draw one (:func:`grid_image`) while another does."""
    cols = min(len(images), 4)
    rows = -(-len(images) // cols)
    aspect = images.shape[2] / images.shape[1]   # a frame strip is wide
    fig = Figure(figsize=(2.4 * aspect * cols, 2.9 * rows))
    axes = fig.subplots(rows, cols, squeeze=False)
    for ax in axes.ravel():
        ax.axis("off")
    for ax, image, prompt, reward, ok in zip(axes.ravel(), images, prompts, rewards, valid):
        ax.imshow(image, interpolation="nearest")
        ax.set_title(_caption(str(prompt), float(reward), bool(ok)), fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig


def grid_image(images: np.ndarray, prompts, rewards, valid, title: str) -> np.ndarray:
    """:func:`captioned_grid` drawn as an RGB picture ``(H, W, 3)`` of uint8."""
    canvas = FigureCanvasAgg(captioned_grid(images, prompts, rewards, valid, title))
    canvas.draw()
    return np.asarray(canvas.buffer_rgba())[..., :3].copy()


def _save(fig, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)
    return path
