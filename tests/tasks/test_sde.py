"""The SDE step against the formulas of docs/algorithm.md, computed independently."""

import math

import numpy as np
import pytest
import torch

from digenrl.tasks.sde import euler_step, noise_scale, sde_step


def reference_step(x, v, sigma, sigma_next, a, eps):
    """docs/algorithm.md's step in float64 numpy, written out term by term."""
    x, v, eps = (np.asarray(t, np.float64) for t in (x, v, eps))
    dt = sigma_next - sigma
    denom_sigma = sigma_next if sigma == 1.0 else sigma
    s = a * math.sqrt(sigma / (1.0 - denom_sigma))
    mean = x + v * dt + (s ** 2 / (2 * sigma)) * (x + (1 - sigma) * v) * dt
    std = s * math.sqrt(-dt)
    nxt = mean + std * eps
    lp = -((nxt - mean) ** 2) / (2 * std ** 2) - math.log(std) - 0.5 * math.log(2 * math.pi)
    return nxt, lp.reshape(len(x), -1).mean(axis=1), mean, std


@pytest.mark.parametrize("sigma,sigma_next", [(1.0, 0.95), (0.8, 0.6), (0.3, 0.0089)])
def test_sde_step_matches_the_formulas(sigma, sigma_next):
    g = torch.Generator().manual_seed(0)
    x, v, eps = (torch.randn(3, 4, 8, 8, generator=g) for _ in range(3))
    step = sde_step(x, v, sigma, sigma_next, 0.7, noise=eps)
    nxt, lp, mean, std = reference_step(x, v, sigma, sigma_next, 0.7, eps)
    assert step.next_latent.dtype == torch.float32
    np.testing.assert_allclose(step.next_latent.numpy(), nxt, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(step.mean.numpy(), mean, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(step.log_prob.numpy(), lp, rtol=1e-4)
    assert step.std == pytest.approx(std)


def test_noise_scale_uses_the_next_sigma_at_one():
    assert noise_scale(1.0, 0.9, 0.7) == pytest.approx(0.7 * math.sqrt(1.0 / 0.1))
    assert noise_scale(0.5, 0.4, 0.7) == pytest.approx(0.7)


def test_log_prob_is_the_mean_gaussian_log_density():
    g = torch.Generator().manual_seed(1)
    x, v, eps = (torch.randn(2, 4, 8, 8, generator=g) for _ in range(3))
    step = sde_step(x, v, 0.7, 0.5, 0.9, noise=eps)
    dist = torch.distributions.Normal(step.mean, step.std)
    expected = dist.log_prob(step.next_latent).mean(dim=(1, 2, 3))
    torch.testing.assert_close(step.log_prob, expected, rtol=1e-5, atol=1e-5)


def test_scoring_a_given_latent_reproduces_its_log_prob_bit_for_bit():
    g = torch.Generator().manual_seed(2)
    x, v, eps = (torch.randn(2, 4, 8, 8, generator=g) for _ in range(3))
    sampled = sde_step(x, v, 0.6, 0.4, 0.7, noise=eps)
    scored = sde_step(x, v, 0.6, 0.4, 0.7, next_latent=sampled.next_latent)
    assert torch.equal(scored.log_prob, sampled.log_prob)


def test_gradients_flow_through_the_mean_only():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 4, 4, 4, generator=g)
    v = torch.randn(2, 4, 4, 4, generator=g, requires_grad=True)
    nxt = torch.randn(2, 4, 4, 4, generator=g, requires_grad=True)
    step = sde_step(x, v, 0.6, 0.4, 0.7, next_latent=nxt)
    step.log_prob.sum().backward()
    assert v.grad is not None and v.grad.abs().sum() > 0
    assert nxt.grad is None


def test_noise_level_zero_is_the_euler_step():
    g = torch.Generator().manual_seed(4)
    x, v = torch.randn(2, 4, 8, 8, generator=g), torch.randn(2, 4, 8, 8, generator=g)
    step = sde_step(x, v, 0.6, 0.4, 0.0)
    assert torch.equal(step.next_latent, euler_step(x, v, 0.6, 0.4))
    torch.testing.assert_close(step.next_latent, x + v * (0.4 - 0.6))
    assert step.log_prob is None


def test_bad_calls_are_rejected():
    x = torch.zeros(1, 4, 2, 2)
    with pytest.raises(ValueError, match="sigma_next"):
        sde_step(x, x, 0.4, 0.6, 0.7, noise=x)
    with pytest.raises(ValueError, match="exactly one"):
        sde_step(x, x, 0.6, 0.4, 0.7)
