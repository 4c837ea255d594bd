"""``verlaudit diagnose PATH``: what happened to a run, its root cause first, evidence, and the fix.

PATH is a variant's run directory, a suite report directory (every run directory in it is
diagnosed, summary first), or a plain log / traceback file from another framework (verl, TRL,
DeepSpeed, plain PyTorch: see `verlaudit.analysis.logparse`). Only the run directory is read (manifest,
metrics, findings, events, status, the runner's record), so runs killed half-way and runs copied
from another machine work.

The analyses below each turn part of the run directory into causes, stamped with the step, phase and
role they concern. The causes are ranked, then ordered by the root-cause rules
(`verlaudit.analysis.rules`): the earliest cause that explains the failure comes first, with the chain
it starts ("root -> consequence"), and only the root carries fixes. A fix is offered when it addresses
the root and the audit or the planner says it would work (no bf16 advice for integer ids or a run that
is bf16 already, no precision change for corrupted weights or a NaN reward, OOM fixes checked against
the planner: `verlaudit.analysis.oom`). Each fix names the suite key (or the user's plug-in) and the
verl key where one exists. Plain text for people, ``--json`` for machines. Exit code 1 when an
error-level cause was found, 0 otherwise, 2 on bad input. Exercised by `pytest tests/test_diagnose.py
tests/test_rules.py` and ``verlaudit diagnose reports/tiny_cpu/<run>``.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import signal
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from verlaudit import verl_keys as V
from verlaudit.analysis.causes import (
    BACKWARD_NAN_WHAT,
    Cause,
    Diagnosis,
    Fix,
    backward_nan_fixes,
    dtype_fixes,
    rank,
)
from verlaudit.analysis.logparse import diagnose_log, explain_error_text, parse_dtype_message
from verlaudit.analysis.oom import oom_cause
from verlaudit.analysis.rules import (
    CAUSE_CLASSES,
    LAST,
    Event,
    Moment,
    chains,
    finding_class,
    moment_words,
    severity_max,
)
from verlaudit.analysis.runview import (
    cfg,
    fmt,
    last_phase_started,
    last_step,
    preset,
    role_policy,
    runner_record,
    setup_plugin,
    user_hook_fix,
)
from verlaudit.analysis.trajectory import loss_scale_causes, no_signal_causes, reward_trend_causes
from verlaudit.rundir import MANIFEST, Finding, RunDir, is_run_dir, read_json, read_run

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


def _status_causes(run: RunDir) -> list[Cause]:
    st = run.status or {}
    reason = st.get("reason")
    step, phase, error = st.get("step"), st.get("phase"), str(st.get("error") or "")
    at = f"step {step}" + (f", phase {phase}" if phase else "") if step is not None else "setup"
    if run.state == "killed":
        return [_killed_cause(run)]
    if run.state == "empty":
        return [Cause("error", "killed", "Nothing was written", "The run directory is empty: the worker never started.",
                      score=40.0)]  # fmt: skip
    if run.state == "completed":
        return []
    if reason == "oom":
        return [oom_cause(run)]
    if reason == "interrupted":
        return [Cause("warning", "interrupted", f"Interrupted at {at}", "The run was stopped (Ctrl-C or SIGTERM); "
                      "everything before it is kept.", evidence=[error] if error else [], step=step, phase=phase,
                      seq=LAST)]  # fmt: skip
    if reason == "refused":
        return [Cause("error", "refused", "Refused before starting", error or "the runner refused this variant",
                      evidence=[error] if error else [], fixes=[Fix("variants.<name>.precision.preset: fp16",
                      V.PARAM_DTYPE_FP16,
                      "the target GPU has no bf16: fp16 autocast with dynamic loss scaling runs there")], step=step,
                      score=40.0)]  # fmt: skip
    if reason in ("nonfinite", "dtype_error") or "probability tensor contains" in error:
        return []  # explained by _nonfinite_causes / _dtype_causes, which read the same status

    known = explain_error_text(error + "\n" + str(st.get("traceback") or ""), step=step)
    for c in known:
        c.phase, c.role, c.seq = phase, st.get("role"), LAST
    if known:
        return known
    field = _field_in(error)
    where = field or st.get("where") or _user_frame(st.get("traceback"))
    fixes = []
    if field:  # a user error names the suite field and says what to do (trainer.config, trainer.data)
        spec = cfg(run, *field.split(".")[:2])
        fixes.append(
            Fix(f"{field} ({spec})" if isinstance(spec, str) else field, None, error.split(": ", 2)[-1])
        )
    elif where and where == _user_frame(st.get("traceback")):
        fixes.append(Fix(None, None, f"the exception was raised in your own code, {where}: fix it there"))
    evidence = [_last_frame(st.get("traceback"))]
    if step is None and cfg(run, "model", "setup"):  # failed in setup, after the user's model code ran
        evidence.append(f"model.setup ran on the models before it: {cfg(run, 'model', 'setup')}")
    return [Cause("error", "exception", f"Failed with an exception at {at}" + (f" in {where}" if where else ""),
                  error or "an exception with no message", evidence=evidence,
                  fixes=fixes, step=step, where=where, score=30.0, phase=phase, role=st.get("role"),
                  seq=LAST)]  # fmt: skip


_FIELD = re.compile(r"^(?:\w+(?:Error|Exception): )?((?:model|data|algo|precision|rollout)\.[\w.]+): ")


def _field_in(error: str) -> str | None:
    """The suite field a user error names first (``ValueError: data.reward_fn: returned shape ...``)."""
    m = _FIELD.match(error)
    return m.group(1) if m else None


def _last_frame(tb: Any) -> str:
    lines = [ln.strip() for ln in str(tb or "").splitlines() if ln.strip().startswith("File ")]
    return f"innermost frame: {lines[-1]}" if lines else "no traceback recorded"


def _user_frame(tb: Any) -> str | None:
    """The innermost traceback frame outside torch, transformers, the trainer and the standard
    library: where user code (a plug-in) raised, as ``file.py:line in fn``."""
    for ln in reversed(str(tb or "").splitlines()):
        ln = ln.strip()
        if not ln.startswith("File "):
            continue
        path = ln.split('"')[1] if '"' in ln else ""
        if any(part in path for part in ("site-packages", "/trainer/", "/verlaudit/", "/lib/python")):
            continue
        rest = ln.split('"')[-1]  # , line N, in fn
        if rest.endswith(("<listcomp>", "<dictcomp>", "<setcomp>", "<genexpr>")):
            continue  # a comprehension's own frame: the function it is in is the next one out
        return f"{Path(path).name}{rest.replace(', line ', ':').replace(', in ', ' in ')}"
    return None


_SIGNAL_WHAT = {
    "SIGKILL": "SIGKILL cannot be caught, so nothing was recorded. It is what the kernel's OOM killer sends when host "
    "RAM runs out; a scheduler's hard limit or `kill -9` send it too.",
    "SIGTERM": "SIGTERM was not handled as an interrupt: a scheduler, a time limit or a parent process stopped it.",
    "SIGSEGV": "a crash in native code (a CUDA kernel, an extension, a driver)",
    "SIGBUS": "a crash in native code or shared memory (/dev/shm) exhausted",
    "SIGABRT": "a native abort (an assertion in C++ code, a CUDA device-side assert)",
}


def _killed_cause(run: RunDir) -> Cause:
    """A worker that died without writing status.json: the exit signal the runner recorded (runner.json)
    and the last phase it started (events.jsonl)."""
    last = last_step(run)
    step, phase = last_phase_started(run)
    rc = runner_record(run).get("returncode")
    sig = None
    if isinstance(rc, int) and rc < 0:
        try:
            sig = signal.Signals(-rc).name
        except ValueError:
            sig = f"signal {-rc}"
    where = f" in {phase} at step {step}" if phase else ""
    ev = [f"last complete metrics line: step {last}" if last is not None else "no metrics line was completed",
          f"{len(run.findings)} findings recorded before it died"]  # fmt: skip
    if phase:
        ev.insert(0, f"last phase started: {phase} at step {step} (events.jsonl phase_start)")
    if rc is not None:
        ev.insert(0, f"exit code {rc} (runner.json)" + (f": killed by {sig}" if sig else ""))
    running = _running_in(run, phase)
    if running:
        ev.append(f"running in that phase: {running}")
    if sig:
        title = f"Killed by {sig}{where}" + (": likely the OOM killer (host RAM)" if sig == "SIGKILL" else "")
        what = f"The worker was killed by {sig}{where}. " + _SIGNAL_WHAT.get(sig, "")
    else:
        title = f"Killed without a status{where}" + (f" (exit code {rc})" if rc is not None else "")
        what = ("The process died without writing status.json: killed by the OS OOM killer (host RAM), a scheduler "
                "time limit, SIGKILL, or a crash in native code. Python exceptions, device OOM, NaN aborts and Ctrl-C "
                "are all recorded, so they are ruled out.")  # fmt: skip
    fixes = [Fix(None, None, "check `dmesg -T | grep -i 'killed process'`: an OOM-killer line names the process and "
                 f"its memory; host RAM ran out{where}" + (f" while {running} ran" if running else ""))]  # fmt: skip
    fixes += _host_memory_fixes(run, phase)
    return Cause("error", "killed", title, what, evidence=ev, fixes=fixes, step=step if step is not None else last,
                 where=phase, score=40.0, phase=phase, seq=LAST, data={"signal": sig, "returncode": rc})  # fmt: skip


def _running_in(run: RunDir, phase: str | None) -> str | None:
    """The user plug-in the trainer calls in ``phase`` (reward: the reward function or model)."""
    if phase == "reward":
        for key in ("model.reward_model", "data.reward_fn", "data.compute_score"):
            spec = cfg(run, *key.split("."))
            if spec:
                return f"{key} ({spec})"
    if phase == "rollout" and cfg(run, "data", "collator"):
        return f"data.collator ({cfg(run, 'data', 'collator')})"
    return None


def _host_memory_fixes(run: RunDir, phase: str | None) -> list[Fix]:
    """What lowers host memory in the phase that was running."""
    b, r = cfg(run, "algo", "batch_size"), cfg(run, "data", "response_length")
    if phase in ("rollout", "reward") and isinstance(b, int) and b > 1:
        return [
            Fix(f"algo.batch_size: {b // 2}", V.MAX_RESPONSE_LENGTH, "fewer sequences in host memory at once")
        ]
    if phase and phase.endswith("update"):
        mb = cfg(run, "algo", "micro_batch_size")
        if isinstance(mb, int) and mb > 1:
            return [Fix(f"algo.micro_batch_size: {mb // 2}", V.micro_batch("actor"), "smaller micro-batches")]
    if isinstance(r, int) and r > 1:
        return [Fix(f"data.response_length: {r // 2}", V.MAX_RESPONSE_LENGTH, "shorter sequences")]
    return []


_MODULE_PRODUCERS = ("numerics/nonfinite_forward", "numerics/overflow", "numerics/nonfinite_backward")
"""Findings that name the module which made a non-finite value from finite inputs. A boundary
(``numerics/nonfinite_boundary``: log-probs, values) or the loss is where NaN was seen, not made."""


def _nonfinite_causes(run: RunDir) -> list[Cause]:  # one analysis: evidence, producer, title, fixes
    st = run.status or {}
    bad_loss = _first_nonfinite(run, _loss_keys(run))
    sampling_nan = "probability tensor contains" in str(st.get("error") or "")
    failed_nonfinite = st.get("reason") == "nonfinite" or sampling_nan
    nf_findings = sorted(
        (f for f in run.findings if f.kind.startswith("numerics/nonfinite") or f.kind == "numerics/overflow"),
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
        evidence.append(f"rollout sampling failed on NaN/Inf probabilities at step {st.get('step')} "
                        f"({st.get('phase')}): the policy's logits were already non-finite")  # fmt: skip
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
    if producer:
        what = (f"{producer.where} ({producer.role}) was the first module whose output became non-finite while its "
                "inputs were finite; the modules after it only propagated it.")  # fmt: skip
        plugin = setup_plugin(run, producer.role)
        if plugin:
            evidence.append(f"model.setup ran on the {producer.role} model: {plugin}")
    else:
        what = ("The loss became NaN/Inf. No module made it from finite inputs on an audited step"
                + (f"; it was first seen in {seen.where} ({seen.role})" if seen is not None else "")
                + ": it came from outside the modules (a reward, advantages, a boundary), or the step was not "
                "audited at the full level.")  # fmt: skip
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
    return [Cause("error", "nonfinite", title, what, evidence=evidence, fixes=fixes,
                  step=step, where=where, score=50.0 if failed_nonfinite else 20.0, phase=phase,
                  role=ref.role if ref is not None else None, seq=_seq(run, ref) if ref is not None else LAST,
                  data={"producer": producer.to_dict() if producer else None,
                        "loss_scale_history": history[-16:]})]  # fmt: skip


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
    fp16_overflow = any(f.kind == "numerics/overflow" and (f.observed or {}).get("dtype") == "fp16" for f in nf
                        if isinstance(f.observed, dict))  # fmt: skip
    scaled_skips = role_policy(run, "actor").get("loss_scaling") == "dynamic" and any(
        v > 0 for s, v in run.series("actor/skipped") if step is None or s <= step
    )
    if preset(run) == "fp16" and (fp16_overflow or scaled_skips):
        fixes.append(Fix("precision.preset: bf16", V.PARAM_DTYPE_BF16,
                         "fp16 overflows at 65504; bf16 has fp32's exponent range (needs an Ampere+ GPU)"))  # fmt: skip
    if _diverged(run, step):
        lr = cfg(run, "algo", "lr")
        fixes.append(Fix(f"algo.lr: {lr / 10:g}" if isinstance(lr, (int, float)) else "algo.lr: <lower>",
                         V.LR, "the loss / gradient norm grew before going non-finite: smaller steps"))  # fmt: skip
        if not cfg(run, "algo", "max_grad_norm"):
            fixes.append(Fix("algo.max_grad_norm: 1.0", V.GRAD_CLIP, "clip gradients"))
    if not fixes and producer is None:
        fixes.append(Fix("audit.level: full", None, f"rerun with every module audited at step {step} (audit.every) "
                         "to name the module or boundary where the NaN is made"))  # fmt: skip
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
    runtime = [f for f in run.findings if f.kind == "runtime/dtype_error"]
    if not failed and not runtime:
        return []

    f = runtime[0] if runtime else None
    msg = str(st.get("error") or (f.message if f else ""))
    parsed = parse_dtype_message(msg) or {}
    observed = (f.observed if f and f.observed else None) or parsed.get("observed")
    expected = (f.expected if f and f.expected else None) or parsed.get("expected")
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
    title = "Dtype error" + (f" in {where}" if where else "") + (f": {observed} where {expected} was expected"
                                                                 if observed and expected else "")  # fmt: skip
    return [Cause("error", "dtype_error", title, "A tensor reached an op whose other operands (or weights) have a "
                  "different dtype, outside autocast.", evidence=ev, fixes=fixes, step=step, where=where,
                  score=50.0 if failed else 20.0, phase=phase, role=role, seq=LAST,
                  data={"observed": observed, "expected": expected})]  # fmt: skip


_EXPLAINED_KINDS = (
    "runtime/dtype_error",
    "numerics/nonfinite",
    "numerics/overflow",
    "memory/oom",
    "numerics/skipped_step",
    "reward/no_signal",
)
"""Finding kinds that a dedicated analysis already turns into a cause (with more evidence)."""


def _finding_causes(run: RunDir) -> list[Cause]:
    groups: dict[tuple[str, str], list[Finding]] = {}
    for f in run.findings:
        if f.severity == "info" or f.kind.startswith(_EXPLAINED_KINDS):
            continue
        groups.setdefault((f.kind, finding_class(f.kind, f.observed, f.expected)), []).append(f)
    out = []
    for (kind, cls), fs in groups.items():
        fs.sort(key=lambda f: (f.severity != "error", f.step if f.step is not None else -1, f.rank))
        top = fs[0]
        ev = [f"{f.role or '-'} {f.where or '-'} step {f.step}: observed {f.observed}, expected {f.expected}"
              + (f" (x{f.count})" if f.count > 1 else "") for f in fs[:5]]  # fmt: skip
        if len(fs) > 5:
            ev.append(f"... and {len(fs) - 5} more")
        plugin = setup_plugin(run, top.role)
        if plugin and kind.startswith(("dtype/", "numerics/weight")):
            ev.append(f"model.setup ran on the {top.role} model: {plugin} (user code that can change dtypes, modules "
                      "and hooks)")  # fmt: skip
        fixes = _plugin_fixes(run, top, fs)
        hook = (
            user_hook_fix(run, top.role, top.where)
            if kind.startswith(("dtype/module", "numerics/"))
            else None
        )
        fixes = [hook, *fixes] if hook else fixes
        sev = "error" if any(f.severity == "error" for f in fs) else "warning"
        out.append(Cause(sev, f"finding:{kind}", f"{kind}: {top.message}", top.message, evidence=ev, fixes=fixes,
                         step=top.step, where=top.where, phase=top.phase, role=top.role, cls=cls,
                         seq=_seq(run, top)))  # fmt: skip
    return out


_MODULE_DTYPE_KINDS = (
    "dtype/param_storage",
    "dtype/mixed_params",
    "dtype/buffer_precision",
    "dtype/module_output",
)
"""Findings about a model's own dtypes: user setup code (model.setup) is where they are changed."""
_WEIGHT_SOURCES = {"actor": "model.path", "reference": "model.path", "critic": "model.critic_path",
                   "reward": "model.reward_model"}  # fmt: skip


def _plugin_fixes(run: RunDir, top: Finding, fs: Sequence[Finding]) -> list[Fix]:
    """The findings' own fixes, each naming the suite key of the user code it is about: the collator,
    the reward function or model, the checkpoint the weights came from."""
    where = top.where or ""
    key = None
    if where.startswith("collator:"):
        key = (
            f"data.collator ({cfg(run, 'data', 'collator')})"
            if cfg(run, "data", "collator")
            else "data.collator"
        )
    elif where.startswith("reward:"):
        source = where.removeprefix("reward:").partition(":")[2]
        key = f"{'model.reward_model' if where.startswith('reward:model:') else 'data.reward_fn'} ({source})"
    elif top.kind in _MODULE_DTYPE_KINDS and setup_plugin(run, top.role):
        key = f"model.setup ({setup_plugin(run, top.role)})"
    elif top.kind.startswith("numerics/weight") or top.kind == "boundary/reward_model":
        field = _WEIGHT_SOURCES.get(top.role or "", "model.path")
        source = cfg(run, *field.split("."))
        plugin = setup_plugin(run, top.role)
        key = f"{field} ({source})" if source else f"model.setup ({plugin})" if plugin else field
    fixes = list(dict.fromkeys(Fix(key, None, f.fix) for f in fs if f.fix))[:3]
    return fixes


ANALYSES = (
    _status_causes,
    _nonfinite_causes,
    _dtype_causes,
    loss_scale_causes,
    reward_trend_causes,
    no_signal_causes,
    _finding_causes,
)


def diagnose_run(run: RunDir) -> Diagnosis:
    """All causes found in one run directory: ranked, then root first (`order_by_root`)."""
    causes: list[Cause] = []
    for analysis in ANALYSES:
        causes.extend(analysis(run))
    causes = order_by_root(rank(causes))
    st = run.status or {}
    if run.state == "completed":
        state = "completed" + (" with warnings" if any(c.severity == "warning" for c in causes) else "")
        if any(c.severity == "error" for c in causes):
            state = "completed with errors"
    elif run.state == "failed":
        state = f"failed at step {st.get('step')}" + (f" ({st.get('phase')})" if st.get("phase") else "") + \
            f": {st.get('reason', 'unknown')}"  # fmt: skip
    else:
        state = run.state + (f" after step {last_step(run)}" if last_step(run) is not None else "")
    algo, steps = cfg(run, "algo", "name"), cfg(run, "steps")
    summary = f"{run.name}: {state}; {algo or '?'} {preset(run) or '?'}, {len(run.metrics)} of {steps or '?'} steps recorded"
    return Diagnosis(str(run.path), "run", run.name, state, summary, causes)


def order_by_root(causes: list[Cause]) -> list[Cause]:
    """``causes`` (ranked) regrouped by the root-cause rules: each group is its root, then what it
    explains in time order; the root gets the chain and the group's highest severity, the
    consequences lose their fixes (the root's fix is theirs). Groups keep the rank order of their
    most important member."""
    for c in causes:
        c.cls = c.cls or CAUSE_CLASSES.get(c.kind, "other")
    events = [Event(c.cls or "other", Moment.of(c.step, c.phase, c.seq), c.role) for c in causes]
    out: list[Cause] = []
    for path, others in chains(events, list(range(len(causes)))):
        root = causes[path[0]]
        cons = [causes[j] for j in path[1:] + others]
        out += [root, *cons]
        if not cons:
            continue
        root.severity = severity_max([root.severity] + [c.severity for c in cons])
        root.chain = [_label(causes[j], events[j].moment) for j in path]
        for c in cons:
            c.consequence_of = root.title
            c.fixes = []
    return out


def _label(c: Cause, m: Moment) -> str:
    kind = c.kind.removeprefix("finding:")
    return f"{kind}" + (f" in {c.where}" if c.where else "") + f" ({moment_words(m)})"


# --------------------------------------------------------------------------------------------
# rendering and the command


def render_text(d: Diagnosis) -> str:
    lines = [f"{d.source_kind} {d.source}", f"  {d.summary}", f"  verdict: {d.verdict}"]
    if not d.causes:
        lines.append("  no problems found")
    for i, c in enumerate(d.causes, 1):
        lines.append(f"  {i}. [{c.severity}] {c.title}")
        if c.chain:
            lines.append(f"     root cause: {' -> '.join(c.chain)}")
        if c.consequence_of:
            lines.append(f"     consequence of the root cause above: {c.consequence_of}")
        lines.append(f"     what: {c.what}")
        for e in c.evidence:
            lines.append(f"     - {e}")
        for f in c.fixes:
            parts = [f"suite: {f.suite}" if f.suite else None, f"verl: {f.verl}" if f.verl else None]
            head = "; ".join(p for p in parts if p)
            lines.append(f"     fix: {head}{' — ' if head and f.why else ''}{f.why}")
            lines.extend(_verl_script_lines(d, f))
        for u in c.unknown:
            lines.append(f"     cannot tell: {u}")
    return "\n".join(lines)


def _verl_script_lines(d: Diagnosis, fix: Fix) -> list[str]:
    """For a run made by `verlaudit from-verl`: the fix as the user's own verl script lines."""
    manifest = read_json(Path(d.source) / MANIFEST) if d.source_kind == "run" else None
    origin = (((manifest or {}).get("config") or {}).get("origin") or {}).get("verl")
    if not origin:
        return []
    from verlaudit.verl.roundtrip import script_lines

    return [f"       {line}" for line in script_lines(origin, fix.verl, fix.suite)]


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
    if is_run_dir(p):
        return [diagnose_run(read_run(p))]
    runs = find_runs(p)
    if not runs:
        raise ValueError(f"{p}: neither a run directory (manifest.json/metrics.jsonl/status.json) nor a suite report "
                         "directory containing run directories, e.g. reports/<suite>/<timestamp>")  # fmt: skip
    return [diagnose_run(read_run(r)) for r in runs]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "path", help="a variant's run directory, a suite report directory, or a log/traceback file"
    )
    p.add_argument("--json", action="store_true", help="machine-readable output")


def main(args: argparse.Namespace) -> int:
    diags = diagnose_path(args.path)
    if args.json:
        print(json.dumps({"diagnoses": [d.to_dict() for d in diags],
                          "verdict": _overall(diags)}, indent=2, default=str))  # fmt: skip
    else:
        if len(diags) > 1:
            print(f"summary ({len(diags)} runs):")
            for d in diags:
                top = _headline(d)
                print(f"  {d.verdict:8s} {d.summary} — {top}")
            print()
        print("\n\n".join(render_text(d) for d in diags))
    return 1 if _overall(diags) == "error" else 0


def _headline(d: Diagnosis) -> str:
    """The first cause in one line: its chain when it has one."""
    if not d.causes or d.verdict == "clean":
        return "no problems found"
    first = d.causes[0]
    return " -> ".join(first.chain) if first.chain else first.title


def _overall(diags: Sequence[Diagnosis]) -> str:
    v = {d.verdict for d in diags}
    return "error" if "error" in v else "warning" if "warning" in v else "clean"
