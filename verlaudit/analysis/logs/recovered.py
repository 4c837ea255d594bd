"""Errors a log shows and then recovers from (logs12 branch, issue 25): a traceback Python printed for an exception it
ignored (``Exception ignored in: <function ... __del__>``: the unraisable hook, at interpreter shutdown or in a
destructor), or one a retry loop logged next to its "retrying" line, after which the run goes on (a later training
step, a "succeeded" / "recovered" line). The fallback that never lets a failure pass as clean
(`verlaudit.analysis.logs.unrecognised`) leaves these out; a family that recognises the message still reads it.
Exercised by ``pytest tests/test_log_families12.py -k recovered``.
"""

from __future__ import annotations

import re

from verlaudit.analysis.logs.lines import LogLine, hints
from verlaudit.analysis.logs.scan import Hit, LogFacts, Traceback

_IGNORED = re.compile(r"^Exception ignored in\b")
_RETRY = re.compile(
    r"\b(?:retry(?:ing)?|will retry|retried|trying again|falling back|fall(?:ing)? back to|attempt \d+\s*/\s*\d+)\b",
    re.I,
)
_SUCCESS = re.compile(
    r"\b(?:succeeded|success(?:ful(?:ly)?)?|recovered|reconnected|resum(?:ed|ing))\b(?! *(?:=|:) *(?:false|0)\b)",
    re.I,
)
_PROGRESS = re.compile(
    r"\bstep\s*[:=]?\s*\d+|\bepoch\s*[:=]?\s*\d+|\d+/\d+ \[|\bloss\s*[=:]?\s*[-\d.]+\d", re.I
)
NEAR = 3
"""Lines between a retry note and the traceback it explains."""


_RETRY_HINTS = hints("etry", "ETRY", "ttempt", "all back", "alling back", "ying again")
_ON_HINTS = hints("ucce", "ecover", "econnect", "esum", "tep", "TEP", "poch", "oss", "/")


def detect(line: LogLine) -> list[Hit]:
    text = line.text
    if text.startswith("Exception ignored"):
        return [Hit("exc_ignored", line)] if _IGNORED.match(text) else []
    out = []
    if _RETRY_HINTS(text) and _RETRY.search(text):
        out.append(Hit("retry_note", line))
    if _ON_HINTS(text) and (_PROGRESS.search(text) or _SUCCESS.search(text)):
        out.append(Hit("went_on", line))
    return out


def is_recovered(facts: LogFacts, tb: Traceback) -> bool:
    """Whether ``tb`` is one the log recovered from: Python's "Exception ignored in" right above it, or a retry
    note beside it and the run going on after it (a later step or a success line)."""
    if any(0 <= tb.start - h.no <= 1 for h in facts.of("exc_ignored")):
        return True
    end = tb.exc.no if tb.exc else tb.end
    retry = any(tb.start - NEAR <= h.no <= end + NEAR for h in facts.of("retry_note"))
    return retry and any(h.no > end for h in facts.of("went_on"))


def recovered_lines(facts: LogFacts) -> set[int]:
    """The lines of every recovered traceback (from its first frame to its exception line)."""
    out: set[int] = set()
    for tb in facts.tracebacks:
        if is_recovered(facts, tb):
            out.update(range(tb.start, max(tb.end, tb.exc.no if tb.exc else tb.end) + 1))
    return out
