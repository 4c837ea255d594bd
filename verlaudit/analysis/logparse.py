"""Explains training logs and tracebacks from other frameworks (verl, TRL / HF Trainer, DeepSpeed,
Megatron, apex, plain PyTorch) with the same causes `verlaudit diagnose` gives for its own runs.

Recognised: dtype errors (every wording in `verlaudit.dtypes.WORDINGS`, the table the live auditor
uses too: ``expected scalar type X but found Y``, ``expected m1 and m2 to have the same dtype``, SDPA
query/key/value dtypes, ``.numpy()`` of a bf16 tensor, ``"op" not implemented for 'Half'``...), device mismatches,
CUDA OOM messages (both the PyTorch >= 2.1 wording and the older one) and vLLM KV-cache OOM,
NaN/Inf losses (verl ``step:N - key:value`` lines, HF ``{'loss': nan}`` dicts, plain ``loss=nan``,
anomaly-mode backward functions, ``probability tensor contains inf/nan``), fp16 overflow skips
(apex / DeepSpeed / Megatron) and the DeepSpeed minimum-loss-scale abort. Every cause says what a log
alone cannot tell (which module produced the NaN, how memory split into parameters / gradients /
optimizer / activations). A log is read in one pass with bounded memory whatever its size (per line
for metric records; in blocks of about a MiB, with context lines around them, for messages), and a
file that is empty or binary is refused as neither a log nor a run directory. Exercised by
`pytest tests/test_logparse.py tests/test_diagnose.py -k log` and ``verlaudit diagnose path/to/train.log``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
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
from verlaudit.dtypes import DtypeMessage, find_dtype_messages

_COMPILE = re.compile(
    r"torch\._dynamo\.exc\.\w+[^\n]*|torch\._inductor\.exc\.\w+[^\n]*|BackendCompilerFailed[^\n]*|InductorError[^\n]*"
)
_COMPILE_HINTS = ("torch._dynamo", "torch._inductor", "BackendCompilerFailed", "InductorError")
_DEVICE = re.compile(
    r"Expected all tensors to be on the same device, but (?:found at least two devices, )?(.*)"
)


_UNIT = {"b": 1 / 1024**3, "bytes": 1 / 1024**3, "kib": 1 / 1024**2, "mib": 1 / 1024, "gib": 1.0}
_N = r"([\d.]+) ?(GiB|MiB|KiB|bytes|B)"
_OOM_NEW = re.compile(
    rf"Tried to allocate {_N}\. GPU (\d+) has a total capac(?:i)?ty of {_N} of which {_N} (?:is )?free\."
    rf"(?:.*?this process has {_N} memory in use\.)?(?:.*?Of the allocated memory {_N} is allocated by PyTorch, "
    rf"and {_N} is reserved by PyTorch but unallocated)?",
    re.S,
)
_OOM_OLD = re.compile(
    rf"Tried to allocate {_N} \(GPU (\d+); {_N} total capacity; {_N} already allocated; {_N} free; "
    rf"{_N} reserved in total by PyTorch\)"
)
_OOM_HINTS = ("out of memory", "OutOfMemoryError", "No available memory", "Tried to allocate")
_OOM_ANY = re.compile(
    r"CUDA out of memory|OutOfMemoryError|CUDA error: out of memory|No available memory for the cache blocks"
)


def _gib(num: str | None, unit: str | None) -> float | None:
    return None if num is None else float(num) * _UNIT[str(unit).lower()]


def parse_oom(text: str) -> dict[str, Any] | None:
    """Numbers of the first CUDA OOM message, in GiB (keys absent when the message lacks them)."""
    found = _find_oom(text)
    return found[1] if found else None


def _find_oom(text: str, pos: int = 0, end: int | None = None) -> tuple[int, dict[str, Any]] | None:
    """(where, numbers) of the first OOM message starting in ``text[pos:end]``; a detailed message
    (either PyTorch wording) wins over a bare "out of memory" line."""
    end = len(text) if end is None else end
    if not any(h in text for h in _OOM_HINTS):  # cheap test first: a long log is searched block by block
        return None
    m = _OOM_NEW.search(text, pos)
    if m and m.start() < end:
        g = m.groups()
        return m.start(), {k: v for k, v in {
            "tried_gib": _gib(g[0], g[1]), "gpu": int(g[2]), "total_gib": _gib(g[3], g[4]), "free_gib": _gib(g[5], g[6]),
            "process_in_use_gib": _gib(g[7], g[8]), "allocated_gib": _gib(g[9], g[10]),
            "reserved_unallocated_gib": _gib(g[11], g[12]), "message": m[0][:400]}.items() if v is not None}  # fmt: skip
    m = _OOM_OLD.search(text, pos)
    if m and m.start() < end:
        g = m.groups()
        alloc, reserved = _gib(g[5], g[6]), _gib(g[9], g[10])
        return m.start(), {"tried_gib": _gib(g[0], g[1]), "gpu": int(g[2]), "total_gib": _gib(g[3], g[4]),
                           "allocated_gib": alloc, "free_gib": _gib(g[7], g[8]),
                           "reserved_unallocated_gib": reserved - alloc, "message": m[0]}  # fmt: skip
    m = _OOM_ANY.search(text, pos)
    return (m.start(), {"message": _line_of(text, m.start())}) if m and m.start() < end else None


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
            "error", "device_mismatch", "Tensors on different devices",
            "An op mixed tensors on two devices: typically a reward function or collator returned CPU tensors, or "
            "an offloaded model (param_offload) was called without being moved back.",
            evidence=[f"line {line(m.start())}: {_line_of(text, m.start())}"] + ([f"raised from {frame}"] if frame else []),
            fixes=[Fix("data.reward_fn: <return tensors on the batch's device or plain floats>", V.REWARD_MANAGER,
                       "the trainer converts lists/floats itself")],
            unknown=[_LOG_UNKNOWN_MODULE], step=step, score=35.0)  # fmt: skip
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
            "error", "dtype_error", f"{word} tensor converted to numpy",
            f"NumPy has no {word}: a `.numpy()` / `np.asarray` on a {d.observed} tensor fails. In RL code this is "
            "usually a reward model or a logging/metrics hook receiving bf16 outputs.",
            evidence=[f"line {line}: {_line_of(text, d.start)}"] + raised,
            fixes=[Fix(None, None, "call `.float()` before `.numpy()` (or `.to(torch.float32)`)"),
                   Fix("precision.overrides.reward.compute_dtype: fp32", V.REWARD_MODEL_DTYPE_FP32,
                       "or keep the role whose output is converted in fp32")],
            unknown=[_LOG_UNKNOWN_MODULE], step=step, score=35.0, data={"observed": d.observed, "expected": d.expected})  # fmt: skip
    if d.wording == "not_implemented":
        kernel_dtype = d.message.rsplit("'", 2)[-2]
        return Cause(
            "error", "dtype_error", f"Op {d.op} has no {d.observed} kernel on this device",
            f"'{d.op}' is not implemented for {kernel_dtype} here (typically fp16 matmuls on CPU, or an old GPU without bf16).",
            evidence=[f"line {line}: {_line_of(text, d.start)}"],
            fixes=[Fix("precision.preset: fp32", None, "on CPU run fp32 or bf16"),
                   Fix("device: cuda", V.DEVICE_CUDA, "fp16 kernels exist on the GPU")],
            step=step, score=35.0, data={"observed": d.observed})  # fmt: skip
    phase = _phase_from_traceback(text)
    return Cause(
        "error", "dtype_error", f"Dtype error: {d.observed or '?'} where {d.expected or '?'} was expected", d.what,
        evidence=[f"line {line}: {d.message}"] + raised + ([f"phase (from traceback): {phase}"] if phase else []),
        fixes=dtype_fixes(d.observed), unknown=[_LOG_UNKNOWN_MODULE], step=step, score=40.0,
        data={"observed": d.observed, "expected": d.expected})  # fmt: skip


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
        "error", "compile_error", "torch.compile failed" + (" in the rollout's decode step" if decode else ""),
        "Dynamo could not trace the code (an unsupported call, a graph break under fullgraph) or Inductor could not "
        "compile it. Nothing is wrong with the run's numerics: the eager path runs the same model.",
        evidence=[f"line {line}: {m[0].strip()[:300]}"]
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
        what += (f" A single {tried:.3g} GiB allocation ({tried / total:.0%} of the GPU): usually logits / log-softmax "
                 "of a whole batch x sequence x vocab in fp32.")  # fmt: skip
    if "No available memory for the cache blocks" in text or phase == "rollout":
        fixes.append(Fix("data.response_length: <shorter>", f"{V.GPU_MEMORY_UTILIZATION} (lower if the "
                         "trainer shares the GPU; higher if vLLM has no room for KV blocks)", "rollout KV cache"))  # fmt: skip
    fixes += [
        Fix("precision.grad_checkpointing: true", V.GRAD_CKPT,
            "activation memory"),
        Fix("algo.micro_batch_size: <half>", f"{V.MICRO_BATCH} "
            f"(and {V.ROLLOUT_LOG_PROB_MICRO_BATCH} / {V.REF_LOG_PROB_MICRO_BATCH})", "smaller micro-batches"),
        Fix("precision.preset: bf16-pure", f"{V.MODEL_DTYPE_BF16} "
            f"(or {V.PARAM_OFFLOAD} / {V.OPTIMIZER_OFFLOAD})", "model state memory"),
    ]  # fmt: skip
    return Cause("error", "oom", f"CUDA out of memory{f' in {phase}' if phase else ''}", what, evidence=ev,
                 fixes=fixes, step=step, where=phase, score=40.0, data=oom,
                 unknown=["memory classes: the message gives totals only, not how much is parameters, gradients, "
                          "optimizer state or activations; `verlaudit plan` estimates them, a run under verlaudit "
                          "measures per phase"])  # fmt: skip


# ---- per-step logs: verl, HF Trainer / TRL dicts, plain `loss=nan`
_VERL_STEP = re.compile(r"step:(\d+)\s+-\s+(.*)")
_VERL_KV = re.compile(r"([\w./@-]+):\s*([-+]?(?:nan|inf|[\d.]+(?:e[-+]?\d+)?))", re.I)
_PLAIN_NAN = re.compile(r"\b(\w*loss\w*|grad_norm)\s*[=:]\s*(nan|-?inf)\b", re.I)
_NAN_VALUE = re.compile(r"[=:][^\S\n]*-?(?:nan|inf)\b")
"""What every `_PLAIN_NAN` match contains: a fast test before the slow one."""
_ANOMALY = re.compile(r"Function '(\w+)' returned nan values in its (\d+)(?:th|st|nd|rd) output")
_SAMPLING_NAN = re.compile(r"probability tensor contains either `inf`, `nan` or element < 0")
_APEX = re.compile(
    r"Gradient overflow\.[ \t]+Skipping step, loss scaler \d+ reducing loss scale to ([\d.e+-]+)"
)
_DS = re.compile(
    r"OVERFLOW! Rank (\d+) Skipping step\. Attempted loss scale: ([\d.e+]+), reducing to ([\d.e+]+)"
)
_DS_MIN = re.compile(r"Current loss scale already at minimum - cannot decrease scale anymore")
_MEGATRON = re.compile(r"number of skipped iterations:\s*(\d+)")


def _f(x: str) -> float:
    try:
        return float(x)
    except ValueError:
        return math.nan


# An HF Trainer / TRL log dict anywhere in a line (after a tqdm bar or a logger prefix, before a bar's
# tail), or cut off at the line's end when the process died mid-print.
_HF_RECORD = re.compile(r"\{'(?:loss|train_loss)':[^{}]*(?:\}|$)")
_HF_KV = re.compile(r"'([\w/.@-]+)':\s*'?([^',}]+)'?")


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
    if "step:" not in line and "{'" not in line:  # most lines of a long log: skip the regexes
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
        values = ((k, _hf_value(v)) for k, v in _HF_KV.findall(d[0]))
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
                bad = [k for k, v in rec.items()
                       if not k.startswith("_") and isinstance(v, float) and not math.isfinite(v)]  # fmt: skip
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

    def causes(self) -> list[Cause]:
        ev, step, backward_only, where = [], None, False, None
        if self.first_bad is not None:
            i, rec, bad = self.first_bad
            step = rec["step"]
            ev.append(f"line {rec['_line']}: step {step}: first non-finite metrics {', '.join(bad[:6])}")
            # only the gradient norm, on the first logged step, with a finite loss: made in the backward
            losses = [v for k, v in rec.items() if "loss" in k and isinstance(v, float)]
            backward_only = i == 0 and all("grad_norm" in k for k in bad) and bool(losses)
        if self.plain:
            ev.append(self.plain)
        if self.anomaly:
            where = self.anomaly[1]
            ev.append(f"line {self.anomaly[0]}: anomaly mode: backward function {where} produced NaN")
        if self.sampling:
            ev.append(f"line {self.sampling}: sampling saw NaN/Inf probabilities: the rollout model's "
                      "logits were already non-finite (weights corrupted by an earlier bad update, or fp16 overflow)")  # fmt: skip
        if not ev:
            return []
        if backward_only:
            return [Cause("error", "nonfinite", f"NaN gradient norm from the first logged step ({step}) with a finite loss",
                          BACKWARD_NAN_WHAT, evidence=ev, step=step, where=where, score=30.0,
                          fixes=backward_nan_fixes(),
                          unknown=["which op made the NaN: rerun with torch.autograd.set_detect_anomaly(True) for one "
                                   "step, or under `verlaudit run` with audit level full"])]  # fmt: skip
        return [Cause("error", "nonfinite", "Non-finite loss / metrics" + (f" from step {step}" if step is not None else ""),
                      "Training values became NaN/Inf.", evidence=ev, step=step, where=where, score=30.0,
                      fixes=[Fix("precision.preset: bf16", V.PARAM_DTYPE_BF16,
                                 "if the run is fp16: bf16 does not overflow"),
                             Fix("algo.lr: <lower>", V.LR, "if the loss diverged first"),
                             Fix("algo.max_grad_norm: 1.0", V.GRAD_CLIP, "clip gradients")],
                      unknown=["the first module that produced the NaN (a log only shows the loss); rerun under "
                               "`verlaudit run` with audit level full for the producer module",
                               "the loss-scale history, unless the framework logged it"])]  # fmt: skip


class _Overflows:
    """fp16 overflow skips (apex, DeepSpeed, Megatron), from blocks of lines: their count, the first
    and the last loss scale, DeepSpeed's minimum-scale abort."""

    def __init__(self) -> None:
        self.count = 0
        self.first: tuple[int, float | None, float] | None = None
        """(line, attempted scale or None, new scale) of the first skip."""
        self.last_scale = math.nan
        self.ds_min: tuple[int, str] | None = None
        self.megatron: int | None = None
        """The most skipped iterations one Megatron logging interval reported."""

    def scan(self, text: str, first_line: int) -> None:
        """Lines ``first_line``... as one ``text``."""
        if "Skipping step" in text:
            hits = [(m.start(), None, _f(m[1])) for m in _APEX.finditer(text)]
            hits += [(m.start(), _f(m[2]), _f(m[3])) for m in _DS.finditer(text)]
            for pos, attempted, scale in sorted(hits, key=lambda h: h[0]):
                if self.first is None:
                    self.first = (_lineno(text, pos) + first_line - 1, attempted, scale)
                self.count += 1
                self.last_scale = scale
        if self.ds_min is None and "already at minimum" in text:
            m = _DS_MIN.search(text)
            if m:
                self.ds_min = (_lineno(text, m.start()) + first_line - 1, m[0])
        if "skipped iterations" in text:
            for m in _MEGATRON.finditer(text):
                self.megatron = max(self.megatron or 0, int(m[1]))

    def causes(self) -> list[Cause]:
        if not self.count and not self.ds_min and not self.megatron:
            return []
        ev = []
        if self.first is not None:
            ln, attempted, scale = self.first
            ev.append(f"{self.count} overflow skips, first at line {ln}; loss scale went "
                      f"{_fmt_scale(attempted or scale * 2)} -> {_fmt_scale(self.last_scale)}")  # fmt: skip
        if self.megatron is not None:
            ev.append(f"Megatron: up to {self.megatron} skipped iterations per logging interval")
        collapse = bool(self.ds_min) or (self.count and self.last_scale <= 1.0) or self.count >= 20
        if self.ds_min:
            ev.append(f"line {self.ds_min[0]}: {self.ds_min[1]}")
        fixes = [Fix("precision.preset: bf16", "bf16 in the framework's config (DeepSpeed: bf16.enabled=true, fp16.enabled=false)",
                     "bf16 has fp32's exponent range: no loss scaling, no overflow skips")]  # fmt: skip
        if collapse:
            return [Cause("error", "loss_scale_collapse", "fp16 loss-scale collapse",
                          "The loss scale was driven to its floor by repeated overflows: values overflow fp16 even "
                          "unscaled, so the optimizer keeps skipping.", evidence=ev, fixes=fixes, score=30.0,
                          unknown=["which module overflows (a log has no per-module absmax); rerun under verlaudit"])]  # fmt: skip
        return [Cause("info" if self.count <= 10 else "warning", "overflow_skips", f"{self.count} fp16 overflow skips",
                      "Dynamic loss scaling found its level by skipping steps; occasional skips are normal.",
                      evidence=ev, fixes=fixes if self.count > 10 else [])]  # fmt: skip


def _fmt_scale(v: float) -> str:
    return f"{v:g}"


# ---- reading a log: one pass, memory bounded whatever the log's size
MAX_LINE = 16 * 1024
"""Characters kept of one line (the rest of a longer line is skipped: no message is that long)."""
BLOCK = 1 << 20
"""Characters of new lines searched for error messages at a time."""
CONTEXT = 400
"""Lines kept before a block (the frames above an error) and held back at its end until the next
block (a message that goes on over several lines), so every message is searched whole."""
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


class _Blocks:
    """The lines of a log gathered into blocks of about `BLOCK` characters. Per block: NaN and
    overflow evidence (`_Nonfinite.scan`, `_Overflows.scan`), what the log says as a whole (the
    framework that wrote it, a traceback, its frames), and the error messages (dtype, device, OOM,
    compile), searched with `CONTEXT` lines on both sides; the first cause of each kind is kept.
    Holds at most a block and 2 x CONTEXT lines."""

    def __init__(self, nonfinite: _Nonfinite, overflows: _Overflows) -> None:
        self.nonfinite, self.overflows = nonfinite, overflows
        self.buffer: list[str] = []
        self.first_line = 1
        """Log line number of buffer[0]."""
        self.settled = 0
        """Error messages starting on lines up to this log line number have been searched for."""
        self.pending = self.pending_chars = 0
        self.covered: set[int] = set()
        """Lines of the pending block that held metric records."""
        self.causes: dict[str, Cause] = {}
        self.seen = {"verl": False, "deepspeed": False, "hf": False, "traceback": False}
        self.frames: list[str | None] = [None, None]
        """The last traceback frame line, and the last one outside torch."""

    def feed(self, line: str, ln: int, records: bool) -> None:
        self.buffer.append(line)
        if records:
            self.covered.add(ln)
        self.pending += 1
        self.pending_chars += len(line) + 1
        if self.pending_chars >= BLOCK:
            self.flush(final=False)

    def flush(self, *, final: bool) -> None:
        last = self.first_line + len(self.buffer) - 1
        new = "\n".join(self.buffer[len(self.buffer) - self.pending :])
        low = new.lower()
        self.nonfinite.scan(new, low, last - self.pending + 1, self.covered)
        self.overflows.scan(new, last - self.pending + 1)
        self._note(new, low)
        self.pending = self.pending_chars = 0
        self.covered.clear()
        upto = last if final else last - CONTEXT
        if upto <= self.settled:
            return
        offsets = [0]  # char offset of each buffered line in the joined text
        for ln in self.buffer:
            offsets.append(offsets[-1] + len(ln) + 1)
        text = "\n".join(self.buffer)
        start, end = offsets[self.settled + 1 - self.first_line], offsets[upto + 1 - self.first_line]
        for kind, cause in _error_causes(text, start=start, end=end, first_line=self.first_line).items():
            self.causes.setdefault(kind, cause)
        self.settled = upto
        drop = max(
            0, upto - CONTEXT - self.first_line + 1
        )  # keep CONTEXT lines before the next unsearched one
        del self.buffer[:drop]
        self.first_line += drop

    def _note(self, text: str, low: str) -> None:
        seen = self.seen
        seen["verl"] |= V.ACTOR_ROLLOUT_REF in text or "/verl/" in text
        seen["deepspeed"] |= "deepspeed" in low
        seen["hf"] |= "{'loss'" in text or "trl" in low
        seen["traceback"] |= "Traceback (most recent call last)" in text
        if "File " in text:
            for m in _FRAME.finditer(text):
                frame = m[1].rstrip()
                self.frames[0] = frame
                if "site-packages/torch" not in frame and "/torch/" not in frame:
                    self.frames[1] = frame


_FRAME = re.compile(r"^[ \t]*(File [^\n]*)", re.M)


def diagnose_log(path: str | Path) -> Diagnosis:
    """Diagnosis of a foreign training log or traceback file, read in one pass (`log_lines`) whatever
    its size: per line for metric records, NaN and overflow lines; in blocks with context for error
    messages. ValueError for a file that is empty or not text: neither a log nor a run directory."""
    p = Path(path)
    nonfinite, overflows = _Nonfinite(), _Overflows()
    blocks = _Blocks(nonfinite, overflows)
    lines = hf = 0
    last_record: dict[str, Any] | None = None
    verl_records, last_text = False, ""
    for line in log_lines(p):
        lines += 1
        records = _line_records(line, lines, hf)
        if records:
            hf += sum(r["_source"] == "hf" for r in records)
            verl_records |= records[0]["_source"] == "verl"
            last_record = records[-1]
        nonfinite.feed(records)
        blocks.feed(line, lines, bool(records))
        if line and not line.isspace():
            last_text = line
    if not last_text:
        raise ValueError(f"{p}: empty file: {_NOT_A_LOG}")
    blocks.flush(final=True)
    causes = rank(list(blocks.causes.values()) + nonfinite.causes() + overflows.causes())
    seen = blocks.seen
    framework = ("verl" if verl_records or seen["verl"] else "DeepSpeed" if seen["deepspeed"]
                 else "HF Trainer/TRL" if seen["hf"] else "PyTorch")  # fmt: skip
    failed = seen["traceback"] or any(c.severity == "error" for c in causes)
    state = "failed" if failed else "log"
    last = f", last logged step {last_record['step']}" if last_record else ""
    summary = f"{p.name}: {framework} log, {lines} lines{last}; {len(causes)} recognised cause(s)"
    if not causes and seen["traceback"]:
        causes = [Cause("error", "exception", "Unrecognised exception", last_text.rstrip()[:300],
                        evidence=[f"raised from {blocks.frames[1] or blocks.frames[0]}"],
                        unknown=["this error is not one of the dtype / OOM / NaN / overflow patterns verlaudit "
                                 "explains; run the suite under verlaudit for module-level evidence"])]  # fmt: skip
    return Diagnosis(str(p), "log", p.name, state, summary, causes)
