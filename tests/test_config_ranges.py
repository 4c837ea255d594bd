"""The table of sane ranges (verlaudit/audit/config_ranges.py) and its causes in diagnose
(verlaudit/analysis/diagnose/config_cause.py): a key outside its range is information at setup, a cause
only when the run's metrics show its consequence, and then it heads what it produced with a fix inside
the range; the shipped settings are clean under every preset."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from trainer.config import TrainConfig
from trainer.precision import resolve_policy
from verlaudit import kinds as K
from verlaudit.analysis.diagnose.config_cause import confirmed
from verlaudit.analysis.diagnose.diagnosis import diagnose_run
from verlaudit.audit import config_ranges as R
from verlaudit.rundir import RunDir

ROOT = Path(__file__).resolve().parents[1]
PRESETS = ("fp32", "fp16", "bf16", "bf16-pure")


def _config(algo, *, preset="fp32", overrides=None, data=None, correction=None):
    cfg = {"algo": algo, "precision": {"preset": preset, "overrides": overrides or {}}, "steps": 3}
    if data:
        cfg["data"] = data
    if correction:
        cfg["rollout_correction"] = correction
    return TrainConfig.from_dict(cfg)


def _found(tc):
    policy = resolve_policy(tc.precision.preset, tc.precision.overrides).to_dict()["roles"]
    return R.setup_findings(tc.to_dict(), policy), policy


def _run(tc, findings, policy, metrics=()):
    return RunDir(
        path=Path("/nonexistent/run"),
        manifest={"config": tc.to_dict(), "policy": {"preset": tc.precision.preset, "roles": policy}},
        metrics=list(metrics),
        findings=list(findings),
        events=[],
        status={"state": "completed"},
    )


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("suite", ["tiny_cpu.yaml", "dpo_tiny_cpu.yaml", "grpo_tiny_cpu.yaml"])
def test_the_shipped_suites_are_inside_every_range(suite, preset):
    path = ROOT / "suites" / suite
    if not path.exists():
        pytest.skip(f"no {suite}")
    spec = yaml.safe_load(path.read_text())
    base = dict(spec.get("train") or {})
    algo = dict(base.get("algo") or {})
    tc = _config(algo, preset=preset, data=base.get("data"))
    assert _found(tc)[0] == []


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("name", ["ppo", "grpo", "dpo"])
def test_the_defaults_are_inside_every_range(name, preset):
    extra = {"loss_agg_mode": "seq-mean-token-sum-norm"} if name != "dpo" else {}
    tc = _config({"name": name, **extra}, preset=preset,
                 correction={"rollout_is": "token"} if name != "dpo" else None)  # fmt: skip
    assert _found(tc)[0] == []


def test_every_emitted_row_fixes_inside_its_range_and_never_to_the_value_it_has():
    for row in R.RANGES:
        assert row.kind is not None or row.checked_by is not None, row.key
        assert row.kind is None or row.kind in R.EMITTED
        assert row.source
    cases = [
        _config({"name": "ppo", "vf_coef": 0.0}),
        _config({"name": "grpo", "use_kl_loss": True, "kl_loss_coef": 0.0}),
        _config({"name": "ppo", "use_kl_in_reward": True, "kl_coef": 0.0}),
        _config({"name": "dpo", "beta": 50.0}),
        _config({"name": "grpo"}, correction={"rollout_is": "token", "rollout_is_threshold": 0.01}),
        _config({"name": "ppo"}, preset="fp16", overrides={"actor": {"growth_interval": 1}}),
        _config({"name": "ppo"}, preset="fp16", overrides={"critic": {"init_scale": 1e-6}}),
        _config({"name": "grpo", "loss_agg_mode": "seq-mean-token-sum-norm", "loss_scale_factor": 0.001}),
    ]
    for tc in cases:
        (f,), _ = _found(tc)
        assert f.severity == "info" and f.observed["confirm"]
        assert f.observed["fix_value"] != f.observed["value"]
        assert f.where in f.fix and f.where in f.message


def test_a_zero_value_coefficient_is_an_error_when_the_critic_gets_no_gradient():
    tc = _config({"name": "ppo", "vf_coef": 0.0})
    found, policy = _found(tc)
    assert [f.kind for f in found] == [K.CONFIG_COEF_ZERO] and found[0].role == "critic"
    still = [{"step": s, "critic/grad_norm": 0.0, "critic/vf_loss": 0.01} for s in range(3)]
    d = diagnose_run(_run(tc, found, policy, still))
    first = d.causes[0]
    assert first.kind == f"finding:{K.CONFIG_COEF_ZERO}" and first.severity == "error"
    assert first.where == "algo.vf_coef" and first.fixes[0].suite == "algo.vf_coef: 1.0"
    assert "critic/grad_norm" in first.evidence[0]
    # the same key where the critic does train (it cannot: but a run that shows otherwise is not confirmed)
    moving = [{"step": s, "critic/grad_norm": 0.3} for s in range(3)]
    assert not any(c.kind == first.kind for c in diagnose_run(_run(tc, found, policy, moving)).causes)
    # GRPO has no critic: the key is not read, nothing is said
    assert R.setup_findings({"algo": {"name": "grpo", "vf_coef": 0.0}}, {}) == []


def test_a_huge_dpo_beta_is_confirmed_by_the_saturated_loss_only():
    tc = _config({"name": "dpo", "beta": 50.0})
    found, policy = _found(tc)
    assert [f.kind for f in found] == [K.CONFIG_SATURATED]
    blown = [{"step": 0, "actor/loss": 0.693, "rewards/margins": 0.0},
             {"step": 1, "actor/loss": 27.0, "rewards/margins": -5.7}]  # fmt: skip
    first = diagnose_run(_run(tc, found, policy, blown)).causes[0]
    assert (
        first.where == "algo.beta"
        and first.severity == "warning"
        and first.fixes[0].suite == "algo.beta: 0.1"
    )
    calm = [{"step": s, "actor/loss": 0.69, "rewards/margins": 0.1} for s in range(2)]
    d = diagnose_run(_run(tc, found, policy, calm))
    assert d.causes == [] or d.causes[0].where != "algo.beta"


def test_an_is_threshold_below_one_truncates_every_token():
    tc = _config({"name": "grpo"}, correction={"rollout_is": "token", "rollout_is_threshold": 0.01})
    found, policy = _found(tc)
    assert [f.where for f in found] == ["rollout_correction.rollout_is_threshold"]
    clipped = [{"step": s, "rollout_corr/rollout_is_ratio_fraction_high": 1.0} for s in range(3)]
    first = diagnose_run(_run(tc, found, policy, clipped)).causes[0]
    assert first.kind == f"finding:{K.CONFIG_IS_TRUNCATION}"
    assert first.fixes[0].suite == "rollout_correction.rollout_is_threshold: 2.0"
    # IcePop bounds that exclude the on-policy ratio 1
    tc2 = _config({"name": "grpo"}, correction={"rollout_is": "token", "rollout_is_threshold": "1.5_3.0"})
    assert [f.kind for f in _found(tc2)[0]] == [K.CONFIG_IS_TRUNCATION]
    # not enabled: the threshold is not read
    assert (
        R.setup_findings({"algo": {"name": "grpo"}, "rollout_correction": {"rollout_is_threshold": 0.01}}, {})
        == []
    )


def test_a_growth_interval_of_one_heads_the_skipped_steps_it_causes():
    tc = _config({"name": "ppo"}, preset="fp16", overrides={"actor": {"growth_interval": 1}})
    found, policy = _found(tc)
    assert [f.where for f in found] == ["precision.overrides.actor.growth_interval"]
    scale = [65536.0 * 2**s for s in range(3)] + [2**18, 2**19, 2**20, 2**19]
    metrics = [{"step": s, "actor/skipped": 1.0 if s in (3, 6) else 0.0, "actor/loss_scale": scale[s],
                "critic/skipped": 0.0} for s in range(7)]  # fmt: skip
    d = diagnose_run(_run(tc, found, policy, metrics))
    first = d.causes[0]
    assert first.where == "precision.overrides.actor.growth_interval"
    assert first.fixes[0].suite == "precision.overrides.actor.growth_interval: 2000"
    skips = [c for c in d.causes if c.cls == "overflow"]
    assert skips and all(c.consequence_of == first.title and not c.fixes for c in skips)
    # the preset's own interval under fp16, and bf16 (no scaler): nothing to say
    assert _found(_config({"name": "ppo"}, preset="fp16"))[0] == []
    assert (
        _found(_config({"name": "ppo"}, preset="bf16", overrides={"actor": {"growth_interval": 1}}))[0] == []
    )


def test_a_tiny_loss_scale_factor_is_harmless_without_fp16_and_a_cause_with_it():
    algo = {"name": "grpo", "loss_agg_mode": "seq-mean-token-sum-norm", "loss_scale_factor": 0.001}
    tc = _config(algo, preset="fp16")
    found, policy = _found(tc)
    assert [f.kind for f in found] == [K.CONFIG_LOSS_SCALE_FACTOR]
    assert found[0].observed["fix_value"] == 8  # the response length, verl's default divisor
    skipped = [{"step": s, "actor/skipped": 1.0, "actor/loss_scale": 2.0 ** (15 - s)} for s in range(3)]
    first = diagnose_run(_run(tc, found, policy, skipped)).causes[0]
    assert first.where == "algo.loss_scale_factor" and first.fixes[0].suite == "algo.loss_scale_factor: 8"
    calm = [{"step": s, "actor/skipped": 0.0, "actor/grad_norm": 1.0} for s in range(3)]
    tcb = _config(algo, preset="bf16")
    fb, pb = _found(tcb)
    assert not any(c.where == "algo.loss_scale_factor" for c in diagnose_run(_run(tcb, fb, pb, calm)).causes)
    # another aggregation does not read it
    assert (
        R.setup_findings(
            {"algo": {**algo, "loss_agg_mode": "token-mean"}, "data": {"response_length": 8}}, {}
        )
        == []
    )


def test_the_confirmation_tests():
    s = [(0, 0.0), (1, 0.0)]
    assert confirmed({"metric": "m", "test": "all_at_most", "bound": 0.0}, s)
    assert not confirmed({"metric": "m", "test": "all_at_most", "bound": 0.0}, [(0, 0.0), (1, 0.1)])
    assert confirmed({"metric": "m", "test": "any_above", "bound": 0.0}, [(0, 0.0), (1, 1.0)])
    assert not confirmed({"metric": "m", "test": "any_above", "bound": 0.0}, s)
    assert confirmed({"metric": "m", "test": "mean_at_least", "bound": 0.5}, [(0, 0.4), (1, 0.8)])
    assert confirmed({"metric": "m", "test": "absmax_at_least", "bound": 5.0}, [(0, 0.0), (1, -5.5)])
    assert not confirmed({"metric": "m", "test": "absmax_at_least", "bound": 5.0}, [(0, float("nan"))])
    assert not confirmed({"metric": "m", "test": "any_above", "bound": 0.0}, [])


def test_a_kl_switched_on_at_zero_is_information_until_the_policy_drifts():
    tc = _config({"name": "grpo", "use_kl_loss": True, "kl_loss_coef": 0.0})
    found, policy = _found(tc)
    assert [(f.kind, f.where) for f in found] == [(K.CONFIG_COEF_ZERO, "algo.kl_loss_coef")]
    near = [{"step": s, "rollout/kl_ref": 0.01 * s} for s in range(3)]
    assert not any(c.where == "algo.kl_loss_coef" for c in diagnose_run(_run(tc, found, policy, near)).causes)
    far = [{"step": s, "rollout/kl_ref": 0.8 * s} for s in range(3)]
    first = diagnose_run(_run(tc, found, policy, far)).causes[0]
    assert first.where == "algo.kl_loss_coef" and first.fixes[0].suite == "algo.kl_loss_coef: 0.001"
    # the KL switched off is not a zero coefficient
    assert R.setup_findings({"algo": {"name": "grpo", "use_kl_loss": False, "kl_loss_coef": 0.0}}, {}) == []
