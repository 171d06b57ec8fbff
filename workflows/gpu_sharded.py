"""A sharded run's trainer path on one GPU: the collective group, ``fully_shard``,
micro-steps, the optimizer step, the sharded checkpoint, and the new weights to a rollout
worker on the same GPU through Dask.

On a local Dask cluster of two worker processes (a trainer and a rollout worker, both
seeing the GPU), the script calls the tasks a run with ``train.sharding: fsdp`` runs
(:mod:`digenrl.tasks.sharded_steps`) on a gang of one trainer: ``make`` (the group over
``cluster.collective_backend``, NCCL on a GPU worker, the transformer sharded with
FSDP2), Flow-GRPO micro-steps on chunks the rollout worker denoised, the optimizer step
writing the version's sharded checkpoint into a store, and the new version's weights to
the rollout worker, which loads them and denoises with them. A gang of one rank is what
one GPU can check (NCCL needs a distinct GPU per rank).

The model is the built-in SD3-shaped transformer made large (by default 12 blocks of 24
heads x 64: about 1.0e9 parameters) in ``model.dtype`` bfloat16, seeded random weights.
Prints seconds per micro-step (the trainer's own time, synchronised), per optimizer step
and checkpoint, the transfer of the weights through Dask, and each process's peak GPU
memory (``torch.cuda.max_memory_allocated``).

    python workflows/gpu_sharded.py                    # ~1e9 parameters, a GPU
    python workflows/gpu_sharded.py --cpu --layers 2 --heads 4 --head-dim 32 --image-size 32
                                                       # the same path on CPU (gloo)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=12, help="transformer blocks (12)")
    p.add_argument("--heads", type=int, default=24, help="attention heads (24)")
    p.add_argument("--head-dim", type=int, default=64, help="width of a head (64)")
    p.add_argument("--image-size", type=int, default=256,
                   help="pixels (256: a 64x64 latent, 1024 tokens a sample)")
    p.add_argument("--chunk-size", type=int, default=4, help="samples a micro-step trains")
    p.add_argument("--micro-steps", type=int, default=4, help="micro-steps an iteration")
    p.add_argument("--iterations", type=int, default=2)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--checkpointing", action="store_true", help="gradient checkpointing")
    p.add_argument("--cpu", action="store_true", help="run on the CPU over gloo (a check)")
    p.add_argument("--json", help="also write the results to this file")
    return p.parse_args(argv)


def config(args):
    from digenrl.config import config_from_dict

    return config_from_dict({
        "model": {"transformer_layers": args.layers, "attention_heads": args.heads,
                  "attention_head_dim": args.head_dim, "image_size": args.image_size,
                  "dtype": args.dtype},
        "train": {"sharding": "fsdp", "gradient_checkpointing": args.checkpointing},
        "algorithm": {"name": "flow_grpo"}, "sampler": {"num_steps": 4},
        "rollout": {"chunk_size": args.chunk_size},
        "data": {"prompts_per_iteration": args.micro_steps, "samples_per_prompt":
                 args.chunk_size},
        # (The cluster section is not used here: this script starts its own, of one
        # trainer; a run refuses fsdp over fewer than two.)
        "cluster": {"collective_backend": "gloo" if args.cpu else "auto",
                    "trainer_workers": 2}})


def timed(fn, *args):
    """``fn(*args)`` and the seconds it took on this worker (the GPU synchronised)."""
    import torch

    def sync():
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    sync()
    start = time.perf_counter()
    out = fn(*args)
    sync()
    return out, time.perf_counter() - start


def first(pair):
    return pair[0]


def memory(reset: bool = False) -> dict:
    """This worker's peak GPU memory since the last reset, in GiB (and reset it)."""
    import torch

    if not torch.cuda.is_available():
        return {"peak_gib": None}
    peak = torch.cuda.max_memory_allocated() / 2 ** 30
    if reset:
        torch.cuda.reset_peak_memory_stats()
    return {"peak_gib": round(peak, 2), "now_gib": round(torch.cuda.memory_allocated() / 2 ** 30, 2)}


def chunk(spec, weights, c: int, size: int):
    """Chunk ``c``'s first denoising step on this worker: ``(prompts, t, before, after,
    advantage)``."""
    import numpy as np

    from digenrl.tasks import rollout
    from digenrl.tasks.types import AdvantageOut

    ids = tuple(range(c * size, (c + 1) * size))
    prompts = tuple(f"a photo of object {i}" for i in ids)
    before = rollout.encoded_noise(spec, 0, ids, prompts)
    after = rollout.denoise(spec, weights, prompts, 0, 0, before)
    advantages = np.linspace(-1.0, 1.0, size, dtype=np.float32)
    return prompts, 0, before, after, AdvantageOut(c, ids, advantages, np.ones(size, bool))


def loaded_equal(spec, weights) -> dict:
    """Load ``weights`` into this worker's resident transformer (the Dask path of a
    rollout worker) and compare what it computes with against them."""
    import torch

    from digenrl.tasks.resident import resident

    models = resident(spec.model, spec.model_seed, spec.trainable)
    start = time.perf_counter()
    models.policy(weights)
    seconds = time.perf_counter() - start
    held = models.loaded(weights.version)
    assert held is not None
    same = all(torch.equal(held[n].float(), t.to(held[n].dtype).float())
               for n, t in weights.tensors.items())
    return {"version": weights.version, "tensors": len(weights.tensors),
            "bytes": weights.nbytes, "load_s": round(seconds, 3),
            "same_as_sent_in_model_dtype": same}


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    if not args.cpu and not torch.cuda.is_available():
        print("gpu_sharded: expected a CUDA GPU (or --cpu for the CPU path), got none",
              file=sys.stderr)
        return 2
    from distributed import Client, LocalCluster, wait

    from digenrl.config import config_to_dict
    from digenrl.graph.build import GraphContext
    from digenrl.store import RunStore
    from digenrl.store.sharded import sharded_checkpoints
    from digenrl.tasks import sharded_steps
    from digenrl.tasks.sharded_steps import ShardSpec

    cfg = config(args)
    ctx = GraphContext.from_config(cfg)
    folder = Path(tempfile.mkdtemp(prefix="gpu-sharded-"))
    store = folder / "run.zarr"
    RunStore.create(store, {"config": config_to_dict(cfg)})
    results: dict = {"config": {k: v for k, v in vars(args).items() if k != "json"}}
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
                      dashboard_address=None, memory_limit=0) as cluster, \
            Client(cluster) as client:
        trainer, roller = sorted(str(w.name) for w in cluster.workers.values())[:2]
        t_addr = [a for a, w in cluster.scheduler.workers.items() if str(w.name) == trainer]
        r_addr = [a for a, w in cluster.scheduler.workers.items() if str(w.name) == roller]
        shard = ShardSpec("trainer", 1, (trainer,), cfg.cluster.collective_backend,
                          cfg.cluster.collective_timeout, str(store))

        def on(addr, fn, *a):
            return client.submit(fn, *a, workers=addr, allow_other_workers=False, pure=False)

        start = time.perf_counter()
        made = on(t_addr, timed, sharded_steps.make, ctx.train, shard, 0, 0, False, False)
        out, make_s = made.result()
        results["make_s"] = round(make_s, 2)
        results["params"] = sum(t.numel() for t in out.weights.tensors.values())
        results["trainer_after_make"] = client.run(memory, True, workers=t_addr)[t_addr[0]]
        print(f"made version 0 in {make_s:.1f} s ({results['params'] / 1e9:.3f}e9 "
              f"parameters); trainer GPU {results['trainer_after_make']}", flush=True)
        previous = client.submit(first, made)
        weights = client.submit(sharded_steps.published, previous)
        steps: list[float] = []
        for i in range(args.iterations):
            # The rollout worker denoises this iteration's chunks with the version's
            # weights, which reach it through Dask.
            t0 = time.perf_counter()
            chunks = [on(r_addr, chunk, ctx.rollout, weights, c, args.chunk_size)
                      for c in range(args.micro_steps)]
            wait(chunks)
            rollout_s = time.perf_counter() - t0
            for r, c in enumerate(chunks):
                last = r == len(chunks) - 1
                step = on(t_addr, timed, sharded_steps.micro_step, ctx.train, shard, 0, r,
                          last, True, previous, None, *[client.submit(lambda x, k=k: x[k], c)
                                                          for k in range(5)])
                _, seconds = step.result()
                steps.append(seconds)
                previous = client.submit(first, step)
            micro = client.run(memory, True, workers=t_addr)[t_addr[0]]
            opt = on(t_addr, timed, sharded_steps.optimizer_step, ctx.train, shard, 0, i,
                     i == args.iterations - 1, previous)
            _, opt_s = opt.result()
            previous = client.submit(first, opt)
            opt_mem = client.run(memory, True, workers=t_addr)[t_addr[0]]
            weights = client.submit(sharded_steps.published, previous)
            t0 = time.perf_counter()
            check = on(r_addr, loaded_equal, ctx.rollout, weights).result()
            transfer_s = time.perf_counter() - t0
            row = {"iteration": i, "rollout_s": round(rollout_s, 2),
                   "micro_steps_s": [round(s, 3) for s in steps[-args.micro_steps:]],
                   "optimizer_step_s": round(opt_s, 2),
                   "checkpoint_written": i == args.iterations - 1,
                   "trainer_peak_micro_steps": micro, "trainer_peak_optimizer": opt_mem,
                   "weights_to_rollout_s": round(transfer_s, 2), "rollout_load": check}
            results.setdefault("iterations", []).append(row)
            print(json.dumps(row), flush=True)
        results["micro_step_median_s"] = round(statistics.median(steps[1:] or steps), 3)
        results["rollout_peak"] = client.run(memory, workers=r_addr)[r_addr[0]]
        results["sharded_checkpoints"] = sorted(sharded_checkpoints(store))
        results["wall_s"] = round(time.perf_counter() - start, 1)
        on(t_addr, sharded_steps.leave, "trainer").result()
    print(json.dumps({k: v for k, v in results.items() if k != "iterations"}, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
