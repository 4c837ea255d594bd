"""Fixes checked against the run before they are offered: none that changes nothing, none that the
evidence contradicts.

- A fix that sets a suite key (``algo.temperature: 1.0``) to the value the run already had -- the
  resolved config in manifest.json, and for ``precision.overrides.<role>.<field>`` the role's resolved
  policy when the suite does not override it -- changes nothing and is dropped (`already_set`). Placeholders
  (``algo.lr: <half>``) and keys the manifest does not hold are kept.
- A fix that raises the fp16 loss scale is dropped from a run that overflowed (an overflow or skipped
  steps recorded as warnings or errors, not the scaler's calibration): a larger scale overflows sooner. Where it was
  the only way out that the cause offered, bf16 (fp32's exponent range) takes its place
  (`contradicted`).

`checked` applies both to a diagnosis' causes in place. Exercised by `pytest tests/test_dynamics.py`.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from typing import Any

import yaml

from verlaudit import kinds as K
from verlaudit import verl_keys as V
from verlaudit.analysis.causes import Cause, Fix
from verlaudit.analysis.diagnose.runview import cfg, role_policy
from verlaudit.rundir import RunDir

SETTING = re.compile(r"^\s*([A-Za-z_]\w*(?:\.\w+)+)\s*:\s*(\S.*?)\s*$")
"""A fix's ``suite`` that sets one key: ``dotted.key: value``."""
RAISE_SCALE = re.compile(
    r"\b(?:raise|increase|larger|higher|bigger)\b[^.;]{0,30}\b(?:loss scale|init_scale)\b"
    r"|\b(?:loss scale|init_scale)\b[^.;]{0,30}\b(?:raised|increased|larger|higher)\b",
    re.I,
)
"""A fix that makes the fp16 loss scale larger."""
_OVERFLOW_KINDS = frozenset({K.OVERFLOW, K.SKIPPED_STEP})
"""Findings that say values did overflow (not `K.HEADROOM`: near the maximum is not over it)."""


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return math.isclose(float(a), float(b), rel_tol=1e-9, abs_tol=0.0)
    return a == b


def already_set(run: RunDir, fix: Fix) -> bool:
    """Whether ``fix`` sets a suite key to the value the run's resolved config already holds."""
    m = SETTING.match(fix.suite or "")
    if not m:
        return False
    try:
        wanted = yaml.safe_load(m.group(2))
    except yaml.YAMLError:
        return False
    if isinstance(wanted, str) and wanted.startswith("<"):
        return False  # a placeholder: <half>, <lower>
    missing = object()
    path = m.group(1).split(".")
    current = cfg(run, *path, default=missing)
    if current is missing and path[:2] == ["precision", "overrides"] and len(path) == 4:
        # a role's field the suite does not override: the value the run resolved it to (manifest policy)
        current = role_policy(run, path[2]).get(path[3], missing)
    return current is not missing and current is not None and _same(current, wanted)


def overflowed(run: RunDir, causes: Sequence[Cause] = ()) -> bool:
    """The run overflowed in fp16: an overflow or a skipped step recorded as a problem (the scaler's
    calibration skips are recorded as info), or a collapsed loss scale; warnings and errors only."""
    if any(f.kind in _OVERFLOW_KINDS for f in run.findings if f.severity != "info"):
        return True
    return any(
        c.kind == "loss_scale_collapse" or (c.kind == "overflow_skips" and c.severity != "info")
        for c in causes
    )


def contradicted(fix: Fix, *, overflowing: bool) -> bool:
    """Whether the evidence contradicts ``fix`` (a larger loss scale in a run that overflows)."""
    return overflowing and bool(RAISE_SCALE.search(f"{fix.suite or ''} {fix.why}"))


BF16 = Fix(
    "precision.preset: bf16",
    V.PARAM_DTYPE_BF16,
    "the run overflows in fp16, so a larger loss scale is no way out: bf16 has fp32's exponent range",
)


def checked(run: RunDir, causes: list[Cause]) -> list[Cause]:
    """Drops from every cause the fixes that change nothing or that the evidence contradicts."""
    overflowing = overflowed(run, causes)
    for c in causes:
        kept = [f for f in c.fixes if not already_set(run, f)]
        if overflowing and any(contradicted(f, overflowing=True) for f in kept):
            kept = [f for f in kept if not contradicted(f, overflowing=True)]
            if not kept and not already_set(run, BF16):
                kept = [BF16]
        c.fixes = kept
    return causes
