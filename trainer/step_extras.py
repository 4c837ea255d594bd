"""The current step's extra metrics: values reported by code a recipe calls without reading back (the
extra keys of a verl ``compute_score`` dict, `trainer.verl_data`), summed here until
`trainer.common.StepLog` ends the step. A module of its own, importing nothing of the trainer, so the
reward code can report without importing the recipe machinery. Exercised by
`pytest tests/test_verl_data.py`.
"""

from __future__ import annotations

from collections.abc import Mapping

STEP_EXTRAS: dict[str, list[float]] = {}
"""name -> [sum, count] since the step started."""


def add_step_metrics(values: Mapping[str, tuple[float, int]]) -> None:
    """Adds ``name -> (sum, count)`` to the current step's extra metrics. `StepLog.end` puts their means
    (over the step's calls and over ranks) beside the recipe's own metrics, which win a name clash."""
    for name, (total, count) in values.items():
        acc = STEP_EXTRAS.setdefault(name, [0.0, 0])
        acc[0] += float(total)
        acc[1] += int(count)


def take() -> dict[str, tuple[float, int]]:
    """The step's ``name -> (sum, count)``, emptying the store."""
    out = {k: (v[0], v[1]) for k, v in STEP_EXTRAS.items()}
    STEP_EXTRAS.clear()
    return out
