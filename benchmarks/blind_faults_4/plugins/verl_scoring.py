"""verl reward functions as they are (``data.compute_score: verl_scoring.py:<fn>``), called per response as
``compute_score(data_source, solution_str, ground_truth, extra_info)``."""

from __future__ import annotations

import re

import numpy as np


def _last_number(text: str) -> str | None:
    found = re.findall(r"-?\d+(?:\.\d+)?", text)
    return found[-1] if found else None


def decimal_score(data_source, solution_str, ground_truth, extra_info=None):
    """1 when the last number of the solution equals the ground truth as a number. The ground truth is
    parsed once into the float32 table the scorer shares with the GPU-side batch checker."""
    pred = _last_number(solution_str)
    if pred is None:
        return 0.0
    target = np.asarray([ground_truth], dtype=np.float32).tolist()[0]
    return float(float(pred) == target)


def strict_score(data_source, solution_str, ground_truth, extra_info=None):
    """1 when the last number of the solution is exactly the ground truth, else 0."""
    return float(_last_number(solution_str) == ground_truth)


def exact_score(data_source, solution_str, ground_truth, extra_info=None):
    """1 when the last number of the solution is the ground truth (compared as text), else 0 (a correct
    scorer, for a control)."""
    return float(_last_number(solution_str) == str(ground_truth))
