"""Settings that make a loss degenerate (verlaudit/audit/config_checks.py) and the loss terms, controllers
and masks that take over an update (verlaudit/audit/dynamics.py): each is planted in variants other than
the blind bench's (another loss, estimator, algorithm, plug-in point) and named with its suite key and
verl's; the settings of healthy runs pass."""

from __future__ import annotations

import pytest
import torch

from verlaudit import kinds as K
from verlaudit.audit import config_checks as C
from verlaudit.audit.dynamics import DynamicsWatch

PPO = {"name": "ppo", "adv_estimator": None, "batch_size": 8, "mini_batch_size": 8, "lr": 2e-3, "critic_lr": 2e-3,
       "gamma": 1.0, "lam": 0.95, "use_kl_in_reward": True, "kl_coef": 0.01, "kl_ctrl_type": "fixed",
       "kl_ctrl_target_kl": 0.1, "kl_ctrl_horizon": 10000, "weight_decay": 0.0, "entropy_coef": 0.0}  # fmt: skip
GRPO = {"name": "grpo", "adv_estimator": None, "batch_size": 4, "group_size": 4, "lr": 1e-3, "gamma": 1.0,
        "lam": 1.0, "use_kl_in_reward": False, "use_kl_loss": True, "kl_loss_coef": 0.01, "weight_decay": 0.0,
        "entropy_coef": 0.0, "temperature": 1.0, "top_k": 0, "norm_adv_by_std_in_grpo": True}  # fmt: skip
DPO = {"name": "dpo", "lr": 1e-3, "batch_size": 8, "beta": 0.1, "dpo_loss": "sigmoid", "label_smoothing": 0.0,
       "weight_decay": 0.0}  # fmt: skip
DATA = {"response_length": 8}


def _config(algo, **over):
    return {"algo": {**algo, **over}, "data": dict(DATA)}


@pytest.mark.parametrize("algo", [PPO, GRPO, DPO], ids=["ppo", "grpo", "dpo"])
def test_the_shipped_settings_are_clean(algo):
    assert C.setup_findings(_config(algo)) == []
    # verl's defaults: weight decay 0.01, gamma 1, an adaptive controller at its default horizon
    assert C.setup_findings(_config(algo, weight_decay=0.01, kl_ctrl_type="adaptive")) == []
    assert C.setup_findings({"algo": {**algo, "gamma": 0.99}, "data": {"response_length": 64}}) == []


def test_label_smoothing_near_half_cancels_the_preference():
    (f,) = C.setup_findings(_config(DPO, label_smoothing=0.4))
    assert f.kind == K.LABEL_SMOOTHING and f.where == "algo.label_smoothing"
    assert f.observed["gradient_scale"] == pytest.approx(0.2) and "label_smoothing" in f.fix
    assert f.observed["optimal_margin"] == pytest.approx(0.405, abs=1e-3)
    # robust DPO keeps pushing the margin up (a scaled loss, Adam normalises it): not reported
    assert C.setup_findings(_config(DPO, dpo_loss="robust", label_smoothing=0.45)) == []
    # the usual cDPO setting, and a loss that does not read it, pass
    assert C.setup_findings(_config(DPO, label_smoothing=0.1)) == []
    assert C.setup_findings(_config(DPO, dpo_loss="ipo", label_smoothing=0.45)) == []


def test_a_discount_that_cuts_the_credit_names_gamma_or_lam():
    (f,) = C.setup_findings(_config(GRPO, adv_estimator="reinforce_plus_plus", gamma=0.5))
    assert f.kind == K.DISCOUNT and f.where == "algo.gamma" and "algorithm.gamma=1" in f.fix
    assert f.observed["first_token_share"] == pytest.approx(0.5**7)
    # a modest discount over long responses cuts it too
    long = C.setup_findings({"algo": {**PPO, "gamma": 0.9}, "data": {"response_length": 256}})
    assert [g.where for g in long] == ["algo.gamma"]
    (lam,) = C.setup_findings(_config(PPO, lam=0.0))
    assert lam.where == "algo.lam" and "algorithm.lam=1.0" in lam.fix
    # GRPO's estimator does not discount: its gamma is never read
    assert C.setup_findings(_config(GRPO, gamma=0.0)) == []


def test_an_adaptive_kl_controller_with_a_short_horizon():
    (f,) = C.setup_findings(_config(PPO, kl_ctrl_type="adaptive", kl_ctrl_horizon=100, batch_size=512))
    assert f.kind == K.KL_CONTROLLER and f.observed["max_change_per_step"] == pytest.approx(1.024)
    assert "kl_ctrl.horizon" in f.fix and "turns negative" in f.message
    # GRPO counts every response of a group as a sequence
    grpo = {
        **GRPO,
        "use_kl_in_reward": True,
        "kl_coef": 0.01,
        "kl_ctrl_type": "adaptive",
        "kl_ctrl_horizon": 4,
    }
    assert C.setup_findings(_config(grpo, kl_ctrl_target_kl=0.1))[0].observed["batch_rows"] == 16
    # a fixed coefficient has no controller
    assert C.setup_findings(_config(PPO, kl_ctrl_horizon=1)) == []


def test_the_coefficient_a_run_reports_running_away():
    w = DynamicsWatch({**PPO, "kl_ctrl_type": "adaptive", "kl_ctrl_horizon": 50})
    seen = [
        w.step_end({"actor/reward_kl_penalty_coeff": c}, step=i) for i, c in enumerate([0.05, 0.1, 0.3, 0.6])
    ]
    assert [len(s) for s in seen] == [0, 0, 0, 1]
    (f,) = seen[-1]
    assert f.kind == K.KL_CONTROLLER and "grew 12x" in f.message
    negative = DynamicsWatch({**PPO, "kl_ctrl_type": "adaptive"})
    out = [
        negative.step_end({"actor/reward_kl_penalty_coeff": c}, step=i) for i, c in enumerate([0.01, -0.002])
    ]
    assert "negative" in out[1][0].message
    # a steady coefficient, and one reported as decided at setup, pass
    steady = DynamicsWatch(PPO)
    assert not any(steady.step_end({"actor/reward_kl_penalty_coeff": 0.01}, step=i) for i in range(4))
    known = DynamicsWatch(PPO, reported={K.KL_CONTROLLER})
    assert not known.step_end({"actor/reward_kl_penalty_coeff": 0.01}, step=0)
    assert not known.step_end({"actor/reward_kl_penalty_coeff": -1.0}, step=1)


def test_weight_decay_that_shrinks_every_weight():
    (f,) = C.setup_findings(_config(GRPO, weight_decay=20.0))
    assert f.kind == K.WEIGHT_DECAY and f.observed["decay_per_step"] == pytest.approx(0.02)
    assert "weight_decay: 0.01" in f.fix and "optim.weight_decay=0.01" in f.fix
    # PPO's critic at a high learning rate decays too, the actor's does not
    (c,) = C.setup_findings(_config(PPO, weight_decay=0.1, critic_lr=0.2, lr=1e-5))
    assert c.role == "critic" and "algo.critic_lr 0.2" in c.message
    # a smaller decay compounded over a long run: 0.5% a step for 500 DPO steps keeps 8% of each weight
    (long,) = C.setup_findings({**_config(DPO, weight_decay=0.5, lr=1e-2, mini_batch_size=8), "steps": 500})
    assert (
        long.observed["kept_after_run"] == pytest.approx(0.995**500) and "500 optimizer steps" in long.message
    )
    # the shipped tiny suite (4 updates a step for 40 steps at verl's default decay) passes
    tiny = {**PPO, "weight_decay": 0.01, "batch_size": 16, "mini_batch_size": 8, "ppo_epochs": 2}
    assert C.setup_findings({**_config(tiny), "steps": 40}) == []


def _entropy(algo, *entropies):
    w = DynamicsWatch(algo)
    return [f for i, e in enumerate(entropies) for f in w.step_end({"actor/entropy": e}, step=i)]


def test_an_entropy_bonus_that_outweighs_the_advantages():
    # a random-init policy near uniform: the bonus dominates from the first step
    (f,) = _entropy({**GRPO, "entropy_coef": 0.5}, 4.6)
    assert f.kind == K.ENTROPY_DOMINATES and f.where == "algo.entropy_coef" and "entropy_coeff=0" in f.fix
    # a peaked policy pushed up by it: found once the term grows, with the rise
    (g,) = _entropy({**PPO, "entropy_coef": 2.0}, 0.05, 0.1, 0.4)
    assert g.step == 2 and "rose from 0.05" in g.message
    # verl's former default at a uniform vocabulary's entropy, and no bonus at all, pass
    assert _entropy({**PPO, "entropy_coef": 0.001}, 11.9, 11.9) == []
    assert _entropy(PPO, 11.9) == []


def test_rollout_rejection_that_masks_most_tokens():
    w = DynamicsWatch(GRPO, correction={"rollout_rs": "seq_mean_k3", "rollout_rs_threshold": 1e-6})
    (f,) = w.step_end({"rollout_corr/rollout_rs_masked_fraction": 0.9}, step=0)
    assert f.kind == K.REJECTION_SATURATED and f.where == "rollout_correction.rollout_rs_threshold"
    assert "seq_mean_k3" in f.message and "rollout_rs_threshold=2.0" in f.fix
    assert DynamicsWatch(GRPO).step_end({"rollout_corr/rollout_rs_masked_fraction": 0.004}, step=0) == []


def _rollout(g=4, groups=4, same=4, length=6):
    ids = torch.randint(3, 50, (groups, g, length))
    ids[:same] = ids[:same, :1]
    return {"response_ids": ids.reshape(-1, length), "response_mask": torch.ones(groups * g, length),
            "engine_facts": None, "trainer_facts": {"used": True}}  # fmt: skip


def test_identical_groups_under_a_narrowing_sampler_name_the_key():
    (f,) = DynamicsWatch({**GRPO, "top_k": 1}).rollout(_rollout(), step=0, phase="rollout")
    assert (
        f.kind == K.SAMPLING_COLLAPSE
        and f.where == "algo.top_k"
        and "rollout.top_k=-1" in f.fix
        and "algo.top_k: 0" in f.fix
    )
    top_p = DynamicsWatch(GRPO, rollout={"top_p": 0.1}).rollout(_rollout(same=3), step=0, phase="rollout")
    assert top_p[0].where == "rollout.top_p"
    # what the engine reports sampling with wins over the config
    facts = {**_rollout(), "engine_facts": {"temperature": 0.05, "top_k": 0, "top_p": 1.0}}
    assert DynamicsWatch(GRPO).rollout(facts, step=0, phase="rollout")[0].where == "algo.temperature"
    greedy = {**_rollout(), "engine_facts": {"temperature": 0.0}}  # an engine that decodes greedily
    assert DynamicsWatch(GRPO).rollout(greedy, step=0, phase="rollout")[0].observed["algo.temperature"] == 0.0


def test_identical_groups_at_normal_sampling_or_diverse_groups_pass():
    assert DynamicsWatch(GRPO).rollout(_rollout(), step=0, phase="rollout") == []  # the policy, not a key
    cold = DynamicsWatch({**GRPO, "temperature": 0.1})
    assert cold.rollout(_rollout(same=1), step=0, phase="rollout") == []  # most groups still differ
    greedy_baseline = {**_rollout(), "trainer_facts": {"used": False}}  # ReMax's greedy baseline
    assert cold.rollout(greedy_baseline, step=0, phase="rollout") == []


def _hot(nll: float, temperature: float, vocab: int = 100):
    lp = torch.full((8, 6), -nll)
    return {"response_ids": torch.randint(3, 50, (8, 6)), "response_mask": torch.ones(8, 6), "logprobs": lp,
            "engine_facts": {"temperature": temperature}, "trainer_facts": {"used": True}}  # fmt: skip


def test_a_temperature_that_samples_noise_names_it():
    # PPO (no groups) at temperature 5: the sampled tokens are as unlikely as a uniform draw over 100
    (f,) = DynamicsWatch(PPO).rollout(_hot(4.4, 5.0), step=0, phase="rollout", vocab=100)
    assert f.kind == K.SAMPLING_NOISE and f.where == "algo.temperature" and "temperature=1.0" in f.fix
    # a peaked policy at that temperature, the same draw at temperature 1 (a random-init model), pass
    assert DynamicsWatch(PPO).rollout(_hot(0.5, 5.0), step=0, phase="rollout", vocab=100) == []
    assert DynamicsWatch(GRPO).rollout(_hot(4.5, 1.0), step=0, phase="rollout", vocab=100) == []
