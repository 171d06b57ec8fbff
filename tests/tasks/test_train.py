import numpy as np
import torch

from digenrl.config import TrainConfig
from digenrl.tasks.train import adamw_update, policy_loss, reduce
from digenrl.tasks.types import GradOut, MicroStats


def test_functional_adamw_matches_torch():
    tc = TrainConfig(learning_rate=1e-2, weight_decay=0.1, adam_beta1=0.8, adam_beta2=0.95)
    g = torch.Generator().manual_seed(0)
    p = torch.randn(5, 3, generator=g)
    ref = torch.nn.Parameter(p.clone())
    opt = torch.optim.AdamW([ref], lr=tc.learning_rate, betas=(tc.adam_beta1, tc.adam_beta2),
                            eps=tc.adam_eps, weight_decay=tc.weight_decay, foreach=False)
    params, m, v = {"w": p}, {"w": torch.zeros_like(p)}, {"w": torch.zeros_like(p)}
    for step in range(1, 4):
        grad = torch.randn(5, 3, generator=g)
        ref.grad = grad.clone()
        opt.step()
        params, m, v = adamw_update(params, m, v, {"w": grad}, step, tc)
    torch.testing.assert_close(params["w"], ref.detach(), rtol=1e-6, atol=1e-7)


def test_adamw_does_not_modify_its_inputs():
    tc = TrainConfig()
    p = {"w": torch.ones(3)}
    zeros = {"w": torch.zeros(3)}
    adamw_update(p, zeros, {"w": torch.zeros(3)}, {"w": torch.ones(3)}, 1, tc)
    assert torch.equal(p["w"], torch.ones(3)) and torch.equal(zeros["w"], torch.zeros(3))


def test_on_policy_samples_have_ratio_and_weight_exactly_one():
    logp = torch.tensor([-1.3, 0.2, 5.0], requires_grad=True)
    adv = torch.tensor([1.0, -2.0, 0.5])
    for correction in ("decoupled", "clip"):
        loss, ratio, weight, truncated = policy_loss(logp, logp.detach(), adv, 1e-4,
                                                     correction, 2.0)
        assert torch.equal(ratio, torch.ones(3)) and torch.equal(weight, torch.ones(3))
        torch.testing.assert_close(loss, -adv)
        (g,) = torch.autograd.grad(loss.sum(), logp)
        torch.testing.assert_close(g, -adv)  # REINFORCE with the group advantage


def test_decoupled_correction_weights_stale_samples_and_truncates():
    logp = torch.tensor([0.0, 0.0, 0.0], requires_grad=True)
    behaviour = torch.tensor([0.5, -0.5, -3.0])  # the last is far less likely then
    adv = torch.ones(3)
    loss, ratio, weight, truncated = policy_loss(logp, behaviour, adv, 1e-4, "decoupled", 2.0)
    torch.testing.assert_close(weight, torch.tensor([np.exp(-0.5), np.exp(0.5), 2.0],
                                                    dtype=torch.float32))
    assert truncated.tolist() == [False, False, True]
    (g,) = torch.autograd.grad(loss.sum(), logp)
    torch.testing.assert_close(g, -weight)


def test_flow_grpo_clip_stops_the_gradient_outside_the_range():
    logp = torch.tensor([0.1, -0.1], requires_grad=True)
    loss, ratio, _, _ = policy_loss(logp, torch.zeros(2), torch.tensor([1.0, -1.0]), 1e-4,
                                    "clip", 2.0)
    (g,) = torch.autograd.grad(loss.sum(), logp)
    assert torch.equal(g, torch.zeros(2))  # both moved past the clip in their direction


def test_reduce_sums_in_the_given_order():
    parts = [GradOut({"w": torch.tensor([v])}, MicroStats(count=1, loss_sum=v, ratio_dev=v))
             for v in (1e8, 1.0, -1e8)]
    out = reduce(*parts)
    # float32: (1e8 + 1) - 1e8 == 0 while (1e8 - 1e8) + 1 == 1: the order is the graph's.
    assert out.grads["w"].item() == (torch.tensor([1e8]) + 1.0 - 1e8).item()
    assert out.stats.count == 3 and out.stats.ratio_dev == 1e8
    assert torch.equal(parts[0].grads["w"], torch.tensor([1e8]))  # inputs untouched


def test_a_sum_added_one_part_at_a_time_is_the_same_bits():
    """The graph sums a tree node's parts as a chain of reductions, each adding one part
    to the sum so far: the bits (and statistics) of one reduction over all the parts."""
    g = torch.Generator().manual_seed(0)
    parts = [GradOut({"a": torch.randn(1000, generator=g) * 10.0 ** (k % 5),
                      "b": torch.randn(7, 3, generator=g)},
                     MicroStats(count=k, loss_sum=float(k) / 3, ratio_dev=float(k % 3)))
             for k in range(8)]
    whole = reduce(*parts)
    chained = reduce(parts[0], parts[1])
    for p in parts[2:]:
        chained = reduce(chained, p)
    assert all(torch.equal(whole.grads[n], chained.grads[n]) for n in whole.grads)
    assert whole.stats == chained.stats
    assert not torch.equal(whole.grads["a"], reduce(*parts[::-1]).grads["a"])  # order shows
    assert torch.equal(reduce(parts[3]).grads["b"], parts[3].grads["b"])
    assert reduce(parts[3]).grads["b"] is not parts[3].grads["b"]
