"""verl reward functions as they are (``data.compute_score: verl_scoring.py:<fn>``), called per response as
``compute_score(data_source, solution_str, ground_truth, extra_info)``."""

from __future__ import annotations

import re

import numpy as np


def _last_number(text: str) -> str | None:
    found = re.findall(r"-?\d+", text)
    return found[-1] if found else None


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """Three equally weighted checks, each a numpy bool: the right number, any number at all, and a
    short answer; the score is how many pass, over 3."""
    pred = _last_number(solution_str)
    exact = np.bool_(pred == str(ground_truth))
    has_number = np.bool_(pred is not None)
    short = np.bool_(len(solution_str.strip()) <= 3)
    return float((exact + has_number + short) / 3)


def exact_score(data_source, solution_str, ground_truth, extra_info=None):
    """1 when the last number of the solution is the ground truth, else 0."""
    return float(_last_number(solution_str) == str(ground_truth))
