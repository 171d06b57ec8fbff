"""Sharded training (FSDP2 over two gloo processes) against the unsharded micro-steps,
reduction and optimizer step of one process: the same gradient, the same weights after
three optimizer steps, the same bits run twice; and ``train.sharding``'s checks."""

from __future__ import annotations

import pytest
import torch

from digenrl.config import ConfigError, config_from_dict
from digenrl.models.base import diffusers_class
from digenrl.models.registry import FAMILIES
from digenrl.models.tiny import TinyFamily
from digenrl.tasks import train

import sharded_ranks as sr

#: How long the ranks of both files' launch may take.
TIMEOUT_S = 480


def unsharded():
    """One process training every chunk: Flow-GRPO's first summed gradient, the weights
    before and after the optimizer steps and the iterations' statistics; DiffusionNFT's
    first summed gradient."""
    ctx = sr.context("flow_grpo", 3)
    out = train.init_state(ctx.train)
    w0 = train.publish(out)
    inputs = {c: sr.flow_inputs(ctx, w0, c) for c in (0, 1, 2)}
    first = None
    stats = []
    for i in range(sr.STEPS):
        weights = train.publish(out)
        total = train.reduce(*(train.grad(ctx.train, weights, None, *inputs[c])
                               for c in (0, 1, 2)))
        if i == 0:
            first = total
        out = train.optimize(ctx.train, out, total, i)
        stats.append(out.stats)
    ctx = sr.context("diffusion_nft", 2)
    nft0 = train.init_state(ctx.train)
    sampling, weights = train.publish(nft0), train.trained(nft0)
    j = ctx.train.algorithm.micro_steps(0)[0]
    nft = train.reduce(*(
        train.matching_grad(ctx.train, weights, sampling, None, None, prompts, 0, j, final, adv)
        for prompts, final, adv in (sr.nft_inputs(ctx, sampling, c) for c in (0, 1))))
    ctx = sr.context("flow_grpo", 3, "bfloat16")
    b0 = train.publish(train.init_state(ctx.train))
    bf16 = train.reduce(*(train.grad(ctx.train, b0, None, *sr.flow_inputs(ctx, b0, c))
                          for c in (0, 1, 2)))
    return {"first": first.grads, "before": w0.tensors, "after": out.state.params,
            "stats": stats, "nft": nft.grads, "bf16": bf16.grads}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """(what rank 0 of the sharded ranks gathered, the unsharded results): the ranks
    (launched once for this file and tests/test_sharded_checkpoints.py) run while this
    process computes the unsharded ones."""
    launch = sr.shared_launch(tmp_path_factory, TIMEOUT_S)
    try:
        want = unsharded()
    finally:
        got = launch.result()
    return got, want


def relative(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    """The norm of the difference over the norm of ``want``, over every tensor."""
    assert set(got) == set(want)
    diff = sum(float((got[n] - want[n]).double().pow(2).sum()) for n in want)
    norm = sum(float(want[n].double().pow(2).sum()) for n in want)
    return (diff / norm) ** 0.5


def test_sharded_gradients_are_the_unsharded_sum(runs):
    got, want = runs
    first, _, _ = got["flow"][0]
    # Flow-GRPO: chunks 0 and 2 on rank 0, chunk 1 and a zero contribution on rank 1.
    assert relative(first, want["first"]) < 1e-5
    # DiffusionNFT: a chunk each, against the sampling copy's velocities.
    assert relative(got["nft"], want["nft"]) < 1e-5
    assert sum(float(t.abs().sum()) for t in want["first"].values()) > 0


def test_sharded_bfloat16_computes_as_the_unsharded_module(runs):
    """bfloat16: the gathered weights and the buffers in bfloat16 as the unsharded module
    holds them, so the trainer scores the rollout's step with the same bits (the
    on-policy ratio is exactly 1); the gradients differ by bfloat16's rounding of the
    gradients reduced (within 1e-2)."""
    got, want = runs
    first, stats, _ = got["bf16"]
    assert stats[0].micro.ratio_dev == 0.0 and stats[0].micro.ratio_dev_count == 6
    assert relative(first, want["bf16"]) < 1e-2


def test_sharded_steps_move_the_weights_as_unsharded_ones(runs):
    got, want = runs
    _, stats, full = got["flow"][0]
    before = want["before"]
    change = {n: full[n] - before[n] for n in before}
    want_change = {n: want["after"][n] - before[n] for n in before}
    assert relative(change, want_change) < 1e-3
    for s, w in zip(stats, want["stats"]):
        assert (s.version, s.micro.count, s.micro.staleness_sum, s.weight_bytes) == \
            (w.version, w.micro.count, w.micro.staleness_sum, w.weight_bytes)
        assert s.micro.loss_sum == pytest.approx(w.micro.loss_sum, rel=1e-5)
        assert s.grad_norm == pytest.approx(w.grad_norm, rel=1e-5)


def test_the_same_sharded_run_twice_is_the_same_bits(runs):
    got, _ = runs
    (g1, _, w1), (g2, _, w2) = got["flow"]
    assert all(torch.equal(g1[n], g2[n]) for n in g1)
    assert all(torch.equal(w1[n], w2[n]) for n in w1)


@pytest.mark.parametrize("fam", sorted({*FAMILIES.values(), TinyFamily}, key=str),
                         ids=lambda f: f.__name__)
def test_each_familys_blocks_are_its_transformers_block_lists(fam):
    """What a sharded trainer gathers one at a time: every list of blocks the transformer
    has (its class at its default size, built without weights), and nothing else."""
    with torch.device("meta"):
        module = diffusers_class(fam.transformer_class_name)()
    lists = [n for n, c in module.named_children() if isinstance(c, torch.nn.ModuleList)]
    assert tuple(lists) == fam.block_lists
    assert all(len(getattr(module, n)) > 0 for n in lists)


@pytest.mark.parametrize("changes,message", [
    ({"train": {"sharding": "zero"}},
     "train.sharding: expected one of ['fsdp', 'none'], got 'zero'"),
    ({"train": {"sharding": "fsdp"}},
     "train.sharding: expected at least 2 trainer workers for fsdp (cluster.trainer_workers), "
     "got 1"),
    ({"train": {"sharding": "fsdp"}, "schedule": {"mode": "colocated"},
      "cluster": {"trainer_workers": 1, "rollout_workers": 1}}, None),
    ({"train": {"sharding": "fsdp", "lora_rank": 4}, "cluster": {"trainer_workers": 2}},
     "train.lora_rank: expected 0 with train.sharding fsdp (it shards every weight; LoRA "
     "adapters train unsharded), got 4"),
])
def test_bad_sharding_fails_naming_the_field(changes, message):
    """One line naming the field, before any work; a colocated pool of a rollout and a
    trainer worker is a gang of two (every worker trains)."""
    if message is None:
        assert config_from_dict(changes).train.sharding == "fsdp"
        return
    with pytest.raises(ConfigError) as e:
        config_from_dict(changes)
    assert str(e.value) == message
