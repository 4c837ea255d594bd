"""Fixes built from the evidence (verlaudit/analysis/diagnose/evidence_fix.py, reward_signal.saturated) and the
ranking of a root above what it produced (rules.py's model channel and standing causes). Hand-made run
directories with the findings the audit writes; each family with members of our own (none a bench item)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.diagnose_runs import causes, make_run
from verlaudit import kinds as K
from verlaudit.analysis.diagnose import evidence_fix
from verlaudit.audit import reward_signal
from verlaudit.rundir import Finding


def _f(
    kind, *, where, observed=None, severity="error", step=0, phase=None, role="actor", fix="the kind's advice"
):
    return Finding(severity=severity, kind=kind, message=f"{kind} happened", role=role, where=where, step=step,
                   phase=phase, observed=observed, fix=fix)  # fmt: skip


# ---------------------------------------------------------------- a reward model saturated at a bound


def _constant(scores):
    w = reward_signal.ConstantWatch()
    w.observe(scores, step=0, source="model:rm", data={}, model_spec="rm.py:load")
    return w.observe(scores, step=1, source="model:rm", data={}, model_spec="rm.py:load")


@pytest.mark.parametrize(
    "scores",
    [
        torch.sigmoid(torch.linspace(20.0, 40.0, 8)),  # logits far past sigmoid's range: 1.0 in fp32
        torch.softmax(torch.randn(8, 1), dim=-1)[:, 0],  # a softmax over one logit is always 1
        torch.tanh(torch.linspace(-40.0, -20.0, 8)),  # tanh's bottom
        torch.sigmoid(torch.linspace(-120.0, -110.0, 8)),  # sigmoid's bottom
    ],
)
def test_a_reward_model_stuck_at_a_squashing_bound_is_told_to_return_the_logit(scores):
    f = _constant(scores)
    assert f is not None and f.kind == K.REWARD_CONSTANT
    assert "saturates" in f.fix and "raw logit" in f.fix and "model.reward_model (rm.py:load)" in f.fix


def test_a_constant_inside_the_range_keeps_the_general_advice():
    f = _constant(torch.full((8,), 0.37))
    assert f is not None and "saturates" not in f.fix and "check what the reward reads" in f.fix


# ---------------------------------------------------------------- identical preference pairs: some or all


@pytest.mark.parametrize(("n", "batch", "filtered"), [(3, 8, True), (1, 16, True), (8, 8, False)])
def test_identical_pairs_in_some_rows_are_filtered_in_all_rebuilt(tmp_path, n, batch, filtered):
    where = "data.dataset (pairs.py:make)"
    fs = [
        _f(
            K.IDENTICAL_PAIRS,
            where=where,
            observed={"identical_pairs": n, "batch": batch},
            fix="build rejected otherwise",
        )
    ]
    d = causes(make_run(tmp_path / "run", algo="dpo", steps=3, findings=fs))
    c = next(c for c in d.causes if c.kind == f"finding:{K.IDENTICAL_PAIRS}")
    assert c.fixes[0].suite == where
    assert ("chosen != rejected" in c.fixes[0].why) is filtered
    assert filtered or c.fixes[0].why == "build rejected otherwise"


# ---------------------------------------------------------------- a setup that replaced the loaded weights


@pytest.mark.parametrize(("rel", "replaced"), [(1.41, True), (1.0, True), (0.93, True), (0.05, False)])
def test_weights_replaced_by_the_setup_name_the_reinitialisation(tmp_path, rel, replaced):
    fs = [_f(K.REFERENCE_NOT_ACTOR, where="lm_head.weight", role="reference", step=None,
             observed={"differ": 4, "worst_rel": rel}, fix="run model.setup.actor on the reference too")]  # fmt: skip
    run = make_run(
        tmp_path / "run", algo="grpo", steps=3, findings=fs, model={"setup": {"actor": "s.py:prepare"}}
    )
    d = causes(run)
    c = d.causes[0]
    assert c.kind == f"finding:{K.REFERENCE_NOT_ACTOR}"
    assert ("re-initialisation" in c.title) is replaced
    if replaced:
        assert c.fixes[0].suite == "model.setup.actor (s.py:prepare)" and "reset_parameters" in c.fixes[0].why
    else:
        assert c.fixes[0].why == "run model.setup.actor on the reference too"


# ---------------------------------------------------------------- every kind's fix names its culprit


def test_every_finding_kinds_fix_names_the_suite_key_its_finding_names(tmp_path):
    """Whatever the kind, a finding whose where is a suite key (with its plug-in) gets a first fix naming it."""
    where = "data.dataset (rows.py:build)"
    skip = {K.REWARD_ANSWER_SCORES}  # info facts: no cause of their own
    kinds = sorted(k for k in K.FINDINGS if k not in skip and not k.startswith(K.SETUP_PREFIX))
    fs = [_f(k, where=where, step=0, phase="reward", fix=f"change what makes {k}") for k in kinds]
    d = causes(make_run(tmp_path / "run", algo="grpo", steps=3, findings=fs))
    named = [c for c in d.causes if c.kind.startswith("finding:") and c.consequence_of is None and c.fixes]
    assert len(named) >= 10, [c.kind for c in d.causes]
    for c in named:  # the key the finding names, or the kind's own key (a reward model's weights: model.path)
        fix = c.fixes[0]
        assert fix.suite or "rows.py:build" in fix.why, (c.kind, fix)
    assert sum(c.fixes[0].suite == where for c in named) >= len(named) - 5, [c.fixes[0].suite for c in named]


def test_a_module_path_is_no_suite_key():
    assert (
        evidence_fix.suite_key("model.layers.0.mlp") is None
        and evidence_fix.suite_key("lm_head.weight") is None
    )
    assert evidence_fix.suite_key("model.setup (s.py:f)") == "model.setup (s.py:f)"
    assert evidence_fix.suite_key("algo.clip_ratio_high") == "algo.clip_ratio_high"


# ---------------------------------------------------------------- the root above what it produced


def _silent_grpo(tmp_path, findings):
    metrics = [{"reward/mean": 0.0, "reward/std": 0.0, "reward/identical_group_frac": 1.0} for _ in range(3)]
    return causes(make_run(tmp_path / "run", algo="grpo", steps=3, metrics=metrics, findings=findings))


@pytest.mark.parametrize(
    "kind", [K.ANSWER_FORM, K.REWARD_ANSWER_LENIENT, K.REWARD_ANSWER_UNSCORED, K.IDENTICAL_PAIRS]
)
def test_a_standing_cause_seen_at_step_1_explains_the_silence_from_step_0(tmp_path, kind):
    d = _silent_grpo(tmp_path, [_f(kind, where="data.train_files (rows.parquet)", step=1, phase="reward")])
    assert d.causes[0].kind == f"finding:{kind}", [(c.kind, c.step) for c in d.causes]
    assert any(c.consequence_of == d.causes[0].title for c in d.causes[1:])
    assert "It explains: No learning signal" in d.causes[0].what


def test_a_standing_cause_first_seen_late_explains_nothing_before(tmp_path):
    d = _silent_grpo(
        tmp_path, [_f(K.ANSWER_FORM, where="data.train_files (rows.parquet)", step=5, phase="reward")]
    )
    assert d.causes[0].kind == "no_signal", [(c.kind, c.step) for c in d.causes]


@pytest.mark.parametrize(
    ("setup_kind", "symptom", "sym_where", "sym_role"),
    [
        (K.SETUP_HOOK_OUTPUT, K.MISMATCH_BEYOND_DTYPE, "rollout:hf-generate", "rollout"),
        (K.SETUP_HOOK_OUTPUT, K.SHADOW_EXCESS, "model.embed_tokens", "actor"),
        (K.SETUP_NO_GRAPH, K.REFERENCE_NOT_ACTOR, "lm_head.weight", "reference"),
    ],
)
def test_a_setup_change_heads_what_the_model_then_computes(
    tmp_path, setup_kind, symptom, sym_where, sym_role
):
    fs = [
        _f(setup_kind, where="model.setup.actor (s.py:prepare)", severity="warning", step=None),
        _f(symptom, where=sym_where, role=sym_role, severity="error", step=0, phase="rollout",
           observed=0.5 if symptom == K.MISMATCH_BEYOND_DTYPE else {"ratio": 40.0}),
    ]  # fmt: skip
    run = make_run(
        tmp_path / "run", algo="grpo", steps=3, findings=fs, model={"setup": {"actor": "s.py:prepare"}}
    )
    d = causes(run)
    assert d.causes[0].kind == f"finding:{setup_kind}", [(c.kind, c.title) for c in d.causes]
    assert d.causes[0].severity != "info" and "s.py:prepare" in str(d.causes[0].fixes[0])


# ---------------------------------------------------------------- rewards handed back in another order


@pytest.mark.parametrize(
    ("twin", "random", "ordered"), [(True, False, True), (False, False, False), (True, True, False)]
)
def test_rewards_that_move_between_rows_both_ways_are_told_to_keep_the_row_index(
    tmp_path, twin, random, ordered
):
    where = "reward:function:r.py:pooled"
    fs = [_f(K.REWARD_FOLLOWS_POSITION, where=where, role="reward", phase="reward", fix="group as [prompts, group]",
             observed={"rows_moved": 4, "rows": 8, "group_size": 1})]  # fmt: skip
    if twin:
        fs.append(_f(K.REWARD_NOT_REPEATABLE, where=where, role="reward", phase="reward", step=1, fix="no state",
                     observed={"rows_moved": 4, "rows": 8, "random_state_moved": random}))  # fmt: skip
    d = causes(
        make_run(tmp_path / "run", algo="grpo", steps=3, findings=fs, data={"reward_fn": "r.py:pooled"})
    )
    c = next(c for c in d.causes if c.kind == f"finding:{K.REWARD_FOLLOWS_POSITION}")
    assert ("as_completed" in c.fixes[0].why and "index" in c.fixes[0].why) is ordered
    assert c.fixes[0].suite == "data.reward_fn (r.py:pooled)"


# ---------------------------------------------------------------- an untrained-looking policy after a setup


@pytest.mark.parametrize(
    ("setup", "names_setup"), [({"actor": "s.py:tune"}, True), ("s.py:tune", True), (None, False)]
)
def test_a_policy_that_predicts_like_an_untrained_one_after_a_setup_names_the_setup(
    tmp_path, setup, names_setup
):
    fs = [_f(K.WEIGHTS_UNTRAINED, where="model.path (ckpt)", step=None, observed={"nll": 3.5, "unigram": 2.1},
             fix="check the checkpoint in ckpt")]  # fmt: skip
    model = {"setup": setup} if setup else None
    d = causes(make_run(tmp_path / "run", algo="grpo", steps=3, findings=fs, model=model))
    c = d.causes[0]
    assert ("s.py:tune" in c.title) is names_setup
    assert ("s.py:tune" in (c.fixes[0].suite or "")) is names_setup and len(c.fixes) >= 1


# ---------------------------------------------------------------- a rollout dtype boundary an override made


@pytest.mark.parametrize(
    ("preset", "overrides", "key"),
    [
        ("fp32", {"actor": {"compute_dtype": "bf16"}}, "precision.overrides.actor.compute_dtype: fp32"),
        ("fp32", {"rollout": {"compute_dtype": "bf16"}}, "precision.overrides.rollout.compute_dtype: fp32"),
        ("bf16", {"actor": {"compute_dtype": "fp16"}}, "precision.overrides.actor.compute_dtype: bf16"),
    ],
)
def test_a_rollout_dtype_boundary_names_the_override_that_made_it(preset, overrides, key):
    from tests.test_setup_cause import run_dir
    from verlaudit.analysis.diagnose.diagnosis import diagnose_run

    f = _f(K.ROLLOUT_DTYPE, where="rollout:hf-generate", role="rollout", phase="rollout", severity="warning",
           observed="fp32", fix="set precision.overrides.rollout.compute_dtype: bf16")  # fmt: skip
    d = diagnose_run(run_dir([f], preset=preset, overrides=overrides, algo="grpo"))
    c = d.causes[0]
    # the boundary itself, its title and fix naming the override (rank12), or the override's own cause that
    # roots it (setup12's override_rollout_apart, for a trained role's compute override): the key comes first
    assert c.kind in (f"finding:{K.ROLLOUT_DTYPE}", "override_rollout_apart"), [
        (x.kind, x.title) for x in d.causes
    ]
    assert key.split(":")[0] in c.title and c.fixes[0].suite == key, (c.title, c.fixes)


def test_a_rollout_dtype_boundary_without_an_override_keeps_its_own_fix():
    from tests.test_setup_cause import run_dir
    from verlaudit.analysis.diagnose.diagnosis import diagnose_run

    f = _f(K.ROLLOUT_DTYPE, where="rollout:hf-generate", role="rollout", phase="rollout", severity="warning",
           observed="fp32", fix="set precision.overrides.rollout.compute_dtype: bf16")  # fmt: skip
    c = diagnose_run(run_dir([f], preset="bf16", algo="grpo")).causes[0]
    assert "from precision.overrides" not in c.title and "compute_dtype: bf16" in c.fixes[0].why


# ---------------------------------------------------------------- an override the role's model does not follow


@pytest.mark.parametrize(
    ("role", "overrides", "kind", "observed", "expected", "source"),
    [
        ("reward", {"param_dtype": "fp16", "compute_dtype": "fp16"}, K.REWARD_MODEL_DTYPE, {"fp32": 120}, "fp16",
         {"reward_model": "rm.py:load"}),
        ("critic", {"param_dtype": "bf16"}, K.PARAM_STORAGE, {"fp32": 300}, "bf16", {"critic_path": "/ckpt/critic"}),
        ("reward", {"compute_dtype": "bf16"}, K.COMPUTE, "fp32", "bf16", {"reward_model": "rm.py:load"}),
    ],
)  # fmt: skip
def test_an_override_the_model_does_not_follow_is_the_root(role, overrides, kind, observed, expected, source):
    from tests.test_setup_cause import run_dir
    from verlaudit.analysis.diagnose.diagnosis import diagnose_run

    f = dataclasses.replace(_f(kind, where="head", role=role, severity="info", phase="reward", observed=observed),
                            expected=expected)  # fmt: skip
    run = run_dir([f], overrides={role: overrides}, algo="ppo")
    run.manifest["config"]["model"].update(source)
    c = diagnose_run(run).causes[0]
    assert c.kind == "override_ignored" and c.severity == "warning", c.title
    assert f"precision.overrides.{role}" in c.title and "configured" in c.title
    assert ".half()" in c.fixes[0].why or ".to(" in c.fixes[0].why
    assert str(next(iter(source.values()))) in c.fixes[0].suite


def test_an_override_the_model_follows_or_no_override_is_quiet():
    from tests.test_setup_cause import run_dir
    from verlaudit.analysis.diagnose.diagnosis import diagnose_run

    f = _f(K.REWARD_MODEL_DTYPE, where="embed", role="reward", severity="info", observed={"fp32": 12})
    d = diagnose_run(run_dir([f], overrides={"reward": {"param_dtype": "fp32"}}))
    assert not any(c.kind == "override_ignored" for c in d.causes)
    d = diagnose_run(
        run_dir([f], preset="fp16")
    )  # no override: the preset's own choice is no contract broken
    assert not any(c.kind == "override_ignored" for c in d.causes)


# ---------------------------------------------------------------- an exception in a module, called from the user's code

_TB = (
    "Traceback (most recent call last):\n"
    '  File "/home/u/loops/{file}", line {line}, in {fn}\n'
    "    logits = model(input_ids=seq).logits\n"
    '  File "/venv/lib/python3.11/site-packages/torch/nn/modules/module.py", line 1778, in _wrapped_call_impl\n'
    "    return self._call_impl(*args, **kwargs)\n"
    "RuntimeError: boom"
)


@pytest.mark.parametrize(
    ("file", "line", "fn", "error", "advice"),
    [
        ("my_loop.py", 130, "forward_logp", "RuntimeError: Inference tensors cannot be saved for backward. To work "
         "around this, you can make a clone to get a normal tensor.", "clone"),
        ("train.py", 42, "step", "RuntimeError: element 0 of tensors does not require grad and does not have a "
         "grad_fn", "fix it there"),
        ("rl.py", 7, "update", "RuntimeError: a leaf Variable that requires grad is being used in an in-place "
         "operation. Please use out-of-place ops.", "out-of-place"),
    ],
)  # fmt: skip
def test_an_exception_in_a_module_names_the_users_line_that_called_it(
    tmp_path, file, line, fn, error, advice
):
    st = {"reason": "exception", "step": 0, "phase": "actor_update", "where": "model.embed_tokens", "error": error,
          "traceback": _TB.format(file=file, line=line, fn=fn)}  # fmt: skip
    d = causes(make_run(tmp_path / "run", steps=2, metrics=[], status=("failed", st)))
    c = d.causes[0]
    assert c.kind == "exception" and f"{file}:{line} in {fn}" in c.title and c.where == "model.embed_tokens"
    assert advice in c.fixes[0].why and f"{file}:{line}" in c.fixes[0].why
