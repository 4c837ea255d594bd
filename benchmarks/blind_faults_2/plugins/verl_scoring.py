"""verl reward functions as they are (``data.compute_score: verl_scoring.py:<fn>``), called per response as
``compute_score(data_source, solution_str, ground_truth, extra_info)``."""

from __future__ import annotations

import re

import numpy as np

LENGTH_PENALTY = 0.05
"""Reward lost per character of difference between the solution's and the ground truth's lengths."""


def _last_number(text: str) -> str | None:
    found = re.findall(r"-?\d+", text)
    return found[-1] if found else None


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """Exact answer (last number) minus a length penalty for rambling; the lengths are kept as a compact
    uint8 array like the rest of the scorer's token statistics."""
    lengths = np.array([len(solution_str), len(ground_truth)], dtype=np.uint8)
    gap = np.abs(lengths[1] - lengths[0])
    correct = float(_last_number(solution_str) == str(ground_truth))
    return {"score": correct - LENGTH_PENALTY * float(gap), "length_gap": float(gap)}


def _arith_score(solution_str, ground_truth):
    return float(_last_number(solution_str) == str(ground_truth))


SCORERS = {"arith/add": _arith_score}


def compute_score_by_source(data_source, solution_str, ground_truth, extra_info=None):
    """Dispatch on the row's source; sources without a scorer get no reward."""
    fn = SCORERS.get(data_source)
    return 0.0 if fn is None else fn(solution_str, ground_truth)
