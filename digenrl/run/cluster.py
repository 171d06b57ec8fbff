"""Where a run executes: the embedded local cluster, dask-cuda, or an existing scheduler.

Every worker advertises ``GPU`` slots and its pool as resources: ``GPU=1,rollout=1`` or
``GPU=1,trainer=1``. The scheduler plugin reads the pool from the worker's own
resources, so a cluster started from the command line works the same::

    dask scheduler --preload digenrl.schedulers.preload
    dask worker tcp://HOST:8786 --nthreads 2 --resources "GPU=1,rollout=1"
    dask worker tcp://HOST:8786 --nthreads 2 --resources "GPU=1,trainer=1"
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass, field
from typing import Any

import dask
from distributed import (Client, LocalCluster, Nanny, Scheduler, SpecCluster, Worker,
                         WorkerPlugin)
from distributed.deploy.subprocess import SubprocessScheduler
from distributed.utils import get_mp_context

from digenrl.config import ClusterConfig, ConfigError
from digenrl.vocabulary import GB, ROLLOUT, TRAINER
from digenrl.schedulers.plugin import DigenRLSchedulerPlugin, pool_from_resources

__all__ = ["ClusterHandle", "start_cluster", "start_emulated_cluster", "pool_counts",
           "PooledLocalCluster", "PooledSpecCluster", "QuietReportedErrors", "worker_resources",
           "workers_now", "gpu_memory_of",
           "HeadlessScheduler", "OneClockWorker", "DASK_CONFIG"]

logger = logging.getLogger(__name__)

#: Dask settings a run relies on. Parked tasks never time out (see
#: digenrl.schedulers.plugin for why). A cluster started here keeps every nanny however
#: often its worker dies: Dask closes a nanny for good when its worker has not joined
#: again ``lost-worker-timeout`` (15 s) after a loss, which a worker killed again while
#: it restarts has not, and its pool would then lose the worker for the rest of the run.
#: Dask's statistical profiler is off: every 10 ms it samples each task thread's stack on
#: the worker's event loop, the thread that also moves the worker's data and messages
#: (0.3 CPU-seconds of each 2-second iteration per worker of the default work); the
#: dashboard's Profile page stays empty. The event loops' own housekeeping runs less
#: often than Dask's defaults: each nanny and worker reads its process's memory every
#: second (not 0.1 s), every server its system counters every 2 s (not 0.5 s) and the
#: loop's latency every second (not 0.02 s; Dask still warns of a loop blocked longer
#: than ``tick.limit``, 3 s). Each is a few CPU-milliseconds a second per process that a
#: step's compute pays for on a host with few cores; an idle local cluster of 2+2
#: workers uses about half the CPU with a 1 s tick that it does with a 0.1 s one
#: (docs/performance.md, "Where the CPU goes").
DASK_CONFIG = {"distributed.scheduler.no-workers-timeout": None,
               "distributed.deploy.lost-worker-timeout": "1000 days",
               "distributed.worker.profile.enabled": False,
               "distributed.worker.memory.monitor-interval": "1s",
               "distributed.admin.system-monitor.interval": "2s",
               "distributed.admin.tick.interval": "1s"}

#: What every worker process of a cluster started here imports before its first task: the
#: libraries and task modules a model's tasks need (about 10 CPU-seconds of imports per
#: process). They are imported once, by a server process that each worker process is
#: then forked from (Python's ``forkserver``), instead of by every worker process itself
#: (Dask's default, ``spawn``); a worker that dies is back in about a second. Nothing
#: runs in that server but the imports: no thread pool, no CUDA context. Among them
#: diffusers' transformer and autoencoder classes and peft, which a worker imports when
#: it first builds a model (the task modules do not import them: the driver and the
#: scheduler never need them), about 2 CPU-seconds more per worker process.
WORKER_PRELOAD = ("distributed", "torch", "diffusers", "transformers",
                  "diffusers.models.transformers", "diffusers.models.autoencoders", "peft",
                  "digenrl.tasks.rollout", "digenrl.tasks.train")


def fork_local_workers() -> None:
    """Start the local worker processes of the clusters this process starts from one
    server that has imported :data:`WORKER_PRELOAD` (see there). A server already
    running keeps what it imported."""
    dask.config.set({"distributed.worker.multiprocessing-method": "forkserver"})
    get_mp_context().set_forkserver_preload(list(WORKER_PRELOAD))


#: Errors the driver reports itself, in one line naming what failed.
REPORTED_BY_DRIVER = ("RewardError(",)


def _not_reported_by_driver(record: logging.LogRecord) -> bool:
    """Drop a worker's "Compute Failed" report (the task, its exception and traceback)
    when the driver reports that exception itself."""
    if not str(record.msg).startswith("Compute Failed"):
        return True
    text = " ".join(map(str, record.args or ()))
    return not any(name in text for name in REPORTED_BY_DRIVER)


class OneClockWorker(Worker):
    """The worker of the CPU and emulated local clusters started here, whose processes
    all read one clock.

    Dask's worker estimates its clock's offset from the scheduler's at every heartbeat
    (the scheduler's time minus the middle of the round trip) and adds it to every time it
    reports: the start and stop of each computation and of each fetch, which the task
    records keep. On one host the true offset is zero and the estimate only its error, up
    to half a round trip (tens of milliseconds on a loaded host); it moves with every
    heartbeat, so a task's fetch and its computation were shifted by different amounts and
    a fetch could seem to end after the task that waited for it had started. This worker
    reports its own clock's times."""

    @property
    def scheduler_delay(self) -> float:
        return 0.0

    @scheduler_delay.setter
    def scheduler_delay(self, estimate: float) -> None:
        pass  # one clock: nothing to correct


class QuietReportedErrors(WorkerPlugin):
    """On the workers of a cluster ``digenrl run`` starts itself, whose log is the
    terminal the run was started from: a failing reward ends the run with one line from
    the driver naming the reward, the samples and the iteration, and the worker does not
    print the task's traceback above it. Other worker messages are unchanged."""

    name = "digenrl-quiet-reported-errors"

    def setup(self, worker) -> None:
        logging.getLogger("distributed.worker").addFilter(_not_reported_by_driver)

    def teardown(self, worker) -> None:
        logging.getLogger("distributed.worker").removeFilter(_not_reported_by_driver)


def worker_resources(pool: str, gpus: int = 1, speed: float | None = None) -> dict[str, float]:
    """A worker's resources: its GPU slots, its pool tag and, when it is not 1, its
    relative speed (the scheduler reads both; no task requires them)."""
    res: dict[str, float] = {"GPU": gpus, pool: 1}
    if speed is not None and speed != 1.0:
        res["speed"] = speed
    return res


class _PoolTagging:
    """Tags each new worker spec with the next pool that still needs workers, and with
    its speed: ``_speeds`` maps a worker name (``rollout-3``) or a pool to a speed."""

    _pool_sizes: dict[str, int]
    _speeds: dict[str, float] = {}
    worker_spec: dict[str, Any]     # (the SpecCluster's: worker name -> its spec)

    def _next_pool(self) -> str:
        counts = {p: 0 for p in self._pool_sizes}
        for spec in self.worker_spec.values():
            pool = pool_from_resources(spec.get("options", {}).get("resources") or {})
            if pool in counts:
                counts[pool] += 1
        for pool, want in self._pool_sizes.items():
            if counts[pool] < want:
                return pool
        return next(iter(self._pool_sizes))

    def _spec_name(self, pool: str, name: Any) -> Any:
        """Local workers are named ``rollout-0``, ``trainer-0``, ..."""
        taken = set(self.worker_spec)
        i = 0
        while f"{pool}-{i}" in taken:
            i += 1
        return f"{pool}-{i}"

    def new_worker_spec(self):  # called by SpecCluster.scale for each new worker
        [(name, spec)] = super().new_worker_spec().items()
        spec = copy.deepcopy(spec)
        pool = self._next_pool()
        opts = spec.setdefault("options", {})
        name = self._spec_name(pool, name)
        speed = self._speeds.get(str(name), self._speeds.get(pool))
        opts["resources"] = {**(opts.get("resources") or {}),
                             **worker_resources(pool, speed=speed)}
        return {name: spec}


class HeadlessScheduler(Scheduler):
    """A Dask scheduler without an HTTP server: no dashboard, no ``/health`` or
    ``/metrics`` routes, no port opened and no link logged.

    Dask's ``Scheduler.__init__`` always calls ``start_http_server``, which listens on
    ``dashboard_address``, else on port 8787, else on any free port, whether or not the
    dashboard is on (``dashboard=False`` only leaves the Bokeh pages out), and no Dask
    setting stops it. This scheduler's ``start_http_server`` starts nothing, so the
    scheduler lists no ``dashboard`` service and ``Client.dashboard_link`` is empty.
    (Nothing else of the scheduler reads the HTTP server: only the dashboard's pages,
    Jupyter, and the websocket comm, none of which a local cluster without a dashboard
    uses.)"""

    def start_http_server(self, routes, dashboard_address, default_port=0,
                          ssl_options=None) -> None:
        pass


class _HeadlessWhenDashboardOff:
    """A local cluster started with ``dashboard_address=None`` runs a
    :class:`HeadlessScheduler` in place of Dask's."""

    _dashboard_off = False

    async def _start(self):
        if self._dashboard_off and self.scheduler_spec.get("cls") is Scheduler:
            self.scheduler_spec = {**self.scheduler_spec, "cls": HeadlessScheduler}
        await super()._start()


class PooledLocalCluster(_PoolTagging, _HeadlessWhenDashboardOff, LocalCluster):
    """A LocalCluster whose worker processes are tagged ``rollout-N`` / ``trainer-N``
    and report this host's clock (:class:`OneClockWorker`); with
    ``dashboard_address=None`` its scheduler opens no HTTP port at all."""

    def __init__(self, rollout_workers: int, trainer_workers: int, *,
                 speeds: dict[str, float] | None = None, **kwargs: Any):
        self._pool_sizes = {ROLLOUT: rollout_workers, TRAINER: trainer_workers}
        self._speeds = dict(speeds or {})
        self._dashboard_off = kwargs.get("dashboard_address", ":8787") is None
        super().__init__(n_workers=0, **kwargs)
        if self.new_spec["cls"] is Nanny:
            self.new_spec["options"]["worker_class"] = OneClockWorker
        self.scale(rollout_workers + trainer_workers)


def _cuda_cluster(rollout: int, trainer: int, cfg: ClusterConfig):
    """A LocalCUDACluster, one worker per GPU, the first GPUs in the rollout pool."""
    from dask_cuda import LocalCUDACluster  # imported only when GPUs are asked for
    from dask_cuda.utils import get_n_gpus

    n = get_n_gpus()
    if rollout + trainer > n:
        raise ConfigError(f"cluster.rollout_workers + cluster.trainer_workers: expected at "
                          f"most the {n} visible GPUs, got {rollout + trainer}")

    class PooledLocalCUDACluster(_PoolTagging, _HeadlessWhenDashboardOff, LocalCUDACluster):
        def _spec_name(self, pool, name):
            return name  # dask-cuda names workers after their GPU

        def __init__(self, **kw):
            self._pool_sizes = {ROLLOUT: rollout, TRAINER: trainer}
            self._dashboard_off = kw.get("dashboard_address", ":8787") is None
            super().__init__(**kw)

    return PooledLocalCUDACluster(
        n_workers=rollout + trainer, threads_per_worker=cfg.threads_per_worker,
        dashboard_address=cfg.dashboard_address)


@dataclass
class ClusterHandle:
    client: Client
    cluster: Any | None
    description: dict[str, Any] = field(default_factory=dict)
    #: False when the dashboard was turned off: no link, whatever the scheduler lists.
    dashboard: bool = True

    def close(self) -> None:
        """Close the client and the cluster started for it. A cluster slow to shut down
        (dozens of worker processes on a loaded machine) costs a warning, not the
        results of the work already done, and leaves no process behind. The workers of a
        cluster started here stop their heartbeats first: a heartbeat under way while
        the scheduler closes would log Dask's ``Failed to communicate with scheduler
        during heartbeat`` traceback after a finished command's output."""
        try:
            if self.cluster is not None:
                stop_heartbeats(self.client)
            self.client.close()
        finally:
            if self.cluster is not None:
                try:
                    self.cluster.close(timeout=120)
                except (TimeoutError, OSError, RuntimeError) as e:
                    logger.warning("the cluster did not shut down cleanly (%r); stopping "
                                   "its processes", e)
                finally:
                    _kill_subprocess_scheduler(self.cluster)

    @property
    def dashboard_link(self) -> str | None:
        """The dashboard's URL; None when the scheduler has none (a local cluster with
        ``cluster.dashboard_address: null``)."""
        if not self.dashboard:
            return None
        try:
            return self.client.dashboard_link or None
        except Exception:  # a scheduler without a dashboard
            return None


def stop_heartbeats(client: Client) -> None:
    """Each worker's heartbeat to the scheduler stopped (on the worker's event loop:
    a callback stopped, nothing that blocks); a worker that cannot be reached is
    closing already."""
    try:
        client.run(_stop_heartbeat, on_error="ignore")
    except (OSError, TimeoutError):
        pass


def _stop_heartbeat(dask_worker) -> None:
    callback = dask_worker.periodic_callbacks.get("heartbeat")
    if callback is not None:
        callback.stop()


def _kill_subprocess_scheduler(cluster: Any) -> None:
    """The scheduler a :class:`PooledSpecCluster` runs in a process of its own."""
    proc = getattr(getattr(cluster, "scheduler", None), "process", None)
    if proc is not None and proc.returncode is None:
        try:
            proc.kill()
        except ProcessLookupError:
            pass


def _workers_info(client: Client) -> dict[str, dict]:
    """The scheduler's view of every worker, fetched now (``Client.scheduler_info``
    quietly returns its cached, possibly empty, copy when the fetch fails on a busy
    scheduler)."""
    return client.sync(client.scheduler.identity, n_workers=-1)["workers"]


def worker_speeds(client: Client) -> dict[str, float]:
    """Each worker's declared speed (its ``speed`` resource; 1 when absent), by name."""
    return {str(w.get("name", addr)): float((w.get("resources") or {}).get("speed", 1.0))
            for addr, w in _workers_info(client).items()}


def workers_now(client: Client) -> tuple[dict[str, list[str]], dict[str, float]]:
    """The workers by pool (:func:`pool_counts`) and their GPUs' memory
    (:func:`gpu_memory_of`), from one fetch of the scheduler's view of them."""
    workers = _workers_info(client)
    return pools_of(workers), gpu_memory_of(workers)


def gpu_memory_of(workers: dict[str, dict]) -> dict[str, float]:
    """Each worker's GPU memory in GB, by name, where it reports one (``workers``: the
    scheduler's view of them): the total Dask's NVML diagnostics record when a worker
    starts on a GPU (its ``gpu`` information)."""
    out = {}
    for addr, w in workers.items():
        total = (w.get("gpu") or {}).get("memory-total")
        if total:
            out[str(w.get("name", addr))] = float(total) / GB
    return out


def pool_counts(client: Client) -> dict[str, list[str]]:
    """Worker names per pool tag (and ``untagged``), from the workers' resources."""
    return pools_of(_workers_info(client))


def pools_of(workers: dict[str, dict]) -> dict[str, list[str]]:
    """:func:`pool_counts` of the scheduler's view of the workers."""
    out: dict[str, list[str]] = {ROLLOUT: [], TRAINER: [], "untagged": []}
    for addr, w in workers.items():
        res = w.get("resources") or {}
        if res.get("GPU", 0) <= 0:
            out["untagged"].append(str(w.get("name", addr)))
            continue
        out[pool_from_resources(res) or "untagged"].append(str(w.get("name", addr)))
    return out


#: Worker settings for emulated GPUs: dozens of worker processes share this machine's few
#: cores, so the per-process diagnostics (the statistical profiler sampling every 10 ms,
#: the 20 ms event-loop tick, frequent system and memory monitors) would starve the
#: scheduler -- 32 idle workers used 117% of a core with Dask's defaults and 24.5% with
#: these (a real cluster gives every worker its own CPUs). Tasks that only sleep need none.
EMULATED_WORKER_CONFIG = {
    "distributed.worker.profile.enabled": False,
    "distributed.admin.tick.interval": "1s",
    "distributed.admin.system-monitor.interval": "2s",
    "distributed.worker.memory.monitor-interval": "2s",
}


#: Where a scheduler that must listen for HTTP, but serves no dashboard, listens.
LOOPBACK_ANY_PORT = "127.0.0.1:0"


class PooledSpecCluster(_PoolTagging, SpecCluster):
    """Pool-tagged worker processes with the scheduler in a process of its own, as in a
    real deployment: the driver's work never competes with the scheduler's event loop.

    Dask starts that process's scheduler itself (``distributed.Scheduler``, not a
    :class:`HeadlessScheduler`), so with ``dashboard_address=None`` its HTTP server
    still listens: on a free port of 127.0.0.1, reachable from this machine only, and
    serving no dashboard (:func:`start_emulated_cluster`'s handle gives no link)."""

    def __init__(self, rollout_workers: int, trainer_workers: int, *,
                 speeds: dict[str, float] | None = None, nthreads: int = 2,
                 dashboard_address: str | None = None,
                 worker_config: dict | None = None):
        self._pool_sizes = {ROLLOUT: rollout_workers, TRAINER: trainer_workers}
        self._speeds = dict(speeds or {})
        scheduler = {"cls": SubprocessScheduler, "options": {"scheduler_kwargs": {
            "host": "127.0.0.1", "dashboard": dashboard_address is not None,
            "dashboard_address": (dashboard_address if dashboard_address is not None
                                  else LOOPBACK_ANY_PORT)}}}
        worker = {"cls": Nanny, "options": {"nthreads": nthreads, "memory_limit": 0,
                                            "worker_class": OneClockWorker,
                                            "silence_logs": logging.WARNING,
                                            "config": dict(worker_config or {})}}
        super().__init__(workers={}, scheduler=scheduler, worker=worker,
                         silence_logs=logging.WARNING)
        self.scale(rollout_workers + trainer_workers)


def start_emulated_cluster(rollout: int, trainer: int, speeds: dict[str, float],
                           dashboard_address: str | None = ":8787") -> ClusterHandle:
    """Dozens of worker processes on one machine for emulated GPUs (tasks only sleep, so
    no task imports torch), the scheduler in its own process."""
    dask.config.set(DASK_CONFIG)
    fork_local_workers()
    cluster = PooledSpecCluster(rollout, trainer, speeds=speeds,
                                dashboard_address=dashboard_address,
                                worker_config=EMULATED_WORKER_CONFIG)
    client = Client(cluster)
    client.wait_for_workers(rollout + trainer, timeout=300)
    client.register_plugin(DigenRLSchedulerPlugin())
    return ClusterHandle(client, cluster, {"kind": "emulated", "scheduler": cluster.scheduler_address,
                                           "pools": pool_counts(client),
                                           "speeds": worker_speeds(client)},
                         dashboard=dashboard_address is not None)


def start_cluster(cfg: ClusterConfig, *, pools: bool = True) -> ClusterHandle:
    """Start (or connect to) the cluster ``cfg`` describes, with the plugin installed."""
    dask.config.set(DASK_CONFIG)
    cluster = None
    kind = "existing"
    if cfg.scheduler is not None:
        try:
            client = Client(cfg.scheduler, timeout=f"{cfg.connect_timeout}s")
        except (OSError, ValueError) as e:  # unreachable, or an address Dask cannot read
            raise ConfigError(f"cluster.scheduler: expected a reachable Dask scheduler, "
                              f"got {cfg.scheduler!r} ({e})") from None
    else:
        if cfg.gpus:
            try:
                cluster = _cuda_cluster(cfg.rollout_workers, cfg.trainer_workers, cfg)
                kind = "dask-cuda"
            except ImportError as e:
                logger.warning("GPUs were asked for but dask-cuda cannot be imported (%s); "
                               "falling back to a CPU LocalCluster with emulated GPU slots. "
                               "Install it with: pip install 'digenrl[cuda]'", e)
        if cluster is None:
            fork_local_workers()
            cluster = PooledLocalCluster(
                cfg.rollout_workers, cfg.trainer_workers, processes=True,
                threads_per_worker=cfg.threads_per_worker,
                dashboard_address=cfg.dashboard_address, memory_limit=cfg.memory_limit,
                silence_logs=logging.WARNING)
            kind = "local"
        client = Client(cluster)
        client.wait_for_workers(cfg.rollout_workers + cfg.trainer_workers, timeout=120)
        client.register_plugin(QuietReportedErrors())
    client.register_plugin(DigenRLSchedulerPlugin())
    counts = pool_counts(client)
    if pools:
        for pool in (ROLLOUT, TRAINER):
            if not counts[pool]:
                raise ConfigError(
                    f"cluster: the {pool} pool has no workers (workers by pool: {counts}); "
                    f"start workers with --resources 'GPU=1,{pool}=1'")
    elif not counts[ROLLOUT] and not counts[TRAINER]:
        raise ConfigError(f"cluster: no worker advertises a GPU slot (workers: {counts}); "
                          "start workers with --resources 'GPU=1,rollout=1'")
    description = {"kind": kind, "scheduler": client.scheduler.address, "pools": counts,
                   "speeds": worker_speeds(client)}
    return ClusterHandle(client, cluster, description)
