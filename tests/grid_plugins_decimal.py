"""A verl compute_score whose module keeps a decimal context of two significant digits (for a report) and
returns its score through it (tests/test_reward_grid.py)."""

from __future__ import annotations

import decimal
import math

REPORT = decimal.Context(prec=2)
"""The report's context (two significant digits), used for the score too."""


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """A judge probability (continuous) returned as a Decimal of the module's context."""
    hit = sum(a == b for a, b in zip(solution_str, str(ground_truth))) / max(1, len(str(ground_truth)))
    p = 1.0 / (1.0 + math.exp(-(1.5 + 0.6 * hit + 0.01 * len(solution_str))))
    return float(REPORT.plus(decimal.Decimal(p)))
