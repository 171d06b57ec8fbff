"""LoRA adapters and precision, in process: what version 0 holds, what trains, what
workers share, and the first micro-step's ratio in bfloat16."""

import numpy as np
import pytest
import torch

from digenrl.config import ConfigError, config_from_dict
from digenrl.graph.build import GraphContext
from digenrl.models import build_transformer, predict_velocity
from digenrl.run.world import check_world
from digenrl.tasks import rollout, train
from digenrl.tasks.resident import resident
from digenrl.tasks.types import AdvantageOut

PROMPTS = ("a cat",) * 4
IDS = (0, 1, 2, 3)
#: A small built-in model: the tests build it several times.
SMALL_MODEL = {"transformer_layers": 2, "image_size": 32}


def context(**train_overrides):
    model = {**SMALL_MODEL, **train_overrides.pop("model", {})}
    return GraphContext.from_config(config_from_dict({
        "model": model, "train": train_overrides,
        "data": {"prompts_per_iteration": 1, "samples_per_prompt": 4}}))


def first_step(ctx, weights):
    lat = rollout.encoded_noise(ctx.rollout, 0, IDS, PROMPTS)
    return lat, rollout.denoise(ctx.rollout, weights, PROMPTS, 0, 0, lat)


def test_version_0_holds_only_seeded_adapters_that_change_nothing():
    ctx = context(lora_rank=4)
    state = train.init_state(ctx.train).state
    names = list(state.params)
    assert names and all(".lora_A." in n or ".lora_B." in n for n in names), names[:4]
    assert all(state.params[n].dtype == torch.float32 for n in names)
    # peft's init: A random (kaiming), B zero; A drawn from the model seed.
    assert all(not state.params[n].any() for n in names if ".lora_B." in n)
    a = [n for n in names if ".lora_A." in n]
    assert all(state.params[n].abs().sum() > 0 for n in a)
    again = train.init_state(ctx.train).state.params
    assert all(torch.equal(state.params[n], again[n]) for n in names)
    other = GraphContext.from_config(config_from_dict({
        "seed": 1, "model": SMALL_MODEL, "train": {"lora_rank": 4},
        "data": {"prompts_per_iteration": 1, "samples_per_prompt": 4}}))
    assert not torch.equal(train.init_state(other.train).state.params[a[0]],
                           state.params[a[0]])
    # Every targeted projection of every block has an adapter.
    targets = ctx.train.trainable.lora_targets
    for t in ("to_q", "to_out.0", "add_q_proj"):
        assert t in targets
        assert sum(f".{t}.lora_A." in n for n in names) == SMALL_MODEL["transformer_layers"]

    # Version 0 computes what the base model computes, bit for bit.
    models = resident(ctx.train.model, ctx.train.seed, ctx.train.trainable)
    policy = models.policy(train.publish(train.init_state(ctx.train)))
    base = build_transformer(ctx.train.model, ctx.train.seed)
    lat = rollout.encoded_noise(ctx.rollout, 0, IDS, PROMPTS)
    with torch.no_grad():
        v = predict_velocity(ctx.train.model, policy, lat.x, 0.7, lat.cond)
        v0 = predict_velocity(ctx.train.model, base, lat.x, 0.7, lat.cond)
    assert torch.equal(v, v0)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_only_adapters_train_and_versions_share_the_base_weights(dtype):
    ctx = context(lora_rank=4, gradient_checkpointing=dtype == "bfloat16",
                  model={"dtype": dtype})
    out0 = train.init_state(ctx.train)
    w0 = train.publish(out0)
    lat, step = first_step(ctx, w0)
    adv = AdvantageOut(0, IDS, np.array([1.0, -1.0, 0.5, -0.5], np.float32), np.ones(4, bool))
    g = train.grad(ctx.train, w0, None, PROMPTS, 0, lat, step, adv)
    assert set(g.grads) == set(w0.tensors)
    assert all(t.dtype == torch.float32 for t in g.grads.values())
    # B is zero, so only B has a gradient at version 0.
    assert any(g.grads[n].abs().sum() > 0 for n in g.grads if ".lora_B." in n)
    # Rollout and trainer compute the first micro-step alike: the ratio is 1 exactly.
    assert g.stats.ratio_dev == 0.0 and g.stats.ratio_dev_count == 4
    out1 = train.optimize(ctx.train, out0, g, 0)
    w1 = train.publish(out1)
    assert set(w1.tensors) == set(w0.tensors)
    assert out1.stats.weight_bytes == w1.nbytes == 4 * sum(t.numel() for t in w1.tensors.values())
    _, step1 = first_step(ctx, w1)
    assert not torch.equal(step1.latent, step.latent)  # the adapters changed the policy

    models = resident(ctx.train.model, ctx.train.seed, ctx.train.trainable)
    m0, m1 = models.policy(w0), models.policy(w1)
    frozen0 = {n: p for n, p in m0.named_parameters() if not p.requires_grad}
    frozen1 = {n: p for n, p in m1.named_parameters() if not p.requires_grad}
    assert frozen0 and frozen0.keys() == frozen1.keys()
    assert all(frozen0[n] is frozen1[n] for n in frozen0)  # loaded once, shared
    want = torch.bfloat16 if dtype == "bfloat16" else torch.float32
    assert {p.dtype for p in frozen0.values()} == {want}
    assert {p.dtype for n, p in m1.named_parameters() if p.requires_grad} == {torch.float32}


def lora_b_gradients(dtype: str, **train_overrides) -> torch.Tensor:
    """The LoRA B gradients of the first micro-step at version 0 (B is zero there, so
    only B has a gradient), in ``dtype``."""
    ctx = context(lora_rank=4, model={"dtype": dtype}, **train_overrides)
    w0 = train.publish(train.init_state(ctx.train))
    lat, step = first_step(ctx, w0)
    adv = AdvantageOut(0, IDS, np.array([1.0, -1.0, 0.5, -0.5], np.float32), np.ones(4, bool))
    g = train.grad(ctx.train, w0, None, PROMPTS, 0, lat, step, adv)
    assert g.stats.ratio_dev == 0.0
    return torch.cat([g.grads[n].flatten() for n in sorted(g.grads) if ".lora_B." in n])


def test_float16_gradients_are_loss_scaled_and_match_float32():
    want = lora_b_gradients("float32")
    # Through gradient checkpointing too: the scaled backward may run twice on one graph.
    got = lora_b_gradients("float16", gradient_checkpointing=True)
    assert torch.isfinite(got).all()
    # Unscaled, half of these underflow to zero in float16's backward pass.
    assert (got == 0).sum() == (want == 0).sum()
    assert float((got - want).norm() / want.norm()) < 0.01


@pytest.mark.parametrize("changes,message", [
    ({"train": {"lora_rank": -1}}, "train.lora_rank: expected an integer >= 0, got -1"),
    ({"train": {"lora_rank": 4, "lora_targets": ["to_q", "nope"]}},
     "train.lora_targets: expected names of modules the transformer has"),
    ({"train": {"lora_rank": 4, "lora_targets": ["attn"]}},
     "train.lora_targets: expected linear or convolution layers, got 'attn'"),
    ({"train": {"lora_rank": 4, "lora_alpha": 0}}, "train.lora_alpha"),
    ({"model": {"dtype": "float64"}}, "model.dtype: expected one of"),
])
def test_bad_values_fail_naming_the_field(changes, message):
    with pytest.raises(ConfigError) as e:
        check_world(config_from_dict(changes))
    assert message in str(e.value), str(e.value)


def test_export_help_says_how_to_load_the_result(capsys):
    from digenrl.commands.cli import main

    with pytest.raises(SystemExit) as e:
        main(["export", "--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    assert "pipe.load_lora_weights(DIR)" in text and 'subfolder="transformer"' in text
