"""The inputs of the sharded-training tests, and one rank of them: run as
``python sharded_ranks.py RANK WORLD PORT OUT`` (gloo on 127.0.0.1), each rank trains its
chunks sharded (:mod:`digenrl.tasks.sharding`) and rank 0 saves what it gathered to OUT.

Flow-GRPO: three chunks over two ranks (rank 0 trains chunks 0 and 2, rank 1 chunk 1 and
then adds zero through chunk 1 again), three optimizer steps on the same chunks, twice
from version 0. DiffusionNFT: two chunks, one per rank, the first iteration's gradient.
"""

from __future__ import annotations

import os
import sys

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


def context(algorithm: str, prompts: int, dtype: str = "float32"):
    sampler = {"num_steps": 2} if algorithm != "flow_grpo" else {"num_steps": 4}
    return GraphContext.from_config(config_from_dict({
        "model": {**MODEL, "dtype": dtype}, "sampler": sampler, "algorithm": {"name": algorithm},
        "rollout": {"chunk_size": 2},
        "data": {"prompts_per_iteration": prompts, "samples_per_prompt": 2}}))


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


def _flow_run(rank: int, mesh, dtype: str = "float32", steps: int = STEPS):
    from digenrl.tasks.sharding import ShardedTrainer, sharded_policy

    ctx = context("flow_grpo", 3, dtype)
    w0 = train.publish(train.init_state(ctx.train))
    inputs = {c: flow_inputs(ctx, w0, c) for c in {0, 1, 2}}
    trainer = ShardedTrainer(ctx.train, sharded_policy(ctx.train, mesh))
    first, stats = None, []
    for i in range(steps):
        chunks = FLOW_CHUNKS[rank]
        for k, c in enumerate(chunks):
            prompts, t, before, after, adv = inputs[c if c is not None else chunks[0]]
            trainer.grad(None, prompts, t, before, after, adv, last=k == len(chunks) - 1,
                         contributes=c is not None)
        if i == 0:
            first = _full_grads(trainer.module)
        stats.append(trainer.optimize(i))
    return first, stats, trainer.full_weights()


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


def main(rank: int, world: int, port: int, out: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,))
        runs = [_flow_run(rank, mesh) for _ in range(2)]
        nft = _nft_grads(rank, mesh)
        bf16 = _flow_run(rank, mesh, "bfloat16", steps=1)
        if rank == 0:
            torch.save({"flow": runs, "nft": nft, "bf16": bf16}, out)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
