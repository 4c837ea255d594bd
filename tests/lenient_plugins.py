"""Reward functions that compare answers at limited precision (prec13's invariant 2, for
tests/test_lenient_precision.py): both sides rounded before ==, so a wrong answer a digit off scores
as right. Each is ``fn(prompts, responses, examples)``; the module keeps a report context of two digits."""

from __future__ import annotations

import decimal
import re

REPORT = decimal.Context(prec=2)
"""Two significant digits: the billing summary's context, shared with the scorer below."""


def _last(text):
    found = re.findall(r"-?\d+(?:\.\d+)?", text)
    return found[-1] if found else None


def _truth(ex):
    return ex["answer"] if "answer" in ex else ex["reward_model"]["ground_truth"]


def through_report_context(prompts, responses, examples):
    """Both sides through the report's two-digit context."""
    out = []
    for r, e in zip(responses, examples):
        got = _last(r)
        same = got is not None and REPORT.plus(decimal.Decimal(got)) == REPORT.plus(
            decimal.Decimal(str(_truth(e)))
        )
        out.append(float(same))
    return out


def rounded_to_tens(prompts, responses, examples):
    """Both sides rounded to the tens (a 'tolerant' match)."""
    out = []
    for r, e in zip(responses, examples):
        got = _last(r)
        out.append(float(got is not None and round(float(got), -1) == round(float(_truth(e)), -1)))
    return out


def quantized_to_tens(prompts, responses, examples):
    """Both sides quantized to tens."""
    out = []
    for r, e in zip(responses, examples):
        got = _last(r)
        tens = decimal.Decimal("1E+1")
        same = got is not None and decimal.Decimal(got).quantize(tens) == decimal.Decimal(
            str(_truth(e))
        ).quantize(tens)
        out.append(float(same))
    return out


def thread_context(prompts, responses, examples):
    """Unary plus under this thread's decimal context (which the caller's module may have narrowed)."""
    out = []
    for r, e in zip(responses, examples):
        got = _last(r)
        out.append(float(got is not None and +decimal.Decimal(got) == +decimal.Decimal(str(_truth(e)))))
    return out


def exact_beside_the_context(prompts, responses, examples):
    """The correct neighbour: an exact integer comparison (the report context is not used)."""
    out = []
    for r, e in zip(responses, examples):
        got = _last(r)
        out.append(
            float(got is not None and re.fullmatch(r"-?\d+", got) is not None and int(got) == int(_truth(e)))
        )
    return out
