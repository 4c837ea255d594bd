"""verl's 2026 keys that from-verl refused before: policy losses ``sapo`` and ``geo_mean``, the KL names
``k1+`` / ``k3+``, ``loss_agg_mode: token-sum``, advantage estimators ``grpo_vectorized`` and
``rloo_vectorized``; each against hand-worked values (in the comments) and a plain reference loop, with
verl's defaults, and mapped by from-verl.

Run: PYTHONPATH=. pytest -q tests/test_verl_2026_keys.py
"""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trainer import advantages as A
from trainer import losses as L
from trainer.config import AlgoConfig, TrainConfig

D = torch.float64


def t(x):
    return torch.tensor(x, dtype=D)


def _sig(x):
    return 1 / (1 + math.exp(-x))


# ---------------------------------------------------------------- sapo


def test_sapo_hand_values_and_verl_defaults():
    # tokens: (logp - old, A) = (ln 1.5, 1), (ln 0.5, -2), padding. tau_pos 1, tau_neg 1.05 (verl's defaults)
    # token 1: g = 4 sigmoid(0.5) = 2.4490; loss -2.4490. token 2: g = (4/1.05) sigmoid(1.05 * -0.5); loss +2 g
    # seq-mean-token-mean over the one row: the mean of the two token losses
    assert (AlgoConfig().tau_pos, AlgoConfig().tau_neg) == (1.0, 1.05)
    lp = t([[math.log(1.5), math.log(0.5), 0.0]])
    old = torch.zeros(1, 3, dtype=D)
    adv = t([[1.0, -2.0, 0.0]])
    mask = t([[1.0, 1.0, 0.0]])
    out = L.sapo_policy_loss(lp, old, adv, mask)
    g1 = 4 * _sig(0.5)
    g2 = (4 / 1.05) * _sig(1.05 * -0.5)
    assert out.loss.item() == pytest.approx((-g1 + 2 * g2) / 2, rel=1e-12)
    assert out.clipfrac.item() == 0.0
    # gradient at r = 1 is the PPO gradient: d/dlogp of -A g(r) = -A r g'(r), g'(1) = 1
    lp = torch.zeros(1, 1, dtype=D, requires_grad=True)
    L.sapo_policy_loss(lp, torch.zeros(1, 1, dtype=D), t([[3.0]]), torch.ones(1, 1, dtype=D)).loss.backward()
    assert lp.grad.item() == pytest.approx(-3.0, rel=1e-12)


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 3), st.integers(1, 4), st.data())
def test_sapo_matches_a_plain_loop(b, r, data):
    f = st.floats(-2, 2)
    lp = data.draw(st.lists(st.lists(f, min_size=r, max_size=r), min_size=b, max_size=b))
    adv = data.draw(st.lists(st.lists(f, min_size=r, max_size=r), min_size=b, max_size=b))
    mask = data.draw(st.lists(st.lists(st.booleans(), min_size=r, max_size=r), min_size=b, max_size=b))
    p = L.PolicyLossParams(tau_pos=0.7, tau_neg=1.3)
    out = L.sapo_policy_loss(t(lp), torch.zeros(b, r, dtype=D), t(adv), t(mask), p)
    seq, rows = 0.0, 0
    for i in range(b):
        terms = [
            -adv[i][j] * (4 / tau) * _sig(tau * (math.exp(lp[i][j]) - 1))
            for j in range(r)
            if mask[i][j]
            for tau in [0.7 if adv[i][j] > 0 else 1.3]
        ]
        if terms:
            seq, rows = seq + sum(terms) / len(terms), rows + 1
    assert out.loss.item() == pytest.approx(seq / max(rows, 1), rel=1e-9, abs=1e-12)


# ---------------------------------------------------------------- geo_mean (GMPO)


def test_geo_mean_hand_values():
    # one row, A = 1 on both tokens, d = logp - old = (0.3, -0.1), clip 0.2 both sides:
    # A > 0 takes min(d, clamp(d)) = (0.2, -0.1): ratio exp(0.05), loss -1 * exp(0.05); token 1 clipped (A > 0)
    lp, old = t([[0.3, -0.1]]), torch.zeros(1, 2, dtype=D)
    out = L.geo_mean_policy_loss(lp, old, t([[1.0, 1.0]]), torch.ones(1, 2, dtype=D))
    assert out.loss.item() == pytest.approx(-math.exp(0.05), rel=1e-7)  # verl divides by length + 1e-8
    assert out.clipfrac.item() == pytest.approx(0.5) and out.clipfrac_lower.item() == 0.0
    # A < 0: max(d, clamp(d)) = (0.3, -0.1): ratio exp(0.1), loss +1 * exp(0.1); token 1 clipped (A < 0)
    out = L.geo_mean_policy_loss(lp, old, t([[-1.0, -1.0]]), torch.ones(1, 2, dtype=D))
    assert out.loss.item() == pytest.approx(math.exp(0.1), rel=1e-7)
    assert out.clipfrac_lower.item() == pytest.approx(0.5)
    # two rows, one of them empty: averaged over the sequences with a token (the global-batch form)
    lp2, mask2 = t([[0.3, -0.1], [0.0, 0.0]]), t([[1.0, 1.0], [0.0, 0.0]])
    out = L.geo_mean_policy_loss(lp2, torch.zeros(2, 2, dtype=D), t([[1.0, 1.0], [5.0, 5.0]]), mask2)
    assert out.loss.item() == pytest.approx(-math.exp(0.05), rel=1e-7)  # verl divides by length + 1e-8


def test_geo_mean_refuses_is_weights():
    with pytest.raises(ValueError, match="rollout_correction.rollout_is: not with algo.loss_mode: geo_mean"):
        TrainConfig.from_dict({"algo": {"name": "grpo", "loss_mode": "geo_mean"},
                               "rollout_correction": {"rollout_is": "token"}})  # fmt: skip


# ---------------------------------------------------------------- k1+ / k3+


def test_straight_through_kl_has_k3s_value_and_k2s_gradient():
    lp = t([-1.0, -2.0]).requires_grad_()
    ref = t([-2.0, -1.0])
    for name, base in (("k1+", "k1"), ("k3+", "k3")):
        lp.grad = None
        out = L.kl_penalty(lp, ref, name)
        assert torch.equal(out.detach(), L.kl_penalty(lp, ref, base).detach()), name
        out.sum().backward()
        assert lp.grad.tolist() == [1.0, -1.0], name  # d/dlogp 0.5 (logp - ref)^2 = logp - ref
    assert AlgoConfig(name="grpo", use_kl_loss=True, kl_loss_type="k3+").kl_loss_type == "k3+"


# ---------------------------------------------------------------- token-sum


def test_token_sum_is_the_unnormalised_sum_over_the_mini_batch():
    # micro-batches of one row each: shares 3 and 4 add up to the mini-batch's 7, whatever the split
    v, m = t([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]]), t([[1, 1, 0], [1, 0, 0]])
    norm = L.AggNorm.of(m)
    assert L.agg_loss(v, m, "token-sum").item() == 7.0
    shares = [L.agg_loss(v[i : i + 1], m[i : i + 1], "token-sum", norm).item() for i in range(2)]
    assert shares == [3.0, 4.0]
    assert L.agg_loss(v, m, "token-sum", L.AggNorm.of(m, world=2)).item() == 14.0  # FSDP averages over ranks


# ---------------------------------------------------------------- grpo_vectorized / rloo_vectorized


def _outcome(scores):
    s = t(scores)
    return s[:, None], torch.ones(len(scores), 1, dtype=D)


def test_vectorized_estimators_hand_values():
    # groups [1, 3] and [5]: mean 2, std sqrt(2); a single row
    r, m = _outcome([1.0, 3.0, 5.0])
    index = torch.tensor([0, 0, 1])
    adv, _ = A.grpo_vectorized(r, m, index)
    s2 = math.sqrt(2)
    assert adv[:, 0].tolist() == pytest.approx([-1 / (s2 + 1e-6), 1 / (s2 + 1e-6), 5 / (1 + 1e-6)], rel=1e-12)
    # rloo_vectorized: n/(n-1)(s - mean) = (-2, 2) for the pair; a group of one gets 0 (rloo keeps 5)
    adv, _ = A.rloo_vectorized(r, m, index)
    assert adv[:, 0].tolist() == pytest.approx([-2.0, 2.0, 0.0])
    assert A.rloo(r, m, index)[0][2, 0].item() == 5.0


def test_grpo_vectorized_floors_the_variance_at_eps():
    # a pair 0.5 apart... and a pair 1e-4 apart: var 5e-9 < eps, std floored to sqrt(1e-6) = 1e-3
    r, m = _outcome([0.0, 1e-4])
    adv, _ = A.grpo_vectorized(r, m, torch.tensor([0, 0]))
    assert adv[1, 0].item() == pytest.approx(0.5e-4 / (1e-3 + 1e-6), rel=1e-9)
    assert A.grpo(r, m, torch.tensor([0, 0]))[0][1, 0].item() == pytest.approx(
        0.5e-4 / (math.sqrt(5e-9) + 1e-6), rel=1e-9
    )
    # a constant group is still exactly 0
    r, m = _outcome([0.7] * 64)
    assert torch.count_nonzero(A.grpo_vectorized(r.float(), m, torch.zeros(64, dtype=torch.long))[0]) == 0


@settings(max_examples=30, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.floats(-5, 5)), min_size=1, max_size=24))
def test_rloo_vectorized_matches_a_plain_leave_one_out_loop(rows):
    index = torch.tensor([g for g, _ in rows])
    r, m = _outcome([s for _, s in rows])
    adv, _ = A.rloo_vectorized(r, m, index)
    for i, (g, s) in enumerate(rows):
        others = [v for j, (h, v) in enumerate(rows) if h == g and j != i]
        want = s - sum(others) / len(others) if others else 0.0
        assert adv[i, 0].item() == pytest.approx(want, rel=1e-9, abs=1e-9)


# ---------------------------------------------------------------- from-verl maps them


@pytest.mark.parametrize(
    ("override", "suite_key", "value"),
    [
        ("actor_rollout_ref.actor.policy_loss.loss_mode=sapo", "loss_mode", "sapo"),
        ("actor_rollout_ref.actor.policy_loss.loss_mode=geo_mean", "loss_mode", "geo_mean"),
        ("actor_rollout_ref.actor.loss_agg_mode=token-sum", "loss_agg_mode", "token-sum"),
        ("algorithm.adv_estimator=rloo_vectorized", "adv_estimator", "rloo_vectorized"),
        ("algorithm.adv_estimator=grpo_vectorized", "adv_estimator", "grpo_vectorized"),
    ],
)
def test_from_verl_maps_the_new_keys(tmp_path, override, suite_key, value):
    from verlaudit.verl.launch import read_launch
    from verlaudit.verl.mapping import map_launch

    script = tmp_path / "job.sh"
    script.write_text(f"python3 -m verl.trainer.main_ppo algorithm.adv_estimator=grpo {override}\n")
    mapped = map_launch(read_launch(str(script)), target="cpu")
    assert mapped.train["algo"][suite_key] == value
    assert not [r for r in mapped.records if r.kind == "unmapped" and r.verl == override.split("=")[0]]


def test_from_verl_maps_sapo_temperatures_and_straight_through_kl(tmp_path):
    from verlaudit.verl.launch import read_launch
    from verlaudit.verl.mapping import map_launch

    script = tmp_path / "job.sh"
    script.write_text(
        "python3 -m verl.trainer.main_ppo algorithm.adv_estimator=grpo "
        "actor_rollout_ref.actor.policy_loss.loss_mode=sapo actor_rollout_ref.actor.tau_pos=0.8 "
        "actor_rollout_ref.actor.use_kl_loss=true actor_rollout_ref.actor.kl_loss_type=k3+\n"
    )
    algo = map_launch(read_launch(str(script)), target="cpu").train["algo"]
    assert (algo["tau_pos"], algo["kl_loss_type"]) == (0.8, "k3+")
