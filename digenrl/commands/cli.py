"""``digenrl run``: the command line.

Flags override the YAML config; ``--set section.field=value`` overrides any field.
Configuration mistakes end with one line naming the field, exit status 2, and no
traceback, before any cluster is started (``digenrl run --check`` validates and exits).
A run stopped by a failing reward ends with one line naming the reward, the samples and
the iteration, and exit status 1; the store keeps the complete iterations before it.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import sys
from pathlib import Path
from typing import Any, Mapping, Sequence

import yaml

from digenrl.config import (ConfigError, RewardModelConfig, RunConfig, apply_overrides,
                            config_from_dict, load_config)
from digenrl.schedulers.switches import MODE_NAMES, switches
from digenrl.schedulers.watchdog import RunStalled
from digenrl.store import StoreError, committed_iterations
from digenrl.tasks.rewards import RewardError

__all__ = ["main", "build_parser", "config_from_args"]

logger = logging.getLogger("digenrl")

#: The switches a flag sets: every mode preset the config may set.
_FLAG_SWITCHES = tuple(s for s in switches() if s.preset and s.configurable)


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
        key = key.strip()
        if not sep or not key:
            raise ConfigError(f"--set: expected SECTION.FIELD=VALUE, got {pair!r}")
        try:
            out[key] = yaml.safe_load(value)
        except yaml.YAMLError:
            raise ConfigError(f"--set: expected a YAML value after '=', got {pair!r}") from None
    return out


def _add_config_arguments(p: argparse.ArgumentParser) -> None:
    """Flags shared by the commands that take a run config."""
    p.add_argument("config", nargs="?", help="YAML config (default: the built-in tiny config)")
    p.add_argument("--mode", help=" | ".join(MODE_NAMES))
    p.add_argument("--iterations", type=int)
    p.add_argument("--seed", type=int)
    p.add_argument("--reward", help="NAME or NAME=WEIGHT[,NAME=WEIGHT...]")
    p.add_argument("--rollout-workers", type=int)
    p.add_argument("--trainer-workers", type=int)
    p.add_argument("--scheduler", help="address of an existing Dask scheduler")
    p.add_argument("--gpus", action="store_true", default=None,
                   help="one dask-cuda worker per GPU (needs digenrl[cuda])")
    for s in _FLAG_SWITCHES:  # --gap/--no-gap, --max-staleness K, ...
        if s.type is bool:
            p.add_argument(s.flag, dest=s.name, action=argparse.BooleanOptionalAction,
                           default=None, help=f"switch {s.title} on or off (default: the "
                                              f"mode's)")
        else:
            p.add_argument(s.flag, dest=s.name, type=s.type, metavar=s.type.__name__.upper(),
                           help=f"{s.title} (default: the mode's)")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                   help="override any config field (repeatable)")
    p.add_argument("--quiet", action="store_true", help="only warnings and errors")
    p.add_argument("--debug", action="store_true", help="show full tracebacks")


def build_parser() -> argparse.ArgumentParser:
    from digenrl.figures.variants import DEFAULT_VARIANTS, VARIANTS

    parser = argparse.ArgumentParser(prog="digenrl", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run RL post-training and write a store")
    _add_config_arguments(run)
    run.add_argument("--out", help="output Zarr store (a new path)")
    run.add_argument("--overwrite", action="store_true", help="replace an existing store")
    run.add_argument("--resume", metavar="STORE",
                     help="continue a stopped run from its last complete iteration (its "
                          "config is the stored one unless CONFIG is given; --iterations "
                          "may extend it)")
    run.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                     help="a progress bar (default: when stderr is a terminal and not --quiet)")
    run.add_argument("--check", action="store_true",
                     help="validate the config, the flags and the store (--out or --resume), "
                          "print the resolved config and exit without starting a cluster")
    bench = sub.add_parser("bench", help="compare modes and ablations on the same work")
    _add_config_arguments(bench)
    bench.add_argument("--out", required=True, help="folder for the stores and results.csv")
    bench.add_argument("--variants", default=",".join(DEFAULT_VARIANTS),
                       help=f"comma-separated, from: {', '.join(VARIANTS)}")
    bench.add_argument("--skip", type=int, default=1,
                       help="leading iterations left out of the measurement (start-up)")
    bench.add_argument("--drain", type=int, default=1,
                       help="trailing iterations left out (the last one has no next "
                            "iteration to overlap with)")
    bench.add_argument("--emulate", metavar="PROFILE",
                       help="emulated GPUs following a cost profile (a shipped name or a YAML "
                            "file) instead of the real model; the config's schedule switches "
                            "are replaced by each variant's")
    bench.add_argument("--time-scale", type=float,
                       help="with --emulate: emulated seconds per profile second "
                            "(default: the profile's)")
    # (--rollout-workers / --trainer-workers size the emulated pools too.)
    rep = sub.add_parser("report", help="PNG plots and a summary of a run's store")
    rep.add_argument("store", help="a digenrl store (finished or running)")
    rep.add_argument("--out", help="folder for the PNGs (default: STORE-report)")
    rep.add_argument("--quiet", action="store_true")
    rep.add_argument("--debug", action="store_true")
    srv = sub.add_parser("reward-server", help="serve a registered reward over HTTP (JSON; "
                                               "see docs/howto.md)")
    srv.add_argument("name", metavar="NAME",
                     help="a registered reward's name, or with --config one of that "
                          "config's reward.models")
    srv.add_argument("--config", help="a run config (YAML) whose reward.models names the "
                                      "reward: the model is loaded on this machine's GPU "
                                      "(else its CPU) before the server starts")
    srv.add_argument("--import", dest="modules", action="append", default=[],
                     metavar="MODULE", help="import a module that registers rewards first "
                                            "(repeatable)")
    srv.add_argument("--host", default="127.0.0.1",
                     help="address to bind (default 127.0.0.1: this machine only)")
    srv.add_argument("--port", type=int, default=0,
                     help="port to listen on (default 0: a free one, printed at start)")
    srv.add_argument("--token", help="bearer token every request must carry (default: the "
                                     "DIGENRL_REWARD_TOKEN environment variable; none when "
                                     "unset)")
    srv.add_argument("--max-bytes", type=int, help="largest request body read, in bytes "
                                                   "(default 64 MiB)")
    srv.add_argument("--batch-size", type=int,
                     help="images per scoring pass, gathered from concurrent requests "
                          "(default 32; a model reward's is its reward.models batch_size)")
    srv.add_argument("--max-wait-ms", type=float,
                     help="how long a request waits for others to fill its pass "
                          "(default 5 ms)")
    srv.add_argument("--max-queue", type=int,
                     help="images waiting beyond which requests are answered 429 with "
                          "Retry-After (default 1024)")
    srv.add_argument("--backlog", type=int,
                     help="connections the kernel queues before they are accepted "
                          "(default 1024)")
    srv.add_argument("--read-timeout", type=float,
                     help="seconds a request body may stall before it is answered 400 "
                          "as truncated (default 30)")
    srv.add_argument("--allow-pickle", action="store_true",
                     help="also accept pickled requests (unpickling can run code: only on a "
                          "network you trust)")
    srv.add_argument("--quiet", action="store_true", help="only warnings and errors")
    srv.add_argument("--debug", action="store_true", help="show full tracebacks")
    exp = sub.add_parser(
        "export", help="write a trained policy version in the form diffusers loads",
        formatter_class=argparse.RawDescriptionHelpFormatter, epilog=EXPORT_EPILOG,
        description="Write policy version N of the run in STORE to DIR: with LoRA, "
                    "DIR/pytorch_lora_weights.safetensors; with full fine-tuning, "
                    "DIR/transformer/ (float32).")
    exp.add_argument("store", help="a digenrl store")
    exp.add_argument("dir", help="output folder (new or empty)")
    exp.add_argument("--version", type=int,
                     help="the policy version (default: the newest the store holds: the "
                          "final weights of a finished run, else the newest checkpoint, sharded "
                          "ones included)")
    why = sub.add_parser("why", help="why a task ran where and when it did: the "
                                     "scheduling decisions on it, from a run's store")
    why.add_argument("store", help="a digenrl store (finished or running)")
    why.add_argument("key", help="the task's key as the store prints it, e.g. "
                                 "\"('grad', 3, 1, 2)\", or plainly: grad,3,1,2")
    why.add_argument("--quiet", action="store_true")
    why.add_argument("--debug", action="store_true")
    sim = sub.add_parser("simulate", help="the scheduling policy on a simulated cluster")
    sim.add_argument("profile", help="a shipped cost profile or a YAML file")
    sim.add_argument("--gpus", type=int, help="scale the profile to this many GPUs")
    sim.add_argument("--iterations", type=int, default=20)
    sim.add_argument("--splits", metavar="R:T[,R:T...]",
                     help="simulate each rollout:trainer split of the GPUs (ratios, e.g. "
                          "11:5,8:8,3:13 on 16 GPUs or the same shares of --gpus) and name "
                          "the best split per variant")
    sim.add_argument("--variants", default="colocated,disaggregated,digenrl",
                     help=f"comma-separated, from: {', '.join(VARIANTS)}")
    sim.add_argument("--dispatch-latency", type=float,
                     help="seconds between a release and the start on an idle worker, in "
                          "the profile's time (default 5 ms; with --validate the measured "
                          "Dask round trip divided by the emulator's time scale)")
    sim.add_argument("--validate", metavar="DIR",
                     help="also run the same variants on emulated GPUs (stores in DIR) "
                          "and report the difference")
    sim.add_argument("--time-scale", type=float, help="with --validate: the emulator's")
    sim.add_argument("--reuse", action="store_true",
                     help="with --validate: use the emulated runs already in DIR (from "
                          "digenrl bench --emulate) instead of running them again")
    sim.add_argument("--context-parallel", metavar="D[,D...]",
                     help="simulate each context-parallel degree (1, 2, 4, 8 or auto, "
                          "comma-separated) instead of the profile's, and compare them: "
                          "iteration time, fraction of the ideal bound, the degree of "
                          "each chunk")
    sim.add_argument("--network-study", action="store_true",
                     help="instead: weight-sync and all-reduce traffic on a static fat-tree "
                          "against a reconfigurable fabric (GPU counts x oversubscription x "
                          "switching delays, or only --gpus)")
    sim.add_argument("--quiet", action="store_true")
    sim.add_argument("--debug", action="store_true")
    _add_deploy_parser(sub)
    return parser


#: Each flag's dest -> the config field it sets.
_FLAG_FIELDS = {
    "mode": "schedule.mode", "iterations": "iterations", "seed": "seed",
    "rollout_workers": "cluster.rollout_workers", "trainer_workers": "cluster.trainer_workers",
    "scheduler": "cluster.scheduler", "gpus": "cluster.gpus",
    **{s.name: f"schedule.{s.name}" for s in _FLAG_SWITCHES},
}


def config_from_args(args: argparse.Namespace) -> RunConfig:
    base = None
    resume = getattr(args, "resume", None)
    if resume and args.config is None:
        base = _stored_config(resume)
    overrides: dict[str, Any] = {}
    for attr, field in _FLAG_FIELDS.items():
        value = getattr(args, attr, None)
        if value is not None:
            overrides[field] = value
    if args.reward is not None:
        overrides["reward.components"] = _reward_components(args.reward)
    overrides.update(_set_pairs(args.set))
    if base is not None:
        return config_from_dict(apply_overrides(base, overrides))
    return load_config(args.config, overrides)


def _stored_config(path: str) -> dict[str, Any]:
    from pathlib import Path

    import zarr

    if not (Path(path) / "zarr.json").is_file():
        raise ConfigError(f"--resume: expected an existing digenrl store, got {path!r}")
    root: Mapping[str, Any] = zarr.open_group(path, mode="r").attrs
    attrs = root.get("digenrl") or {}
    if "config" not in attrs:
        raise ConfigError(f"--resume: {path!r} holds no digenrl run config")
    return dict(attrs["config"])


def _setup_logging(quiet: bool) -> None:
    logging.basicConfig(format="%(asctime)s %(name)s %(levelname)s %(message)s",
                        datefmt="%H:%M:%S", stream=sys.stderr)
    logger.setLevel(logging.WARNING if quiet else logging.INFO)
    import distributed  # noqa: F401  (configures its loggers; quieten them after)

    for name in list(logging.root.manager.loggerDict):
        if name == "distributed" or name.startswith("distributed."):
            logging.getLogger(name).setLevel(logging.WARNING)


def _cmd_run(args: argparse.Namespace) -> int:
    from digenrl.run.runner import Runner

    if args.out is not None and args.resume is not None or (
            args.out is None and args.resume is None and not args.check):
        raise ConfigError("run: expected exactly one of --out STORE (a new run) or "
                          "--resume STORE (continue one)")
    config = config_from_args(args)
    out, resume = (args.resume, True) if args.resume else (args.out, False)
    if args.check:
        return _check_run(config, out, resume, args.overwrite)

    def runner(**kw):
        return Runner(config, out, overwrite=args.overwrite, resume=resume, **kw)

    show = args.progress if args.progress is not None else (
        sys.stderr.isatty() and not args.quiet)
    if not show:
        runner().run()
        return 0
    from tqdm import tqdm
    from tqdm.contrib.logging import logging_redirect_tqdm

    with tqdm(total=config.iterations, unit="it", desc="digenrl", dynamic_ncols=True) as bar, \
            logging_redirect_tqdm(loggers=[logger]):
        def advance(summary) -> None:
            bar.set_postfix(reward=f"{summary.reward_mean:.4f}",
                            images_per_s=f"{summary.images_per_s:.2f}", refresh=False)
            bar.update(1)

        runner(on_iteration=advance).run()
    return 0


def _check_run(config: RunConfig, out: str | None, resume: bool, overwrite: bool) -> int:
    """``digenrl run --check``: everything a run checks before starting a cluster."""
    from digenrl.algorithms import ALGORITHMS
    from digenrl.config import config_to_dict
    from digenrl.run.driver import check_store, resume_point
    from digenrl.run.runner import RLWorkload

    workload = RLWorkload(config)
    start = computed_from = 0
    if out is not None:
        start = check_store(workload, out, overwrite=overwrite, resume=resume)
        if resume:
            computed_from = resume_point(workload, out, start)
    sys.stdout.write(yaml.safe_dump(config_to_dict(config), sort_keys=False))
    alg = ALGORITHMS[config.algorithm.name]
    dynamics = config.algorithm.dynamics or alg.dynamics_choices[0]
    logger.info("%s's defaults%s (a config that leaves them unset gets these): %s", alg.name,
                f" with {dynamics} dynamics" if alg.dynamics_defaults else "",
                ", ".join(f"{k} {v:g}" if isinstance(v, float) else f"{k} {v}"
                          for k, v in alg.defaults_for(dynamics).items()))
    for line in workload.describe():
        logger.info(line)
    again = (f", computing iterations {computed_from} to {start - 1} again from their "
             f"checkpoints" if computed_from < start else "")
    logger.info("the config is valid%s", f"; the run would resume {out} at iteration "
                f"{start}{again}" if resume else "")
    return 0


def _stored(args: argparse.Namespace) -> tuple[str | None, int | None]:
    """The store a ``run`` writes and how many complete iterations it holds now (None
    when there is no store yet, or the command writes none)."""
    if args.command != "run" or getattr(args, "check", False):
        return None, None
    out = getattr(args, "resume", None) or getattr(args, "out", None)
    if not out:
        return None, None
    try:
        return out, committed_iterations(out)
    except (StoreError, OSError, KeyError):
        return out, None


def _holds(out: str, n: int) -> str:
    return f"{out} holds {n} complete iteration{'s' if n != 1 else ''}"


def _resume_command(args: argparse.Namespace, out: str) -> str:
    """The command that continues ``out``: the stored config, on the same cluster."""
    cmd = f"digenrl run --resume {out}"
    if getattr(args, "scheduler", None):
        cmd += f" --scheduler {args.scheduler}"
    return cmd


def _reward_failure(e: RewardError, args: argparse.Namespace) -> str:
    """The one line a run stopped by a failing reward ends with."""
    out, n = _stored(args)
    hint = "set reward.on_error: drop to leave such samples out of training and count them"
    if n is not None:
        hint = (f"{out} holds the {n} complete iteration{'s' if n != 1 else ''} before "
                f"it (--resume {out} continues it); {hint}")
    return f"{e} ({hint})"


def _lost_scheduler(e: BaseException | None, address: str | None = None) -> bool:
    """Whether ``e`` (or an exception it was raised from) says the Dask scheduler went
    away: the connection closed under a request, the client cancelled the run's futures
    because it lost the scheduler (one future's result asked for, or several waited
    for), or a new connection to the scheduler at ``address`` (when the run was given
    one) timed out."""
    from distributed.client import FutureCancelledError, FuturesCancelledError
    from distributed.comm.core import CommClosedError

    lost = "scheduler-connection-lost"
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if (isinstance(e, CommClosedError)
                or (isinstance(e, FutureCancelledError) and e.reason == lost)
                or (isinstance(e, FuturesCancelledError)
                    and any(g.reason == lost for g in e.error_groups))):
            return True
        if (address and isinstance(e, OSError)
                and str(e).startswith("Timed out trying to connect to ")
                and address.split("://")[-1] in str(e)):
            return True
        e = e.__cause__ or e.__context__
    return False


def _scheduler_loss(args: argparse.Namespace, e: BaseException) -> str:
    """The one line a run that lost its scheduler ends with."""
    out, n = _stored(args)
    where = f" at {args.scheduler}" if getattr(args, "scheduler", None) else ""
    line = (f"digenrl run: error: lost the Dask scheduler{where} "
            f"({type(e).__name__}: {_one_line(str(e))[:200]})")
    if out is None or n is None:
        return line + "; nothing was stored"
    hint = _resume_command(args, out)
    if where:
        hint = hint.replace(f"--scheduler {args.scheduler}", "--scheduler NEW_ADDRESS")
        hint = f"start a scheduler and continue with: {hint}"
    else:
        hint = f"continue with: {hint}"
    return f"{line}; {_holds(out, n)}; {hint}"


class Stopped(KeyboardInterrupt):
    """The first SIGINT or SIGTERM a command receives: raised in the main thread so the
    command unwinds (a run's driver cancels its work and leaves the store as its last
    commit made it)."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _interrupted(args: argparse.Namespace, signum: int) -> str:
    """The one line a command stopped by a signal ends with."""
    name = signal.Signals(signum).name
    out, n = _stored(args)
    if out is None:
        return f"digenrl {args.command}: stopped by {name}"
    if n is None:
        return (f"digenrl {args.command}: stopped by {name} before {out} held any "
                f"iteration; start it again with --out {out} --overwrite")
    return (f"digenrl {args.command}: stopped by {name}; {_holds(out, n)}; "
            f"continue with: {_resume_command(args, out)}")


@contextlib.contextmanager
def _stop_on_signals(args: argparse.Namespace):
    """While a command runs, the first SIGINT or SIGTERM (a job scheduler's stop) raises
    :class:`Stopped`; a second one exits at once. The previous handlers come back after
    (``main`` is also called from other programs and tests)."""
    if sys.platform == "win32" or not _in_main_thread():
        yield
        return

    def at_once(signum, frame):
        print(f"digenrl {args.command}: {signal.Signals(signum).name} again, exiting at once",
              file=sys.stderr, flush=True)
        os._exit(128 + signum)

    def first(signum, frame):
        for s in (signal.SIGINT, signal.SIGTERM):
            signal.signal(s, at_once)
        print(f"digenrl {args.command}: {signal.Signals(signum).name} received, stopping "
              "(again to exit at once)", file=sys.stderr, flush=True)
        raise Stopped(signum)

    previous = {s: signal.signal(s, first) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def _in_main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


EXPORT_EPILOG = """\
loading the result in diffusers (PipelineClass: the pipeline the run trained, e.g.
StableDiffusion3Pipeline, FluxPipeline, WanPipeline; the built-in model's is
StableDiffusion3Pipeline):
  LoRA:  pipe = PipelineClass.from_pretrained(MODEL_PATH); pipe.load_lora_weights(DIR)
  full:  transformer = TransformerClass.from_pretrained(DIR, subfolder="transformer")
         pipe = PipelineClass.from_pretrained(MODEL_PATH, transformer=transformer)
"""


def _cmd_export(args: argparse.Namespace) -> int:
    from digenrl.commands.export import export

    done = export(args.store, args.dir, args.version)
    kind = "LoRA adapters" if done.lora else "transformer"
    print(f"policy version {done.version} ({kind}) -> {done.path}")
    return 0


def _cmd_report(args: argparse.Namespace) -> int:
    from digenrl.commands.report import write_report

    written, text = write_report(args.store, args.out)
    print(text)
    for path in written:
        logger.info("wrote %s", path)
    return 0


def _cmd_why(args: argparse.Namespace) -> int:
    from digenrl.commands.why import why

    print(why(args.store, args.key))
    return 0


def _cmd_bench(args: argparse.Namespace) -> int:
    from digenrl.commands.bench import bench_config, bench_profile, format_table
    from digenrl.run.world import check_world

    config = config_from_args(args)
    check_world(config)  # before the cluster starts
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    if args.emulate:
        from digenrl.sim.profile import ProfileError, load_profile

        try:
            profile = load_profile(args.emulate)
        except ProfileError as e:
            raise ConfigError(str(e)) from None
        if args.time_scale is not None and not args.time_scale > 0:
            raise ConfigError(f"--time-scale: expected a number > 0, got {args.time_scale}")
        if args.rollout_workers is not None or args.trainer_workers is not None:
            try:
                profile = profile.with_pools(
                    args.rollout_workers if args.rollout_workers is not None
                    else profile.rollout_workers,
                    args.trainer_workers if args.trainer_workers is not None
                    else profile.trainer_workers)
            except ProfileError as e:
                raise ConfigError(f"--rollout-workers/--trainer-workers: {e}") from None
        _check_memory(profile, variants)
        results = bench_profile(profile, variants, args.out, iterations=config.iterations,
                                time_scale=args.time_scale, skip=args.skip, drain=args.drain,
                                dashboard_address=config.cluster.dashboard_address)
    else:
        results = bench_config(config, variants, args.out, skip=args.skip, drain=args.drain)
    print(format_table(results))
    return 0


def _degree_arg(text: str) -> int | str:
    """``--context-parallel``'s degree: ``auto`` or an integer (checked by the profile)."""
    text = text.strip()
    try:
        return int(text)
    except ValueError:
        return text


def _cmd_simulate(args: argparse.Namespace) -> int:
    if args.network_study:
        from digenrl.sim.network import run_network_study

        try:
            print(run_network_study(args.profile, args.gpus), end="")
        except ValueError as e:
            raise ConfigError(str(e)) from None
        return 0
    from digenrl.commands.bench import bench_profile, measure_store
    from digenrl.sim.profile import ProfileError, load_profile
    from digenrl.sim.simulate import (DASK_ROUND_TRIP, format_degrees, format_reports,
                                      measured_latencies, simulate_variants)
    from digenrl.figures.variants import VARIANTS

    def fits(p, show: bool = True) -> None:
        _check_memory(p, variants)
        if show and p.model.params:
            print(p.memory().line())

    try:
        profile = load_profile(args.profile)
    except ProfileError as e:
        raise ConfigError(str(e)) from None
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        raise ConfigError(f"--variants: expected names from {sorted(VARIANTS)}, got {unknown}")
    if args.gpus is not None:
        if args.gpus < 2:
            raise ConfigError(f"--gpus: expected at least 2, got {args.gpus}")
        profile = profile.scaled(args.gpus)
        try:   # (the profile's degree, on the scaled rollout pool)
            profile = profile.with_context_parallel(profile.context_parallel)
        except ProfileError as e:
            raise ConfigError(f"--gpus: {e}") from None
    if args.iterations < 3:
        raise ConfigError(f"--iterations: expected at least 3, got {args.iterations}")
    if args.time_scale is not None and not args.time_scale > 0:
        raise ConfigError(f"--time-scale: expected a number > 0, got {args.time_scale}")
    if args.reuse and not args.validate:
        raise ConfigError("--reuse: expected together with --validate DIR")
    splits = _parse_splits(args.splits) if args.splits is not None else None
    if splits and args.validate:
        raise ConfigError("--splits: expected without --validate (it simulates only)")
    if args.context_parallel is not None:
        if splits or args.validate:
            raise ConfigError("--context-parallel: expected without --splits and --validate")
        try:
            profiles = [profile.with_context_parallel(_degree_arg(d))
                        for d in args.context_parallel.split(",")]
        except ProfileError as e:
            raise ConfigError(f"--context-parallel: {e}") from None
        latency = args.dispatch_latency if args.dispatch_latency is not None else 0.005
        fits(profile)
        print(format_degrees([(v, r) for p in profiles
                              for v, r in simulate_variants(p, variants, args.iterations,
                                                            dispatch_latency=latency)]))
        return 0
    scale = args.time_scale or profile.time_scale
    latency = args.dispatch_latency
    if latency is None:
        latency = DASK_ROUND_TRIP / scale if args.validate else 0.005
    if splits:
        best: dict[str, tuple[float, str]] = {}
        for r, t in splits:
            fits(profile.split(r, t), show=False)
        for r, t in splits:
            p = profile.split(r, t)
            name = f"{p.rollout_workers} rollout + {p.trainer_workers} trainer"
            fits(p)
            reports = simulate_variants(p, variants, args.iterations, dispatch_latency=latency)
            print(f"{name}:\n{format_reports(reports)}\n")
            for v, rep in reports:
                if v not in best or rep.images_per_s > best[v][0]:
                    best[v] = (rep.images_per_s, name)
        for v, (rate, name) in best.items():
            print(f"best split for {v}: {name} ({rate:.4f} images/s)")
        return 0
    fits(profile)
    if not args.validate:
        print(format_reports(simulate_variants(profile, variants, args.iterations,
                                               dispatch_latency=latency)))
        return 0
    # Validation: the same variants on emulated GPUs (run now, or reused), then the
    # simulator with the Dask latencies measured in each emulated run.
    out = Path(args.validate)
    measured = {}
    todo = [v for v in variants if not (args.reuse and (out / f"{v}.zarr").is_dir())]
    if todo:
        for done in bench_profile(profile, todo, out, iterations=args.iterations,
                                  time_scale=scale, drain=1, dashboard_address=None):
            measured[done.name] = (done.stats.images_per_s, done.overhead)
    for v in variants:
        if v not in measured:
            _check_reused(out / f"{v}.zarr", profile, args.iterations)
            stats, overhead = measure_store(out / f"{v}.zarr", skip=1, drain=1)
            measured[v] = (stats.images_per_s, overhead)
    emulated = {v: m[0] for v, m in measured.items()}
    latencies = {v: measured_latencies(m[1], scale) for v, m in measured.items()}
    fixed = simulate_variants(profile, variants, args.iterations, dispatch_latency=latency)
    calibrated = simulate_variants(profile, variants, args.iterations, latencies=latencies)
    print(format_reports(calibrated, emulated, {n: r.images_per_s for n, r in fixed}))
    print("Dask latencies measured on the emulator (ms, wall clock): "
          + "; ".join(f"{v} dispatch {m[1]['fresh_ms']:.1f}, queued {m[1]['queued_ms']:.1f}"
                      for v, m in measured.items()))
    return 0


def _check_memory(profile, variants) -> None:
    """Each variant's GPUs hold their roles of ``profile`` (a co-located variant: both
    on each GPU), checked before anything is simulated or started."""
    from digenrl.figures.variants import VARIANTS, variant_schedule
    from digenrl.sim.profile import ProfileError

    try:
        for v in variants:
            if v in VARIANTS:
                profile.check_memory(colocated=not variant_schedule(v).options().pools)
    except ProfileError as e:
        raise ConfigError(str(e)) from None


def _parse_splits(text: str) -> list[tuple[int, int]]:
    """``--splits``: ``R:T`` pairs of positive integers, comma-separated."""
    out = []
    for part in text.split(","):
        r, sep, t = part.strip().partition(":")
        if not (sep and r.isdigit() and t.isdigit() and int(r) > 0 and int(t) > 0):
            raise ConfigError(f"--splits: expected ROLLOUT:TRAINER pairs of positive "
                              f"integers, comma-separated (e.g. 11:5,8:8), got {text!r}")
        out.append((int(r), int(t)))
    return out


def _check_reused(store: Path, profile, iterations: int) -> None:
    """A reused emulated run must be of the profile and length being simulated."""
    from digenrl.store import open_run

    ds = open_run(store)
    attrs = ds["tasks"].attrs["digenrl"]
    name = (attrs.get("profile") or {}).get("name")
    if attrs.get("workload") != "emulated" or name != profile.name:
        raise ConfigError(f"--reuse: expected {store} to be an emulated run of profile "
                          f"{profile.name!r}, got {attrs.get('workload')} run of {name!r}")
    ran = ds["metrics"].sizes.get("iteration", 0)
    if ran != iterations:
        raise ConfigError(f"--reuse: expected {store} to hold {iterations} iterations "
                          f"(--iterations), got {ran}")


def _add_deploy_parser(sub) -> None:
    """``digenrl deploy slurm|k8s``: print a deployment to copy (see docs/clusters.md)."""
    from digenrl.commands.deploy import Deployment

    default = Deployment()
    deploy = sub.add_parser("deploy", help="print a SLURM or Kubernetes deployment of a "
                                           "cluster with digenrl's pools and plugin")
    engines = deploy.add_subparsers(dest="engine", required=True)
    slurm = engines.add_parser("slurm", help="a bash script submitting the scheduler and "
                                             "each pool's job array with sbatch")
    k8s = engines.add_parser("k8s", help="a DaskCluster and one DaskWorkerGroup per pool "
                                         "for the dask-kubernetes operator (kubectl apply)")
    for p in (slurm, k8s):
        p.add_argument("--rollout-workers", type=int,
                       help=f"workers (one GPU each) of the rollout pool (default "
                            f"{default.rollout_workers})")
        p.add_argument("--trainer-workers", type=int,
                       help=f"workers of the trainer pool (default {default.trainer_workers})")
        p.add_argument("--cpu", action="store_true",
                       help="CPU workers (dask worker), each with one emulated GPU slot, "
                            "instead of one dask-cuda worker per GPU")
        p.add_argument("--nthreads", type=int,
                       help=f"threads per worker (default {default.nthreads})")
        p.add_argument("--memory", help=f"host memory per worker (default {default.memory})")
        p.add_argument("--name", help=f"the cluster's name (default {default.name})")
        p.add_argument("--scheduler-port", type=int,
                       help=f"default {default.scheduler_port}" + (
                           "; 0: any free port" if p is slurm else ""))
        p.add_argument("--dashboard-port", type=int,
                       help=f"default {default.dashboard_port}")
        p.add_argument("--death-timeout", type=int,
                       help=f"seconds a worker waits for its scheduler (default "
                            f"{default.death_timeout})")
        p.add_argument("--python", help=f"the Python of digenrl's environment on the nodes "
                                        f"or in the image (default {default.python})")
        p.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                       help="an environment variable of every process (repeatable)")
        p.add_argument("--quiet", action="store_true")
        p.add_argument("--debug", action="store_true")
    slurm.add_argument("--gpus-per-node", type=int,
                       help=f"GPUs (workers) per job; a pool larger than this must be a "
                            f"multiple of it (default {default.gpus_per_node})")
    slurm.add_argument("--prologue", action="append", default=[], metavar="LINE",
                       help="a shell line each job runs first, e.g. 'source "
                            ".venv/bin/activate' (repeatable)")
    slurm.add_argument("--partition", help="#SBATCH -p")
    slurm.add_argument("--account", help="#SBATCH -A")
    slurm.add_argument("--walltime", help=f"#SBATCH -t (default {default.walltime})")
    slurm.add_argument("--folder", help=f"a folder every node shares, relative to where "
                                        f"the jobs are submitted: job scripts, logs and the "
                                        f"scheduler file (default {default.folder})")
    slurm.add_argument("--interface", help="the network interface of the scheduler and "
                                           "workers, e.g. ib0 (default: Dask's choice)")
    slurm.add_argument("--jobqueue", action="store_true",
                       help="print a dask-jobqueue launcher (Python) instead")
    k8s.add_argument("--image", help="the container image of every pod, with digenrl "
                                     "installed (with its cuda extra for GPUs)")
    k8s.add_argument("--namespace", help="the namespace of the resources (default: "
                                         "kubectl's)")


def _cmd_deploy(args: argparse.Namespace) -> int:
    from dataclasses import fields

    from digenrl.commands import deploy as dp

    given = {f.name: getattr(args, f.name) for f in fields(dp.Deployment)
             if getattr(args, f.name, None) not in (None, [])}
    given = {k: tuple(v) if isinstance(v, list) else v for k, v in given.items()}
    d = dp.Deployment(**given, gpus=not args.cpu)
    if args.engine == "k8s":
        text = dp.k8s_yaml(d, dp.command_line("k8s", d))
    elif args.jobqueue:
        text = dp.jobqueue_launcher(d, dp.command_line("slurm", d, "--jobqueue"))
    else:
        text = dp.slurm_submit_script(d, dp.command_line("slurm", d))
    sys.stdout.write(text)
    return 0


def _cmd_reward_server(args: argparse.Namespace) -> int:
    import importlib

    from digenrl.serving import server as rs
    from digenrl.tasks.reward_sources import resolve_rewards
    from digenrl.tasks.rewards import REWARDS, get_reward

    for module in args.modules:
        try:
            importlib.import_module(module)
        except ImportError as e:
            raise ConfigError(f"--import: expected an importable module, got {module!r} "
                              f"({e})") from None
    models: Mapping[str, RewardModelConfig] = {}
    if args.config is not None:
        from digenrl.run.world import check_rewards

        reward = load_config(args.config).reward
        check_rewards(reward)
        models = reward.models
    if args.name in models:
        spec = resolve_rewards({args.name: 1.0}, models=models)[0][0]
    elif args.config is not None and args.name not in REWARDS:
        raise ConfigError(f"reward: expected a registered reward {sorted(REWARDS)} or one of "
                          f"reward.models in {args.config} {sorted(models)}, got "
                          f"{args.name!r}")
    else:
        try:
            spec = get_reward(args.name)
        except ValueError as e:
            raise ConfigError(str(e)) from None
    if spec.group:
        raise ConfigError(f"reward: expected a reward that scores each image alone (a "
                          f"server gathers requests of many groups into one pass), got the "
                          f"group reward {args.name!r}")
    options = rs.serve_options(
        spec, port=args.port, max_bytes=args.max_bytes, batch_size=args.batch_size,
        max_queue=args.max_queue, backlog=args.backlog, max_wait_ms=args.max_wait_ms,
        read_timeout=args.read_timeout, token=args.token)
    load = getattr(spec.fn, "load", None)  # a model reward's: loaded before serving
    if load is not None:
        try:
            load()
        except Exception as e:  # weights or a processor that transformers cannot read
            raise ConfigError(f"reward.models.{args.name}: expected a model that loads, "
                              f"got {type(e).__name__}: {e}") from None
    try:
        rs.serve(spec, args.host, allow_pickle=args.allow_pickle, **options,
                 announce=lambda line: print(line, flush=True))
    except OSError as e:
        raise ConfigError(f"--host/--port: expected an address this machine can listen on, "
                          f"got {args.host}:{args.port} ({e.strerror or e})") from None
    return 0


def _one_line(text: str) -> str:
    """An error message on one line, whatever it quotes (a YAML parser's report, a
    reward's exception)."""
    return " ".join(part.strip() for part in text.splitlines() if part.strip())


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    _setup_logging(getattr(args, "quiet", False))
    try:
        with _stop_on_signals(args):
            return {"run": _cmd_run, "bench": _cmd_bench, "report": _cmd_report,
                    "export": _cmd_export, "simulate": _cmd_simulate, "why": _cmd_why,
                    "reward-server": _cmd_reward_server,
                    "deploy": _cmd_deploy}[args.command](args)
    except Stopped as e:
        print(_interrupted(args, e.signum), file=sys.stderr)
        return 128 + e.signum
    except (ConfigError, StoreError) as e:
        if getattr(args, "debug", False):
            raise
        print(f"digenrl {args.command}: error: {_one_line(str(e))}", file=sys.stderr)
        return 2
    except RewardError as e:
        if getattr(args, "debug", False):
            raise
        print(f"digenrl {args.command}: error: {_one_line(_reward_failure(e, args))}",
              file=sys.stderr)
        return 1
    except RunStalled as e:
        out, n = _stored(args)
        hint = "" if n is None or out is None else (f"; {_holds(out, n)}; continue with: "
                                     f"{_resume_command(args, out)}")
        print(f"digenrl {args.command}: error: {_one_line(str(e))}{hint}", file=sys.stderr)
        return 1
    except Exception as e:
        if (args.command != "run" or getattr(args, "debug", False)
                or not _lost_scheduler(e, getattr(args, "scheduler", None))):
            raise
        print(_scheduler_loss(args, e), file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # outside the main thread, or on a platform without signals
        print(_interrupted(args, signal.SIGINT), file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
