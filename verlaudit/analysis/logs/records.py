"""The non-finite evidence of a foreign log: the first metric record (`verlaudit.analysis.logs.table`,
every format) with a non-finite loss, gradient-norm, reward or log-prob metric (`vocab.is_finding_key`),
and from the lines around them a plain ``loss=nan``, anomaly mode's backward function, NaN
probabilities in sampling: fed line by line, bounded whatever the log's size. Exercised by
``pytest tests/test_logparse.py``.
"""

from __future__ import annotations

import math
import re
from typing import Any

from verlaudit import verl_keys as V
from verlaudit.analysis.causes import BACKWARD_NAN_WHAT, Cause, Fix, backward_nan_fixes
from verlaudit.analysis.logs import table, vocab
from verlaudit.analysis.logs.frameworks import LogContext, applied, fixes

# Megatron's training_log line: "iteration 9/ 10 | consumed samples: ... | elapsed time per iteration (ms): ..."; it
# adds each loss ("lm loss: 2.1E+00 |") only when the interval's average is > 0, so a NaN loss leaves none on an
# iteration that was applied (no skipped iteration: an fp16 skip adds nothing to the average and leaves 0)
_MEGATRON_ITER = re.compile(r"^\s*iteration\s+(\d+)\s*/\s*\d+\s*\|")
_MEGATRON_APPLIED = re.compile(r"number of skipped iterations:\s*0\s*\|")
_MEGATRON_LOSS = re.compile(r"\bloss: ")


def _line_of(text: str, pos: int) -> str:
    start = text.rfind("\n", 0, pos) + 1
    end = text.find("\n", pos)
    return text[start : end if end >= 0 else len(text)].strip()[:400]


def _lineno(text: str, pos: int) -> int:
    return text.count("\n", 0, pos) + 1


# ---- non-finite evidence outside the records: a plain `loss=nan`, anomaly mode, sampling
# a loss / gradient-norm / reward / log-prob / KL / entropy named with a non-finite value in a sentence as well as
# a pair: `loss=nan`, verl's "WARN: grad_norm is not finite: nan", "loss is nan", "loss became inf", "NaN detected in
# loss", "found inf in grad norm", "non-finite values in the reward"
_NAN_METRIC = (
    r"\w*loss\w*|\w*grad(?:ient)?[_ ]?norm\w*|\w*rewards?\b\w*|\w*log_?probs?\w*|\w*entropy\w*|kl\w*"
)
_PLAIN_NAN = re.compile(
    rf"\b({_NAN_METRIC})(?:\s+(?:is|was|became|becomes|turned|went|got|has|have|value|values|not|finite|non-finite|"
    rf"detected|found|now|to))*\s*[=:]?\s*(nan|[-+]?inf)\b"
    rf"|\b(?:nan|inf|non-finite|not finite)\s+(?:values?\s+)?(?:(?:detected|found|encountered|seen)\s+)?(?:in|for)\s+"
    rf"(?:the\s+)?({_NAN_METRIC})\b",
    re.I,
)
_NAN_VALUE = re.compile(r"\b(?:nan|inf|non-finite|not finite)\b")
"""What every `_PLAIN_NAN` match contains: a fast test before the slow one."""
_NAN_HINTS = (
    "loss",
    "grad_norm",
    "grad norm",
    "gradient norm",
    "gradnorm",
    "reward",
    "logprob",
    "log_prob",
    "entropy",
    "kl",
)
_NOT_A_SERIES = re.compile(
    r"time|eta\b|throughput|per_?s(?:ec)?\b|/s\b|speed|rate|mfu|flops|mem|tokens?_per", re.I
)
"""Columns a table or a record may leave non-finite without a failure: timings, throughputs, memory."""
_ANOMALY = re.compile(r"Function '(\w+)' returned nan values in its (\d+)(?:th|st|nd|rd) output")
_SAMPLING_NAN = re.compile(r"probability tensor contains either `inf`, `nan` or element < 0")


def parse_metric_lines(text: str) -> list[dict[str, Any]]:
    """The metric records of a log's text, in every line format `verlaudit.analysis.logs.table`
    reads (verl step lines, HF Trainer / TRL dicts, JSON lines, key=value pairs, tables). A record
    without a step of its own (an HF dict) gets its ordinal among those; ``_source`` says which
    format it came from. A value that is not a number is left out."""
    t = table.MetricTable()
    out: list[dict[str, Any]] = []
    for ln, line in enumerate(text.splitlines(), 1):
        out += t.feed(ln, line)
    return out + t.finish()


# autograd's backward functions are named for the forward op (`Log1PBackward0` is torch.log1p's): the forward names
# a reader knows, where they differ from the snake_case of the name
_FORWARD = {
    "Log1P": "torch.log1p", "LogSigmoid": "torch.nn.functional.logsigmoid", "LogSoftmax": "torch.log_softmax",
    "Div": "division (torch.div)", "Mul": "multiplication (torch.mul)", "LinalgVectorNorm": "torch.linalg.vector_norm",
    "Norm": "torch.norm", "NllLoss": "torch.nn.functional.nll_loss", "BinaryCrossEntropy": "torch.nn.functional.binary_cross_entropy",
    "Mm": "torch.mm", "Bmm": "torch.bmm", "Addmm": "torch.addmm (a linear layer)", "Xlogy": "torch.xlogy",
}  # fmt: skip
# ops whose backward is infinite at a point of their input (log at 0, log1p at -1, sqrt at 0, division by ~0, ...)
_SINGULAR = frozenset({"Log", "Log1P", "Log2", "Log10", "Sqrt", "Rsqrt", "Div", "Pow", "Norm", "LinalgVectorNorm", "Acos",
                       "Asin", "Atanh", "Reciprocal", "Xlogy", "Atan2"})  # fmt: skip


def backward_of(fn: str) -> str:
    """``Log1PBackward0 (the backward of torch.log1p)``: an autograd function with the forward op it belongs to."""
    m = re.match(r"^([A-Z]\w*?)Backward\d*$", fn)
    if m is None:
        return fn
    op = m[1]
    forward = _FORWARD.get(op) or "torch." + re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", op).lower()
    singular = " at an input where its derivative is infinite" if op in _SINGULAR else ""
    return f"{fn} (the backward of {forward}{singular})"


_ROLES = frozenset({"actor", "critic", "ref", "reference", "rollout", "policy", "value", "reward_model", "rm", "teacher",
                    "student", "generator", "discriminator", "ppo_actor", "ppo_critic"})  # fmt: skip
"""Metric prefixes that name a model's role (verl's ``critic/``, OpenRLHF's ``actor/``), not a section."""


class Nonfinite:
    """Non-finite evidence: the first record with a non-finite metric (fed record by record), and
    from blocks of lines the first ``loss=nan`` no record covers, anomaly mode's backward function
    and NaN probabilities in sampling."""

    def __init__(self) -> None:
        self.records = 0
        self.first_bad: tuple[int, dict[str, Any], list[str]] | None = None
        """(ordinal of the record, the record, its non-finite keys)."""
        self.plain: str | None = None
        self.plain_metric: str | None = None
        self.anomaly: tuple[int, str] | None = None
        self.sampling: int | None = None
        self.column: tuple[dict[str, Any], str] | None = None
        """(the record, the column): a logged column no rule names that was finite and then is not (a
        reporter's ``| Step | run_a |`` table of a gradient norm, a metric the framework names its own way)."""
        self._finite: set[str] = set()
        self.dropped: str | None = None
        """A Megatron iteration line without its loss (Megatron prints a loss only when its average is > 0)."""

    def feed(self, records: list[dict[str, Any]]) -> None:
        if self.first_bad is None:
            for i, rec in enumerate(records, self.records):
                bad = [
                    k
                    for k, v in rec.items()
                    if not k.startswith("_")
                    and isinstance(v, float)
                    and not math.isfinite(v)
                    and vocab.is_finding_key(k)
                ]
                if bad:
                    self.first_bad = (i, rec, bad)
                    break
        if self.first_bad is None and self.column is None:
            for rec in records:
                for k, v in rec.items():
                    if (
                        k.startswith("_")
                        or k == "step"
                        or not isinstance(v, float)
                        or _NOT_A_SERIES.search(k)
                    ):
                        continue
                    if math.isfinite(v):
                        if len(self._finite) < 512:
                            self._finite.add(k)
                    elif k in self._finite and self.column is None:
                        self.column = (rec, k)
        self.records += len(records)

    def scan(self, text: str, low: str, first_line: int, covered: set[int]) -> None:
        """Lines ``first_line``... as one ``text`` (``low``: lower-cased); ``covered``: their lines
        that held records (a verl line's `pg_loss:nan` is already its record's evidence)."""
        if self.plain is None and any(w in low for w in _NAN_HINTS):
            for m in _NAN_VALUE.finditer(low):  # a cheap necessary condition, then the whole pattern
                line = _line_of(text, m.start())
                if _lineno(text, m.start()) + first_line - 1 not in covered and (
                    pm := _PLAIN_NAN.search(line)
                ):
                    self.plain = f"line {_lineno(text, m.start()) + first_line - 1}: log: {line[:160]}"
                    self.plain_metric = (pm[1] or pm[3] or "").strip()
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
        if self.dropped is None and "elapsed time per iteration" in line:
            m = _MEGATRON_ITER.search(line)
            if m and _MEGATRON_APPLIED.search(line) and not _MEGATRON_LOSS.search(line):
                self.dropped = f"line {ln}: iteration {m[1]}: Megatron's iteration line prints no loss: {line.strip()[:160]}"

    # long: one cause from every kind of non-finite evidence (records, columns, sentences, anomaly mode, sampling)
    def causes(self, ctx: LogContext | None = None) -> list[Cause]:
        ctx = ctx or LogContext(None)
        ev, step, backward_only, where, role, first_line = [], None, False, None, None, None
        metrics = None  # the non-finite metrics' own names: the place when no role or producer names one
        if self.first_bad is not None:
            i, rec, bad = self.first_bad
            step, first_line = rec["step"], rec["_line"]
            roles = {k.split("/", 1)[0] for k in bad if "/" in k}
            role = roles.pop() if len(roles) == 1 and all("/" in k for k in bad) else None
            role = (
                role if role and vocab.norm(role) in _ROLES else None
            )  # `train/`, `eval/` are sections, not roles
            where = role  # (the metrics' own names are the place where no role prefixes them: `metrics`)
            metrics = ", ".join(bad[:3])
            ev.append(f"line {rec['_line']}: step {step}: first non-finite metrics {', '.join(bad[:6])}")
            # only the gradient norm, on the first logged step, with a finite loss: made in the backward
            losses = [v for k, v in rec.items() if "loss" in k and isinstance(v, float)]
            backward_only = i == 0 and all("grad_norm" in k for k in bad) and bool(losses)
        elif self.column is not None:
            rec, col = self.column
            step, first_line, where = rec["step"], rec["_line"], col
            ev.append(
                f"line {rec['_line']}: step {step}: the logged column {col!r} turned {rec[col]} after finite values"
            )
        if self.plain:
            ev.append(self.plain)
        if self.plain and first_line is None:
            first_line = int(self.plain.split(":", 1)[0].removeprefix("line "))
        if self.dropped:
            ev.append(self.dropped + " (Megatron prints a loss only when its average is > 0: a NaN loss is dropped "
                      "from the line, with no iteration counted as skipped)")  # fmt: skip
            first_line = first_line or int(self.dropped.split(":", 1)[0].removeprefix("line "))
        if self.anomaly:
            where = backward_of(self.anomaly[1])
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
            # a finite loss whose gradient norm is NaN from the first step: the reduction of the gradients, not
            # the model, is the other maker; DeepSpeed ZeRO-2's overlapped reduction (overlap_comm) is the most
            # reported one (DeepSpeed issues 5347, 5294, 5242), wherever DeepSpeed can run the backward
            if ctx.shows("deepspeed") or ctx.framework in _DEEPSPEED_USERS:
                where = (
                    where
                    or "the gradient reduction: deepspeed ZeRO overlap_comm, if DeepSpeed runs the backward"
                )
                fx = [
                    Fix(None, None, "if DeepSpeed ZeRO-2 runs the backward: set zero_optimization.overlap_comm=false "
                        "(its overlapped bucketed reduction has made NaN / zero gradients in several releases), or "
                        "upgrade deepspeed, or raise reduce_bucket_size", key="zero_optimization.overlap_comm=false",
                        framework="deepspeed"),
                    *fx,
                ]  # fmt: skip
            return [Cause("error", "nonfinite", f"NaN gradient norm from the first logged step ({step}) with a finite loss",
                          BACKWARD_NAN_WHAT, evidence=ev, step=step, where=where or metrics, score=30.0, fixes=fx,
                          phase="update", line=first_line,
                          unknown=["which op made the NaN: rerun with torch.autograd.set_detect_anomaly(True) for one "
                                   "step, or under `verlaudit run` with audit level full"])]  # fmt: skip
        named = None
        if self.first_bad is None and self.column is not None:
            named = self.column[1]
        elif self.first_bad is None and self.plain_metric:
            named = where = where or self.plain_metric
        title = (f"Non-finite {named}" if named else "Non-finite loss / metrics") + (
            f" from step {step}" if step is not None else ""
        )
        title += f" in the {role}" if role and not self.anomaly else ""
        return [
            Cause("error", "nonfinite", title, "Training values became NaN/Inf.", evidence=ev, step=step,
                  where=where or metrics, score=30.0, fixes=_nonfinite_fixes(ctx, role), phase="update", line=first_line,
                  unknown=["the first module that produced the NaN (a log only shows the loss); rerun under "
                           "`verlaudit run` with audit level full for the producer module",
                           "the loss-scale history, unless the framework logged it"])
        ]  # fmt: skip


# frameworks whose training runs through DeepSpeed when the user gives it a DeepSpeed config
_DEEPSPEED_USERS = ("hf-trainer", "trl", "accelerate", "openrlhf", "deepspeed", None)


def _nonfinite_fixes(ctx: LogContext, role: str | None) -> list[Fix]:
    """What to try for NaN/Inf metrics, in the log's framework (the critic's own keys for a verl critic)."""
    if role == "critic" and ctx.framework == "verl":  # the critic has its own optimiser and clipping
        return fixes(
            ctx,
            None
            if applied("bf16_instead_of_fp16", ctx)
            else Fix(
                "precision.preset: bf16",
                V.param_dtype("critic", "bf16"),
                "if the run is fp16: bf16 does not overflow",
            ),
            Fix("algo.lr: <lower>", V.lr("critic"), "if the value loss diverged first"),
            Fix("algo.max_grad_norm: 1.0", V.grad_clip("critic"), "clip the critic's gradients"),
        )
    return fixes(
        ctx,
        ("bf16_instead_of_fp16", "if the run is fp16: bf16 does not overflow", "precision.preset: bf16"),
        ("lr", "if the loss diverged first", "algo.lr: <lower>"),
        ("grad_clip", "clip gradients", "algo.max_grad_norm: 1.0"),
    )
