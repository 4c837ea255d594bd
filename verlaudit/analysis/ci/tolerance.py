"""A baseline's trajectory tolerance model: how far a metric may move at each step, per variant
(dtype), before `verlaudit compare` calls it a regression rather than kernel noise.

The model is measured, not chosen: `benchmarks/derive_tolerances.py` runs the suite under every
CPU kernel condition it can produce (ATen / oneDNN / MKL instruction sets, threads, oneDNN off) and
`derive` turns the trajectories into, per variant, metric and step::

    spread(s)    = max - min over conditions of the metric at step s
    envelope(s)  = max(spread(0..s))                (noise does not shrink along a trajectory)
    step_atol(s) = max(floor, k x envelope(s))
    floor        = FLOOR_ULPS x 2**-23 x max|reference trajectory|   (fp32 rounding of the metric)

and the same for the mean residual over the first n steps (``mean_atol``), which catches a
one-sided drift that stays inside the per-step band. The safety factor k covers kernels the
derivation could not run (AMX, AVX512-FP16, GPUs): per variant, `safety_factors` makes it a margin
over the leave-one-factor-out ratios of `loo_ratios` (how far the conditions sharing one kernel
setting land outside the envelope of the others). The file is ``tolerances.json`` in the baseline
directory; `load_model` reads it back (field-path errors for a malformed file), `violations` and
`step_tolerances` apply it; `verlaudit.analysis.ci.baseline_notes` explains it in BASELINE.md.
Exercised by `pytest tests/test_tolerance.py tests/test_tolerance_replay.py tests/test_compare.py`.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

TOLERANCE_FILE = "tolerances.json"
FORMAT = 1
MODELLED_METRICS = (
    "actor/loss",
    "actor/grad_norm",
    "actor/entropy",
    "actor/ppo_kl",
    "critic/vf_loss",
    "critic/grad_norm",
)
"""What compare checks with the model: the loss; the gradient norms, which see a loss weight or a
clipping change that Adam's scale invariance hides from the loss; the entropy and the policy KL,
which move with the policy. All continuous in the parameters: counts such as the clip fraction or
the reward of sampled tokens jump when one token flips, which no per-step noise band describes."""
RECORDED_METRICS = (*MODELLED_METRICS, "actor/pg_clipfrac", "critic/values/mean", "critic/score/mean")
"""What the derivation records per step (its fixture)."""
K_MIN = 4.0
LOFO_MARGIN = 2.0
"""Safety factor per variant: max(K_MIN, LOFO_MARGIN x the largest leave-one-factor-out ratio); why
these two numbers is in the baseline's BASELINE.md ('Why k')."""
FLOOR_ULPS = 16.0
"""The floor in fp32 ulps of the metric's magnitude: where every condition agrees bit for bit, an
unmeasured kernel may still reorder an fp32 reduction, which moves it by a few ulps."""
EPS32 = 2.0**-23

Trajectories = Mapping[str, Mapping[str, Sequence[float | None]]]
"""variant -> metric -> value per step (None where the step did not record it)."""


# --------------------------------------------------------------------------------------------
# derivation: pure functions over {condition: trajectories}


def _finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _column(runs: Mapping[str, Trajectories], variant: str, metric: str) -> list[list[float]]:
    """Per step, the finite values across conditions (steps every condition recorded)."""
    series = [list(r[variant][metric]) for r in runs.values()]
    n = min(len(s) for s in series)
    return [[s[i] for s in series if _finite(s[i])] for i in range(n)]


def spread(values_per_step: Sequence[Sequence[float]]) -> list[float]:
    """max - min per step: the largest difference between any two conditions (the baseline is made
    under one of them, CI runs under another)."""
    return [max(v) - min(v) if len(v) > 1 else 0.0 for v in values_per_step]


def envelope(xs: Sequence[float]) -> list[float]:
    out, m = [], 0.0
    for x in xs:
        m = max(m, x)
        out.append(m)
    return out


def prefix_means(series: Sequence[float]) -> list[float]:
    out, total = [], 0.0
    for i, x in enumerate(series):
        total += x
        out.append(total / (i + 1))
    return out


def metric_model(
    runs: Mapping[str, Trajectories],
    variant: str,
    metric: str,
    *,
    reference: str,
    safety: float,
    floor_ulps: float = FLOOR_ULPS,
) -> dict[str, Any]:
    """The tolerance model of one metric of one variant (JSON-ready)."""
    cols = _column(runs, variant, metric)
    ref = [x for x in runs[reference][variant][metric][: len(cols)] if _finite(x)]
    floor = floor_ulps * EPS32 * max((abs(x) for x in ref), default=0.0)
    sp = spread(cols)
    # prefix means need every step of a condition: conditions with a gap are left out of the mean
    full = [r[variant][metric][: len(cols)] for r in runs.values()]
    means = [prefix_means(s) for s in full if all(_finite(x) for x in s)]
    msp = spread([[m[i] for m in means] for i in range(len(cols))]) if means else [0.0] * len(cols)
    return {
        "floor": floor,
        "spread": sp,
        "step_atol": [max(floor, safety * e) for e in envelope(sp)],
        "mean_spread": msp,
        "mean_atol": [max(floor, safety * e) for e in envelope(msp)],
    }


def derive(
    runs: Mapping[str, Trajectories],
    *,
    reference: str,
    safety: float | Mapping[str, float],
    metrics: Sequence[str] = MODELLED_METRICS,
    presets: Mapping[str, str] | None = None,
    floor_ulps: float = FLOOR_ULPS,
) -> dict[str, Any]:
    """{condition: trajectories} -> the tolerances.json content (without its ``derivation`` notes);
    ``safety``: one k for every variant, or k per variant."""
    if reference not in runs:
        raise ValueError(f"reference condition {reference!r} not among {', '.join(runs)}")
    variants = list(runs[reference])
    steps = min(len(r[v][m]) for r in runs.values() for v in variants for m in metrics)
    ks = safety if isinstance(safety, Mapping) else dict.fromkeys(variants, safety)
    return {
        "format": FORMAT,
        "steps": steps,
        "floor_ulps": floor_ulps,
        "conditions": list(runs),
        "variants": {
            v: {
                "preset": (presets or {}).get(v, v),
                "safety": ks[v],
                "metrics": {
                    m: metric_model(runs, v, m, reference=reference, safety=ks[v], floor_ulps=floor_ulps)
                    for m in metrics
                },
            }
            for v in variants
        },
    }


def safety_factors(
    loo: Mapping[str, Mapping[str, Mapping[str, float]]],
    exclude: Sequence[str] = (),
    k_min: float = K_MIN,
    margin: float = LOFO_MARGIN,
) -> dict[str, float]:
    """{variant: {metric: {factor: leave-one-factor-out ratio}}} -> k per variant: ``margin`` x the
    largest ratio over the factors not in ``exclude`` (an unmeasured machine may land further out
    than any setting we left out), at least ``k_min``; rounded up to 0.1."""
    out = {}
    for v, per_metric in loo.items():
        worst = max(
            (r for ratios in per_metric.values() for f, r in ratios.items() if f not in exclude), default=0.0
        )
        out[v] = math.ceil(max(k_min, margin * worst) * 10) / 10
    return out


def loo_ratios(
    runs: Mapping[str, Trajectories],
    variant: str,
    metric: str,
    groups: Mapping[str, Sequence[str]],
    *,
    reference: str,
    floor_ulps: float = FLOOR_ULPS,
) -> dict[str, float]:
    """Leave one factor out: for each group (the conditions that share one kernel setting, e.g. every
    condition with ``ATEN_CPU_CAPABILITY=default``), the largest ratio, over its conditions and the
    steps, of (the largest |d| to any remaining condition) / (the tolerance the remaining conditions
    give with k = 1). Above 1: a machine with that setting, had it not been measured, would have
    fallen outside the bare envelope; k must exceed it."""
    out = {}
    for label, members in groups.items():
        rest = {k: r for k, r in runs.items() if k not in members}
        if not rest or reference not in rest:
            continue
        mm = metric_model(rest, variant, metric, reference=reference, safety=1.0, floor_ulps=floor_ulps)
        worst = 0.0
        for c in members:
            mine = runs[c][variant][metric]
            for s, atol in enumerate(mm["step_atol"]):
                vals = [r[variant][metric][s] for r in rest.values() if _finite(r[variant][metric][s])]
                if _finite(mine[s]) and vals:
                    d = max(abs(mine[s] - x) for x in vals)
                    worst = max(worst, d / atol if atol > 0 else (math.inf if d else 0.0))
        out[label] = worst
    return out


def factor_groups(settings: Mapping[str, Mapping[str, Any]]) -> dict[str, list[str]]:
    """{condition: {setting: value}} -> {"setting=value": conditions that have it}."""
    out: dict[str, list[str]] = {}
    for c, kv in settings.items():
        for k, v in kv.items():
            out.setdefault(f"{k}={v}", []).append(c)
    return out


# --------------------------------------------------------------------------------------------
# checking a trajectory against the model (also what the derivation uses for planted changes)


@dataclasses.dataclass(frozen=True, kw_only=True)
class MetricModel:
    step_atol: tuple[float, ...]
    """Allowed |now - baseline| at step s (index s); steps beyond are not covered by the model."""
    mean_atol: tuple[float, ...]
    """Allowed |mean(now - baseline)| over the first n compared steps (index n - 1)."""
    floor: float
    """The smallest tolerance (fp32 rounding of the metric's magnitude)."""

    def atol(self, step: int) -> float | None:
        return self.step_atol[step] if 0 <= step < len(self.step_atol) else None

    def mean(self, n: int) -> float | None:
        return self.mean_atol[n - 1] if 1 <= n <= len(self.mean_atol) else None


@dataclasses.dataclass(frozen=True, kw_only=True)
class VariantModel:
    preset: str
    """The precision preset the variant was measured with (lookup for other variant names)."""
    safety: float
    """The safety factor k its tolerances were derived with."""
    metrics: Mapping[str, MetricModel]


@dataclasses.dataclass(frozen=True, kw_only=True)
class ToleranceModel:
    path: Path
    """The tolerances.json it was read from."""
    steps: int
    """Steps 0..steps-1 are covered."""
    variants: Mapping[str, VariantModel]

    def for_variant(self, name: str, preset: str | None) -> tuple[str, VariantModel] | None:
        """(label, model) by variant name (a ``-sN`` seed suffix ignored), else by precision preset."""
        base = name.rsplit("-s", 1)[0] if name.rsplit("-s", 1)[-1].isdigit() else name
        for key in (name, base):
            if key in self.variants:
                return key, self.variants[key]
        hits = [k for k, v in self.variants.items() if preset and v.preset == preset]
        return (f"{hits[0]} (preset {preset})", self.variants[hits[0]]) if len(hits) == 1 else None


def _floats(x: Any, where: str) -> tuple[float, ...]:
    if not isinstance(x, list) or not x or not all(_finite(v) and v >= 0 for v in x):
        raise ValueError(f"{where}: expected a non-empty list of non-negative numbers")
    return tuple(float(v) for v in x)


def load_model(baseline: str | Path) -> ToleranceModel | None:
    """The baseline directory's tolerances.json, or None when it has none."""
    path = Path(baseline) / TOLERANCE_FILE
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(
            f"{path}: not readable JSON ({e}); regenerate it with benchmarks/derive_tolerances.py"
        ) from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ValueError(
            f"{path}: format: expected {FORMAT} (a mapping written by benchmarks/derive_tolerances.py)"
        )
    variants = data.get("variants")
    if not isinstance(variants, dict) or not variants:
        raise ValueError(f"{path}: variants: expected a non-empty mapping of variant -> model")
    out = {}
    for v, vm in variants.items():
        if not isinstance(vm, dict) or not isinstance(vm.get("metrics"), dict):
            raise ValueError(f"{path}: variants.{v}.metrics: expected a mapping of metric -> model")
        metrics = {}
        for m, mm in vm["metrics"].items():
            where = f"{path}: variants.{v}.metrics.{m}"
            if not isinstance(mm, dict):
                raise ValueError(f"{where}: expected a mapping with step_atol, mean_atol, floor")
            floor = mm.get("floor")
            if not _finite(floor) or floor < 0:
                raise ValueError(f"{where}.floor: expected a non-negative number, got {floor!r}")
            metrics[m] = MetricModel(
                step_atol=_floats(mm.get("step_atol"), f"{where}.step_atol"),
                mean_atol=_floats(mm.get("mean_atol"), f"{where}.mean_atol"),
                floor=float(floor),
            )
        k = vm.get("safety")
        if not _finite(k) or k < 1:
            raise ValueError(f"{path}: variants.{v}.safety: expected a number >= 1, got {k!r}")
        out[str(v)] = VariantModel(preset=str(vm.get("preset", v)), safety=float(k), metrics=metrics)
    steps = data.get("steps")
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
        raise ValueError(f"{path}: steps: expected an integer >= 1, got {steps!r}")
    return ToleranceModel(path=path, steps=steps, variants=out)


def mean_residual(base: Sequence[float], now: Sequence[float]) -> float:
    """mean(now) - mean(base), computed like the model's prefix means (so a measured condition is
    never outside the band by a rounding of the order of summation)."""
    return prefix_means(now)[-1] - prefix_means(base)[-1] if base else 0.0


def violations(
    model: MetricModel, base: Sequence[float | None], now: Sequence[float | None], steps: int | None = None
) -> list[tuple[str, float, float]]:
    """(where, |d|, tolerance) for each step (``step s``) or mean (``mean of n``) outside the model,
    over the first ``steps`` steps (default: all the model covers)."""
    n = min(len(base), len(now), len(model.step_atol), steps or len(model.step_atol))
    out, bs, xs = [], [], []
    for s in range(n):
        b, x = base[s], now[s]
        if not _finite(b):
            continue
        if not _finite(x):
            out.append((f"step {s}", math.inf, model.step_atol[s]))
            continue
        bs.append(b)
        xs.append(x)
        if abs(x - b) > model.step_atol[s]:
            out.append((f"step {s}", abs(x - b), model.step_atol[s]))
    d = abs(mean_residual(bs, xs))
    if bs and d > model.mean_atol[len(bs) - 1]:
        out.append((f"mean of {len(bs)}", d, model.mean_atol[len(bs) - 1]))
    return out


Model = tuple[str, MetricModel]
"""(label, per-step model) of one metric of one variant, as compare applies it."""


def step_tolerances(
    steps: Sequence[int], tol: Mapping[str, float], model: Model | None, explicit: Mapping[str, str]
) -> list[tuple[float, str]]:
    """(atol, where it came from) per compared step: an explicit loss_atol, else the model for the
    steps it covers, else the default."""
    if "loss_atol" in explicit:
        return [(tol["loss_atol"], f"loss_atol ({explicit['loss_atol']})")] * len(steps)
    out = []
    for s in steps:
        a = model[1].atol(s) if model else None
        out.append((a, f"model {model[0]}") if a is not None else (tol["loss_atol"], "loss_atol (default)"))
    return out


def mean_tolerance(
    n: int, tol: Mapping[str, float], model: Model | None, explicit: Mapping[str, str]
) -> tuple[float, str]:
    if "loss_mean_atol" in explicit:
        return tol["loss_mean_atol"], f"loss_mean_atol ({explicit['loss_mean_atol']})"
    a = model[1].mean(n) if model and n else None
    return (
        (a, f"model {model[0]}")
        if a is not None and model
        else (tol["loss_mean_atol"], "loss_mean_atol (default)")
    )


def tolerance_label(
    steps: Sequence[int], per_step: Sequence[tuple[float, str]], mean: tuple[float, str]
) -> str:
    """'steps 0-2 <= [3e-05, 6e-05, 1e-04] (model fp16); steps 3-39 <= 0.05 (loss_atol (default)); ...'"""
    parts, i = [], 0
    while i < len(steps):
        j = i
        while j + 1 < len(steps) and per_step[j + 1][1] == per_step[i][1]:
            j += 1
        vals = [a for a, _ in per_step[i : j + 1]]
        shown = (
            f"{vals[0]:.2g}"
            if len(set(vals)) == 1
            else (
                "[" + ", ".join(f"{v:.2g}" for v in vals) + "]"
                if len(vals) <= 8
                else f"[{vals[0]:.2g} .. {vals[-1]:.2g}]"
            )
        )
        rng = f"step {steps[i]}" if i == j else f"steps {steps[i]}-{steps[j]}"
        parts.append(f"{rng} |d|<={shown} ({per_step[i][1]})")
        i = j + 1
    return "; ".join([*parts, f"|mean d|<={mean[0]:.2g} ({mean[1]})"])
