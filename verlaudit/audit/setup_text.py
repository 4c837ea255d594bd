"""The wording and the finding shape shared by the setup checks (`setup_changes`, `setup_effect`,
`setup_values`): a list of module / tensor names cut to a few, and a setup finding whose observed record is
the change's own (its ``aspect`` tag dropped), each module saying what the model was expected to be."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from verlaudit.rundir import Finding


def names(xs: list[str], count: int) -> str:
    """``a, b and 3 more``: the names shown, and how many of ``count`` were not (``<model>`` for the root)."""
    shown = ", ".join(x or "<model>" for x in xs)
    return shown + (f" and {count - len(xs)} more" if count > len(xs) else "")


def finding(
    kind: str,
    severity: str,
    role: str,
    who: str,
    msg: str,
    fix: str,
    module: Any,
    observed: Mapping[str, Any],
    *,
    expected: str,
) -> Finding:
    """A setup finding at ``who`` (the setup's spec), naming ``module``, with the change's record as observed."""
    return Finding(
        severity=severity,
        kind=kind,
        role=role,
        where=who,
        message=msg,
        observed={"module": module, **{k: v for k, v in observed.items() if k != "aspect"}},
        expected=expected,
        fix=fix,
    )
