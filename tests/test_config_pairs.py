"""Keys wrong in combination (verlaudit/audit/config_pairs.py) and their causes, GRPO's std normalisation
of tie-break spreads, and a tensor's resolution at a 16-bit boundary (verlaudit/analysis/diagnose/
pair_cause.py): each combination is information at setup and a cause when the run shows it (or by
construction), heads what it produced, and fixes a key to a value it does not have; the defaults and the
shipped suites are quiet under every preset."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml

from trainer.config import TrainConfig
from trainer.precision import resolve_policy
from verlaudit import kinds as K
from verlaudit.analysis.diagnose import pair_cause as PC
from verlaudit.analysis.diagnose.diagnosis import diagnose_run
from verlaudit.audit import config_pairs as P
from verlaudit.audit.reward_signal import tiny_std_groups
from verlaudit.rundir import RunDir

ROOT = Path(__file__).resolve().parents[1]
PRESETS = ("fp32", "fp16", "bf16", "bf16-pure")


def _config(algo, *, preset="fp32", overrides=None, data=None, rollout=None, model=None):
    cfg = {"algo": algo, "precision": {"preset": preset, "overrides": overrides or {}}, "steps": 3}
    if data:
        cfg["data"] = data
    if rollout:
        cfg["rollout"] = rollout
    if model:
        cfg["model"] = model
    return TrainConfig.from_dict(cfg)


def _policy(tc):
    return resolve_policy(tc.precision.preset, tc.precision.overrides).to_dict()["roles"]


def _found(tc):
    return P.setup_findings(tc.to_dict(), _policy(tc))


def _run(tc, findings=(), metrics=()):
    return RunDir(
        path=Path("/nonexistent/run"),
        manifest={"config": tc.to_dict(), "policy": {"preset": tc.precision.preset, "roles": _policy(tc)}},
        metrics=[{"step": i, **m} for i, m in enumerate(metrics)],
        findings=list(findings),
        events=[],
        status={"state": "completed"},
    )


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("name", ["ppo", "grpo", "dpo"])
def test_the_defaults_set_no_combination(name, preset):
    assert _found(_config({"name": name}, preset=preset)) == []


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("suite", ["tiny_cpu.yaml", "dpo_tiny_cpu.yaml", "grpo_tiny_cpu.yaml"])
def test_the_shipped_suites_set_no_combination(suite, preset):
    path = ROOT / "suites" / suite
    if not path.exists():
        pytest.skip(f"no {suite}")
    base = dict(yaml.safe_load(path.read_text()).get("train") or {})
    tc = _config(dict(base.get("algo") or {}), preset=preset, data=base.get("data"))
    assert _found(tc) == []


def _cause(tc, metrics=()):
    found = _found(tc)
    return found, PC.combo_causes(_run(tc, found, metrics))


def test_the_kl_penalised_in_the_reward_and_the_loss_is_a_cause_by_construction():
    both = {"use_kl_in_reward": True, "kl_coef": 0.05, "use_kl_loss": True, "kl_loss_coef": 0.05}
    found, causes = _cause(_config({"name": "ppo", **both}, preset="bf16"))
    assert [f.kind for f in found] == [K.CONFIG_PENALTY_TWICE] and found[0].severity == "info"
    (c,) = causes
    assert c.severity == "warning" and c.where == "algo.use_kl_loss"
    assert c.fixes[0].suite == "algo.use_kl_loss: false" and "use_kl_loss=false" in c.fixes[0].verl
    _, causes = _cause(_config({"name": "grpo", **both}))
    assert causes[0].fixes[0].suite == "algo.use_kl_in_reward: false"  # GRPO keeps its KL loss
    for one in ({"use_kl_in_reward": True, "kl_coef": 0.05}, {"use_kl_loss": True, "kl_loss_coef": 0.05}):
        assert _found(_config({"name": "ppo", **one})) == []


def test_robust_dpo_near_half_is_steep_and_unbounded_and_a_small_eps_is_not():
    found, causes = _cause(_config({"name": "dpo", "dpo_loss": "robust", "label_smoothing": 0.45}))
    assert found[0].kind == K.LABEL_SMOOTHING and found[0].observed["loss_scale"] == pytest.approx(10.0)
    assert causes[0].fixes[0].suite == "algo.label_smoothing: 0.1"
    assert _found(_config({"name": "dpo", "dpo_loss": "robust", "label_smoothing": 0.1})) == []
    assert (
        _found(_config({"name": "dpo", "dpo_loss": "sigmoid", "label_smoothing": 0.45})) == []
    )  # cDPO's own


def test_an_ipo_tau_set_like_a_dpo_beta_is_confirmed_by_the_loss_it_starts_at():
    tc = _config({"name": "dpo", "dpo_loss": "ipo", "beta": 0.005}, preset="bf16")
    found, causes = _cause(tc, [{"actor/loss": 9950.0}, {"actor/loss": 9700.0}])
    assert found[0].kind == K.CONFIG_LOSS_TYPE_SCALE and found[0].observed["target_margin"] == pytest.approx(
        100
    )
    assert causes[0].where == "algo.beta" and causes[0].fixes[0].suite == "algo.beta: 0.1"
    assert PC.combo_causes(_run(tc, found, [{"actor/loss": 3.0}])) == []  # not what the run shows
    assert _found(_config({"name": "dpo", "dpo_loss": "ipo", "beta": 0.1})) == []
    assert _found(_config({"name": "dpo", "dpo_loss": "sigmoid", "beta": 0.005})) == []


def test_a_token_sum_under_fp16_loss_scaling_heads_the_skipped_steps_it_causes():
    algo = {"name": "grpo", "loss_agg_mode": "token-sum", "batch_size": 4, "group_size": 4,
            "mini_batch_size": 16, "micro_batch_size": 8}  # fmt: skip
    tc = _config(algo, preset="fp16", data={"response_length": 8})
    found = _found(tc)
    assert [f.kind for f in found] == [K.CONFIG_LOSS_AGG_FP16]
    assert found[0].observed["loss_magnitude_factor"] == 128
    metrics = [
        {"actor/skipped": 1.0, "actor/loss_scale": 2.0 ** (15 - i), "numerics/actor/nonfinite_grads": 100}
        for i in range(4)
    ]
    top = diagnose_run(_run(tc, found, metrics)).causes[0]
    assert top.kind == f"finding:{K.CONFIG_LOSS_AGG_FP16}" and top.where == "algo.loss_agg_mode"
    assert top.fixes[0].suite == "algo.loss_agg_mode: token-mean"
    assert (
        _found(_config(algo, preset="bf16", data={"response_length": 8})) == []
    )  # no loss scale to overflow


def test_a_zero_width_clip_bound_is_named():
    found = _found(_config({"name": "grpo", "clip_ratio_low": 0.0}))
    assert found[0].kind == K.CONFIG_CLIP_ZERO_WIDTH and found[0].where == "algo.clip_ratio_low"
    assert _found(_config({"name": "grpo", "clip_ratio_low": 0.2, "clip_ratio_high": 0.28})) == []


def test_a_low_temperature_over_bf16_rollout_logits_needs_a_measured_difference():
    tc = _config({"name": "grpo", "temperature": 0.1}, preset="bf16")
    found = _found(tc)
    assert found[0].kind == K.CONFIG_TEMPERATURE_DTYPE and found[0].observed[
        "amplification"
    ] == pytest.approx(10)
    (c,) = PC.combo_causes(_run(tc, found, [{"rollout_corr/abs_diff_mean": 0.0067}] * 3))
    assert "temperature" in c.title and c.fixes[0].suite == "precision.overrides.rollout.compute_dtype: fp32"
    assert PC.combo_causes(_run(tc, found, [{"rollout_corr/abs_diff_mean": 0.0}] * 3)) == []  # same kernels
    assert _found(_config({"name": "grpo", "temperature": 0.1}, preset="fp32")) == []
    assert _found(_config({"name": "grpo", "temperature": 1.0}, preset="bf16")) == []


def test_tiny_std_groups_counts_groups_that_differ_by_a_tie_break_only():
    r = torch.tensor([0.0, 1e-4, 2e-4, 3e-4] + [0.0, 1.0, 0.0, 1.0] + [0.0] * 4 + [5.0, 5.0, 5.0, 5.0002])
    assert tiny_std_groups(r, 4) == pytest.approx(0.5)
    assert tiny_std_groups(torch.tensor([0.0, 1.0, 0.0]), 4) is None


def test_grpo_std_normalisation_of_tie_breaks_is_a_cause_and_dr_grpo_is_not():
    tc = _config({"name": "grpo"})
    (c,) = PC.combo_causes(_run(tc, metrics=[{PC.TINY_STD_METRIC: 1.0}] * 3))
    assert (
        c.where == "algo.norm_adv_by_std_in_grpo"
        and c.fixes[0].suite == "algo.norm_adv_by_std_in_grpo: false"
    )
    assert PC.combo_causes(_run(tc, metrics=[{PC.TINY_STD_METRIC: 0.0}] * 3)) == []
    off = _config({"name": "grpo", "norm_adv_by_std_in_grpo": False})
    assert PC.combo_causes(_run(off, metrics=[{PC.TINY_STD_METRIC: 1.0}] * 3)) == []


def test_the_spacing_of_the_16_bit_floats():
    assert PC.spacing("bf16", 50.0) == 0.25 and PC.spacing("bf16", 1.0) == 2.0**-7
    assert PC.spacing("fp16", 3000.0) == 2.0 and PC.spacing("fp32", 50.0) is None


def test_offset_values_in_a_bf16_critic_lose_their_resolution_and_centred_ones_do_not():
    bf16 = {"critic": {"param_dtype": "bf16", "compute_dtype": "bf16"}}
    shape = {"response_length": 8}
    tc = _config({"name": "ppo", "batch_size": 8, "mini_batch_size": 8}, overrides=bf16, data=shape)
    offset = [{"critic/values/mean": 50.3, "critic/values/std": 0.14, "critic/returns/std": 0.1}] * 3
    (c,) = PC.resolution_causes(_run(tc, metrics=offset))
    assert c.where == "precision.overrides.critic" and "0.25" in c.title and "fp32" in c.fixes[0].suite
    centred = [{"critic/values/mean": 0.3, "critic/values/std": 0.1, "critic/returns/std": 0.1}] * 3
    assert PC.resolution_causes(_run(tc, metrics=centred)) == []
    fp32 = _config({"name": "ppo", "batch_size": 8, "mini_batch_size": 8}, data=shape)
    assert PC.resolution_causes(_run(fp32, metrics=offset)) == []  # an fp32 critic
    flat = [{"critic/values/mean": 50.0, "critic/values/std": 0.0, "critic/returns/std": 0.0}]
    assert PC.resolution_causes(_run(tc, metrics=flat)) == []


def test_scores_finer_than_the_roles_grid_were_not_rounded_to_it():
    rm = {"model": {"reward_model": "rm.py:load"}}
    tc = _config({"name": "grpo", "batch_size": 2, "group_size": 4}, preset="bf16-pure", **rm)
    # std 0.003 at 40 cannot be 8 values on bf16's 0.25 grid (smallest nonzero std 0.083): kept in fp32
    fine = [{"critic/score/mean": 40.17, "critic/score/std": 0.003, "reward/std": 0.0028}] * 3
    assert PC.resolution_causes(_run(tc, metrics=fine)) == []
    rounded = [{"critic/score/mean": 40.17, "critic/score/std": 0.12, "reward/std": 0.11}] * 3
    (c,) = PC.resolution_causes(_run(tc, metrics=rounded))
    assert c.where == "precision.overrides.reward" and c.role == "reward"
    assert PC.grid_min_std(0.25, 8) == pytest.approx(0.25 * 7**0.5 / 8)


def test_reinforce_plus_plus_whitening_of_a_tiny_batch_std_is_a_cause():
    tc = _config({"name": "grpo", "adv_estimator": "reinforce_plus_plus"})
    (c,) = PC.combo_causes(_run(tc, metrics=[{"reward/std": 2e-4}] * 3))
    assert c.where == "algo.adv_estimator" and c.fixes[0].suite == "algo.adv_estimator: rloo"
    assert PC.combo_causes(_run(tc, metrics=[{"reward/std": 0.0}] * 3)) == []  # no signal: not this
    assert PC.combo_causes(_run(tc, metrics=[{"reward/std": 0.4}] * 3)) == []
