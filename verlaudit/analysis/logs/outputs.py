"""Outputs compared with a reference and found apart: a test or script that checks an engine's (or a port's,
or a lower precision's) outputs against a reference implementation. Two families of message, neither
specific to one library:

- a failed tolerance check: an ``AssertionError`` whose asserted expression (its frame's source line, or a
  pasted ``assert`` line above it) compares against a tolerance (``atol``, ``rtol``, ``tol``, ``eps``,
  ``threshold``, ``margin``; ``isclose`` / ``allclose``), or the report of ``torch.testing.assert_close`` /
  ``numpy.testing.assert_allclose`` ("Tensor-likes are not close!", "Mismatched elements: 7 / 4096",
  "Not equal to tolerance"): an error; the labelled numbers printed near it (``VLLM: ... 0.272``,
  ``Difference: 0.0618``) and the model the test names (``Model: org/name``) are its evidence and culprit;
- labelled outputs that diverge: a line ``<label>: <text>`` and, within two lines, ``<other>: <text>``, one
  label naming a reference side (``ref``, ``reference``, ``baseline``, ``golden``, ``hf``, ``transformers``,
  ``eager``, ``fp32``), the two texts sharing their first words (the same prompt's continuations) and then
  differing: a warning (the outputs diverge; the reader decides the tolerance), naming the label that
  differs and the word where it does.

The fixes tell a precision gap from an implementation difference (rerun both sides in fp32) and bisect the
engine's features. Exercised by ``pytest tests/test_log_outputs.py``.
"""

from __future__ import annotations

import re

from verlaudit.analysis.causes import Cause
from verlaudit.analysis.logs.frameworks import LogContext, advice
from verlaudit.analysis.logs.lines import LogLine, hints
from verlaudit.analysis.logs.scan import Hit, LogFacts, place, quote

_LABELLED = re.compile(r"^\s*(?:[>|*-]\s*)?(?P<label>[A-Za-z][\w .-]{0,38}?)\s*:\s+(?P<text>\S.*?)\s*$")
_REF_WORDS = frozenset({"ref", "reference", "baseline", "golden", "hf", "transformers", "eager", "fp32"})
_TOLERANCE = re.compile(
    r"\b(?:a|r)?tol(?:erance)?\b|\beps(?:ilon)?\b|\bthreshold\b|\bmargin\b|isclose|allclose"
)
_TESTING = re.compile(
    r"Tensor-likes are not (?:close|equal)|Mismatched elements: (\d+) / (\d+)|Not equal to tolerance"
    r"|Arrays are not (?:almost )?equal|Greatest (?:absolute|relative) difference: ([-\w.+]+)"
)
_MODEL = re.compile(r"^\s*(?:Model|model(?:_name)?(?:_or_path)?)\s*[:=]\s*['\"]?([\w.-]+/[\w.-]+)")
_NUMBER_END = re.compile(r"(-?\d+(?:\.\d+)?(?:e-?\d+)?)\s*$")
_HAS = hints(":")
PREFIX_WORDS = 3
"""The words two labelled texts must share before they differ to be read as one prompt's two
continuations (unrelated lines share none)."""


def detect(line: LogLine) -> list[Hit]:
    """Labelled lines, a testing library's closeness report, and a line naming the model."""
    text = line.text
    if not _HAS(text) or len(text) > 2000:
        return []
    out: list[Hit] = []
    if m := _TESTING.search(text):
        out.append(Hit("close_report", line, {"groups": m.groups()}))
    if m := _MODEL.match(text):
        out.append(Hit("model_named", line, {"model": m[1]}))
    elif (m := _LABELLED.match(text)) and not text.lstrip().startswith(("File ", "Traceback")):
        label = m["label"].strip()
        if "  " not in label and not re.search(
            r"(?:Error|Exception|Warning)$|^(?:INFO|WARNING|ERROR|DEBUG)\b", label
        ):
            out.append(Hit("labelled", line, {"label": label, "text": m["text"]}))
    return out


def explain(facts: LogFacts, ctx: LogContext) -> list[Cause]:
    """A failed tolerance check, else labelled outputs that diverge from a reference side."""
    cause = _tolerance(facts, ctx)
    return [cause] if cause else [c for c in [_diverged(facts, ctx)] if c]


def _words(label: str) -> set[str]:
    return {w for w in re.split(r"[\W_]+", label.lower()) if w}


def _is_ref(label: str) -> bool:
    return bool(_words(label) & _REF_WORDS)


def _asserted(facts: LogFacts, h: Hit) -> str | None:
    tb = facts.traceback_near(h.no, h.line.rank)
    code = tb.frames[-1].code if tb and tb.frames else None
    m = re.match(r"\s*assert\s+(.+?)\s*$", code or "")
    if m:
        return m[1]
    near = [a for a in facts.of("assert_line") if 0 < h.no - a.no <= 4]
    return near[-1].fields["expr"] if near else None


def _model_near(facts: LogFacts, no: int, span: int = 15) -> str | None:
    near = [h for h in facts.of("model_named") if abs(h.no - no) <= span]
    return min(near, key=lambda h: abs(h.no - no)).fields["model"] if near else None


def _fixes(ctx: LogContext) -> list:
    return [
        advice(
            "rerun the comparison with both sides in fp32 (dtype=float32, the head too): a gap that closes is "
            "half-precision rounding (greedy decoding then forks at the first near-tie token), to be judged "
            "with a tolerance for the dtype; a gap that stays is an implementation difference"
        ),
        advice(
            "bisect the engine side: turn off one feature at a time (speculative decoding, prefix caching, "
            "CUDA graphs with enforce_eager, fused or quantised kernels, tensor parallelism) until the "
            "outputs match"
        ),
    ]


def _tolerance(facts: LogFacts, ctx: LogContext) -> Cause | None:
    reports = facts.of("close_report")
    for h in facts.of("exception_line"):
        if not h.fields.get("type", "").endswith("AssertionError"):
            continue
        expr = _asserted(facts, h)
        near = [r for r in reports if abs(r.no - h.no) <= 20]
        report = next((r for r in near if r.fields["groups"][0]), near[0] if near else None)
        closeness = report is not None
        if not (closeness or (expr and _TOLERANCE.search(expr))):
            continue
        at = report if closeness and report is not None else h
        numbers = [
            (x.fields["label"], m[1])
            for x in facts.of("labelled")
            if abs(x.no - h.no) <= 15 and (m := _NUMBER_END.search(x.fields["text"]))
        ]
        sides = [n for n in re.findall(r"[A-Za-z_]\w*", expr or "") if not _TOLERANCE.fullmatch(n)][:3]
        if closeness and report is not None and report.fields["groups"][0]:
            sides.append(f"{report.fields['groups'][0]} of {report.fields['groups'][1]} elements apart")
        model = _model_near(facts, h.no)
        where = ", ".join(x for x in [model and f"model {model}", " vs ".join(sides[:2])] if x) or None
        shown = "; ".join(f"{label} {value}" for label, value in numbers[:4])
        pl = place(facts, h.line)
        ev = (
            [quote(h.line)]
            + ([f"asserted: {expr}"] if expr else [])
            + ([quote(at.line)] if at is not h else [])
        )
        ev += [f"printed: {shown}"] if shown else []
        half = [
            x
            for x in facts.of("labelled")
            if abs(x.no - h.no) <= 15 and re.search(r"float16|bfloat16|fp16|bf16", x.fields["text"])
        ]
        if half:
            ev.append(f"a compared side runs in half precision: {quote(half[0].line, 160)}")
        return Cause(
            "error",
            "mismatch",
            "Outputs differ from the reference beyond the tolerance"
            + (f": assert {expr}" if expr else ": " + at.line.text.strip()[:120])
            + (f" ({shown})" if shown else ""),
            "A comparison of outputs with a reference implementation failed its tolerance: the two sides "
            "compute different numbers. Either the tolerance is too tight for the dtype one side runs in, or "
            "one side computes something else (a kernel, a layer, a head or a weight loaded differently).",
            evidence=ev + pl.evidence(),
            fixes=_fixes(ctx),
            where=where,
            phase=pl.phase,
            rank=pl.rank,
            line=h.no,
            score=14.0,
            unknown=["which side is wrong: the log shows that they differ, not why"],
        )
    return None


def _diverged(facts: LogFacts, ctx: LogContext) -> Cause | None:
    rows = facts.of("labelled")
    pairs = []
    for a, b in zip(rows, rows[1:]):
        if (
            b.no - a.no > 2
            or a.fields["label"] == b.fields["label"]
            or _is_ref(a.fields["label"]) == _is_ref(b.fields["label"])
        ):
            continue
        ref, other = (a, b) if _is_ref(a.fields["label"]) else (b, a)
        rw, ow = ref.fields["text"].split(), other.fields["text"].split()
        same = next((i for i, (x, y) in enumerate(zip(rw, ow)) if x != y), min(len(rw), len(ow)))
        if rw != ow and same >= PREFIX_WORDS:
            pairs.append((ref, other, same))
    if not pairs:
        return None
    ref, other, same = pairs[0]
    rl, ol = ref.fields["label"], other.fields["label"]
    ev = [
        f"line {other.no}: {ol} leaves {rl} after word {same}: "
        f"...{' '.join(ref.fields['text'].split()[max(0, same - 3) : same + 3])!r} vs "
        f"...{' '.join(other.fields['text'].split()[max(0, same - 3) : same + 3])!r}"
        for ref, other, same in pairs[:3]
    ]
    model = _model_near(facts, other.no, 40)
    pl = place(facts, other.line)
    return Cause(
        "warning",
        "mismatch",
        f"Outputs diverge from the reference: {ol} differs from {rl} after {same} words"
        + (f" ({len(pairs)} pairs)" if len(pairs) > 1 else ""),
        "The log prints the same prompt's continuation from a reference side and from the side under test; "
        "they agree for a few words and then fork. Greedy outputs of one model should match token for token "
        "unless the two sides compute different logits (a kernel, a feature such as speculative decoding or "
        "prefix caching, a dtype).",
        evidence=ev + pl.evidence(),
        fixes=_fixes(ctx),
        where=f"{ol} vs {rl}" + (f" (model {model})" if model else ""),
        phase=pl.phase,
        rank=pl.rank,
        line=other.no,
        score=9.0,
        unknown=["whether the difference exceeds what the dtype explains: the log shows no tolerance"],
    )
