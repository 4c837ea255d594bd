"""Does the reward follow the answer? The reference answer handed to the reward function as the response.

The probe's calls run in one forked child (`verlaudit.audit.probes_fork.in_fork`) from the state before
the real call, on the real batch's prompts and examples, with the responses replaced:

- the reference answer (the example's ``answer``, or verl's ``reward_model.ground_truth``) as text, raw and
  in the formats a task's reward extracts it from (``#### a``, ``\\boxed{a}``, ``The answer is a.``); the
  best-scoring format is the probe's "right" response;
- a wrong answer in that format (another row's answer where it differs, else the answer with its last
  digit or letter changed).

What it says (`judge_answers`, on `precompute_answers`' scores):

- the reward separates right from wrong in most rows: an info finding (``reward/answer_scores``) that
  diagnosis reads to settle "no learning signal" (a sparse reward that the policy has not yet hit is not
  a fault: the reward can fire);
- it does not, while the run's own rewards were one value (the reward cannot fire): an error
  (``reward/answer_unscored``) naming the reward, with what would have scored: the answer as text where
  the example stores another type (an int ground truth a text comparison never equals), or the answer
  rounded through float32 / float16 (a ground truth compared for exact equality after a narrower float);
- the raw answer scores but its canonical form (stripped, NFKC, an integer-valued float written as an
  integer) scores less in most rows where they differ: the data's answers carry a form a correct
  response will not have (a leading space, full-width digits, "12.0"): ``data/answer_form``, naming
  the dataset.

Exercised by `pytest tests/test_probes_fork.py`.
"""

from __future__ import annotations

import copy
import math
import re
import sys
import unicodedata
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from verlaudit import kinds as K
from verlaudit.audit.probes_fork import in_fork, scores
from verlaudit.rundir import Finding

FORMATS: tuple[tuple[str, Callable[[str], str]], ...] = (
    ("raw", lambda a: a),
    ("#### a", lambda a: f"#### {a}"),
    ("\\boxed{a}", lambda a: f"\\boxed{{{a}}}"),
    ("The answer is a.", lambda a: f"The answer is {a}."),
)
MOST = 0.5
"""Share of the probed rows a verdict needs (right above wrong; the canonical form below the raw one)."""
_INT_FLOAT = re.compile(r"^(-?\d+)\.0+$")
_EXPONENT = re.compile(r"^-?\d+(?:\.\d+)?[eE][+-]?\d+$")
_FLOAT = re.compile(r"^-?\d*\.\d+$")
_INT = re.compile(r"^-?\d+$")
NOISE_DIGITS = 15
"""Significant digits from which a decimal text is a float's repr rather than a number anybody writes."""
NEAR_REL = 0.01
"""A decimal answer's near miss (one unit of its last place) counts only where it is this far off (relative)."""


def _significant(text: str) -> int:
    return len(text.lstrip("-").replace(".", "").lstrip("0"))


def denoised(text: str) -> str | None:
    """The short decimal a float's repr stands for ('0.30000000000000004' -> '0.3', binary rounding noise in
    the last digits), or None where the text is no such repr."""
    t = text.strip()
    if not _FLOAT.match(t) or _significant(t) < NOISE_DIGITS:
        return None
    x = float(t)
    for p in range(1, NOISE_DIGITS - 2):
        short = f"{x:.{p}g}"
        if "e" not in short and abs(float(short) - x) <= 4 * math.ulp(x):
            return short  # a float sum's rounding: a few units in the last place of the double
    return None


def reference(ex: Any) -> tuple[str, Any] | None:
    """``(field, value)`` of an example's reference answer: ``answer``, or verl's ground truth."""
    if not isinstance(ex, Mapping):
        return None
    if ex.get("answer") is not None:
        return "answer", ex["answer"]
    rm = ex.get("reward_model")
    if isinstance(rm, Mapping) and rm.get("ground_truth") is not None:
        return "reward_model.ground_truth", rm["ground_truth"]
    return None


def _with_answer(ex: Mapping, field: str, value: Any) -> dict:
    out = dict(ex)
    if field == "answer":
        out["answer"] = value
    else:
        out["reward_model"] = {**ex["reward_model"], "ground_truth": value}
    return out


def canonical(text: str) -> str:
    """The form a correct response writes: NFKC, stripped, an integer-valued float as the integer."""
    t = unicodedata.normalize("NFKC", text).strip()
    m = _INT_FLOAT.match(t)
    if m:
        return m.group(1)
    if _EXPONENT.match(t) and float(t).is_integer() and abs(float(t)) < 1e18:
        return str(int(float(t)))  # a response writes digits, not an exponent
    short = denoised(t)
    if short is not None:
        return short  # a response writes 0.3, not the repr of 0.1 + 0.2
    return t


def near_misses(text: str) -> list[str]:
    """Wrong answers next to ``text``, which a correct reward must score as wrong: an integer +-1, a decimal
    +- one unit of its last place (where that is at least `NEAR_REL` off), else the last letter changed."""
    t = text.strip()
    if _INT.match(t) or (_FLOAT.match(t) and denoised(t) is None):  # numbers: a unit of the last place off
        import decimal

        # prec13: our own context, exact for any answer: the user's module may have set this thread's
        # context to two digits (then 1234 + 1 would be '1.2E+3', a near miss no reward reads as a number)
        with decimal.localcontext(decimal.Context(prec=max(28, 2 * len(t)))):
            d = decimal.Decimal(t)
            whole = bool(_INT.match(t) or _INT_FLOAT.match(t))
            unit = decimal.Decimal(1) if whole else decimal.Decimal(1).scaleb(d.as_tuple().exponent)
            if whole or (d != 0 and unit / abs(d) >= decimal.Decimal(str(NEAR_REL))):
                return [str(d + unit), str(d - unit)]
        return []
    for j in range(len(t) - 1, -1, -1):
        if t[j].isalpha():
            return [t[:j] + ("b" if t[j].lower() == "a" else "a") + t[j + 1 :]]
    return []


def _form(raw: str, canon: str) -> tuple[str, str]:
    """(what differs, the fix) between a raw answer and its canonical form."""
    if unicodedata.normalize("NFKC", raw) != raw:
        return (
            "characters a response does not write (full-width or compatibility forms, NFKC changes them)",
            "NFKC-normalise the answers when the dataset is built (unicodedata.normalize('NFKC', a)), ASCII digits",
        )
    if raw.strip() != raw:
        return ("leading or trailing whitespace", "strip the answers when the dataset is built (a.strip())")
    if _INT_FLOAT.match(raw.strip()):
        return (
            "integers written as float text ('.0': a column read as float64)",
            "keep the answer column as text or integers (read it with dtype=str, or .astype('Int64') before "
            "str()), so that an integer is written without a trailing '.0'",
        )
    if denoised(raw) is not None:
        return (
            "numbers written with binary floating-point noise in their last digits (the repr of a float "
            f"computation: {raw.strip()!r} for {denoised(raw)!r}), which no response writes",
            "write each answer as the decimal it stands for when the dataset is built: round(x, n) or a format "
            "with the answer's digits (f'{x:.1f}'), or compute it exactly with decimal.Decimal / fractions",
        )
    if _EXPONENT.match(raw.strip()):
        return (
            "numbers written in exponent notation (a float format such as f'{x:g}' keeps 6 significant "
            "digits and switches to an exponent past them)",
            "write integer answers as integers (str(int(x)) or f'{x:d}'), not through a float format",
        )
    return ("another form than its canonical one", "write the answers in the form a correct response has")


def _wrong(texts: list[str], i: int, step: int) -> str:
    a = texts[i]
    other = texts[(i + step) % len(texts)]
    if canonical(other) != canonical(a):
        return other
    for j in range(len(a) - 1, -1, -1):
        ch = a[j]
        if ch.isdigit():
            return a[:j] + str((int(ch) + 1) % 10) + a[j + 1 :]
        if ch.isalpha():
            return a[:j] + ("b" if ch.lower() == "a" else "a") + a[j + 1 :]
    return a + "x"


def _narrow(text: str) -> dict[str, str]:
    """The answer's number rounded through float32 and float16, written out (where that changes it)."""
    t = text.strip()
    if not _FLOAT.match(t):
        return {}
    try:
        import numpy as np
    except ImportError:
        return {}
    x, out = float(t), {}
    for name, dt in (("float32", np.float32), ("float16", np.float16)):
        r = repr(float(dt(x)))
        if r != t and float(r) != x:
            out[name] = r
    return out


def precompute_answers(fn: Callable, prompts: list, examples: list, *, group_size: int) -> dict[str, Any]:
    """The answer probe's calls of one batch, all in one child forked now (before the real call); an empty
    probe when the child fails. One child, not one per call: a reward whose calls change its state is
    the contract probes' finding, and the answer probe is not read then (`probes_run`)."""
    ok, pre = in_fork(lambda: _answers(fn, prompts, examples, group_size=group_size))
    return pre if ok else {"rows": [], "refs": []}


def _answers(fn: Callable, prompts: list, examples: list, *, group_size: int) -> dict[str, Any]:
    """`precompute_answers`' calls, made in the child."""
    refs = [reference(ex) for ex in examples]
    rows = [i for i, r in enumerate(refs) if r is not None]
    n = len(examples)
    pre: dict[str, Any] = {"rows": rows, "refs": refs}
    if len(rows) < 2:
        return pre
    texts = [str(refs[i][1]) if refs[i] is not None else "" for i in range(n)]
    pre["texts"] = texts

    def score(responses: list[str], exs: list | None = None) -> list[float] | None:
        try:  # the child's own examples: a copy, whatever the call does to them
            return scores(fn(list(prompts), list(responses), copy.deepcopy(list(exs or examples))), n)
        except Exception:
            return None

    by_format: dict[str, list[float]] = {}
    for name, fmt in FORMATS:
        got = score([fmt(t) for t in texts])
        if got is not None and all(math.isfinite(got[i]) for i in rows):
            by_format[name] = got
    pre["by_format"] = by_format
    if not by_format:
        return pre
    best = max(by_format, key=lambda k: sum(by_format[k][i] for i in rows))
    fmt = dict(FORMATS)[best]
    pre["best"] = best
    pre["wrong"] = score([fmt(_wrong(texts, i, max(group_size, 1))) for i in range(n)])
    canon = [canonical(t) for t in texts]
    pre["canon"] = canon
    if any(canon[i] != texts[i] and canon[i] for i in rows):
        pre["canon_scores"] = score([fmt(c) for c in canon])
    near = [near_misses(t) for t in texts]
    pre["near"] = []
    for k in range(max((len(n) for n in near), default=0)):
        alt = [near[i][k] if i in rows and k < len(near[i]) else None for i in range(n)]
        got = score(
            [fmt(a if a is not None else _wrong(texts, i, max(group_size, 1))) for i, a in enumerate(alt)]
        )
        if got is not None:
            pre["near"].append((alt, got))
    field = refs[rows[0]][0]
    kinds = sorted({type(refs[i][1]).__name__ for i in rows})
    pre["field"], pre["types"] = field, kinds
    if kinds != ["str"]:
        as_text = [_with_answer(examples[i], field, texts[i]) if i in rows else examples[i] for i in range(n)]
        pre["as_text"] = score([fmt(t) for t in texts], as_text)
    pre["narrow"] = {}
    for dname in ("float32", "float16"):
        alt = [_narrow(texts[i]).get(dname) for i in range(n)]
        if sum(1 for i in rows if alt[i] is not None) >= MOST * len(rows):
            got = score([fmt(alt[i]) if alt[i] is not None else fmt(texts[i]) for i in range(n)])
            if got is not None:
                pre["narrow"][dname] = (alt, got)
    return pre


def judge_answers(
    pre: Mapping[str, Any],
    real: list[float],
    *,
    source: str,
    fn_name: str,
    data_key: str,
    ctx: Mapping[str, Any],
) -> tuple[list[Finding], dict[str, Any]]:
    """`precompute_answers`' scores judged (the run's own rewards ``real`` say whether the reward fired). A
    probe that fails is the audit's bug: named on stderr and in what the probe ran, never the run's end."""
    try:
        return _judge(pre, real, source=source, fn_name=fn_name, data_key=data_key, ctx=ctx)
    except Exception as e:  # noqa: BLE001 -- a check must never kill the user's run
        print(
            f"verlaudit: the reward's answer probe failed (an audit bug, the run goes on): {e!r}",
            file=sys.stderr,
        )
        return [], {"answer_probe_error": repr(e)[:200]}


# long: one verdict over the probe's scores, then the hints that name why the reward cannot fire, each worded in place
def _judge(
    pre: Mapping[str, Any],
    real: list[float],
    *,
    source: str,
    fn_name: str,
    data_key: str,
    ctx: Mapping[str, Any],
) -> tuple[list[Finding], dict[str, Any]]:
    rows, refs = pre["rows"], pre["refs"]
    ran: dict[str, Any] = {"answer_formats": sorted(pre.get("by_format", {}))}
    if len(rows) < 2 or not pre.get("by_format") or pre.get("wrong") is None:
        return [], ran
    texts, best, wrong = pre["texts"], pre["best"], pre["wrong"]
    right = pre["by_format"][best]
    if not all(math.isfinite(wrong[i]) for i in rows):
        return [], ran
    scale = max((abs(v) for v in right + wrong + real if math.isfinite(v)), default=0.0)
    tol = 1e-6 * max(scale, 1e-12)
    above = [i for i in rows if right[i] > wrong[i] + tol]
    mean_r = sum(right[i] for i in rows) / len(rows)
    mean_w = sum(wrong[i] for i in rows) / len(rows)
    ran["separates"] = round(len(above) / len(rows), 3)
    where = f"reward:{source}"
    field = pre["field"]
    observed = {
        "rows": len(rows),
        "right_above_wrong": len(above),
        "right_mean": mean_r,
        "wrong_mean": mean_w,
        "format": best,
        "field": field,
    }
    out: list[Finding] = []
    if len(above) >= MOST * len(rows):
        checked, passed = _near_hits(pre, above, right, tol)
        observed.update(near_miss_rows=len(checked), near_miss_scored=len(passed))
        out.append(
            Finding(
                severity="info",
                kind=K.REWARD_ANSWER_SCORES,
                role="reward",
                where=where,
                message=f"the reward can fire: the reference answer ({field}) as the response ({best}) scores "
                f"{mean_r:.3g} on average, a wrong answer {mean_w:.3g}; right above wrong in {len(above)} of "
                f"{len(rows)} rows",
                observed=observed,
                expected="a correct answer scores above a wrong one",
                **ctx,
            )
        )
        out += _lenient_findings(pre, checked, passed, right, where=where, fn_name=fn_name, ctx=ctx)
        out += _form_findings(pre, rows, right, tol, data_key=data_key, ctx=ctx)
        return out, ran
    finite = [v for v in real if math.isfinite(v)]
    if not finite or max(finite) - min(finite) > 1e-6 * max(1.0, scale):
        return out, ran  # the reward reads something of the responses, if not the answer: no claim
    hints, fix = [], []
    kinds = pre["types"]
    as_text = pre.get("as_text")
    if as_text is not None and sum(as_text[i] > wrong[i] + tol for i in rows) >= MOST * len(rows):
        hints.append(
            f"the examples store {field} as {'/'.join(kinds)} ({refs[rows[0]][1]!r}); given as the string "
            f"{texts[rows[0]]!r} the same answer scores {sum(as_text[i] for i in rows) / len(rows):.3g}: the "
            "reward compares the response's text with a non-string ground truth, which is never equal"
        )
        fix.append(
            f"compare as text: str(ground_truth) == the extracted answer in the reward, or store {field} as a "
            "string in the data"
        )
    for dname, (alt, got) in pre.get("narrow", {}).items():
        probe_rows = [i for i in rows if alt[i] is not None]
        hit = [i for i in probe_rows if got[i] > right[i] + tol]
        if probe_rows and len(hit) >= MOST * len(probe_rows):
            i0 = hit[0]
            hints.append(
                f"the answer rounded through {dname} scores ({texts[i0]!r} written as {alt[i0]!r} scores "
                f"{got[i0]:.3g}, the exact answer {right[i0]:.3g}): the reward compares for exact equality "
                f"with the ground truth rounded to {dname}"
            )
            fix.append(
                "compare numbers with a tolerance (math.isclose(pred, float(ground_truth), rel_tol=1e-6)) or as "
                f"decimal text, and keep the ground truth in float64 or as a string, not {dname}"
            )
            break
    every = [v for got in pre["by_format"].values() for v in got] + wrong + finite
    if not hints and max(every) - min(every) <= tol:
        return out, ran  # one value whatever it is given: a reward that reads nothing (reward/constant's)
    fix.append(
        "make the reward score its reference answer: compare the extracted answer with str(ground_truth) "
        "after normalising both (strip, numbers with math.isclose), and test it on the dataset's own answers"
    )
    out.append(
        Finding(
            severity="error",
            kind=K.REWARD_ANSWER_UNSCORED,
            role="reward",
            where=where,
            message=f"the reward function {fn_name} cannot fire: given each row's reference answer ({field}) as the "
            f"response ({', '.join(pre['by_format'])}), it scores {mean_r:.3g} on average, no more than a wrong "
            f"answer ({mean_w:.3g}), in {len(rows) - len(above)} of {len(rows)} rows"
            + ("; " + "; ".join(hints) if hints else "")
            + "; every reward of the run's batch is one value, so no response can teach the policy anything",
            observed={**observed, "hints": hints},
            expected="the reference answer scores above a wrong one",
            fix="; ".join(dict.fromkeys(fix)),
            **ctx,
        )
    )
    return out, ran


LENIENT_MIN = 0.25
"""Share of the probed rows (at least 2) in which a near miss scoring as the right answer is a finding."""


def _near_hits(
    pre: Mapping[str, Any], above: Sequence[int], right: list[float], tol: float
) -> tuple[list[int], list[int]]:
    """(rows whose reference answer fires and has a near miss, those of them where a near miss scores as much)."""
    checked, passed = [], []
    for i in above:
        got = [g[i] for alt, g in pre.get("near", []) if alt[i] is not None and math.isfinite(g[i])]
        if got:
            checked.append(i)
            if max(got) >= right[i] - tol:
                passed.append(i)
    return checked, passed


def _lenient_findings(
    pre: Mapping[str, Any],
    checked: Sequence[int],
    passed: Sequence[int],
    right: list[float],
    *,
    where: str,
    fn_name: str,
    ctx: Mapping[str, Any],
) -> list[Finding]:
    """``reward/answer_lenient`` when wrong answers next to the reference score as the reference does."""
    if not checked or len(passed) < max(2, LENIENT_MIN * len(checked)):
        return []
    i0 = passed[0]
    # the near miss that scored most in that row (`_near_hits` saw one at least as high as the answer, less tol)
    alt, got = max(
        ((a, g) for a, g in pre["near"] if a[i0] is not None and math.isfinite(g[i0])),
        key=lambda ag: ag[1][i0],
    )
    truth = pre["texts"][i0]
    numeric = bool(_INT.match(truth.strip()) or _FLOAT.match(truth.strip()))
    return [
        Finding(
            severity="error",
            kind=K.REWARD_ANSWER_LENIENT,
            role="reward",
            where=where,
            message=f"the reward function {fn_name} scores near-miss wrong answers as correct: {alt[i0]!r} for the "
            f"reference answer {truth!r} scores {got[i0]:.3g}, as much as the answer itself ({right[i0]:.3g}), in "
            f"{len(passed)} of {len(checked)} probed rows"
            + (
                ": its numeric comparison has a tolerance (rel_tol / abs_tol) wider than the answers' spacing"
                if numeric
                else ": it matches a part of the answer, not the whole of it"
            )
            + ", so wrong responses are rewarded as right ones",
            observed={
                "rows": len(checked),
                "rows_lenient": len(passed),
                "example": truth,
                "near_miss": alt[i0],
                "near_miss_score": got[i0],
                "right_score": right[i0],
            },  # fmt: skip
            expected="a wrong answer next to the reference scores below it",
            fix=(
                "compare exactly: the extracted answer == str(ground_truth), integers as int(pred) == int(truth); "
                "where numbers need a tolerance, math.isclose with an abs_tol below half the answers' spacing "
                "(not a rel_tol that grows with the answer)"
                if numeric
                else "compare the whole extracted answer with the ground truth (==), not a prefix or a substring"
            ),
            **ctx,
        )
    ]


def _form_findings(
    pre: Mapping[str, Any],
    rows: Sequence[int],
    right: list[float],
    tol: float,
    *,
    data_key: str,
    ctx: Mapping[str, Any],
) -> list[Finding]:
    """``data/answer_form`` when the canonical form of the answers scores below their raw form."""
    got, canon, texts = pre.get("canon_scores"), pre["canon"], pre["texts"]
    if got is None:
        return []
    differ = [i for i in rows if canon[i] != texts[i] and canon[i]]
    lower = [i for i in differ if math.isfinite(got[i]) and got[i] < right[i] - tol]
    if not differ or len(lower) < MOST * len(differ):
        return []
    i0 = lower[0]
    what, fix = _form(texts[i0], canon[i0])
    return [
        Finding(
            severity="error",
            kind=K.ANSWER_FORM,
            role="reward",
            where=data_key,
            message=f"the dataset's answers carry {what}: the reference answer {texts[i0]!r} as the response scores "
            f"{right[i0]:.3g}, its canonical form {canon[i0]!r} (what a correct response writes) only {got[i0]:.3g}; "
            f"{len(lower)} of {len(rows)} answers differ so: a correct response is scored as partly or wholly wrong",
            observed={
                "rows": len(rows),
                "rows_lower": len(lower),
                "example": texts[i0],
                "canonical": canon[i0],
                "raw_score": right[i0],
                "canonical_score": got[i0],
            },
            expected="an answer's canonical form scores as the answer does",
            fix=f"{data_key}: {fix}",
            **ctx,
        )
    ]
