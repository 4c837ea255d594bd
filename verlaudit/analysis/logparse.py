"""Explains training logs and tracebacks from other frameworks (verl and its forks, TRL / HF Trainer,
OpenRLHF, NeMo-RL, DeepSpeed, accelerate, vLLM, SGLang, Megatron, apex, plain PyTorch) with the same
causes `verlaudit diagnose` gives for its own runs. The thin entry point: the rule families live in
`verlaudit.analysis.logs` (one streaming pass, bounded facts, one module per family); this module adds
the per-step metric records (verl ``step:N - key:value`` lines, HF Trainer / TRL dicts, JSON records)
and the non-finite evidence drawn from them, and `explain_error_text`, the same messages read from a
run directory's recorded traceback. Exercised by `pytest tests/test_logparse.py tests/test_log_rules.py
tests/test_diagnose.py -k log` and ``verlaudit diagnose path/to/train.log``.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

from verlaudit import verl_keys as V
from verlaudit.analysis import logs
from verlaudit.analysis.causes import (
    BACKWARD_NAN_WHAT,
    Cause,
    Diagnosis,
    Fix,
    backward_nan_fixes,
    dtype_fixes,
)
from verlaudit.analysis.logs.exceptions import (
    COMPILE,
    DEVICE,
    NOT_IMPLEMENTED,
    NUMPY_DTYPE,
    parse_dtype_message,
)
from verlaudit.analysis.logs.exceptions import (
    dtype_name as _dt,
)
from verlaudit.analysis.logs.memory import parse_oom

_NUMPY_BF16 = NUMPY_DTYPE
_NOT_IMPL = NOT_IMPLEMENTED
_COMPILE = COMPILE
_DEVICE = DEVICE


def _line_of(text: str, pos: int) -> str:
    start = text.rfind("\n", 0, pos) + 1
    end = text.find("\n", pos)
    return text[start : end if end >= 0 else len(text)].strip()[:400]


def _lineno(text: str, pos: int) -> int:
    return text.count("\n", 0, pos) + 1


# Functions seen in tracebacks -> the phase they belong to (verl workers, TRL trainers, HF generate).
_PHASE_FRAMES = [
    ("rollout", ("generate_sequences", "_generate", "generate(", "in generate", "sample(", "rollout")),
    ("ref", ("compute_ref_log_prob", "ref_model", "_get_per_token_logps")),
    ("critic", ("compute_values",)),
    ("critic_update", ("update_critic",)),
    (
        "actor_update",
        ("update_policy", "update_actor", "compute_log_prob", "training_step", "compute_loss", "backward"),
    ),
]


def _phase_from_traceback(text: str) -> str | None:
    frames = [ln for ln in text.splitlines() if ln.strip().startswith("File ")]
    for frame in reversed(frames):  # the innermost recognised frame wins
        for phase, keys in _PHASE_FRAMES:
            if any(k in frame for k in keys):
                return phase
    return None


def _innermost_frame(text: str, before: int | None = None) -> str | None:
    frames = [ln.strip() for ln in text[:before].splitlines() if ln.strip().startswith("File ")]
    user = [f for f in frames if "site-packages/torch" not in f and "/torch/" not in f]
    return (user or frames or [None])[-1]


_LOG_UNKNOWN_MODULE = (
    "which module: a log has no module tracker; rerun the suite under `verlaudit run` (audit level full)"
)


def explain_error_text(text: str, *, step: int | None = None) -> list[Cause]:
    """Causes for the errors recognised in a traceback / error message (dtype, device, OOM)."""
    causes = []
    d = parse_dtype_message(text)
    if d:
        pos = text.find(d["message"])
        frame = _innermost_frame(text, pos)
        causes.append(Cause(
            "error", "dtype_error", f"Dtype error: {d['observed'] or '?'} where {d['expected'] or '?'} was "
                                    "expected",
            "An op received operands (or input and weights) of different dtypes outside autocast.",
            evidence=[f"line {_lineno(text, pos)}: {d['message']}"] + ([f"raised from {frame}"] if frame else [])
            + ([f"phase (from traceback): {_phase_from_traceback(text)}"] if _phase_from_traceback(text) else []),
            fixes=dtype_fixes(d["observed"]), unknown=[_LOG_UNKNOWN_MODULE], step=step, score=40.0,
            data={"observed": d["observed"], "expected": d["expected"]}))  # fmt: skip
    m = _NUMPY_BF16.search(text)
    if m:
        causes.append(Cause(
            "error", "dtype_error", f"{m[1]} tensor converted to numpy",
            f"NumPy has no {m[1]}: a `.numpy()` / `np.asarray` on a {_dt(m[1])} tensor fails. In RL code "
            "this is "
            "usually a reward model or a logging/metrics hook receiving bf16 outputs.",
            evidence=[f"line {_lineno(text, m.start())}: {_line_of(text, m.start())}"]
            + ([f"raised from {_innermost_frame(text, m.start())}"] if _innermost_frame(text, m.start()) else []),
            fixes=[Fix(None, None, "call `.float()` before `.numpy()` (or `.to(torch.float32)`)"),
                   Fix("precision.overrides.reward.compute_dtype: fp32", V.REWARD_MODEL_DTYPE_FP32,
                       "or keep the role whose output is converted in fp32")],
            unknown=[_LOG_UNKNOWN_MODULE], step=step, score=35.0, data={"observed": _dt(m[1]), "expected": "fp32"}))  # fmt: skip
    m = _NOT_IMPL.search(text)
    if m:
        causes.append(Cause(
            "error", "dtype_error", f"Op {m[1]} has no {_dt(m[2])} kernel on this device",
            f"'{m[1]}' is not implemented for {m[2]} here (typically fp16 matmuls on CPU, or an old GPU "
            "without bf16).",
            evidence=[f"line {_lineno(text, m.start())}: {_line_of(text, m.start())}"],
            fixes=[Fix("precision.preset: fp32", None, "on CPU run fp32 or bf16"),
                   Fix("device: cuda", V.DEVICE_CUDA, "fp16 kernels exist on the GPU")],
            step=step, score=35.0, data={"observed": _dt(m[2])}))  # fmt: skip
    m = _DEVICE.search(text)
    if m:
        causes.append(Cause(
            "error", "device_mismatch", "Tensors on different devices",
            "An op mixed tensors on two devices: typically a reward function or collator returned CPU "
            "tensors, or "
            "an offloaded model (param_offload) was called without being moved back.",
            evidence=[f"line {_lineno(text, m.start())}: {_line_of(text, m.start())}"]
            + ([f"raised from {_innermost_frame(text, m.start())}"] if _innermost_frame(text, m.start()) else []),
            fixes=[Fix("data.reward_fn: <return tensors on the batch's device or plain floats>", V.REWARD_MANAGER,
                       "the trainer converts lists/floats itself")],
            unknown=[_LOG_UNKNOWN_MODULE], step=step, score=35.0))  # fmt: skip
    m = _COMPILE.search(text)
    if m:
        causes.append(_compile_cause(text, m, step))
    oom = parse_oom(text)
    if oom:
        causes.append(_log_oom_cause(text, oom, step))
    return causes


def _compile_cause(text: str, m: re.Match, step: int | None) -> Cause:
    """torch.compile (Dynamo tracing or Inductor) failed: name the code it was tracing and turn the
    compiled path off where it failed."""
    user = re.search(r"from user code:\s*\n\s*(File [^\n]+)", text)
    decode = "rollout.py" in text or "_decode_forward" in text
    rollout_fix = Fix(
        "rollout.compile: false", None, "the rollout's compiled decode step (the CUDA graph still applies)"
    )
    layer_fix = Fix("model.compile: false", V.TORCH_COMPILE_OFF, "the compiled training layers")
    return Cause(
        "error", "compile_error", "torch.compile failed" + (" in the rollout's decode step" if decode else ""),
        "Dynamo could not trace the code (an unsupported call, a graph break under fullgraph) or Inductor "
        "could not "
        "compile it. Nothing is wrong with the run's numerics: the eager path runs the same model.",
        evidence=[f"line {_lineno(text, m.start())}: {m[0].strip()[:300]}"]
        + ([f"while tracing {user[1].strip()}"] if user else []),
        fixes=[rollout_fix, layer_fix] if decode else [layer_fix, rollout_fix],
        step=step, score=35.0,
    )  # fmt: skip


def _log_oom_cause(text: str, oom: dict[str, Any], step: int | None) -> Cause:
    phase = _phase_from_traceback(text)
    ev = [oom["message"]]
    nums = {k: v for k, v in oom.items() if k.endswith("_gib")}
    if nums:
        ev.append("device view: " + ", ".join(f"{k[:-4]} {v:.3g} GiB" for k, v in nums.items()))
    if phase:
        ev.append(f"phase (from traceback): {phase}")
    what = "The GPU ran out of memory."
    fixes = []
    frag = oom.get("reserved_unallocated_gib")
    alloc = oom.get("allocated_gib")
    if frag is not None and alloc is not None and frag > 0.2 * max(alloc, 1e-9):
        what += (
            f" {frag:.3g} GiB was reserved but unallocated: fragmentation made it fail earlier than needed."
        )
        fixes.append(
            Fix(
                None,
                V.ALLOC_CONF,
                "lets the allocator grow segments",
            )
        )
    tried, total = oom.get("tried_gib"), oom.get("total_gib")
    if tried and total and tried > 0.1 * total:
        what += (f" A single {tried:.3g} GiB allocation ({tried / total:.0%} of the GPU): usually logits / "
                 "log-softmax "
                 "of a whole batch x sequence x vocab in fp32.")  # fmt: skip
    if "No available memory for the cache blocks" in text or phase == "rollout":
        fixes.append(Fix("data.response_length: <shorter>", f"{V.GPU_MEMORY_UTILIZATION} (lower if the "
                         "trainer shares the GPU; higher if vLLM has no room for KV blocks)", "rollout KV cache"))  # fmt: skip
    fixes += [
        Fix("precision.grad_checkpointing: true", V.GRAD_CKPT,
            "activation memory"),
        Fix("algo.micro_batch_size: <half>", f"{V.MICRO_BATCH} "
            f"(and {V.ROLLOUT_LOG_PROB_MICRO_BATCH} / {V.REF_LOG_PROB_MICRO_BATCH})", "smaller "
                                                                                      "micro-batches"),
        Fix("precision.preset: bf16-pure", f"{V.MODEL_DTYPE_BF16} "
            f"(or {V.PARAM_OFFLOAD} / {V.OPTIMIZER_OFFLOAD})", "model state memory"),
    ]  # fmt: skip
    return Cause("error", "oom", f"CUDA out of memory{f' in {phase}' if phase else ''}", what, evidence=ev,
                 fixes=fixes, step=step, where=phase, score=40.0, data=oom,
                 unknown=["memory classes: the message gives totals only, not how much is parameters, "
                          "gradients, "
                          "optimizer state or activations; `verlaudit plan` estimates them, a run under "
                          "verlaudit "
                          "measures per phase"])  # fmt: skip


# ---- per-step logs: verl, HF Trainer / TRL dicts, plain `loss=nan`
_VERL_STEP = re.compile(r"step:(\d+)\s+-\s+(.*)")
_VERL_KV = re.compile(r"([\w./@-]+):\s*([-+]?(?:nan|inf|[\d.]+(?:e[-+]?\d+)?))", re.I)
_PLAIN_NAN = re.compile(r"\b(\w*loss\w*|grad_norm)\s*[=:]\s*(nan|-?inf)\b", re.I)
_ANOMALY = re.compile(r"Function '(\w+)' returned nan values in its (\d+)(?:th|st|nd|rd) output")
_SAMPLING_NAN = re.compile(r"probability tensor contains either `inf`, `nan` or element < 0")


def _f(x: str) -> float:
    try:
        return float(x)
    except ValueError:
        return math.nan


# An HF Trainer / TRL log dict anywhere in a line (after a tqdm bar or a logger prefix, before a bar's
# tail), or cut off at the line's end when the process died mid-print.
_HF_RECORD = re.compile(r"\{(['\"])(?:loss|train_loss)\1:[^{}]*(?:\}|$)")
_HF_KV = re.compile(r"(['\"])([\w/.@()-]+)\1:\s*['\"]?([^'\",}]+)['\"]?")


def _hf_value(text: str) -> float | None:
    """A dict value as a float; None for what is not a number (not evidence of a NaN)."""
    v = text.strip()
    if v.startswith("tensor("):  # older Trainers logged tensors: `tensor(nan, device='cuda:0')`
        v = v[len("tensor(") :]
    try:
        return float(v)
    except ValueError:
        return None


def parse_metric_lines(text: str) -> list[dict[str, Any]]:
    """Metric records (like metrics.jsonl) from verl ``step:N - key:value - ...`` console lines and
    from HF Trainer / TRL log dicts (``{'loss': '0.69', 'grad_norm': 'nan', ...}``, values quoted or
    not; anywhere in a line, or cut off at its end). HF dicts carry no step: their step is the record's
    ordinal, and ``_source`` says which. A value that is not a number is left out."""
    out = []
    hf = 0
    for ln, line in enumerate(text.splitlines(), 1):
        m = _VERL_STEP.search(line)
        if m:
            rec = {"step": int(m[1]), "_line": ln, "_source": "verl"}
            rec.update({k: _f(v) for k, v in _VERL_KV.findall(m[2])})
            out.append(rec)
        else:
            for d in _HF_RECORD.finditer(line):
                hf += 1
                rec = {"step": hf, "_line": ln, "_source": "hf"}
                values = ((k, _hf_value(v)) for _, k, v in _HF_KV.findall(d[0]))
                rec.update({k: v for k, v in values if v is not None})
                out.append(rec)
    return out


def _nonfinite_log_causes(
    text: str, records: list[dict[str, Any]], ctx: logs.LogContext | None = None
) -> list[Cause]:
    ctx = ctx or logs.LogContext(None)
    ev, step, backward_only, role, first_line = [], None, False, None, None
    for i, rec in enumerate(records):
        bad = [
            k
            for k, v in rec.items()
            if not k.startswith("_") and isinstance(v, float) and not math.isfinite(v)
        ]
        if bad:
            step, first_line = rec["step"], rec["_line"]
            ev.append(f"line {rec['_line']}: step {step}: first non-finite metrics {', '.join(bad[:6])}")
            # only the gradient norm, on the first logged step, with a finite loss: made in the backward
            losses = [v for k, v in rec.items() if "loss" in k and isinstance(v, float)]
            backward_only = i == 0 and all("grad_norm" in k for k in bad) and bool(losses)
            roles = {k.split("/", 1)[0] for k in bad if "/" in k}
            role = roles.pop() if len(roles) == 1 and len(bad) == sum("/" in k for k in bad) else None
            break
    # `loss=nan` in lines no record covers (a verl line's `pg_loss:nan` is already the record's evidence)
    covered = {rec["_line"] for rec in records}
    for m in _PLAIN_NAN.finditer(text):
        line = _lineno(text, m.start())
        if line not in covered:
            ev.append(f"line {line}: log: {_line_of(text, m.start())[:160]}")
            first_line = first_line or line
            break
    anomaly = _ANOMALY.search(text)
    where = role
    if anomaly:
        where = anomaly[1]
        first_line = first_line or _lineno(text, anomaly.start())
        ev.append(
            f"line {_lineno(text, anomaly.start())}: anomaly mode: backward function {anomaly[1]} produced "
            "NaN"
        )
    samp = _SAMPLING_NAN.search(text)
    if samp:
        first_line = first_line or _lineno(text, samp.start())
        ev.append(f"line {_lineno(text, samp.start())}: sampling saw NaN/Inf probabilities: the rollout "
                  "model's "
                  "logits were already non-finite (weights corrupted by an earlier bad update, or fp16 "
                  "overflow)")  # fmt: skip
    if not ev:
        return []
    verlish = ctx.framework in (None, "verl")
    if backward_only:
        fx = backward_nan_fixes() if verlish else [Fix(f.suite, None, f.why) for f in backward_nan_fixes()]
        return [Cause("error", "nonfinite", f"NaN gradient norm from the first logged step ({step}) with a "
                                            "finite loss",
                      BACKWARD_NAN_WHAT, evidence=ev, step=step, where=where, score=30.0, fixes=fx,
                      phase="update", line=first_line,
                      unknown=["which op made the NaN: rerun with torch.autograd.set_detect_anomaly(True) "
                               "for one "
                               "step, or under `verlaudit run` with audit level full"])]  # fmt: skip
    fx = _nonfinite_fixes(ctx, role)
    title = "Non-finite loss / metrics" + (f" from step {step}" if step is not None else "")
    title += f" in the {role}" if role and not anomaly else ""
    return [
        Cause(
            "error",
            "nonfinite",
            title,
            "Training values became NaN/Inf.",
            evidence=ev,
            step=step,
            where=where,
            score=30.0,
            fixes=fx,
            phase="update",
            line=first_line,
            unknown=[
                "the first module that produced the NaN (a log only shows the loss); rerun under "
                "`verlaudit run` with audit level full for the producer module",
                "the loss-scale history, unless the framework logged it",
            ],
        )
    ]


def _nonfinite_fixes(ctx: logs.LogContext, role: str | None) -> list[Fix]:
    """What to try for NaN/Inf metrics, in the log's framework (the critic's own keys for a verl critic)."""
    if role == "critic" and ctx.framework == "verl":  # the critic has its own optimiser and clipping
        return logs.frameworks.fixes(
            ctx,
            None
            if logs.frameworks.applied("bf16_instead_of_fp16", ctx)
            else Fix(
                "precision.preset: bf16",
                V.param_dtype("critic", "bf16"),
                "if the run is fp16: bf16 does not overflow",
            ),
            Fix("algo.lr: <lower>", V.lr("critic"), "if the value loss diverged first"),
            Fix("algo.max_grad_norm: 1.0", V.grad_clip("critic"), "clip the critic's gradients"),
        )
    return logs.frameworks.fixes(
        ctx,
        ("bf16_instead_of_fp16", "if the run is fp16: bf16 does not overflow", "precision.preset: bf16"),
        ("lr", "if the loss diverged first", "algo.lr: <lower>"),
        ("grad_clip", "clip gradients", "algo.max_grad_norm: 1.0"),
    )


def diagnose_log(path: str | Path) -> Diagnosis:
    """Diagnosis of a foreign training log or traceback file: the rule families of
    `verlaudit.analysis.logs` fed line by line, plus the metric records' non-finite evidence."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8", errors="replace")
    except OSError as e:
        raise ValueError(f"{p}: cannot read the log ({e})") from None
    records = parse_metric_lines(text)
    scan = logs.new_scan()
    n = 0
    for n, line in enumerate(text.splitlines(), 1):
        scan.feed(n, line)
    causes, ctx = logs.explain(scan.facts())
    nonfinite = _nonfinite_log_causes(text, records, ctx)
    for c in nonfinite:
        c.framework = ctx.framework
    causes = logs.order(_without_unrecognised(causes) + nonfinite if nonfinite else causes)
    state = "failed" if any(c.severity == "error" for c in causes) else "log"
    last = f", last logged step {records[-1]['step']}" if records else ""
    summary = (
        f"{p.name}: {ctx.framework or 'PyTorch'} log, {n} lines{last}; {len(causes)} recognised cause(s)"
    )
    return Diagnosis(str(p), "log", p.name, state, summary, causes)


def _without_unrecognised(causes: list[Cause]) -> list[Cause]:
    """The causes without the unrecognised-failure fallback (a recognised NaN explains the log)."""
    return [c for c in causes if not (c.kind == "exception" and c.title.startswith("Unrecognised failure"))]
