"""``verlaudit recommend SUITE.yaml``: the cheapest precision recipe whose measured error against fp32
stays within a stated tolerance, for the suite's model, algorithm and target hardware.

Candidates (`RECIPES`, and `CHECKPOINTING` choices crossed with them): fp32, fp16 with dynamic loss
scaling, bf16 autocast over fp32 masters, bf16-pure, and per-role mixes (an fp32 critic under bf16
for PPO, a bf16 reference under fp32 when there is a reference). Each is planned first
(`verlaudit.plan.planner.plan_config`: one that does not fit the target loses without running),
then run for a few steps with the fp32 shadow on the first step (`verlaudit.run.batch`: the candidates
share a worker process, a failure ends it and the rest go on in a fresh one; a run directory each). From the run directories alone (the interface)
come its cost -- the median step time of the steps after the shadowed one and the planned and
measured memory -- and its error against fp32: the actor's log-prob error per token and the largest
module error over its rounding from the shadow, the largest fraction of updates lost to rounding.
Candidates within the tolerance (`Tolerance`) are ranked by cost; the table, the suite variant to
paste and why each loser lost are printed, and written to ``recommend.md`` beside the runs.
Exercised by `pytest tests/test_recommend.py`.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Mapping, Sequence
from typing import Any

import yaml

from verlaudit.analysis.report import build as report_mod
from verlaudit.audit.shadow import EXCESS
from verlaudit.run.suite import Suite, check_variant_name
from verlaudit.rundir import GRADHEALTH, RunDir, read_records, to_float

RECIPES: dict[str, dict[str, Any]] = {
    "fp32": {"preset": "fp32"},
    "fp16": {"preset": "fp16"},
    "bf16": {"preset": "bf16"},
    "bf16-pure": {"preset": "bf16-pure"},
    "bf16.fp32-critic": {"preset": "bf16", "overrides": {"critic": {"param_dtype": "fp32", "compute_dtype": "fp32"}}},
    "fp32.bf16-ref": {"preset": "fp32", "overrides": {"reference": {"param_dtype": "bf16", "compute_dtype": "bf16"}}},
}  # fmt: skip
"""Recipe name -> the ``precision:`` section it sets (on top of the suite's other precision keys). A
recipe's name, with ``-<checkpointing>`` after it, names its candidate variant, so each follows the
variant-name rule (`verlaudit.run.suite.check_variant_name`): ``bf16.fp32-critic`` is bf16 with an fp32
critic."""
CHECKPOINTING: dict[str, dict[str, Any]] = {
    "suite": {},
    "no-ckpt": {"grad_checkpointing": False, "checkpoint_layers": None},
    "ckpt": {"grad_checkpointing": True, "checkpoint_layers": None},
    "ckpt-auto": {"grad_checkpointing": True, "checkpoint_layers": "auto"},
}
"""Checkpointing choice -> the precision keys it sets (``suite``: the suite's own)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Tolerance:
    """How far from fp32 a recipe may be, measured on its own run."""

    logprob: float = 0.05
    """Mean |log p - log p_fp32| per token of the actor's shadowed forward, in nats."""
    update_loss: float = 0.25
    """Fraction of the sampled weight updates a trained role's optimizer step lost to rounding."""
    ratio: float = EXCESS
    """Largest module error over what its dtype's rounding explains (the shadow's rounding model)."""

    @classmethod
    def parse(cls, text: str | None) -> Tolerance:
        """``logprob=0.05,update_loss=0.25,ratio=4``; ValueError naming the bad item."""
        if not text:
            return cls()
        names = {f.name for f in dataclasses.fields(cls)}
        values: dict[str, float] = {}
        for item in text.split(","):
            key, sep, value = item.partition("=")
            key = key.strip()
            if not sep or key not in names:
                raise ValueError(
                    f"--tolerance: {item!r}; expected key=value with key one of {', '.join(sorted(names))}"
                )
            try:
                values[key] = float(value)
            except ValueError:
                raise ValueError(f"--tolerance: {key}={value!r} is not a number") from None
            if not values[key] > 0:
                raise ValueError(f"--tolerance: {key} must be > 0, got {value}")
        return cls(**values)


def candidates(
    suite: Suite, recipes: Sequence[str], checkpointing: Sequence[str]
) -> dict[str, dict[str, Any]]:
    """Candidate name -> the variant's overrides (a ``precision:`` section), for the recipes that
    apply to the suite's algorithm (an fp32 critic needs a critic, a bf16 reference a reference)."""
    algo = suite.train.algo
    base = suite.train.precision.to_dict()
    out = {}
    for recipe in recipes:
        if recipe not in RECIPES:
            raise ValueError(f"--recipes: unknown recipe {recipe!r}; expected some of {', '.join(RECIPES)}")
        if "critic" in recipe and algo.name != "ppo":
            continue
        if "ref" in recipe and not algo.uses_reference:
            continue
        for ck in checkpointing:
            if ck not in CHECKPOINTING:
                raise ValueError(
                    f"--checkpointing: unknown choice {ck!r}; expected some of {', '.join(CHECKPOINTING)}"
                )
            precision = {**base, "overrides": {}, **RECIPES[recipe], **CHECKPOINTING[ck]}
            name = recipe if ck == "suite" else f"{recipe}-{ck}"
            check_variant_name(name, f"candidate {name}")
            out[name] = {"precision": precision}
    return out


SHADOWED_STEP = 0
"""The step `recommend_suite` runs the full audit with the fp32 shadow on (``full_steps: 1``)."""


def recommend_suite(
    suite: Suite, cands: Mapping[str, Mapping[str, Any]], *, steps: int, rows: int, matmul: str = "fp32"
) -> Suite:
    """The suite the runner runs: the candidates as variants, ``steps`` steps, the full audit with the
    fp32 shadow on the first step only (so the later steps time the recipe alone), without the
    shadow's weight-gradient comparison (`measure` reads none of it: it would only cost time), its
    products as ``matmul`` (`verlaudit.audit.settings.AuditSettings.shadow_matmul`)."""
    data = suite.to_dict()
    data["name"] = f"{suite.name}-recommend"
    data["train"] = {**data["train"], "steps": steps}
    data["variants"] = {k: dict(v) for k, v in cands.items()}
    data["audit"] = {
        "level": "full",
        "full_steps": 1,
        "every": 0,
        "shadow": True,
        "shadow_rows": rows,
        "shadow_param_grads": False,
        "shadow_matmul": matmul,
        "opcount_steps": 1,
    }
    return Suite.from_dict(data, source=suite.source)


@dataclasses.dataclass
class Measured:
    """One candidate, as its run directory and the planner tell it."""

    name: str
    planned_gib: float
    target_gib: float | None
    shadow_gib: float = 0.0
    """The fp32 shadow's extra memory on the shadowed step (`verlaudit.plan.planner.shadow_gib`)."""
    state: str = "not run"
    status: str = "not run"
    step_s: float = math.nan
    peak_gib: float = math.nan
    logprob: float = math.nan
    ratio: float = math.nan
    update_loss: float = math.nan
    errors: int = 0
    failure: dict[str, Any] = dataclasses.field(default_factory=dict)
    """status.json's reason, step and phase of a failed run."""
    lost: list[str] = dataclasses.field(default_factory=list)
    """Why it lost; empty for the candidates within tolerance."""

    @property
    def fits(self) -> bool:
        """The recipe's step and the shadow's extra memory fit the target."""
        return self.target_gib is None or self.planned_gib + self.shadow_gib <= self.target_gib

    @property
    def shadow_oom(self) -> bool:
        """Out of memory on the shadowed step (step 0) of a recipe whose own step fits: the shadow
        did not fit beside it, the recipe's own steps never ran."""
        f = self.failure
        return self.state == "failed" and f.get("reason") == "oom" and f.get("step") == SHADOWED_STEP


def measure(run: RunDir, m: Measured) -> Measured:
    """Cost and error of a candidate from its run directory."""
    row = report_mod.run_row(run, trailing_window=10)
    m.state, m.status, m.peak_gib, m.errors = (
        row["state"],
        row["status"],
        row["device_peak_gb"],
        row["errors"],
    )
    m.failure = (
        {k: (run.status or {}).get(k) for k in ("reason", "step", "phase")} if m.state == "failed" else {}
    )
    timed = [
        to_float(x["perf/step_time_s"])
        for x in run.metrics
        if "perf/step_time_s" in x and not x.get("audit/shadow")
    ]
    m.step_s = statistics.median(timed) if timed else math.nan
    shadowed = [x for x in run.metrics if x.get("audit/shadow")]
    m.logprob = max(
        (
            to_float(x["shadow/actor/logprob_err/mean"])
            for x in shadowed
            if "shadow/actor/logprob_err/mean" in x
        ),
        default=math.nan,
    )
    m.ratio = max(
        (to_float(v) for x in shadowed for k, v in x.items() if k.endswith("/max_ratio")), default=math.nan
    )
    m.update_loss = update_loss(read_records(run.path, GRADHEALTH))
    return m


def update_loss(records: Sequence[Mapping[str, Any]]) -> float:
    """The largest over trained roles of the fraction of updates lost, each role's modules weighted
    by their size (NaN when no optimizer step was measured)."""
    per_role: dict[str, list[float]] = {}
    for r in records:
        if r.get("measure") == "update_loss" and r.get("sampled", 0):
            acc = per_role.setdefault(r["role"], [0.0, 0.0])
            acc[0] += r["lost_frac"] * r["size"]
            acc[1] += r["size"]
    return max((lost / n for lost, n in per_role.values() if n), default=math.nan)


def judge(m: Measured, tol: Tolerance) -> list[str]:
    """Why a candidate is out (empty: it is within tolerance)."""
    why = []
    if not m.fits:
        if m.planned_gib <= m.target_gib:
            return [
                f"the shadow does not fit: planned {m.planned_gib:.1f} GiB + {m.shadow_gib:.1f} GiB for the "
                f"fp32 shadow > target {m.target_gib:.1f} GiB (fewer --rows shrink the shadow)"
            ]
        why.append(f"does not fit: planned {m.planned_gib:.1f} GiB > target {m.target_gib:.1f} GiB")
        return why
    if m.shadow_oom:
        return [f"the shadow did not fit: out of memory on step {SHADOWED_STEP}, the shadowed one, in "
                f"{m.failure.get('phase')} (planned {m.planned_gib:.1f} GiB + {m.shadow_gib:.1f} GiB shadow); "
                "the recipe's own steps never ran: try fewer --rows, or run the variant without the shadow"]  # fmt: skip
    if m.state != "completed":
        return [f"run {m.status}"]
    if m.errors:
        why.append(f"{m.errors} error finding(s) (see its findings.jsonl)")
    if not m.logprob <= tol.logprob:
        why.append(
            f"log-prob error {m.logprob:.3g} nats/token > {tol.logprob:g}"
            if math.isfinite(m.logprob)
            else "no log-prob error measured (the shadow did not run on the actor)"
        )
    if m.ratio > tol.ratio:
        why.append(f"a module's error is {m.ratio:.3g}x what its rounding explains > {tol.ratio:g}")
    if m.update_loss > tol.update_loss:
        why.append(f"{m.update_loss:.0%} of updates lost to rounding > {tol.update_loss:.0%}")
    return why


def rank(measured: Sequence[Measured], tol: Tolerance, by: str) -> list[Measured]:
    """Within tolerance first, by cost (``time``: step time, then planned memory; ``memory``: the
    other way round); the others after, in the order given."""
    for m in measured:
        m.lost = judge(m, tol)
    ok = [m for m in measured if not m.lost]
    key = (lambda m: (m.step_s, m.planned_gib)) if by == "time" else (lambda m: (m.planned_gib, m.step_s))
    ok.sort(key=key)
    return ok + [m for m in measured if m.lost]


def render(
    ranked: Sequence[Measured], cands: Mapping[str, Mapping[str, Any]], tol: Tolerance, by: str
) -> str:
    """The table, the variant to paste, and why each loser lost."""
    from tabulate import tabulate

    def f(v: float, spec: str) -> str:
        return "—" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)

    best = ranked[0] if ranked and not ranked[0].lost else None
    rows = [
        [
            m.name,
            _planned(m),
            m.status,
            f(m.step_s, ".3f"),
            f(m.peak_gib, ".3g"),
            f(m.logprob, ".3g"),
            f(m.ratio, ".3g"),
            f(m.update_loss, ".1%"),
            "recommended" if m is best else ("ok" if not m.lost else "out"),
        ]
        for m in ranked
    ]
    head = [
        "candidate",
        "planned GiB",
        "status",
        "step s",
        "peak GiB",
        "log-prob err",
        "max ratio",
        "updates lost",
        "",
    ]
    lines = [
        f"Tolerance: log-prob error <= {tol.logprob:g} nats/token, module error <= {tol.ratio:g}x its rounding, "
        f"updates lost <= {tol.update_loss:.0%}; ranked by {'step time' if by == 'time' else 'planned memory'}.",
        "",
        tabulate(rows, head, tablefmt="github", disable_numparse=True),
        "",
    ]
    if best is None:
        lines.append("No candidate is within tolerance: loosen --tolerance, or look at the losers below.")
    else:
        variant = {
            "precision": {k: v for k, v in cands[best.name]["precision"].items() if v not in ({}, None)}
        }
        snippet = yaml.safe_dump({"variants": {f"recommended-{best.name}": variant}}, sort_keys=False)
        lines += [f"Recommended: {best.name}. Paste into your suite:", "", "```yaml", snippet.rstrip(), "```"]
    lines += ["", "Why the others lost:"]
    for m in ranked:
        if m is best:
            continue
        if m.lost:
            lines.append(f"- {m.name}: {'; '.join(m.lost)}")
        elif best is not None:
            lines.append(f"- {m.name}: within tolerance but costlier ({_costlier(m, best, by)})")
    return "\n".join(lines)


def _planned(m: Measured) -> str:
    """The planned GiB cell: the recipe's step, the shadow's share beside it when it counts."""
    text = format(m.planned_gib, ".3g")
    if m.shadow_gib >= 0.05:
        text += f" + {m.shadow_gib:.2g} shadow"
    return text + ("" if m.fits else " (does not fit)")


def _costlier(m: Measured, best: Measured, by: str) -> str:
    t = f"{m.step_s:.3g} s/step vs {best.step_s:.3g}"
    g = f"{m.planned_gib:.3g} GiB planned vs {best.planned_gib:.3g}"
    return f"{t}, {g}" if by == "time" else f"{g}, {t}"


def planned(rsuite: Suite) -> list[Measured]:
    """Each candidate with the planner's device memory per GPU and the target's."""
    from verlaudit.plan.memory_model import GIB
    from verlaudit.plan.planner import plan_config, resolve_checkpoint_layers, shadow_gib
    from verlaudit.run.hardware import get_target

    hw = rsuite.hardware
    target_gib = hw.memory_gb or get_target(hw.target).memory_gb
    rows = rsuite.audit.shadow_rows if rsuite.audit.shadow else 0
    out = []
    for name, cfg in rsuite.variants.items():
        cfg, _ = resolve_checkpoint_layers(cfg, gpus=hw.gpus, target_gib=target_gib)
        need = plan_config(cfg, gpus=hw.gpus)[0].device_bytes() / GIB
        shadow = shadow_gib(cfg, rows=rows)
        out.append(Measured(name=name, planned_gib=need, target_gib=target_gib, shadow_gib=shadow))
    return out
