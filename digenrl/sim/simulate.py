"""``digenrl simulate``: the scheduling policy on simulated clusters of 16 to 2,048 GPUs.

The discrete-event engine (:mod:`digenrl.sim.engine`) runs a profile's iteration DAG
under the same :class:`~digenrl.schedulers.policy.SchedulingPolicy` the Dask plugin
uses. Tasks cost what :mod:`digenrl.sim.costs` says, the one cost model the emulator
sleeps too (weight sync, phase switch, remote reward, the all-reduce at the reduction
root, a context-parallel step's gang); on top of it the simulator models what Dask
does for the emulator: moving latents between workers (``latent_bytes / bandwidth +
latency``) and a dispatch latency per task (the scheduler round trip).
"""

from __future__ import annotations

import dataclasses

import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from digenrl.figures.analysis import ideal_fraction
from digenrl.schedulers.options import ScheduleOptions
from digenrl.schedulers.policy import TaskInfo
from digenrl.sim.costs import Extras, TaskCosts, WorkerHeld, planned
from digenrl.sim.engine import SimClock, SimResult, SimWorker, Simulator
from digenrl.sim.profile import Profile
from digenrl.figures.variants import variant_schedule
from digenrl.vocabulary import COLOCATED, DENOISE, NOISE, ROLLOUT, TRAINER

__all__ = ["SimulationReport", "simulate", "simulate_variants", "format_reports",
           "format_degrees", "degree_runs", "DASK_ROUND_TRIP"]

#: The scheduler<->worker round trip of one task on this kind of machine, seconds
#: (``python workflows/microbench.py dispatch``: 5.7 ms per hop of a dependent chain).
DASK_ROUND_TRIP = 0.0057


@dataclass
class SimulationReport:
    profile: str
    mode: str
    gpus: int
    iterations: int
    images_per_s: float
    ideal_images_per_s: float
    ideal_fraction: float
    utilisation: dict[str, float]
    weight_sync_s: float          # GPU-seconds spent waiting for weights (rollout workers)
    wall_s: float                 # how long the simulation itself took
    tasks: int
    result: SimResult | None = None
    #: With ``model.sharding: fsdp``: the share of the GPUs' simulated time spent in
    #: collectives (all-gathers, the reduce-scatter, the weights' publish), as charged.
    collective_share: float | None = None
    #: The profile's ``context_parallel`` and the degree of each chunk of an iteration.
    context_parallel: int | str = 1
    degrees: tuple[int, ...] = ()
    images_per_iteration: int = 0

    @property
    def iteration_s(self) -> float:
        """Seconds per iteration (the profile's time): its images over the rate."""
        return self.images_per_iteration / self.images_per_s

    def as_dict(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        d.pop("result")
        d["iteration_s"] = self.iteration_s
        return d


def _workers(profile: Profile, speeds: Mapping[str, float] | None = None) -> list[SimWorker]:
    """The profile's workers; ``speeds`` overrides the speed of workers by name."""
    speeds = speeds or {}
    names = profile.worker_names()
    unknown = set(speeds) - {n for n, _ in names}
    if unknown:
        raise ValueError(f"speeds: expected names of the profile's workers, got {sorted(unknown)}")
    return [SimWorker(n, pool, 1, speeds.get(n, profile.speed_of(n))) for n, pool in names]


def simulate(profile: Profile, options: ScheduleOptions, iterations: int, *,
             stale_groups: int | None = None, dispatch_latency: float = 0.005,
             queued_latency: float = 0.0, skip: int = 1, drain: int = 1,
             slowdown: Callable[[str, float], float] | None = None,
             speeds: Mapping[str, float] | None = None, trail: int = 0) -> SimulationReport:
    """Simulate ``iterations`` of ``profile`` under ``options``.

    ``dispatch_latency``: seconds (in the profile's time) between a task's release and
    its start when the worker is idle; ``queued_latency``: between a GPU freeing and the
    task queued on that worker starting. ``slowdown(worker, now)``: a factor on the
    durations of a worker's tasks starting at ``now`` (stragglers; default: the profile's
    ``slowdowns``). ``speeds``: per-worker speeds (``rollout-0``...) instead of the
    profile's; the ideal bound counts each worker at its speed. The policy's rebalancing
    assumes the profile's network bandwidth. ``trail``: decisions kept per task in the
    records' ``decisions`` column (0, the default, records none).
    """
    colocated = not options.pools
    profile.check_memory(colocated=colocated)
    plans = planned(profile, iterations)
    chunks = len(plans[0].chunks) if plans else 0
    degrees = tuple(plans[0].context_parallel or (1,) * chunks) if plans else ()
    pool = profile.gpus if colocated else profile.rollout_workers
    if degrees and max(degrees) > pool:
        raise ValueError(f"context_parallel: expected at most the {pool} workers that "
                         f"generate, got {max(degrees)}")
    options = dataclasses.replace(options, transfer_bandwidth=profile.network.bandwidth)
    if slowdown is None and profile.slowdowns:
        slowdown = profile.slowdown_factor
    layout = profile.layout(options.max_staleness, stale_groups)
    workers = _workers(profile, speeds)
    costs = TaskCosts(profile, layout, plans, colocated=colocated)
    extras = Extras.of(profile, colocated=colocated)
    held = {w.name: WorkerHeld() for w in workers}
    rollout_worker = {w.name: w.pool == ROLLOUT for w in workers}
    clock = SimClock()

    def cost(info: TaskInfo, worker: SimWorker) -> float:
        kind, name = info.kind, worker.name
        seconds, network = costs.task(kind, info.samples, info.key, info.iteration, info.gang)
        if slowdown is not None:
            seconds *= slowdown(name, clock.now)
        extra = network + extras.pay(held[name], kind, info.policy_version,
                                     rollout_worker[name])
        # The engine divides by the worker's speed; extras are network time, not compute.
        return seconds + extra * worker.speed if extra else seconds

    latent = profile.costs.latent_bytes_per_sample
    net = profile.network

    def transfer(kind: str, samples: int) -> float:
        if kind in (NOISE, DENOISE) and latent:
            return net.latency + latent * samples / net.bandwidth
        return 0.0

    sim = Simulator(options, workers, cost,
                    transfer=transfer, dispatch_latency=dispatch_latency,
                    queued_latency=queued_latency,
                    output_bytes=lambda kind, samples: max(samples, 1),
                    clock=clock, trail=trail)
    t = time.perf_counter()
    result = sim.run(layout, plans)
    wall = time.perf_counter() - t
    synced = sum(h.synced for h in held.values())
    report = _report(profile, options, result, iterations, skip, drain, wall, synced)
    report.context_parallel = profile.context_parallel
    report.degrees = degrees
    if profile.model.fsdp:
        charged = (synced + sum(h.gathered for h in held.values())
                   + costs.allreduce * len(result.completed))
        report.collective_share = charged / (result.end * len(workers))
    return report


def _report(profile: Profile, options: ScheduleOptions, result: SimResult, iterations: int,
            skip: int, drain: int, wall: float, sync: float) -> SimulationReport:
    ends = result.completed
    its = sorted(ends)[: len(ends) - drain]
    if len(its) <= skip:
        raise ValueError(f"iterations: expected more than skip + drain = {skip + drain}, "
                         f"got {iterations}")
    t0, t1 = ends[its[skip - 1]], ends[its[-1]]
    images = profile.images_per_iteration * (len(its) - skip)
    rate = images / (t1 - t0)
    ideal = profile.ideal_images_per_s(sum(w.speed for w in result.workers))
    busy = result.busy(t0, t1)
    util = {}
    groups = {ROLLOUT: [w for w in result.workers if w.pool == ROLLOUT],
              TRAINER: [w for w in result.workers if w.pool == TRAINER]}
    if not options.pools:
        groups = {COLOCATED: list(result.workers)}
    for pool, ws in groups.items():
        if ws:
            util[pool] = sum(busy.get(w.name, 0.0) for w in ws) / (len(ws) * (t1 - t0))
    return SimulationReport(profile=profile.name, mode=options.mode, gpus=profile.gpus,
                            iterations=iterations, images_per_s=rate,
                            ideal_images_per_s=ideal,
                            ideal_fraction=ideal_fraction(rate, ideal),
                            utilisation=util, weight_sync_s=sync, wall_s=wall,
                            tasks=result.tasks, result=result,
                            images_per_iteration=profile.images_per_iteration)


def simulate_variants(profile: Profile, variants, iterations: int, *,
                      dispatch_latency: float = 0.005, queued_latency: float = 0.0,
                      latencies: Mapping[str, tuple[float, float]] | None = None,
                      skip: int = 1, drain: int = 1) -> list[tuple[str, SimulationReport]]:
    """Every named variant (:data:`digenrl.figures.variants.VARIANTS`) of ``profile``.
    ``latencies``: per variant, the (dispatch, queued) latencies to use instead of the
    common ones."""
    out = []
    for name in variants:
        s = variant_schedule(name)
        dispatch, queued = (latencies or {}).get(name, (dispatch_latency, queued_latency))
        out.append((name, simulate(profile, s.options(), iterations,
                                   stale_groups=s.stale_groups, dispatch_latency=dispatch,
                                   queued_latency=queued, skip=skip, drain=drain)))
    return out


def measured_latencies(overhead: Mapping[str, float],
                       time_scale: float) -> tuple[float, float]:
    """The (dispatch, queued) latencies, in the profile's time, that an emulated run
    measured (its ``dispatch_overhead``: milliseconds of wall clock at ``time_scale``):
    what :func:`simulate` charges to stand for that run's Dask."""
    return (overhead["fresh_ms"] / 1000 / time_scale,
            overhead["queued_ms"] / 1000 / time_scale)


def format_reports(reports, emulated: Mapping[str, float] | None = None,
                   uncalibrated: Mapping[str, float] | None = None) -> str:
    """A table of simulated variants; with ``emulated`` (variant -> images/s measured on
    emulated GPUs), the difference between the two, and with ``uncalibrated`` (variant ->
    simulated images/s with the default latencies) that one's difference too."""
    head = (f"{'variant':<14}{'GPUs':>6}{'img/s':>10}{'ideal':>7}{'util r/t/c':>18}"
            f"{'tasks':>10}{'sim s':>8}")
    if emulated:
        head += f"{'emulated':>10}{'diff':>8}"
    if uncalibrated:
        head += f"{'fixed-latency diff':>20}"
    shares = any(r.collective_share is not None for _, r in reports)
    if shares:
        head += f"{'collectives':>13}"
    lines = [head, "-" * len(head)]
    for name, r in reports:
        u = "/".join(f"{r.utilisation[p]:.2f}" if p in r.utilisation else "-"
                     for p in (ROLLOUT, TRAINER, COLOCATED))
        line = (f"{name:<14}{r.gpus:>6}{r.images_per_s:>10.4f}{r.ideal_fraction:>7.3f}{u:>18}"
                f"{r.tasks:>10}{r.wall_s:>8.1f}")
        if emulated and name in emulated:
            e = emulated[name]
            line += f"{e:>10.4f}{100 * (r.images_per_s - e) / e:>7.1f}%"
            if uncalibrated and name in uncalibrated:
                line += f"{100 * (uncalibrated[name] - e) / e:>19.1f}%"
        if shares:
            share = r.collective_share
            line += f"{'-' if share is None else f'{100 * share:.1f}%':>13}"
        lines.append(line)
    if shares:
        lines.append("collectives: the share of the GPUs' simulated time in FSDP's all-gathers, "
                     "the gradients' reduce-scatter and the weights' publish")
    return "\n".join(lines)


def degree_runs(degrees) -> str:
    """An iteration's chunk degrees as runs in chunk order: ``50x1 5x2 9x1``."""
    runs: list[list[int]] = []
    for d in degrees:
        if runs and runs[-1][1] == d:
            runs[-1][0] += 1
        else:
            runs.append([1, d])
    return " ".join(f"{n}x{d}" for n, d in runs)


def format_degrees(reports) -> str:
    """A table of ``(variant, report)`` at several context-parallel degrees: each row's
    iteration time, images/s, fraction of the ideal bound (the degree-1 GPU work with
    every GPU busy) and its iteration's chunks by degree."""
    head = (f"{'variant':<14}{'cp':>6}{'GPUs':>6}{'iteration s':>13}{'img/s':>10}"
            f"{'ideal':>7}  chunks x degree")
    lines = [head, "-" * len(head)]
    for name, r in reports:
        lines.append(f"{name:<14}{str(r.context_parallel):>6}{r.gpus:>6}"
                     f"{r.iteration_s:>13.1f}{r.images_per_s:>10.4f}{r.ideal_fraction:>7.3f}"
                     f"  {degree_runs(r.degrees)}")
    return "\n".join(lines)
