"""Setup before step in `verlaudit diagnose` (verlaudit/analysis/diagnose/setup_cause.py): a
``model.setup`` change heads the chain of what it explains through the finding that says what is
wrong, named as its culprit; a precision override that departs from the preset's contract is the root
of what it explains, with the suite key that restores it; facts that explain nothing are dropped; a
consequence is marked as one in the text and in --json alike."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from trainer.config import TrainConfig
from trainer.precision import resolve_policy
from verlaudit import kinds as K
from verlaudit.analysis.diagnose.diagnosis import diagnose_run
from verlaudit.analysis.diagnose.rules import RULES
from verlaudit.rundir import Finding, RunDir

SPEC = "my_setup.py:half_critic"


def finding(kind, *, step=0, phase="rollout", role="actor", where="model.layers.0", severity="error", **kw):
    return Finding(severity=severity, kind=kind, message=kw.pop("message", f"{kind} seen"), role=role,
                   where=where, step=step, phase=None if step is None else phase, **kw)  # fmt: skip


def setup(kind, role="actor", severity="info", observed=None):
    where = f"model.setup.{role} ({SPEC})"
    return finding(kind, step=None, role=role, where=where, severity=severity, message=f"{where} changed it",
                   observed=observed or {}, fix=f"undo it in {where}")  # fmt: skip


def run_dir(findings, *, preset="fp32", overrides=None, algo="ppo", metrics=None, status=None):
    train = {
        "algo": algo if isinstance(algo, dict) else {"name": algo},
        "precision": {"preset": preset, "overrides": overrides or {}},
        "steps": 3,
    }
    config = TrainConfig.from_dict(train)
    return RunDir(
        path=Path("/nonexistent/run"),
        manifest={"config": config.to_dict(), "policy": resolve_policy(preset, overrides).to_dict()},
        metrics=metrics or [{"step": s, "actor/loss": 0.5} for s in range(3)],
        findings=findings,
        events=[],
        status=status or {"state": "completed"},
    )


def assert_marked(d, root):
    for c in d.causes[1:]:
        if c.consequence_of is not None:
            assert c.consequence_of == root.title and not c.fixes
    js = json.loads(json.dumps(d.to_dict()))
    assert js["causes"][0]["consequence_of"] is None and js["causes"][0]["chain"]


def test_a_setup_cast_heads_its_chain_through_the_finding_it_explains_and_is_named_in_it():
    d = diagnose_run(
        run_dir(
            [
                setup(
                    K.SETUP_DTYPE,
                    "critic",
                    "warning",
                    {"module": "backbone.embed_tokens.weight", "names": []},
                ),
                finding(
                    K.PARAM_STORAGE,
                    step=None,
                    role="critic",
                    where="backbone.embed_tokens",
                    observed={"fp16": 10},
                    expected="fp32",
                    fix="keep the critic in fp32",
                ),
                finding(K.WEIGHT_NONFINITE, step=1, role="critic", where="backbone.embed_tokens"),
                finding(
                    K.NONFINITE_FORWARD, step=1, phase="values", role="critic", where="backbone.embed_tokens"
                ),
            ]
        )  # fmt: skip
    )
    first = d.causes[0]
    assert first.kind == f"finding:{K.PARAM_STORAGE}", [(c.kind, c.title) for c in d.causes]
    assert SPEC in first.title and f"model.setup.critic ({SPEC})" in first.evidence[0]
    assert first.severity == "error" and len(first.chain) >= 2
    assert any(f.suite == f"model.setup.critic ({SPEC})" for f in first.fixes)
    assert not any(c.kind == f"finding:{K.SETUP_DTYPE}" for c in d.causes)  # taken over, not listed twice
    assert all(c.consequence_of == first.title for c in d.causes[1:] if c.role == "critic")
    assert_marked(d, first)


def test_a_setup_resize_with_no_state_finding_of_its_own_role_is_the_root_of_the_failure():
    d = diagnose_run(
        run_dir(
            [
                setup(K.SETUP_VOCAB, "actor", "warning", {"module": "model.embed_tokens"}),
                finding(
                    K.REFERENCE_NOT_ACTOR, step=None, role="reference", where="model.embed_tokens.weight"
                ),
            ],
            status={
                "state": "failed",
                "reason": "exception",
                "step": 0,
                "phase": "ref",
                "role": "reference",
                "error": "IndexError: index out of range in self",
                "where": "model.embed_tokens",
            },  # fmt: skip
        )
    )
    first = d.causes[0]
    assert first.kind == f"finding:{K.SETUP_VOCAB}" and SPEC in first.title, [
        (c.kind, c.title) for c in d.causes
    ]
    assert first.severity == "error" and first.fixes[0].suite == f"model.setup.actor ({SPEC})"
    assert {c.kind for c in d.causes if c.consequence_of == first.title} >= {
        "exception",
        f"finding:{K.REFERENCE_NOT_ACTOR}",
    }


def test_a_frozen_model_is_a_warning_of_its_own_and_a_fact_that_explains_nothing_is_dropped():
    d = diagnose_run(run_dir([setup(K.SETUP_TRAINABLE, severity="warning"), setup(K.SETUP_HOOKS)]))
    assert [c.kind for c in d.causes] == [f"finding:{K.SETUP_TRAINABLE}"] and d.verdict == "warning"
    assert diagnose_run(run_dir([setup(K.SETUP_HOOKS), setup(K.SETUP_MODULES)])).verdict == "clean"


def test_a_hook_the_setup_put_on_a_module_names_the_setup_in_the_module_output_finding():
    d = diagnose_run(
        run_dir(
            [
                setup(K.SETUP_HOOKS, observed={"module": "model.layers.0", "modules": ["model.layers.0"]}),
                finding(
                    K.MODULE_OUTPUT,
                    step=0,
                    phase="actor_update",
                    where="model.layers.0",
                    severity="warning",
                    observed="bf16",
                    expected="fp32",
                    fix="remove the cast",
                ),
            ]
        )  # fmt: skip
    )
    first = d.causes[0]
    assert (
        first.kind == f"finding:{K.MODULE_OUTPUT}" and first.where == "model.layers.0" and SPEC in first.title
    )
    assert len(d.causes) == 1 and first.chain


def test_a_setup_change_in_one_role_explains_nothing_in_another():
    d = diagnose_run(
        run_dir(
            [
                setup(K.SETUP_DTYPE, "critic", observed={"module": "x"}),
                finding(
                    K.PARAM_STORAGE,
                    step=None,
                    role="actor",
                    where="lm_head",
                    observed={"bf16": 1},
                    expected="fp32",
                ),
            ]
        )  # fmt: skip
    )
    assert [c.kind for c in d.causes] == [f"finding:{K.PARAM_STORAGE}"] and SPEC not in d.causes[0].title


@pytest.mark.parametrize(
    "overrides, symptom, key, fix",
    [
        ({"actor": {"loss_scaling": "none"}}, finding(K.GRAD_UNDERFLOW, phase="actor_update", severity="warning"),
         "loss_scaling", "precision.overrides.actor.loss_scaling: dynamic"),
        ({"actor": {"loss_scaling": "static", "init_scale": 1e9}},
         finding(K.OVERFLOW, phase="actor_update", observed={"dtype": "fp16"}),
         "loss_scaling", "precision.overrides.actor.loss_scaling: dynamic"),
        ({"actor": {"param_dtype": "fp16"}}, finding(K.WEIGHT_NONFINITE, step=1, where="model.embed_tokens"),
         "param_dtype", "precision.overrides.actor.param_dtype: fp32"),
    ],
)  # fmt: skip
def test_an_override_away_from_the_preset_is_the_root_of_what_it_explains(overrides, symptom, key, fix):
    d = diagnose_run(run_dir([symptom], preset="fp16", overrides=overrides))
    first = d.causes[0]
    assert first.where == f"precision.overrides.actor.{key}", [(c.kind, c.title) for c in d.causes]
    assert first.fixes[0].suite == fix and first.severity != "info"
    assert_marked(d, first)


def test_an_override_that_explains_nothing_is_dropped_and_a_preset_alone_has_none():
    assert (
        diagnose_run(run_dir([], preset="fp16", overrides={"actor": {"loss_scaling": "none"}})).causes == []
    )
    for preset in ("fp32", "fp16", "bf16", "bf16-pure"):
        assert diagnose_run(run_dir([], preset=preset)).causes == []
    # raising a role's precision above the preset's loses nothing
    assert (
        diagnose_run(run_dir([], preset="bf16-pure", overrides={"critic": {"compute_dtype": "fp32"}})).causes
        == []
    )


def test_a_reference_computing_below_the_actor_is_a_warning_with_the_first_kl():
    no_kl = run_dir([], preset="fp32", overrides={"reference": {"compute_dtype": "bf16"}}, algo="grpo")
    assert diagnose_run(no_kl).causes == []  # no KL term: the reference is not read
    metrics = [{"step": 0, "rollout/kl_ref": 4.6e-5}, {"step": 1, "rollout/kl_ref": 1e-3}]
    over = {"reference": {"param_dtype": "bf16", "compute_dtype": "bf16"}}
    d = diagnose_run(
        run_dir(
            [], preset="fp32", overrides=over, algo={"name": "grpo", "use_kl_loss": True}, metrics=metrics
        )
    )
    assert d.verdict == "warning" and len(d.causes) == 1
    c = d.causes[0]
    assert c.where == "precision.overrides.reference.compute_dtype" and "4.6e-05" in c.title
    assert c.fixes[0].suite == "precision.overrides.reference.compute_dtype: fp32"


def test_every_rule_from_a_setup_or_override_class_names_a_registered_symptom_class():
    for root, symptom in RULES:
        if root.startswith(("setup_", "override_")):
            assert root in K.ROOT_CLASSES and symptom in K.CLASSES, (root, symptom)


def test_a_fix_that_sets_a_role_to_the_precision_it_already_resolved_to_is_dropped():
    from verlaudit.analysis.causes import Fix
    from verlaudit.analysis.diagnose import fixcheck

    run = run_dir([], preset="bf16", overrides={"critic": {"compute_dtype": "fp32"}})
    same = Fix("precision.overrides.actor.param_dtype: fp32", None, "")  # the bf16 preset's master weights
    overridden = Fix("precision.overrides.critic.compute_dtype: fp32", None, "")  # the suite sets it already
    other = Fix("precision.overrides.actor.compute_dtype: fp32", None, "")  # bf16 now: a real change
    assert fixcheck.already_set(run, same) and fixcheck.already_set(run, overridden)
    assert not fixcheck.already_set(run, other)


def test_a_setup_run_on_every_role_names_itself_in_the_role_where_its_change_shows():
    hooks = {"module": "model.layers.0", "modules": ["model.layers.0"]}
    d = diagnose_run(
        run_dir(
            [
                setup(K.SETUP_HOOKS, "actor", observed=hooks),
                setup(K.SETUP_HOOKS, "reference", observed=hooks),
                finding(
                    K.MODULE_OUTPUT,
                    step=0,
                    phase="ref",
                    role="reference",
                    where="model.layers.0",
                    severity="warning",
                    observed="bf16",
                    expected="fp32",
                ),
            ]
        )  # fmt: skip
    )
    assert [c.kind for c in d.causes] == [f"finding:{K.MODULE_OUTPUT}"] and SPEC in d.causes[0].title
