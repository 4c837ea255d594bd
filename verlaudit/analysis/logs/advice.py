"""The message's own remedy, wherever a family explains the failure: many messages say their fix in the lines
around them ("To adjust the eviction threshold, set the environment variable `RAY_memory_usage_threshold_fraction`",
"consider decreasing `gpu_memory_utilization` or switching to eager mode", "Try setting
PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"). ``detect`` keeps each line whose advising sentences name a
flag, an environment variable, a key or a backticked setting; ``attach`` puts that advice first among the
fixes of the error or warning it sits next to (same process, from two lines above to ten below), unless the
cause's fixes already name everything it names. A family's general remedy then follows the specific one
the message gave. Exercised by ``pytest tests/test_log_outputs.py -k advice``.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from verlaudit.analysis.causes import Cause, Fix
from verlaudit.analysis.logs.lines import LogLine, hints, message_advice
from verlaudit.analysis.logs.scan import Hit, LogFacts

_TICKED = re.compile(r"[`'\"]([A-Za-z_][\w.-]*(?:=\S+?)?)[`'\"]")
_ENV = re.compile(r"\b([A-Z][A-Z0-9]*_[A-Za-z0-9_]*[A-Za-z0-9])\b")
_HAS = hints("set", "Set", "consider", "Consider", "try", "Try", "increase", "decrease", "reduce", "lower",
             "raise", "use", "Use", "pass", "install", "upgrade", "downgrade", "you can", "You can")  # fmt: skip
_CODE = re.compile(r"^(?:raise|return|assert|use)\s+[\w.]+\(")  # a frame's source line, not a sentence
_LOOK = re.compile(r"debug|stack ?trace|more (?:information|details)|verbose", re.I)
"""Advice on how to see more (CUDA_LAUNCH_BLOCKING=1 "for debugging", HYDRA_FULL_ERROR=1 "for a complete
stack trace"): what to look at next, after the remedies, not before them."""
BEFORE, AFTER = 2, 10
"""The lines around a cause's line whose advice is the message's own."""


def _names(sentence: str) -> list[str]:
    _, named = message_advice(sentence)
    found = list(named)
    found += [m for m in _TICKED.findall(sentence) if "_" in m or "-" in m or "=" in m]
    found += [m for m in _ENV.findall(sentence) if "environment" in sentence.lower() or "=" in sentence]
    out: list[str] = []
    for n in found:
        n = n.rstrip(".,;)")
        if n and n not in out:
            out.append(n)
    return out


def detect(line: LogLine) -> list[Hit]:
    """A line whose advising sentences name what to change."""
    text = line.text
    if len(text) > 3000 or not _HAS(text):
        return []
    sentences, _ = message_advice(text)
    sentences = [s for s in sentences if not _CODE.match(s)]
    told = [(s, n) for s in sentences if (n := _names(s))]
    if not told:
        return []
    # every advising sentence of the line, in its order: the one that names nothing often leads ("Consider
    # provisioning more memory ... To adjust the threshold, set `X`")
    return [Hit("advice", line, {"sentences": sentences, "names": [x for _, n in told for x in n]})]


def _fix_text(c: Cause) -> str:
    return " ".join(
        f"{f.suite or ''} {f.verl or ''} {getattr(f, 'key', None) or ''} {f.why}" for f in c.fixes
    )


def attach(causes: Sequence[Cause], facts: LogFacts) -> None:
    """The message's own advice first among the fixes of each error / warning it sits next to."""
    told = facts.of("advice")
    if not told:
        return
    for c in causes:
        if c.severity not in ("error", "warning") or c.line is None:
            continue
        near = [
            h for h in told
            if c.line - BEFORE <= h.no <= c.line + AFTER and (c.rank is None or h.line.rank in (None, c.rank))
        ]  # fmt: skip
        have = _fix_text(c)
        new: list[Fix] = []
        look: list[Fix] = []
        for h in near:
            if all(n in have for n in h.fields["names"]):
                continue
            for s in h.fields["sentences"]:
                if s not in have:
                    (look if _LOOK.search(s) else new).append(
                        Fix(None, None, f"the message's own advice: {s[:300]}")
                    )
                    have += " " + s
        if new or look:
            c.fixes[:0] = new[:3]
            c.fixes.extend(look[:1])
            c.evidence.append(f"line {near[0].no}: the message advises its own remedy")
