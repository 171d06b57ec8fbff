"""Each algorithm's formula against an independent float64 re-derivation from its paper's
equations (docs/algorithm.md), written out here term by term."""

import math

import numpy as np
import pytest
import torch

from digenrl.config import AlgorithmConfig
from digenrl.tasks.algorithms.awm import matching_log_prob
from digenrl.tasks.algorithms.common import Draws, noised, policy_loss
from digenrl.tasks.algorithms.diffusion_nft import nft_loss, optimality
from digenrl.tasks.algorithms.dpo import dpo_loss, pairs
from digenrl.tasks.algorithms.flow_grpo import guard_log_ratio
from digenrl.tasks.sde import sde_step
from digenrl.tasks.train import sampling_copy_update
from digenrl.tasks.types import AdvantageOut


def f64(*tensors):
    return tuple(np.asarray(t.detach(), np.float64) for t in tensors)


def rows(a):
    """The mean over every dimension but the first, float64."""
    return a.reshape(len(a), -1).mean(axis=1)


def tensors(n, seed=0, shape=(3, 4, 8, 8)):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(shape, generator=g) for _ in range(n))


# --------------------------------------------------------------- sampling dynamics


@pytest.mark.parametrize("sigma,sigma_next", [(0.9, 0.7), (0.4, 0.25)])
def test_dance_dynamics_has_a_constant_noise_scale(sigma, sigma_next):
    """DanceGRPO (arXiv 2505.07818): the flow SDE with s_t = a at every step."""
    x, v, eps = tensors(3)
    a = 0.7
    step = sde_step(x, v, sigma, sigma_next, a, noise=eps, dynamics="dance")
    x_, v_, e_ = f64(x, v, eps)
    dt = sigma_next - sigma
    mean = x_ + v_ * dt + (a * a / (2 * sigma)) * (x_ + (1 - sigma) * v_) * dt
    std = a * math.sqrt(-dt)
    nxt = mean + std * e_
    lp = -((nxt - mean) ** 2) / (2 * std ** 2) - math.log(std) - 0.5 * math.log(2 * math.pi)
    np.testing.assert_allclose(step.mean.numpy(), mean, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(step.next_latent.numpy(), nxt, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(step.log_prob.numpy(), rows(lp), rtol=1e-4)
    assert step.std == pytest.approx(std)


@pytest.mark.parametrize("sigma,sigma_next", [(1.0, 0.9), (0.6, 0.45), (0.2, 0.05)])
def test_cps_dynamics_preserves_the_coefficients(sigma, sigma_next):
    """FlowCPS (arXiv 2509.05952): x_next = (1 - s') x0_hat + sqrt(s'^2 - std^2) eps_hat +
    std eps with std = s' sin(a pi / 2), x0_hat = x - s v, eps_hat = x + (1 - s) v; the
    log-probability is -mean((x_next - mean)^2). The noise coefficients' squares add up to
    s'^2: the next latent sits at its noise level's marginal."""
    x, v, eps = tensors(3, seed=1)
    a = 0.7
    step = sde_step(x, v, sigma, sigma_next, a, noise=eps, dynamics="cps")
    x_, v_, e_ = f64(x, v, eps)
    std = sigma_next * math.sin(a * math.pi / 2)
    x0_hat, eps_hat = x_ - sigma * v_, x_ + (1 - sigma) * v_
    keep = math.sqrt(sigma_next ** 2 - std ** 2)
    assert keep ** 2 + std ** 2 == pytest.approx(sigma_next ** 2)
    mean = (1 - sigma_next) * x0_hat + keep * eps_hat
    nxt = mean + std * e_
    np.testing.assert_allclose(step.mean.numpy(), mean, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(step.next_latent.numpy(), nxt, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(step.log_prob.numpy(), rows(-(nxt - mean) ** 2), rtol=1e-4,
                               atol=1e-7)
    assert step.std == pytest.approx(std)
    # Scoring the sampled latent gives the recorded log-probability bit for bit.
    again = sde_step(x, v, sigma, sigma_next, a, next_latent=step.next_latent, dynamics="cps")
    assert torch.equal(again.log_prob, step.log_prob)


def test_a_cps_step_to_noise_level_zero_and_an_ode_step_are_the_euler_step():
    x, v = tensors(2, seed=2)
    for dynamics, nxt in (("cps", 0.0), ("ode", 0.3)):
        step = sde_step(x, v, 0.5, nxt, 0.7, dynamics=dynamics)
        assert step.log_prob is None
        np.testing.assert_allclose(step.next_latent.numpy(),
                                   f64(x)[0] + f64(v)[0] * (nxt - 0.5), rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------- GRPO-Guard


def test_guard_ratio_is_centred_and_scaled_by_the_step_std():
    """GRPO-Guard (arXiv 2510.22319, RatioNorm): log r = (log p - log p_old +
    ||mu - mu_old||^2 / (2 std^2)) * std, per-sample means over the latent."""
    x, v, v_old, eps = tensors(4, seed=3)
    v = v_old + 0.01 * v
    sigma, sigma_next, a = 0.7, 0.5, 0.7
    old = sde_step(x, v_old, sigma, sigma_next, a, noise=eps)
    new = sde_step(x, v, sigma, sigma_next, a, next_latent=old.next_latent)
    got = guard_log_ratio(new.log_prob, old.log_prob, new.mean, old.mean, new.precision,
                          new.std)
    lp, lp_old, mu, mu_old = f64(new.log_prob, old.log_prob, new.mean, old.mean)
    std = new.std
    expected = (lp - lp_old + rows((mu - mu_old) ** 2) / (2 * std ** 2)) * std
    np.testing.assert_allclose(got.numpy(), expected, rtol=1e-4, atol=1e-7)
    # Centred: the shift is what the plain log-ratio loses on average: its value is
    # (eps . (mu - mu_old)) / std * std, a mean-zero function of the noise.
    e_ = f64(eps)[0]
    np.testing.assert_allclose(got.numpy(), rows(e_ * (mu - mu_old)), rtol=1e-3, atol=1e-6)


# --------------------------------------------------------------- DiffusionNFT


def test_nft_loss_is_the_papers_implicit_policy_loss():
    """DiffusionNFT (arXiv 2509.16117): r = 1/2 + 1/2 clip(A / A_max, -1, 1);
    v+ = (1 - b) v_old + b v, v- = (1 + b) v_old - b v; the clean-sample predictions
    x0+- = x_t - t v+- regress x0, each squared error divided by its own (constant) mean
    absolute error; loss = (r L+ + (1 - r) L-) / b."""
    x0, noise, v, v_old = tensors(4, seed=4)
    sigma = torch.tensor([0.2, 0.5, 0.9], dtype=torch.float64)
    adv = torch.tensor([2.0, -0.3, -9.0])
    beta, adv_max = 0.7, 5.0
    x_t = noised(x0, Draws(sigma, noise))
    r = optimality(adv, adv_max)
    got = nft_loss(x_t, sigma, x0, v, v_old, r, beta)

    x0_, n_, v_, vo_ = f64(x0, noise, v, v_old)
    t = sigma.numpy().reshape(-1, 1, 1, 1)
    xt_ = (1 - t) * x0_ + t * n_
    np.testing.assert_allclose(x_t.numpy(), xt_, rtol=1e-5, atol=1e-6)
    r_ = 0.5 + 0.5 * np.clip(adv.numpy().astype(np.float64) / adv_max, -1, 1)
    np.testing.assert_allclose(r.numpy(), r_, rtol=1e-6)
    assert r_[2] == 0.0 and 0 < r_[1] < 0.5 < r_[0] < 1

    def part(vel):
        err = (xt_ - t * vel) - x0_
        return rows(err ** 2) / np.maximum(rows(np.abs(err)), 1e-5)

    pos = part((1 - beta) * vo_ + beta * v_)
    neg = part((1 + beta) * vo_ - beta * v_)
    np.testing.assert_allclose(got.detach().numpy(), (r_ * pos + (1 - r_) * neg) / beta,
                               rtol=1e-4)


def test_nft_gradient_points_positive_samples_at_the_target_and_away_otherwise():
    """At v = v_old the gradient of r L+ + (1 - r) L- in v is (2r - 1) times the plain
    flow-matching gradient: a sample with r = 1 is regressed to its clean latent, one
    with r = 0 pushed away from it, one with r = 1/2 not moved."""
    x0, noise, v_old = tensors(3, seed=5)
    sigma = torch.full((3,), 0.5, dtype=torch.float64)
    x_t = noised(x0, Draws(sigma, noise))
    v = v_old.clone().requires_grad_(True)
    r = torch.tensor([1.0, 0.0, 0.5])
    nft_loss(x_t, sigma, x0, v, v_old, r, 1.0).sum().backward()
    xt_, x0_, vo_ = f64(x_t, x0, v_old)
    err = xt_ - 0.5 * vo_ - x0_
    scale = rows(np.abs(err)).reshape(-1, 1, 1, 1)
    n = err[0].size
    plain = 2 * err * (-0.5) / (n * scale)   # d/dv of mean(err^2) / scale
    g = v.grad.numpy()
    np.testing.assert_allclose(g[0], plain[0], rtol=1e-3, atol=1e-8)
    np.testing.assert_allclose(g[1], -plain[1], rtol=1e-3, atol=1e-8)
    np.testing.assert_allclose(g[2], 0.0, atol=1e-8)


def test_a_stale_chunks_implicit_policies_centre_on_its_copy_and_offset_from_the_trainers():
    """A chunk an older copy sampled (velocity v_old): v+- = v_old +- b (v - v_anchor),
    v_anchor the copy of the version trained. At v = v_anchor the gradient is (2r - 1)
    times the flow-matching gradient at v_old (a sample with r = 1/2 is not moved), where
    centring on the older copy alone (v+- around v_old) pulls every sample back to it."""
    x0, noise, v_old, v_anchor = tensors(4, seed=7)
    sigma = torch.tensor([0.3, 0.6, 0.8], dtype=torch.float64)
    x_t = noised(x0, Draws(sigma, noise))
    r = torch.tensor([1.0, 0.0, 0.5])
    beta = 0.7
    v = v_anchor.clone().requires_grad_(True)
    got = nft_loss(x_t, sigma, x0, v, v_old, r, beta, v_anchor)
    got.sum().backward()
    xt_, x0_, vo_ = f64(x_t, x0, v_old)
    t = sigma.numpy().reshape(-1, 1, 1, 1)
    err = xt_ - t * vo_ - x0_          # both implicit policies are v_old at v = v_anchor
    scale = rows(np.abs(err))
    np.testing.assert_allclose(got.detach().numpy(), rows(err ** 2) / scale / beta,
                               rtol=1e-4)
    plain = 2 * err * (-t) / (err[0].size * scale.reshape(-1, 1, 1, 1))
    g = v.grad.numpy()
    np.testing.assert_allclose(g[0], plain[0], rtol=1e-3, atol=1e-8)
    np.testing.assert_allclose(g[1], -plain[1], rtol=1e-3, atol=1e-8)
    np.testing.assert_allclose(g[2], 0.0, atol=1e-8)
    v.grad = None
    nft_loss(x_t, sigma, x0, v, v_old, r, beta).sum().backward()
    assert np.abs(v.grad.numpy()[2]).max() > 1e-4   # the older copy's pull
    # With the anchor the copy that sampled, it is the on-policy loss.
    w = torch.randn_like(v_old)
    np.testing.assert_allclose(nft_loss(x_t, sigma, x0, w, v_old, r, beta, v_old).numpy(),
                               nft_loss(x_t, sigma, x0, w, v_old, r, beta).numpy(),
                               rtol=1e-5)


def test_the_sampling_copy_moves_on_the_papers_schedule():
    """eta_i = min(ramp x i, max); copy <- eta_i copy + (1 - eta_i) new weights."""
    cfg = AlgorithmConfig(name="diffusion_nft", ema_ramp=0.1, ema_max=0.5)
    assert [cfg.sampling_copy_decay(i) for i in (0, 1, 3, 5, 9)] == \
        pytest.approx([0.0, 0.1, 0.3, 0.5, 0.5])
    copy, new = tensors(2, seed=6, shape=(5,))
    out = sampling_copy_update({"w": copy}, {"w": new}, 0.3)
    c_, n_ = f64(copy, new)
    np.testing.assert_allclose(out["w"].numpy(), 0.3 * c_ + 0.7 * n_, rtol=1e-6)


# --------------------------------------------------------------- AWM


def test_awm_on_policy_gradient_is_the_advantage_weighted_matching_gradient():
    """AWM (arXiv 2509.25050): on-policy, the policy loss of log p = -mean((v - u)^2) has
    the gradient of A mean((v - u)^2): the flow-matching loss weighted by the advantage."""
    v0, target = tensors(2, seed=7)
    adv = torch.tensor([1.5, -0.5, 0.0])
    v = v0.clone().requires_grad_(True)
    logp = matching_log_prob(v, target)
    loss, ratio, weight, _ = policy_loss(logp, logp.detach(), adv, 1e-4, "decoupled", 2.0)
    loss.sum().backward()
    v_, u_ = f64(v0, target)
    n = v_[0].size
    expected = adv.numpy().astype(np.float64).reshape(-1, 1, 1, 1) * 2 * (v_ - u_) / n
    np.testing.assert_allclose(v.grad.numpy(), expected, rtol=1e-4, atol=1e-9)
    np.testing.assert_allclose(logp.detach().numpy(), -rows((v_ - u_) ** 2), rtol=1e-5)
    assert torch.equal(ratio.detach(), torch.ones(3)) and torch.equal(weight, torch.ones(3))


# --------------------------------------------------------------- Diffusion-DPO


def test_dpo_loss_is_the_papers_preference_loss():
    """Diffusion-DPO (arXiv 2311.12908, eq. 14 with the flow-matching error):
    -log sigmoid(-beta/2 ((e_w - e_ref_w) - (e_l - e_ref_l)))."""
    g = torch.Generator().manual_seed(8)
    ew, rw, el, rl = (torch.rand(6, generator=g, dtype=torch.float64) for _ in range(4))
    beta = 50.0
    got = dpo_loss(ew, rw, el, rl, beta).numpy()
    z = -beta / 2 * ((ew - rw) - (el - rl)).numpy()
    np.testing.assert_allclose(got, -np.log(1 / (1 + np.exp(-z))), rtol=1e-9)


def test_dpo_pairs_each_groups_best_and_worst_valid_sample():
    parts = (AdvantageOut(group=0, sample_ids=(0, 1, 2, 3),
                          advantages=np.array([0.1, 1.2, -2.0, 3.0], np.float32),
                          valid=np.array([True, True, True, False])),
             AdvantageOut(group=1, sample_ids=(4, 5, 6, 7),
                          advantages=np.zeros(4, np.float32), valid=np.ones(4, bool)),
             AdvantageOut(group=2, sample_ids=(8, 9, 10, 11),
                          advantages=np.array([1, 0, 0, 0], np.float32),
                          valid=np.array([True, False, False, False])))
    assert pairs(parts) == [(0, 1, 2)]   # a tie and a lone valid sample give no pair
