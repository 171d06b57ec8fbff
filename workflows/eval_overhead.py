"""Training throughput with held-out evaluation on and off, on one cluster, in one go.

    python workflows/eval_overhead.py workflows/configs/tiny.yaml --out runs/eval-overhead \
        --iterations 10 --every 2 --repeats 2

Runs the config (mode as it sets it) without evaluation and with ``eval.every``, in
turn, ``--repeats`` times each on the same cluster, and prints each run's images/s over
the iterations after the first (as ``digenrl bench`` measures them) and the ratio of
the means, evaluation on / off. Evaluation uses the config's held-out prompts (the
built-in set's when it trains on a built-in prompt set).

On a shared host the task times of two runs differ more than evaluation could make
them, so for each run with evaluation it also prints, from its tasks records, how long
evaluation held up training-side work: for each ``eval`` task, from the first rollout
step or grad that became ready while it ran, on its worker, until it stopped (an
upper bound: that step may have waited for other reasons too).
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys

from digenrl.commands.bench import bench_config
from digenrl.config import apply_overrides, config_from_dict, config_to_dict, load_config
from digenrl.store import open_run
from digenrl.vocabulary import EVAL, GRAD, OPTIMIZE, ROLLOUT_KINDS


def held_up(store: str) -> tuple[float, float, float]:
    """Seconds that evaluation held up training-side GPU work (an upper bound, see the
    module's text), GPU-seconds of evaluation, and the run's seconds."""
    t = open_run(store)["tasks"].to_dataframe()
    evals = t[t.kind == EVAL]
    work = t[t.gpu & (t.kind.isin(ROLLOUT_KINDS) | (t.kind == GRAD))]
    held = 0.0
    for _, e in evals.iterrows():
        behind = work[(work.worker == e.worker) & (work.eligible >= e.start)
                      & (work.eligible < e.stop) & (work.start >= e.stop - 1e-3)]
        if len(behind):
            held += float(e.stop - behind.eligible.min())
    span = float(t[t.kind == OPTIMIZE].stop.max() - t.start.min())
    return held, float((evals.stop - evals.start).sum()), span


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("config")
    ap.add_argument("--out", required=True, help="folder for the runs' stores")
    ap.add_argument("--iterations", type=int, default=10)
    ap.add_argument("--every", type=int, default=2, help="eval.every of the runs with it")
    ap.add_argument("--repeats", type=int, default=2, help="runs of each, interleaved")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    base = config_from_dict(apply_overrides(config_to_dict(load_config(args.config)),
                                            {"iterations": args.iterations}))
    extra, names = {}, []
    for r in range(args.repeats):
        extra[f"off-{r}"] = {"eval.every": 0, "eval.before_first": False}
        extra[f"on-{r}"] = {"eval.every": args.every}
        names += [f"off-{r}", f"on-{r}"]
    results = bench_config(base, names, args.out, extra=extra)
    speed = {res.name: res.stats.images_per_s for res in results}
    stores = {res.name: res.store for res in results}
    for name in names:
        line = f"{name:8s} {speed[name]:.3f} images/s"
        if name.startswith("on"):
            held, gpu_s, span = held_up(stores[name])
            line += (f"; evaluation {gpu_s:.1f} GPU-s, held up training-side work "
                     f"{held:.1f} s of the run's {span:.1f} s ({held / span:.1%})")
        print(line)
    off = statistics.mean(v for k, v in speed.items() if k.startswith("off"))
    on = statistics.mean(v for k, v in speed.items() if k.startswith("on"))
    print(f"evaluation on / off: {on / off:.3f} ({on:.3f} against {off:.3f} images/s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
