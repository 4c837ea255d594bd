"""verl reward function for the addition rows (``data.compute_score``, verl's signature)."""

from __future__ import annotations

import re

import numpy as np

LENGTH_DTYPE = np.float16
_NUMBER = re.compile(r"-?\d+")


def compute_score(data_source, solution_str, ground_truth, extra_info=None, max_chars=48):
    """1 for the right sum (the last number in the response), minus a cubic penalty on the response's
    length relative to the character budget."""
    found = _NUMBER.findall(solution_str)
    correct = 1.0 if found and found[-1] == str(ground_truth) else 0.0
    length = np.asarray(len(solution_str), dtype=LENGTH_DTYPE)
    budget = np.asarray(max_chars, dtype=LENGTH_DTYPE)
    penalty = length**3 / budget**3
    return {"score": float(correct - 0.5 * penalty), "correct": correct}
