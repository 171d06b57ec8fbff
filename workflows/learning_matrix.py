"""The learning matrix: every algorithm (and Flow-GRPO's dynamics and an SDE window) at
the defaults a user gets, on the embedded default model, over seeds, prompt sets and
modes; a table of gains in standard errors and a PNG of the reward curves.

    python workflows/learning_matrix.py --out runs/matrix
    python workflows/learning_matrix.py --cells nft --seeds 11 --modes digenrl

Each cell runs ``workflows/configs/tiny.yaml`` with ``algorithm.*`` of its row, ``seed``,
``data.prompt_set`` and ``schedule.mode`` set, for ``--iterations`` iterations (the
learning rate, beta and the other per-algorithm settings are the algorithm's defaults).
Its gain is the mean reward of the last four iterations minus the first four's, in
standard errors of that difference from the per-sample rewards
(:func:`digenrl.figures.learning.learning`); a cell learns with a gain above 3 standard errors
and no late iteration's reward spread below a third of the first iteration's. Writes
``matrix.md`` (the table), ``matrix.json`` (every curve, written after each cell) and
``matrix.png`` into ``--out``; a cell already in ``--out``'s ``matrix.json`` is not run
again, so an interrupted matrix goes on where it stopped (with the same settings). Exits
1 when some cell does not learn. A full matrix is 7 rows x 3 seeds x 2 prompt sets x 2
modes = 84 runs, about 1.5 minutes each on two CPU cores.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import yaml

from digenrl.run.cluster import start_cluster
from digenrl.config import load_config
from digenrl.figures.learning import learning
from digenrl.run.runner import Runner
from digenrl.store import open_run

CONFIG = Path(__file__).parent / "configs" / "tiny.yaml"

#: Each row of the matrix: its name and the algorithm settings it sets.
CELLS = {
    "flow_grpo": {"algorithm.name": "flow_grpo"},
    "flow_grpo_cps": {"algorithm.name": "flow_grpo", "algorithm.dynamics": "cps"},
    "flow_grpo_dance": {"algorithm.name": "flow_grpo", "algorithm.dynamics": "dance"},
    "flow_grpo_window": {"algorithm.name": "flow_grpo", "algorithm.dynamics": "cps",
                         "algorithm.sde_steps": [0, 1, 2, 3], "algorithm.num_sde_steps": 2},
    "nft": {"algorithm.name": "diffusion_nft"},
    "awm": {"algorithm.name": "awm"},
    "dpo": {"algorithm.name": "dpo"},
}
SEEDS = (11, 12, 13)
PROMPT_SETS = ("animal_photos", "simple_animals")
MODES = ("digenrl", "colocated")


def cell_config(cell: str, seed: int, prompt_set: str, mode: str, iterations: int,
                extra: dict | None = None):
    return load_config(CONFIG, {**CELLS[cell], "seed": seed, "data.prompt_set": prompt_set,
                                "schedule.mode": mode, "iterations": iterations,
                                **(extra or {})})


def run_matrix(cells, seeds, prompt_sets, modes, iterations: int, out: Path,
               extra: dict | None = None) -> list[dict]:
    out.mkdir(parents=True, exist_ok=True)
    done = out / "matrix.json"
    rows = json.loads(done.read_text()) if done.exists() else []
    ran = {(r["cell"], r["mode"], r["prompt_set"], r["seed"]) for r in rows}
    for mode in modes:
        if all((c, mode, p, s) in ran for c in cells for p in prompt_sets for s in seeds):
            continue
        first = cell_config(cells[0], seeds[0], prompt_sets[0], mode, iterations, extra)
        handle = start_cluster(first.cluster, pools=first.schedule.options().pools)
        try:
            for cell in cells:
                for prompt_set in prompt_sets:
                    for seed in seeds:
                        if (cell, mode, prompt_set, seed) in ran:
                            continue
                        cfg = cell_config(cell, seed, prompt_set, mode, iterations, extra)
                        store = out / "stores" / f"{cell}-{mode}-{prompt_set}-{seed}.zarr"
                        shutil.rmtree(store, ignore_errors=True)
                        Runner(cfg, str(store), cluster=handle).run()
                        rewards = open_run(store)["samples"].reward.values
                        got = learning(rewards)
                        rows.append({"cell": cell, "mode": mode, "prompt_set": prompt_set,
                                     "seed": seed, "lr": cfg.train.learning_rate,
                                     "gain": got.gain, "se": got.se,
                                     "gain_se": got.gain_se, "spread_ratio": got.spread_ratio,
                                     "learns": got.learns, "curve": got.curve,
                                     "spreads": got.spreads})
                        print(f"{cell:17s} {mode:9s} {prompt_set:14s} seed {seed}: "
                              f"{got.describe()}", flush=True)
                        shutil.rmtree(store, ignore_errors=True)
                        (out / "matrix.json").write_text(json.dumps(rows, indent=1))
        finally:
            handle.close()
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| cell | mode | prompt set | seed | lr | gain (reward, kB) | gain / se "
             "| least late spread / first | learns |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['cell']} | {r['mode']} | {r['prompt_set']} | {r['seed']} "
                     f"| {r['lr']:g} | {r['gain']:+.3f} | {r['gain_se']:+.1f} "
                     f"| {r['spread_ratio']:.2f} | {'yes' if r['learns'] else 'NO'} |")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = sorted({r["cell"] for r in rows}, key=list(CELLS).index)
    # One colour per prompt set and seed, one line style per mode, the same in every
    # panel whatever order the rows were run in (a resumed matrix appends as it goes).
    runs = sorted({(r["prompt_set"], r["seed"]) for r in rows})
    colour = {run: f"C{i % 10}" for i, run in enumerate(runs)}
    fig, axes = plt.subplots(1, len(cells), figsize=(3.2 * len(cells), 3), squeeze=False,
                             sharey=False)
    for ax, cell in zip(axes[0], cells):
        for r in sorted((r for r in rows if r["cell"] == cell),
                        key=lambda r: (r["mode"] != "digenrl", r["prompt_set"], r["seed"])):
            ax.plot(r["curve"], ls="-" if r["mode"] == "digenrl" else "--", lw=1,
                    color=colour[(r["prompt_set"], r["seed"])],
                    label=f"{r['mode'][:3]} {r['prompt_set'][:6]} {r['seed']}")
        ax.set_title(cell, fontsize=9)
        ax.set_xlabel("iteration", fontsize=8)
        ax.tick_params(labelsize=7)
    axes[0][0].set_ylabel("mean reward (-kB)", fontsize=8)
    axes[0][-1].legend(fontsize=5)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="runs/learning-matrix")
    p.add_argument("--cells", nargs="+", choices=list(CELLS), default=list(CELLS))
    p.add_argument("--seeds", nargs="+", type=int, default=list(SEEDS))
    p.add_argument("--prompt-sets", nargs="+", default=list(PROMPT_SETS))
    p.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES))
    p.add_argument("--iterations", type=int, default=16)
    p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                   help="a config field set in every cell (off the defaults: a study, not "
                        "the matrix)")
    args = p.parse_args(argv)
    out = Path(args.out)
    extra = {k: yaml.safe_load(v) for k, v in (s.split("=", 1) for s in args.set)}
    rows = run_matrix(args.cells, args.seeds, args.prompt_sets, args.modes,
                      args.iterations, out, extra)
    (out / "matrix.md").write_text(table(rows))
    plot(rows, out / "matrix.png")
    print(table(rows))
    return 0 if all(r["learns"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
