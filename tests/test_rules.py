"""The root-cause rule table (verlaudit/analysis/diagnose/rules.py), one test per rule: a run directory (in
memory, records as the auditor and the worker write them) holding the root's record and the symptom's
is diagnosed, the root comes first and the symptom is its consequence; with the root recorded after
the symptom, the symptom stands alone; for a rule within one role, a root in another role explains
nothing. The rule between a foreign log's classes (`verlaudit.analysis.logs.classify`) on log causes.
Plus the ordering itself (`Moment`, `root_of`, `chains`) on hand-built events.

Run: `pytest tests/test_rules.py`.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from trainer.config import TrainConfig
from trainer.precision import resolve_policy
from verlaudit import kinds as K
from verlaudit.analysis import logs
from verlaudit.analysis.causes import Cause, Fix
from verlaudit.analysis.diagnose.diagnosis import diagnose_run, order_log
from verlaudit.analysis.diagnose.rules import PHASE_RANK, RULES, Event, Moment, chains, root_of
from verlaudit.rundir import Finding, RunDir


def finding(
    kind,
    *,
    step=0,
    phase="rollout",
    role="actor",
    where="model.layers.0.mlp",
    observed=None,
    expected=None,
    severity="error",
    message=None,
):
    return Finding(
        severity=severity,
        kind=kind,
        step=step,
        phase=phase,
        role=role,
        where=where,
        observed=observed,
        expected=expected,
        message=message or f"{kind} at {where}",
        fix=f"fix the {kind} at {where}",
    )


class Records:
    """What one side of a rule leaves in a run directory."""

    def __init__(self, findings=(), status=None, metrics=None, preset=None):
        self.findings, self.status, self.metrics, self.preset = list(findings), status, metrics, preset


def nan_loss(step=0, role="actor"):
    metrics = [{"step": s, "actor/loss": 0.5, "actor/skipped": 0.0} for s in range(step)]
    metrics.append({"step": step, "actor/loss": "nan", "actor/skipped": 1.0})
    return Records(
        [
            finding(
                "numerics/nonfinite_loss",
                step=step,
                phase="actor_update",
                role=role,
                where="loss",
                observed={"loss": "nan"},
                expected="finite",
            )
        ],
        metrics=metrics,
    )


def fp16_skips(first=0, n=3, nan_at=None):
    """Steps the dynamic loss scaler skipped (fp16), the scale halving each time."""
    metrics = []
    for s in range(first + n + 1):
        skipped = first <= s < first + n
        metrics.append(
            {
                "step": s,
                "actor/loss": 0.5,
                "actor/skipped": 1.0 if skipped else 0.0,
                "actor/loss_scale": 65536.0 / 2 ** max(0, min(s, first + n) - first),
            }
        )
    if nan_at is not None:
        metrics[nan_at]["actor/loss"] = "inf"
    return Records(metrics=metrics, preset="fp16")


def failed(reason, error, *, step=0, phase="rollout", role="actor", where="model.embed_tokens"):
    findings = []
    if reason == "dtype_error":
        findings = [
            finding(
                "runtime/dtype_error",
                step=step,
                phase=phase,
                role=role,
                where=where,
                observed="fp32",
                expected="bf16",
            )
        ]
    status = {
        "state": "failed",
        "reason": reason,
        "step": step,
        "phase": phase,
        "error": error,
        "role": role,
        "where": where,
    }
    return Records(findings, status=status)


# the root side of each rule: (step, phase, role) -> its records
ROOTS = {
    "ids_float": lambda st, ph, role: Records([finding(K.COLLATOR_FLOAT_IDS, step=st, phase=ph, role=role,
                                                       where="collator:c.input_ids", observed="fp32", expected="int64")]),
    "ids_range": lambda st, ph, role: Records([finding(K.COLLATOR_ID_RANGE, step=st, phase=ph, role=role,
                                                       where="collator:c.input_ids", observed=[0, 107], expected=[0, 99])]),
    "batch_shape": lambda st, ph, role: Records([finding(K.COLLATOR_SHAPE, step=st, phase=ph, role=role,
                                                         where="collator:c.attention_mask", observed=[2, 7],
                                                         expected=[2, 8])]),
    "reward_nonfinite": lambda st, ph, role: Records([finding(K.REWARD_NONFINITE, step=st, phase=ph, role=role,
                                                              where="reward:function:r", observed="nan",
                                                              expected="finite")]),
    "reward_model_dtype": lambda st, ph, role: Records([finding("boundary/reward_model", step=st, phase=ph, role=role,
                                                                where="score", observed={"fp16": 10},
                                                                expected="fp32")]),
    "weights_nonfinite": lambda st, ph, role: Records([finding("numerics/weight_nonfinite", step=st, phase=ph,
                                                               role=role, where="model.layers.1.mlp.down_proj",
                                                               observed={"nonfinite": 1}, expected="finite")]),
    "weights_outlier": lambda st, ph, role: Records([finding("numerics/weight_outlier", step=st, phase=ph, role=role,
                                                             where="model.layers.1.mlp.down_proj",
                                                             observed={"rms_ratio": 3e4}, expected="< 10")]),
    "param_dtype": lambda st, ph, role: Records([finding("dtype/param_storage", step=st, phase=ph, role=role,
                                                         observed={"fp32": 90, "bf16": 10}, expected="fp32")]),
    "module_output_dtype": lambda st, ph, role: Records([finding("dtype/module_output", step=st, phase=ph, role=role,
                                                                 observed="bf16", expected="fp32")]),
    "module_input_dtype": lambda st, ph, role: Records([finding("dtype/module_input", step=st, phase=ph, role=role,
                                                                observed="fp32", expected="bf16")]),
    "overflow": lambda st, ph, role: fp16_skips(first=max(0, st), n=3),
    "compute_dtype": lambda st, ph, role: Records([finding(K.CONTRACT_COMPUTE, step=st, phase=ph, role=role,
                                                           where="lm_head", observed={"pass": "forward", "share": 1.0},
                                                           expected="fp32")]),
    "plugin_nonfinite": lambda st, ph, role: Records([finding(K.PLUGIN_NONFINITE_OP, step=st, phase=ph, role=role,
                                                              where="data.reward_fn (function:r)",
                                                              observed={"op": "exp", "line": "r.py:3"})]),
    "plugin_precision": lambda st, ph, role: Records([finding(K.PLUGIN_PRECISION_LOSS, step=st, phase=ph, role=role,
                                                              where="model.reward_model (model:m)",
                                                              observed={"distinct": 3, "distinct_high": 12})]),
    "reward_integer": lambda st, ph, role: Records([finding(K.REWARD_INTEGER, step=st, phase=ph, role=role,
                                                            where="reward:function:r", severity="warning",
                                                            observed={"dtype": "int64", "values": [0]})]),
    "newly_initialised": lambda st, ph, role: Records([finding(K.NEWLY_INITIALISED, step=st, phase=ph, role=role,
                                                               where="model.reward_model (/ckpt)",
                                                               observed={"missing": 1}, expected="every weight")]),
    "tied_weights": lambda st, ph, role: Records([finding(K.TIED_WEIGHTS_BROKEN, step=st, phase=ph, role=role,
                                                          where="lm_head.weight", observed="separate tensors",
                                                          expected="one tensor", severity="warning")]),
    "vocab": lambda st, ph, role: Records([finding(K.VOCAB_MISMATCH, step=st, phase=ph, role=role,
                                                   where="response_ids", observed=125, expected="< 100",
                                                   severity="warning")]),
    "learning_rate": lambda st, ph, role: Records([finding(K.WEIGHT_GROWTH, step=st, phase=ph, role=role, where="*",
                                                           observed={"median_growth": 9.0, "lr": 0.2},
                                                           expected="weight RMS within 4x of setup")]),
    "dropout": lambda st, ph, role: Records([finding(K.DROPOUT_ACTIVE, step=st, phase=ph, role=role, where="config",
                                                     severity="warning", observed={"config": {"attention_dropout": 0.2}},
                                                     expected="dropout 0")]),
    "rollout_engine": lambda st, ph, role: Records([finding(K.ROLLOUT_SAMPLING, step=st, phase=ph, role="rollout",
                                                            where="rollout:hf-generate.sampling.truncation",
                                                            severity="warning", observed="top_k 0, top_p 0.5",
                                                            expected="top_k 0, top_p 1")]),
    # dyn24: the sampling setting that made a group's responses identical
    "sampling": lambda st, ph, role: Records([finding(K.SAMPLING_COLLAPSE, step=st, phase=ph, role=role,
                                                      where="algo.temperature", severity="warning",
                                                      observed={"identical_groups": 4, "groups": 4})]),
    # plug24: an own loop's checks (verlaudit.integrations.loop_checks)
    "loop_scaling": lambda st, ph, role: Records([finding(K.LOOP_UNSCALED_BACKWARD, step=st, phase=ph, role=role,
                                                          where="GradScaler at loop.py:9 (step)")]),
    "autocast_device": lambda st, ph, role: Records([finding(K.LOOP_AUTOCAST_INACTIVE, step=st, phase=ph, role=role,
                                                             where="autocast at loop.py:7 (step)",
                                                             severity="warning")]),
    "round_trip": lambda st, ph, role: Records([finding(K.LOOP_WEIGHT_ROUND_TRIP, step=st, phase=ph, role=role,
                                                        where="cast of the actor at loop.py:5 (gen)")]),
    "reward_constant": lambda st, ph, role: Records([finding(K.REWARD_CONSTANT, step=st, phase=ph, role="reward",
                                                             where="data.reward_fn (r.py:f)", severity="warning",
                                                             observed={"values": [0.0], "steps": 2})]),
    # loop24: an own loop's cadence and graph (verlaudit.integrations.loop_protocol)
    "loop_cadence": lambda st, ph, role: Records([finding(K.LOOP_SCHEDULER_CADENCE, step=st, phase=ph, role=role,
                                                          where="scheduler.step at loop.py:12 (step)")]),
    "loop_graph": lambda st, ph, role: Records([finding(K.LOOP_LOSS_NO_GRAPH, step=st, phase=ph, role=role,
                                                        where="backward at loop.py:14 (step)")]),
    "loop_optimizer": lambda st, ph, role: Records([finding(K.LOOP_OPTIMIZER_PARAMS, step=st, phase=ph, role=role,
                                                            where="optimizer of the actor")]),
    "reward_position": lambda st, ph, role: Records([finding(K.REWARD_POSITION, step=st, phase=ph, role="reward",
                                                             where="model.reward_model (rm.py:load)",
                                                             observed={"rows_changed": 6, "rows": 8})]),
    # model24: the tokenizer, the checkpoint and a setup's forwards (verlaudit.audit.model_checks)
    "tokenizer_vocab": lambda st, ph, role: Records([finding(K.TOKENIZER_VOCAB, step=st, phase=ph, role=role,
                                                             where="model.tokenizer (/tok)", observed={"differ": 60})]),
    "tokenizer_decode": lambda st, ph, role: Records([finding(K.TOKENIZER_DECODE, step=st, phase=ph, role=role,
                                                              where="model.tokenizer (/tok)", observed={"changed": 32})]),
    "chat_template": lambda st, ph, role: Records([finding(K.CHAT_TEMPLATE_CONTENT, step=st, phase=ph, role=role,
                                                           where="model.tokenizer (/tok)", observed={"fields": ["text"]})]),
    "weights_untrained": lambda st, ph, role: Records([finding(K.WEIGHTS_UNTRAINED, step=st, phase=ph, role=role,
                                                               where="model.path (/ckpt)", observed={"nll": 3.5})]),
    "hook_output": lambda st, ph, role: Records([finding(K.SETUP_HOOK_OUTPUT, step=st, phase=ph, role=role,
                                                         where="model.setup (s.py:f)", severity="warning",
                                                         observed={"scale": 1.43})]),
    "mask_ignored": lambda st, ph, role: Records([finding(K.PADDING_DEPENDENT, step=st, phase=ph, role=role,
                                                          where="actor", observed={"change": 0.3})]),
    # data24: the examples' invariants and the reward's probes
    "completion_prompt": lambda st, ph, role: Records([finding(K.COMPLETION_REPEATS_PROMPT, step=st, phase=ph,
                                                               role=role, where="data.dataset (d.py:pairs)",
                                                               observed={"pairs_repeating_prompt": 8})]),
    "plugin_numpy_bool": lambda st, ph, role: Records([finding(K.PLUGIN_NUMPY_BOOL_ADD, step=st, phase=ph,
                                                               role="reward", severity="warning",
                                                               where="data.reward_fn (r.py:f) r.py:9 (f)",
                                                               observed={"calls_undercounted": 3})]),
    "response_length": lambda st, ph, role: Records([finding(K.RESPONSE_SHORTER_THAN_ANSWER, step=st, phase=ph,
                                                             role=role, where="data.response_length (3)",
                                                             severity="warning",
                                                             observed={"response_length": 3, "longest_needed": 5})]),
    # loopg: an own loop's update against its loss (verlaudit.integrations.loop_update, loop_tokens)
    "loop_order": lambda st, ph, role: Records([finding(K.LOOP_GRADS_AFTER_STEP, step=st, phase=ph, role=role,
                                                        where="clip_grad_norm_ at loop.py:9 (after optimizer.step)")]),
    "loop_alignment": lambda st, ph, role: Records([finding(K.LOOP_LOGPROBS_MISALIGNED, step=st, phase=ph,
                                                            role=role, where="token log-probs of the loss at loop.py:8")]),
    "loop_loss_tokens": lambda st, ph, role: Records([finding(K.LOOP_LOSS_OUTSIDE_RESPONSE, step=st, phase=ph,
                                                              role=role, where="loss at loop.py:8: prompt tokens")]),
}  # fmt: skip

# the symptom side of each rule (at step 0 unless it follows an fp16 skip run), for a role
SYMPTOMS = {
    "dtype_error": lambda role: failed("dtype_error", "RuntimeError: mat1 and mat2 must have the same dtype",
                                       phase="actor_update", role=role),
    "exception": lambda role: failed("exception", "IndexError: index out of range in self", phase="actor_update",
                                     role=role),
    "ids_float": lambda role: Records([finding("dtype/int_became_float", phase="rollout", role=role, where="<root>",
                                               observed="fp32", expected="int64")]),
    "nonfinite": lambda role: nan_loss(role=role),
    "overflow": lambda role: fp16_skips(first=0, n=3),
    "reward_nonfinite": lambda role: Records([finding(K.REWARD_NONFINITE, phase="reward", role=role,
                                                      where="reward:model:m", observed="nan", expected="finite")]),
    "reward_dtype": lambda role: Records([finding(K.REWARD_DTYPE, phase="reward", role=role, where="reward:model:m",
                                                  observed="fp16", expected="fp32", severity="warning")]),
    "module_input_dtype": lambda role: Records([finding("dtype/module_input", phase="actor_update", role=role,
                                                        where="model.layers.1.mlp", observed="bf16",
                                                        expected="fp32")]),
    "compute_dtype": lambda role: Records([finding("dtype/compute", phase="actor_update", role=role,
                                                   where="model.layers.1.mlp.up_proj", observed="bf16",
                                                   expected="fp32")]),
    "island_dtype": lambda role: Records([finding("dtype/island", phase="actor_update", role=role, where="logprobs",
                                                  observed="bf16", expected="fp32")]),
    "grad_dtype": lambda role: Records([finding("dtype/grad", phase="actor_update", role=role,
                                                where="model.layers.0.mlp", observed="bf16", expected="fp32")]),
    "buffer_dtype": lambda role: Records([finding("dtype/buffer_precision", step=None, phase=None, role=role,
                                                  where="model.rotary_emb", observed={"inv_freq": "bf16"},
                                                  expected="fp32", severity="warning")]),
    "update_underflow": lambda role: Records([finding(K.UPDATE_UNDERFLOW, phase="actor_update", role=role,
                                                      where="model.layers.0.mlp.up_proj", severity="warning",
                                                      observed={"fraction": 0.4}, expected="<= 0.05")]),
    "plugin_nonfinite": lambda role: Records([finding(K.PLUGIN_NONFINITE_OP, phase="reward", role=role,
                                                      where="data.reward_fn (function:r)", observed={"op": "exp"})]),
    "plugin_precision": lambda role: Records([finding(K.PLUGIN_PRECISION_LOSS, phase="reward", role=role,
                                                      where="model.reward_model (model:m)",
                                                      observed={"distinct": 3, "distinct_high": 12})]),
    "no_signal": lambda role: Records([finding(K.NO_SIGNAL, phase="reward", role=role, where="reward:function:r",
                                               observed={"identical_groups": 4, "groups": 4})]),
    "ids_range": lambda role: Records([finding(K.COLLATOR_ID_RANGE, phase="rollout", role=role,
                                               where="collator:c.input_ids", observed=[0, 107], expected=[0, 99])]),
    "reference": lambda role: Records([finding(K.REFERENCE_NOT_ACTOR, step=None, phase=None, role="reference",
                                               where="model.layers.1.mlp.down_proj.weight",
                                               observed={"differ": 1}, expected="the actor's weights")]),
    "weights_nonfinite": lambda role: Records([finding(K.WEIGHT_NONFINITE, step=1, phase="rollout", role=role,
                                                       where="model.embed_tokens", observed={"rms": "nan"},
                                                       expected="finite")]),
    "mismatch": lambda role: Records([finding(K.MISMATCH_BEYOND_DTYPE, phase="rollout", role="rollout",
                                              where="rollout:hf-generate", severity="warning", observed=0.68,
                                              expected=1e-8)]),
    "precision_excess": lambda role: Records([finding(K.SHADOW_EXCESS, phase="actor_update", role=role,
                                                      where="model.layers.1.mlp", severity="warning",
                                                      observed={"ratio": 40.0}, expected="rel err <= 4 x 0.004")]),
    "reward_constant": lambda role: Records([finding(K.REWARD_CONSTANT, phase="reward", role="reward",
                                                     where="model.reward_model (rm.py:load)", severity="warning",
                                                     observed={"values": [0.3], "steps": 2})]),
    "identical_pairs": lambda role: Records([finding(K.IDENTICAL_PAIRS, role=role, where="data.response_length",
                                                     observed={"identical_pairs": 6, "batch": 8})]),
    # loopg: what an own loop's root explains (verlaudit.integrations.loop_protocol, loop_direction)
    "loop_cadence": lambda role: Records([finding(K.LOOP_GRADS_NOT_CLEARED, phase="actor_update", role=role,
                                                  where="optimizer step at loop.py:10 (step)")]),
    "loop_objective": lambda role: Records([finding(K.LOOP_UPDATE_AGAINST_ADVANTAGE, phase="actor_update",
                                                    role=role, where="policy-gradient loss at loop.py:8")]),
}  # fmt: skip
# rank12: a reference that is not the actor's start explains the KL penalty that dominates from step 0
ROOTS["reference"] = lambda st, ph, role: Records(
    [
        finding(
            K.REFERENCE_NOT_ACTOR,
            step=st,
            phase=ph,
            role="reference",
            where="lm_head.weight",
            observed={"differ": 2},
        )
    ]
)
SYMPTOMS["kl_penalty"] = lambda role: Records([finding(K.KL_DOMINATES, phase="reward", role="actor",
                                                       where="algo.kl_coef", severity="warning",
                                                       observed={"ratio": 20.0})])  # fmt: skip
ROOT_ROLE = {"reward_nonfinite": "reward", "reward_model_dtype": "reward", "newly_initialised": "reward"}
"""Roots recorded by one role whatever the symptom's (the reward boundary is the reward role's)."""


def run_dir(*parts: Records, algo="ppo") -> RunDir:
    preset = next((p.preset for p in parts if p.preset), "fp32")
    config = TrainConfig.from_dict({"algo": {"name": algo}, "precision": {"preset": preset}, "steps": 5})
    metrics: dict[int, dict] = {}
    for p in parts:
        for m in p.metrics or []:
            metrics.setdefault(m["step"], {}).update(m)
    status = next((p.status for p in parts if p.status), {"state": "completed"})
    findings = sorted((f for p in parts for f in p.findings), key=lambda f: -1 if f.step is None else f.step)
    return RunDir(
        path=Path("/nonexistent/run"),
        manifest={"config": config.to_dict(), "policy": resolve_policy(preset).to_dict()},
        metrics=[metrics[k] for k in sorted(metrics)],
        findings=findings,
        events=[],
        status=status,
    )


def symptom_role(root: str, symptom: str) -> str:
    if symptom in ("reward_nonfinite", "reward_dtype", "plugin_nonfinite", "no_signal", "plugin_precision"):
        return "reward"
    return ROOT_ROLE.get(root, "actor")


RUN_RULES = sorted(
    r
    for r in RULES
    if r != (logs.FAILURE, logs.CASCADE_CLASS) and not r[0].startswith(("setup_", "override_"))
)
"""The rules between the classes of a run's records (the log rule is tested on log causes below; the
rules from what model.setup changed and from precision overrides in tests/test_setup_cause.py)."""


def _is_setup_root(root: str) -> bool:
    return root in (
        "weights_nonfinite",
        "weights_outlier",
        "param_dtype",
        "reward_model_dtype",
        "tied_weights",
        "newly_initialised",
        # model24: recorded at setup (verlaudit.audit.model_checks)
        "tokenizer_vocab",
        "tokenizer_decode",
        "chat_template",
        "weights_untrained",
        "hook_output",
        "mask_ignored",
    )


@pytest.mark.parametrize("rule", RUN_RULES, ids=lambda r: f"{r[0]}->{r[1]}")
def test_each_rule_puts_the_root_first(rule):
    root_cls, sym_cls = rule
    role = symptom_role(root_cls, sym_cls)
    setup = _is_setup_root(root_cls)
    # the root before the symptom: at setup, or early in step 0
    root = ROOTS[root_cls](None if setup else 0, None if setup else "rollout", ROOT_ROLE.get(root_cls, role))
    if sym_cls == "nonfinite" and root_cls == "overflow":  # the fp16 skips, then the inf they end in
        d = diagnose_run(run_dir(fp16_skips(first=0, n=3, nan_at=3)))
    else:
        d = diagnose_run(run_dir(root, SYMPTOMS[sym_cls](role)))
    first = d.causes[0]
    assert first.cls == root_cls, [(c.cls, c.title) for c in d.causes]
    consequences = [c for c in d.causes[1:] if c.cls == sym_cls]
    assert consequences and all(c.consequence_of == first.title and not c.fixes for c in consequences)
    assert first.chain and len(first.chain) >= 2 and first.fixes


@pytest.mark.parametrize(
    "rule", sorted(r for r in RUN_RULES if r[0] != "overflow"), ids=lambda r: f"{r[0]}->{r[1]}"
)
def test_a_root_recorded_after_the_symptom_explains_nothing(rule):
    root_cls, sym_cls = rule
    role = symptom_role(root_cls, sym_cls)
    late = ROOTS[root_cls](3, "critic_update", ROOT_ROLE.get(root_cls, role))
    d = diagnose_run(run_dir(late, SYMPTOMS[sym_cls](role)))
    root = next(c for c in d.causes if c.kind == f"finding:{late.findings[0].kind}" and c.step == 3)
    assert not root.chain, [(c.cls, c.chain) for c in d.causes]


SAME_ROLE = sorted(r for r in RUN_RULES if RULES[r].same_role)


@pytest.mark.parametrize("rule", SAME_ROLE, ids=lambda r: f"{r[0]}->{r[1]}")
def test_a_rule_within_one_role_does_not_cross_roles(rule):
    root_cls, sym_cls = rule
    role = symptom_role(root_cls, sym_cls)
    other = "critic" if role != "critic" else "actor"
    root = ROOTS[root_cls](None, None, other)
    d = diagnose_run(run_dir(root, SYMPTOMS[sym_cls](role)))
    cause = next(c for c in d.causes if c.kind == f"finding:{root.findings[0].kind}" and c.role == other)
    assert not cause.chain, [(c.cls, c.role, c.chain) for c in d.causes]


def test_every_class_in_the_table_is_built_by_these_tests():
    # a rule whose side nobody can record would be dead: each class has a record that produces it
    assert {r for r, _ in RUN_RULES} <= set(ROOTS) and {s for _, s in RUN_RULES} <= set(SYMPTOMS)


def _log_cause(kind: str, line: int | None, severity: str = "error") -> Cause:
    return Cause(
        severity, kind, f"{kind} at line {line}", "", fixes=[Fix(None, None, f"fix {kind}")], line=line
    )


def test_the_log_rule_a_failure_explains_the_cascade_after_it():
    # a log's classes: an error of a CASCADE kind after another error is its consequence, by line
    oom, timeout, import_error = (
        _log_cause("oom", 4),
        _log_cause("nccl_timeout", 9),
        _log_cause("import_error", 20),
    )
    out = order_log([timeout, import_error, oom])
    assert [c.kind for c in out] == ["oom", "nccl_timeout", "import_error"]
    assert (timeout.cls, oom.cls) == (logs.CASCADE_CLASS, logs.FAILURE)
    assert timeout.consequence_of == oom.title and not timeout.fixes and oom.fixes and not import_error.chain
    assert oom.chain == ["oom (line 4)", "nccl_timeout (line 9)"]
    assert "likely a consequence of: oom at line 4 (line 4)" in timeout.evidence


def test_a_log_cascade_before_every_failure_or_beside_a_warning_stands_alone():
    early, late = _log_cause("nccl_timeout", 2), _log_cause("dtype_error", 10)
    warned, cut = _log_cause("weight_sync", 1, "warning"), _log_cause("killed", None)
    out = order_log([early, warned, late, cut])
    # errors first, the cascades last; a failure at line 10 explains neither the line-2 timeout nor
    # a kill with no line; a warning (class other) explains nothing
    assert [c.kind for c in out] == ["dtype_error", "nccl_timeout", "killed", "weight_sync"]
    assert all(c.consequence_of is None and c.fixes for c in out) and not late.chain


def test_one_phase_table_ranks_both_vocabularies():
    # a log phase ranks with the trainer phase it is; setup and init first, a checkpoint last
    assert PHASE_RANK["generate"] == PHASE_RANK["rollout"] < PHASE_RANK["reward"] < PHASE_RANK["reference"]
    assert PHASE_RANK["reference"] == PHASE_RANK["ref"] and PHASE_RANK["values"] == PHASE_RANK["critic"]
    assert PHASE_RANK["update"] == PHASE_RANK["logprob"] == PHASE_RANK["actor_update"]
    assert PHASE_RANK["init"] == PHASE_RANK[None] == 0
    assert PHASE_RANK["checkpoint"] > max(v for k, v in PHASE_RANK.items() if k != "checkpoint")


# ---------------------------------------------------------------- the ordering itself


def test_moment_orders_setup_then_steps_then_phases():
    # setup < step 0 before its phases (DPO collation) < rollout < reward < ... < a failure (last)
    assert Moment.of(None, None) < Moment.of(0, None) < Moment.of(0, "rollout") < Moment.of(0, "reward")
    assert Moment.of(0, "critic_update") < Moment.of(1, "rollout")
    assert Moment.of(0, "rollout", 3) < Moment.of(0, "rollout", float("inf"))
    # by step and phase only: line order within a phase does not decide "before"
    assert Moment.of(0, "actor_update", 9).not_after(Moment.of(0, "actor_update", 1))


def test_root_of_walks_back_through_rules_to_the_earliest():
    # reward-model weights NaN (setup) -> NaN reward (step 0, reward) -> NaN loss (step 0, actor_update)
    ev = [
        Event("nonfinite", Moment.of(0, "actor_update", 5), "actor"),
        Event("reward_nonfinite", Moment.of(0, "reward", 2), "reward"),
        Event("weights_nonfinite", Moment.of(None, None, 0), "reward"),
        Event("padding", Moment.of(0, "rollout", 1), "actor"),  # explains nothing here
    ]
    assert root_of(ev, 0) == [2, 1, 0]
    groups = chains(ev, [0, 1, 3, 2])
    assert groups == [([2, 1, 0], []), ([3], [])]


def test_same_class_in_one_phase_the_earlier_record_is_the_root():
    a = Event("ids_float", Moment.of(0, "rollout", 0), "actor")
    b = Event("ids_float", Moment.of(0, "rollout", 4), "rollout")
    assert root_of([b, a], 0) == [1, 0] and root_of([b, a], 1) == [1]


@pytest.mark.parametrize(
    "kind, cls",
    [
        (K.COLLATOR_FLOAT_IDS, "ids_float"),
        (K.COLLATOR_ID_RANGE, "ids_range"),
        (K.COLLATOR_SHAPE, "batch_shape"),
        (K.COLLATOR_NOT_TENSOR, "batch_shape"),
        (K.COLLATOR_ID_WIDTH, "ids_dtype"),
        (K.REWARD_NONFINITE, "reward_nonfinite"),
        (K.REWARD_DTYPE, "reward_dtype"),
        (K.REWARD_DEVICE, "reward_device"),
        (K.REWARD_SHAPE, "reward_shape"),
        (K.NONFINITE_LOSS, "nonfinite"),
        (K.PARAM_STORAGE, "param_dtype"),
        ("some/new_kind", "other"),
    ],
)
def test_a_finding_takes_its_kinds_class(kind, cls):
    # the class is the registry's, whatever the finding observed (verlaudit/kinds.py)
    d = diagnose_run(run_dir(Records([finding(kind, observed="fp32", expected="int64")])))
    assert [c.cls for c in d.causes] == [cls]
