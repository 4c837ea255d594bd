"""The machinery of the finding-kind registry (`verlaudit.kinds`): the `Kind` record, the two tables and
the functions that register a finding kind (`_f`) and a cause kind (`_c`) once, with a class from
`verlaudit.kind_classes`. Split out of kinds.py for length; nothing outside the registry's modules uses it."""

from __future__ import annotations

import dataclasses

from verlaudit.kind_classes import CLASSES


@dataclasses.dataclass(frozen=True)
class Kind:
    """One registered kind: its name as written, its root-cause class, and what it means."""

    name: str
    cls: str
    meaning: str


_FINDINGS: dict[str, Kind] = {}
_CAUSES: dict[str, Kind] = {}


def _register(table: dict[str, Kind], name: str, cls: str, meaning: str) -> str:
    if name in table:
        raise ValueError(f"verlaudit.kinds: {name!r} registered twice")
    if cls not in CLASSES:
        raise ValueError(
            f"verlaudit.kinds: {name!r}: unknown class {cls!r}; expected one of {', '.join(CLASSES)}"
        )
    table[name] = Kind(name, cls, meaning)
    return name


def _f(name: str, cls: str, meaning: str) -> str:
    return _register(_FINDINGS, name, cls, meaning)


def _c(name: str, cls: str, meaning: str) -> str:
    return _register(_CAUSES, name, cls, meaning)
