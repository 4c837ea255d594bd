"""Where the run is: the step, the phase, whether backward is under way, whether the step is sampled.

The `Auditor` writes a `StepContext` as the trainer's events arrive and hands the same object to
the module probes and collectors, which only read it (they never reach back into the auditor).
`PhaseTimer` keeps verl's ``timing_s/<phase>``. Exercised by `pytest tests/test_audit_collectors.py`
and `pytest tests/test_worker.py` (the timing keys).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Iterator
from typing import Any


@dataclasses.dataclass
class StepContext:
    """The step and phase the trainer is in; one per run, updated in place."""

    step: int | None = None
    """The current training step (0-based); None before the first."""
    phase: str | None = None
    """The innermost phase the trainer has entered (`trainer.events.PHASES`), None between phases."""
    in_backward: bool = False
    """Between a loss and its backward: forward calls then are activation-checkpoint recomputes."""
    sampled: bool = False
    """This step is audited at the full level (module hooks on)."""
    failed_phase: str | None = None
    """The innermost phase an exception left (the first one recorded): where the run died."""

    def start_step(self, step: int, *, sampled: bool) -> None:
        self.step, self.sampled, self.in_backward = step, sampled, False

    def where(self) -> dict[str, Any]:
        """``step`` and ``phase`` keyword arguments for a `Finding`."""
        return {"step": self.step, "phase": self.phase}

    @contextlib.contextmanager
    def in_phase(self, name: str) -> Iterator[None]:
        previous, self.phase = self.phase, name
        try:
            yield
        except BaseException:
            if self.failed_phase is None:  # innermost phase first: that is where it died
                self.failed_phase = name
            raise
        finally:
            self.phase = previous


class PhaseTimer:
    """Host wall time per phase within a step, for verl's ``timing_s/<phase>`` metrics."""

    def __init__(self) -> None:
        self._seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        # no device sync (a sync per phase would cost overlap): on a GPU, work still queued when a
        # phase ends is counted in the phase that next waits for it; the rollout and the optimizer
        # step end on host reads
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self._seconds[name] = self._seconds.get(name, 0.0) + time.perf_counter() - t0

    def reset(self) -> None:
        self._seconds = {}

    def take(self) -> dict[str, float]:
        """``{"timing_s/<phase>": seconds}`` for the step so far; starts the next step at zero."""
        out = {f"timing_s/{name}": v for name, v in self._seconds.items()}
        self._seconds = {}
        return out
