"""Explains training logs and tracebacks from other frameworks (verl and its forks, TRL / HF Trainer,
OpenRLHF, NeMo-RL, DeepSpeed, accelerate, vLLM, SGLang, Megatron, apex, plain PyTorch) with the same
causes `verlaudit diagnose` gives for its own runs. The thin entry point: a log is read in one pass
with bounded memory whatever its size (`log_lines`; an empty or binary file is refused as neither a
log nor a run directory), each line goes to the rule families of `verlaudit.analysis.logs` (one
streaming scan, bounded facts, one module per family) and to the metric records (verl
``step:N - key:value`` lines, HF Trainer / TRL dicts and JSON records) whose non-finite evidence this
module explains; `explain_error_text` reads the same messages in a run directory's recorded
traceback. Exercised by `pytest tests/test_logparse.py tests/test_log_rules.py tests/test_diagnose.py
-k log` and ``verlaudit diagnose path/to/train.log``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
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
from verlaudit.analysis.logs.exceptions import COMPILE as _COMPILE
from verlaudit.analysis.logs.exceptions import DEVICE as _DEVICE
from verlaudit.analysis.logs.memory import find_oom as _find_oom
from verlaudit.dtypes import DtypeMessage, find_dtype_messages

_COMPILE_HINTS = ("torch._dynamo", "torch._inductor", "BackendCompilerFailed", "InductorError")


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
    return list(_error_causes(text, step=step).values())


def _error_causes(
    text: str, *, step: int | None = None, start: int = 0, end: int | None = None, first_line: int = 1
) -> dict[str, Cause]:
    """The causes of the first error of each kind that starts in ``text[start:end]`` (the rest of
    ``text`` is context: the frames above, the end of a message), keyed by kind; ``first_line`` is
    the log line number of ``text``'s first line."""
    end = len(text) if end is None else end
    causes: dict[str, Cause] = {}

    def line(pos: int) -> int:
        return _lineno(text, pos) + first_line - 1

    for d in find_dtype_messages(text, start):
        slot = d.wording if d.wording in ("numpy", "not_implemented") else "dtype"
        if d.start < end and slot not in causes:
            causes[slot] = _dtype_cause(text, d, line(d.start), step)
    m = _DEVICE.search(text, start) if "to be on the same device" in text else None
    if m and m.start() < end:
        frame = _innermost_frame(text, m.start())
        causes["device"] = Cause(
            "error",
            "device_mismatch",
            "Tensors on different devices",
            "An op mixed tensors on two devices: typically a reward function or collator returned CPU tensors, or "
            "an offloaded model (param_offload) was called without being moved back.",
            evidence=[f"line {line(m.start())}: {_line_of(text, m.start())}"]
            + ([f"raised from {frame}"] if frame else []),
            fixes=[
                Fix(
                    "data.reward_fn: <return tensors on the batch's device or plain floats>",
                    V.REWARD_MANAGER,
                    "the trainer converts lists/floats itself",
                )
            ],
            unknown=[_LOG_UNKNOWN_MODULE],
            step=step,
            score=35.0,
        )
    m = _COMPILE.search(text, start) if any(h in text for h in _COMPILE_HINTS) else None
    if m and m.start() < end:
        causes["compile"] = _compile_cause(text, m, line(m.start()), step)
    oom = _find_oom(text, start, end)
    if oom:
        causes["oom"] = _log_oom_cause(text, oom[1], step)
    return causes


def _dtype_cause(text: str, d: DtypeMessage, line: int, step: int | None) -> Cause:
    """The cause for one recognised dtype message: `.numpy()` of a bf16 tensor, an op without a kernel
    for the dtype, or (every other wording) operands / weights of mixed dtypes."""
    frame = _innermost_frame(text, d.start)
    raised = [f"raised from {frame}"] if frame else []
    if d.wording == "numpy":
        word = d.message.rsplit(" ", 1)[-1]
        return Cause(
            "error",
            "dtype_error",
            f"{word} tensor converted to numpy",
            f"NumPy has no {word}: a `.numpy()` / `np.asarray` on a {d.observed} tensor fails. In RL code this is "
            "usually a reward model or a logging/metrics hook receiving bf16 outputs.",
            evidence=[f"line {line}: {_line_of(text, d.start)}"] + raised,
            fixes=[
                Fix(None, None, "call `.float()` before `.numpy()` (or `.to(torch.float32)`)"),
                Fix(
                    "precision.overrides.reward.compute_dtype: fp32",
                    V.REWARD_MODEL_DTYPE_FP32,
                    "or keep the role whose output is converted in fp32",
                ),
            ],
            unknown=[_LOG_UNKNOWN_MODULE],
            step=step,
            score=35.0,
            data={"observed": d.observed, "expected": d.expected},
        )
    if d.wording == "not_implemented":
        kernel_dtype = d.message.rsplit("'", 2)[-2]
        return Cause(
            "error",
            "dtype_error",
            f"Op {d.op} has no {d.observed} kernel on this device",
            f"'{d.op}' is not implemented for {kernel_dtype} here (typically fp16 matmuls on CPU, or an old GPU without bf16).",
            evidence=[f"line {line}: {_line_of(text, d.start)}"],
            fixes=[
                Fix("precision.preset: fp32", None, "on CPU run fp32 or bf16"),
                Fix("device: cuda", V.DEVICE_CUDA, "fp16 kernels exist on the GPU"),
            ],
            step=step,
            score=35.0,
            data={"observed": d.observed},
        )
    phase = _phase_from_traceback(text)
    return Cause(
        "error",
        "dtype_error",
        f"Dtype error: {d.observed or '?'} where {d.expected or '?'} was expected",
        d.what,
        evidence=[f"line {line}: {d.message}"]
        + raised
        + ([f"phase (from traceback): {phase}"] if phase else []),
        fixes=dtype_fixes(d.observed),
        unknown=[_LOG_UNKNOWN_MODULE],
        step=step,
        score=40.0,
        data={"observed": d.observed, "expected": d.expected},
    )


def _compile_cause(text: str, m: re.Match, line: int, step: int | None) -> Cause:
    """torch.compile (Dynamo tracing or Inductor) failed: name the code it was tracing and turn the
    compiled path off where it failed."""
    user = re.search(r"from user code:\s*\n\s*(File [^\n]+)", text)
    decode = "rollout.py" in text or "_decode_forward" in text
    rollout_fix = Fix(
        "rollout.compile: false", None, "the rollout's compiled decode step (the CUDA graph still applies)"
    )
    layer_fix = Fix("model.compile: false", V.TORCH_COMPILE_OFF, "the compiled training layers")
    return Cause(
        "error",
        "compile_error",
        "torch.compile failed" + (" in the rollout's decode step" if decode else ""),
        "Dynamo could not trace the code (an unsupported call, a graph break under fullgraph) or Inductor could not "
        "compile it. Nothing is wrong with the run's numerics: the eager path runs the same model.",
        evidence=[f"line {line}: {m[0].strip()[:300]}"]
        + ([f"while tracing {user[1].strip()}"] if user else []),
        fixes=[rollout_fix, layer_fix] if decode else [layer_fix, rollout_fix],
        step=step,
        score=35.0,
    )


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
        what += (
            f" A single {tried:.3g} GiB allocation ({tried / total:.0%} of the GPU): usually logits / log-softmax "
            "of a whole batch x sequence x vocab in fp32."
        )
    if "No available memory for the cache blocks" in text or phase == "rollout":
        fixes.append(
            Fix(
                "data.response_length: <shorter>",
                f"{V.GPU_MEMORY_UTILIZATION} (lower if the "
                "trainer shares the GPU; higher if vLLM has no room for KV blocks)",
                "rollout KV cache",
            )
        )
    fixes += [
        Fix("precision.grad_checkpointing: true", V.GRAD_CKPT, "activation memory"),
        Fix(
            "algo.micro_batch_size: <half>",
            f"{V.MICRO_BATCH} (and {V.ROLLOUT_LOG_PROB_MICRO_BATCH} / {V.REF_LOG_PROB_MICRO_BATCH})",
            "smaller micro-batches",
        ),
        Fix(
            "precision.preset: bf16-pure",
            f"{V.MODEL_DTYPE_BF16} (or {V.PARAM_OFFLOAD} / {V.OPTIMIZER_OFFLOAD})",
            "model state memory",
        ),
    ]
    return Cause(
        "error",
        "oom",
        f"CUDA out of memory{f' in {phase}' if phase else ''}",
        what,
        evidence=ev,
        fixes=fixes,
        step=step,
        where=phase,
        score=40.0,
        data=oom,
        unknown=[
            "memory classes: the message gives totals only, not how much is parameters, gradients, "
            "optimizer state or activations; `verlaudit plan` estimates them, a run under verlaudit "
            "measures per phase"
        ],
    )


# ---- per-step logs: verl, HF Trainer / TRL dicts, plain `loss=nan`
_VERL_STEP = re.compile(r"step:(\d+)\s+-\s+(.*)")
_VERL_KV = re.compile(r"([\w./@-]+):\s*([-+]?(?:nan|inf|[\d.]+(?:e[-+]?\d+)?))", re.I)
_PLAIN_NAN = re.compile(r"\b(\w*loss\w*|grad_norm)\s*[=:]\s*(nan|-?inf)\b", re.I)
_NAN_VALUE = re.compile(r"[=:][^\S\n]*-?(?:nan|inf)\b")
"""What every `_PLAIN_NAN` match contains: a fast test before the slow one."""
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
    out: list[dict[str, Any]] = []
    hf = 0
    for ln, line in enumerate(text.splitlines(), 1):
        recs = _line_records(line, ln, hf)
        hf += sum(r["_source"] == "hf" for r in recs)
        out += recs
    return out


def _line_records(line: str, ln: int, hf: int) -> list[dict[str, Any]]:
    """The metric records of log line ``ln``; ``hf`` HF dicts came before it (their steps count on)."""
    if "step:" not in line and "{'" not in line and '{"' not in line:  # most lines: skip the regexes
        return []
    m = _VERL_STEP.search(line)
    if m:
        rec = {"step": int(m[1]), "_line": ln, "_source": "verl"}
        rec.update({k: _f(v) for k, v in _VERL_KV.findall(m[2])})
        return [rec]
    out = []
    for d in _HF_RECORD.finditer(line):
        hf += 1
        rec = {"step": hf, "_line": ln, "_source": "hf"}
        values = ((k, _hf_value(v)) for _, k, v in _HF_KV.findall(d[0]))
        rec.update({k: v for k, v in values if v is not None})
        out.append(rec)
    return out


class _Nonfinite:
    """Non-finite evidence: the first record with a non-finite metric (fed record by record), and
    from blocks of lines the first ``loss=nan`` no record covers, anomaly mode's backward function
    and NaN probabilities in sampling."""

    def __init__(self) -> None:
        self.records = 0
        self.first_bad: tuple[int, dict[str, Any], list[str]] | None = None
        """(ordinal of the record, the record, its non-finite keys)."""
        self.plain: str | None = None
        self.anomaly: tuple[int, str] | None = None
        self.sampling: int | None = None

    def feed(self, records: list[dict[str, Any]]) -> None:
        if self.first_bad is None:
            for i, rec in enumerate(records, self.records):
                bad = [
                    k
                    for k, v in rec.items()
                    if not k.startswith("_") and isinstance(v, float) and not math.isfinite(v)
                ]
                if bad:
                    self.first_bad = (i, rec, bad)
                    break
        self.records += len(records)

    def scan(self, text: str, low: str, first_line: int, covered: set[int]) -> None:
        """Lines ``first_line``... as one ``text`` (``low``: lower-cased); ``covered``: their lines
        that held records (a verl line's `pg_loss:nan` is already its record's evidence)."""
        if self.plain is None and ("loss" in low or "grad_norm" in low):
            for m in _NAN_VALUE.finditer(low):  # a cheap necessary condition, then the whole pattern
                line = _line_of(text, m.start())
                if _lineno(text, m.start()) + first_line - 1 not in covered and _PLAIN_NAN.search(line):
                    self.plain = f"line {_lineno(text, m.start()) + first_line - 1}: log: {line[:160]}"
                    break
        if self.anomaly is None and "returned nan values" in text:
            m = _ANOMALY.search(text)
            if m:
                self.anomaly = (_lineno(text, m.start()) + first_line - 1, m[1])
        if self.sampling is None and "probability tensor contains" in text:
            m = _SAMPLING_NAN.search(text)
            if m:
                self.sampling = _lineno(text, m.start()) + first_line - 1

    def scan_line(self, line: str, ln: int, covered: bool) -> None:
        """One log line (``covered``: it held a metric record)."""
        if "nan" in line or "NaN" in line or "inf" in line or "Inf" in line:
            self.scan(line, line.lower(), ln, {ln} if covered else set())

    def causes(self, ctx: logs.LogContext | None = None) -> list[Cause]:
        ctx = ctx or logs.LogContext(None)
        ev, step, backward_only, where, role, first_line = [], None, False, None, None, None
        if self.first_bad is not None:
            i, rec, bad = self.first_bad
            step, first_line = rec["step"], rec["_line"]
            roles = {k.split("/", 1)[0] for k in bad if "/" in k}
            role = roles.pop() if len(roles) == 1 and all("/" in k for k in bad) else None
            where = role
            ev.append(f"line {rec['_line']}: step {step}: first non-finite metrics {', '.join(bad[:6])}")
            # only the gradient norm, on the first logged step, with a finite loss: made in the backward
            losses = [v for k, v in rec.items() if "loss" in k and isinstance(v, float)]
            backward_only = i == 0 and all("grad_norm" in k for k in bad) and bool(losses)
        if self.plain:
            ev.append(self.plain)
        if self.plain and first_line is None:
            first_line = int(self.plain.split(":", 1)[0].removeprefix("line "))
        if self.anomaly:
            where = self.anomaly[1]
            first_line = first_line or self.anomaly[0]
            ev.append(f"line {self.anomaly[0]}: anomaly mode: backward function {where} produced NaN")
        if self.sampling:
            ev.append(
                f"line {self.sampling}: sampling saw NaN/Inf probabilities: the rollout model's "
                "logits were already non-finite (weights corrupted by an earlier bad update, or fp16 overflow)"
            )
        if not ev:
            return []
        verlish = ctx.framework in (None, "verl")
        if backward_only:
            fx = (
                backward_nan_fixes() if verlish else [Fix(f.suite, None, f.why) for f in backward_nan_fixes()]
            )
            return [Cause("error", "nonfinite", f"NaN gradient norm from the first logged step ({step}) with a finite loss",
                          BACKWARD_NAN_WHAT, evidence=ev, step=step, where=where, score=30.0, fixes=fx,
                          phase="update", line=first_line,
                          unknown=["which op made the NaN: rerun with torch.autograd.set_detect_anomaly(True) for one "
                                   "step, or under `verlaudit run` with audit level full"])]  # fmt: skip
        title = "Non-finite loss / metrics" + (f" from step {step}" if step is not None else "")
        title += f" in the {role}" if role and not self.anomaly else ""
        return [
            Cause("error", "nonfinite", title, "Training values became NaN/Inf.", evidence=ev, step=step,
                  where=where, score=30.0, fixes=_nonfinite_fixes(ctx, role), phase="update", line=first_line,
                  unknown=["the first module that produced the NaN (a log only shows the loss); rerun under "
                           "`verlaudit run` with audit level full for the producer module",
                           "the loss-scale history, unless the framework logged it"])
        ]  # fmt: skip


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


# ---- reading a log: one pass, memory bounded whatever the log's size
MAX_LINE = 16 * 1024
"""Characters kept of one line (the rest of a longer line is skipped: no message is that long)."""
_NOT_A_LOG = "neither a log nor a run directory; pass a training log or traceback (text), or a run directory"


def _binary(head: bytes) -> bool:
    """Whether the first bytes of a file look like anything but text: a NUL byte, or more than a
    tenth of them control characters or invalid UTF-8."""
    if b"\0" in head:
        return True
    control = sum(b < 32 and b not in b"\t\n\r\f\b\x0b\x1b" for b in head)
    invalid = head.decode("utf-8", errors="replace").count("\ufffd")
    return control + invalid > len(head) / 10


def log_lines(path: Path) -> Iterator[str]:
    """The lines of a log file, without their newlines and cut at `MAX_LINE` characters; ValueError
    for a file that cannot be read or is not text (binary)."""
    try:
        with open(path, "rb") as f:
            head = f.read(8192)
        if _binary(head):
            raise ValueError(f"{path}: a binary file: {_NOT_A_LOG}")
        with open(path, encoding="utf-8", errors="replace") as f:
            while line := f.readline(MAX_LINE):
                rest = line
                while not rest.endswith("\n") and rest:  # a cut line: skip the rest of it
                    rest = f.readline(MAX_LINE)
                yield line.rstrip("\n")
    except OSError as e:
        raise ValueError(f"{path}: cannot read the log ({e})") from None


def diagnose_log(path: str | Path) -> Diagnosis:
    """Diagnosis of a foreign training log or traceback file, read in one pass (`log_lines`) whatever
    its size: each line to the metric records and their NaN evidence, and to the rule families of
    `verlaudit.analysis.logs`. ValueError for a file that is empty or not text: neither a log nor a run
    directory."""
    p = Path(path)
    nonfinite, scan = _Nonfinite(), logs.new_scan()
    lines = hf = 0
    last_record: dict[str, Any] | None = None
    blank = True
    for line in log_lines(p):
        lines += 1
        blank = blank and not line.strip()
        records = _line_records(line, lines, hf)
        if records:
            hf += sum(r["_source"] == "hf" for r in records)
            last_record = records[-1]
        nonfinite.feed(records)
        nonfinite.scan_line(line, lines, bool(records))
        scan.feed(lines, line)
    if blank:
        raise ValueError(f"{p}: empty file: {_NOT_A_LOG}")
    causes, ctx = logs.explain(scan.facts())
    found = nonfinite.causes(ctx)
    for c in found:
        c.framework = ctx.framework
    if found:  # a recognised NaN explains the log: no "unrecognised failure" beside it
        causes = [
            c for c in causes if not (c.kind == "exception" and c.title.startswith("Unrecognised failure"))
        ]
    causes = logs.order(causes + found)
    state = "failed" if any(c.severity == "error" for c in causes) else "log"
    last = f", last logged step {last_record['step']}" if last_record else ""
    summary = (
        f"{p.name}: {ctx.framework or 'PyTorch'} log, {lines} lines{last}; {len(causes)} recognised cause(s)"
    )
    return Diagnosis(str(p), "log", p.name, state, summary, causes)
