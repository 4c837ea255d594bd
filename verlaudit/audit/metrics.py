"""The step's metrics line: the trainer's metrics plus the audit's own numbers, one flat dict.

`StepNumbers` collects what the audit measures during a step (reward spread, gradient and update
counts); `step_line` puts the line together at the step's end from the trainer's metrics, the
memory and timing collectors, those numbers and the step's finding counts. Key names follow
``component/quantity/stat`` (verl's where verl has one). Exercised by
`pytest tests/test_audit_collectors.py tests/test_worker.py`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any


class StepNumbers:
    """The audit's numbers for the current step, in the order they were first set."""

    def __init__(self) -> None:
        self.values: dict[str, float] = {}

    def reset(self) -> None:
        self.values = {}

    def put(self, key: str, value: float) -> None:
        self.values[key] = value

    def max(self, key: str, value: float) -> None:
        """Keeps the largest value seen this step (several micro-batches or optimizer steps)."""
        self.values[key] = max(self.values.get(key, 0.0), value)

    def add(self, key: str, value: float) -> None:
        self.values[key] = self.values.get(key, 0) + value

    def ensure(self, key: str, value: float = 0) -> None:
        """Sets ``key`` only if this step has not set it yet (a count that is zero, not missing)."""
        self.values.setdefault(key, value)


def step_line(
    trainer: Mapping[str, Any],
    *,
    memory: Mapping[str, float],
    timing: Mapping[str, float],
    audit: Mapping[str, float] | None,
    counts: Mapping[str, int],
    sampled: bool,
) -> dict[str, Any]:
    """One metrics.jsonl line. ``audit`` is None at the ``off`` level (no numerics keys at all)."""
    out = dict(trainer)
    out.update(memory)
    out.update(timing)
    if audit is not None:
        out.update(audit)
    out["audit/findings/error"], out["audit/findings/warning"] = counts["error"], counts["warning"]
    out["audit/full"] = 1.0 if sampled else 0.0
    return out


def audit_numbers(
    trained_roles: Iterable[str], numbers: Mapping[str, float], act_absmax: Mapping[str, float] | None
) -> dict[str, float]:
    """The audit's numerics keys: a zero ``nonfinite_grads`` for every trained role (so a series has
    no holes), the step's numbers, and the per-role activation maxima of a sampled step."""
    out: dict[str, float] = {f"numerics/{role}/nonfinite_grads": 0 for role in trained_roles}
    out.update(numbers)
    for role, v in (act_absmax or {}).items():
        out[f"numerics/{role}/act_absmax"] = v
    return out
