"""The inputs of the sharded-training tests, and one rank of them: run as
``python sharded_ranks.py RANK WORLD PORT OUT`` (gloo on 127.0.0.1), each rank trains its
chunks sharded (:mod:`digenrl.tasks.sharding`) and rank 0 saves what it gathered to OUT.
With ``checkpoint STORE`` after them (2 ranks), they run the sharded checkpoint's steps instead
(:func:`_checkpoint_run`); with ``both STORE``, the training and then the checkpoint's steps,
all in one file (:func:`shared_launch`: one launch for the tests of both).

Flow-GRPO: three chunks over two ranks (rank 0 trains chunks 0 and 2, rank 1 chunk 1 and
then adds zero through chunk 1 again), three optimizer steps on the same chunks, twice
from version 0. DiffusionNFT: two chunks, one per rank, the first iteration's gradient.
"""

from __future__ import annotations

import fcntl
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch

from digenrl.config import config_from_dict
from digenrl.graph.build import GraphContext
from digenrl.tasks import rollout, train
from digenrl.tasks.types import AdvantageOut

#: A small built-in model.
MODEL = {"transformer_layers": 2, "image_size": 32}
STEPS = 3  # optimizer steps of the Flow-GRPO comparison
#: Chunks each rank trains, by algorithm, in order (None: a zero contribution).
FLOW_CHUNKS = {0: (0, 2), 1: (1, None)}
NFT_CHUNKS = {0: (0,), 1: (1,)}


def config(algorithm: str, prompts: int, dtype: str = "float32"):
    sampler = {"num_steps": 2} if algorithm != "flow_grpo" else {"num_steps": 4}
    return config_from_dict({
        "model": {**MODEL, "dtype": dtype}, "sampler": sampler, "algorithm": {"name": algorithm},
        "rollout": {"chunk_size": 2},
        "data": {"prompts_per_iteration": prompts, "samples_per_prompt": 2}})


def context(algorithm: str, prompts: int, dtype: str = "float32"):
    return GraphContext.from_config(config(algorithm, prompts, dtype))


def start(world: int, out, *extra: str, script: str = __file__) -> list[subprocess.Popen]:
    """``world`` ranks of ``script`` (this one unless named) started, each as ``script
    RANK WORLD PORT OUT *EXTRA`` on a free port (each prints to a pipe)."""
    root = str(Path(__file__).resolve().parent.parent)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [root] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])}
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return [subprocess.Popen([sys.executable, str(Path(script).resolve()), str(r),
                              str(world), str(port), str(out), *extra],
                             env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True) for r in range(world)]


def finish(procs: list[subprocess.Popen], timeout: float) -> None:
    """Wait for the ranks (at most ``timeout`` seconds each; killed past it) and fail
    with a rank's log if it did not exit cleanly."""
    try:
        logs = [p.communicate(timeout=timeout)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=30)
    for r, (p, log) in enumerate(zip(procs, logs)):
        assert p.returncode == 0, f"rank {r} exited with {p.returncode}:\n{log[-3000:]}"


class SharedLaunch:
    """What 2 ranks run with ``both STORE`` (:func:`shared_launch`), launched once per
    suite: the process that asks first starts the ranks and holds a lock on the folder
    of the suite's processes until they end; one that asks meanwhile waits on that lock
    in :meth:`result`, and one that asks later reads the file."""

    def __init__(self, folder: Path, timeout: float):
        self.store, self.out = folder / "run.zarr", folder / "rank0.pt"
        self.timeout = timeout
        self.lock = open(folder / "lock", "w")
        self.procs: list[subprocess.Popen] = []
        try:
            fcntl.flock(self.lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return   # another process runs them: result() waits for its lock
        if self.out.exists():
            return
        from digenrl.config import config_to_dict
        from digenrl.store import RunStore

        if self.store.exists():   # a launch that failed part-way: start it anew
            import shutil

            shutil.rmtree(self.store)
        RunStore.create(self.store, {"config": config_to_dict(config("flow_grpo", 3))})
        partial = self.out.with_suffix(".partial")
        self.procs = start(2, partial, "both", str(self.store))

    def result(self) -> dict:
        """What rank 0 gathered (failing with a rank's log if a rank failed)."""
        try:
            if self.procs:
                finish(self.procs, self.timeout)
                self.out.with_suffix(".partial").rename(self.out)
            else:
                fcntl.flock(self.lock, fcntl.LOCK_EX)
        finally:
            fcntl.flock(self.lock, fcntl.LOCK_UN)
            self.lock.close()
        assert self.out.exists(), "the sharded ranks' launch failed in another process"
        return torch.load(self.out, weights_only=False)


def shared_launch(tmp_path_factory, timeout: float) -> SharedLaunch:
    """The ranks of ``both STORE``, started (or found running, or done) in a folder all
    the suite's processes share (pytest-xdist's workers take their temporary folders
    inside one): the sharded training and the sharded checkpoint's tests read one launch
    whichever process runs them, instead of each importing torch into ranks of its own.
    ``result()`` waits for them."""
    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    folder = shared / "sharded-ranks"
    folder.mkdir(exist_ok=True)
    return SharedLaunch(folder, timeout)


def chunk_ids(c: int) -> tuple[tuple[int, ...], tuple[str, ...]]:
    words = ("cat", "dog", "fox")
    return (2 * c, 2 * c + 1), (f"a {words[c]}",) * 2


def advantage(c: int) -> AdvantageOut:
    ids, _ = chunk_ids(c)
    return AdvantageOut(c, ids, np.array([1.0, -0.5], np.float32) * (c + 1), np.ones(2, bool))


def flow_inputs(ctx, weights, c: int):
    """Chunk ``c``'s first step: ``(prompts, t, before, after, advantage)``."""
    ids, prompts = chunk_ids(c)
    lat = rollout.encoded_noise(ctx.rollout, 0, ids, prompts)
    return prompts, 0, lat, rollout.denoise(ctx.rollout, weights, prompts, 0, 0, lat), \
        advantage(c)


def nft_inputs(ctx, sampling, c: int):
    """Chunk ``c``'s final latent: ``(prompts, final StepOut, advantage)``."""
    ids, prompts = chunk_ids(c)
    x = rollout.encoded_noise(ctx.rollout, 0, ids, prompts)
    for t in range(ctx.train.sampler.num_steps):
        x = rollout.denoise(ctx.rollout, sampling, prompts, 0, t, x)
    return prompts, x, advantage(c)


def _full_grads(module) -> dict[str, torch.Tensor]:
    from digenrl.models.lora import trainable_parameters

    return {n: (p.grad.full_tensor() if p.grad is not None else torch.zeros(p.shape))
            for n, p in trainable_parameters(module).items()}


def _micro_steps(trainer, inputs, chunks) -> None:
    """An iteration's Flow-GRPO micro-steps on ``chunks`` (None: a zero contribution)."""
    for k, c in enumerate(chunks):
        prompts, t, before, after, adv = inputs[c if c is not None else chunks[0]]
        trainer.grad(None, prompts, t, before, after, adv, last=k == len(chunks) - 1,
                     contributes=c is not None)


def _flow_iteration(trainer, inputs, chunks, i: int):
    """Iteration ``i``: the micro-steps and the optimizer step."""
    _micro_steps(trainer, inputs, chunks)
    return trainer.optimize(i)


def _flow_run(rank: int, mesh, dtype: str = "float32", steps: int = STEPS):
    from digenrl.tasks.sharding import ShardedTrainer, sharded_policy

    ctx = context("flow_grpo", 3, dtype)
    w0 = train.publish(train.init_state(ctx.train))
    inputs = {c: flow_inputs(ctx, w0, c) for c in {0, 1, 2}}
    trainer = ShardedTrainer(ctx.train, sharded_policy(ctx.train, mesh))
    first, stats = None, []
    for i in range(steps):
        _micro_steps(trainer, inputs, FLOW_CHUNKS[rank])
        if i == 0:
            first = _full_grads(trainer.module)
        stats.append(trainer.optimize(i))
    return first, stats, trainer.full_weights()


def _full_state(trainer) -> dict[str, torch.Tensor]:
    """A copy of the trainer's whole state (every rank takes part), by checkpoint key (on
    one rank a full tensor may be the shard itself, which the next step changes)."""
    return {k: t.full_tensor().clone() for k, t in trainer.sharded_state().items()}


def _checkpoint_run(rank: int, mesh, store: str) -> dict[str, dict]:
    """Both ranks: one optimizer step, version 1's sharded checkpoint saved, then the next
    step uninterrupted and again from the checkpoint loaded into a new trainer
    (``"two"``). Rank 0 alone (a mesh of one rank): the checkpoint loaded, resharded, and
    the next step on every chunk (``"one"``)."""
    from torch.distributed import new_group
    from torch.distributed.device_mesh import DeviceMesh

    from digenrl.tasks.sharding import ShardedTrainer, sharded_policy

    ctx = context("flow_grpo", 3)
    w0 = train.publish(train.init_state(ctx.train))
    inputs = {c: flow_inputs(ctx, w0, c) for c in {0, 1, 2}}

    def resume(mesh, chunks) -> dict:
        trainer = ShardedTrainer(ctx.train, sharded_policy(ctx.train, mesh))
        trainer.load_checkpoint(store, 1)
        got = {"loaded": _full_state(trainer), "version": trainer.version,
               "step": trainer.shards.step}
        got["resumed_version"] = _flow_iteration(trainer, inputs, chunks, 1).version
        return {**got, "resumed": trainer.full_weights()}

    chunks = FLOW_CHUNKS[rank]
    trainer = ShardedTrainer(ctx.train, sharded_policy(ctx.train, mesh))
    _flow_iteration(trainer, inputs, chunks, 0)
    trainer.save_checkpoint(store)
    saved = _full_state(trainer)
    _flow_iteration(trainer, inputs, chunks, 1)
    two = {"saved": saved, "uninterrupted": trainer.full_weights(), **resume(mesh, chunks)}
    alone = new_group([0])  # every rank takes part in making it
    one = resume(DeviceMesh.from_group(alone, "cpu"), (0, 1, 2)) if rank == 0 else {}
    return {"two": two, "one": one}


def _nft_grads(rank: int, mesh):
    from digenrl.tasks.resident import resident
    from digenrl.tasks.sharding import ShardedTrainer, sharded_policy

    ctx = context("diffusion_nft", 2)
    out0 = train.init_state(ctx.train)
    sampling = train.publish(out0)
    prompts, final, adv = nft_inputs(ctx, sampling, NFT_CHUNKS[rank][0])
    copy = resident(ctx.train.model, ctx.train.seed, ctx.train.trainable).policy(sampling)
    trainer = ShardedTrainer(ctx.train, sharded_policy(ctx.train, mesh))
    j = ctx.train.algorithm.micro_steps(0)[0]
    trainer.matching_grad(copy, None, None, prompts, 0, j, final, adv, last=True)
    return _full_grads(trainer.module)


def main(rank: int, world: int, port: int, out: str, mode: str | None = None,
         store: str | None = None) -> None:
    """``mode`` None: the training; ``checkpoint``: the checkpoint's steps in ``store``;
    ``both``: the one and then the other."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,))
        got: dict = {}
        if mode != "checkpoint":
            got["flow"] = [_flow_run(rank, mesh) for _ in range(2)]
            got["nft"] = _nft_grads(rank, mesh)
            got["bf16"] = _flow_run(rank, mesh, "bfloat16", steps=1)
        if mode is not None:
            assert store is not None and mode in ("checkpoint", "both"), (mode, store)
            got.update(_checkpoint_run(rank, mesh, store))
        if rank == 0:
            torch.save(got, out)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4],
         *sys.argv[5:7])
