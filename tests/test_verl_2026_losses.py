"""verl's policy-loss keys of 2026 that from-verl refused before: ``dppo_tv`` / ``dppo_kl`` (DPPO), ``dro``
(``dro_beta``), the ``bypass_mode`` loss with ``rollout_correction.bypass_mode`` / ``loss_type``, and the
two-sided ``rollout_is_threshold: "lower_upper"`` (IcePop); each against hand-worked values (in the comments)
and a plain reference loop, with verl's defaults, refused where verl refuses, and mapped by from-verl. Also the
IS-metric forms of verl 0.8 and 0.9 (`trainer.verl_versions`).

Run: PYTHONPATH=. pytest -q tests/test_verl_2026_losses.py
"""

import math

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from trainer import losses as L
from trainer.config import AlgoConfig, RolloutCorrectionConfig, TrainConfig
from trainer.mismatch import is_weights

D = torch.float64
LN = math.log


def t(x):
    return torch.tensor(x, dtype=D)


def _grad(fn, lp):
    lp = lp.clone().requires_grad_(True)
    out = fn(lp)
    out.loss.backward()
    return out, lp.grad


# ---------------------------------------------------------------- DPPO


def test_dppo_tv_hand_values():
    # pi_old 0.5 everywhere, bounds 0.2 (verl's clip_ratio_low / high), clip_ratio_c 3:
    # t0 pi 0.6, A +1: moved +0.1 <= 0.2, kept: -1 * 1.2 * ln 0.6
    # t1 pi 0.8, A +1: moved +0.3 > 0.2, dropped
    # t2 pi 0.2, A -1: moved -0.3 < -0.2, dropped
    # t3 pi 0.4, A -1: moved -0.1, kept: +1 * 0.8 * ln 0.4
    lp = t([[LN(0.6), LN(0.8), LN(0.2), LN(0.4)]])
    old = t([[LN(0.5)] * 4])
    adv = t([[1.0, 1.0, -1.0, -1.0]])
    out, g = _grad(lambda x: L.policy_loss("dppo_tv", x, old, adv, torch.ones(1, 4)), lp)
    assert out.loss.item() == pytest.approx((-1.2 * LN(0.6) + 0.8 * LN(0.4)) / 4, rel=1e-12)
    assert out.clipfrac.item() == 0.5 and out.clipfrac_lower.item() == 0.0
    # the gradient in logp is -A sg[min(r, c)] on the kept tokens, over the 4 tokens
    assert g[0].tolist() == pytest.approx([-1.2 / 4, 0.0, 0.0, 0.8 / 4], rel=1e-12)
    assert out.ppo_kl.item() == pytest.approx(-(LN(1.2) + LN(1.6) + LN(0.4) + LN(0.8)) / 4, rel=1e-12)


def test_dppo_truncates_the_ratio_at_clip_ratio_c():
    # pi_old 0.1, pi 0.5, A -1: moved +0.4, kept (a negative advantage only bounds a fall); r = 5 -> 3
    lp, old, adv = t([[LN(0.5)]]), t([[LN(0.1)]]), t([[-1.0]])
    out = L.policy_loss("dppo_tv", lp, old, adv, torch.ones(1, 1))
    assert out.loss.item() == pytest.approx(3.0 * LN(0.5), rel=1e-12)
    assert out.clipfrac.item() == 0.0 and out.clipfrac_lower.item() == 1.0  # verl's: kept and truncated
    wide = L.policy_loss("dppo_tv", lp, old, adv, torch.ones(1, 1), L.PolicyLossParams(clip_ratio_c=20.0))
    assert wide.loss.item() == pytest.approx(5.0 * LN(0.5), rel=1e-12)


def _binary_kl(p_old, p):
    return p_old * (LN(p_old) - LN(p)) + (1 - p_old) * LN((1 - p_old + 1e-8) / (1 - p + 1e-8))


def test_dppo_kl_hand_values():
    # pi_old 0.5; pi 0.8: KL = 0.5 ln(0.5/0.8) + 0.5 ln(0.5/0.2) = 0.5 ln 1.5625 = 0.2231 > 0.2
    # pi 0.6: KL = 0.5 ln(0.5/0.6) + 0.5 ln(0.5/0.4) = 0.0204
    assert _binary_kl(0.5, 0.8) == pytest.approx(0.5 * LN(1.5625), rel=1e-6)
    lp = t([[LN(0.8), LN(0.6), LN(0.8), LN(0.2)]])
    old = t([[LN(0.5)] * 4])
    adv = t([[1.0, 1.0, -1.0, -1.0]])
    # t0 A+ KL 0.223 and a rise: dropped; t1 A+ KL 0.02: kept; t2 A- a rise: kept whatever the KL;
    # t3 A- KL(0.5, 0.2) = 0.223 and a fall: dropped
    out = L.policy_loss("dppo_kl", lp, old, adv, torch.ones(1, 4))
    want = (-1.2 * LN(0.6) + 1.6 * LN(0.8)) / 4
    assert out.loss.item() == pytest.approx(want, rel=1e-9) and out.clipfrac.item() == 0.5


def _dppo_reference(kind, lp, old, adv, low, high, c):
    """A plain loop over the tokens of one row with math: verl's DPPO token losses and their mean."""
    total = 0.0
    for lpt, oldt, a in zip(lp, old, adv):
        p, p_old = math.exp(lpt), math.exp(oldt)
        if kind == "dppo_tv":
            keep = p - p_old <= high if a > 0 else p - p_old >= -low
        else:
            kl = _binary_kl(p_old, p)
            keep = (kl <= high or p <= p_old) if a > 0 else (kl <= low or p >= p_old)
        ratio = math.exp(max(-20.0, min(20.0, lpt - oldt)))
        total += -a * min(ratio, c) * lpt if keep else 0.0
    return total / len(lp)


@settings(max_examples=40, deadline=None)
@given(
    st.sampled_from(["dppo_tv", "dppo_kl"]),
    st.lists(
        st.tuples(st.floats(0.01, 0.99), st.floats(0.01, 0.99), st.floats(-2, 2)), min_size=1, max_size=8
    ),
    st.floats(0.01, 0.5),
    st.floats(0.01, 0.5),
)
def test_dppo_matches_a_plain_loop(kind, tokens, low, high):
    p, p_old, adv = zip(*tokens)
    lp, old = [LN(x) for x in p], [LN(x) for x in p_old]
    # a divergence within rounding of a bound may be kept or dropped (torch's exp and log are not libm's)
    divergences = [x - y for x, y in zip(p, p_old)] + [_binary_kl(y, x) for x, y in zip(p, p_old)]
    assume(all(abs(abs(d) - b) > 1e-9 for d in divergences for b in (low, high)))
    params = L.PolicyLossParams(clip_ratio_low=low, clip_ratio_high=high, clip_ratio_c=3.0)
    got = L.policy_loss(kind, t([lp]), t([old]), t([list(adv)]), torch.ones(1, len(lp)), params).loss.item()
    assert got == pytest.approx(_dppo_reference(kind, lp, old, adv, low, high, 3.0), rel=1e-9, abs=1e-12)


# ---------------------------------------------------------------- DRO


def test_dro_hand_values_and_gradient():
    # logp -1, old -1.5, A 2, beta 0.5: -(2 * -1 - 0.25 * 0.25) = 2.0625; d/dlogp = -(A - beta (logp - old))
    # = -(2 - 0.25) = -1.75
    p = L.PolicyLossParams(dro_beta=0.5)
    out, g = _grad(
        lambda x: L.policy_loss("dro", x, t([[-1.5]]), t([[2.0]]), torch.ones(1, 1), p), t([[-1.0]])
    )
    assert out.loss.item() == pytest.approx(2.0625) and g.item() == pytest.approx(-1.75)
    assert out.ppo_kl.item() == pytest.approx(-0.5) and out.clipfrac.item() == 0.0
    with pytest.raises(ValueError, match="dro_beta: must be > 0 with loss_mode dro"):
        L.policy_loss("dro", t([[-1.0]]), t([[-1.5]]), t([[2.0]]), torch.ones(1, 1))


def test_dro_config_follows_verl():
    assert AlgoConfig().dro_beta is None  # verl's actor.policy_loss.dro_beta: null, required with dro
    with pytest.raises(ValueError, match="dro_beta: must be set > 0 with loss_mode: dro"):
        AlgoConfig(name="grpo", loss_mode="dro")
    with pytest.raises(ValueError, match="dro_beta: set to 0.1 but nothing reads it: needs loss_mode: dro"):
        AlgoConfig(name="grpo", dro_beta=0.1)
    with pytest.raises(ValueError, match="rollout_correction.rollout_is: not with algo.loss_mode: dro"):
        TrainConfig.from_dict(
            {
                "algo": {"name": "grpo", "loss_mode": "dro", "dro_beta": 0.1},
                "rollout_correction": {"rollout_is": "token"},
            }
        )
    AlgoConfig(name="grpo", loss_mode="dro", dro_beta=0.1)


# ---------------------------------------------------------------- bypass mode


def _bypass(**rc):
    return L.PolicyLossParams(
        bypass=L.Bypass(RolloutCorrectionConfig(bypass_mode=True, **rc), rc.get("loss_type", "ppo_clip"))
    )


def test_bypass_ppo_clip_without_a_correction_is_vanilla_against_the_rollout():
    torch.manual_seed(0)
    lp, roll, adv = (
        torch.randn(3, 5, dtype=D) * 0.3 - 1,
        torch.randn(3, 5, dtype=D) * 0.3 - 1,
        torch.randn(3, 5, dtype=D),
    )
    mask = (torch.rand(3, 5) > 0.3).to(D)
    b, gb = _grad(lambda x: L.policy_loss("bypass_mode", x, roll, adv, mask, _bypass()), lp)
    v, gv = _grad(lambda x: L.policy_loss("vanilla", x, roll, adv, mask), lp)
    assert b.loss.item() == v.loss.item() and torch.equal(gb, gv)
    assert (
        b.metrics.keys() == v.metrics.keys()
    )  # vanilla's own (trainer.update_stats), no rollout_corr/* ones


def test_bypass_rejects_in_the_loss_and_keeps_the_mini_batch_denominator():
    # current / rollout ratios e^0.1, e^1, e^0 on three tokens; token_k1 bounds [1/2, 2]: the second leaves the loss
    # ppo_clip: token-mean over all 3 tokens of the mini-batch (verl's global batch info), the rejected one 0
    roll = t([[-1.0, -2.0, -1.0]])
    lp = roll + t([[0.1, 1.0, 0.0]])
    adv = t([[1.0, 1.0, -1.0]])
    p = _bypass(rollout_rs="token_k1", rollout_rs_threshold=2.0)
    out = L.policy_loss("bypass_mode", lp, roll, adv, torch.ones(1, 3), p)
    # t0: -A min(r, 1.2) with r = e^0.1 = 1.105 -> -1.105; t2: r = 1 -> +1
    assert out.loss.item() == pytest.approx((-math.exp(0.1) + 1.0) / 3, rel=1e-12)
    assert out.metrics["rollout_corr/rollout_rs_masked_fraction"] == pytest.approx(1 / 3)


def test_bypass_reinforce_weights_the_policy_gradient():
    # loss_type reinforce, token IS truncated at 2: ratios e^0.1 and e^1 -> w 1.105, 2; -A w logp, token-mean
    roll = t([[-1.0, -2.0]])
    lp = roll + t([[0.1, 1.0]])
    adv = t([[1.0, -0.5]])
    p = _bypass(rollout_is="token", rollout_is_threshold=2.0, loss_type="reinforce")
    out, g = _grad(lambda x: L.policy_loss("bypass_mode", x, roll, adv, torch.ones(1, 2), p), lp)
    w = [math.exp(0.1), 2.0]
    # the weights are fp32, as verl's; they carry no gradient
    assert out.loss.item() == pytest.approx((-w[0] * -0.9 + 0.5 * w[1] * -1.0) / 2, abs=1e-7)
    assert g[0].tolist() == pytest.approx([-w[0] / 2, 0.5 * w[1] / 2], rel=1e-6)
    assert out.ppo_kl.item() == pytest.approx(-0.55) and out.metrics["rollout_corr/rollout_is_mean"] > 0
    plain = L.policy_loss("bypass_mode", lp, roll, adv, torch.ones(1, 2), _bypass(loss_type="reinforce"))
    assert plain.loss.item() == pytest.approx((0.9 - 0.5) / 2, rel=1e-12)  # no rollout_is: -A logp


def test_bypass_mode_and_its_loss_go_together():
    grpo = {"name": "grpo"}
    TrainConfig.from_dict(
        {"algo": {**grpo, "loss_mode": "bypass_mode"}, "rollout_correction": {"bypass_mode": True}}
    )
    with pytest.raises(ValueError, match="algo.loss_mode: vanilla with rollout_correction.bypass_mode: true"):
        TrainConfig.from_dict({"algo": grpo, "rollout_correction": {"bypass_mode": True}})
    with pytest.raises(
        ValueError, match="rollout_correction.bypass_mode: bypass_mode with rollout_correction"
    ):
        TrainConfig.from_dict({"algo": {**grpo, "loss_mode": "bypass_mode"}})
    with pytest.raises(
        ValueError, match="loss_type: set to 'reinforce' but nothing reads it: needs bypass_mode"
    ):
        RolloutCorrectionConfig(loss_type="reinforce")
    with pytest.raises(ValueError, match="loss_type: 'ppo'; expected one of ppo_clip, reinforce"):
        RolloutCorrectionConfig(bypass_mode=True, loss_type="ppo")
    with pytest.raises(ValueError, match="DPO has no rollout to correct"):
        TrainConfig.from_dict({"algo": {"name": "dpo"}, "rollout_correction": {"bypass_mode": True}})
    assert (RolloutCorrectionConfig().bypass_mode, RolloutCorrectionConfig().loss_type) == (False, "ppo_clip")


def test_a_grpo_step_in_bypass_mode_runs_the_correction_in_the_loss():
    from trainer.train import train

    algo = {"name": "grpo", "loss_mode": "bypass_mode", "batch_size": 2, "group_size": 2, "mini_batch_size": 4,
            "micro_batch_size": 2}  # fmt: skip
    rc = {"bypass_mode": True, "loss_type": "reinforce", "rollout_is": "token", "rollout_rs": "token_k1",
          "rollout_rs_threshold": 2.0}  # fmt: skip
    data = {"prompt_length": 12, "response_length": 4, "num_examples": 16}
    cfg = {"algo": algo, "data": data, "rollout_correction": rc, "steps": 1, "device": "cpu", "seed": 0}
    metrics = train(TrainConfig.from_dict(cfg)).final
    # the correction ran in the loss (its metrics are the micro-batches'), not between the reward and the advantages
    assert "rollout_corr/rollout_is_mean" in metrics and "rollout_corr/rollout_rs_masked_fraction" in metrics
    assert math.isfinite(metrics["actor/pg_loss"])


# ---------------------------------------------------------------- IcePop: rollout_is_threshold "lower_upper"


def test_the_threshold_is_a_number_or_lower_upper():
    assert RolloutCorrectionConfig(rollout_is_threshold=2.0).is_bounds() == (None, 2.0)
    assert RolloutCorrectionConfig(rollout_is_threshold="3").is_bounds() == (
        None,
        3.0,
    )  # verl: a number-like string
    assert RolloutCorrectionConfig(rollout_is_threshold="0.5_5.0").is_bounds() == (0.5, 5.0)
    for bad, why in (
        ("5_0.5", "needs 0 < lower <= upper"),
        ("a_b", "not a number or lower_upper"),
        (0.0, "> 0"),
    ):
        with pytest.raises(ValueError, match=f"rollout_is_threshold: .*{why}"):
            RolloutCorrectionConfig(rollout_is_threshold=bad)
    with pytest.raises(ValueError, match="lower_upper \\(IcePop\\) is verl 0.8's on"):
        TrainConfig.from_dict(
            {
                "algo": {"name": "grpo", "verl_version": "0.7"},
                "rollout_correction": {"rollout_is_threshold": "0.5_2"},
            }
        )


def test_icepop_weights_and_metrics_hand_values():
    # raw token ratios 4, 1.5, 1, 0.25 with bounds [0.5, 2]: weights 0, 1.5, 1, 0 (zeroed, not truncated)
    log_ratio = t([[LN(4.0), LN(1.5), 0.0, LN(0.25)]])
    w, m = is_weights(log_ratio, torch.ones(1, 4), "token", 2.0, lower=0.5, truncated_metrics=True)
    assert w[0].tolist() == pytest.approx([0.0, 1.5, 1.0, 0.0])
    assert m["rollout_is_oob_ratio"] == 0.5 and m["rollout_is_mean"] == pytest.approx(2.5 / 4)
    assert (m["rollout_is_max"], m["rollout_is_min"]) == pytest.approx((1.5, 0.0))
    assert m["rollout_is_ratio_fraction_high"] == 0.25 and m["rollout_is_ratio_fraction_low"] == 0.25
    # std and ESS of the weights clamped to [0, 2]: mean 0.625, E[w^2] = 0.8125
    assert m["rollout_is_std"] == pytest.approx(math.sqrt(0.8125 - 0.625**2), rel=1e-6)
    assert m["rollout_is_eff_sample_size"] == pytest.approx(0.625**2 / 0.8125, rel=1e-6)


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.floats(-3, 3), min_size=1, max_size=10),
    st.floats(0.1, 1.0),
    st.floats(1.0, 5.0),
    st.booleans(),
)
def test_icepop_weights_match_a_plain_loop(log_ratios, lower, upper, sequence):
    level = "sequence" if sequence else "token"
    w, _ = is_weights(
        t([log_ratios]), torch.ones(1, len(log_ratios)), level, upper, lower=lower, truncated_metrics=True
    )
    raws = [math.exp(sum(log_ratios))] * len(log_ratios) if sequence else [math.exp(x) for x in log_ratios]
    # a weight within fp32's rounding of a bound may fall on either side of it (the weights are fp32, as verl's)
    assume(all(abs(r - bound) > 1e-5 * bound for r in raws for bound in (lower, upper)))
    want = [r if lower <= r <= upper else 0.0 for r in raws]
    assert w[0].tolist() == pytest.approx(want, rel=1e-6)  # the weights are fp32, as verl's


def test_the_correction_reads_the_two_bounds():
    from trainer.mismatch import rollout_correction

    roll = t([[-1.0, -1.0, -1.0]])
    old = roll + t([[LN(3.0), 0.0, LN(0.1)]])
    c = rollout_correction(
        roll, old, torch.ones(1, 3), RolloutCorrectionConfig(rollout_is="token", rollout_is_threshold="0.2_2")
    )
    assert c.weights[0].tolist() == pytest.approx([0.0, 1.0, 0.0]) and torch.equal(c.mask, torch.ones(1, 3))


# ---------------------------------------------------------------- the IS metrics of verl 0.8 and 0.9


def test_sequence_weight_max_min_stay_raw_and_std_floors_at_zero_from_verl_0_8():
    # one sequence of log-ratio sum ln 8 (raw weight 8, truncated at 2): verl reports max 8 in both forms
    log_ratio = t([[LN(2.0), LN(4.0)]])
    _, new = is_weights(log_ratio, torch.ones(1, 2), "sequence", 2.0, truncated_metrics=True)
    _, old = is_weights(log_ratio, torch.ones(1, 2), "sequence", 2.0)
    assert new["rollout_is_max"] == pytest.approx(8.0) and old["rollout_is_max"] == pytest.approx(8.0)
    assert new["rollout_is_mean"] == pytest.approx(2.0) and old["rollout_is_mean"] == pytest.approx(8.0)
    # token weights 0.25 and 1, C 2: 0.8 on clamps them to [0, 2] for the std (0.375), before to [0.5, 2] (0.25)
    low = t([[LN(0.25), 0.0]])
    _, new = is_weights(low, torch.ones(1, 2), "token", 2.0, truncated_metrics=True)
    _, old = is_weights(low, torch.ones(1, 2), "token", 2.0)
    assert new["rollout_is_std"] == pytest.approx(0.375) and old["rollout_is_std"] == pytest.approx(0.25)


def test_sequence_fractions_are_of_the_raw_weights_from_verl_0_9():
    # two rows: token ratios (4, 4) -> raw mean 4 > C = 2, truncated mean 2 (not above); (1, 1)
    log_ratio = t([[LN(4.0), LN(4.0)], [0.0, 0.0]])
    mask = torch.ones(2, 2)
    _, v09 = is_weights(log_ratio, mask, "token", 2.0, truncated_metrics=True)
    _, v08 = is_weights(log_ratio, mask, "token", 2.0, truncated_metrics=True, raw_seq_fractions=False)
    assert v09["rollout_is_seq_fraction_high"] == 0.5 and v08["rollout_is_seq_fraction_high"] == 0.0
    assert v09["rollout_is_seq_mean"] == v08["rollout_is_seq_mean"] == pytest.approx(1.5)


# ---------------------------------------------------------------- named and mapped


def test_verl_keys_name_the_new_options():
    from verlaudit import verl_keys as V

    assert V.algo_key("dro_beta") == "actor_rollout_ref.actor.policy_loss.dro_beta"
    assert V.correction_key("bypass_mode") == "algorithm.rollout_correction.bypass_mode"
    assert (
        V.correction_override("loss_type", "reinforce") == "algorithm.rollout_correction.loss_type=reinforce"
    )


def test_from_verl_maps_the_new_losses(tmp_path):
    from verlaudit.verl.launch import read_launch
    from verlaudit.verl.mapping import map_launch

    def mapped(overrides):
        script = tmp_path / "job.sh"
        script.write_text(f"python3 -m verl.trainer.main_ppo algorithm.adv_estimator=grpo {overrides}\n")
        m = map_launch(read_launch(str(script)), target="cpu")
        assert not [r for r in m.records if r.kind == "unmapped"], m.records
        TrainConfig.from_dict({k: v for k, v in m.train.items() if k in ("algo", "rollout_correction")})
        return m.train

    pl = "actor_rollout_ref.actor.policy_loss"
    assert mapped(f"{pl}.loss_mode=dppo_kl")["algo"]["loss_mode"] == "dppo_kl"
    algo = mapped(f"{pl}.loss_mode=dro {pl}.dro_beta=0.05")["algo"]
    assert (algo["loss_mode"], algo["dro_beta"]) == ("dro", 0.05)
    rc = "algorithm.rollout_correction"
    train = mapped(
        f"{rc}.bypass_mode=true {rc}.loss_type=reinforce {rc}.rollout_is=token {rc}.rollout_is_threshold=0.5_5.0"
    )
    assert train["algo"]["loss_mode"] == "bypass_mode"  # verl's apply_bypass_mode replaces the loss_mode
    assert train["rollout_correction"] == {
        "bypass_mode": True, "loss_type": "reinforce", "rollout_is": "token", "rollout_is_threshold": "0.5_5.0"
    }  # fmt: skip
