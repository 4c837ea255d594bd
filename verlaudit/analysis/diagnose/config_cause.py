"""A numeric key outside its sane range as a cause, when the run confirms it.

`verlaudit.audit.config_ranges` records at setup, as ``info``, every key of its table (`RANGES`) the run
sets outside the range recipes use, with the metric tests that would show the consequence
(``observed["confirm"]``: ``critic/grad_norm`` 0 at every step for a vf_coef of 0, the share of truncated
importance weights for a threshold below 1, skipped steps for a loss scale that doubles every step, the
DPO margins past the sigmoid's saturation for a huge beta). `range_causes` reads those series from the
run's metrics: a confirmed violation becomes a cause at the row's severity, stamped at setup (the key was
set before anything ran), with the metric as its evidence and the fix that sets the key inside its range;
an unconfirmed one stays information (no cause). Exercised by `pytest tests/test_config_ranges.py`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from verlaudit import kinds as K
from verlaudit.analysis.causes import Cause, Fix
from verlaudit.analysis.diagnose.runview import fmt
from verlaudit.rundir import RunDir


def _v(x: Any) -> str:
    return fmt(float(x)) if isinstance(x, (int, float)) and not isinstance(x, bool) else str(x)


RANGE_KINDS = frozenset(
    {
        K.CONFIG_COEF_ZERO,
        K.CONFIG_SATURATED,
        K.CONFIG_IS_TRUNCATION,
        K.CONFIG_SCALER,
        K.CONFIG_LOSS_SCALE_FACTOR,
    }
)


def confirmed(test: Mapping[str, Any], series: Sequence[tuple[int, float]]) -> str | None:
    """The evidence line when ``series`` passes ``test`` (`verlaudit.audit.config_ranges.Confirm`), else None."""
    values = [v for _, v in series if v == v]  # NaN never confirms a bound
    if not values:
        return None
    kind, bound, metric = test.get("test"), float(test.get("bound", 0.0)), test.get("metric")
    n = len(values)
    if kind == "all_at_most" and all(v <= bound for v in values):
        return f"{metric} at most {fmt(bound)} at all {n} recorded steps ({test.get('means')})"
    if kind == "any_above":
        hits = [(s, v) for s, v in series if v > bound]
        if hits:
            at = ", ".join(f"step {s}: {fmt(v)}" for s, v in hits[:4])
            return f"{metric} above {fmt(bound)} at {len(hits)} of {n} steps ({at}; {test.get('means')})"
    if kind == "mean_at_least":
        mean = sum(values) / n
        if mean >= bound:
            return (
                f"{metric} averages {fmt(mean)} over {n} steps, at least {fmt(bound)} ({test.get('means')})"
            )
    if kind == "absmax_at_least":
        s, v = max(series, key=lambda sv: abs(sv[1]) if sv[1] == sv[1] else -1.0)
        if abs(v) >= bound:
            return (
                f"{metric} reaches {fmt(v)} at step {s}, |value| at least {fmt(bound)} ({test.get('means')})"
            )
    return None


def range_causes(run: RunDir) -> list[Cause]:
    """One cause per range finding whose consequence the run's metrics show (module docstring)."""
    out: list[Cause] = []
    for f in run.findings:
        if f.kind not in RANGE_KINDS or not isinstance(f.observed, dict):
            continue
        obs = f.observed
        lines = [
            line
            for test in obs.get("confirm") or []
            if isinstance(test, dict) and (line := confirmed(test, run.series(str(test.get("metric")))))
        ]
        if not lines:
            continue
        key, value = obs.get("key") or f.where, obs.get("fix_value")
        verl = None
        why = f.fix or ""
        if "(verl: " in why:
            verl = why.split("(verl: ", 1)[1].rstrip(")")
        fix = Fix(
            f"{key}: {value}",
            verl,
            f"{key} inside its range ({f.expected}); the run shows the consequence: {lines[0]}",
        )
        out.append(
            Cause(
                str(obs.get("severity") or "warning"),
                f"finding:{f.kind}",
                f"{f.kind}: {key} {_v(obs.get('value'))} is outside its sane range, and the run shows it",
                f.message,
                evidence=[
                    *lines,
                    f"{key} = {_v(obs.get('value'))}; range bound {_v(obs.get('bound'))}, default "
                    f"{_v(obs.get('default'))} ({obs.get('source')})",
                ],
                fixes=[fix],
                step=None,
                where=key,
                phase=None,
                role=f.role,
                cls=K.class_of(f.kind),
                seq=-1.0,
            )
        )
    return out
