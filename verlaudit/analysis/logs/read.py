"""Reading a foreign log: one pass, memory bounded whatever its size. Each line goes to the rule
families' streaming scan (`verlaudit.analysis.logs.scan`) and to the per-step metric table
(`verlaudit.analysis.logs.table`) and its non-finite evidence (`verlaudit.analysis.logs.records`); a
metrics file that is not a text log (`verlaudit.analysis.logs.files`) goes to the table alone; an empty
or binary file is refused as neither a log nor a run directory. Exercised by ``pytest tests/test_logparse.py``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from verlaudit.analysis.causes import Cause
from verlaudit.analysis.logs import files, records, trends, vocab
from verlaudit.analysis.logs.frameworks import LogContext
from verlaudit.analysis.logs.scan import LogFacts, LogScan
from verlaudit.analysis.logs.table import MetricTable

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


@dataclasses.dataclass
class LogRead:
    """What one pass over a log file kept."""

    facts: LogFacts
    nonfinite: records.Nonfinite
    lines: int
    last_record: dict[str, Any] | None
    table: MetricTable = dataclasses.field(default_factory=MetricTable)
    """The per-step metric table every format fed (`verlaudit.analysis.logs.table`)."""

    def causes(self, ctx: LogContext) -> list[Cause]:
        """The metric causes: non-finite values (but not fp16's skipped steps: `benign_skip`), a
        collapse, a mismatch (`trends`)."""
        found = [] if self.benign_skip(ctx) else self.nonfinite.causes(ctx)
        return found + trends.causes(self.table, ctx)

    def benign_skip(self, ctx: LogContext) -> bool:
        """Whether the only non-finite values are gradient norms of steps fp16 loss scaling skipped:
        the log shows overflow skips (or fp16 on), every loss is finite, and the gradient norm is
        finite again by the last logged step. A dynamic loss scale backs off exactly so; nothing
        diverged."""
        nf = self.nonfinite
        if nf.first_bad is None or nf.plain or nf.anomaly or nf.sampling:
            return False
        if not all(vocab.canonical(k) == "grad_norm" for k in nf.first_bad[2]):
            return False
        skips = self.facts.count("overflow", "overflow_apex", "overflow_reducing") > 0
        if not (skips or ctx.is_true("fp16")):
            return False
        loss = self.table.series.get("loss")
        grad = self.table.series.get("grad_norm")
        if loss is None or grad is None or not all(math.isfinite(v) for _, _, v in loss.points()):
            return False
        points = grad.points()
        return bool(points) and math.isfinite(points[-1][2])


def _file_records(path: Path, kind: str) -> Iterator[dict[str, Any]]:
    if kind == "tensorboard":
        return files.tensorboard_records(path)
    if kind == "trainer_state":
        return files.trainer_state_records(path)
    raise files.wandb_binary(path)


def read_log(path: Path, scan: LogScan) -> LogRead:
    """One pass over the log at ``path`` (`log_lines`): each line to ``scan`` (the rule families'
    detectors) and to the metric table and its NaN evidence; a metrics file that is not text
    (`files.kind`: trainer_state.json, a TensorBoard event file) straight to the table. ValueError
    for a file that cannot be read, is not text (nor such a file), or is empty: neither a log nor a
    run directory."""
    nonfinite = records.Nonfinite()
    metrics = MetricTable()
    kind = files.kind(path)
    if kind is not None:
        n = 0
        for rec in _file_records(path, kind):
            n += 1
            nonfinite.feed(metrics.add(rec))
        if n == 0:
            raise ValueError(
                f"{path}: a {kind.replace('_', ' ')} file with no training metrics: {_NOT_A_LOG}"
            )
        return LogRead(scan.facts(), nonfinite, n, metrics.last, metrics)
    lines = 0
    blank = True
    for line in log_lines(path):
        lines += 1
        blank = blank and not line.strip()
        recs = metrics.feed(lines, line)
        nonfinite.feed(recs)
        nonfinite.scan_line(line, lines, bool(recs) and any(r["_line"] == lines for r in recs))
        scan.feed(lines, line)
    nonfinite.feed(metrics.finish())
    if blank:
        raise ValueError(f"{path}: empty file: {_NOT_A_LOG}")
    return LogRead(scan.facts(), nonfinite, lines, metrics.last, metrics)
