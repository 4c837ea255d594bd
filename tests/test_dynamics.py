"""Training dynamics as causes (verlaudit/audit/dynamics.py): each planted setting is found from the step's
metrics with its suite key, and a healthy run's metrics (the clean controls, the tiny suite's
multi-epoch steps) pass."""

from __future__ import annotations

import pytest

from verlaudit import kinds as K
from verlaudit.audit.dynamics import DynamicsWatch, _round_down

PPO = {"name": "ppo", "batch_size": 8, "mini_batch_size": 8, "ppo_epochs": 1, "clip_ratio": 0.2,
       "loss_mode": "vanilla", "use_kl_in_reward": True, "kl_coef": 0.01, "use_kl_loss": False}  # fmt: skip
GRPO = {"name": "grpo", "batch_size": 4, "group_size": 4, "mini_batch_size": 16, "ppo_epochs": 1,
        "clip_ratio": 0.2, "loss_mode": "vanilla", "use_kl_in_reward": False, "use_kl_loss": True,
        "kl_loss_coef": 0.01, "kl_loss_type": "low_var_kl", "norm_adv_by_std_in_grpo": True}  # fmt: skip
HEALTHY = {"actor/pg_clipfrac": 0.0, "actor/ppo_kl": 0.0, "critic/score/mean": 0.05, "critic/score/std": 0.09,
           "critic/rewards/mean": 0.048, "critic/advantages/mean": 0.0, "actor/kl_loss": 0.005,
           "actor/reward_kl_penalty_coeff": 0.01}  # fmt: skip


def _run(algo, *steps):
    w = DynamicsWatch(algo)
    return [f for i, m in enumerate(steps) for f in w.step_end({**HEALTHY, **m}, step=i)]


@pytest.mark.parametrize("algo", [PPO, GRPO], ids=["ppo", "grpo"])
def test_a_healthy_run_is_clean(algo):
    assert _run(algo, {}, {}, {}) == []
    # the tiny suite: 4 optimizer steps a batch at clip 0.2 clip up to 0.30 of the tokens
    many = {**algo, "batch_size": 16, "mini_batch_size": 8, "ppo_epochs": 2}
    assert _run(many, {"actor/pg_clipfrac": 0.297, "actor/ppo_kl": 0.056}) == []


def test_a_tiny_clip_range_names_clip_ratio():
    algo = {**PPO, "clip_ratio": 0.001, "ppo_epochs": 2, "mini_batch_size": 4}
    (f,) = _run(algo, {"actor/pg_clipfrac": 0.56, "actor/ppo_kl": 0.029}, {"actor/pg_clipfrac": 0.57})
    assert f.kind == K.CLIP_SATURATED and f.where == "algo.clip_ratio" and f.step == 0
    assert "clip_ratio: 0.2" in f.fix and "actor_rollout_ref.actor.clip_ratio=0.2" in f.fix
    # the narrower side of a split clip is named; an on-policy step (clip fraction 0) shows nothing
    split = {**algo, "clip_ratio_low": 0.002, "clip_ratio_high": 0.28}
    assert _run(split, {"actor/pg_clipfrac": 0.4})[0].where == "algo.clip_ratio_low"
    assert _run(algo, {"actor/pg_clipfrac": 0.0}) == []
    # GSPO's sequence ratio is clipped at 3e-4 by design
    assert _run({**algo, "loss_mode": "gspo"}, {"actor/pg_clipfrac": 0.5}) == []


def test_too_many_optimizer_steps_a_batch_are_stale():
    algo = {**GRPO, "mini_batch_size": 1, "ppo_epochs": 4}
    (f,) = _run(algo, {"actor/pg_clipfrac": 0.59, "actor/ppo_kl": 0.106})
    assert f.kind == K.STALE_UPDATES and "64 optimizer steps" in f.message
    assert "algo.mini_batch_size: 4" in f.fix and "ppo_mini_batch_size" in f.fix
    assert _run(algo, {"actor/pg_clipfrac": 0.05}) == []  # many steps that barely move: not stale


def test_a_kl_penalty_that_dominates_the_return():
    algo = {**PPO, "kl_coef": 100.0}
    step0 = {"critic/rewards/mean": 0.14, "critic/score/mean": 0.047, "critic/score/std": 0.087}
    step1 = {"critic/rewards/mean": -18.7, "critic/score/mean": 0.094, "critic/score/std": 0.17,
             "actor/reward_kl_penalty_coeff": 100.0}  # fmt: skip
    (f,) = _run(algo, step0, step1)
    assert f.kind == K.KL_DOMINATES and f.step == 1 and f.where == "algo.kl_coef"
    assert "algorithm.kl_ctrl.kl_coef=0.09" in f.fix
    # the tiny suite's worst healthy step: penalty 1.3x a score std that fell to 0.02
    assert (
        _run(PPO, {"critic/rewards/mean": 0.022, "critic/score/mean": 0.05, "critic/score/std": 0.0213}) == []
    )


def test_a_kl_loss_that_outweighs_the_advantages():
    (f,) = _run({**GRPO, "kl_loss_coef": 100.0}, {"actor/kl_loss": 0.01, "actor/kl_coef": 100.0})
    assert f.kind == K.KL_DOMINATES and f.where == "algo.kl_loss_coef" and "kl_loss_coef" in f.fix


def test_a_group_of_one_has_no_baseline():
    algo = {**GRPO, "group_size": 1, "mini_batch_size": 4}
    (f,) = _run(algo, {"critic/advantages/mean": 0.094, "critic/score/mean": 0.094}, {})
    assert f.kind == K.NO_GROUP_BASELINE and "actor_rollout_ref.rollout.n=4" in f.fix
    # REINFORCE++ has no group baseline: a group of one is how it runs
    assert _run({**algo, "adv_estimator": "reinforce_plus_plus"}, {}) == []
    assert _run(PPO, {}) == []  # PPO's baseline is the critic


def test_round_down():
    assert _round_down(0.0909) == 0.09 and _round_down(0.00347) == 0.003 and _round_down(3.0) == 3.0


def _fp16_run(skipped):
    from pathlib import Path

    from trainer.config import TrainConfig
    from trainer.precision import resolve_policy
    from verlaudit.rundir import RunDir

    config = TrainConfig.from_dict({"algo": {"name": "grpo"}, "precision": {"preset": "fp16"}, "steps": 3})
    metrics = [{"step": i, "actor/skipped": v, "actor/loss_scale": 65536.0} for i, v in enumerate(skipped)]
    manifest = {"config": config.to_dict(), "policy": resolve_policy("fp16").to_dict()}
    return RunDir(
        path=Path("/nonexistent"), manifest=manifest, metrics=metrics, findings=[], events=[], status={}
    )


def test_one_skip_in_64_optimizer_steps_is_calibration():
    from verlaudit.analysis.diagnose.trajectory import loss_scale_causes

    # actor/skipped is each step's skipped share of its optimizer steps: 1 of 64 is not 1 step in 3
    (c,) = loss_scale_causes(_fp16_run([1 / 64, 0.0, 0.0]))
    assert c.severity == "info" and c.kind == "overflow_skips"
    (c,) = loss_scale_causes(_fp16_run([1.0, 0.0, 0.0]))  # one optimizer step a step: a third skipped
    assert c.severity == "warning"


def test_a_static_scale_that_overflows_names_the_static_scale():
    from verlaudit.analysis.diagnose.trajectory import loss_scale_causes

    run = _fp16_run([1.0, 1.0, 1.0])
    run.manifest["policy"]["roles"]["actor"].update(loss_scaling="static", init_scale=1e9)
    (c,) = loss_scale_causes(run)
    assert c.severity == "error" and "static loss scale" in c.title and "init_scale" in c.where
    assert [f.suite for f in c.fixes][0] == "precision.overrides.actor.loss_scaling: dynamic"
    assert "init_scale: 9.766e+05" in c.fixes[1].suite  # lower, never higher
