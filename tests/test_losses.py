"""Tests for trainer/losses.py: hand-worked values, a plain-Python GAE reference, hypothesis invariants.

Run: PYTHONPATH=. pytest -q tests/test_losses.py
"""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trainer import losses as L

finite = st.floats(min_value=-5, max_value=5, allow_nan=False, allow_infinity=False)


def test_masked_mean_sum_and_empty_mask():
    v = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    m = torch.tensor([[1, 1, 0], [1, 0, 0]], dtype=torch.bool)
    # sum = 1 + 2 + 4 = 7 over 3 tokens -> mean 7/3
    assert L.masked_sum(v, m).item() == pytest.approx(7.0)
    assert L.masked_mean(v, m).item() == pytest.approx(7 / 3)
    # per row: (1+2)/2 = 1.5, 4/1 = 4
    assert L.masked_mean(v, m.float(), dim=-1).tolist() == pytest.approx([1.5, 4.0])
    assert L.masked_mean(v, torch.zeros_like(m)).item() == 0.0


def test_masked_whiten_hand_values():
    # masked values 1, 3 (the 100 is padding): mean 2, unbiased var ((1-2)^2+(3-2)^2)/1 = 2
    v = torch.tensor([[1.0, 3.0, 100.0]])
    m = torch.tensor([[1.0, 1.0, 0.0]])
    w = L.masked_whiten(v, m, eps=0.0)
    s = math.sqrt(2.0)
    assert w.tolist()[0] == pytest.approx([-1 / s, 1 / s, 0.0])


def test_kl_estimators_hand_values():
    lp, ref = torch.tensor([-1.0]), torch.tensor([-2.0])
    # k1 = logp - ref = 1; k3 with log r = ref - logp = -1: e^-1 + 1 - 1 = 0.3679
    assert L.kl_penalty(lp, ref, "k1").item() == pytest.approx(1.0)
    assert L.kl_penalty(lp, ref, "k3").item() == pytest.approx(math.exp(-1.0), rel=1e-6)
    with pytest.raises(ValueError, match="kl_estimator"):
        L.kl_penalty(lp, ref, "k2")


@given(st.lists(st.tuples(finite, finite), min_size=1, max_size=20))
def test_k3_is_non_negative(pairs):
    lp = torch.tensor([p[0] for p in pairs])
    ref = torch.tensor([p[1] for p in pairs])
    assert (L.kl_penalty(lp, ref, "k3") >= 0).all()


def test_token_level_rewards_places_score_on_last_token():
    scores = torch.tensor([1.0, 0.5])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    kl = torch.tensor([[0.1, 0.2, 9.0], [0.0, 0.0, 1.0]])
    r = L.token_level_rewards(scores, mask, kl, kl_coef=0.5)
    # row 0: [-0.05, 1 - 0.1, 0 (padding ignores kl 9)]; row 1: [0, 0, 0.5 - 0.5]
    assert r.tolist()[0] == pytest.approx([-0.05, 0.9, 0.0])
    assert r.tolist()[1] == pytest.approx([0.0, 0.0, 0.0])
    assert L.token_level_rewards(scores, mask, None, 0.5).tolist()[1] == pytest.approx([0.0, 0.0, 0.5])


def _gae_reference(rewards, values, length, gamma, lam):
    """Plain-Python GAE over the first ``length`` tokens of one sequence."""
    adv = [0.0] * len(rewards)
    last = 0.0
    for t in reversed(range(length)):
        nv = values[t + 1] if t + 1 < length else 0.0
        delta = rewards[t] + gamma * nv - values[t]
        last = delta + gamma * lam * last
        adv[t] = last
    ret = [adv[t] + values[t] if t < length else 0.0 for t in range(len(rewards))]
    return adv, ret


def test_gae_hand_values():
    # one sequence of 2 tokens, gamma=1, lam=0.5; rewards [0, 1], values [0.5, 0.25]
    # t=1: delta = 1 - 0.25 = 0.75, A1 = 0.75; t=0: delta = 0 + 0.25 - 0.5 = -0.25, A0 = -0.25 + 0.5*0.75 = 0.125
    adv, ret = L.compute_gae(
        torch.tensor([[0.0, 1.0]]), torch.tensor([[0.5, 0.25]]), torch.ones(1, 2), 1.0, 0.5
    )
    assert adv.tolist()[0] == pytest.approx([0.125, 0.75])
    assert ret.tolist()[0] == pytest.approx([0.625, 1.0])


@settings(max_examples=60, deadline=None)
@given(
    st.integers(1, 4),
    st.integers(1, 6),
    st.floats(0, 1),
    st.floats(0, 1),
    st.data(),
)
def test_gae_matches_reference_loop(batch, width, gamma, lam, data):
    rows = [data.draw(st.lists(finite, min_size=width, max_size=width)) for _ in range(batch)]
    vals = [data.draw(st.lists(finite, min_size=width, max_size=width)) for _ in range(batch)]
    lengths = [data.draw(st.integers(0, width)) for _ in range(batch)]
    mask = torch.tensor([[1.0 if t < n else 0.0 for t in range(width)] for n in lengths])
    adv, ret = L.compute_gae(torch.tensor(rows), torch.tensor(vals), mask, gamma, lam)
    for b in range(batch):
        ea, er = _gae_reference(rows[b], vals[b], lengths[b], gamma, lam)
        assert adv[b].tolist() == pytest.approx(ea, abs=1e-4)
        assert ret[b].tolist() == pytest.approx(er, abs=1e-4)


@settings(max_examples=40, deadline=None)
@given(st.lists(finite, min_size=1, max_size=8), st.lists(finite, min_size=8, max_size=8))
def test_gae_gamma_lam_one_is_reward_to_go_minus_value(rewards, values):
    n = len(rewards)
    r, v = torch.tensor([rewards]), torch.tensor([values[:n]])
    adv, _ = L.compute_gae(r, v, torch.ones(1, n), 1.0, 1.0)
    to_go = torch.flip(torch.cumsum(torch.flip(r, [1]), 1), [1])
    assert torch.allclose(adv, to_go - v, atol=1e-4)


def test_grpo_advantages_hand_values():
    # group [1, 0]: mean 0.5, std (Bessel) = sqrt(0.5) -> +-0.5/0.7071 = +-0.7071; group [2, 2]: 0
    a = L.grpo_advantages(torch.tensor([1.0, 0.0, 2.0, 2.0]), group_size=2, eps=0.0)
    assert a[:2].tolist() == pytest.approx([math.sqrt(0.5), -math.sqrt(0.5)])
    assert L.grpo_advantages(torch.tensor([1.0, 0.0, 2.0, 2.0]), 2)[2:].tolist() == [0.0, 0.0]
    with pytest.raises(ValueError, match="group_size"):
        L.grpo_advantages(torch.ones(3), 2)


def test_ppo_policy_loss_hand_values():
    # token 0: ratio e^0.5=1.6487, A=1 -> min(1.6487, 1.2) = 1.2, loss -1.2, clipped
    # token 1: ratio e^-0.1=0.9048, A=-1 -> max(0.9048, 0.9048) = 0.9048, not clipped
    lp = torch.tensor([[0.5, -0.1]])
    old = torch.zeros(1, 2)
    adv = torch.tensor([[1.0, -1.0]])
    loss, clipfrac, kl = L.ppo_policy_loss(lp, old, adv, torch.ones(1, 2), 0.2)
    assert loss.item() == pytest.approx((-1.2 + math.exp(-0.1)) / 2, rel=1e-5)
    assert clipfrac.item() == pytest.approx(0.5)
    assert kl.item() == pytest.approx((-0.5 + 0.1) / 2)


@settings(max_examples=80, deadline=None)
@given(finite, finite, finite, st.floats(0.01, 0.5))
def test_ppo_clip_bounds(lp, old, adv, eps):
    """Per token L = max(-A r, -A clip(r)): so L >= -A r (pessimism), and the surrogate cannot reward
    moving the ratio past the clip: L >= -A (1+eps) for A >= 0 and L >= -A (1-eps) = |A| (1-eps) for A < 0.
    When the clipped term is the max the gradient w.r.t. the new log-prob is zero."""
    x = torch.tensor([[lp]], requires_grad=True)
    loss, clipfrac, _ = L.ppo_policy_loss(
        x, torch.tensor([[old]]), torch.tensor([[adv]]), torch.ones(1, 1), eps
    )
    ratio = math.exp(max(min(lp - old, 20), -20))
    tol = 1e-4 * (1 + abs(adv) * ratio)
    assert loss.item() >= -adv * ratio - tol
    bound = -adv * (1 + eps) if adv >= 0 else -adv * (1 - eps)
    assert loss.item() >= bound - tol
    loss.backward()
    if clipfrac.item() == 1.0:
        assert x.grad.item() == 0.0


def test_value_loss_hand_values():
    # v=1, old=0, ret=2, clip 0.2: unclipped (1-2)^2=1, clipped (0.2-2)^2=3.24 -> 0.5*3.24 = 1.62
    loss, frac = L.value_loss(
        torch.tensor([[1.0]]), torch.zeros(1, 1), torch.tensor([[2.0]]), torch.ones(1, 1), 0.2
    )
    assert loss.item() == pytest.approx(1.62)
    assert frac.item() == 1.0
    loss, frac = L.value_loss(
        torch.tensor([[1.0]]), torch.zeros(1, 1), torch.tensor([[2.0]]), torch.ones(1, 1), 0.0
    )
    assert loss.item() == pytest.approx(0.5)
    assert frac.item() == 0.0


def test_dpo_loss_hand_values():
    # h = (-1 - -2) - (-3 - -3) = 1; beta 0.5: -log sigmoid(0.5) = 0.474077
    pc, pr, rc, rr = (torch.tensor([x]) for x in (-1.0, -3.0, -2.0, -3.0))
    losses, cr, rj = L.dpo_loss(pc, pr, rc, rr, beta=0.5)
    assert losses.item() == pytest.approx(-math.log(1 / (1 + math.exp(-0.5))), rel=1e-6)
    assert (cr.item(), rj.item()) == pytest.approx((0.5, 0.0))
    # ipo: (1 - 1/(2*0.5))^2 = 0
    assert L.dpo_loss(pc, pr, rc, rr, beta=0.5, loss_type="ipo")[0].item() == pytest.approx(0.0)
    with pytest.raises(ValueError, match="dpo_loss"):
        L.dpo_loss(pc, pr, rc, rr, beta=0.5, loss_type="hinge")


@settings(max_examples=60, deadline=None)
@given(finite, finite, finite, finite, st.floats(0.01, 2.0))
def test_dpo_swap_symmetry(pc, pr, rc, rr, beta):
    """Swapping chosen and rejected flips h; since log sigmoid(x) - log sigmoid(-x) = x,
    loss(swapped) - loss = beta * h, and the implicit rewards swap."""
    t = [torch.tensor([x]) for x in (pc, pr, rc, rr)]
    loss, c, r = L.dpo_loss(t[0], t[1], t[2], t[3], beta)
    sloss, sc, sr = L.dpo_loss(t[1], t[0], t[3], t[2], beta)
    h = (pc - rc) - (pr - rr)
    assert (sloss - loss).item() == pytest.approx(beta * h, abs=1e-4)
    assert torch.equal(sc, r) and torch.equal(sr, c)


def test_losses_upcast_low_precision_inputs():
    lp = torch.tensor([[0.5, -0.1]], dtype=torch.bfloat16)
    loss, _, _ = L.ppo_policy_loss(
        lp, torch.zeros(1, 2, dtype=torch.bfloat16), torch.ones(1, 2), torch.ones(1, 2), 0.2
    )
    assert loss.dtype == torch.float32
