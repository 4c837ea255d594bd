"""Tests for trainer/losses.py: masked ops, verl's KL estimators, loss aggregation, the vanilla PPO loss
(dual-clip, clip-higher), the value loss. Hand-worked values in the comments, plain reference loops,
hypothesis invariants; fp64 where the value is compared tightly (no dependence on CPU kernels).
The other policy losses: tests/test_policy_losses.py; DPO: tests/test_dpo_losses.py.

Run: PYTHONPATH=. pytest -q tests/test_losses.py
"""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trainer import losses as L

finite = st.floats(min_value=-5, max_value=5, allow_nan=False, allow_infinity=False)
D = torch.float64


def t(x):
    return torch.tensor(x, dtype=D)


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


def test_fp64_stays_fp64_and_low_precision_is_upcast():
    assert L.masked_mean(t([1.0, 2.0]), torch.ones(2, dtype=torch.long)).dtype == D
    lp = torch.tensor([[0.5, -0.1]], dtype=torch.bfloat16)
    out = L.ppo_policy_loss(lp, torch.zeros(1, 2, dtype=torch.bfloat16), torch.ones(1, 2), torch.ones(1, 2))
    assert out.loss.dtype == torch.float32


# ---------------------------------------------------------------- KL estimators


def test_kl_estimators_hand_values():
    # logp - ref = 1: k1 1, abs 1, k2 0.5 * 1 = 0.5; k3 with x = ref - logp = -1: e^-1 + 1 - 1 = e^-1
    lp, ref = t([-1.0, -2.0]), t([-2.0, -1.0])
    # second token: logp - ref = -1: k1 -1, abs 1, k2 0.5; k3 with x = 1: e - 1 - 1 = 0.718282
    expected = {
        "kl": [1.0, -1.0], "k1": [1.0, -1.0], "abs": [1.0, 1.0], "mse": [0.5, 0.5], "k2": [0.5, 0.5],
        "low_var_kl": [math.exp(-1), math.e - 2], "k3": [math.exp(-1), math.e - 2],
        "k1+": [1.0, -1.0], "k3+": [math.exp(-1), math.e - 2],  # the values of k1 / k3 (k2's gradient)
    }  # fmt: skip
    assert set(expected) == set(L.KL_ESTIMATORS)
    for name, want in expected.items():
        assert L.kl_penalty(lp, ref, name).tolist() == pytest.approx(want, rel=1e-12), name
    with pytest.raises(ValueError, match="kl estimator 'full'"):
        L.kl_penalty(lp, ref, "full")


def test_k3_is_clamped_like_verl_with_zero_gradient():
    # the reference's log-prob exceeds the actor's by 10: x = 10, e^10 - 10 - 1 = 22015.5 -> clamped to 10,
    # and a clamped value has no gradient (verl: kl clamp [-20, 20], value clamp [-10, 10])
    lp = t([-12.0, -2.0, -30.0, -2.0]).requires_grad_()
    # token 1: x = -25 -> clamped to -20: e^-20 + 20 - 1 = 19.0 -> 10; token 2: x = 28 -> 20 -> 10
    # token 3: x = -5: e^-5 + 5 - 1 = 4.006738, gradient d/dlogp = 1 - e^-5 = 0.993262 (not clamped)
    ref = t([-2.0, -27.0, -2.0, -7.0])
    k3 = L.kl_penalty(lp, ref, "low_var_kl")
    assert k3.tolist() == pytest.approx([10.0, 10.0, 10.0, math.exp(-5) + 4], rel=1e-12)
    k3.sum().backward()
    assert lp.grad.tolist() == pytest.approx([0.0, 0.0, 0.0, 1 - math.exp(-5)], rel=1e-12)


@given(st.lists(st.tuples(finite, finite), min_size=1, max_size=20))
def test_k3_is_non_negative_and_at_most_10(pairs):
    lp = torch.tensor([p[0] for p in pairs])
    ref = torch.tensor([p[1] for p in pairs])
    k3 = L.kl_penalty(lp, ref, "k3")
    assert ((k3 >= 0) & (k3 <= 10)).all()


def test_token_level_rewards_places_score_on_last_token():
    scores = torch.tensor([1.0, 0.5])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    kl = torch.tensor([[0.1, 0.2, 9.0], [0.0, 0.0, 1.0]])
    r = L.token_level_rewards(scores, mask, kl, kl_coef=0.5)
    # row 0: [-0.05, 1 - 0.1, 0 (padding ignores kl 9)]; row 1: [0, 0, 0.5 - 0.5]
    assert r.tolist()[0] == pytest.approx([-0.05, 0.9, 0.0])
    assert r.tolist()[1] == pytest.approx([0.0, 0.0, 0.0])
    assert L.token_level_rewards(scores, mask, None, 0.5).tolist()[1] == pytest.approx([0.0, 0.0, 0.5])


# ---------------------------------------------------------------- GAE (unwhitened)


def _gae_reference(rewards, values, length, gamma, lam):
    """Plain-Python GAE over the first ``length`` tokens of one sequence."""
    adv = [0.0] * len(rewards)
    last = 0.0
    for i in reversed(range(length)):
        nv = values[i + 1] if i + 1 < length else 0.0
        delta = rewards[i] + gamma * nv - values[i]
        last = delta + gamma * lam * last
        adv[i] = last
    ret = [adv[i] + values[i] if i < length else 0.0 for i in range(len(rewards))]
    return adv, ret


def test_gae_hand_values():
    # one sequence of 2 tokens, gamma=1, lam=0.5; rewards [0, 1], values [0.5, 0.25]
    # t=1: delta = 1 - 0.25 = 0.75, A1 = 0.75; t=0: delta = 0 + 0.25 - 0.5 = -0.25, A0 = -0.25 + 0.5*0.75 = 0.125
    adv, ret = L.compute_gae(t([[0.0, 1.0]]), t([[0.5, 0.25]]), torch.ones(1, 2), 1.0, 0.5)
    assert adv.tolist()[0] == pytest.approx([0.125, 0.75])
    assert ret.tolist()[0] == pytest.approx([0.625, 1.0])


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 4), st.integers(1, 6), st.floats(0, 1), st.floats(0, 1), st.data())
def test_gae_matches_reference_loop(batch, width, gamma, lam, data):
    rows = [data.draw(st.lists(finite, min_size=width, max_size=width)) for _ in range(batch)]
    vals = [data.draw(st.lists(finite, min_size=width, max_size=width)) for _ in range(batch)]
    lengths = [data.draw(st.integers(0, width)) for _ in range(batch)]
    mask = torch.tensor([[1.0 if i < n else 0.0 for i in range(width)] for n in lengths])
    adv, ret = L.compute_gae(t(rows), t(vals), mask, gamma, lam)
    for b in range(batch):
        ea, er = _gae_reference(rows[b], vals[b], lengths[b], gamma, lam)
        assert adv[b].tolist() == pytest.approx(ea, abs=1e-9)
        assert ret[b].tolist() == pytest.approx(er, abs=1e-9)


# ---------------------------------------------------------------- aggregation

LOSS = [[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]]
MASK = [[1, 1, 0], [1, 0, 0]]


def test_agg_loss_modes_hand_values():
    v, m = t(LOSS), torch.tensor(MASK)
    # token-mean (1 + 2 + 4) / 3; seq-mean-token-sum (3 + 4) / 2; seq-mean-token-mean (1.5 + 4) / 2;
    # seq-mean-token-sum-norm (3 + 4) / 2 / R with R = 3; token-sum 1 + 2 + 4
    expected = {
        "token-mean": 7 / 3,
        "token-sum": 7.0,
        "seq-mean-token-sum": 3.5,
        "seq-mean-token-mean": 2.75,
        "seq-mean-token-sum-norm": 7 / 6,
    }
    assert set(expected) == set(L.LOSS_AGG_MODES)
    for mode, want in expected.items():
        assert L.agg_loss(v, m, mode).item() == pytest.approx(want, rel=1e-12), mode
    # verl's loss_scale_factor replaces R: 3.5 / 10
    assert L.agg_loss(v, m, "seq-mean-token-sum-norm", L.AggNorm.of(m, horizon=10.0)).item() == pytest.approx(
        0.35
    )
    with pytest.raises(ValueError, match="loss_agg_mode 'token-max'"):
        L.agg_loss(v, m, "token-max")


def test_token_mean_is_normalised_over_the_mini_batch_not_each_micro_batch():
    # micro-batches = the two rows. Shares with the mini-batch's denominators: 3/3 + 4/3 = 7/3, the
    # token mean of the whole mini-batch. The mean of per-micro-batch token means would be (1.5 + 4)/2 = 2.75.
    v, m = t(LOSS), torch.tensor(MASK)
    norm = L.AggNorm.of(m)
    shares = [L.agg_loss(v[i : i + 1], m[i : i + 1], "token-mean", norm).item() for i in range(2)]
    assert shares == pytest.approx([1.0, 4 / 3], rel=1e-12) and sum(shares) == pytest.approx(7 / 3, rel=1e-12)
    # two ranks (FSDP averages gradients): each share doubles, the mean over ranks of the sums is the loss
    assert L.agg_loss(v[:1], m[:1], "token-mean", L.AggNorm(3.0, 2.0, world=2)).item() == pytest.approx(2.0)


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 6), st.integers(1, 5), st.sampled_from(L.LOSS_AGG_MODES), st.data())
def test_micro_batch_shares_sum_to_the_mini_batch_loss_and_seq_modes_match_a_loop(rows, width, mode, data):
    vals = t([data.draw(st.lists(finite, min_size=width, max_size=width)) for _ in range(rows)])
    lengths = [data.draw(st.integers(0, width)) for _ in range(rows)]
    mask = torch.tensor([[1 if i < n else 0 for i in range(width)] for n in lengths])
    full = L.agg_loss(vals, mask, mode).item()
    cut = data.draw(st.integers(0, rows))
    norm = L.AggNorm.of(mask)
    shares = sum(L.agg_loss(vals[a:b], mask[a:b], mode, norm).item() for a, b in ((0, cut), (cut, rows)))
    assert shares == pytest.approx(full, abs=1e-9)
    # plain per-sequence loop over the non-empty sequences
    seqs = [(sum(vals[b, :n].tolist()), n) for b, n in enumerate(lengths) if n > 0]
    if mode == "token-sum":
        assert full == pytest.approx(sum(s for s, _ in seqs), abs=1e-9)
    elif mode != "token-mean" and seqs:
        per = [s / n if mode == "seq-mean-token-mean" else s for s, n in seqs]
        want = sum(per) / len(per) / (width if mode == "seq-mean-token-sum-norm" else 1)
        assert full == pytest.approx(want, abs=1e-9)


# ---------------------------------------------------------------- vanilla PPO


def test_ppo_policy_loss_hand_values_with_clip_higher_and_dual_clip():
    # clip low 0.2, high 0.28, dual-clip c 3:
    # token 0: A=1, r=e^0.25=1.2840 -> max(-1.2840, -clip(r)=-1.28) = -1.28 (clipped by the raised upper bound)
    # token 1: A=-1, r=4 -> max(4, 1.2) = 4, then min(4, c=3) = 3 (dual-clip: bounded, zero gradient)
    # token 2: A=-1, r=0.5 -> max(0.5, clip(0.5)=0.8) = 0.8, min(0.8, 3) = 0.8
    lp = t([[0.25, math.log(4.0), math.log(0.5)]]).requires_grad_()
    p = L.PolicyLossParams(clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0)
    out = L.ppo_policy_loss(lp, torch.zeros(1, 3, dtype=D), t([[1.0, -1.0, -1.0]]), torch.ones(1, 3), p)
    assert out.loss.item() == pytest.approx((-1.28 + 3.0 + 0.8) / 3, rel=1e-12)
    assert out.clipfrac.item() == pytest.approx(2 / 3)  # tokens 0 and 2: the clipped term won
    assert out.clipfrac_lower.item() == pytest.approx(1 / 3)  # token 1
    assert out.ppo_kl.item() == pytest.approx(-(0.25 + math.log(4) + math.log(0.5)) / 3, rel=1e-12)
    out.loss.backward()
    assert lp.grad.tolist()[0] == pytest.approx([0.0, 0.0, 0.0])  # every token is clipped here
    # symmetric 0.2: token 0 becomes -1.2
    sym = L.ppo_policy_loss(lp.detach(), torch.zeros(1, 3, dtype=D), t([[1.0, -1.0, -1.0]]), torch.ones(1, 3))
    assert sym.loss.item() == pytest.approx((-1.2 + 3.0 + 0.8) / 3, rel=1e-12)
    with pytest.raises(ValueError, match="clip_ratio_c"):
        L.ppo_policy_loss(lp, lp, lp, torch.ones(1, 3), L.PolicyLossParams(clip_ratio_c=1.0))


@settings(max_examples=100, deadline=None)
@given(finite, finite, finite, st.floats(0.01, 0.5), st.floats(0.01, 0.5), st.floats(1.01, 10.0))
def test_ppo_clip_and_dual_clip_bounds(lp, old, adv, low, high, c):
    """Per token: A >= 0: L >= -A r (pessimism) and L >= -A (1 + high) (no reward past the upper clip).
    A < 0: |A| (1 - low) <= L <= |A| c (dual-clip caps the loss of a negative advantage). Whenever the
    loss is a clipped constant, its gradient w.r.t. the new log-prob is zero."""
    x = t([[lp]]).requires_grad_()
    p = L.PolicyLossParams(clip_ratio_low=low, clip_ratio_high=high, clip_ratio_c=c)
    out = L.ppo_policy_loss(x, t([[old]]), t([[adv]]), torch.ones(1, 1), p)
    loss = out.loss.item()
    ratio = math.exp(max(min(lp - old, 20), -20))
    tol = 1e-9 * (1 + abs(adv) * ratio)
    if adv >= 0:
        assert loss >= -adv * ratio - tol and loss >= -adv * (1 + high) - tol
    else:
        assert -adv * (1 - low) - tol <= loss <= -adv * c + tol
    out.loss.backward()
    if out.clipfrac.item() == 1.0 or out.clipfrac_lower.item() == 1.0:
        assert x.grad.item() == 0.0
    else:  # the unclipped surrogate -A r: d/dlogp = -A r
        assert x.grad.item() == pytest.approx(
            -adv * ratio if abs(lp - old) < 20 else 0.0, rel=1e-9, abs=1e-12
        )


# ---------------------------------------------------------------- value loss


def test_value_loss_verl_semantics_hand_values():
    one = torch.ones(1, 1)
    # v=1, old=0, ret=2, c=0.5: unclipped (1-2)^2 = 1; v_clip = 0 + clamp(1, -0.5, 0.5) = 0.5 -> (0.5-2)^2 = 2.25
    # -> 0.5 * max(1, 2.25) = 1.125, clipped
    loss, frac = L.value_loss(t([[1.0]]), t([[0.0]]), t([[2.0]]), one, 0.5)
    assert (loss.item(), frac.item()) == pytest.approx((1.125, 1.0))
    # c=0 clips to the old value (verl): v_clip = 0 -> (0-2)^2 = 4 -> 0.5 * 4 = 2, and no gradient
    v = t([[1.0]]).requires_grad_()
    loss, frac = L.value_loss(v, t([[0.0]]), t([[2.0]]), one, 0.0)
    loss.backward()
    assert (loss.item(), frac.item(), v.grad.item()) == pytest.approx((2.0, 1.0, 0.0))
    # c=0 where the unclipped error is larger: v=-3: (-3-2)^2 = 25 > 4 -> 12.5, gradient (v - ret) = -5
    v = t([[-3.0]]).requires_grad_()
    loss, frac = L.value_loss(v, t([[0.0]]), t([[2.0]]), one, 0.0)
    loss.backward()
    assert (loss.item(), frac.item(), v.grad.item()) == pytest.approx((12.5, 0.0, -5.0))


@settings(max_examples=60, deadline=None)
@given(finite, finite, finite, st.floats(0, 2))
def test_value_loss_is_at_least_the_unclipped_loss(v, old, ret, c):
    loss, _ = L.value_loss(t([[v]]), t([[old]]), t([[ret]]), torch.ones(1, 1), c)
    assert loss.item() >= 0.5 * (v - ret) ** 2 - 1e-12
