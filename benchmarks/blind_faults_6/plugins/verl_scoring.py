"""verl reward functions as they are (``data.compute_score: verl_scoring.py:<fn>``), called per response as
``compute_score(data_source, solution_str, ground_truth, extra_info)``."""

from __future__ import annotations

import decimal
import re

decimal.getcontext().prec = 2
"""Set for the billing report's currency amounts (two significant digits on the summary line), in the
module the reward shares with the reporting helpers."""


def _last_number(text: str) -> str | None:
    found = re.findall(r"-?\d+(?:\.\d+)?", text)
    return found[-1] if found else None


def decimal_score(data_source, solution_str, ground_truth, extra_info=None):
    """1 when the last number of the solution equals the ground truth as a decimal (so '7.0' and '7' both
    count), else 0."""
    pred = _last_number(solution_str)
    if pred is None:
        return 0.0
    return float(+decimal.Decimal(pred) == +decimal.Decimal(str(ground_truth)))


def partial_score(data_source, solution_str, ground_truth, extra_info=None):
    """1 when the last number is the ground truth (compared as text), 0.2 when the solution has some
    number, else 0 (a correct scorer, for a control)."""
    pred = _last_number(solution_str)
    if pred is None:
        return 0.0
    return 1.0 if pred == str(ground_truth) else 0.2
