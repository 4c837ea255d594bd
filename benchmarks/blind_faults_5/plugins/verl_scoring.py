"""verl reward functions as they are (``data.compute_score: verl_scoring.py:<fn>``), called per response as
``compute_score(data_source, solution_str, ground_truth, extra_info)``."""

from __future__ import annotations

import math
import re


def _last_number(text: str) -> str | None:
    found = re.findall(r"-?\d+(?:\.\d+)?", text)
    return found[-1] if found else None


REL_TOL = 0.1
"""Relative tolerance of the numeric comparison (written for answers with rounding in their last digit)."""


def lenient_score(data_source, solution_str, ground_truth, extra_info=None):
    """1 when the last number of the solution equals the ground truth up to a relative tolerance (so
    '7.0' and '7' both count), else 0."""
    pred = _last_number(solution_str)
    if pred is None:
        return 0.0
    return float(math.isclose(float(pred), float(ground_truth), rel_tol=REL_TOL))


def exact_score(data_source, solution_str, ground_truth, extra_info=None):
    """1 when the last number of the solution is the ground truth (compared as text), else 0 (a correct
    scorer, for a control)."""
    return float(_last_number(solution_str) == str(ground_truth))
