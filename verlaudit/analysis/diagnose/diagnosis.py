"""Diagnosis: what happened to a run, its root cause first, evidence, and the fix (the library under
``verlaudit diagnose PATH``; the command and the text rendering are `verlaudit.commands.diagnose`).

PATH is a variant's run directory, a suite report directory (every run directory in it is
diagnosed, summary first), or a plain log / traceback file from another framework (verl, TRL,
DeepSpeed, plain PyTorch: `diagnose_log`, with the rule families of `verlaudit.analysis.logs`). Only
the run directory is read (manifest, metrics, findings, events, status, the runner's record), so runs
killed half-way and runs copied from another machine work.

The analyses below each turn part of the run directory into causes, stamped with the step, phase and
role they concern. The causes are ranked, then ordered by the root-cause rules
(`verlaudit.analysis.diagnose.rules`): the earliest cause that explains the failure comes first, with the chain
it starts ("root -> consequence"), and only the root carries fixes. A log's causes are ordered by the
same rules (`order_by_root` with the log's lines for moments). A fix is offered when it addresses
the root and the audit or the planner says it would work (no bf16 advice for integer ids or a run that
is bf16 already, no precision change for corrupted weights or a NaN reward, OOM fixes checked against
the planner: `verlaudit.analysis.diagnose.oom`). Each fix names the suite key (or the user's plug-in) and the
verl key where one exists; where a finding's numbers decide the change, the fix built from them comes first
(`verlaudit.analysis.diagnose.evidence_fix`). Exercised by `pytest tests/test_diagnose.py
tests/test_rules.py` and ``verlaudit diagnose reports/tiny_cpu/<run>``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from pathlib import Path

from verlaudit import kinds as K
from verlaudit import verl_keys as V
from verlaudit.analysis import logs
from verlaudit.analysis.causes import (
    BACKWARD_NAN_WHAT,
    Cause,
    Diagnosis,
    Fix,
    backward_nan_fixes,
    dtype_fixes,
    rank,
)
from verlaudit.analysis.diagnose import evidence_fix, fixcheck
from verlaudit.analysis.diagnose.config_cause import range_causes
from verlaudit.analysis.diagnose.mismatch_cause import mismatch_causes
from verlaudit.analysis.diagnose.pair_cause import combo_causes
from verlaudit.analysis.diagnose.rules import LAST, Event, Moment, chains, moment_words, severity_max
from verlaudit.analysis.diagnose.runview import (
    cfg,
    fmt,
    last_step,
    preset,
    role_policy,
    setup_plugin,
    user_hook_fix,
)
from verlaudit.analysis.diagnose.setup_cause import absorb, explains_nothing, override_causes, take_over
from verlaudit.analysis.diagnose.status import status_causes
from verlaudit.analysis.diagnose.trajectory import loss_scale_causes, no_signal_causes, reward_trend_causes
from verlaudit.dtypes import parse_dtype_message
from verlaudit.rundir import Finding, RunDir, is_run_dir, read_run

# --------------------------------------------------------------------------------------------
# small readers over a RunDir


def _first_nonfinite(run: RunDir, keys: Sequence[str]) -> tuple[int, str, float] | None:
    best = None
    for k in keys:
        for step, v in run.series(k):
            if not math.isfinite(v):
                if best is None or step < best[0]:
                    best = (step, k, v)
                break
    return best


def _loss_keys(run: RunDir) -> list[str]:
    keys = {k for m in run.metrics for k in m if k.endswith("loss") and "/" in k}
    return sorted(keys, key=lambda k: (k != "actor/loss", k))


def _seq(run: RunDir, f: Finding | None) -> float:
    """A finding's line in findings.jsonl (the order it was first recorded in)."""
    for i, x in enumerate(run.findings):
        if x is f:
            return float(i)
    return LAST


# --------------------------------------------------------------------------------------------
# analyses: each is a pure function RunDir -> list[Cause]


_MODULE_PRODUCERS = (K.NONFINITE_FORWARD, K.OVERFLOW, K.NONFINITE_BACKWARD)
"""Findings that name the module which made a non-finite value from finite inputs. A boundary
(``numerics/nonfinite_boundary``: log-probs, values) or the loss is where NaN was seen, not made."""
_NONFINITE_KINDS = frozenset(
    {
        K.NONFINITE_FORWARD,
        K.NONFINITE_BACKWARD,
        K.NONFINITE_BOUNDARY,
        K.NONFINITE_LOSS,
        K.NONFINITE_GRADS,
        K.OVERFLOW,
    }
)
"""Findings of NaN/Inf made or seen in a step, which `_nonfinite_causes` reads together."""


# long: one analysis: evidence, producer, title and fixes of the non-finite cause, decided together
def _nonfinite_causes(run: RunDir) -> list[Cause]:
    st = run.status or {}
    bad_loss = _first_nonfinite(run, _loss_keys(run))
    sampling_nan = "probability tensor contains" in str(st.get("error") or "")
    failed_nonfinite = st.get("reason") == "nonfinite" or sampling_nan
    nf_findings = sorted(
        (f for f in run.findings if f.kind in _NONFINITE_KINDS),
        key=lambda f: (f.step if f.step is not None else 1 << 30, f.rank),
    )
    if not (failed_nonfinite or bad_loss or any(f.severity == "error" for f in nf_findings)):
        return []
    step = bad_loss[0] if bad_loss else st.get("step") if failed_nonfinite else nf_findings[0].step
    producer = _producer(nf_findings)
    seen = producer or next((f for f in nf_findings if f.step == step), None)
    evidence = []
    if bad_loss:
        evidence.append(f"first non-finite loss: {bad_loss[1]} = {bad_loss[2]} at step {bad_loss[0]}")
    if sampling_nan:
        evidence.append(
            f"rollout sampling failed on NaN/Inf probabilities at step {st.get('step')} "
            f"({st.get('phase')}): the policy's logits were already non-finite"
        )
    elif failed_nonfinite:
        evidence.append(f"run stopped: {st.get('error') or 'non-finite loss'} (step {st.get('step')})")
    for f in nf_findings[:4]:
        evidence.append(f"{f.kind} in {f.role or '?'} {f.where or '?'} at step {f.step}: {f.message}")
    for key in ("numerics/actor/nonfinite_grads", "numerics/critic/nonfinite_grads"):
        s = [(st_, v) for st_, v in run.series(key) if v > 0]
        if s:
            evidence.append(f"{key} > 0 first at step {s[0][0]} ({fmt(s[0][1])} elements)")
    history = [(s, v) for s, v in run.series("actor/loss_scale") if step is None or s <= step]
    if history and (role_policy(run, "actor").get("loss_scaling") not in (None, "none")):
        evidence.append("loss scale before it: " + ", ".join(f"{s}:{fmt(v)}" for s, v in history[-8:]))
    skipped = [(s, v) for s, v in run.series("actor/skipped") if v > 0 and (step is None or s <= step)]
    if skipped:
        evidence.append(
            f"skipped optimizer steps before it: {len(skipped)} (steps {', '.join(str(s) for s, _ in skipped[-6:])})"
        )
    where = producer.where if producer else None
    title = f"Non-finite loss/gradients from step {step}" + (f", first produced in {where}" if where else "")
    obs = producer.observed if producer is not None and isinstance(producer.observed, dict) else {}
    if producer is not None and producer.kind == K.OVERFLOW:
        # an fp16 overflow: the dtype is the cause, not the loss scale (plug24); before any update the
        # model as loaded and set up is what exceeds fp16's range, so the preset is named (dyn24)
        fresh = producer.step in (None, first_step_of(run)) and producer.phase not in _UPDATE_PHASES
        preset = cfg(run, "precision", "preset")
        activation = obs.get("dtype") == "fp16"
        if activation:
            title = f"fp16 overflow from step {step}: {where}'s forward output passed fp16's max 65504"
        else:
            title += ": an fp16 overflow (fp16's largest value is 65504)"
        if fresh and preset:
            title += (
                f" before any update, so under precision.preset {preset} the activations of the model as loaded "
                "and set up exceed fp16's range"
            )
        elif activation and preset:
            title += f" (precision.preset: {preset})"
        if activation:
            title += "; the loss and gradients are non-finite after it"
    if producer:
        what = (
            f"{producer.where} ({producer.role}) was the first module whose output became non-finite while its "
            "inputs were finite; the modules after it only propagated it."
        )
        plugin = setup_plugin(run, producer.role)
        if plugin:
            evidence.append(f"model.setup ran on the {producer.role} model: {plugin}")
    else:
        what = (
            "The loss became NaN/Inf. No module made it from finite inputs on an audited step"
            + (f"; it was first seen in {seen.where} ({seen.role})" if seen is not None else "")
            + ": it came from outside the modules (a reward, advantages, a boundary), or the step was not "
            "audited at the full level."
        )
    fixes = _nonfinite_fixes(run, producer, nf_findings, step)
    hook = user_hook_fix(run, producer.role, producer.where) if producer else None
    if hook is not None:
        fixes.insert(0, hook)
    first_step = run.metrics[0].get("step") if run.metrics else None
    if not bad_loss and not failed_nonfinite and producer is None and step is not None and step == first_step:
        # finite loss, NaN gradients before any update: the weights are the initial ones, so it is not
        # divergence or overflow of trained values but a backward that makes NaN from finite inputs
        title = f"Non-finite gradients from the first step ({step}) with a finite loss: NaN made in the backward pass"
        what = BACKWARD_NAN_WHAT
        fixes = backward_nan_fixes() + [f for f in fixes if f.suite is not None]
    ref = producer or seen
    phase = ref.phase if ref is not None and ref.step == step else st.get("phase") or "actor_update"
    return [
        Cause(
            "error",
            "nonfinite",
            title,
            what,
            evidence=evidence,
            fixes=fixes,
            step=step,
            where=where,
            score=50.0 if failed_nonfinite else 20.0,
            phase=phase,
            role=ref.role if ref is not None else None,
            seq=_seq(run, ref) if ref is not None else LAST,
            data={"producer": producer.to_dict() if producer else None, "loss_scale_history": history[-16:]},
        )
    ]


_UPDATE_PHASES = ("actor_update", "critic_update")
"""Phases after which a step's weights are no longer the ones it started with."""


def first_step_of(run: RunDir) -> int:
    """The run's first step: that of its first metrics line, else 0 (a run that died in step 0)."""
    step = run.metrics[0].get("step") if run.metrics else None
    return int(step) if isinstance(step, int) else 0


def _producer(findings: Sequence[Finding]) -> Finding | None:
    # the forward producer is the root; a backward producer only when no forward one exists
    # A nonfinite_grads finding names parameters in registration order, not the module that made
    # the NaN, so it is never taken for a producer; nor is a boundary where NaN was only seen.
    for kind in _MODULE_PRODUCERS:
        for f in findings:
            if f.kind == kind and f.where:
                return f
    return None


def _nonfinite_fixes(
    run: RunDir, producer: Finding | None, nf: Sequence[Finding], step: int | None
) -> list[Fix]:
    """Fixes the audit supports: the producer's own; bf16 for fp16 only when an fp16 overflow was seen
    (an overflow finding, or steps the dynamic loss scaler skipped: bf16 has fp32's range; it does
    nothing for a NaN); a lower learning rate and clipping only when the
    run diverged (loss or gradient norm growing over finite steps) before the first non-finite one."""
    fixes = []
    if producer is not None and producer.fix:
        fixes.append(Fix(None, None, producer.fix))
    fp16_overflow = any(
        f.kind == K.OVERFLOW and (f.observed or {}).get("dtype") == "fp16"
        for f in nf
        if isinstance(f.observed, dict)
    )
    scaled_skips = role_policy(run, "actor").get("loss_scaling") == "dynamic" and any(
        v > 0 for s, v in run.series("actor/skipped") if step is None or s <= step
    )
    if preset(run) == "fp16" and (fp16_overflow or scaled_skips):
        fixes.append(
            Fix(
                "precision.preset: bf16",
                V.PARAM_DTYPE_BF16,
                "fp16 overflows at 65504; bf16 has fp32's exponent range (needs an Ampere+ GPU)",
            )
        )
    if _diverged(run, step):
        lr = cfg(run, "algo", "lr")
        fixes.append(
            Fix(
                f"algo.lr: {lr / 10:g}" if isinstance(lr, (int, float)) else "algo.lr: <lower>",
                V.LR,
                "the loss / gradient norm grew before going non-finite: smaller steps",
            )
        )
        if not cfg(run, "algo", "max_grad_norm"):
            fixes.append(Fix("algo.max_grad_norm: 1.0", V.GRAD_CLIP, "clip gradients"))
    if not fixes and producer is None:
        fixes.append(
            Fix(
                "audit.level: full",
                None,
                f"rerun with every module audited at step {step} (audit.every) "
                "to name the module or boundary where the NaN is made",
            )
        )
    return fixes


def _diverged(run: RunDir, step: int | None) -> bool:
    """At least three finite steps before ``step`` with the gradient norm (or loss) rising 10x."""
    for key in ("actor/grad_norm", "actor/loss"):
        vals = [abs(v) for s, v in run.series(key) if (step is None or s < step) and math.isfinite(v)]
        if len(vals) >= 3 and min(vals[:2]) > 0 and vals[-1] > 10 * min(vals[:2]):
            return True
    return False


def _dtype_causes(run: RunDir) -> list[Cause]:
    st = run.status or {}
    failed = st.get("reason") == "dtype_error"
    runtime = [f for f in run.findings if f.kind == K.RUNTIME_DTYPE_ERROR]
    if not failed and not runtime:
        return []

    f = runtime[0] if runtime else None
    msg = str(st.get("error") or (f.message if f else ""))
    parsed = parse_dtype_message(msg)
    observed = (f.observed if f and f.observed else None) or (parsed.observed if parsed else None)
    expected = (f.expected if f and f.expected else None) or (parsed.expected if parsed else None)
    where = (f.where if f else None) or st.get("where")
    role = (f.role if f else None) or st.get("role")
    step = f.step if f and f.step is not None else st.get("step")
    phase = st.get("phase") or (f.phase if f else None)
    ev = [f"error: {msg}"] if msg else []
    if where:
        ev.append(f"innermost module executing: {where}" + (f" ({role})" if role else ""))
    if observed or expected:
        ev.append(f"observed {observed}, expected {expected}")
    ev.append(f"phase {phase}, step {step}")
    plugin = setup_plugin(run, role)
    if plugin:
        ev.append(f"model.setup ran on the {role} model: {plugin}")
    fixes = [Fix(None, None, f.fix)] if f and f.fix else []
    autocast = bool(role_policy(run, role or "actor").get("autocast")) or preset(run) in ("bf16", "bf16-pure")
    fixes += dtype_fixes(observed, expected, autocast=autocast)
    title = (
        "Dtype error"
        + (f" in {where}" if where else "")
        + (f": {observed} where {expected} was expected" if observed and expected else "")
    )
    return [
        Cause(
            "error",
            "dtype_error",
            title,
            "A tensor reached an op whose other operands (or weights) have a "
            "different dtype, outside autocast.",
            evidence=ev,
            fixes=fixes,
            step=step,
            where=where,
            score=50.0 if failed else 20.0,
            phase=phase,
            role=role,
            seq=LAST,
            data={"observed": observed, "expected": expected},
        )
    ]


_EXPLAINED_KINDS = frozenset(
    {
        K.RUNTIME_DTYPE_ERROR,  # _dtype_causes
        *_NONFINITE_KINDS,  # _nonfinite_causes
        K.OOM,  # status_causes
        K.SKIPPED_STEP,  # loss_scale_causes
        K.NO_SIGNAL,  # no_signal_causes
        K.MISMATCH_BEYOND_DTYPE,  # mismatch_causes
    }
)
"""Finding kinds that a dedicated analysis already turns into a cause (with more evidence)."""


def _finding_causes(run: RunDir) -> list[Cause]:
    groups: dict[tuple[str, str, str | None], list[Finding]] = {}
    for f in run.findings:
        setup = f.kind.startswith(K.SETUP_PREFIX)  # facts: a cause when they explain something
        if (f.severity == "info" and not setup) or f.kind in _EXPLAINED_KINDS:
            continue
        # what a setup changed is a fact about one role's model: one cause per role, so that it explains
        # what it did to that model and not another's
        groups.setdefault((f.kind, K.class_of(f.kind), f.role if setup else None), []).append(f)
    out = []
    for (kind, cls, _), fs in groups.items():
        fs.sort(key=lambda f: (f.severity != "error", f.step if f.step is not None else -1, f.rank))
        top = fs[0]
        ev = [
            f"{f.role or '-'} {f.where or '-'} step {f.step}: observed {f.observed}, expected {f.expected}"
            + (f" (x{f.count})" if f.count > 1 else "")
            for f in fs[:5]
        ]
        if len(fs) > 5:
            ev.append(f"... and {len(fs) - 5} more")
        plugin = setup_plugin(run, top.role)
        if plugin and kind in _SETUP_CHANGES:
            ev.append(
                f"model.setup ran on the {top.role} model before training: {plugin} -- the code that changed "
                "the model (vocabulary, embeddings, modules, weights) is the first place to look"
            )
        elif plugin and kind.startswith(("dtype/", "numerics/weight")):
            ev.append(
                f"model.setup ran on the {top.role} model: {plugin} (user code that can change dtypes, modules "
                "and hooks)"
            )
        fixes = _plugin_fixes(run, top, fs)
        hook = (
            user_hook_fix(run, top.role, top.where)
            if kind.startswith(("dtype/module", "numerics/"))
            else None
        )
        fixes = [hook, *fixes] if hook else fixes
        fixes, title = evidence_fix.refine(run, kind, fs, fixes, f"{kind}: {top.message}")
        sev = next((s for s in ("error", "warning", "info") if any(f.severity == s for f in fs)), "info")
        out.append(
            Cause(
                sev,
                f"finding:{kind}",
                title,
                top.message,
                evidence=ev,
                fixes=fixes,
                step=top.step,
                where=top.where,
                phase=top.phase,
                role=top.role,
                cls=cls,
                seq=_seq(run, top),
                data={"observed": top.observed} if kind.startswith(K.SETUP_PREFIX) else {},
            )
        )
    return out


_MODULE_DTYPE_KINDS = (K.PARAM_STORAGE, K.MIXED_PARAMS, K.BUFFER_PRECISION, K.MODULE_OUTPUT)
_SETUP_CHANGES = (
    K.VOCAB_MISMATCH,
    K.ROLLOUT_TOKEN_RANGE,
    K.TIED_WEIGHTS_BROKEN,
    K.REFERENCE_NOT_ACTOR,
    K.DROPOUT_ACTIVE,
    K.NONDETERMINISTIC_FORWARD,
)
"""Findings about what a model is (its vocabulary, ties, weights, modules): when a ``model.setup``
plug-in ran on that model, it is named as the culprit and its key carries the fix."""
"""Findings about a model's own dtypes: user setup code (model.setup) is where they are changed."""
_WEIGHT_SOURCES = {
    "actor": "model.path",
    "reference": "model.path",
    "critic": "model.critic_path",
    "reward": "model.reward_model",
}


def _plugin_fixes(run: RunDir, top: Finding, fs: Sequence[Finding]) -> list[Fix]:
    """The findings' own fixes, each naming the suite key of the user code it is about: the collator,
    the reward function or model, the checkpoint the weights came from."""
    where = top.where or ""
    key = verl = None
    if where.startswith("collator:"):
        key = (
            f"data.collator ({cfg(run, 'data', 'collator')})"
            if cfg(run, "data", "collator")
            else "data.collator"
        )
    elif where.startswith("reward:"):
        source = where.removeprefix("reward:").partition(":")[2]  # function:<spec>, model:<spec>
        field = "model.reward_model" if where.startswith("reward:model:") else "data.reward_fn"
        if source.startswith("verl:"):  # verl's compute_score, as the run's data.compute_score names it
            field, source = "data.compute_score", source.removeprefix("verl:")
        key = f"{field} ({source})"
        verl = V.REWARD_MODEL_PATH if field == "model.reward_model" else V.CUSTOM_REWARD
    elif top.kind.startswith(K.SETUP_PREFIX):
        key = top.where  # model.setup.<role> (file.py:function)
    elif top.kind in (*_MODULE_DTYPE_KINDS, *_SETUP_CHANGES) and setup_plugin(run, top.role):
        key = f"model.setup ({setup_plugin(run, top.role)})"
    elif top.kind in (K.WEIGHT_NONFINITE, K.WEIGHT_OUTLIER, K.REWARD_MODEL_DTYPE, K.PRECISION_WEIGHT_GRID):
        field = _WEIGHT_SOURCES.get(top.role or "", "model.path")
        source = cfg(run, *field.split("."))
        plugin = setup_plugin(run, top.role)
        key = f"{field} ({source})" if source else f"model.setup ({plugin})" if plugin else field
    elif top.kind == K.WEIGHT_GROWTH:
        return list(dict.fromkeys(_lr_fix(f) for f in fs if f.fix))[:3]
    key = key or evidence_fix.suite_key(where)  # rank12: a finding that names its suite key names the fix's
    fixes = list(dict.fromkeys(Fix(key, verl, f.fix) for f in fs if f.fix))[:3]
    return fixes


def _lr_fix(f: Finding) -> Fix:
    """The learning-rate fix of a ``dynamics/weight_growth`` finding, in its own role's keys."""
    lr = f.observed.get("lr") if isinstance(f.observed, dict) else None
    field = "algo.critic_lr" if f.role == "critic" else "algo.lr"
    value = f"{float(lr) / 10:g}" if isinstance(lr, (int, float)) and lr > 0 else "<lower>"
    return Fix(f"{field}: {value}", V.lr(f.role or "actor"), f.fix or "")


ANALYSES = (
    status_causes,
    _nonfinite_causes,
    _dtype_causes,
    loss_scale_causes,
    reward_trend_causes,
    no_signal_causes,
    mismatch_causes,
    _finding_causes,
    override_causes,
    range_causes,
    combo_causes,  # combo: keys wrong together, resolution lost at a 16-bit boundary
    evidence_fix.override_ignored_causes,  # rank12: an override the role's model does not follow
)


def diagnose_run(run: RunDir) -> Diagnosis:
    """All causes found in one run directory: ranked, then root first (`order_by_root`)."""
    causes: list[Cause] = []
    for analysis in ANALYSES:
        causes.extend(analysis(run))
    causes = evidence_fix.overrides_named(causes)
    causes = _in_users_terms(run, fixcheck.checked(run, order_by_root(rank(causes))))
    st = run.status or {}
    if run.state == "completed":
        state = "completed" + (" with warnings" if any(c.severity == "warning" for c in causes) else "")
        if any(c.severity == "error" for c in causes):
            state = "completed with errors"
    elif run.state == "failed" and st.get("step") is None:
        state = "failed at setup" + f": {st.get('reason', 'unknown')}"  # refused, preflight, or setup code
    elif run.state == "failed":
        state = (
            f"failed at step {st.get('step')}"
            + (f" ({st.get('phase')})" if st.get("phase") else "")
            + f": {st.get('reason', 'unknown')}"
        )
    else:
        state = run.state + (f" after step {last_step(run)}" if last_step(run) is not None else "")
    algo, steps = cfg(run, "algo", "name"), cfg(run, "steps")
    summary = f"{run.name}: {state}; {algo or '?'} {preset(run) or '?'}, {len(run.metrics)} of {steps or '?'} steps recorded"
    return Diagnosis(str(run.path), "run", run.name, state, summary, causes)


def _in_users_terms(run: RunDir, causes: list[Cause]) -> list[Cause]:
    """A run audited inside another framework (`verlaudit.integrations`) names each fix in that
    framework's terms too: manifest ``integration.keys`` maps a suite key (a prefix of the fix's) to the
    framework's setting, ``integration.roles`` a role to the argument that supplied its model."""
    integ = run.manifest.get("integration") or {}
    fw, keys, roles = integ.get("framework"), integ.get("keys") or {}, integ.get("roles") or {}
    if not isinstance(fw, str) or not isinstance(keys, dict) or not isinstance(roles, dict):
        return causes
    for c in causes:
        fixes = []
        for f in c.fixes:
            hit = max((k for k in keys if f.suite and f.suite.startswith(k)), key=len, default=None)
            if hit is not None and f.key is None:
                f = dataclasses.replace(f, key=str(keys[hit]) + f.suite[len(hit) :], framework=fw, verl=None)
            fixes.append(f)
        if fixes and c.role in roles and not any(f.framework for f in fixes):
            fixes[0] = dataclasses.replace(fixes[0], key=str(roles[c.role]), framework=fw)
        c.fixes = fixes
    return causes


def order_by_root(causes: list[Cause], moments: Sequence[Moment] | None = None) -> list[Cause]:
    """``causes`` (ranked) regrouped by the root-cause rules: each group is its root, then what it
    explains in time order; the root gets the chain and the group's highest severity, the
    consequences lose their fixes (the root's fix is theirs). Groups keep the rank order of their
    most important member. ``moments``: when each cause was first seen (default: its step, phase and
    order of recording; a log's are its lines)."""
    for c in causes:
        c.cls = c.cls or K.cause_class(c.kind)
    if moments is None:
        moments = [Moment.of(c.step, c.phase, c.seq) for c in causes]
    weight = {"error": 2, "warning": 1}
    events = [
        Event(c.cls or "other", m, c.role, weight.get(c.severity, 0))
        for c, m in zip(causes, moments, strict=True)
    ]
    out: list[Cause] = []
    for path, others in chains(events, list(range(len(causes)))):
        root = causes[path[0]]
        cons = [causes[j] for j in path[1:] + others]
        head = absorb(root, cons, causes[path[-1]])
        labels = [_label(causes[j], events[j].moment) for j in path] if cons else []
        if head is not None:  # a model.setup change: the finding it explains heads, naming the setup
            cons = take_over(root, head, cons)
            at = next(k for k, c in enumerate(causes) if c is head)
            labels = [labels[0], _label(head, events[at].moment)] + [
                lab for j, lab in zip(path[1:], labels[1:], strict=True) if j != at
            ]
            root, root.severity = head, severity_max([head.severity, root.severity])
        out += [root, *cons]
        if head is not None:
            root.chain = labels
        if not cons:
            continue
        root.severity = severity_max([root.severity] + [c.severity for c in cons])
        root.chain = labels
        root.what = _what_it_explains(root.what, cons)
        for c in cons:
            c.consequence_of = root.title
            c.fixes = []
    return [c for c in out if not explains_nothing(c)]


def _what_it_explains(what: str, cons: Sequence[Cause]) -> str:
    """A root's account with what it produced (its consequences' titles, the first two): the root says what
    it did to the run, not only what it is."""
    said = [c.title if len(c.title) <= 140 else c.title[:139] + "…" for c in cons[:2]]
    more = f" (and {len(cons) - 2} more)" if len(cons) > 2 else ""
    return f"{what.rstrip()} It explains: {'; '.join(said)}{more}." if said else what


def _label(c: Cause, m: Moment) -> str:
    kind = c.kind.removeprefix("finding:")
    when = f"line {c.line}" if c.line is not None else moment_words(m)
    return f"{kind}" + (f" in {c.where}" if c.where else "") + f" ({when})"


def order_log(causes: Sequence[Cause]) -> list[Cause]:
    """A foreign log's causes in the root-cause order (`order_by_root`), starting from the log's own
    ranking (`verlaudit.analysis.logs.ranked`): classes from `verlaudit.analysis.logs.classify`, a
    cause's line for its moment (a cause without a line has no moment: no rule relates it). A
    consequence names its root and the root's line in its evidence."""
    ranked = logs.ranked(causes)
    for c in ranked:
        c.cls = logs.classify(c) if c.line is not None else "other"
    moments = [Moment(float(c.line if c.line is not None else LAST), 0) for c in ranked]
    out = order_by_root(ranked, moments)
    root: Cause | None = None
    for c in out:
        if c.consequence_of is None:
            root = c
        elif root is not None:
            on = f", rank {root.rank}" if root.rank is not None else ""
            c.evidence.append(f"likely a consequence of: {root.title} (line {root.line}{on})")
    return out


def diagnose_log(path: str | Path) -> Diagnosis:
    """Diagnosis of a foreign training log or traceback file, read in one pass (`logs.read`) whatever
    its size: each line to the metric records and their NaN evidence, and to the rule families of
    `verlaudit.analysis.logs`; ordered by the root-cause rules (`order_log`). ValueError for a file
    that is empty or not text: neither a log nor a run directory."""
    p = Path(path)
    read = logs.read(p)
    causes, ctx = logs.explain(read.facts)
    found = read.causes(ctx)
    for c in found:
        c.framework = ctx.framework
    if any(c.severity == "error" for c in found):  # a recognised NaN / collapse explains the log
        causes = [
            c for c in causes if not (c.kind == "exception" and c.title.startswith("Unrecognised failure"))
        ]
    causes = order_log(causes + found)
    if causes:  # the first cause's culprit, from the whole log (its kind and place in the order stay)
        logs.culprit.resolve(causes[0], read.facts, ctx)
    state = "failed" if any(c.severity == "error" for c in causes) else "log"
    last = f", last logged step {read.last_record['step']}" if read.last_record else ""
    summary = (
        f"{p.name}: {ctx.framework or 'PyTorch'} log, {read.lines} lines{last}; "
        f"{len(causes)} recognised cause(s)"
    )
    return Diagnosis(str(p), "log", p.name, state, summary, causes)


def find_runs(path: Path) -> list[Path]:
    """The run directories of a suite report directory (direct children), sorted by name."""
    return sorted(p for p in path.iterdir() if is_run_dir(p))


def diagnose_path(path: str | Path) -> list[Diagnosis]:
    """One Diagnosis per run (or the log file). ValueError when PATH is none of the accepted kinds."""
    p = Path(path)
    if p.is_file():
        return [diagnose_log(p)]
    if not p.exists():
        raise ValueError(
            f"{p}: no such file or directory; pass a run directory, a suite report directory or a log file"
        )
    if not p.is_dir():
        raise ValueError(
            f"{p}: a device or a pipe, not a file: neither a log nor a run directory; pass a training "
            "log (text), a run directory or a suite report directory"
        )
    if is_run_dir(p):
        return [diagnose_run(read_run(p))]
    runs = find_runs(p)
    if not runs:
        raise ValueError(
            f"{p}: neither a run directory (manifest.json/metrics.jsonl/status.json) nor a suite report "
            "directory containing run directories, e.g. reports/<suite>/<timestamp>"
        )
    return [diagnose_run(read_run(r)) for r in runs]
