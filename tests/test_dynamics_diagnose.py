"""How diagnose reads the dynamics and configuration causes (verlaudit/analysis/diagnose/diagnosis.py): a
setting decided before the run heads the diagnosis over what it produces; an fp16 overflow that made the
loss non-finite before any update names the preset, one after updates does not claim it."""

from __future__ import annotations

from pathlib import Path

from trainer.config import TrainConfig
from trainer.precision import resolve_policy
from verlaudit import kinds as K
from verlaudit.analysis.diagnose.diagnosis import diagnose_run
from verlaudit.audit import config_checks
from verlaudit.rundir import Finding, RunDir


def _run(findings, *, algo, preset="fp32", metrics=(), status=None) -> RunDir:
    config = TrainConfig.from_dict({"algo": algo, "precision": {"preset": preset}, "steps": 3})
    return RunDir(
        path=Path("/nonexistent/run"),
        manifest={"config": config.to_dict(), "policy": resolve_policy(preset).to_dict()},
        metrics=list(metrics),
        findings=list(findings),
        events=[],
        status=status or {"state": "completed"},
    )


def _overflow(step, phase):
    return Finding(
        severity="error",
        kind=K.OVERFLOW,
        role="actor",
        where="model.layers.0.mlp.down_proj",
        step=step,
        phase=phase,
        message="model.layers.0.mlp.down_proj produced inf in its forward output from finite inputs",
        observed={"value": "inf", "dtype": "fp16"},
        expected="finite",
    )


def test_an_fp16_overflow_before_any_update_names_the_preset():
    failed = {"state": "failed", "reason": "exception", "step": 0, "phase": "rollout",
              "error": "RuntimeError: probability tensor contains either `inf`, `nan` or element < 0"}  # fmt: skip
    d = diagnose_run(_run([_overflow(0, "rollout")], algo={"name": "ppo"}, preset="fp16", status=failed))
    title = d.causes[0].title
    assert "fp16 overflow" in title and "before any update" in title and "precision.preset fp16" in title
    # after updates the weights are the run's own: the preset is not claimed (the lr may be the cause)
    metrics = [{"step": s, "actor/loss": 0.5} for s in range(3)]
    late = diagnose_run(_run([_overflow(2, "actor_update")], algo={"name": "ppo"}, preset="fp16", metrics=metrics,
                             status={**failed, "step": 2, "phase": "actor_update"}))  # fmt: skip
    assert "fp16 overflow" in late.causes[0].title and "before any update" not in late.causes[0].title


def test_a_setting_decided_at_setup_heads_the_diagnosis():
    # label smoothing near 0.5 (a DPO run with nothing else wrong): the config cause is the diagnosis
    algo = {"name": "dpo", "label_smoothing": 0.45}
    found = config_checks.setup_findings({"algo": algo, "data": {"response_length": 8}})
    d = diagnose_run(_run(found, algo=algo))
    assert d.causes[0].kind == f"finding:{K.LABEL_SMOOTHING}" and d.causes[0].where == "algo.label_smoothing"
    assert "label_smoothing" in d.causes[0].fixes[0].why


def test_identical_groups_under_a_cold_sampler_explain_the_missing_signal():
    sampling = Finding(severity="warning", kind=K.SAMPLING_COLLAPSE, role="actor", where="algo.temperature",
                       step=0, phase="rollout", message="4 of 4 groups' 4 responses are token-identical",
                       observed={"identical_groups": 4}, fix="set algo.temperature: 1.0")  # fmt: skip
    silent = [
        Finding(severity="warning", kind=K.NO_SIGNAL, role="reward", where="reward:function:r", step=s,
                phase="reward", message="all 4 groups got identical rewards", observed={"identical_groups": 4})
        for s in range(3)
    ]  # fmt: skip
    metrics = [{"step": s, "reward/identical_group_frac": 1.0, "actor/pg_loss": 0.0} for s in range(3)]
    d = diagnose_run(_run([sampling, *silent], algo={"name": "grpo", "temperature": 0.01}, metrics=metrics))
    first = d.causes[0]
    assert first.where == "algo.temperature" and "temperature" in first.fixes[0].why
    assert any(c.consequence_of == first.title for c in d.causes[1:] if c.cls == "no_signal")
