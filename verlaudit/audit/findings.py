"""Finding bookkeeping: fold repeats of the same (kind, role, where, severity) into one record with a count.

The first occurrence keeps its step, phase and numbers; later ones only raise ``count``. New
findings are appended to ``findings.jsonl`` at once (so a run killed a moment later still shows
them). Severity is part of the key: an error is never folded into an earlier info or warning of the
same kind and place (a reward function's "returns a list" info must not swallow its later "2 rewards
are non-finite" error). When counts of already-written findings change, the file is rewritten atomically at the next
`flush`. `FindingSink` is all a probe or collector needs of it (a plain list will do in tests).
Exercised by `pytest tests/test_audit_checks.py tests/test_audit_collectors.py`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Protocol

from verlaudit import kinds as K
from verlaudit.rundir import Finding, RunWriter

ROLE_WIDE = frozenset({K.COMPUTE, K.ISLAND, K.HEADROOM})
"""Kinds that describe a whole role (every Linear computing in the wrong dtype is one problem)."""


class FindingSink(Protocol):
    """Where a probe or collector puts its findings (a `FindingLog`, or a list's ``extend`` in tests)."""

    def extend(self, findings: Iterable[Finding]) -> None: ...


def _key(f: Finding) -> tuple[str, str | None, str | None, str]:
    return (f.kind, f.role, None if f.kind in ROLE_WIDE else f.where, f.severity)


class FindingLog:
    """Deduplicating store of findings, optionally mirrored to a run directory."""

    def __init__(self, writer: RunWriter | None = None) -> None:
        self.writer = writer
        self._by_key: dict[tuple[str, str | None, str | None, str], Finding] = {}
        self._dirty = False
        self.new_this_step: dict[str, int] = {"error": 0, "warning": 0, "info": 0}

    def add(self, finding: Finding) -> bool:
        """Records ``finding``; returns True when it is new (not a repeat). Kinds in `ROLE_WIDE`
        fold over the whole role (the first module seen names it)."""
        key = _key(finding)
        old = self._by_key.get(key)
        if old is not None:
            self._by_key[key] = dataclasses.replace(old, count=old.count + finding.count)
            self._dirty = True
            return False
        self._by_key[key] = finding
        self.new_this_step[finding.severity] += 1
        if self.writer is not None:
            self.writer.finding(finding)
        return True

    def extend(self, findings: Iterable[Finding]) -> None:
        for f in findings:
            self.add(f)

    def take_step_counts(self) -> dict[str, int]:
        """New findings per severity since the last call (for ``audit/findings/<severity>``)."""
        out, self.new_this_step = self.new_this_step, {"error": 0, "warning": 0, "info": 0}
        return out

    def relabel(self, pick, severity: str, note: str) -> int:
        """Sets ``severity`` on the findings ``pick(finding)`` selects, appending ``note`` to their
        message (a later judgement, e.g. the loss scaler handled an overflow); returns how many."""
        n = 0
        for key, f in list(self._by_key.items()):
            if f.severity == severity or not pick(f):
                continue
            if self.new_this_step.get(f.severity, 0) > 0:
                self.new_this_step[f.severity] -= 1
                self.new_this_step[severity] += 1
            del self._by_key[key]
            new = dataclasses.replace(f, severity=severity, message=f"{f.message}; {note}")
            same = self._by_key.get(_key(new))
            # an earlier finding already at the new severity absorbs this one's count (it came first)
            self._by_key[_key(new)] = dataclasses.replace(same, count=same.count + f.count) if same else new
            self._dirty = True
            n += 1
        return n

    def flush(self) -> None:
        """Rewrites findings.jsonl when repeat counts changed since it was written."""
        if self._dirty and self.writer is not None:
            self.writer.replace_findings(self.all())
        self._dirty = False

    def all(self) -> list[Finding]:
        return list(self._by_key.values())

    def find(self, kind: str, *, role: str | None = None, where: str | None = None) -> list[Finding]:
        """Findings of ``kind`` (a prefix ending in ``/`` matches a family), filtered by role/where."""
        return [
            f
            for f in self._by_key.values()
            if (f.kind == kind or (kind.endswith("/") and f.kind.startswith(kind)))
            and (role is None or f.role == role)
            and (where is None or f.where == where)
        ]
