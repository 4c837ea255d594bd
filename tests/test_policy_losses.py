"""Tests for verl's other policy losses in trainer/losses.py (``loss_mode`` gspo, gpg, cispo, clip_cov,
kl_cov): hand-worked values and gradients, and the invariant that defines each. fp64 throughout.
The vanilla (PPO) loss and the aggregation modes: tests/test_losses.py.

Run: PYTHONPATH=. pytest -q tests/test_policy_losses.py
"""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trainer import losses as L

D = torch.float64
small = st.floats(-1.0, 1.0)


def t(x):
    return torch.tensor(x, dtype=D)


def test_gspo_hand_values_sequence_ratio_and_seq_mean_token_mean():
    # seq 0: log-ratios 0.1, 0.3 -> sequence ratio e^0.2 = 1.2214, A = 1: clipped to 1.2 -> -1.2 per token
    # seq 1: log-ratio -0.1 (the 5.0 is padding) -> e^-0.1 = 0.904837, A = -1 -> 0.904837 (inside the clip)
    # seq-mean-token-mean: (-1.2 + 0.904837) / 2, whatever loss_agg_mode says (as verl)
    old = t([[-1.0, -1.0], [-1.0, -1.0]])
    lp = (old + t([[0.1, 0.3], [-0.1, 5.0]])).requires_grad_()
    adv, mask = t([[1.0, 1.0], [-1.0, -1.0]]), torch.tensor([[1, 1], [1, 0]])
    out = L.gspo_policy_loss(lp, old, adv, mask, L.PolicyLossParams(loss_agg_mode="token-mean"))
    assert out.loss.item() == pytest.approx((-1.2 + math.exp(-0.1)) / 2, rel=1e-12)
    assert out.clipfrac.item() == pytest.approx(2 / 3)  # seq 0's two tokens
    assert out.ppo_kl.item() == pytest.approx(-(0.1 + 0.3 - 0.1) / 3, rel=1e-12)
    out.loss.backward()
    # token gradient: -A s_i (its own log-prob carries the sequence ratio), / (1 token x 2 sequences)
    assert lp.grad.flatten().tolist() == pytest.approx([0.0, 0.0, math.exp(-0.1) / 2, 0.0], rel=1e-12)


@settings(max_examples=50, deadline=None)
@given(st.lists(small, min_size=2, max_size=6), small, st.randoms(use_true_random=False))
def test_gspo_depends_on_a_sequence_only_through_its_mean_log_ratio(ratios, adv, rnd):
    """One ratio per sequence: shuffling the token log-ratios inside a sequence changes nothing."""
    shuffled = list(ratios)
    rnd.shuffle(shuffled)
    old, mask = torch.zeros(1, len(ratios), dtype=D), torch.ones(1, len(ratios))
    a = t([[adv] * len(ratios)])
    one = L.gspo_policy_loss(t([ratios]), old, a, mask).loss
    two = L.gspo_policy_loss(t([shuffled]), old, a, mask).loss
    assert one.item() == pytest.approx(two.item(), abs=1e-12)


def test_gpg_is_plain_policy_gradient():
    # -logp * A = [1 * 1, 2 * 0.5] -> token-mean 1.0; gradient -A / 2 tokens
    lp = t([[-1.0, -2.0]]).requires_grad_()
    out = L.gpg_policy_loss(lp, torch.zeros(1, 2, dtype=D), t([[1.0, 0.5]]), torch.ones(1, 2))
    out.loss.backward()
    assert out.loss.item() == pytest.approx(1.0) and lp.grad.tolist()[0] == pytest.approx([-0.5, -0.25])
    assert out.clipfrac.item() == out.ppo_kl.item() == 0.0


def test_cispo_hand_values_keep_the_gradient_of_clipped_tokens():
    # log-ratios 0.5, -0.5 -> r = 1.6487, 0.6065, clipped (low 0.2, high 0.28) to 1.28, 0.8 (both clipped)
    # losses -w A logp: -1.28 * 1 * -1 = 1.28; -0.8 * -1 * -1 = -0.8 -> mean 0.24
    # gradient -w A / 2 = -0.64, 0.4: not zero, unlike PPO's clip
    lp = t([[-1.0, -1.0]]).requires_grad_()
    p = L.PolicyLossParams(clip_ratio_low=0.2, clip_ratio_high=0.28)
    out = L.cispo_policy_loss(lp, t([[-1.5, -0.5]]), t([[1.0, -1.0]]), torch.ones(1, 2), p)
    out.loss.backward()
    assert out.loss.item() == pytest.approx(0.24, rel=1e-12)
    assert lp.grad.tolist()[0] == pytest.approx([-0.64, 0.4], rel=1e-12)
    assert out.clipfrac.item() == 1.0


@settings(max_examples=50, deadline=None)
@given(st.lists(st.tuples(small, small, small), min_size=1, max_size=6))
def test_cispo_gradient_is_the_clipped_weight_times_advantage(tokens):
    lp = t([[a for a, _, _ in tokens]]).requires_grad_()
    old, adv = t([[b for _, b, _ in tokens]]), t([[c for _, _, c in tokens]])
    L.cispo_policy_loss(lp, old, adv, torch.ones(1, len(tokens))).loss.backward()
    w = torch.exp(lp.detach() - old).clamp(0.8, 1.2)
    assert torch.allclose(lp.grad, -w * adv / len(tokens), atol=1e-12)


COV_ADV = [[3.0, 0.0, 0.0, 0.0]]
COV_LP = [[-0.5, -1.5, -1.5, -1.5]]
# centred covariance (A - 0.75)(logp + 1.25) = [2.25 * 0.75, -0.75 * -0.25 x 3] = [1.6875, 0.1875, 0.1875, 0.1875]


def test_clip_cov_drops_the_high_covariance_token():
    # ratio 1 everywhere (old = new): only token 0 has covariance in (lb 1, ub 5), and
    # max(1, int(0.0002 * 4)) = 1 token is dropped -> the loss -A r = [-3, 0, 0, 0] loses its only term
    lp = t(COV_LP).requires_grad_()
    out = L.clip_cov_policy_loss(lp, t(COV_LP), t(COV_ADV), torch.ones(1, 4))
    out.loss.backward()
    assert out.loss.item() == 0.0 and out.clipfrac.item() == 0.25
    assert lp.grad.tolist()[0] == [0.0, 0.0, 0.0, 0.0]
    # token 0 already clipped by PPO (ratio e^0.5 > 1.2 with A > 0) is not a candidate: nothing dropped,
    # loss = max(-3 e^0.5, -3 * 1.2) / 4 = -0.9
    old = t([[-1.0, -1.5, -1.5, -1.5]])
    out = L.clip_cov_policy_loss(t(COV_LP), old, t(COV_ADV), torch.ones(1, 4))
    assert out.loss.item() == pytest.approx(-3.6 / 4, rel=1e-12) and out.clipfrac.item() == 0.0


def test_kl_cov_penalises_the_high_covariance_token():
    # token 0 (covariance 1.6875, the largest) gets + ppo_kl_coef |log r|: -3 e^0.1 + 0.1 * 0.1;
    # the others -0 * 1 = 0 -> mean (-3.315513 + 0.01) / 4; ppo_kl = mean |log r| = 0.1 / 4
    old = t([[-0.6, -1.5, -1.5, -1.5]])
    out = L.kl_cov_policy_loss(t(COV_LP), old, t(COV_ADV), torch.ones(1, 4))
    assert out.loss.item() == pytest.approx((-3 * math.exp(0.1) + 0.01) / 4, rel=1e-12)
    assert out.ppo_kl.item() == pytest.approx(0.025, rel=1e-12)
    # with ppo_kl_coef 0 it is the unclipped surrogate
    plain = L.kl_cov_policy_loss(
        t(COV_LP), old, t(COV_ADV), torch.ones(1, 4), L.PolicyLossParams(ppo_kl_coef=0.0)
    )
    assert plain.loss.item() == pytest.approx(-3 * math.exp(0.1) / 4, rel=1e-12)


def test_policy_loss_dispatch():
    # logp = old = -1, A = 1: the ratio losses give -A r = -1; gpg, cispo, the DPPO pair and dro give
    # -A logp = 1; sapo's gate at r = 1 is 2 / tau_pos = 2; bypass_mode (ppo_clip, no correction) is vanilla's
    from trainer.config import RolloutCorrectionConfig

    args = (t([[-1.0]]), t([[-1.0]]), t([[1.0]]), torch.ones(1, 1))
    bypass = L.Bypass(RolloutCorrectionConfig(bypass_mode=True))
    p = L.PolicyLossParams(dro_beta=0.5, bypass=bypass)
    for mode in L.POLICY_LOSSES:
        want = {"gpg": 1.0, "cispo": 1.0, "sapo": -2.0, "dppo_tv": 1.0, "dppo_kl": 1.0, "dro": 1.0}.get(
            mode, -1.0
        )
        assert L.policy_loss(mode, *args, p).loss.item() == pytest.approx(want), mode
    with pytest.raises(ValueError, match="loss_mode 'dppo_js'"):
        L.policy_loss("dppo_js", *args)
