"""``digenrl run``: the command line.

Flags override the YAML config; ``--set section.field=value`` overrides any field.
Configuration mistakes end with one line naming the field, exit status 2, and no
traceback.
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Any, Sequence

import yaml

from digenrl.config import ConfigError, RunConfig, load_config
from digenrl.store import StoreError

__all__ = ["main", "build_parser", "config_from_args"]

logger = logging.getLogger("digenrl")


def _reward_components(text: str) -> dict[str, float]:
    """``name`` or ``name=weight,name=weight``."""
    out: dict[str, float] = {}
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        name, _, weight = part.partition("=")
        try:
            out[name.strip()] = float(weight) if weight else 1.0
        except ValueError:
            raise ConfigError(f"--reward: expected NAME or NAME=WEIGHT[,...], got {text!r}") from None
    if not out:
        raise ConfigError(f"--reward: expected NAME or NAME=WEIGHT[,...], got {text!r}")
    return out


def _set_pairs(pairs: Sequence[str]) -> dict[str, Any]:
    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ConfigError(f"--set: expected SECTION.FIELD=VALUE, got {pair!r}")
        try:
            out[key.strip()] = yaml.safe_load(value)
        except yaml.YAMLError:
            raise ConfigError(f"--set: expected a YAML value after '=', got {pair!r}") from None
    return out


def _add_config_arguments(p: argparse.ArgumentParser) -> None:
    """Flags shared by the commands that take a run config."""
    p.add_argument("config", nargs="?", help="YAML config (default: the built-in tiny config)")
    p.add_argument("--mode", help="colocated | disaggregated | digenrl")
    p.add_argument("--iterations", type=int)
    p.add_argument("--seed", type=int)
    p.add_argument("--reward", help="NAME or NAME=WEIGHT[,NAME=WEIGHT...]")
    p.add_argument("--rollout-workers", type=int)
    p.add_argument("--trainer-workers", type=int)
    p.add_argument("--scheduler", help="address of an existing Dask scheduler")
    p.add_argument("--gpus", action="store_true", default=None,
                   help="one dask-cuda worker per GPU (needs digenrl[cuda])")
    p.add_argument("--max-staleness", type=int, metavar="K")
    for name, what in (("gap", "generation-axis pipeline"), ("tsp", "time-step parallelism"),
                       ("tag", "trainer-assisted generation")):
        p.add_argument(f"--{name}", dest=name, action=argparse.BooleanOptionalAction,
                       default=None, help=f"switch {what} on or off (default: the mode's)")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                   help="override any config field (repeatable)")
    p.add_argument("--quiet", action="store_true", help="only warnings and errors")
    p.add_argument("--debug", action="store_true", help="show full tracebacks")


def build_parser() -> argparse.ArgumentParser:
    from digenrl.bench import DEFAULT_VARIANTS, VARIANTS

    parser = argparse.ArgumentParser(prog="digenrl", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run RL post-training and write a store")
    _add_config_arguments(run)
    run.add_argument("--out", required=True, help="output Zarr store (a new path)")
    run.add_argument("--overwrite", action="store_true", help="replace an existing store")
    bench = sub.add_parser("bench", help="compare modes and ablations on the same work")
    _add_config_arguments(bench)
    bench.add_argument("--out", required=True, help="folder for the stores and results.csv")
    bench.add_argument("--variants", default=",".join(DEFAULT_VARIANTS),
                       help=f"comma-separated, from: {', '.join(VARIANTS)}")
    bench.add_argument("--skip", type=int, default=1,
                       help="leading iterations left out of the measurement (start-up)")
    return parser


_FLAG_FIELDS = {
    "mode": "schedule.mode", "iterations": "iterations", "seed": "seed",
    "rollout_workers": "cluster.rollout_workers", "trainer_workers": "cluster.trainer_workers",
    "scheduler": "cluster.scheduler", "gpus": "cluster.gpus",
    "max_staleness": "schedule.max_staleness", "gap": "schedule.gap", "tsp": "schedule.tsp",
    "tag": "schedule.tag",
}


def config_from_args(args: argparse.Namespace) -> RunConfig:
    overrides: dict[str, Any] = {}
    for attr, field in _FLAG_FIELDS.items():
        value = getattr(args, attr, None)
        if value is not None:
            overrides[field] = value
    if args.reward is not None:
        overrides["reward.components"] = _reward_components(args.reward)
    overrides.update(_set_pairs(args.set))
    return load_config(args.config, overrides)


def _setup_logging(quiet: bool) -> None:
    logging.basicConfig(format="%(asctime)s %(name)s %(levelname)s %(message)s",
                        datefmt="%H:%M:%S", stream=sys.stderr)
    logger.setLevel(logging.WARNING if quiet else logging.INFO)
    import distributed  # noqa: F401  (configures its loggers; quieten them after)

    for name in list(logging.root.manager.loggerDict):
        if name == "distributed" or name.startswith("distributed."):
            logging.getLogger(name).setLevel(logging.WARNING)


def _cmd_run(args: argparse.Namespace) -> int:
    from digenrl.runner import Runner

    config = config_from_args(args)
    Runner(config, args.out, overwrite=args.overwrite).run()
    return 0


def _cmd_bench(args: argparse.Namespace) -> int:
    from digenrl.bench import format_table, run_bench

    config = config_from_args(args)
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    try:
        results = run_bench(config, variants, args.out, skip=args.skip)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    print(format_table(results))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    _setup_logging(getattr(args, "quiet", False))
    try:
        return {"run": _cmd_run, "bench": _cmd_bench}[args.command](args)
    except (ConfigError, StoreError) as e:
        if getattr(args, "debug", False):
            raise
        print(f"digenrl {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"digenrl {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
