"""Mismatch metrics and verl's rollout correction against hand-worked values: `pytest tests/test_mismatch.py`.

The small batch used throughout (two rows, the second one token shorter):
    rollout probabilities mu = [[0.5, 0.25, 0.8], [0.1, 0.2, -]]
    trainer probabilities pi = [[0.4, 0.25, 0.9], [0.25, 0.2, -]]
so the token ratios w = pi / mu are [[0.8, 1, 1.125], [2.5, 1]], |mu - pi| is [[0.1, 0, 0.1], [0.15, 0]],
and the sequence ratios prod(pi) / prod(mu) are 0.09 / 0.1 = 0.9 and 0.05 / 0.02 = 2.5.
"""

from __future__ import annotations

import math
import statistics

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trainer import losses as L
from trainer.config import RolloutCorrectionConfig, TrainConfig
from trainer.mismatch import (
    kl_estimators,
    mismatch_metrics,
    quantile,
    rollout_correction,
    weighted_advantages,
    worst_tokens,
)

MU = torch.tensor([[0.5, 0.25, 0.8], [0.1, 0.2, 0.3]])
PI = torch.tensor([[0.4, 0.25, 0.9], [0.25, 0.2, 0.7]])
MASK = torch.tensor([[1, 1, 1], [1, 1, 0]])
ROLL, OLD = MU.log(), PI.log()
W = [0.8, 1.0, 1.125, 2.5, 1.0]  # valid tokens, row-major
LOGW = [math.log(w) for w in W]


def approx(x):
    return pytest.approx(x, rel=1e-5, abs=1e-6)


def test_probability_difference_metrics_verl_names():
    m = mismatch_metrics(ROLL, OLD, MASK)
    diffs = [0.1, 0.0, 0.1, 0.15, 0.0]
    assert m["training/rollout_probs_diff_valid"] == 1.0
    assert m["training/rollout_probs_diff_max"] == approx(0.15)
    assert m["training/rollout_probs_diff_mean"] == approx(0.35 / 5)
    assert m["training/rollout_probs_diff_std"] == approx(statistics.stdev(diffs))  # unbiased, as torch.std
    # sorted diffs [0, 0, 0.1, 0.1, 0.15]: p50 at index 2 -> 0.1; p90 at 3.6 -> 0.1 + 0.6 * 0.05
    assert m["training/rollout_probs_diff_p50"] == approx(0.1)
    assert m["training/rollout_probs_diff_p90"] == approx(0.13)
    assert m["training/rollout_probs_diff_p99"] == approx(0.1 + 0.96 * 0.05)
    assert m["training/rollout_actor_probs_pearson_corr"] == approx(
        statistics.correlation([0.4, 0.25, 0.9, 0.25, 0.2], [0.5, 0.25, 0.8, 0.1, 0.2])
    )
    # log-prob differences: |log mu - log pi| = |log w|
    assert m["rollout_corr/abs_diff_max"] == approx(math.log(2.5))
    assert m["training/rollout_log_probs_signed_diff_mean"] == approx(-sum(LOGW) / 5)


def test_kl_estimators_per_token_and_per_sequence():
    m = mismatch_metrics(ROLL, OLD, MASK)
    # k1 = log mu - log pi = -log w; k2 = (log w)^2 / 2; k3 = w - 1 - log w
    k1 = [-x for x in LOGW]
    k2 = [x * x / 2 for x in LOGW]
    k3 = [w - 1 - x for w, x in zip(W, LOGW)]
    assert m["rollout_corr/kl"] == approx(sum(k1) / 5)
    assert m["rollout_corr/k2_kl"] == approx(sum(k2) / 5)
    assert m["rollout_corr/k3_kl"] == approx(sum(k3) / 5)  # (0.023144 + 0 + 0.007217 + 0.583709 + 0) / 5
    # per sequence: sums over each row's tokens, then the mean over rows; k1 of row 0 is log(0.1 / 0.09)
    assert m["rollout_corr/seq_kl"] == approx((math.log(0.1 / 0.09) + math.log(0.02 / 0.05)) / 2)
    assert m["rollout_corr/seq_kl_max"] == approx(math.log(0.1 / 0.09))
    assert m["rollout_corr/seq_k3_kl"] == approx((sum(k3[:3]) + sum(k3[3:])) / 2)
    assert m["rollout_corr/seq_k2_kl_max"] == approx(sum(k2[3:]))


def test_perplexity_and_chi2_metrics_verl_names():
    m = mismatch_metrics(ROLL, OLD, MASK)
    # per-row mean log-probs: trainer log(0.09) / 3 and log(0.05) / 2, rollout log(0.1) / 3 and log(0.02) / 2
    train = [math.log(0.09) / 3, math.log(0.05) / 2]
    roll = [math.log(0.1) / 3, math.log(0.02) / 2]
    diff = [r - t for r, t in zip(roll, train)]
    assert m["rollout_corr/training_ppl"] == approx((math.exp(-train[0]) + math.exp(-train[1])) / 2)
    assert m["rollout_corr/training_log_ppl"] == approx(-(train[0] + train[1]) / 2)
    assert m["rollout_corr/rollout_ppl"] == approx((math.exp(-roll[0]) + math.exp(-roll[1])) / 2)
    assert m["rollout_corr/log_ppl_diff"] == approx(sum(diff) / 2)
    assert m["rollout_corr/log_ppl_abs_diff"] == approx((abs(diff[0]) + abs(diff[1])) / 2)
    assert (m["rollout_corr/log_ppl_diff_max"], m["rollout_corr/log_ppl_diff_min"]) == (
        approx(diff[0]),
        approx(diff[1]),
    )
    assert m["rollout_corr/ppl_ratio"] == approx((math.exp(diff[0]) + math.exp(diff[1])) / 2)
    # chi2: E[w^2] - 1 per token (7.905 ... / 5 - 1); per sequence E[(prod w)^2] - 1 = (0.81 + 6.25) / 2 - 1
    assert m["rollout_corr/chi2_token"] == approx(sum(w * w for w in W) / 5 - 1)
    assert m["rollout_corr/chi2_seq"] == approx((0.81 + 6.25) / 2 - 1)


def test_importance_ratio_statistics_and_token_mult_prob_error():
    m = mismatch_metrics(ROLL, OLD, MASK, ratio_bound=1.5)
    assert m["rollout_corr/token_ratio_mean"] == approx(6.425 / 5)
    assert (m["rollout_corr/token_ratio_min"], m["rollout_corr/token_ratio_max"]) == (
        approx(0.8),
        approx(2.5),
    )
    # ESS / n = (sum w)^2 / (n sum w^2) = 6.425^2 / (5 * 10.155625)
    assert m["rollout_corr/token_ratio_eff_sample_size"] == approx(6.425**2 / (5 * 10.155625))
    assert m["rollout_corr/token_ratio_fraction_outside"] == approx(1 / 5)  # only 2.5 is outside [2/3, 1.5]
    # NeMo-RL: mean exp(|log mu - log pi|) = (1.25 + 1 + 1.125 + 2.5 + 1) / 5
    assert m["rollout_corr/token_mult_prob_error"] == approx(6.875 / 5)


def test_worst_tokens_position_probability_entropy():
    entropy = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    worst = worst_tokens(ROLL, OLD, MASK, entropy, k=2)
    top = worst[0]
    assert (top["row"], top["position"]) == (1.0, 0.0) and worst[1]["prob_diff"] == approx(0.1)
    assert (
        top["prob_diff"] == approx(0.15)
        and top["rollout_prob"] == approx(0.1)
        and top["train_prob"] == approx(0.25)
    )
    assert top["entropy"] == 4.0 and top["logprob_diff"] == approx(math.log(0.1 / 0.25))
    m = mismatch_metrics(ROLL, OLD, MASK, entropy=entropy)
    assert m["rollout_corr/worst_token_position"] == 0.0 and m["rollout_corr/worst_token_entropy"] == 4.0
    # the masked token (row 1, position 2: |0.3 - 0.7| = 0.4) is never reported
    assert all(w["prob_diff"] <= 0.15 + 1e-6 for w in worst_tokens(ROLL, OLD, MASK, k=6))


def test_identical_logprobs_and_empty_mask():
    m = mismatch_metrics(ROLL, ROLL, MASK)
    for key in (
        "training/rollout_probs_diff_max",
        "rollout_corr/kl",
        "rollout_corr/k3_kl",
        "rollout_corr/chi2_seq",
    ):
        assert m[key] == approx(0.0)
    assert m["rollout_corr/token_ratio_eff_sample_size"] == approx(1.0)
    assert m["rollout_corr/token_mult_prob_error"] == approx(1.0)
    assert mismatch_metrics(ROLL, OLD, torch.zeros_like(MASK)) == {"training/rollout_probs_diff_valid": 0.0}


@settings(max_examples=30, deadline=None)
@given(
    n=st.integers(min_value=1, max_value=300),
    q=st.sampled_from([0.0, 0.5, 0.9, 0.99, 1.0]),
    seed=st.integers(min_value=0, max_value=2**31),
)
def test_quantile_is_torch_quantile(n, q, seed):
    v = torch.rand(n, generator=torch.Generator().manual_seed(seed))
    assert quantile(v, q) == pytest.approx(float(torch.quantile(v, q)), abs=1e-6)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(min_value=0, max_value=2**31), rows=st.integers(1, 4), cols=st.integers(1, 6))
def test_vectorised_metrics_match_a_plain_loop(seed, rows, cols):
    g = torch.Generator().manual_seed(seed)
    roll = -torch.rand(rows, cols, generator=g) * 4
    old = roll + torch.randn(rows, cols, generator=g) * 0.5
    mask = (torch.rand(rows, cols, generator=g) < 0.8).long()
    mask[:, 0] = 1
    m = mismatch_metrics(roll, old, mask)
    toks = [(float(roll[i, j]), float(old[i, j])) for i in range(rows) for j in range(cols) if mask[i, j]]
    k3 = [math.exp(o - r) - 1 - (o - r) for r, o in toks]
    assert (
        float(kl_estimators(old - roll)["k3"].min()) >= 0
        and float(kl_estimators(old - roll)["k2"].min()) >= 0
    )
    assert m["rollout_corr/k3_kl"] == pytest.approx(sum(k3) / len(k3), rel=1e-4, abs=1e-6)
    seq = [
        sum(r - o for j, (r, o) in enumerate(zip(roll[i].tolist(), old[i].tolist())) if mask[i, j])
        for i in range(rows)
    ]
    assert m["rollout_corr/seq_kl"] == pytest.approx(sum(seq) / rows, rel=1e-4, abs=1e-5)
    w = [math.exp(o - r) for r, o in toks]
    assert m["rollout_corr/token_ratio_eff_sample_size"] == pytest.approx(
        sum(w) ** 2 / (len(w) * sum(x * x for x in w)), rel=1e-4
    )


# ---- verl's rollout correction ---------------------------------------------------------------


def _corr(**kw):
    return rollout_correction(ROLL, OLD, MASK, RolloutCorrectionConfig(**kw))


def test_no_correction_by_default():
    c = _corr()
    assert c.weights is None and c.metrics == {} and c.mask is MASK


def test_token_and_sequence_truncated_is_weights():
    c = _corr(rollout_is="token", rollout_is_threshold=2.0)
    # w = [[0.8, 1, 1.125], [2.5 -> 2, 1, 0 (padding)]]
    torch.testing.assert_close(c.weights, torch.tensor([[0.8, 1.0, 1.125], [2.0, 1.0, 0.0]]))
    assert c.mask is MASK and not c.weights.requires_grad
    assert c.metrics["rollout_corr/rollout_is_mean"] == approx(6.425 / 5)  # before truncation, as verl
    assert c.metrics["rollout_corr/rollout_is_ratio_fraction_high"] == approx(1 / 5)
    assert c.metrics["rollout_corr/rollout_is_max"] == approx(2.5)
    c = _corr(rollout_is="sequence", rollout_is_threshold=2.0)
    # sequence ratios 0.9 and 2.5 -> truncated to 2, on every valid token of the row
    torch.testing.assert_close(c.weights, torch.tensor([[0.9, 0.9, 0.9], [2.0, 2.0, 0.0]]))
    assert c.metrics["rollout_corr/rollout_is_ratio_fraction_high"] == approx(0.5)
    c = _corr(rollout_is="token", rollout_is_threshold=2.0, rollout_is_batch_normalize=True)
    # the truncated weights' token mean (0.8 + 1 + 1.125 + 2 + 1) / 5 = 1.185 becomes 1
    assert c.metrics["rollout_corr/rollout_is_batch_norm_factor"] == approx(1.185)
    torch.testing.assert_close(c.weights, torch.tensor([[0.8, 1.0, 1.125], [2.0, 1.0, 0.0]]) / 1.185)


@pytest.mark.parametrize(
    "rs, threshold, kept",
    [
        # token_k1: rollout/train ratio 1/w = [1.25, 1, 0.889, 0.4, 1] must be in [0.5, 2]
        ("token_k1", 2.0, [[1, 1, 1], [0, 1, 0]]),
        ("token", 2.0, [[1, 1, 1], [0, 1, 0]]),  # verl's earlier name, the same test
        # the rows' ratio products 1/0.9 and 0.4 against [0.95, 1.2]: row 1 goes
        ("seq_sum_k1", "0.95_1.2", [[1, 1, 1], [0, 0, 0]]),
        # geometric means (1/0.9)^(1/3) = 1.036 and 0.4^(1/2) = 0.632 against [1/1.05, 1.05]
        ("geometric", 1.05, [[1, 1, 1], [0, 0, 0]]),
        # token k3 = w - 1 - log w = [0.023, 0, 0.007, 0.584, 0] <= 0.05
        ("token_k3", 0.05, [[1, 1, 1], [0, 1, 0]]),
        # the rows' max k2 = (log w)^2 / 2: 0.0249 and 0.4198 <= 0.1
        ("seq_max_k2", 0.1, [[1, 1, 1], [0, 0, 0]]),
        # both must pass: token k3 <= 0.02 drops both tokens 0; the rows' mean k3 (0.0101 and 0.2919)
        # <= 0.05 drops row 1
        ("token_k3,seq_mean_k3", "0.02,0.05", [[0, 1, 1], [0, 0, 0]]),
    ],
)
def test_rejection_options(rs, threshold, kept):
    c = _corr(rollout_rs=rs, rollout_rs_threshold=threshold)
    assert c.mask.tolist() == kept and c.mask.dtype == MASK.dtype and c.weights is None
    dropped = 5 - sum(map(sum, kept))
    assert c.metrics["rollout_corr/rollout_rs_masked_fraction"] == approx(dropped / 5)


def test_per_option_and_combined_fractions():
    c = _corr(rollout_rs="token_k3,seq_mean_k3", rollout_rs_threshold="0.02,0.05")
    m = c.metrics
    # token k3 drops 2 of 5 tokens in 2 of 2 rows; seq mean k3 drops row 1: 2 of 5 tokens, 1 of 2 rows
    assert m["rollout_corr/rollout_rs_token_k3_masked_fraction"] == approx(2 / 5)
    assert m["rollout_corr/rollout_rs_token_k3_seq_masked_fraction"] == approx(1.0)
    assert m["rollout_corr/rollout_rs_seq_mean_k3_masked_fraction"] == approx(2 / 5)
    assert m["rollout_corr/rollout_rs_seq_mean_k3_seq_masked_fraction"] == approx(1 / 2)
    assert m["rollout_corr/rollout_rs_seq_mean_k3_mean"] == approx((3 * 0.0101204 + 2 * 0.2918546) / 5)
    assert m["rollout_corr/rollout_rs_masked_fraction"] == approx(3 / 5)
    assert m["rollout_corr/rollout_rs_seq_masked_fraction"] == approx(1.0)


def _verl_pg_loss(logprobs, old, adv, mask, weights, clip, clip_c=3.0):
    """verl's vanilla policy loss written out per token: max(-A r, -A clip(r)) (for A < 0 at most
    -A c, the dual clip), times the rollout IS weight, token-mean over the (rejection-modified)
    response mask."""
    total, count = 0.0, 0
    for i in range(logprobs.shape[0]):
        for j in range(logprobs.shape[1]):
            if not mask[i, j]:
                continue
            ratio = torch.exp(logprobs[i, j] - old[i, j])
            a = adv[i, j]
            loss = torch.maximum(-a * ratio, -a * ratio.clamp(1 - clip, 1 + clip))
            if a < 0:
                loss = torch.minimum(loss, -a * clip_c)
            total = total + loss * (1.0 if weights is None else weights[i, j])
            count += 1
    return total / max(count, 1)


def _loss(mode, logprobs, old, adv, mask):
    return L.policy_loss(mode, logprobs, old, adv, mask, L.PolicyLossParams()).loss


def test_correction_changes_the_ppo_loss_as_verls_does():
    """Hand-worked at ratio 1 (current = old log-probs), advantages A = [[1, -1, 0.5], [2, 1, 0]]:
    no correction: -(1 - 1 + 0.5 + 2 + 1) / 5 = -0.7;
    token TIS (C = 2): -(1*0.8 - 1*1 + 0.5*1.125 + 2*2 + 1*1) / 5 = -5.3625 / 5 = -1.0725;
    + token_k1 rejection (row 1 token 0 dropped): -(0.8 - 1 + 0.5625 + 1) / 4 = -0.340625."""
    adv = torch.tensor([[1.0, -1.0, 0.5], [2.0, 1.0, 0.0]])
    current = OLD.clone()
    plain = _loss("vanilla", current, OLD, adv, MASK)
    assert float(plain) == approx(-0.7)
    c = _corr(rollout_is="token", rollout_is_threshold=2.0)
    tis = _loss("vanilla", current, OLD, weighted_advantages(adv, c.weights), c.mask)
    assert float(tis) == approx(-1.0725)
    c = _corr(rollout_is="token", rollout_is_threshold=2.0, rollout_rs="token_k1", rollout_rs_threshold=2.0)
    both = _loss("vanilla", current, OLD, weighted_advantages(adv, c.weights), c.mask)
    assert float(both) == approx(-0.340625)
    assert float(both) == approx(float(_verl_pg_loss(current, OLD, adv, c.mask, c.weights, 0.2)))


def _per_token_reference(mode, logprobs, old, adv, mask, weights):
    """verl's weighting for a loss whose tokens are independent: sum over tokens of w_t times the
    loss of that token alone (our loss on a one-token mask), over the token count (token-mean)."""
    total = 0.0
    for i, j in mask.nonzero().tolist():
        alone = torch.zeros_like(mask)
        alone[i, j] = 1
        total = total + weights[i, j] * _loss(mode, logprobs, old, adv, alone)
    return total / int(mask.sum())


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(min_value=0, max_value=2**31),
    level=st.sampled_from(["token", "sequence"]),
    mode=st.sampled_from(["vanilla", "gpg", "cispo"]),
)
def test_weighted_advantages_give_verls_loss_and_gradient(seed, level, mode):
    """Scaling the advantages by the (non-negative) weights is verl's per-token weighting of the
    policy loss, value and gradient, clipped and dual-clipped tokens included (ratios up to e^+-1.5
    against clip 0.2 and c = 3); vanilla against a plain loop of verl's formula, the others against
    their own per-token losses weighted."""
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(3, 5, generator=g) * 3
    roll = old + torch.randn(3, 5, generator=g) * 0.3
    adv = torch.randn(3, 5, generator=g)
    mask = (torch.rand(3, 5, generator=g) < 0.8).long()
    mask[:, 0] = 1
    c = rollout_correction(
        roll, old, mask, RolloutCorrectionConfig(rollout_is=level, rollout_is_threshold=1.5)
    )
    current = (old + torch.randn(3, 5, generator=g) * 1.5).requires_grad_(True)
    ours = _loss(mode, current, old, weighted_advantages(adv, c.weights), mask)
    (g_ours,) = torch.autograd.grad(ours, current)
    if mode == "vanilla":
        ref = _verl_pg_loss(current, old, adv, mask, c.weights, 0.2)
    else:
        ref = _per_token_reference(mode, current, old, adv, mask, c.weights)
    (g_ref,) = torch.autograd.grad(ref, current)
    assert float(ours.detach()) == pytest.approx(float(ref.detach()), rel=1e-5, abs=1e-6)
    torch.testing.assert_close(g_ours, g_ref, rtol=1e-5, atol=1e-7)


def test_config_errors_name_the_field():
    with pytest.raises(
        ValueError, match=r"rollout_correction.rollout_rs_threshold: required with rollout_rs"
    ):
        TrainConfig.from_dict({"rollout_correction": {"rollout_rs": "token_k1"}})
    with pytest.raises(ValueError, match=r"rollout_correction.rollout_rs: unknown option 'token_k4'"):
        TrainConfig.from_dict({"rollout_correction": {"rollout_rs": "token_k4", "rollout_rs_threshold": 2}})
    with pytest.raises(ValueError, match=r"'0.5_2' for token_k3: one upper bound"):
        TrainConfig.from_dict(
            {"rollout_correction": {"rollout_rs": "token_k3", "rollout_rs_threshold": "0.5_2"}}
        )
    with pytest.raises(ValueError, match=r"2 thresholds for 3 rollout_rs options"):
        RolloutCorrectionConfig(rollout_rs="token_k1,token_k2,token_k3", rollout_rs_threshold="1,2")
    with pytest.raises(ValueError, match=r"rollout_correction.rollout_is: 'tokens'"):
        TrainConfig.from_dict({"rollout_correction": {"rollout_is": "tokens"}})
    cfg = TrainConfig.from_dict(
        {"rollout_correction": {"rollout_rs": "seq_sum_k1,token_k3", "rollout_rs_threshold": "0.5_2.0,0.01"}}
    )
    assert cfg.rollout_correction.rs_thresholds() == {"seq_sum_k1": (0.5, 2.0), "token_k3": (None, 0.01)}
    assert TrainConfig.from_dict(cfg.to_dict()) == cfg


def _ppo_step(correction: dict | None = None) -> dict:
    from trainer.train import train

    cfg = {
        "algo": {"name": "ppo", "batch_size": 4, "mini_batch_size": 4, "micro_batch_size": 4},
        "data": {"prompt_length": 12, "response_length": 4, "num_examples": 64},
        # fp32 training, bf16 rollout: the ratios are away from 1 on any CPU kernel (with bf16 on both
        # sides, scalar kernels can give the trainer exactly the rollout's log-probs)
        "precision": {"preset": "fp32", "overrides": {"rollout": {"compute_dtype": "bf16"}}},
        "steps": 1,
        "device": "cpu",
        "seed": 0,
    }
    if correction:
        cfg["rollout_correction"] = correction
    return train(TrainConfig.from_dict(cfg)).final


def test_the_recipe_applies_the_correction():
    """Mismatch metrics on every step; IS weights reach the policy loss; rejected tokens leave it."""
    plain = _ppo_step()
    assert plain["training/rollout_probs_diff_max"] > 0 and "rollout_corr/rollout_is_mean" not in plain
    # (one epoch over one mini-batch: the ratio is 1 and the whitened advantages average 0, so the
    # policy loss itself is 0 in every run; its gradient is what the correction changes)
    weighted = _ppo_step({"rollout_is": "token", "rollout_is_threshold": 1e9})  # untruncated ratios
    assert weighted["rollout_corr/rollout_is_mean"] != 1.0
    assert weighted["actor/grad_norm"] != plain["actor/grad_norm"]
    # every sequence's ratio product is outside [1e-9, 1e-8]: nothing is left to learn from
    none = _ppo_step({"rollout_rs": "seq_sum_k1", "rollout_rs_threshold": "1e-9_1e-8"})
    assert none["rollout_corr/rollout_rs_masked_fraction"] == 1.0
    assert none["actor/grad_norm"] == 0.0 and plain["actor/grad_norm"] > 0.0


def test_is_weights_refused_where_they_would_not_be_verls():
    with pytest.raises(ValueError, match=r"rollout_correction.rollout_is: not with algo.loss_mode: clip_cov"):
        TrainConfig.from_dict(
            {"algo": {"loss_mode": "clip_cov"}, "rollout_correction": {"rollout_is": "token"}}
        )
    with pytest.raises(ValueError, match=r"rollout_correction: DPO has no rollout"):
        TrainConfig.from_dict({"algo": {"name": "dpo"}, "rollout_correction": {"rollout_is": "token"}})
    TrainConfig.from_dict(  # rejection alone only masks tokens: fine with every loss
        {
            "algo": {"loss_mode": "kl_cov"},
            "rollout_correction": {"rollout_rs": "token_k3", "rollout_rs_threshold": 0.1},
        }
    )
