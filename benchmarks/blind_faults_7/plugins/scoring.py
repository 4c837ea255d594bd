"""verl reward functions as they are (``data.compute_score: scoring.py:<fn>``), called per response as
``compute_score(data_source, solution_str, ground_truth, extra_info)``."""

from __future__ import annotations

import re

import numpy as np


def _last_int(text: str) -> str | None:
    found = re.findall(r"-?\d+", text)
    return found[-1] if found else None


def tolerant_score(data_source, solution_str, ground_truth, extra_info=None):
    """1 when the last number is the ground truth up to rounding (|pred - truth| < 0.5, 'so that 12.0 and 12
    match'), done on np.float32 values as in the team's vectorised grader; 0.1 for any number; else 0."""
    pred = _last_int(solution_str)
    if pred is None:
        return 0.0
    return 1.0 if abs(np.float32(pred) - np.float32(ground_truth)) < 0.5 else 0.1


def exact_score(data_source, solution_str, ground_truth, extra_info=None):
    """1 when the last number is the ground truth (as text), 0.1 for any number, else 0 (a correct scorer)."""
    pred = _last_int(solution_str)
    if pred is None:
        return 0.0
    return 1.0 if pred == str(ground_truth).strip() else 0.1
