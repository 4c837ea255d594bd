"""The audit's own failures, kept out of the user's run.

A check, a collector, a module hook or a dispatch mode of the audit that raises is the audit's bug, not the
user's: the run must go on. `Guard` reports each failing piece once (stderr and an ``audit_check_failed``
event: the piece, the step, the error) and the piece is then left out for the rest of the run where
running it again would see a half-updated state. The auditor owns one guard and makes it `current` while it
is entered, so hooks and dispatch modes that do not hold the auditor (`plugins.Recorder`, `probes.ModuleProbe`,
`shadow.FP32Shadow`, `opcount`) report to the same place; with no auditor entered they report to stderr.

What is not guarded, on purpose: the user's own calls (a plug-in's function, the model's forward) raise as
they would without the audit; only the audit's work before and after them is caught.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any


class Guard:
    """Failed pieces of the audit, by name: the first error of each, in the order they failed."""

    def __init__(self, writer: Callable[[], Any] | None = None) -> None:
        self._writer = writer or (lambda: None)
        self.failed: dict[str, str] = {}

    def off(self, name: str) -> bool:
        return name in self.failed

    def report(self, name: str, exc: BaseException, *, step: int | None = None, what: str = "check") -> None:
        if name in self.failed:
            return
        msg = f"{type(exc).__name__}: {exc}"[:500]
        self.failed[name] = msg
        print(f"verlaudit: the audit's {what} {name!r} failed and was skipped ({msg})", file=sys.stderr)
        writer = self._writer()
        if writer is not None:
            try:
                writer.event("audit_check_failed", check=name, error=msg, step=step)
            except Exception:  # noqa: BLE001  (a writer that fails here must not take the run with it)
                pass


_STDERR = Guard()
current: Guard = _STDERR
"""The guard hooks and dispatch modes report to: the entered auditor's, else one that prints only."""


def activate(guard: Guard) -> Guard:
    """Makes ``guard`` current; returns the one it replaces (for `restore`)."""
    global current
    previous, current = current, guard
    return previous


def restore(previous: Guard) -> None:
    global current
    current = previous


def report(name: str, exc: BaseException, *, what: str = "hook") -> None:
    """From a hook or a dispatch mode: the failure goes to the current guard."""
    current.report(name, exc, what=what)
