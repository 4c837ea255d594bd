"""``verlaudit diagnose PATH``: what happened to a run, ranked causes, evidence, and the fix.

PATH is a variant's run directory, a suite report directory (every run directory in it is
diagnosed, summary first), or a plain log / traceback file from another framework (verl, TRL,
DeepSpeed, plain PyTorch: see `verlaudit.analysis.logparse`). Only the run directory is read (manifest,
metrics, findings, status), so runs killed half-way and runs copied from another machine work.

Each cause says what happened, the evidence (step, module path or boundary, numbers) and a fix
in the suite's own keys with the verl equivalent where one exists. Plain text for people,
``--json`` for machines. Exit code 1 when an error-level cause was found, 0 otherwise, 2 on bad
input. Exercised by `pytest tests/test_diagnose.py` and ``verlaudit diagnose reports/tiny_cpu/<run>``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from collections.abc import Mapping, Sequence
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
from verlaudit.analysis.logparse import diagnose_log, explain_error_text
from verlaudit.analysis.mismatch_cause import mismatch_causes
from verlaudit.dtypes import parse_dtype_message
from verlaudit.plan.failure import capacity_gib, memory_at_failure, run_plan_inputs, run_world_size
from verlaudit.plan.memory_model import GIB
from verlaudit.plan.planner import plan_config
from verlaudit.rundir import MANIFEST, Finding, RunDir, is_run_dir, read_json, read_run, to_float

# --------------------------------------------------------------------------------------------
# small readers over a RunDir


def _cfg(run: RunDir, *path: str, default: Any = None) -> Any:
    cur: Any = run.manifest.get("config") or {}
    for p in path:
        if not isinstance(cur, Mapping) or p not in cur:
            return default
        cur = cur[p]
    return cur


def _role_policy(run: RunDir, role: str) -> Mapping[str, Any]:
    return ((run.manifest.get("policy") or {}).get("roles") or {}).get(role) or {}


def _uses_reference(run: RunDir) -> bool:
    """Whether the run built the frozen reference (trainer.config.AlgoConfig.uses_reference); runs
    recorded before the verl KL keys had one whenever kl_coef was positive."""
    algo = (run.manifest.get("config") or {}).get("algo") or {}
    if "use_kl_loss" not in algo:
        return algo.get("name") == "dpo" or bool(algo.get("kl_coef", 0.05))
    return algo.get("name") == "dpo" or bool(algo.get("use_kl_in_reward") or algo.get("use_kl_loss"))


def _preset(run: RunDir) -> str | None:
    return (run.manifest.get("policy") or {}).get("preset") or _cfg(run, "precision", "preset")


def _fmt(v: float) -> str:
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    return f"{v:.4g}"


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


def _last_step(run: RunDir) -> int | None:
    steps = [int(m["step"]) for m in run.metrics if "step" in m]
    return max(steps) if steps else None


# --------------------------------------------------------------------------------------------
# analyses: each is a pure function RunDir -> list[Cause]


def _status_causes(run: RunDir) -> list[Cause]:
    st = run.status or {}
    reason = st.get("reason")
    step, phase, error = st.get("step"), st.get("phase"), str(st.get("error") or "")
    at = f"step {step}" + (f", phase {phase}" if phase else "")
    if run.state == "killed":
        last = _last_step(run)
        return [
            Cause(
                "error", "killed", "Killed without a status (no status.json)",
                "The process died without writing status.json: killed by the OS OOM killer (host RAM), a "
                "scheduler time limit, SIGKILL, or a crash in native code. Python exceptions, device OOM, "
                "NaN aborts and Ctrl-C are all recorded, so they are ruled out.",
                evidence=[f"last complete metrics line: step {last}" if last is not None else "no metrics line was completed",
                          f"{len(run.findings)} findings recorded before it died"],
                fixes=[Fix(None, None, "check `dmesg | grep -i 'killed process'` (host OOM killer) and the "
                           "scheduler's log; if host RAM: lower algo.batch_size or data.response_length")],
                step=last, score=40.0,
            )
        ]  # fmt: skip
    if run.state == "empty":
        return [Cause("error", "killed", "Nothing was written", "The run directory is empty: the worker never started.",
                      score=40.0)]  # fmt: skip
    if run.state == "completed":
        return []
    if reason == "oom":
        return [_oom_cause(run)]
    if reason == "interrupted":
        return [Cause("warning", "interrupted", f"Interrupted at {at}", "The run was stopped (Ctrl-C or SIGTERM); "
                      "everything before it is kept.", evidence=[error] if error else [], step=step)]  # fmt: skip
    if reason == "refused":
        return [Cause("error", "refused", "Refused before starting", error or "the runner refused this variant",
                      evidence=[error] if error else [], fixes=[Fix("variants.<name>.precision.preset: fp16",
                      V.PARAM_DTYPE_FP16,
                      "the target GPU has no bf16: fp16 autocast with dynamic loss scaling runs there")], step=step,
                      score=40.0)]  # fmt: skip
    if reason in ("nonfinite", "dtype_error") or "probability tensor contains" in error:
        return []  # explained by _nonfinite_causes / _dtype_causes, which read the same status

    known = explain_error_text(error + "\n" + str(st.get("traceback") or ""), step=step)
    if known:
        return known
    return [Cause("error", "exception", f"Failed with an exception at {at}", error or "an exception with no message",
                  evidence=[_last_frame(st.get("traceback"))], step=step, score=30.0)]  # fmt: skip


def _last_frame(tb: Any) -> str:
    lines = [ln.strip() for ln in str(tb or "").splitlines() if ln.strip().startswith("File ")]
    return f"innermost frame: {lines[-1]}" if lines else "no traceback recorded"


def _nonfinite_causes(run: RunDir) -> list[Cause]:
    st = run.status or {}
    failed_nonfinite = st.get("reason") == "nonfinite"
    bad_loss = _first_nonfinite(run, _loss_keys(run))
    sampling_nan = "probability tensor contains" in str(st.get("error") or "")
    failed_nonfinite = failed_nonfinite or sampling_nan
    nf_findings = sorted(
        (f for f in run.findings if f.kind.startswith("numerics/nonfinite") or f.kind == "numerics/overflow"),
        key=lambda f: (f.step if f.step is not None else 1 << 30, f.rank),
    )
    if not (failed_nonfinite or bad_loss or any(f.severity == "error" for f in nf_findings)):
        return []
    step = bad_loss[0] if bad_loss else st.get("step") if failed_nonfinite else nf_findings[0].step
    producer = _producer(nf_findings)
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
            evidence.append(f"{key} > 0 first at step {s[0][0]} ({_fmt(s[0][1])} elements)")
    history = [(s, v) for s, v in run.series("actor/loss_scale") if step is None or s <= step]
    if history and (_role_policy(run, "actor").get("loss_scaling") not in (None, "none")):
        evidence.append("loss scale before it: " + ", ".join(f"{s}:{_fmt(v)}" for s, v in history[-8:]))
    skipped = [(s, v) for s, v in run.series("actor/skipped") if v > 0 and (step is None or s <= step)]
    if skipped:
        evidence.append(
            f"skipped optimizer steps before it: {len(skipped)} (steps {', '.join(str(s) for s, _ in skipped[-6:])})"
        )
    where = producer.where if producer else None
    title = f"Non-finite loss/gradients from step {step}" + (f", first produced in {where}" if where else "")
    what = (f"{producer.where} ({producer.role}) was the first module whose output became non-finite while its "
            "inputs were finite; the modules after it only propagated it." if producer else
            "The loss became NaN/Inf. No per-module producer was recorded (audit level off/boundary on that step, "
            "or the NaN came from outside a module: reward, advantages, log-probs).")  # fmt: skip
    fixes = _nonfinite_fixes(run, producer)
    first_step = run.metrics[0].get("step") if run.metrics else None
    if not bad_loss and not failed_nonfinite and producer is None and step is not None and step == first_step:
        # finite loss, NaN gradients before any update: the weights are the initial ones, so it is not
        # divergence or overflow of trained values but a backward that makes NaN from finite inputs
        title = f"Non-finite gradients from the first step ({step}) with a finite loss: NaN made in the backward pass"

        what = BACKWARD_NAN_WHAT
        fixes = backward_nan_fixes() + [f for f in fixes if f.suite is not None]
    return [Cause("error", "nonfinite", title, what, evidence=evidence, fixes=fixes,
                  step=step, where=where, score=50.0 if failed_nonfinite else 20.0,
                  data={"producer": producer.to_dict() if producer else None,
                        "loss_scale_history": history[-16:]})]  # fmt: skip


def _producer(findings: Sequence[Finding]) -> Finding | None:
    # the forward producer is the root; a backward producer only when no forward one exists
    # A nonfinite_grads finding names parameters in registration order, not the module that made
    # the NaN, so it is never taken for a producer.
    for pref in ("forward", "producer", "backward", ""):
        for f in findings:
            if pref in f.kind and f.where and f.kind != "numerics/nonfinite_grads":
                return f
    return None


def _nonfinite_fixes(run: RunDir, producer: Finding | None) -> list[Fix]:
    preset = _preset(run)
    fixes = []
    if producer is not None and producer.fix:
        fixes.append(Fix(None, None, producer.fix))
    if preset == "fp16":
        fixes.append(Fix("precision.preset: bf16", V.PARAM_DTYPE_BF16,
                         "fp16 overflows at 65504; bf16 has fp32's exponent range (needs an Ampere+ GPU)"))  # fmt: skip
    if preset == "bf16-pure":
        fixes.append(Fix("precision.preset: bf16", V.MODEL_DTYPE_FP32,
                         "keep fp32 master weights and optimizer state; bf16 autocast only for matmuls"))  # fmt: skip
    lr = _cfg(run, "algo", "lr")
    fixes.append(Fix(f"algo.lr: {lr / 10:g}" if isinstance(lr, (int, float)) else "algo.lr: <lower>",
                     V.LR, "a lower learning rate keeps weights and activations "
                     "in range if the loss diverged before it went non-finite"))  # fmt: skip
    if not _cfg(run, "algo", "max_grad_norm"):
        fixes.append(Fix("algo.max_grad_norm: 1.0", V.GRAD_CLIP, "clip gradients"))
    return fixes


def _dtype_causes(run: RunDir) -> list[Cause]:
    st = run.status or {}
    failed = st.get("reason") == "dtype_error"
    runtime = [f for f in run.findings if f.kind == "runtime/dtype_error"]
    if not failed and not runtime:
        return []

    f = runtime[0] if runtime else None
    msg = str(st.get("error") or (f.message if f else ""))
    parsed = parse_dtype_message(msg)
    observed = (f.observed if f and f.observed else None) or (parsed.observed if parsed else None)
    expected = (f.expected if f and f.expected else None) or (parsed.expected if parsed else None)
    where = (f.where if f else None) or st.get("where")
    step = f.step if f and f.step is not None else st.get("step")
    ev = [f"error: {msg}"] if msg else []
    if where:
        ev.append(f"innermost module executing: {where}" + (f" ({f.role})" if f and f.role else ""))
    if observed or expected:
        ev.append(f"observed {observed}, expected {expected}")
    ev.append(f"phase {st.get('phase') or (f.phase if f else None)}, step {step}")
    related = [x for x in run.findings if x.kind.startswith(("dtype/", "boundary/")) and x.severity != "info"]
    for x in related[:3]:
        ev.append(f"earlier finding {x.kind} at {x.where} (step {x.step}): {x.message}")
    fixes = [Fix(None, None, f.fix)] if f and f.fix else []
    fixes += dtype_fixes(observed)
    title = "Dtype error" + (f" in {where}" if where else "") + (f": {observed} where {expected} was expected"
                                                                 if observed and expected else "")  # fmt: skip
    return [Cause("error", "dtype_error", title, "A tensor reached an op whose other operands (or weights) have a "
                  "different dtype, outside autocast.", evidence=ev, fixes=fixes, step=step, where=where,
                  score=50.0 if failed else 20.0, data={"observed": observed, "expected": expected})]  # fmt: skip


def _loss_scale_causes(run: RunDir) -> list[Cause]:
    out = []
    for role in ("actor", "critic"):
        skipped = run.series(f"{role}/skipped")
        scale = run.series(f"{role}/loss_scale")
        n_skipped = sum(1 for _, v in skipped if v > 0)
        if not skipped or n_skipped == 0:
            continue
        longest = cur = 0
        for _, v in skipped:
            cur = cur + 1 if v >= 0.999 else 0
            longest = max(longest, cur)
        tail_all_skipped = len(skipped) >= 3 and all(v >= 0.999 for _, v in skipped[-3:])
        final_scale = scale[-1][1] if scale else None
        at_floor = final_scale is not None and final_scale <= 1.0 and n_skipped >= 3
        frac = n_skipped / len(skipped)
        first = next(s for s, v in skipped if v > 0)
        ev = [
            f"{n_skipped} of {len(skipped)} steps skipped ({frac:.0%}), longest run {longest}, first at step {first}"
        ]
        if scale:
            ev.append("loss scale: " + ", ".join(f"{s}:{_fmt(v)}" for s, v in scale[-8:]))
        overflow = [f for f in run.findings if "overflow" in f.kind or "headroom" in f.kind]
        where = overflow[0].where if overflow else None
        for f in overflow[:3]:
            ev.append(f"{f.kind} at {f.where} (step {f.step}): {f.message}")
        if _role_policy(run, role).get("loss_scaling", "none") == "none":
            out.append(Cause("warning", "nonfinite_skips", f"{role}: {n_skipped} optimizer step(s) skipped for "
                             "non-finite gradients", "This policy has no loss scaling, so a skip is not calibration: "
                             "gradients were NaN/Inf (see the non-finite cause for the producer).", evidence=ev,
                             step=first, where=where))  # fmt: skip
            continue
        fixes = [Fix("precision.preset: bf16", V.param_dtype(role, "bf16"),
                      "bf16 has fp32's exponent range: no overflow, no loss scaling")]  # fmt: skip
        if where:
            fixes.append(
                Fix(None, None, f"{where} exceeds fp16's range: keep it in fp32 or rescale its output")
            )
        if at_floor or longest >= 5 or tail_all_skipped:
            out.append(Cause("error", "loss_scale_collapse", f"{role} loss-scale collapse: scale driven to "
                             f"{_fmt(final_scale) if final_scale is not None else '?'} with repeated skipped steps",
                             (
                        "Gradients overflow even at a loss scale of 1 or below, so the overflow is in the "
                        "forward/backward values themselves (fp16 range), not a too-large scale; the "
                        "optimizer has stopped updating."
                        if at_floor
                        else f"{longest} optimizer steps in a row were skipped for non-finite gradients while "
                        "the scale kept halving: the scaler is not recovering and the weights are not updating."
                    ), evidence=ev, fixes=fixes, step=first, where=where,
                             score=30.0, data={"skipped": n_skipped, "longest_run": longest, "final_scale": final_scale}))  # fmt: skip
        elif frac > 0.1:
            out.append(Cause("warning", "overflow_skips", f"{role}: {n_skipped} optimizer steps skipped on overflow",
                             "More than 10% of steps were skipped for non-finite gradients; the scaler recovers but "
                             "training is slowed and noisier.", evidence=ev, fixes=fixes, step=first, where=where))  # fmt: skip
        else:
            out.append(Cause("info", "overflow_skips", f"{role}: {n_skipped} skipped step(s) while the loss scale "
                             "calibrated", "A few overflow skips early in fp16 are the dynamic scaler finding its "
                             "level; no action needed.", evidence=ev, step=first))  # fmt: skip
    return out


def _reward_causes(run: RunDir) -> list[Cause]:
    algo = _cfg(run, "algo", "name", default="ppo")
    mean_key, std_key = (
        ("rewards/margins", None) if algo == "dpo" else ("critic/score/mean", "critic/score/std")
    )
    means = [v for _, v in run.series(mean_key)]
    out = []
    if len(means) < 6 or any(not math.isfinite(v) for v in means):
        return out  # too short to judge; non-finite rewards are reported by _nonfinite_causes
    w = max(3, len(means) // 5)
    early, late = means[:w], means[-w:]
    e_mean, l_mean = sum(early) / w, sum(late) / w
    best = max(sum(means[i : i + w]) / w for i in range(len(means) - w + 1))
    span = max(means) - min(means)
    if span > 1e-9 and best - l_mean > 0.5 * span and l_mean < e_mean:
        kl_loss_coef = max(_cfg(run, "algo", "kl_loss_coef", default=0.001) * 2, 0.01)
        out.append(Cause("warning", "reward_collapse", f"Reward collapse: {mean_key} fell from {_fmt(best)} "
                         f"(best {w}-step window) to {_fmt(l_mean)}",
                         "The policy got worse than where it started: typical of a too-large step size, KL "
                         "drift from the reference, or reward hacking that the reward later punishes.",
                         evidence=[f"first {w} steps mean {_fmt(e_mean)}, last {w} steps mean {_fmt(l_mean)}"],
                         fixes=[Fix(f"algo.use_kl_loss: true, algo.kl_loss_coef: {kl_loss_coef:g}",
                                    f"{V.algo_override('use_kl_loss', True)} {V.KL_LOSS_COEF}={kl_loss_coef:g} "
                                    f"(or {V.algo_key('use_kl_in_reward')} with {V.KL_COEF})",
                                    "a stronger KL anchor to the reference"),
                                Fix("algo.lr: <half>", V.LR, "smaller policy steps")],
                         step=len(means) - w))  # fmt: skip
    if std_key:
        stds = [v for _, v in run.series(std_key)]
        if len(stds) >= 6 and all(math.isfinite(v) for v in stds):
            e_std, l_std = sum(stds[:w]) / w, sum(stds[-w:]) / w
            if max(stds[:-w] or [0]) > 1e-3 and all(v < 1e-6 for v in stds[-3:]):
                out.append(Cause("warning", "reward_collapse", "Reward variance collapsed to zero",
                                 "Every response in the batch gets the same score, so GRPO/PPO advantages are zero "
                                 "and the policy stops learning (entropy collapse or a saturated reward).",
                                 evidence=[f"{std_key}: early mean {_fmt(e_std)}, last 3 steps "
                                           + ", ".join(_fmt(v) for v in stds[-3:])],
                                 fixes=[Fix("algo.temperature: 1.0", V.TEMPERATURE,
                                            "sample with more diversity"),
                                        Fix("algo.entropy_coef: 0.001", V.ENTROPY_COEFF,
                                            "keep the policy's entropy from collapsing")]))  # fmt: skip
            elif e_std > 0 and l_std > 10 * e_std:
                out.append(Cause("warning", "reward_variance", f"Exploding reward variance: {std_key} grew "
                                 f"{l_std / e_std:.0f}x ({_fmt(e_std)} -> {_fmt(l_std)})",
                                 "The spread of rewards grows without bound: the reward model or function is being "
                                 "exploited, or values are blowing up.",
                                 evidence=[f"first {w} steps mean {_fmt(e_std)}, last {w} steps mean {_fmt(l_std)}"],
                                 fixes=[Fix("data.reward_fn: <clip or normalise the reward>", V.REWARD_MANAGER,
                                            "bound the reward"),
                                        Fix("algo.lr: <half>", V.LR, "smaller steps")]))  # fmt: skip
    return out


_EXPLAINED_KINDS = (
    "runtime/dtype_error",
    "numerics/nonfinite",
    "numerics/overflow",
    "memory/oom",
    "numerics/skipped_step",
    "mismatch/",  # mismatch_causes
)
"""Finding kinds that a dedicated analysis already turns into a cause (with more evidence)."""


def _finding_causes(run: RunDir) -> list[Cause]:
    groups: dict[str, list[Finding]] = {}
    for f in run.findings:
        if f.severity == "info" or f.kind.startswith(_EXPLAINED_KINDS):
            continue
        groups.setdefault(f.kind, []).append(f)
    out = []
    for kind, fs in groups.items():
        fs.sort(key=lambda f: (f.severity != "error", f.step if f.step is not None else 1 << 30, f.rank))
        top = fs[0]
        ev = [f"{f.role or '-'} {f.where or '-'} step {f.step}: observed {f.observed}, expected {f.expected}"
              + (f" (x{f.count})" if f.count > 1 else "") for f in fs[:5]]  # fmt: skip
        if len(fs) > 5:
            ev.append(f"... and {len(fs) - 5} more")
        fixes = list(dict.fromkeys(Fix(None, None, f.fix) for f in fs if f.fix))[:3]
        sev = "error" if any(f.severity == "error" for f in fs) else "warning"
        out.append(Cause(sev, f"finding:{kind}", f"{kind}: {top.message}", top.message, evidence=ev, fixes=fixes,
                         step=top.step, where=top.where))  # fmt: skip
    return out


ANALYSES = (
    _status_causes,
    _nonfinite_causes,
    _dtype_causes,
    _loss_scale_causes,
    _reward_causes,
    mismatch_causes,
    _finding_causes,
)


def diagnose_run(run: RunDir) -> Diagnosis:
    """All causes found in one run directory, ranked."""
    causes: list[Cause] = []
    for analysis in ANALYSES:
        causes.extend(analysis(run))
    causes = rank(causes)
    st = run.status or {}
    if run.state == "completed":
        state = "completed" + (" with warnings" if any(c.severity == "warning" for c in causes) else "")
        if any(c.severity == "error" for c in causes):
            state = "completed with errors"
    elif run.state == "failed":
        state = f"failed at step {st.get('step')}" + (f" ({st.get('phase')})" if st.get("phase") else "") + \
            f": {st.get('reason', 'unknown')}"  # fmt: skip
    else:
        state = run.state + (f" after step {_last_step(run)}" if _last_step(run) is not None else "")
    algo, preset, steps = _cfg(run, "algo", "name"), _preset(run), _cfg(run, "steps")
    summary = f"{run.name}: {state}; {algo or '?'} {preset or '?'}, {len(run.metrics)} of {steps or '?'} steps recorded"
    return Diagnosis(str(run.path), "run", run.name, state, summary, causes)


# --------------------------------------------------------------------------------------------
# OOM: which memory class dominated, from the planner (verlaudit.plan.memory_model via verlaudit.plan)


def _planned_fit(run: RunDir, changes: Mapping[str, Any], cap: float | None, gpus: int | None = None) -> str:
    """`` (planner: N GiB needed of M: fits)`` for the run's config with ``changes``; empty when the
    changed config cannot be planned (the fix is still printed, unchecked)."""

    try:
        cfg, _, w, optimizer = run_plan_inputs(run, changes)
        need = plan_config(cfg, gpus=gpus or w, optimizer=optimizer)[0].device_bytes() / GIB
    except ValueError:
        return ""
    if cap is None:
        return f" (planner: {need:.3g} GiB per GPU)"
    return f" (planner: {need:.3g} GiB needed of {cap:.1f}: {'fits' if need <= cap else 'does NOT fit'})"


def _oom_cause(run: RunDir) -> Cause:
    st = run.status or {}
    phase, step = st.get("phase"), st.get("step")
    mem = st.get("memory") or {}
    ev = [f"out of memory at step {step}, phase {phase}"
          + (f", in {st['where']}" + (f" ({st['role']})" if st.get("role") else "") if st.get("where") else "")]  # fmt: skip
    if st.get("error"):
        ev.append(f"error: {str(st['error'])[:300]}")
    shown = {k: v for k, v in mem.items() if isinstance(v, (int, float))}
    if shown:
        ev.append(
            "allocator/device view (GiB): " + ", ".join(f"{k}={_fmt(float(v))}" for k, v in shown.items())
        )
    for k, v in mem.items():
        if isinstance(v, Mapping) and v:
            ev.append(f"{k}: " + ", ".join(f"{p}={_fmt(to_float(x))}" for p, x in v.items() if _num(x)))
    emu = run.manifest.get("emulation") or {}
    if emu.get("memory_cap_gb"):
        ev.append(
            f"memory cap {emu['memory_cap_gb']} GiB emulating {emu.get('target')} ({emu.get('reason') or ''})"
        )

    unknown: list[str] = []
    est = None
    try:
        est = memory_at_failure(run, phase, step)
    except ValueError as e:
        unknown.append(f"memory classes: the planner cannot model this run ({e})")
    if est is not None:
        ev.append(f"planner at '{est.phase}': " + ", ".join(f"{k} {v:.3g}" for k, v in list(est.components.items())[:6])
                  + f" GiB (allocated {est.allocated:.3g} GiB; {est.device:.3g} GiB on the device with allocator "
                  "reserve and CUDA context)")  # fmt: skip
        ev.append("by class: " + ", ".join(f"{k} {v:.3g} GiB" for k, v in est.classes.items()))
        ev += [f"planner assumed: {n}" for n in est.notes]
    dominant = est.dominant if est else None
    reserved, allocated = _num(mem.get("reserved_gb")), _num(mem.get("allocated_gb"))
    fragmented = bool(reserved and allocated is not None and reserved - allocated > 0.25 * reserved)
    title = f"Out of memory in {phase or '?'} at step {step}" + (
        f"; {dominant} dominate ({est.classes[dominant]:.3g} of {est.allocated:.3g} GiB by the planner)" if est else "")  # fmt: skip
    what = f"The device ran out of memory during {phase}."
    if est is not None:
        cap = f"{est.capacity:.1f} GiB available" if est.capacity else "an unknown capacity"
        what += (f" The planner puts '{est.phase}' at {est.device:.1f} GiB on the device against {cap}; "
                 f"{dominant} are the largest class.")  # fmt: skip
        if est.capacity and est.device < est.capacity:
            what += (" That is below the device, so memory the planner does not model (another process, "
                     "fragmentation, user code, a different model than the config names) made the difference.")  # fmt: skip
    if fragmented:
        what += f" The allocator held {reserved - allocated:.3g} GiB reserved but unallocated: fragmentation."
    cap = est.capacity if est else capacity_gib(run)
    return Cause("error", "oom", title, what, evidence=ev, fixes=_oom_fixes(run, phase, dominant, fragmented, cap),
                 unknown=unknown, step=step, where=phase, score=50.0,
                 data={"phase": phase, "memory": mem, "dominant": dominant,
                       "estimate": dataclasses.asdict(est) if est else None})  # fmt: skip


def _num(v: Any) -> float | None:
    try:
        f = to_float(v)
    except (TypeError, ValueError):
        return None
    return f if math.isfinite(f) else None


def _oom_fixes(
    run: RunDir, phase: str | None, dominant: str | None, fragmented: bool, cap: float | None
) -> list[Fix]:
    """Fixes for the dominating class, each checked against the planner where it is a config change."""

    mb = _cfg(run, "algo", "micro_batch_size")
    half = max(1, mb // 2) if isinstance(mb, int) else None
    role = "critic" if phase in ("critic_update", "critic") else "actor"
    fixes = []
    if dominant == "activations" or (dominant is None and phase in ("actor_update", "critic_update")):
        kept = _cfg(run, "precision", "checkpoint_layers")
        ckpt_on = _cfg(run, "precision", "grad_checkpointing")
        if isinstance(ckpt_on, Mapping):  # per role
            ckpt_on = ckpt_on.get(role, False)
        if ckpt_on and isinstance(kept, int) and not isinstance(kept, bool):
            # selective checkpointing kept some layers' activations: checkpoint them all, or let the
            # planner size it for this GPU
            fixes.append(Fix("precision.checkpoint_layers: auto (or unset: every layer)",
                             V.grad_ckpt(role),
                             f"only the first {kept} decoder layers were checkpointed; the rest kept their activations"
                             + _planned_fit(run, {"precision": {"checkpoint_layers": None}}, cap)))  # fmt: skip
        elif not ckpt_on:
            fixes.append(Fix("precision.grad_checkpointing: true", V.grad_ckpt(role),
                             "recompute activations in backward instead of keeping every layer's"
                             + _planned_fit(run, {"precision": {"grad_checkpointing": True}}, cap)))  # fmt: skip
        fixes += [
            Fix(f"algo.micro_batch_size: {half if half else '<half>'}", V.micro_batch(role),
                "activations scale with the micro-batch; gradient accumulation keeps the effective batch"
                + (_planned_fit(run, {"algo": {"micro_batch_size": half}}, cap) if half else "")),
        ]  # fmt: skip
    if dominant in ("optimizer state", "parameters", "gradients"):
        gpus = run_world_size(run) * 2
        fixes += [
            Fix("precision.preset: bf16-pure", V.MODEL_DTYPE_BF16,
                "bf16 parameters and AdamW moments halve the model-state memory (fp32 master copy dropped)"
                + _planned_fit(run, {"precision": {"preset": "bf16-pure"}}, cap)),
            Fix(f"hardware.gpus: {gpus}", f"{V.N_GPUS} (FSDP shards params/grads/optimizer)",
                "sharding divides model state by the number of GPUs" + _planned_fit(run, {}, cap, gpus=gpus)),
            Fix(None, V.OPTIMIZER_OFFLOAD, "offload AdamW state to host "
                "(no verlaudit suite key)"),
        ]  # fmt: skip
        if _uses_reference(run) and _role_policy(run, "reference").get("param_dtype") == "fp32":
            fixes.append(Fix("precision.overrides.reference.param_dtype: bf16",
                             V.REF_PARAM_OFFLOAD, "the frozen reference needs no fp32 copy"))  # fmt: skip
    if phase == "rollout" or dominant == "kv cache + rollout logits":
        fixes += [
            Fix("data.response_length: <shorter>", V.MAX_RESPONSE_LENGTH, "the KV cache grows with sequence length"),
            Fix("algo.batch_size: <smaller>", f"{V.GPU_MEMORY_UTILIZATION} (vLLM/SGLang)",
                "fewer sequences generated at once"),
        ]  # fmt: skip
    if phase == "ref":
        fixes.append(Fix("precision.overrides.reference.param_dtype: bf16", V.REF_LOG_PROB_MICRO_BATCH,
                         "smaller reference forward micro-batches or a bf16 reference"))  # fmt: skip
    if fragmented:
        fixes.append(Fix(None, V.ALLOC_CONF, "reduces fragmentation"))
    if not fixes:
        fixes.append(Fix(f"algo.micro_batch_size: {half or '<half>'}", V.micro_batch(role),
                         "smaller micro-batches"))  # fmt: skip
    return fixes


# --------------------------------------------------------------------------------------------
# rendering and the command


def render_text(d: Diagnosis) -> str:
    lines = [f"{d.source_kind} {d.source}", f"  {d.summary}", f"  verdict: {d.verdict}"]
    if not d.causes:
        lines.append("  no problems found")
    for i, c in enumerate(d.causes, 1):
        lines.append(f"  {i}. [{c.severity}] {c.title}")
        if c.framework or c.phase or c.rank is not None:  # a foreign log's cause: where it sits in the run
            at = [f"culprit: {c.where}" if c.where else None, f"phase: {c.phase}" if c.phase else None,
                  f"rank: {c.rank}" if c.rank is not None else None]  # fmt: skip
            if any(at):
                lines.append("     " + "; ".join(a for a in at if a))
        lines.append(f"     what: {c.what}")
        for e in c.evidence:
            lines.append(f"     - {e}")
        for f in c.fixes:
            parts = [f"suite: {f.suite}" if f.suite else None, f"verl: {f.verl}" if f.verl else None,
                     f"{f.framework}: {f.key}" if f.key else None]  # fmt: skip
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
    if not p.is_dir():
        raise ValueError(f"{p}: a device or a pipe, not a file: neither a log nor a run directory; pass a training "
                         "log (text), a run directory or a suite report directory")  # fmt: skip
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
                top = d.causes[0].title if d.causes and d.verdict != "clean" else "no problems found"
                print(f"  {d.verdict:8s} {d.summary} — {top}")
            print()
        print("\n\n".join(render_text(d) for d in diags))
    return 1 if _overall(diags) == "error" else 0


def _overall(diags: Sequence[Diagnosis]) -> str:
    v = {d.verdict for d in diags}
    return "error" if "error" in v else "warning" if "warning" in v else "clean"
