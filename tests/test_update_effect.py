"""What a legal key did to the update (verlaudit/audit/update_effect.py, trainer/update_stats.py): the
trainer's metrics of a clip's share, the trust region and a preference loss's direction are hand-worked
on the real losses, each check fires on several members of its family (not only the bench item that
motivated it) with the key and a fix, and the clean controls' numbers pass."""

from __future__ import annotations

import math

import pytest
import torch

from trainer import losses as L
from trainer.config import TrainConfig
from trainer.train import train
from trainer.update_stats import dpo_direction, ratio_metrics
from verlaudit import kinds as K
from verlaudit.audit.dynamics import DynamicsWatch

PPO = {"name": "ppo", "batch_size": 8, "mini_batch_size": 4, "ppo_epochs": 2, "clip_ratio": 0.2,
       "loss_mode": "vanilla", "max_grad_norm": 1.0, "cliprange_value": 0.5}  # fmt: skip
GRPO = {"name": "grpo", "batch_size": 4, "group_size": 4, "mini_batch_size": 8, "ppo_epochs": 4,
        "clip_ratio": 0.2, "loss_mode": "vanilla", "max_grad_norm": 1.0, "norm_adv_by_std_in_grpo": True}  # fmt: skip
DPO = {"name": "dpo", "batch_size": 8, "mini_batch_size": 8, "beta": 0.1, "dpo_loss": "sigmoid",
       "label_smoothing": 0.0, "max_grad_norm": 1.0}  # fmt: skip


def _run(algo, *steps, correction=None):
    w = DynamicsWatch(algo, correction=correction)
    return [f for i, m in enumerate(steps) for f in w.step_end(m, step=i)]


def _kinds(found):
    return [f.kind for f in found]


# ---------------------------------------------------------------- the trainer's metrics, hand-worked


def test_ratio_metrics_split_the_clip_by_side_and_count_tokens_past_the_usual_bound():
    # ratios 1.5 (A>0), 0.5 (A<0), 1.0 (A>0): an upper bound of 3.8 clips nothing above, a lower 0.8 clips 0.5
    lp = torch.tensor([[math.log(1.5), math.log(0.5), 0.0]])
    adv, mask, old = torch.tensor([[1.0, -1.0, 1.0]]), torch.ones(1, 3), torch.zeros(1, 3)
    typo = L.ppo_policy_loss(lp, old, adv, mask, L.PolicyLossParams(clip_ratio_low=0.2, clip_ratio_high=2.8))
    m = {k: float(v) for k, v in typo.metrics.items()}
    assert m["actor/pg_clipfrac_high"] == 0.0 and m["actor/pg_clipfrac_low"] == pytest.approx(1 / 3)
    assert m["actor/ratio_outside_usual_high"] == pytest.approx(1 / 3)  # 1.5 > 1.28, unclipped
    assert m["actor/ratio_outside_usual_low"] == pytest.approx(1 / 3)  # 0.5 < 0.8, clipped
    assert m["actor/ratio_max"] == pytest.approx(1.5) and m["actor/ratio_min"] == pytest.approx(0.5)
    assert m["actor/logratio_adv_pos"] == pytest.approx(math.log(1.5) / 2)
    usual = L.ppo_policy_loss(
        lp, old, adv, mask, L.PolicyLossParams(clip_ratio_low=0.2, clip_ratio_high=0.28)
    )
    assert float(usual.metrics["actor/pg_clipfrac_high"]) == pytest.approx(1 / 3)
    # the side fractions add up to verl's pg_clipfrac; a loss without a clip clips nothing
    assert float(
        usual.metrics["actor/pg_clipfrac_high"] + usual.metrics["actor/pg_clipfrac_low"]
    ) == pytest.approx(float(usual.clipfrac))
    free = ratio_metrics(lp - old, adv, mask)
    assert float(free["actor/pg_clipfrac_high"]) == 0.0 and float(free["actor/pg_clipfrac_low"]) == 0.0
    gpg = L.gpg_policy_loss(lp, old, adv, mask)
    assert float(gpg.metrics["actor/ratio_outside_usual_high"]) == pytest.approx(1 / 3)


def test_dpo_direction_reads_which_way_each_loss_moves_the_chosen_answer():
    z = torch.zeros(4)
    c, r = torch.tensor([0.5, 1.0, 2.0, 0.2]), torch.tensor([-0.5, -1.0, -2.0, -3.0])
    lengths = {"chosen_lengths": torch.full((4,), 3.0), "rejected_lengths": torch.full((4,), 3.0)}

    def d(loss, beta=0.1):
        return {k: float(v) for k, v in dpo_direction(L.dpo_loss, c, r, z, z, beta, loss, **lengths).items()}

    sig = d("sigmoid")  # -dL/dc = beta sigmoid(-beta h) = -(-dL/dr)
    h = c - r
    assert sig["dpo/chosen_pull"] == pytest.approx(float((0.1 * torch.sigmoid(-0.1 * h)).mean()), rel=1e-5)
    assert (
        sig["dpo/chosen_pull"] == pytest.approx(-sig["dpo/rejected_pull"])
        and sig["dpo/chosen_pushed_down_frac"] == 0
    )
    down = d("apo_down")  # beta s'(beta c) - beta s'(beta h) > 0 where |h| > |c|: the chosen is lowered
    assert down["dpo/chosen_pushed_down_frac"] == 1.0 and down["dpo/chosen_pull"] < 0
    assert d("ipo", beta=50.0)["dpo/chosen_pushed_down_frac"] == 1.0  # target margin 1/(2 beta) = 0.01
    assert d("apo_zero")["dpo/chosen_pull"] > 0 and d("hinge")["dpo/chosen_pushed_down_frac"] == 0


# ---------------------------------------------------------------- the gradient clip


def test_a_max_grad_norm_far_below_the_gradient_norm_is_the_update():
    # the bench's 1e-4, a clip 300x below the norm, and one on the critic alone (values far off)
    for algo, steps in (
        ({**PPO, "max_grad_norm": 1e-4}, [{"actor/grad_norm": 1.93, "critic/grad_norm": 0.17}] * 3),
        (
            {**GRPO, "max_grad_norm": 0.015},
            [{"actor/grad_norm": 1.24}, {"actor/grad_norm": 1.9}],
        ),  # 100x below
        ({**PPO, "max_grad_norm": 0.05}, [{"actor/grad_norm": 0.8, "critic/grad_norm": 40.0}] * 2),
    ):
        (f,) = _run(algo, *steps)
        assert f.kind == K.GRAD_CLIP_TOTAL and f.where == "algo.max_grad_norm" and f.step == 1
        assert "algo.max_grad_norm: 1" in f.fix and "actor_rollout_ref.actor.grad_clip=1" in f.fix
    assert "critic.grad_clip" in f.fix and f.role == "critic"
    # the controls: norms 0.1-3 at max_grad_norm 1; a single step's spike is what a clip is for; 0 is off
    assert _run(PPO, *[{"actor/grad_norm": 2.9, "critic/grad_norm": 0.6}] * 3) == []
    assert _run({**DPO, "max_grad_norm": 0.5}, *[{"actor/grad_norm": n} for n in (11.4, 19.7, 10.9)]) == []
    assert _run({**PPO, "max_grad_norm": 0.01}, {"actor/grad_norm": 5.0}, {"actor/grad_norm": 0.3}) == []
    assert _run({**PPO, "max_grad_norm": 0.0}, *[{"actor/grad_norm": 500.0}] * 3) == []


# ---------------------------------------------------------------- an update that does not move the weights


def test_a_learning_rate_that_leaves_the_weights_where_they_were():
    frozen = [{"actor/update_rel": 2e-12, "actor/lr": 1e-12, "actor/grad_norm": 1.3}] * 2
    (f,) = _run({**GRPO, "lr": 1e-12}, *frozen)
    assert (
        f.kind == K.NULL_UPDATE and f.where == "algo.lr" and "actor_rollout_ref.actor.optim.lr=1e-06" in f.fix
    )
    critic = [
        {"critic/update_rel": 0.0, "critic/lr": 1e-10, "critic/grad_norm": 0.4, "actor/update_rel": 0.01}
    ] * 2
    (f,) = _run({**PPO, "critic_lr": 1e-10}, *critic)
    assert f.where == "algo.critic_lr" and f.role == "critic" and "critic.optim.lr=1e-05" in f.fix
    dpo = [{"actor/update_rel": 1e-10, "actor/lr": 1e-9, "actor/grad_norm": 5.0}] * 3
    assert _kinds(_run({**DPO, "lr": 1e-9}, *dpo)) == [K.NULL_UPDATE]
    # a usual lr whose bf16 updates round away is update_underflow's; a lr that moves the weights passes
    assert _run(GRPO, *[{"actor/update_rel": 0.0, "actor/lr": 1e-6, "actor/grad_norm": 1.0}] * 2) == []
    # a low lr whose steps move the weights far more than Adam at that lr would: the lr is not the step's size
    moved = {"actor/update_rel": 3e-4, "actor/lr": 5e-8, "actor/weight_rms": 0.02, "actor/grad_norm": 1.0}
    assert _run({**GRPO, "lr": 5e-8}, *[moved] * 2) == []


# ---------------------------------------------------------------- the value clip


def test_a_value_clip_that_holds_the_critic_to_its_old_values():
    for c, std, fracs in ((0.0, 0.07, (0.05, 0.48, 0.19)), (0.001, 0.3, (0.4, 0.5)), (0.5, 20.0, (0.3, 0.4))):
        steps = [{"critic/vf_clipfrac": f, "critic/returns/std": std} for f in fracs]
        found = _run({**PPO, "cliprange_value": c}, *steps)
        assert _kinds(found) == [K.VALUE_CLIP_TOTAL], (c, std)
        assert found[0].where == "algo.cliprange_value" and "critic.cliprange_value=0.5" in found[0].fix
    # the controls: clip 0.5 against returns in [0, 1] clips (almost) nothing; a wide clip that binds is no total clip
    assert _run(PPO, *[{"critic/vf_clipfrac": 0.02, "critic/returns/std": 0.1}] * 3) == []
    assert _run(PPO, *[{"critic/vf_clipfrac": 0.4, "critic/returns/std": 0.3}] * 3) == []


# ---------------------------------------------------------------- the trust region


def _side(high_past=0.0, high_clip=0.0, low_past=0.0, low_clip=0.0, kl=0.02):
    return {"actor/ratio_outside_usual_high": high_past, "actor/pg_clipfrac_high": high_clip,
            "actor/ratio_outside_usual_low": low_past, "actor/pg_clipfrac_low": low_clip, "actor/ppo_kl": kl,
            "actor/ratio_max": 1.9, "actor/ratio_min": 0.6}  # fmt: skip


def test_an_opened_clip_side_with_tokens_past_the_usual_bound_has_no_trust_region():
    cases = (  # (algo, correction, step metrics, the key named, the fix)
        ({**GRPO, "clip_ratio_high": 2.8}, None, _side(0.19, 0.0, 0.3, 0.3), "algo.clip_ratio_high", "0.28"),
        ({**GRPO, "clip_ratio_low": 0.99}, None, _side(0.1, 0.1, 0.25, 0.0), "algo.clip_ratio_low", "0.2"),
        ({**PPO, "clip_ratio": 0.9}, None, _side(0.12, 0.0, 0.2, 0.01), "algo.clip_ratio", "clip_ratio: 0.2"),
        ({**GRPO, "loss_mode": "gpg"}, None, _side(0.2, 0.0, 0.3), "algo.loss_mode", "vanilla"),
        ({**GRPO, "loss_mode": "bypass_mode"}, {"bypass_mode": True, "loss_type": "reinforce"},
         _side(0.13, 0.0, 0.21), "rollout_correction.loss_type", "ppo_clip"),
    )  # fmt: skip
    for algo, corr, m, key, fix in cases:
        found = _run(algo, m, m, correction=corr)
        assert _kinds(found) == [K.NO_TRUST_REGION], key
        assert found[0].where == key and fix in found[0].fix and "trust region" in found[0].message
    # the controls: the usual clip binds what moves past it (its own bound); DAPO's 0.28 is the usual width
    assert _run(GRPO, _side(0.2, 0.2, 0.1, 0.1), _side(0.3, 0.3)) == []
    assert _run({**GRPO, "clip_ratio_high": 0.28}, _side(0.2, 0.2), _side(0.1, 0.1)) == []
    # an opened side the policy does not move past, and PPO-clip in bypass mode (its own clip), pass
    assert _run({**GRPO, "clip_ratio_high": 2.8}, _side(0.01), _side(0.02)) == []
    ppo_clip = {"bypass_mode": True, "loss_type": "ppo_clip"}
    assert _run({**GRPO, "loss_mode": "bypass_mode"}, _side(0.2, 0.2), correction=ppo_clip) == []


# ---------------------------------------------------------------- a preference loss's direction


def _dpo(pull, rej, down, chosen):
    return {"dpo/chosen_pull": pull, "dpo/rejected_pull": rej, "dpo/chosen_pushed_down_frac": down,
            "rewards/chosen": chosen, "logps/chosen": -23.0 + 10 * chosen}  # fmt: skip


def test_a_preference_loss_that_lowers_the_chosen_answers():
    apo = [
        _dpo(-0.0, -0.025, 0.0, -1e-4),
        _dpo(-1e-5, -0.025, 0.25, -0.056),
        _dpo(-1e-5, -0.025, 0.375, -0.108),
    ]
    (f,) = _run({**DPO, "dpo_loss": "apo_down"}, *apo)
    assert f.kind == K.CHOSEN_PUSHED_DOWN and f.where == "algo.dpo_loss" and "dpo_loss: sigmoid" in f.fix
    assert f.step == 1
    ipo = [_dpo(-0.5, 0.5, 1.0, -0.01), _dpo(-0.5, 0.5, 1.0, -0.2)]  # beta 50: the target margin is 0.01
    (f,) = _run({**DPO, "dpo_loss": "ipo", "beta": 50.0}, *ipo)
    assert f.where == "algo.beta" and "beta" in f.fix
    sppo = [_dpo(-1.8, 3.2, 1.0, -0.05), _dpo(-1.5, 3.0, 0.9, -0.3)]
    assert _kinds(_run({**DPO, "dpo_loss": "sppo_hard", "beta": 50.0}, *sppo)) == [K.CHOSEN_PUSHED_DOWN]
    # the controls: sigmoid DPO pulls the chosen up as much as it pushes the rejected down, even while
    # both fall (shared parameters); a loss that lowers the chosen while it stays above the reference waits
    both_fall = [_dpo(0.05, -0.05, 0.0, -0.1), _dpo(0.048, -0.048, 0.0, -0.3), _dpo(0.045, -0.045, 0.0, -0.5)]
    assert _run(DPO, *both_fall) == []
    assert (
        _run({**DPO, "dpo_loss": "apo_down"}, _dpo(-1e-5, -0.025, 0.5, 0.02), _dpo(-1e-5, -0.02, 0.6, 0.01))
        == []
    )


# ---------------------------------------------------------------- real tiny runs


def _tiny(algo: str, **over) -> list[dict]:
    small = {"batch_size": 4, "mini_batch_size": 4, "micro_batch_size": 2, "group_size": 2}
    cfg = TrainConfig.from_dict(
        {
            "algo": {"name": algo, **small, "lr": 2e-3, **over},
            "data": {"prompt_length": 12, "response_length": 4, "num_examples": 64},
            "precision": {"preset": "fp32"},
            "steps": 2,
            "device": "cpu",
            "seed": 0,
        }
    )
    return cfg, train(cfg).history


def _watch(cfg, history):
    d = cfg.to_dict()
    w = DynamicsWatch(d["algo"], correction=d.get("rollout_correction"))
    return [f.kind for i, m in enumerate(history) for f in w.step_end(m, step=i)]


def test_real_tiny_runs_show_the_clip_the_direction_and_nothing_on_defaults():
    cfg, hist = _tiny("ppo", max_grad_norm=1e-4)
    assert K.GRAD_CLIP_TOTAL in _watch(cfg, hist)
    many = {"ppo_epochs": 4, "mini_batch_size": 2, "micro_batch_size": 2}  # 16 optimizer steps a batch
    for side in ({"clip_ratio_high": 2.8}, {"clip_ratio_low": 0.99}):
        cfg, hist = _tiny("grpo", **side, **many)
        assert K.NO_TRUST_REGION in _watch(cfg, hist), side
    cfg, hist = _tiny("grpo", **many)  # the usual clip binds what moves past it (stale, but bounded)
    assert K.NO_TRUST_REGION not in _watch(cfg, hist)
    # its upper bound 1.2 lies inside the usual 1.28: every token past the usual bound is clipped
    assert all(m["actor/pg_clipfrac_high"] >= m["actor/ratio_outside_usual_high"] - 1e-6 for m in hist)
    cfg, hist = _tiny("dpo", dpo_loss="apo_down")
    assert max(m["dpo/chosen_pull"] for m in hist) <= 0.02 * min(abs(m["dpo/rejected_pull"]) for m in hist)
    cfg, hist = _tiny("dpo")
    assert all(m["dpo/chosen_pull"] == pytest.approx(-m["dpo/rejected_pull"], rel=1e-4) for m in hist)
    assert _watch(cfg, hist) == []
    cfg, hist = _tiny("ppo", ppo_epochs=2, mini_batch_size=2, micro_batch_size=2)
    assert _watch(cfg, hist) == []
    assert all(m["actor/update_rel"] > 1e-4 and m["critic/update_rel"] > 1e-4 for m in hist)
    cfg, hist = _tiny("grpo", lr=1e-12)
    assert K.NULL_UPDATE in _watch(cfg, hist) and max(m["actor/update_rel"] for m in hist) < 1e-9
    # the family's members that verlaudit.audit.dynamics weighs by their term's size: an entropy bonus and a
    # KL loss whose gradient outweighs the advantages
    two = {"ppo_epochs": 2, "mini_batch_size": 4, "micro_batch_size": 2}
    cfg, hist = _tiny("grpo", entropy_coef=1.0, **two)
    assert K.ENTROPY_DOMINATES in _watch(cfg, hist)
    cfg, hist = _tiny("grpo", use_kl_loss=True, kl_loss_coef=50.0, **two)
    assert K.KL_DOMINATES in _watch(cfg, hist)


def test_a_dual_clip_just_above_one_holds_the_negative_tokens_that_rose():
    # the real loss: A < 0 tokens at ratios 1.1 and 1.4 are held at -A c for c 1.05 (no gradient), not for c 3
    lp = torch.tensor([[math.log(1.1), math.log(1.4), 0.0, 0.0]], requires_grad=True)
    adv, mask, old = torch.tensor([[-1.0, -1.0, 1.0, -1.0]]), torch.ones(1, 4), torch.zeros(1, 4)
    held = L.ppo_policy_loss(lp, old, adv, mask, L.PolicyLossParams(clip_ratio_c=1.05))
    held.loss.backward()
    assert float(held.clipfrac_lower) == pytest.approx(0.5) and float(lp.grad[0, 0]) == 0.0 == float(
        lp.grad[0, 1]
    )
    assert float(L.ppo_policy_loss(lp, old, adv, mask, L.PolicyLossParams()).clipfrac_lower) == 0.0
    for c, fracs in ((1.05, (0.14, 0.0)), (1.01, (0.3, 0.2)), (1.2, (0.08, 0.06))):
        found = _run({**PPO, "clip_ratio_c": c}, *[{"actor/pg_clipfrac_lower": f} for f in fracs])
        assert _kinds(found) == [K.CLIP_SATURATED] and found[0].where == "algo.clip_ratio_c"
        assert "clip_ratio_c: 3" in found[0].fix
    # verl's default bound 3, and a narrow bound that holds next to nothing, pass
    assert _run({**PPO, "clip_ratio_c": 3.0}, *[{"actor/pg_clipfrac_lower": 0.2}] * 2) == []
    assert _run({**PPO, "clip_ratio_c": 1.05}, *[{"actor/pg_clipfrac_lower": 0.01}] * 2) == []


def test_a_check_that_raises_is_skipped_not_the_run(monkeypatch, capsys):
    from verlaudit.audit.update_effect import UpdateEffect

    def broken(self, step):
        raise ZeroDivisionError("planted")

    monkeypatch.setattr(UpdateEffect, "_grad_clip", broken)
    steps = [{"actor/grad_norm": 1.9, "critic/grad_norm": 0.2}] * 3
    assert _run({**PPO, "max_grad_norm": 1e-4}, *steps) == []
    assert "dynamics/grad_clip_total check failed (ZeroDivisionError: planted)" in capsys.readouterr().err


def test_the_metrics_have_one_key_set_whatever_the_batch():
    # ranks all-reduce a step's metrics by name: a rank with no negative advantage (or no valid token) must
    # emit the same keys as its peers
    from trainer.update_stats import RATIO_KEYS, update_size, weight_sample

    lp, adv = torch.tensor([[0.1, 0.2]]), torch.tensor([[1.0, 1.0]])
    assert set(ratio_metrics(lp, adv, torch.ones(1, 2))) == set(RATIO_KEYS)
    empty = ratio_metrics(lp, adv, torch.zeros(1, 2))
    assert set(empty) == set(RATIO_KEYS) and float(empty["actor/ratio_max"]) == 1.0
    model = torch.nn.Linear(4, 3)
    assert weight_sample(model, distributed=True) == [] and update_size([]) == {}
    before = weight_sample(model)
    with torch.no_grad():
        model.weight.mul_(1.01)
    assert update_size(before)["update_rel"] == pytest.approx(0.01, rel=1e-4)
