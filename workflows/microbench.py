"""Micro-benchmarks behind statements in docs/.

    python workflows/microbench.py dispatch   # a chain hop: parked-and-released vs plain Dask
    python workflows/microbench.py malloc     # a forward pass under Dask's nanny malloc setting
    python workflows/microbench.py eventloop  # the simulator's CPU per task vs a bare event loop
    python workflows/microbench.py transfer   # a version's weights, trainer to rollout worker
    python workflows/microbench.py collector  # a full garbage-collector pass, before and after the freeze
    python workflows/microbench.py idle       # an idle local cluster's CPU, by event-loop tick interval
    python workflows/microbench.py imports    # a driver's imports; a forked worker's first model build
    python workflows/microbench.py commit     # a store commit: its arrays written at once vs in turn
    python workflows/microbench.py checkpoint # a checkpoint: chunk by chunk vs one zarr write
    python workflows/microbench.py ocr        # the OCR reward's seconds per image
    python workflows/microbench.py fsdp_memory  # a trainer's state per rank, FSDP2 over 1 and 2
    python workflows/microbench.py broadcast  # a version by collective broadcast vs Dask's transfer

``dispatch`` runs a chain of dependent no-op tasks on a local cluster of one rollout and
one trainer worker, once as plain Dask tasks and once annotated as digenrl tasks (parked
by the plugin and released by the policy), alternating, and prints milliseconds per hop
and the CPU-milliseconds per task of all the cluster's processes (the workers' allocator
and collector set up as a run sets them up).
``malloc`` times the default transformer's forward pass in fresh processes with and
without ``MALLOC_TRIM_THRESHOLD_=65536`` (what Dask's nanny exports), and with that
variable plus the allocator tuning the worker plugin applies. ``eventloop`` times, in
one process, a bare discrete-event loop over chains of tasks (one input each, a heap of
ready tasks, a heap of finishes, one record per task: the least any event simulator in
Python does per task) and ``digenrl simulate``'s engine on the FLUX-like profile, and
prints CPU microseconds per task for both. ``transfer`` moves the default model's
published weights (a ``PolicyWeights`` of its 4.6 million parameters) from the trainer
to the rollout worker of the default local cluster, with the trainer idle and while it
runs the default transformer's forward and backward passes (as during a micro-step),
alternating, and prints the worker's own record of each fetch (Dask's
``transfer_incoming_log``) in milliseconds, and the CPU-milliseconds all processes spend
per fetch from the idle trainer (with the small task that reads it) and per MB
(the workers' allocator and collector set up as a run sets them up), then, in this
process, the milliseconds Dask takes to serialize those weights into frames and read
them back, and to pickle and unpickle them. ``collector``
times full passes of Python's cyclic garbage collector in a fresh process that has
imported what a worker imports (torch, diffusers, transformers, Dask, digenrl) and built
the default models, before and after :func:`digenrl.process.freeze_collector`. ``idle``
starts the local cluster of two rollout and two trainer workers a run starts, lets it
settle, and prints the CPU all its processes (the driver's, with the scheduler and the
nannies, and the workers') use per second while no run uses it, with the event loops'
tick (:data:`digenrl.run.cluster.DASK_CONFIG`) as configured and at 0.1 s, each in a fresh
process, alternating. ``imports`` prints,
each in a fresh process, the CPU-seconds of a driver's imports (``digenrl.commands.cli``,
``digenrl.run.runner``, and the default family asked for its latent shape and sigmas) and
the CPU-seconds and modules a worker forked from the preloading server
(:data:`digenrl.run.cluster.WORKER_PRELOAD`) spends building the default transformer and VAE
(the imports a build needs beyond the preload). ``commit`` appends iterations shaped like
a small run's (30 task columns of 30 rows, 30 per-iteration variables) to a fresh store
with :class:`digenrl.store.RunStore`, its writes awaited together (as it commits) and one
after another, alternating, and prints CPU-seconds per commit. ``checkpoint`` writes the
default model's trainer state (its weights and two AdamW moments, 56 MB) as checkpoints
to a fresh store, with :func:`digenrl.store.checkpoints.write_checkpoint` and as one zarr
write of the whole array with zarr's default settings (the attributes set after it),
alternating, and prints the user and system CPU-seconds per checkpoint. ``ocr`` scores
text rendered with PIL (the ocr prompt set's texts, DejaVu Sans, dark on light) with the
OCR reward (``reward.models`` kind ``ocr``) in this process, with one torch (and so
onnxruntime) thread as a worker has, at 256 and 512 pixels in calls of 1 and 8 images,
and prints the first call's seconds (the models loaded) and the wall seconds per image
of the later calls (median of the rounds), and, for calls of 8, those of the detector's
forward passes stacked into one (what the reward does on a GPU) against one per image;
then the CPU-seconds per image spent in the detector's and the recogniser's
onnxruntime sessions and in the rest (pre- and post-processing, which stays on the CPU
with a GPU provider), and the floating-point operations of each model's convolutions
and matrix products per forward pass, counted from onnxruntime's profile of one pass
(its nodes' input and output shapes) -- what docs/performance.md derives a GPU's
figure from.
``fsdp_memory`` trains a built-in model widened to 54.6 million parameters (six blocks of
width 512) sharded (:mod:`digenrl.tasks.sharding`) over 1 and then 2 gloo processes on
this machine, each with one torch thread: one DiffusionNFT micro-step of two samples and
one optimizer step; each rank prints the bytes it holds of the parameters, their
gradients and the two AdamW moments (the local shards' storage, counted once per
storage) and its process's peak resident memory, then the ratio of 2 ranks' to 1 rank's
per rank.
``broadcast`` starts a local cluster of one trainer and two rollout workers, makes
``--mb`` MB of float32 weights (tensors of 4 MB) on the trainer as a ``PolicyWeights``
task output, and moves them to both rollout workers, alternating: by Dask (a task on
each rollout worker reading that output, which Dask fetches from the trainer) and by
:mod:`digenrl.tasks.broadcast` over a gloo group of the three workers (``send`` on the
trainer, ``receive`` into new tensors on each rollout worker, in buckets of
``--bucket-mb`` MiB). It prints, per way, the median over the rounds of the wall seconds
from submitting the tasks to their end, and the version's MB per second that gives (the
version reaching both workers), then the ratio.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time


def _inc(x):
    return x + 1


def _cluster_cpu() -> float:
    """CPU-seconds used so far by this process and every process under it: the driver
    (with the local cluster's scheduler), the nannies and the workers."""
    import psutil

    me = psutil.Process()
    total = 0.0
    for p in [me, *me.children(recursive=True)]:
        try:
            t = p.cpu_times()
        except psutil.Error:
            continue
        total += t.user + t.system
    return total


def _as_in_a_run() -> None:
    """A worker process set up as a run's worker plugin sets it up (its allocator and
    collector), without building models."""
    from digenrl.process import freeze_collector, tune_malloc

    tune_malloc()
    freeze_collector()


def dispatch(hops: int, rounds: int) -> None:
    import logging

    from dask._task_spec import Task, TaskRef
    from dask.highlevelgraph import HighLevelGraph, MaterializedLayer

    from digenrl.run.cluster import start_cluster
    from digenrl.config import ClusterConfig
    from digenrl.graph.keys import task_meta
    from digenrl.schedulers.options import MODES, ScheduleOptions
    from digenrl.vocabulary import ANNOTATION

    logging.getLogger("distributed").setLevel(logging.ERROR)
    handle = start_cluster(ClusterConfig(dashboard_address=None))
    c = handle.client
    opts = ScheduleOptions(mode="digenrl", **MODES["digenrl"])
    c.sync(c.scheduler.digenrl_begin_run, run="microbench", options=opts.as_dict())

    def chain(name: str, annotate: bool):
        dsk, meta = {}, {}
        for i in range(hops):
            key = (name, i)
            dsk[key] = Task(key, _inc, TaskRef((name, i - 1)) if i else 0)
            meta[key] = task_meta("advantage", 0, 0)  # a trainer-pool task with no GPU
        ann = {ANNOTATION: meta.get} if annotate else None
        return HighLevelGraph({name: MaterializedLayer(dsk, annotations=ann)}, {name: set()})

    c.run(_as_in_a_run)
    times: dict[str, list[float]] = {"plain": [], "digenrl": []}
    cpu: dict[str, list[float]] = {"plain": [], "digenrl": []}
    try:
        for r in range(rounds):
            for label in ("plain", "digenrl"):
                g = chain(f"{label}-{r}", label == "digenrl")
                c0, t0 = _cluster_cpu(), time.perf_counter()
                [f] = c.get(g, [(f"{label}-{r}", hops - 1)], sync=False)
                assert f.result() == hops
                times[label].append((time.perf_counter() - t0) / hops * 1000)
                cpu[label].append((_cluster_cpu() - c0) / hops * 1000)
                del f
    finally:
        handle.close()
    for label, ts in times.items():
        print(f"{label:>8}: {statistics.median(ts):.2f} ms per hop "
              f"(median of {rounds} chains of {hops}; min {min(ts):.2f}, max {max(ts):.2f}); "
              f"{statistics.median(cpu[label]):.2f} CPU-ms per task, all processes")
    print(f"   ratio: {statistics.median(times['digenrl']) / statistics.median(times['plain']):.3f}"
          f" (CPU {statistics.median(cpu['digenrl']) / statistics.median(cpu['plain']):.3f})")


_FORWARD = """
import sys, time, torch
if sys.argv[1] == "tuned":
    from digenrl.process import tune_malloc
    assert tune_malloc()
torch.set_num_threads(1)
from digenrl.config import ModelConfig
from digenrl.models import build_transformer
m = build_transformer(ModelConfig(), 0)
x = torch.randn(4, 4, 16, 16); e = torch.randn(4, 8, 64); p = torch.randn(4, 32)
ts = torch.full((4,), 500.0)
with torch.no_grad():
    for _ in range(3):
        m(x, e, p, ts)
    t = time.perf_counter()
    for _ in range(20):
        m(x, e, p, ts)
print((time.perf_counter() - t) / 20 * 1000)
"""


def malloc() -> None:
    cases = [("no MALLOC_TRIM_THRESHOLD_", {}, "plain"),
             ("MALLOC_TRIM_THRESHOLD_=65536 (Dask nanny)", {"MALLOC_TRIM_THRESHOLD_": "65536"},
              "plain"),
             ("same + digenrl allocator tuning", {"MALLOC_TRIM_THRESHOLD_": "65536"}, "tuned")]
    base = {k: v for k, v in os.environ.items() if k != "MALLOC_TRIM_THRESHOLD_"}
    results = {}
    for label, extra, mode in cases:
        runs = []
        for _ in range(3):
            out = subprocess.run([sys.executable, "-c", _FORWARD, mode], env={**base, **extra},
                                 capture_output=True, text=True, check=True)
            runs.append(float(out.stdout.strip().splitlines()[-1]))
        results[label] = statistics.median(runs)
        print(f"{label:<42} {results[label]:6.1f} ms per forward pass (median of 3 processes)")
    first = next(iter(results.values()))
    for label, v in results.items():
        print(f"{label:<42} {v / first:6.2f}x")


_COLLECT = """
import gc, json, statistics, time
import distributed, torch
from digenrl.config import ModelConfig
from digenrl.models.lora import Trainable, build_policy
from digenrl.models import build_vae
from digenrl.process import freeze_collector
import digenrl.run.runner, digenrl.tasks.resident  # (what the driver and a worker import)
models = [build_policy(ModelConfig(), Trainable(), 0), build_vae(ModelConfig(), 0)]

def passes():
    out = []
    for _ in range(5):
        t = time.perf_counter()
        gc.collect()
        out.append(1000 * (time.perf_counter() - t))
    return statistics.median(out)

before, tracked = passes(), len(gc.get_objects())
frozen = freeze_collector()
print(json.dumps({"before": before, "after": passes(), "tracked": tracked, "frozen": frozen,
                  "left": len(gc.get_objects())}))
"""


def collector(rounds: int) -> None:
    import json

    runs = [json.loads(subprocess.run([sys.executable, "-c", _COLLECT], capture_output=True,
                                      text=True, check=True).stdout.strip().splitlines()[-1])
            for _ in range(rounds)]
    before = statistics.median(r["before"] for r in runs)
    after = statistics.median(r["after"] for r in runs)
    r = runs[0]
    print(f"{r['tracked']} objects tracked after the imports and the default models; "
          f"{r['frozen']} frozen, {r['left']} left")
    print(f"full collector pass: {before:.1f} ms before the freeze, {after:.2f} ms after "
          f"(medians of 5 passes in each of {rounds} processes)")


def _weights():
    from digenrl.config import ModelConfig
    from digenrl.models.lora import Trainable, build_policy, trainable_parameters
    from digenrl.tasks.types import PolicyWeights

    model = build_policy(ModelConfig(), Trainable(), 0)
    return PolicyWeights(version=1, tensors={n: p.detach().clone()
                                             for n, p in trainable_parameters(model).items()})


def _size(weights) -> int:
    return weights.nbytes


def _train_for(seconds: float) -> int:
    """Forward and backward passes of the default transformer for ``seconds``."""
    import torch

    from digenrl.config import ModelConfig
    from digenrl.models import build_transformer
    m = build_transformer(ModelConfig(), 0)
    x = torch.randn(4, 4, 16, 16)
    e = torch.randn(4, 8, 64)
    p = torch.randn(4, 32)
    ts = torch.full((4,), 500.0)
    passes, end = 0, time.perf_counter() + seconds
    while time.perf_counter() < end:
        m(x, e, p, ts).sample.sum().backward()
        passes += 1
    return passes


def _last_fetch(dask_worker) -> float:
    return float(dask_worker.transfer_incoming_log[-1]["duration"])


def transfer(rounds: int) -> None:
    import logging

    from digenrl.run.cluster import start_cluster
    from digenrl.config import ClusterConfig

    logging.getLogger("distributed").setLevel(logging.ERROR)
    handle = start_cluster(ClusterConfig(dashboard_address=None))
    c = handle.client
    by_name = {str(w["name"]): a for a, w in c.scheduler_info()["workers"].items()}
    trainer = next(a for n, a in by_name.items() if n.startswith("trainer"))
    rollout = next(a for n, a in by_name.items() if n.startswith("rollout"))
    c.run(_as_in_a_run)
    times: dict[str, list[float]] = {"idle": [], "training": []}
    cpu: list[float] = []   # all processes, per fetch to an idle trainer's worker
    nbytes = 0
    try:
        # A first round, not counted: each worker imports what the weights need on its
        # first fetch.
        for r in range(rounds + 1):
            for label in times:
                w = c.submit(_weights, workers=[trainer], pure=False)
                w.result()
                busy = None
                if label == "training":
                    busy = c.submit(_train_for, 1.0, workers=[trainer], pure=False)
                    time.sleep(0.2)   # (the passes under way before the fetch)
                c0 = _cluster_cpu()
                nbytes = c.submit(_size, w, workers=[rollout], pure=False).result()
                if r and busy is None:
                    cpu.append(_cluster_cpu() - c0)
                if r:
                    times[label].append(1000 * c.run(_last_fetch, workers=[rollout])[rollout])
                if busy is not None:
                    busy.result()
                del w
    finally:
        handle.close()
    print(f"{nbytes / 1e6:.1f} MB of weights, trainer to rollout worker, {rounds} rounds:")
    for label, ts in times.items():
        print(f"{label:>9}: {statistics.median(ts):6.1f} ms per fetch (median; "
              f"min {min(ts):.1f}, max {max(ts):.1f})")
    print(f"    ratio: {statistics.median(times['training']) / statistics.median(times['idle']):.2f}")
    # (The mean: a process's CPU time is counted in clock ticks of 10 ms.)
    per_fetch = statistics.mean(cpu)
    print(f"CPU, all processes, per fetch from the idle trainer (with the task reading it): "
          f"{1000 * per_fetch:.1f} ms, {1000 * per_fetch / (nbytes / 1e6):.2f} ms per MB "
          f"(mean of {len(cpu)})")
    _serialization()


def _serialization(repeats: int = 21) -> None:
    """Dask's serialization of the default weights, by the digenrl serializer and pickled,
    each read back from fresh writable buffers (as a socket fills them)."""
    import pickle

    from distributed.protocol.serialize import merge_and_deserialize, serialize_and_split

    weights = _weights()

    def ms(f) -> float:
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            f()
            times.append(time.perf_counter() - t)
        return 1000 * statistics.median(times)

    header, frames = serialize_and_split(weights)
    received = iter([[bytearray(f) for f in frames] for _ in range(repeats)])
    pickled = pickle.dumps(weights, protocol=5)
    print(f"{len(weights.tensors)} tensors in {len(frames)} frames; medians of {repeats}: "
          f"serialize_and_split {ms(lambda: serialize_and_split(weights)):.1f} ms, "
          f"merge_and_deserialize {ms(lambda: merge_and_deserialize(header, next(received))):.1f}"
          f" ms; pickled {ms(lambda: pickle.dumps(weights, protocol=5)):.1f} ms, unpickled "
          f"{ms(lambda: pickle.loads(bytearray(pickled))):.1f} ms")


def _bare_loop(workers: int, chains: int, length: int, iterations: int) -> tuple[int, float]:
    """Tasks run and CPU seconds of the bare loop."""
    import heapq

    class Task:
        __slots__ = ("key", "dependents", "waiting")

        def __init__(self, key):
            self.key, self.dependents, self.waiting = key, [], 0

    n, t0 = 0, time.process_time()
    seq = 0
    for it in range(iterations):
        tasks, ready = {}, []
        for c in range(chains):
            prev = None
            for t in range(length):
                x = Task(("step", it, c, t))
                tasks[x.key] = x
                n += 1
                if prev is None:
                    heapq.heappush(ready, ((it, c, t), seq, x))
                    seq += 1
                else:
                    prev.dependents.append(x)
                    x.waiting = 1
                prev = x
        events, now, free, records = [], 0.0, list(range(workers)), []
        while ready or events:
            while free and ready:
                _, _, x = heapq.heappop(ready)
                heapq.heappush(events, (now + 1.0 + 0.001 * (x.key[2] % 7), seq, x, free.pop()))
                seq += 1
            now, _, x, w = heapq.heappop(events)
            records.append((x.key, w, now))
            free.append(w)
            for d in x.dependents:
                d.waiting -= 1
                if not d.waiting:
                    heapq.heappush(ready, ((it, d.key[2], d.key[3]), seq, d))
                    seq += 1
        tasks.clear()
    return n, time.process_time() - t0


def eventloop(gpus: int, iterations: int) -> None:
    from digenrl.sim.engine import collector_off
    from digenrl.sim.profile import load_profile
    from digenrl.sim.simulate import simulate
    from digenrl.figures.variants import variant_schedule

    profile = load_profile("flux12b-16gpu").scaled(gpus)
    s = variant_schedule("digenrl")
    t0 = time.process_time()
    report = simulate(profile, s.options(), iterations, stale_groups=s.stale_groups)
    sim = (time.process_time() - t0) / report.tasks
    # The bare loop on as many chains and workers, with as many tasks per chain.
    chains = profile.prompts_per_iteration * profile.samples_per_prompt // profile.chunk_size
    tasks = report.tasks
    per_chain = tasks // (iterations * chains)
    del report  # (its tasks are freed now, not held through the bare loop)
    # With the cyclic collector off, as the simulator runs.
    with collector_off():
        n, cpu = _bare_loop(gpus, chains, per_chain, iterations)
    bare = cpu / n
    print(f"digenrl simulate, {profile.name}, {iterations} iterations: {tasks} tasks, "
          f"{1e6 * sim:.1f} us CPU per task")
    print(f"bare event loop, {chains} chains of {per_chain} on {gpus} workers: {n} tasks, "
          f"{1e6 * bare:.1f} us CPU per task")
    print(f"ratio {sim / bare:.2f}")


def _idle_cores(tick: str, seconds: float) -> float:
    """Cores the local 2+2 cluster uses while idle, with the tick interval ``tick``
    (empty: as configured), in this process."""
    from digenrl.run import cluster
    from digenrl.config import ClusterConfig

    if tick:
        cluster.DASK_CONFIG["distributed.admin.tick.interval"] = tick
    handle = cluster.start_cluster(ClusterConfig(rollout_workers=2, trainer_workers=2,
                                                 dashboard_address=None))
    try:
        time.sleep(5)  # the workers' start-up settles
        c0, t0 = _cluster_cpu(), time.monotonic()
        time.sleep(seconds)
        return (_cluster_cpu() - c0) / (time.monotonic() - t0)
    finally:
        handle.close()


def idle(rounds: int, seconds: float = 20.0) -> None:
    from digenrl.run.cluster import DASK_CONFIG

    ticks = {f"as configured ({DASK_CONFIG['distributed.admin.tick.interval']})": "",
             "0.1 s": "100ms"}
    cores: dict[str, list[float]] = {name: [] for name in ticks}
    for _ in range(rounds):
        for name, tick in ticks.items():
            out = subprocess.run([sys.executable, __file__, "_idle", tick, str(seconds)],
                                 capture_output=True, text=True, check=True).stdout
            cores[name].append(float(out.split()[-1]))
    for name, c in cores.items():
        print(f"idle 2+2 local cluster, tick {name}: {statistics.median(c):.4f} cores "
              f"(median of {rounds}; {', '.join(f'{x:.4f}' for x in c)})")


_DRIVER_IMPORTS = """
import json, sys, time
from digenrl.config import load_config
import digenrl.commands.cli, digenrl.run.runner
from digenrl.models import family, flow_sigmas
cfg = load_config("workflows/configs/tiny.yaml")
family(cfg.model).latent_shape(); flow_sigmas(cfg.sampler, cfg.model)
print(json.dumps({"cpu": time.process_time()}))
"""

_WORKER_BUILD = """
import importlib, json, sys, time
from digenrl.run.cluster import WORKER_PRELOAD
for m in WORKER_PRELOAD:
    importlib.import_module(m)
before, t = set(sys.modules), time.process_time()
from digenrl.config import ModelConfig
from digenrl.models.lora import Trainable, build_policy
from digenrl.models import build_vae
build_policy(ModelConfig(), Trainable(), 0), build_vae(ModelConfig(), 0)
print(json.dumps({"cpu": time.process_time() - t, "modules": len(set(sys.modules) - before)}))
"""


def imports(rounds: int) -> None:
    import json

    def fresh(code: str) -> dict:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             check=True, cwd=os.path.dirname(os.path.dirname(__file__)))
        return json.loads(out.stdout.strip().splitlines()[-1])

    driver, worker = [], []
    for _ in range(rounds):
        driver.append(fresh(_DRIVER_IMPORTS)["cpu"])
        worker.append(fresh(_WORKER_BUILD))
    print(f"a driver's imports: {statistics.median(driver):.2f} CPU-s (median of {rounds}; "
          f"{', '.join(f'{x:.2f}' for x in driver)})")
    print(f"a forked worker's first build of the default models: "
          f"{statistics.median(w['cpu'] for w in worker):.2f} CPU-s, "
          f"{worker[0]['modules']} modules imported beyond the preload")


def _commit_cpu(together: bool, commits: int) -> float:
    """CPU-seconds per commit of a small run's iteration to a fresh store."""
    import tempfile

    import numpy as np

    from digenrl import store

    rng = np.random.default_rng(0)
    iteration = {"tasks": {f"column{k}": rng.standard_normal(30) for k in range(30)},
                 "metrics": {f"metric{k}": np.float64(k) for k in range(30)}}
    with tempfile.TemporaryDirectory() as tmp:
        s = store.RunStore.create(os.path.join(tmp, "bench.zarr"), {})
        s.append_iteration(iteration)   # (makes the arrays)
        t = time.process_time()
        for _ in range(commits):
            writes = s._batch_writes([iteration])
            if together:
                store.write_all(writes)
            else:
                for w in writes:
                    store.write_all([w])
            s.commit()
        return (time.process_time() - t) / commits


def commit(rounds: int, commits: int = 10) -> None:
    cpu: dict[str, list[float]] = {"at once": [], "in turn": []}
    for _ in range(rounds):
        cpu["at once"].append(_commit_cpu(True, commits))
        cpu["in turn"].append(_commit_cpu(False, commits))
    for name, c in cpu.items():
        print(f"a commit of 60 arrays, written {name}: {statistics.median(c):.3f} CPU-s "
              f"(median of {rounds} rounds of {commits})")
    print(f"ratio {statistics.median(cpu['at once']) / statistics.median(cpu['in turn']):.2f}")


def _checkpoint_cpu(chunkwise: bool, writes: int) -> tuple[float, float]:
    """User and system CPU-seconds per checkpoint of the default model's trainer state."""
    import resource
    import tempfile

    from digenrl import store
    from digenrl.store import checkpoints

    params = {n: t.numpy() for n, t in _weights().tensors.items()}
    parts = {p: params for p in ("params", "exp_avg", "exp_avg_sq")}

    def whole(grp, name, flat, attrs):  # one write of the whole array, zarr's defaults
        z = grp.create_array(name, shape=flat.shape, dtype=flat.dtype, compressors=None,
                             chunks=(1, min(flat.shape[1], checkpoints._CHECKPOINT_CHUNK)),
                             overwrite=True)
        z[...] = flat
        z.attrs.update(attrs)
        return z

    def used() -> tuple[float, float]:
        r = resource.getrusage(resource.RUSAGE_SELF)
        return r.ru_utime, r.ru_stime

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "bench.zarr")
        store.RunStore.create(path, {})
        write = checkpoints._write_flat
        try:
            if not chunkwise:
                checkpoints._write_flat = whole
            checkpoints.write_checkpoint(path, 0, parts, 0)   # (first file writes)
            u, s = used()
            for v in range(1, writes + 1):
                checkpoints.write_checkpoint(path, v, parts, v)
                checkpoints.drop_checkpoints(path, lambda old, v=v: old < v)  # as a run does
            u2, s2 = used()
        finally:
            checkpoints._write_flat = write
    return (u2 - u) / writes, (s2 - s) / writes


def checkpoint(rounds: int, writes: int = 10) -> None:
    cpu: dict[str, list[tuple[float, float]]] = {"chunk by chunk": [], "one zarr write": []}
    for _ in range(rounds):
        cpu["chunk by chunk"].append(_checkpoint_cpu(True, writes))
        cpu["one zarr write"].append(_checkpoint_cpu(False, writes))
    medians = {name: (statistics.median(u for u, _ in c), statistics.median(s for _, s in c))
               for name, c in cpu.items()}
    for name, (user, system) in medians.items():
        print(f"a checkpoint of the default model's trainer state, {name}: {user:.3f} user "
              f"+ {system:.3f} system CPU-s (median of {rounds} rounds of {writes})")
    print(f"ratio of all CPU "
          f"{sum(medians['chunk by chunk']) / sum(medians['one zarr write']):.2f}")


def _text_images(size: int, count: int):
    """``count`` images of ``size`` pixels, each showing one of the ocr set's texts, and
    their prompts."""
    import numpy as np
    from PIL import Image, ImageDraw, ImageFont

    from digenrl.prompts import PROMPT_SETS

    prompts = list(PROMPT_SETS["ocr"][::7][:count])
    images = []
    for prompt in prompts:
        text = prompt.split('"')[1]
        image = Image.new("RGB", (size, size), (235, 232, 220))
        draw = ImageDraw.Draw(image)
        try:
            font = ImageFont.truetype("DejaVuSans.ttf", size // 12)
        except OSError:
            font = ImageFont.load_default(size=size // 12)
        left, top, right, bottom = draw.textbbox((0, 0), text, font=font)
        draw.text(((size - right - left) / 2, (size - bottom - top) / 2), text, font=font,
                  fill=(20, 20, 30))
        images.append(np.asarray(image))
    return np.stack(images), prompts


def ocr(rounds: int) -> None:
    import numpy as np
    import torch

    from digenrl.config import RewardModelConfig
    from digenrl.tasks.reward_models import model_reward, resident_reward_model

    torch.set_num_threads(1)  # a worker's cluster.torch_threads
    config = RewardModelConfig(kind="ocr", batch_size=8)
    spec = model_reward("ocr", config)
    images, prompts = _text_images(512, 1)
    start = time.perf_counter()
    spec(images, prompts)
    print(f"first call (the models loaded, one 512-pixel image): "
          f"{time.perf_counter() - start:.2f} s")
    reader = resident_reward_model(config).reader
    for size in (256, 512):
        images, prompts = _text_images(size, 8)
        scores = spec(images, prompts)
        for batch in (1, 8):
            wall, cpu = _per_image(rounds, lambda: [
                spec(images[a:a + batch], prompts[a:a + batch]) for a in range(0, 8, batch)])
            print(f"{size} px, calls of {batch}: {wall:.3f} s, {cpu:.3f} CPU-s per image "
                  f"(medians of {rounds} rounds of 8 images; mean score {np.mean(scores):.2f})")
        for stack in (False, True):
            wall, cpu = _per_image(rounds, lambda: reader.read(images, stack=stack))
            what = "stacked into one pass" if stack else "one pass per image"
            print(f"{size} px, reading 8, detection {what}: {wall:.3f} s, {cpu:.3f} CPU-s "
                  f"per image")


    _ocr_split(reader, rounds)
    _ocr_flops()


def _ocr_split(reader, rounds: int) -> None:
    """CPU-seconds per image in each session, and outside them."""
    spent = {"detector": 0.0, "recogniser": 0.0}
    owners = {"detector": reader.detector, "recogniser": reader.engine.text_rec}

    class Timed:
        def __init__(self, name, session):
            self.name, self.session = name, session

        def __call__(self, x):
            start = time.process_time()
            try:
                return self.session(x)
            finally:
                spent[self.name] += time.process_time() - start

    originals = {name: owner.session for name, owner in owners.items()}
    try:
        for name, owner in owners.items():
            owner.session = Timed(name, originals[name])
        for size in (256, 512):
            images, _ = _text_images(size, 8)
            spent.update(detector=0.0, recogniser=0.0)
            start = time.process_time()
            for _ in range(rounds):
                reader.read(images)
            n = 8 * rounds
            total = (time.process_time() - start) / n
            det, rec = spent["detector"] / n, spent["recogniser"] / n
            print(f"{size} px, CPU-s per image: {total:.4f} = detector {det:.4f} + "
                  f"recogniser {rec:.4f} + the rest {total - det - rec:.4f} ({n} images)")
    finally:
        for name, owner in owners.items():
            owner.session = originals[name]


def _ocr_flops() -> None:
    import json
    import tempfile

    import numpy as np
    import onnxruntime

    from digenrl.tasks.ocr import model_files

    det, rec = model_files()
    for path, shape in ((det, (1, 3, 256, 256)), (det, (1, 3, 512, 512)),
                        (rec, (1, 3, 48, 320))):
        with tempfile.TemporaryDirectory() as folder:
            options = onnxruntime.SessionOptions()
            options.enable_profiling, options.intra_op_num_threads = True, 1
            options.profile_file_prefix = f"{folder}/profile"
            session = onnxruntime.InferenceSession(str(path), options,
                                                   providers=["CPUExecutionProvider"])
            session.run(None, {session.get_inputs()[0].name:
                               np.zeros(shape, np.float32)})
            with open(session.end_profiling()) as f:
                events = json.load(f)
        flops, nodes = 0, 0
        for e in events:
            if e.get("cat") != "Node" or not e["name"].endswith("_kernel_time"):
                continue
            nodes += 1
            a = e["args"]
            ins = [next(iter(d.values())) for d in a.get("input_type_shape", [])]
            out = [next(iter(d.values())) for d in a.get("output_type_shape", [])]
            if a.get("op_name") in ("Conv", "FusedConv") and len(ins) > 1:
                flops += 2 * int(np.prod(out[0])) * int(np.prod(ins[1][1:]))
            elif a.get("op_name") in ("MatMul", "FusedMatMul", "Gemm") and len(ins) > 1:
                flops += 2 * int(np.prod(out[0])) * ins[0][-1]
        print(f"{path.name} on {shape}: {flops / 1e9:.2f} GFLOP in convolutions and matrix "
              f"products, {nodes} nodes run")


def _per_image(rounds: int, read_eight) -> tuple[float, float]:
    """The median wall and CPU (this process's) seconds per image of ``read_eight``."""
    wall, cpu = [], []
    for _ in range(rounds):
        w, c = time.perf_counter(), time.process_time()
        read_eight()
        wall.append((time.perf_counter() - w) / 8)
        cpu.append((time.process_time() - c) / 8)
    return statistics.median(wall), statistics.median(cpu)


#: ``fsdp_memory``'s model: the built-in one, six blocks of width 512 (54.6M parameters).
_WIDE = {"transformer_layers": 6, "attention_heads": 8, "attention_head_dim": 64}


def _storage_bytes(tensors) -> int:
    """The bytes of the storages holding ``tensors``, each storage counted once."""
    seen = {}
    for t in tensors:
        st = t.untyped_storage()
        seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


def _fsdp_rank(rank: int, world: int, port: int) -> None:
    """One rank of ``fsdp_memory``: a micro-step and an optimizer step; prints a JSON line."""
    import json
    import resource

    import numpy as np
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from digenrl.config import config_from_dict
    from digenrl.graph.build import GraphContext
    from digenrl.models.lora import trainable_parameters
    from digenrl.tasks import rollout
    from digenrl.tasks.sharding import ShardedTrainer, local_tensors, sharded_policy
    from digenrl.tasks.types import AdvantageOut, StepOut

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    ctx = GraphContext.from_config(config_from_dict({
        "model": _WIDE, "algorithm": {"name": "diffusion_nft"}, "sampler": {"num_steps": 2},
        "rollout": {"chunk_size": 2}, "data": {"prompts_per_iteration": 1,
                                               "samples_per_prompt": 2}}))
    mesh = init_device_mesh("cpu", (world,))
    with open("/proc/self/statm") as f:  # resident pages before any weight exists
        before = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    module = sharded_policy(ctx.train, mesh)
    built = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    trainer = ShardedTrainer(ctx.train, module)
    ids, prompts = (0, 1), ("a cat",) * 2
    lat = rollout.encoded_noise(ctx.rollout, 0, ids, prompts)
    final = StepOut(ids, 1, lat.x, None, 0, lat.cond)  # its noise as the clean latent
    adv = AdvantageOut(0, ids, np.array([1.0, -1.0], np.float32), np.ones(2, bool))
    j = ctx.train.algorithm.micro_steps(0)[0]
    # At version 0 the sampling copy is the trained weights: the module itself.
    trainer.matching_grad(module, None, None, prompts, 0, j, final, adv, last=True)
    params = trainable_parameters(module)
    held = {"parameters": _storage_bytes(local_tensors(params).values()),
            "gradients": _storage_bytes(local_tensors(
                {n: p.grad for n, p in params.items()}).values()),
            "moments": _storage_bytes(list(trainer.shards.exp_avg.values())
                                      + list(trainer.shards.exp_avg_sq.values()))}
    trainer.optimize(0)
    total = sum(p.numel() for p in params.values())
    print(json.dumps({"rank": rank, "world": world, "model_parameters": total, **held,
                      "rss_before": before, "peak_rss_built": built,
                      "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))
    dist.destroy_process_group()


def fsdp_memory(rounds: int) -> None:
    import json
    import socket

    per_rank = {}
    for world in (1, 2):
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        procs = [subprocess.Popen([sys.executable, __file__, "_fsdp_rank", str(r), str(world),
                                   str(port)], stdout=subprocess.PIPE, text=True)
                 for r in range(world)]
        rows = [json.loads(p.communicate(timeout=900)[0].strip().splitlines()[-1])
                for p in procs]
        assert all(p.returncode == 0 for p in procs)
        print(f"model: {rows[0]['model_parameters'] / 1e6:.1f}M parameters (float32)")
        for row in rows:
            state = row["parameters"] + row["gradients"] + row["moments"]
            print(f"k={world} rank {row['rank']}: parameters {row['parameters'] / 2**20:.1f} MiB"
                  f" + gradients {row['gradients'] / 2**20:.1f} MiB + AdamW moments "
                  f"{row['moments'] / 2**20:.1f} MiB = {state / 2**20:.1f} MiB; peak RSS "
                  f"{row['peak_rss'] / 2**20:.0f} MiB ({row['rss_before'] / 2**20:.0f} MiB "
                  f"before the model, {row['peak_rss_built'] / 2**20:.0f} MiB once built and "
                  f"sharded)")
        per_rank[world] = (max(r["parameters"] + r["gradients"] + r["moments"] for r in rows),
                           max(r["peak_rss"] for r in rows),
                           max(r["peak_rss"] - r["rss_before"] for r in rows))
    one, two = per_rank[1], per_rank[2]
    print(f"per rank, k=2 / k=1: trainer state {two[0] / one[0]:.3f}, peak RSS "
          f"{two[1] / one[1]:.3f}, peak RSS above the process before the model "
          f"{two[2] / one[2]:.3f}")


def _bench_weights(mb: int, seed: int):
    """``mb`` MB of float32 weights in tensors of 4 MB (a ``PolicyWeights``)."""
    import torch

    from digenrl.tasks.types import PolicyWeights

    g = torch.Generator().manual_seed(seed)
    count = max(mb // 4, 1)
    return PolicyWeights(seed, {f"w{i}": torch.randn(1 << 20, generator=g)
                                for i in range(count)})


def _bench_join(name: str, members: list) -> None:
    from digenrl.tasks import collective

    collective.join(name, members, 1, backend="gloo", timeout=300.0)


def _bench_leave() -> None:
    from digenrl.tasks import collective

    collective.leave()


def _bench_manifest(weights, bucket_mb: float):
    from digenrl.tasks.broadcast import Manifest

    return Manifest.of(weights.version, weights.tensors, bucket_mb)


def _bench_send(name: str, weights, manifest) -> float:
    from digenrl.tasks import broadcast, collective

    start = time.perf_counter()
    broadcast.send(collective.group(name, 1), weights.tensors, manifest)
    return time.perf_counter() - start


def _bench_receive(name: str, manifest) -> int:
    from digenrl.tasks import broadcast, collective

    got = broadcast.receive(collective.group(name, 1), manifest)
    return sum(t.numel() * t.element_size() for t in got.values())


def broadcast(rounds: int, mb: int, bucket_mb: float) -> None:
    import logging

    from distributed import wait

    from digenrl.config import ClusterConfig
    from digenrl.run.cluster import start_cluster

    logging.getLogger("distributed").setLevel(logging.ERROR)
    handle = start_cluster(ClusterConfig(rollout_workers=2, trainer_workers=1,
                                         dashboard_address=None))
    c = handle.client
    by_name = {str(w["name"]): a for a, w in c.scheduler_info()["workers"].items()}
    trainer = next(n for n in sorted(by_name) if n.startswith("trainer"))
    rollouts = [n for n in sorted(by_name) if n.startswith("rollout")]
    members = [trainer, *rollouts]
    c.run(_as_in_a_run)

    def on(name, fn, *args):
        return c.submit(fn, *args, workers=[by_name[name]], allow_other_workers=False,
                        pure=False)

    wait([on(n, _bench_join, "bench", members) for n in members])
    seconds: dict[str, list[float]] = {"dask": [], "broadcast": []}
    nbytes = buckets = 0
    try:
        # A first round, not counted: each worker imports what the weights need.
        for r in range(rounds + 1):
            w = on(trainer, _bench_weights, mb, r)
            wait([w])
            # (made where the weights are: only the manifest reaches this process)
            manifest = on(trainer, _bench_manifest, w, bucket_mb).result()
            nbytes, buckets = manifest.nbytes, len(manifest.buckets)
            for way in (("dask", "broadcast") if r % 2 else ("broadcast", "dask")):
                start = time.perf_counter()
                if way == "dask":
                    got = [on(n, _size, w) for n in rollouts]
                else:
                    got = [on(trainer, _bench_send, "bench", w, manifest),
                           *[on(n, _bench_receive, "bench", manifest) for n in rollouts]]
                wait(got)
                if r:
                    seconds[way].append(time.perf_counter() - start)
                assert all(f.status == "finished" for f in got), [f.exception() for f in got]
                del got
            del w
    finally:
        wait([on(n, _bench_leave) for n in members])
        handle.close()
    print(f"{nbytes / 1e6:.0f} MB of float32 weights (tensors of 4 MB), trainer to 2 "
          f"rollout workers, {rounds} rounds; broadcast in {buckets} buckets of "
          f"{bucket_mb:g} MiB over gloo:")
    for way, ts in seconds.items():
        med = statistics.median(ts)
        print(f"{way:>9}: {med:6.2f} s (median; min {min(ts):.2f}, max {max(ts):.2f}), "
              f"{nbytes / 1e6 / med:6.0f} MB/s")
    print(f"    ratio: broadcast {statistics.median(seconds['dask']) / statistics.median(seconds['broadcast']):.2f}x "
          f"as fast as Dask")


def main() -> None:
    if sys.argv[1:2] == ["_idle"]:  # one measurement, in a process of its own
        print(_idle_cores(sys.argv[2], float(sys.argv[3])))
        return
    if sys.argv[1:2] == ["_fsdp_rank"]:  # one rank of fsdp_memory, in a process of its own
        _fsdp_rank(int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))
        return
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    # The benchmarks that take only the number of rounds.
    by_rounds = {"transfer": transfer, "collector": collector, "idle": idle,
                 "imports": imports, "commit": commit, "checkpoint": checkpoint, "ocr": ocr,
                 "fsdp_memory": fsdp_memory}
    p.add_argument("what", choices=["dispatch", "malloc", "eventloop", "broadcast",
                                    *by_rounds])
    p.add_argument("--hops", type=int, default=300)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--gpus", type=int, default=256, help="eventloop: the profile's GPUs")
    p.add_argument("--iterations", type=int, default=8, help="eventloop: iterations")
    p.add_argument("--mb", type=int, default=200, help="broadcast: MB of weights")
    p.add_argument("--bucket-mb", type=float, default=32.0,
                   help="broadcast: the buckets' MiB")
    args = p.parse_args()
    if args.what == "broadcast":
        broadcast(args.rounds, args.mb, args.bucket_mb)
    elif args.what == "dispatch":
        dispatch(args.hops, args.rounds)
    elif args.what == "eventloop":
        eventloop(args.gpus, args.iterations)
    elif args.what in by_rounds:
        by_rounds[args.what](args.rounds)
    else:
        malloc()


if __name__ == "__main__":
    main()
