"""One rank of the context-parallel tests: run as ``python context_parallel_ranks.py RANK
WORLD PORT OUT CASES`` (gloo on 127.0.0.1; CASES: a JSON file of ``{name: {"config": a
config as a dict, "sources": each prompt's source image or []}}``). For each case, every
rank computes one denoise step of a chunk of two samples at degree 1
(:func:`digenrl.tasks.rollout.denoise`, alone) and at degree WORLD
(:func:`digenrl.tasks.context_parallel.denoise`, all ranks together), then alone again,
and saves the three, with the tokens its transformer's last projection saw, to
``OUT.RANK``.
"""

from __future__ import annotations

import json
import os
import sys

import torch

from digenrl.config import config_from_dict
from digenrl.graph.build import GraphContext
from digenrl.prompts import PromptInputs, SourceFile
from digenrl.tasks import context_parallel, rollout, train
from digenrl.tasks.collective import Group
from digenrl.tasks.resident import resident
from digenrl.tasks.types import StepOut

#: The chunk: two samples of prompts of different lengths (a language model's encoding
#: is as long as its prompt: the text splits unevenly).
SAMPLE_IDS = (0, 1)
PROMPTS = ("a red cat", "a small green dog on a hill")
#: The step computed (an SDE step, with its log-prob).
STEP = 1


def step_of(case: dict, over: Group | None) -> tuple[StepOut, int]:
    """The chunk's step ``STEP`` (from the degree-1 step before it), computed alone
    (``over`` None) or by the group, and the tokens the transformer's last projection
    saw in this process at its first call (the plan gathers them after it). ``case``:
    the config as a dict and each prompt's source image (``[path, sha256]``), if any."""
    ctx = GraphContext.from_config(config_from_dict(case["config"]))
    spec = ctx.rollout
    weights = train.publish(train.init_state(ctx.train))
    if case["sources"]:   # each prompt a group of its own, with its source image
        groups = [rollout.encode(spec, p, PromptInputs((SourceFile(*source),)))
                  for p, source in zip(PROMPTS, case["sources"])]
        x = rollout.noise(spec, 0, SAMPLE_IDS, PROMPTS, tuple(range(len(PROMPTS))), *groups)
    else:
        x = rollout.encoded_noise(spec, 0, SAMPLE_IDS, PROMPTS)
    before = rollout.denoise(spec, weights, PROMPTS, 0, STEP - 1, x)
    seen: list[int] = []
    module = resident(spec.model, spec.model_seed, spec.trainable).policy(weights)
    hook = module.proj_out.register_forward_pre_hook(lambda m, a: seen.append(a[0].shape[1]))
    try:
        if over is None:
            out = rollout.denoise(spec, weights, PROMPTS, 0, STEP, before)
        else:
            out = context_parallel.denoise(spec, weights, PROMPTS, 0, STEP, before, over)
    finally:
        hook.remove()
    return out, seen[0]


def main(rank: int, world: int, port: int, out: str, path: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    with open(path) as f:
        cases = json.load(f)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        # The group as collective.join leaves it in a worker: the default process group.
        group = Group("rollout", 0, tuple(f"rank-{r}" for r in range(world)), rank, "gloo",
                      60.0, f"ranks-{port}", f"127.0.0.1:{port}", dist.group.WORLD)
        got = {}
        for name, case in cases.items():
            (alone, all_tokens), (together, tokens) = step_of(case, None), step_of(case, group)
            after, _ = step_of(case, None)     # (the resident module as it was before)
            got[name] = {"alone": alone, "together": together, "after": after,
                         "tokens": all_tokens, "own_tokens": tokens}
        torch.save(got, f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5])
