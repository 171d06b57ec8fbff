"""Deployments beyond one machine, rendered from one place.

``digenrl deploy slurm`` prints a script that writes and submits SLURM jobs: a Dask
scheduler with digenrl's plugin preloaded, and one job array per pool whose workers
carry their pool tag and GPU slot. ``digenrl deploy slurm --jobqueue`` prints the same
jobs as a dask-jobqueue launcher, and ``digenrl deploy k8s`` a manifest for the
dask-kubernetes operator: a ``DaskCluster`` (the scheduler) and one ``DaskWorkerGroup``
per pool. Nothing here needs dask-jobqueue or dask-kubernetes installed: the texts are
rendered from what their formats are, and the worker's flags from the facts the local
cluster uses (:func:`digenrl.run.cluster.worker_resources`, the configured threads per
worker, the preload module and :data:`digenrl.run.cluster.DASK_CONFIG`).

Every worker serves one GPU (``dask cuda worker`` starts one worker per GPU it sees) and
advertises ``GPU=1`` and its pool; with ``gpus=False`` the workers are ``dask worker``
processes on CPUs, each advertising one emulated GPU slot, as the local cluster's do.
"""

from __future__ import annotations

import math
import posixpath
import re
import shlex
from dataclasses import dataclass, fields
from typing import Any, Sequence

import yaml
from dask.utils import format_bytes, parse_bytes

from digenrl.checks import require
from digenrl.run.cluster import DASK_CONFIG, worker_resources
from digenrl.config import ClusterConfig
from digenrl.schedulers import preload
from digenrl.vocabulary import POOLS, ROLLOUT, TRAINER

__all__ = ["Deployment", "PRELOAD", "command_line", "resources_argument", "worker_command",
           "scheduler_command", "dask_env", "jobqueue_settings", "job_script",
           "slurm_job_scripts", "slurm_submit_script", "jobqueue_launcher", "k8s_manifest",
           "k8s_yaml"]

#: The module ``dask scheduler --preload`` imports to install digenrl's plugin.
PRELOAD = preload.__name__
#: The Python modules behind ``dask cuda worker`` and ``dask worker`` (``python -m``).
GPU_WORKER_MODULE = "dask_cuda.cli"
CPU_WORKER_MODULE = "distributed.cli.dask_worker"
SCHEDULER_MODULE = "distributed.cli.dask_scheduler"
#: The interpreter line of every job script (dask-jobqueue's default).
SHEBANG = "#!/usr/bin/env bash"
#: Where a scheduler in a container listens: every interface of its pod.
ALL_INTERFACES = "0.0.0.0"
#: The dask-kubernetes operator's resources.
K8S_API = "kubernetes.dask.org/v1"
#: A worker container's name: the ``DASK_WORKER_NAME`` the operator puts in its
#: environment (Kubernetes expands ``$(VAR)`` in a container's args).
K8S_WORKER_NAME = "$(DASK_WORKER_NAME)"

_LOCAL_DEFAULTS = ClusterConfig()
_NAME = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")
_ENV_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


@dataclass(frozen=True)
class Deployment:
    """A cluster of ``rollout_workers`` + ``trainer_workers`` workers, one GPU each."""

    rollout_workers: int = _LOCAL_DEFAULTS.rollout_workers
    trainer_workers: int = _LOCAL_DEFAULTS.trainer_workers
    #: SLURM: the GPUs one job takes (one worker each), fewer when a pool is smaller;
    #: a pool larger than this must be a multiple of it. Without GPUs: workers per job.
    gpus_per_node: int = 1
    #: False: CPU workers (``dask worker``), each with one emulated GPU slot.
    gpus: bool = True
    nthreads: int = _LOCAL_DEFAULTS.threads_per_worker
    #: Host memory of each worker (Dask's memory limit, and what the job requests).
    memory: str = "32GiB"
    #: The cluster's name: SLURM job names, Kubernetes resource names.
    name: str = "digenrl"
    #: 0: any free port (SLURM only: the workers read the address from the scheduler file).
    scheduler_port: int = 8786
    dashboard_port: int = 8787
    #: Environment variables of every process (``KEY=VALUE``).
    env: tuple[str, ...] = ()
    #: Seconds a worker waits for an unreachable scheduler before it exits.
    death_timeout: int = 60
    # -- SLURM
    python: str = "python3"
    #: Shell lines run before each process (``module load ...``, ``source .venv/bin/activate``).
    prologue: tuple[str, ...] = ()
    partition: str | None = None
    account: str | None = None
    walltime: str = "24:00:00"
    #: A folder every node shares, relative to where the jobs are submitted: the job
    #: scripts, their logs and the scheduler file.
    folder: str = "digenrl-cluster"
    #: The network interface of the scheduler and workers (e.g. ``ib0``); None: Dask's choice.
    interface: str | None = None
    # -- Kubernetes
    image: str | None = None
    namespace: str | None = None

    def pools(self) -> dict[str, int]:
        return {ROLLOUT: self.rollout_workers, TRAINER: self.trainer_workers}

    def validate(self, engine: str = "slurm") -> None:
        """One line naming the flag, what was expected and what arrived."""
        for flag, value in (("--rollout-workers", self.rollout_workers),
                            ("--trainer-workers", self.trainer_workers),
                            ("--gpus-per-node", self.gpus_per_node),
                            ("--nthreads", self.nthreads),
                            ("--death-timeout", self.death_timeout)):
            require(isinstance(value, int) and not isinstance(value, bool) and value >= 1,
                     flag, "an integer >= 1", value)
        for pool, n in self.pools().items():
            per_job = min(self.gpus_per_node, n)
            require(n % per_job == 0, f"--{pool}-workers",
                     f"at most --gpus-per-node ({self.gpus_per_node}) or a multiple of it "
                     "(each job takes that many GPUs)", n)
        try:
            memory = parse_bytes(self.memory)
        except (ValueError, TypeError):
            memory = 0
        require(memory > 0, "--memory", "a size such as 32GiB or 500MB", self.memory)
        require(isinstance(self.name, str) and bool(_NAME.fullmatch(self.name))
                 and len(self.name) <= 40, "--name",
                 "a lowercase name of letters, digits and '-' (at most 40 characters)",
                 self.name)
        low = 1 if engine == "k8s" else 0
        for flag, port in (("--scheduler-port", self.scheduler_port),
                           ("--dashboard-port", self.dashboard_port)):
            require(isinstance(port, int) and low <= port <= 65535, flag,
                     f"a port from {low} to 65535", port)
        for item in self.env:
            key, sep, _ = item.partition("=")
            require(bool(sep) and bool(_ENV_KEY.fullmatch(key)) and "\n" not in item,
                     "--env", "KEY=VALUE on one line, KEY a shell variable name", item)
        for flag, text in (("--python", self.python), ("--partition", self.partition),
                           ("--account", self.account), ("--walltime", self.walltime),
                           ("--folder", self.folder), ("--interface", self.interface),
                           ("--image", self.image), ("--namespace", self.namespace)):
            require(text is None or (isinstance(text, str) and text != ""
                                     and not any(c.isspace() for c in text)),
                    flag, "a value without spaces", text)
        for line in self.prologue:
            require("\n" not in line and line != _EOF, "--prologue", "one shell line",
                     line)
        if engine == "k8s":
            require(self.image is not None, "--image",
                     "the container image every pod runs (with digenrl installed)", None)

    @property
    def environment(self) -> dict[str, str]:
        return dict(item.partition("=")[::2] for item in self.env)


def command_line(engine: str, d: Deployment, *extra: str) -> str:
    """The ``digenrl deploy`` command that renders ``d``: each field differing from its
    default as its flag (``--rollout-workers 4``; ``gpus`` false is ``--cpu``)."""
    parts = ["digenrl", "deploy", engine, *extra]
    default = Deployment()
    for f in fields(d):
        value = getattr(d, f.name)
        if value == getattr(default, f.name):
            continue
        flag = "--" + f.name.replace("_", "-")
        if f.name == "gpus":
            parts.append("--cpu")
        elif isinstance(value, tuple):
            for item in value:
                parts += [flag, item]
        else:
            parts += [flag, str(value)]
    return shlex.join(parts)


# ---------------------------------------------------------------- the worker's facts

def resources_argument(pool: str) -> str:
    """``--resources`` of a worker of ``pool``: ``GPU=1,rollout=1``."""
    return ",".join(f"{k}={v:g}" for k, v in worker_resources(pool).items())


def _memory_bytes(d: Deployment) -> int:
    return parse_bytes(d.memory)


def _memory_limit(d: Deployment) -> str:
    """A worker's ``--memory-limit`` as dask-jobqueue writes it (``32.00GiB``)."""
    return format_bytes(_memory_bytes(d)).replace(" ", "")


def _size(n: int, suffix: str = "iB") -> str:
    """Bytes exactly, in the largest binary unit that divides them (``32GiB``; Kubernetes
    writes ``32Gi``)."""
    for unit, size in (("G", 2**30), ("M", 2**20), ("K", 2**10)):
        if n % size == 0:
            return f"{n // size}{unit}{suffix}"
    return str(n)


def _slurm_bytes(n: int) -> str:
    """Bytes as SLURM's ``--mem`` reads them, rounded up (its K, M and G are KiB, ...)."""
    for unit, size in (("G", 2**30), ("M", 2**20), ("K", 2**10)):
        if n >= size:
            return f"{math.ceil(n / size)}{unit}"
    return "1K"


def workers_per_job(d: Deployment, pool: str) -> int:
    return min(d.gpus_per_node, d.pools()[pool])


def jobs(d: Deployment, pool: str) -> int:
    return d.pools()[pool] // workers_per_job(d, pool)


def worker_command(d: Deployment, pool: str, scheduler: str | None, name: str,
                   workers: int = 1) -> list[str]:
    """The command starting ``workers`` workers of ``pool`` (each with one GPU, or one
    emulated GPU slot), named ``name`` (``name-0``, ``name-1``, ... when several),
    joining ``scheduler``: an address, ``--scheduler-file PATH``, or None for the
    ``DASK_SCHEDULER_ADDRESS`` of their environment. The order of the flags is
    dask-jobqueue's, so that its job scripts and these are the same text."""
    module = GPU_WORKER_MODULE if d.gpus else CPU_WORKER_MODULE
    cmd = [d.python, "-m", module, *([scheduler] if scheduler else []),
           "--name", name, "--nthreads", str(d.nthreads), "--memory-limit", _memory_limit(d)]
    if not d.gpus:  # dask cuda worker starts one worker per GPU, each under a nanny
        cmd += (["--nworkers", str(workers)] if workers > 1 else []) + ["--nanny"]
    cmd += ["--death-timeout", str(d.death_timeout), "--resources", resources_argument(pool)]
    if d.interface:
        cmd += ["--interface", d.interface]
    return cmd


def scheduler_command(d: Deployment, *, scheduler_file: str | None = None,
                      host: str | None = None) -> list[str]:
    """``dask scheduler`` with digenrl's plugin preloaded."""
    cmd = [d.python, "-m", SCHEDULER_MODULE]
    if scheduler_file:
        cmd += ["--scheduler-file", scheduler_file]
    if host:
        cmd += ["--host", host]
    elif d.interface:
        cmd += ["--interface", d.interface]
    return cmd + ["--port", str(d.scheduler_port),
                  "--dashboard-address", f":{d.dashboard_port}", "--preload", PRELOAD]


def dask_env(config: dict[str, Any] = DASK_CONFIG) -> dict[str, str]:
    """Dask settings as the environment variables Dask reads them from."""
    return {"DASK_" + key.upper().replace(".", "__").replace("-", "_"):
            value if isinstance(value, str) else repr(value)
            for key, value in config.items()}


# ---------------------------------------------------------------------- SLURM

def _folder(d: Deployment, *parts: str) -> str:
    return posixpath.join(d.folder, *parts)


def _job_name(d: Deployment, role: str) -> str:
    return f"{d.name}-{role}"


def _exports(env: dict[str, str]) -> list[str]:
    return [f"export {k}={shlex.quote(v)}" for k, v in env.items()]


def jobqueue_settings(d: Deployment, pool: str) -> dict[str, Any]:
    """Keyword arguments of dask-jobqueue's ``SLURMCluster`` / ``SLURMJob`` for one job
    of ``pool``: its workers, GPUs, CPUs, memory and pool tag. A job runs
    ``workers_per_job`` workers: with GPUs one ``dask cuda worker`` (one worker per GPU
    of the job), else ``dask worker --nworkers``."""
    n = workers_per_job(d, pool)
    settings: dict[str, Any] = {
        "job_name": _job_name(d, pool),
        # dask-jobqueue's worker threads are cores / processes.
        "cores": d.nthreads if d.gpus else d.nthreads * n,
        "processes": 1 if d.gpus else n,
        "memory": _size(_memory_bytes(d) * (1 if d.gpus else n)),
        "job_cpu": d.nthreads * n,
        "job_mem": _slurm_bytes(_memory_bytes(d) * n),
        "python": d.python,
        "worker_command": GPU_WORKER_MODULE if d.gpus else CPU_WORKER_MODULE,
        "worker_extra_args": ["--resources", resources_argument(pool)],
        "job_extra_directives": [f"--gres=gpu:{n}"] if d.gpus else [],
        "job_script_prologue": [*d.prologue, *_exports(d.environment)],
        "death_timeout": d.death_timeout,
        "walltime": d.walltime,
        "log_directory": _folder(d, "logs"),
        "shebang": SHEBANG,
    }
    for key, value in (("queue", d.partition), ("account", d.account),
                       ("interface", d.interface)):
        if value is not None:
            settings[key] = value
    return settings


def _header(d: Deployment, job_name: str, cpus: int | None = None, mem: str | None = None,
            extra: Sequence[str] = ()) -> list[str]:
    """``#SBATCH`` lines in dask-jobqueue's order."""
    logs = _folder(d, "logs")
    lines = [f"-J {job_name}", f"-e {logs}/{job_name}-%J.err", f"-o {logs}/{job_name}-%J.out"]
    lines += [f"-p {d.partition}"] * (d.partition is not None)
    lines += [f"-A {d.account}"] * (d.account is not None)
    lines += ["-n 1"] + [f"--cpus-per-task={cpus}"] * (cpus is not None)
    lines += [f"--mem={mem}"] * (mem is not None) + [f"-t {d.walltime}", *extra]
    return [f"#SBATCH {line}" for line in lines]


def _script(header: list[str], prologue: list[str], command: list[str]) -> str:
    body = [SHEBANG, "", *header, "\n".join(prologue), " ".join(command)]
    return "\n".join(body) + "\n"


def job_script(d: Deployment, pool: str, scheduler: str, name: str) -> str:
    """The batch script of one job of ``pool``, as dask-jobqueue writes it from
    :func:`jobqueue_settings` (``SLURMJob(scheduler, name=name, **settings)``)."""
    s = jobqueue_settings(d, pool)
    header = _header(d, s["job_name"], s["job_cpu"], s["job_mem"], s["job_extra_directives"])
    return _script(header, s["job_script_prologue"],
                   worker_command(d, pool, scheduler, name, workers_per_job(d, pool)))


def _scheduler_file(d: Deployment) -> str:
    return _folder(d, "scheduler.json")


def slurm_job_scripts(d: Deployment) -> dict[str, str]:
    """The job scripts of a SLURM deployment by file name: the scheduler's, then one
    per pool (submitted as a job array; ``SLURM_ARRAY_TASK_ID`` numbers its workers).
    The workers find the scheduler through its scheduler file in the shared folder."""
    d.validate("slurm")
    env = {**d.environment, **dask_env()}
    sched = _script(_header(d, _job_name(d, "scheduler")), [*d.prologue, *_exports(env)],
                    scheduler_command(d, scheduler_file=shlex.quote(_scheduler_file(d))))
    scripts = {"scheduler.sbatch": sched}
    scheduler = f"--scheduler-file {shlex.quote(_scheduler_file(d))}"
    for pool in POOLS:
        scripts[f"{pool}.sbatch"] = job_script(d, pool, scheduler,
                                               f"{pool}-${{SLURM_ARRAY_TASK_ID}}")
    return scripts


#: Ends each here-document of the submit script (a line no job script holds).
_EOF = "DIGENRL_EOF"


def slurm_submit_script(d: Deployment, command: str = "digenrl deploy slurm") -> str:
    """A bash script that writes the job scripts into the shared folder and submits
    them: the scheduler, then each pool's job array once the scheduler has started."""
    scripts = slurm_job_scripts(d)

    def q(*parts: str) -> str:
        return shlex.quote(_folder(d, *parts))

    sizes = ", ".join(f"{n} {pool} workers in {jobs(d, pool)} job(s) of "
                      f"{workers_per_job(d, pool)}" for pool, n in d.pools().items())
    unit = "GPU" if d.gpus else "emulated GPU slot (CPU worker)"
    lines = [
        SHEBANG,
        f"# digenrl on SLURM: {sizes}; one {unit} per worker.",
        f"# Generated by: {command}",
        "# Run it with bash from a folder every node shares: it writes the job scripts to",
        f"# {d.folder}/, submits them, and prints how to start a run on the cluster.",
        "set -euo pipefail",
        f"mkdir -p {q('logs')}",
        f"rm -f {q('scheduler.json')}  # a previous scheduler's address",
    ]
    for file, text in scripts.items():
        lines += [f"cat > {q(file)} <<'{_EOF}'", text.rstrip("\n"), _EOF]
    lines += [f"scheduler=$(sbatch --parsable {q('scheduler.sbatch')})",
              "scheduler=${scheduler%%;*}  # sbatch --parsable prints ID[;CLUSTER]"]
    for pool in POOLS:
        lines += [f"{pool}=$(sbatch --parsable --dependency=after:$scheduler "
                  f"--array=0-{jobs(d, pool) - 1} {q(pool + '.sbatch')})",
                  f"{pool}=${{{pool}%%;*}}"]
    read = (f"{d.python} -c 'import json, sys; print(json.load(open(sys.argv[1]))"
            f"[\"address\"])' {q('scheduler.json')}")
    lines += [
        'echo "submitted: scheduler job $scheduler, ' + ", ".join(
            f"{pool} job array ${pool}" for pool in POOLS) + '"',
        f"echo \"stop the cluster with: scancel {' '.join('$' + p for p in ('scheduler', *POOLS))}\"",
        f"cat <<'{_EOF}'",
        f"Once the scheduler runs, its address is in {_folder(d, 'scheduler.json')}. "
        "Start a run (its --out on a",
        "filesystem every worker shares) with:",
        f'  digenrl run CONFIG --out STORE --scheduler "$({read})"',
        _EOF,
    ]
    return "\n".join(lines) + "\n"


def _literal(value: Any, indent: str = "") -> str:
    """A Python literal of ``value``, one dict item a line."""
    if not isinstance(value, dict) or not value:
        return repr(value)
    inner = indent + "    "
    items = "".join(f"{inner}{k!r}: {_literal(v, inner)},\n" for k, v in value.items())
    return "{\n" + items + indent + "}"


def jobqueue_launcher(d: Deployment, command: str = "digenrl deploy slurm --jobqueue") -> str:
    """A Python script that starts the same cluster with dask-jobqueue: the scheduler
    (with the plugin preloaded) in its own process, the rollout pool's jobs from a
    ``SLURMCluster`` and the trainer pool's as ``SLURMJob`` s joining its scheduler."""
    d.validate("slurm")
    scheduler_options = {"preload": [PRELOAD], "port": d.scheduler_port,
                         "dashboard_address": f":{d.dashboard_port}"}
    return f'''"""digenrl on SLURM with dask-jobqueue.

Generated by: {command}
Run it where jobs are submitted, in digenrl's environment (pip install "digenrl[slurm]"):
the scheduler, with digenrl's plugin preloaded, runs in this process for as long as it
runs; the rollout pool's jobs belong to a SLURMCluster, the trainer pool's are SLURMJobs
joining the same scheduler.
"""

import dask
from dask_jobqueue import SLURMCluster
from dask_jobqueue.slurm import SLURMJob

#: The Dask settings a digenrl run relies on (digenrl.run.cluster.DASK_CONFIG).
DASK_CONFIG = {_literal(DASK_CONFIG)}
SCHEDULER_OPTIONS = {_literal(scheduler_options)}
#: Each pool's job settings (one job: its workers, GPUs, CPUs, memory and pool tag).
JOBS = {_literal({pool: jobqueue_settings(d, pool) for pool in POOLS})}
#: Jobs per pool.
JOB_COUNT = {_literal({pool: jobs(d, pool) for pool in POOLS})}


def make_cluster():
    """The scheduler in this process and the rollout pool's (not yet submitted) jobs."""
    dask.config.set(DASK_CONFIG)
    return SLURMCluster(name="{ROLLOUT}", scheduler_options=SCHEDULER_OPTIONS,
                        **JOBS["{ROLLOUT}"])


def trainer_jobs(cluster):
    return [SLURMJob(cluster.scheduler_address, name=f"{TRAINER}-{{i}}", **JOBS["{TRAINER}"])
            for i in range(JOB_COUNT["{TRAINER}"])]


if __name__ == "__main__":
    cluster = make_cluster()
    cluster.scale(jobs=JOB_COUNT["{ROLLOUT}"])
    trainers = trainer_jobs(cluster)
    try:
        for job in trainers:
            cluster.sync(job.start)
        print("start a run with: digenrl run CONFIG --out STORE --scheduler",
              cluster.scheduler_address)
        input("press Enter to stop the cluster\\n")
    except (KeyboardInterrupt, EOFError):
        pass
    finally:
        for job in trainers:
            cluster.sync(job.close)
        cluster.close()
'''


# ------------------------------------------------------------------ Kubernetes

def _k8s_quantity(n: int) -> str:
    return _size(n, "i")


def _k8s_env(env: dict[str, str]) -> list[dict[str, str]]:
    return [{"name": k, "value": v} for k, v in env.items()]


def _k8s_worker(d: Deployment, pool: str, replicas: int) -> dict[str, Any]:
    """A worker group's pods: one worker (one GPU) per pod; the operator gives each
    container ``DASK_WORKER_NAME`` and ``DASK_SCHEDULER_ADDRESS``."""
    resources: dict[str, Any] = {
        "requests": {"cpu": str(d.nthreads), "memory": _k8s_quantity(_memory_bytes(d))},
        "limits": {"memory": _k8s_quantity(_memory_bytes(d))}}
    if d.gpus:
        resources["limits"]["nvidia.com/gpu"] = 1
    container = {"name": "worker", "image": d.image,
                 "args": worker_command(d, pool, None, K8S_WORKER_NAME),
                 "env": _k8s_env(d.environment), "resources": resources}
    return {"replicas": replicas, "spec": {"containers": [container]}}


def _metadata(d: Deployment, name: str) -> dict[str, str]:
    return {"name": name, **({"namespace": d.namespace} if d.namespace else {})}


def scheduler_address(d: Deployment) -> str:
    """The scheduler's address inside the Kubernetes cluster: its Service's name (in
    its namespace)."""
    namespace = f".{d.namespace}" if d.namespace else ""
    return f"tcp://{d.name}-scheduler{namespace}:{d.scheduler_port}"


def k8s_manifest(d: Deployment) -> list[dict[str, Any]]:
    """A ``DaskCluster`` (the scheduler, with the plugin preloaded; its default worker
    group left empty) and one ``DaskWorkerGroup`` per pool, as plain dicts."""
    d.validate("k8s")
    ports = [{"name": "tcp-comm", "containerPort": d.scheduler_port, "protocol": "TCP"},
             {"name": "http-dashboard", "containerPort": d.dashboard_port, "protocol": "TCP"}]
    health = {"httpGet": {"port": "http-dashboard", "path": "/health"}}
    scheduler = {
        "name": "scheduler", "image": d.image,
        "args": scheduler_command(d, host=ALL_INTERFACES),
        "env": _k8s_env({**d.environment, **dask_env()}),
        "ports": ports,
        "readinessProbe": {**health, "initialDelaySeconds": 0, "periodSeconds": 1,
                           "timeoutSeconds": 300},
        "livenessProbe": {**health, "initialDelaySeconds": 15, "periodSeconds": 20},
    }
    service = {
        "type": "ClusterIP",
        "selector": {"dask.org/cluster-name": d.name, "dask.org/component": "scheduler"},
        "ports": [{"name": p["name"], "protocol": "TCP", "port": p["containerPort"],
                   "targetPort": p["name"]} for p in ports],
    }
    cluster = {
        "apiVersion": K8S_API, "kind": "DaskCluster", "metadata": _metadata(d, d.name),
        "spec": {"worker": _k8s_worker(d, ROLLOUT, 0),
                 "scheduler": {"spec": {"containers": [scheduler]}, "service": service}},
    }
    groups = [{"apiVersion": K8S_API, "kind": "DaskWorkerGroup",
               "metadata": _metadata(d, f"{d.name}-{pool}"),
               "spec": {"cluster": d.name, "worker": _k8s_worker(d, pool, n)}}
              for pool, n in d.pools().items()]
    return [cluster, *groups]


def k8s_yaml(d: Deployment, command: str = "digenrl deploy k8s") -> str:
    """:func:`k8s_manifest` as YAML documents for ``kubectl apply -f``."""
    docs = k8s_manifest(d)
    unit = "GPU" if d.gpus else "emulated GPU slot (CPU worker)"
    head = [
        f"# digenrl on Kubernetes (the dask-kubernetes operator): {d.rollout_workers} "
        f"rollout + {d.trainer_workers} trainer workers, one {unit} and one pod each.",
        f"# Generated by: {command}",
        "# kubectl apply -f THIS_FILE; then, from a pod of the cluster:",
        f"#   digenrl run CONFIG --out STORE --scheduler {scheduler_address(d)}",
    ]
    return "\n".join(head) + "\n" + yaml.dump_all(docs, Dumper=_NoAliases, sort_keys=False)


class _NoAliases(yaml.SafeDumper):
    """Repeated values written out each time (no ``&id001`` anchors)."""

    def ignore_aliases(self, data: Any) -> bool:
        return True
