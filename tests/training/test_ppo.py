"""The decoupled PPO loss against a plain per-token reference, including the edge cases."""

from __future__ import annotations

import math

import pytest
import torch

from asyncwebrl.training.ppo import PPOParams, PPOStats, loglinear_alpha, loglinear_prox, ppo_loss_sum


def reference_loss(logp, prox, behave, adv, mask, p: PPOParams, n_global):
    """SPEC section 6 written token by token with Python floats."""
    eps_hi = p.eps_clip if p.eps_clip_higher is None else p.eps_clip_higher
    total, clipped, clipped_coupled, capped = 0.0, 0, 0, 0
    for lt, lp, lb, a, m in zip(logp, prox, behave, adv, mask, strict=False):
        if not m:
            continue
        if p.use_decoupled_loss:
            r = math.exp(lt - lp)
            w = math.exp(lp - lb)
            if w > p.behave_imp_weight_cap:
                capped += 1
                w = 0.0 if p.behave_imp_weight_mode == "mask" else p.behave_imp_weight_cap
        else:
            r, w = math.exp(lt - lb), 1.0
            capped += math.exp(lp - lb) > p.behave_imp_weight_cap
        rc = min(max(r, 1 - p.eps_clip), 1 + eps_hi)
        clipped += (-a * rc) > (-a * r)
        rb = math.exp(lt - lb)
        rbc = min(max(rb, 1 - p.eps_clip), 1 + eps_hi)
        clipped_coupled += (-a * rbc) > (-a * rb)
        total += max(-a * r, -a * rc) * w
    return total / max(n_global, 1), clipped, clipped_coupled, capped


def random_case(n=64, seed=0, spread=0.5):
    g = torch.Generator().manual_seed(seed)
    behave = -torch.rand(n, generator=g, dtype=torch.float64) * 3
    prox = behave + torch.randn(n, generator=g, dtype=torch.float64) * spread
    logp = prox + torch.randn(n, generator=g, dtype=torch.float64) * spread
    adv = torch.randn(n, generator=g, dtype=torch.float64)
    mask = torch.rand(n, generator=g) > 0.2
    return logp, prox, behave, adv, mask


PARAMS = [
    PPOParams(),
    PPOParams(eps_clip=0.1, eps_clip_higher=0.28),
    PPOParams(behave_imp_weight_mode="clamp", behave_imp_weight_cap=1.5),
    PPOParams(behave_imp_weight_mode="mask", behave_imp_weight_cap=1.5),
    PPOParams(use_decoupled_loss=False),
]


@pytest.mark.parametrize("params", PARAMS, ids=lambda p: f"dec{int(p.use_decoupled_loss)}-{p.behave_imp_weight_mode}-{p.behave_imp_weight_cap}-{p.eps_clip_higher}")
@pytest.mark.parametrize("seed,spread", [(0, 0.05), (1, 0.5), (2, 3.0)])
def test_loss_and_clip_counts_match_reference(params, seed, spread):
    logp, prox, behave, adv, mask = random_case(seed=seed, spread=spread)
    n_global = int(mask.sum()) + 7  # other micro-batches hold 7 more tokens
    loss, st = ppo_loss_sum(logp.clone().requires_grad_(), prox, behave, adv, mask, params, n_global)
    ref, clipped, clipped_coupled, capped = reference_loss(
        logp.tolist(), prox.tolist(), behave.tolist(), adv.tolist(), mask.tolist(), params, n_global)
    assert loss.item() == pytest.approx(ref, rel=1e-9, abs=1e-12)
    assert st.n_clipped == clipped
    assert st.n_clipped_coupled == clipped_coupled
    assert st.n_capped == capped
    assert st.n_tokens == int(mask.sum())


def test_gradient_matches_reference_autograd():
    logp, prox, behave, adv, mask = random_case(seed=3, spread=0.4)
    p = PPOParams(eps_clip=0.2, eps_clip_higher=0.3, behave_imp_weight_cap=2.0)
    x = logp.clone().requires_grad_()
    loss, _ = ppo_loss_sum(x, prox, behave, adv, mask, p, int(mask.sum()))
    loss.backward()
    # reference gradient: d/dlogp of max(-A r, -A clip(r)) * w is -A r w where the unclipped branch
    # is the max (or both equal), 0 where the clipped branch is active, and 0 on masked/capped tokens
    r = torch.exp(logp - prox)
    w = torch.exp(prox - behave)
    w = torch.where(w > 2.0, torch.zeros_like(w), w)
    rc = r.clamp(0.8, 1.3)
    unclipped_active = (-adv * r) >= (-adv * rc)
    expect = torch.where(mask & unclipped_active, -adv * r * w, torch.zeros_like(r)) / int(mask.sum())
    assert torch.allclose(x.grad, expect, atol=1e-12)


def test_all_tokens_masked_gives_zero_loss_and_zero_gradient():
    logp, prox, behave, adv, _ = random_case(seed=4)
    x = logp.clone().requires_grad_()
    loss, st = ppo_loss_sum(x, prox, behave, adv, torch.zeros_like(adv, dtype=torch.bool), PPOParams(), 0)
    loss.backward()
    assert loss.item() == 0.0 and torch.isfinite(loss)
    assert torch.count_nonzero(x.grad) == 0
    assert st.n_tokens == 0 and st.finalize()["clip_rate"] == 0.0 and st.w_max == 0.0


def test_zero_advantages_give_zero_loss_and_no_clipping():
    logp, prox, behave, _, mask = random_case(seed=5, spread=2.0)
    x = logp.clone().requires_grad_()
    loss, st = ppo_loss_sum(x, prox, behave, torch.zeros_like(logp), mask, PPOParams(), int(mask.sum()))
    loss.backward()
    assert loss.item() == 0.0
    assert torch.count_nonzero(x.grad) == 0
    assert st.n_clipped == 0 and st.n_clipped_coupled == 0


def test_huge_and_tiny_ratios_stay_finite_and_are_clipped():
    n = 4
    behave = torch.zeros(n, dtype=torch.float64)
    prox = torch.zeros(n, dtype=torch.float64)
    logp = torch.tensor([60.0, -60.0, 60.0, -60.0], dtype=torch.float64)  # r = e^60 and e^-60
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0], dtype=torch.float64)
    x = logp.clone().requires_grad_()
    loss, st = ppo_loss_sum(x, prox, behave, adv, torch.ones(n, dtype=torch.bool), PPOParams(), n)
    loss.backward()
    ref, clipped, _, _ = reference_loss(logp.tolist(), prox.tolist(), behave.tolist(), adv.tolist(), [1] * n, PPOParams(), n)
    assert torch.isfinite(loss) and loss.item() == pytest.approx(ref)
    # A>0 with huge r and A<0 with tiny r are clipped (no gradient); the other two are not
    assert clipped == st.n_clipped == 2
    assert x.grad[0] == 0 and x.grad[3] == 0
    assert torch.isfinite(x.grad).all()


def test_capped_weights_mask_versus_clamp():
    # prox far above behave: w = e^3 ~ 20 > cap 5
    logp = torch.zeros(3, dtype=torch.float64)
    prox = torch.zeros(3, dtype=torch.float64)
    behave = torch.tensor([-3.0, 0.0, -0.5], dtype=torch.float64)
    adv = torch.ones(3, dtype=torch.float64)
    mask = torch.ones(3, dtype=torch.bool)
    lm, sm = ppo_loss_sum(logp, prox, behave, adv, mask, PPOParams(behave_imp_weight_mode="mask"), 3)
    lc, sc = ppo_loss_sum(logp, prox, behave, adv, mask, PPOParams(behave_imp_weight_mode="clamp"), 3)
    # r = 1 everywhere, so pg = -A * w
    assert lm.item() == pytest.approx(-(0 + 1 + math.exp(0.5)) / 3)
    assert lc.item() == pytest.approx(-(5 + 1 + math.exp(0.5)) / 3)
    assert sm.n_capped == sc.n_capped == 1
    assert sm.finalize()["behave_weight_max"] == pytest.approx(math.exp(3.0))
    assert sm.finalize()["behave_weight_capped_frac"] == pytest.approx(1 / 3)


def test_micro_batch_split_sums_to_whole_batch_loss():
    logp, prox, behave, adv, mask = random_case(n=50, seed=6)
    n = int(mask.sum())
    whole, st_whole = ppo_loss_sum(logp, prox, behave, adv, mask, PPOParams(), n)
    parts = PPOStats()
    total = 0.0
    for sl in (slice(0, 13), slice(13, 31), slice(31, 50)):
        part, st = ppo_loss_sum(logp[sl], prox[sl], behave[sl], adv[sl], mask[sl], PPOParams(), n)
        total += part.item()
        parts.add(st)
    assert total == pytest.approx(whole.item(), rel=1e-12)
    assert parts.finalize() == pytest.approx(st_whole.finalize())


def test_decoupled_clip_rate_lower_than_coupled_when_rollouts_are_stale():
    # stale behaviour policy: prox is far from behave, the current policy close to prox
    g = torch.Generator().manual_seed(7)
    behave = -torch.rand(2000, generator=g, dtype=torch.float64) * 3
    prox = behave + torch.randn(2000, generator=g, dtype=torch.float64) * 0.5
    logp = prox + torch.randn(2000, generator=g, dtype=torch.float64) * 0.05
    adv = torch.randn(2000, generator=g, dtype=torch.float64)
    _, st = ppo_loss_sum(logp, prox, behave, adv, torch.ones(2000, dtype=torch.bool), PPOParams(), 2000)
    m = st.finalize()
    assert m["clip_rate"] < 0.05 < m["clip_rate_coupled"]


def test_loglinear_alpha_from_versions():
    v_b = torch.tensor([3, 5, 2, 5, 7])
    a = loglinear_alpha(v_b, v_prox=5, v_theta=5.5)
    assert a.tolist() == pytest.approx([2 / 2.5, 0.0, 3 / 3.5, 0.0, 1.0])  # v_b > v_theta: clipped to 1
    # single minibatch: v_theta == v_prox, alpha = 1, prox equals the (detached) current logp
    logp = torch.randn(5, dtype=torch.float64, requires_grad=True)
    behave = torch.randn(5, dtype=torch.float64)
    prox = loglinear_prox(logp, behave, v_b, 5, 5)
    assert not prox.requires_grad
    assert torch.allclose(prox[v_b != 5], logp.detach()[v_b != 5])
    assert torch.allclose(prox[v_b == 5], logp.detach()[v_b == 5])  # nothing moved: alpha 1


def test_kl_estimators_against_their_formulas_and_gradients():
    from asyncwebrl.training.ppo import kl_per_token

    g = torch.Generator().manual_seed(3)
    ref = -torch.rand(32, generator=g, dtype=torch.float64) * 4
    logp = (ref + torch.randn(32, generator=g, dtype=torch.float64) * 0.5).requires_grad_(True)
    k1 = kl_per_token(logp, ref, "k1")
    k3 = kl_per_token(logp, ref, "k3")
    for t, (lp, r) in enumerate(zip(logp.tolist(), ref.tolist(), strict=True)):
        assert float(k1[t].detach()) == pytest.approx(lp - r)
        assert float(k3[t].detach()) == pytest.approx(math.exp(r - lp) - (r - lp) - 1)
    assert bool((k3 >= 0).all())  # k3 is never negative, k1 is, for some tokens
    assert bool((k1 < 0).any())
    # k3's gradient in logp is 1 - exp(ref - logp): zero where the policy equals the reference
    (grad,) = torch.autograd.grad(k3.sum(), logp)
    assert torch.allclose(grad, 1 - torch.exp(ref - logp.detach()))
    same = ref.clone().requires_grad_(True)
    (g0,) = torch.autograd.grad(kl_per_token(same, ref, "k3").sum(), same)
    assert float(g0.abs().max()) == 0.0
    with pytest.raises(ValueError, match="k2"):
        kl_per_token(logp, ref, "k2")


def test_micro_batch_loss_adds_the_kl_term_and_reports_it():
    from asyncwebrl.training.ppo import micro_batch_loss

    logp, prox, behave, adv, _ = random_case(48, seed=5)
    ref = logp.detach() - 0.3
    ent = torch.zeros_like(logp)
    base, st0 = micro_batch_loss(logp, prox, behave, adv, ent, PPOParams(), 100.0)
    beta = 0.5
    with_kl, st = micro_batch_loss(logp, prox, behave, adv, ent, PPOParams(kl_coef=beta), 100.0, ref)
    k3 = math.exp(-0.3) + 0.3 - 1  # every token sits 0.3 above the reference
    assert float(with_kl - base) == pytest.approx(beta * 48 * k3 / 100.0, rel=1e-6)
    assert st.finalize()["kl_ref"] == pytest.approx(k3, rel=1e-6)
    assert "kl_ref" not in st0.finalize()  # off: no figure that could be mistaken for a measurement
    with pytest.raises(ValueError, match="reference"):
        micro_batch_loss(logp, prox, behave, adv, ent, PPOParams(kl_coef=beta), 100.0)
