"""``digenrl deploy``: the SLURM job scripts, the dask-jobqueue launcher and the
Kubernetes manifest carry each worker's pool tag, GPU slot, threads and memory and the
scheduler's preload, from the facts the local cluster uses; and the rendered commands,
run on this machine without SLURM or Kubernetes, make a cluster whose workers are in
their pools.

Neither SLURM nor Kubernetes runs here: ``sbatch`` is a stand-in that records its
arguments, and what the operator does (start the pods) is not exercised.
"""

from __future__ import annotations

import os
import re
import runpy
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import dask
import pytest
import yaml
from distributed import Client, LocalCluster

from digenrl.commands.cli import main
from digenrl.run.cluster import DASK_CONFIG, pool_counts, worker_resources
from digenrl.config import ClusterConfig
from digenrl.commands.deploy import (PRELOAD, Deployment, command_line, dask_env, job_script,
                            jobqueue_launcher, jobqueue_settings, k8s_manifest, k8s_yaml,
                            resources_argument, slurm_job_scripts, slurm_submit_script)
from digenrl.schedulers.plugin import PLUGIN_NAME
from digenrl.vocabulary import POOLS, ROLLOUT, TRAINER

GIB = 2**30


def flag(command: list[str], name: str) -> str:
    """The value following ``name`` in a command."""
    assert command.count(name) == 1, (name, command)
    return command[command.index(name) + 1]


def last_line(script: str) -> list[str]:
    return shlex.split(script.rstrip("\n").splitlines()[-1])


def sbatch_lines(script: str) -> list[str]:
    return [line[len("#SBATCH "):] for line in script.splitlines()
            if line.startswith("#SBATCH ")]


def test_the_worker_flags_are_the_local_clusters_facts():
    for pool in POOLS:
        pairs = (item.split("=") for item in resources_argument(pool).split(","))
        assert {k: float(v) for k, v in pairs} == worker_resources(pool)
    assert resources_argument(ROLLOUT) == "GPU=1,rollout=1"
    default = Deployment()
    local = ClusterConfig()
    assert default.nthreads == local.threads_per_worker
    assert (default.rollout_workers, default.trainer_workers) == (
        local.rollout_workers, local.trainer_workers)
    # The module `dask scheduler --preload` imports, with the hook Dask calls.
    assert callable(__import__(PRELOAD, fromlist=["dask_setup"]).dask_setup)
    # The scheduler's environment holds the Dask settings a run relies on.
    collected = dask.config.collect_env(dask_env())
    for key, value in DASK_CONFIG.items():
        assert dask.config.get(key, "absent", config=collected) == value


def test_slurm_job_scripts_give_each_worker_its_gpu_pool_and_threads():
    d = Deployment(rollout_workers=8, trainer_workers=2, gpus_per_node=4, partition="gpu",
                   account="proj", walltime="02:00:00", memory="40GiB",
                   prologue=("source .venv/bin/activate",), env=("HF_HOME=/shared/hf",))
    scripts = slurm_job_scripts(d)
    assert list(scripts) == ["scheduler.sbatch", "rollout.sbatch", "trainer.sbatch"]

    sched = scripts["scheduler.sbatch"]
    cmd = last_line(sched)
    assert cmd[:3] == ["python3", "-m", "distributed.cli.dask_scheduler"]
    assert flag(cmd, "--preload") == PRELOAD
    assert flag(cmd, "--scheduler-file") == "digenrl-cluster/scheduler.json"
    assert flag(cmd, "--port") == "8786"
    assert "source .venv/bin/activate" in sched and "export HF_HOME=/shared/hf" in sched
    for key, value in dask_env().items():
        assert f"export {key}={shlex.quote(value)}" in sched
    assert "-p gpu" in sbatch_lines(sched) and "-t 02:00:00" in sbatch_lines(sched)

    for pool, gpus in ((ROLLOUT, 4), (TRAINER, 2)):  # the trainer pool is smaller than a node
        script = scripts[f"{pool}.sbatch"]
        assert script.startswith("#!/usr/bin/env bash\n")
        header = sbatch_lines(script)
        assert f"--gres=gpu:{gpus}" in header
        assert f"--cpus-per-task={2 * gpus}" in header
        assert f"--mem={40 * gpus}G" in header
        assert {"-n 1", "-p gpu", "-A proj", "-t 02:00:00", f"-J digenrl-{pool}"} <= set(header)
        assert "source .venv/bin/activate" in script and "export HF_HOME=/shared/hf" in script
        cmd = last_line(script)
        # One dask-cuda worker per GPU of the job, each advertising one GPU and its pool.
        assert cmd[:3] == ["python3", "-m", "dask_cuda.cli"]
        assert flag(cmd, "--scheduler-file") == "digenrl-cluster/scheduler.json"
        assert flag(cmd, "--resources") == f"GPU=1,{pool}=1"
        assert flag(cmd, "--nthreads") == "2"
        assert flag(cmd, "--memory-limit") == "40.00GiB"
        assert flag(cmd, "--name") == f"{pool}-${{SLURM_ARRAY_TASK_ID}}"
        assert "--nworkers" not in cmd


def test_the_submit_script_submits_the_scheduler_then_each_pools_job_array():
    d = Deployment(rollout_workers=8, trainer_workers=2, gpus_per_node=4)
    script = slurm_submit_script(d)
    subprocess.run(["bash", "-n"], input=script, text=True, check=True)
    submits = [line for line in script.splitlines() if "=$(sbatch --parsable" in line]
    assert submits == [
        "scheduler=$(sbatch --parsable digenrl-cluster/scheduler.sbatch)",
        "rollout=$(sbatch --parsable --dependency=after:$scheduler --array=0-1 "
        "digenrl-cluster/rollout.sbatch)",
        "trainer=$(sbatch --parsable --dependency=after:$scheduler --array=0-0 "
        "digenrl-cluster/trainer.sbatch)",
    ]
    for text in slurm_job_scripts(d).values():
        assert text in script


@pytest.mark.parametrize("gpus", [True, False], ids=["gpus", "cpus"])
def test_the_job_scripts_are_those_dask_jobqueue_writes_from_the_settings(tmp_path, gpus):
    pytest.importorskip("dask_jobqueue")
    from dask_jobqueue.slurm import SLURMJob

    d = Deployment(rollout_workers=6, trainer_workers=3, gpus_per_node=3, gpus=gpus,
                   partition="gpu", account="proj", interface="ib0", memory="24GiB",
                   folder=str(tmp_path / "shared"), prologue=("module load cuda",),
                   env=("A=1 2",))
    for pool in POOLS:
        for scheduler in ("tcp://10.0.0.1:8786", "--scheduler-file /shared/s.json"):
            ours = job_script(d, pool, scheduler, f"{pool}-7")
            theirs = SLURMJob(scheduler, name=f"{pool}-7", **jobqueue_settings(d, pool))
            assert ours == theirs.job_script()
    cmd = last_line(job_script(d, TRAINER, "tcp://10.0.0.1:8786", "trainer-0"))
    if not gpus:  # three CPU workers in one job, each with one emulated GPU slot
        assert cmd[2] == "distributed.cli.dask_worker" and flag(cmd, "--nworkers") == "3"
        assert "--gres=gpu:3" not in job_script(d, TRAINER, "tcp://h:1", "t")


def run_script(path: Path, cwd: Path, **env: str) -> subprocess.Popen:
    """A job script run with bash, as SLURM's job step would (its #SBATCH lines are
    comments to bash), in a process group of its own."""
    return subprocess.Popen(["bash", str(path)], cwd=cwd, env={**os.environ, **env},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)


def stop(procs: list[subprocess.Popen]) -> None:
    """Each script's process group: the workers first, then the scheduler."""
    for p in reversed(procs):
        try:
            os.killpg(p.pid, signal.SIGTERM)
        except ProcessLookupError:
            continue
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def poll(predicate, timeout=120.0, what="condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.1)
    raise TimeoutError(f"timed out waiting for {what}")


def workers_by_name(client: Client) -> dict[str, dict]:
    info = client.sync(client.scheduler.identity, n_workers=-1)["workers"]
    return {w["name"]: w for w in info.values()}


@pytest.mark.slow
def test_the_submitted_job_scripts_run_as_a_cluster_with_its_pools(tmp_path):
    """The submit script writes the job scripts and submits them (to a stand-in sbatch);
    the scripts it wrote, run with bash here, start the scheduler with the plugin and
    workers in their pools, found through the scheduler file."""
    d = Deployment(rollout_workers=2, trainer_workers=1, gpus_per_node=2, gpus=False,
                   memory="2GiB", python=sys.executable, interface="lo", scheduler_port=0,
                   dashboard_port=0, env=("DIGENRL_DEPLOY_TEST=yes",))
    submit = tmp_path / "submit.sh"
    submit.write_text(slurm_submit_script(d))
    # SLURM is not installed here: this sbatch records its arguments and answers as
    # `sbatch --parsable` does (JOBID;CLUSTER).
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "sbatch").write_text(
        '#!/usr/bin/env bash\necho "$*" >> "$SBATCH_LOG"\n'
        'echo "$((100 + $(wc -l < "$SBATCH_LOG")));cluster"\n')
    (bin_dir / "sbatch").chmod(0o755)
    log = tmp_path / "sbatch.log"
    out = subprocess.run(["bash", str(submit)], cwd=tmp_path, capture_output=True, text=True,
                         env={**os.environ, "SBATCH_LOG": str(log),
                              "PATH": f"{bin_dir}:{os.environ['PATH']}"}, check=True).stdout
    assert log.read_text().splitlines() == [
        "--parsable digenrl-cluster/scheduler.sbatch",
        "--parsable --dependency=after:101 --array=0-0 digenrl-cluster/rollout.sbatch",
        "--parsable --dependency=after:101 --array=0-0 digenrl-cluster/trainer.sbatch"]
    assert "scheduler job 101, rollout job array 102, trainer job array 103" in out
    folder = tmp_path / "digenrl-cluster"
    for name, text in slurm_job_scripts(d).items():
        assert (folder / name).read_text() == text
    assert (folder / "logs").is_dir()

    procs = [run_script(folder / "scheduler.sbatch", tmp_path)]
    try:
        poll((folder / "scheduler.json").exists, what="the scheduler file")
        for pool in POOLS:  # each pool's job array has one job: task 0
            procs.append(run_script(folder / f"{pool}.sbatch", tmp_path,
                                    SLURM_ARRAY_TASK_ID="0"))
        with Client(scheduler_file=str(folder / "scheduler.json"), timeout="60s") as c:
            c.wait_for_workers(3, timeout=120)
            assert c.run_on_scheduler(lambda dask_scheduler: PLUGIN_NAME in
                                      dask_scheduler.plugins)
            assert c.run_on_scheduler(lambda: (
                dask.config.get("distributed.deploy.lost-worker-timeout"),
                os.environ.get("DIGENRL_DEPLOY_TEST"))) == ("1000 days", "yes")
            counts = pool_counts(c)
            assert sorted(counts[ROLLOUT]) == ["rollout-0-0", "rollout-0-1"]
            assert counts[TRAINER] == ["trainer-0"] and counts["untagged"] == []
            for name, w in workers_by_name(c).items():
                pool = name.split("-")[0]
                assert w["resources"] == worker_resources(pool)
                assert w["nthreads"] == 2 and w["memory_limit"] == 2 * GIB
                assert w["host"] == "127.0.0.1"
            # The command the submit script prints reads the address from the file.
            read = re.search(r'--scheduler "\$\((.*)\)"', out).group(1)
            address = subprocess.run(["bash", "-c", read], cwd=tmp_path, capture_output=True,
                                     text=True, check=True).stdout.strip()
            assert address == c.scheduler.address
    finally:
        stop(procs)


@pytest.mark.slow
def test_the_jobqueue_launcher_preloads_the_plugin_and_its_jobs_join_their_pools(tmp_path):
    """The launcher's SLURMCluster (its scheduler in this process) has the plugin; the
    job scripts dask-jobqueue writes for both pools are digenrl's, and run with bash
    here they join that scheduler in their pools. Only sbatch is missing."""
    pytest.importorskip("dask_jobqueue")
    d = Deployment(gpus=False, memory="2GiB", python=sys.executable, interface="lo",
                   scheduler_port=0, dashboard_port=0, folder=str(tmp_path / "shared"))
    launcher = tmp_path / "launch.py"
    launcher.write_text(jobqueue_launcher(d))
    ns = runpy.run_path(str(launcher), run_name="digenrl_launcher")  # not __main__: no jobs
    assert ns["JOB_COUNT"] == {ROLLOUT: 1, TRAINER: 1}
    cluster = ns["make_cluster"]()
    procs = []
    try:
        assert PLUGIN_NAME in cluster.scheduler.plugins
        address = cluster.scheduler_address
        assert address.startswith("tcp://127.0.0.1:")
        # The rollout pool's job as the cluster would submit it, and the trainer pool's.
        [(name, spec)] = cluster.new_worker_spec().items()
        rollout = spec["cls"](address, name=name, **spec["options"])
        [trainer] = ns["trainer_jobs"](cluster)
        assert cluster.job_script() == job_script(d, ROLLOUT, address, "dummy-name")
        assert rollout.job_script() == job_script(d, ROLLOUT, address, "rollout-0")
        assert trainer.job_script() == job_script(d, TRAINER, address, "trainer-0")
        for job in (rollout, trainer):
            path = tmp_path / f"{job.name}.sh"
            path.write_text(job.job_script())
            procs.append(run_script(path, tmp_path))
        with Client(address) as c:
            c.wait_for_workers(2, timeout=120)
            assert pool_counts(c) == {ROLLOUT: ["rollout-0"], TRAINER: ["trainer-0"],
                                      "untagged": []}
    finally:
        stop(procs)
        cluster.close()


@pytest.mark.slow
def test_the_jobqueue_launcher_submits_each_pools_jobs_and_cancels_them_on_enter(tmp_path):
    """``python launch.py`` as a user runs it: dask-jobqueue submits one job per pool
    with digenrl's job scripts and the launcher's scheduler address, and cancels them
    when Enter is pressed. SLURM is not installed here: sbatch and scancel are stand-ins
    that keep the submitted script (sbatch answers as SLURM does, 'Submitted batch job
    ID') and record the cancelled ids."""
    pytest.importorskip("dask_jobqueue")
    d = Deployment(rollout_workers=2, trainer_workers=2, gpus_per_node=2, interface="lo",
                   scheduler_port=0, dashboard_port=0, folder=str(tmp_path / "shared"))
    launcher = tmp_path / "launch.py"
    launcher.write_text(jobqueue_launcher(d))
    slurm = tmp_path / "slurm"
    slurm.mkdir()
    (slurm / "sbatch").write_text('#!/usr/bin/env bash\ncp "$1" "$SLURM_LOG/job-$$.sh"\n'
                                  'echo "Submitted batch job $$"\n')
    (slurm / "scancel").write_text('#!/usr/bin/env bash\necho "$@" >> "$SLURM_LOG/scancel"\n')
    for tool in ("sbatch", "scancel"):
        (slurm / tool).chmod(0o755)
    log = tmp_path / "log"
    log.mkdir()
    proc = subprocess.Popen([sys.executable, str(launcher)], cwd=tmp_path, text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL,
                            env={**os.environ, "SLURM_LOG": str(log),
                                 "PATH": f"{slurm}:{os.environ['PATH']}"})
    try:
        line = proc.stdout.readline()
        address = re.search(r"--scheduler (tcp://127\.0\.0\.1:\d+)", line).group(1)
        poll(lambda: len(list(log.glob("job-*.sh"))) == 2, what="two submitted jobs")
        proc.stdin.write("\n")
        proc.stdin.flush()
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    submitted = {p.stem.removeprefix("job-"): p.read_text() for p in log.glob("job-*.sh")}
    assert sorted(submitted.values()) == sorted([
        job_script(d, ROLLOUT, address, "rollout-0"),
        job_script(d, TRAINER, address, "trainer-0")])
    cancelled = set((log / "scancel").read_text().split())
    assert cancelled == set(submitted)


def test_the_k8s_manifest_has_the_preloaded_scheduler_and_one_worker_group_per_pool():
    d = Deployment(rollout_workers=2, trainer_workers=6, image="registry.example/digenrl:1",
                   namespace="ml", env=("HF_HOME=/shared/hf",), memory="48GiB")
    docs = list(yaml.safe_load_all(k8s_yaml(d)))
    assert docs == k8s_manifest(d)
    assert [doc["kind"] for doc in docs] == ["DaskCluster", "DaskWorkerGroup", "DaskWorkerGroup"]
    assert {doc["apiVersion"] for doc in docs} == {"kubernetes.dask.org/v1"}
    assert {doc["metadata"]["namespace"] for doc in docs} == {"ml"}
    cluster, *groups = docs
    assert cluster["metadata"]["name"] == "digenrl"
    assert cluster["spec"]["worker"]["replicas"] == 0  # the operator's default group: unused

    [sched] = cluster["spec"]["scheduler"]["spec"]["containers"]
    assert sched["image"] == "registry.example/digenrl:1"
    assert sched["args"][:3] == ["python3", "-m", "distributed.cli.dask_scheduler"]
    assert flag(sched["args"], "--preload") == PRELOAD
    assert flag(sched["args"], "--host") == "0.0.0.0"
    assert flag(sched["args"], "--port") == "8786"
    env = {e["name"]: e["value"] for e in sched["env"]}
    assert env == {"HF_HOME": "/shared/hf", **dask_env()}
    ports = {p["name"]: p["containerPort"] for p in sched["ports"]}
    assert ports == {"tcp-comm": 8786, "http-dashboard": 8787}
    service = cluster["spec"]["scheduler"]["service"]
    assert {(p["port"], p["targetPort"]) for p in service["ports"]} == {
        (8786, "tcp-comm"), (8787, "http-dashboard")}
    assert service["selector"] == {"dask.org/cluster-name": "digenrl",
                                   "dask.org/component": "scheduler"}

    assert [g["metadata"]["name"] for g in groups] == ["digenrl-rollout", "digenrl-trainer"]
    for group, (pool, n) in zip(groups, [(ROLLOUT, 2), (TRAINER, 6)]):
        assert group["spec"]["cluster"] == "digenrl"
        assert group["spec"]["worker"]["replicas"] == n
        [c] = group["spec"]["worker"]["spec"]["containers"]
        assert c["image"] == "registry.example/digenrl:1"
        assert c["resources"]["limits"] == {"nvidia.com/gpu": 1, "memory": "48Gi"}
        assert c["resources"]["requests"] == {"cpu": "2", "memory": "48Gi"}
        # The operator gives the container its name and the scheduler's address.
        assert c["args"][:5] == ["python3", "-m", "dask_cuda.cli", "--name",
                                 "$(DASK_WORKER_NAME)"]
        assert flag(c["args"], "--resources") == f"GPU=1,{pool}=1"
        assert flag(c["args"], "--nthreads") == "2"
        assert flag(c["args"], "--memory-limit") == "48.00GiB"
        assert {e["name"]: e["value"] for e in c["env"]} == {"HF_HOME": "/shared/hf"}

    cpu = k8s_manifest(Deployment(image="im", gpus=False))
    for doc in cpu[1:]:
        [c] = doc["spec"]["worker"]["spec"]["containers"]
        assert "nvidia.com/gpu" not in c["resources"]["limits"]
        assert c["args"][2] == "distributed.cli.dask_worker" and "--nanny" in c["args"]
        assert "metadata" in doc and "namespace" not in doc["metadata"]


@pytest.mark.slow
def test_a_k8s_worker_container_joins_the_scheduler_of_its_environment():
    """A worker group's container command, with the environment the operator gives it
    ($(DASK_WORKER_NAME) expanded as Kubernetes does), joins its pool."""
    d = Deployment(image="im", gpus=False, memory="2GiB", python=sys.executable)
    with LocalCluster(n_workers=0, host="127.0.0.1", dashboard_address="127.0.0.1:0") as lc, \
            Client(lc) as c:
        [group] = [g for g in k8s_manifest(d)[1:] if g["metadata"]["name"].endswith(TRAINER)]
        [container] = group["spec"]["worker"]["spec"]["containers"]
        env = {"DASK_WORKER_NAME": "digenrl-trainer-worker-5f2c1",
               "DASK_SCHEDULER_ADDRESS": lc.scheduler_address}
        args = [re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], a) for a in container["args"]]
        proc = subprocess.Popen(args, env={**os.environ, **env}, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, start_new_session=True)
        try:
            c.wait_for_workers(1, timeout=120)
            assert pool_counts(c)[TRAINER] == ["digenrl-trainer-worker-5f2c1"]
        finally:
            stop([proc])


@pytest.mark.parametrize("argv,message", [
    (["slurm", "--rollout-workers", "6", "--gpus-per-node", "4"],
     "--rollout-workers: expected at most --gpus-per-node (4) or a multiple of it"),
    (["slurm", "--nthreads", "0"], "--nthreads: expected an integer >= 1, got 0"),
    (["slurm", "--memory", "lots"], "--memory: expected a size such as 32GiB"),
    (["slurm", "--name", "Digenrl"], "--name: expected a lowercase name"),
    (["slurm", "--env", "1X=2"], "--env: expected KEY=VALUE"),
    (["slurm", "--folder", "my folder"], "--folder: expected a value without spaces"),
    (["k8s"], "--image: expected the container image"),
    (["k8s", "--image", "im", "--scheduler-port", "0"],
     "--scheduler-port: expected a port from 1 to 65535, got 0"),
])
def test_bad_input_is_one_line_naming_the_flag(capsys, argv, message):
    code = main(["deploy", *argv])
    out, err = capsys.readouterr()
    assert code == 2 and out == ""
    assert message in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("argv", [
    ["k8s", "--image", "im", "--rollout-workers", "3", "--env", "A=x y", "--cpu"],
    ["slurm", "--rollout-workers", "4", "--gpus-per-node", "2", "--prologue", "module load x",
     "--walltime", "1:00:00"],
    ["slurm", "--jobqueue", "--trainer-workers", "2", "--interface", "ib0"],
])
def test_the_cli_prints_the_rendering_and_the_command_that_made_it(capsys, argv):
    assert main(["deploy", *argv]) == 0
    out = capsys.readouterr().out
    [made_by] = re.findall(r"Generated by: (.*)", out)
    assert shlex.split(made_by)[:3] == ["digenrl", "deploy", argv[0]]
    # The command it names prints the same text again.
    assert main(shlex.split(made_by)[1:]) == 0
    assert capsys.readouterr().out == out
    if argv[0] == "k8s":
        d = Deployment(image="im", rollout_workers=3, env=("A=x y",), gpus=False)
        assert out == k8s_yaml(d, command_line("k8s", d))
