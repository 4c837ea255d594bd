"""Where precision was lost, per variant, from the run directories' record files: the report's
``Precision`` section and its plot.

Reads shadow.jsonl, opcounts.jsonl and gradhealth.jsonl (`verlaudit.rundir.read_records`) and the
shadowed steps' metrics; builds the fp32-shadow table (log-prob error, output and gradient error,
the first module whose error its rounding does not explain, the shadow's cost beside the step's),
the op counts by dtype and their differences between variants, the gradient-health table, and
``shadow_depth.png`` (the chain's relative error vs block depth, one line per variant, forward and
backward). Pure over what was written: it works on runs from another machine. Exercised by
`pytest tests/test_report_precision.py`.
"""

from __future__ import annotations

import math
import statistics
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from tabulate import tabulate

from verlaudit.rundir import GRADHEALTH, OPCOUNTS, SHADOW, RunDir, read_records, to_float

PLOT = "shadow_depth.png"
SHOWN = ("matmul", "attention", "softmax", "norm", "reduction", "cast", "pointwise")
"""Op categories shown in the dtype tables (views do no arithmetic; ``other`` is bookkeeping)."""


def _fmt(v: Any, spec: str = ".3g") -> str:
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "—"
    return format(v, spec)


def depth_curve(
    records: Iterable[Mapping[str, Any]], direction: str = "forward"
) -> list[tuple[int, float, str]]:
    """(depth, chain relative error, block) of the actor's first shadowed forward with a gradient
    (else its first one), in depth order: the error an fp32 model would show, block by block."""
    chain = [r for r in records if r.get("measure") == "chain" and r.get("role") == "actor"]
    if not chain:
        return []
    grad = [r for r in chain if r.get("grad")]
    pick = grad or chain
    first = (pick[0]["step"], pick[0]["phase"], pick[0].get("grad"))
    sel = [
        r for r in pick if (r["step"], r["phase"], r.get("grad")) == first and r.get("direction") == direction
    ]
    return sorted((int(r["depth"]), to_float(r["rel_err"]), r["module"]) for r in sel)


def shadow_row(run: RunDir) -> dict[str, Any] | None:
    """The fp32 shadow's numbers of one run (largest over its shadowed steps), None without any."""
    shadowed = [m for m in run.metrics if m.get("audit/shadow")]
    if not shadowed:
        return None

    def worst(key: str) -> float:
        return max((to_float(m[key]) for m in shadowed if key in m), default=math.nan)

    plain = [
        to_float(m["perf/step_time_s"])
        for m in run.metrics
        if "perf/step_time_s" in m and not m.get("audit/shadow")
    ]
    culprit = next((f for f in run.findings if f.kind == "precision/shadow_excess"), None)
    return {
        "logprob_mean": worst("shadow/actor/logprob_err/mean"),
        "logprob_max": worst("shadow/actor/logprob_err/max"),
        "output": worst("shadow/actor/output_rel_err"),
        "grad": worst("shadow/actor/input_grad_rel_err"),
        "ratio": max((to_float(v) for m in shadowed for k, v in m.items() if k.endswith("/max_ratio")), default=math.nan),
        "culprit": f"{culprit.role}: {culprit.where} ({to_float(culprit.observed['ratio']):.3g}x)" if culprit else "none",
        "shadow_s": statistics.median(to_float(m["timing_s/shadow"]) for m in shadowed if "timing_s/shadow" in m)
        if any("timing_s/shadow" in m for m in shadowed) else math.nan,
        "step_s": statistics.median(plain) if plain else math.nan,
        "shadow_step_s": statistics.median(to_float(m["perf/step_time_s"]) for m in shadowed if "perf/step_time_s" in m),
    }  # fmt: skip


def op_totals(
    records: Iterable[Mapping[str, Any]], role: str = "actor", phase: str = "actor_update"
) -> Counter:
    """Op counts of one role's phase (its modules and the ops outside them) per (pass, category,
    dtypes); ``dtypes`` is the input label, ``in->out`` when the op changes the dtype. Elementwise
    ops are counted only where they promote (inputs of two dtypes)."""
    out: Counter = Counter()
    for r in records:
        if (
            r["phase"] != phase
            or r["role"] not in (role, None)
            or r["category"] not in SHOWN
            or r["out"] == "-"
        ):
            continue
        if r["category"] == "pointwise" and "+" not in r["in"]:
            continue  # elementwise ops follow their inputs' dtype; only promotions are worth a row
        label = r["in"] if r["in"] == r["out"] else f"{r['in']}->{r['out']}"
        cat = (
            "norm statistics"
            if r.get("kind") == "norm" and r["category"] in ("reduction", "norm")
            else r["category"]
        )
        where = "" if r["role"] else " (outside modules)"
        out[(r["pass"], cat + where, label)] += r["count"]
    return out


def differences(per_variant: Mapping[str, Counter]) -> list[dict[str, Any]]:
    """Rows (pass, category, dtypes) of `op_totals` whose count differs between variants."""
    keys = sorted({k for t in per_variant.values() for k in t}, key=str)
    rows = []
    for k in keys:
        counts = {v: t.get(k, 0) for v, t in per_variant.items()}
        if len(set(counts.values())) > 1:
            rows.append({"pass": k[0], "category": k[1], "dtypes": k[2], **counts})
    return rows


def first_step(records: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    steps = [r["step"] for r in records if r.get("step") is not None]
    return [r for r in records if r.get("step") == min(steps)] if steps else list(records)


def grad_rows(run: RunDir) -> dict[str, str]:
    """The worst module for lost updates and for fp16 underflow, as words."""
    recs = read_records(run.path, GRADHEALTH)
    lost = [r for r in recs if r.get("measure") == "update_loss" and r.get("sampled")]
    under = [r for r in recs if r.get("measure") == "fp16_underflow"]
    out = {"lost": "—", "underflow": "—"}
    if lost:
        w = max(lost, key=lambda r: r["lost_frac"])
        total = sum(r["lost_frac"] * r["size"] for r in lost) / max(1, sum(r["size"] for r in lost))
        out["lost"] = (
            f"{total:.1%} overall; worst {w['role']} {w['module']} {w['lost_frac']:.0%} (lr {w.get('lr')})"
        )
    if under:
        w = max(under, key=lambda r: r["subnormal_frac"])
        keep = "fits" if w.get("fits") else "no fp16 scale fits"
        out["underflow"] = (
            f"worst {w['role']} {w['module']}: {w['subnormal_frac']:.1%} subnormal, {w['zero_frac']:.1%} zero "
            f"at scale {w['scale']:g}; keeps at {_fmt(w['scale_keep'], 'g')}, max {_fmt(w['scale_max'], 'g')} ({keep})"
        )
    return out


# long: the report section's tables in the order they print
def section(runs: Sequence[RunDir], out_dir: Path, plots: bool = True) -> tuple[list[str], list[Path]]:
    """The report's Precision section (markdown lines) and its plot; nothing when no run has records."""
    shadow = {r.path.name: read_records(r.path, SHADOW) for r in runs}
    ops = {r.path.name: first_step(read_records(r.path, OPCOUNTS)) for r in runs}
    grads = {r.path.name: grad_rows(r) for r in runs}
    if (
        not any(shadow.values())
        and not any(ops.values())
        and all(g == {"lost": "—", "underflow": "—"} for g in grads.values())
    ):
        return [], []
    lines = ["", "## Precision: where it is lost", ""]
    rows = [(r.path.name, shadow_row(r)) for r in runs]
    rows = [(n, s) for n, s in rows if s is not None]
    if rows:
        lines += [
            "fp32 shadow of the actor (largest over its shadowed steps; the shadow runs on sampled steps, whose "
            "step time is shown apart):",
            "",
            tabulate(
                [
                    [
                        n,
                        _fmt(s["logprob_mean"]),
                        _fmt(s["logprob_max"]),
                        _fmt(s["output"]),
                        _fmt(s["grad"]),
                        _fmt(s["ratio"]),
                        s["culprit"],
                        _fmt(s["shadow_s"], ".3f"),
                        _fmt(s["shadow_step_s"], ".3f"),
                        _fmt(s["step_s"], ".3f"),
                    ]
                    for n, s in rows
                ],
                [
                    "variant",
                    "log-prob err mean",
                    "log-prob err max",
                    "output rel err",
                    "input grad rel err",
                    "max err / rounding",
                    "first module over its rounding",
                    "shadow s",
                    "shadowed step s",
                    "other steps s",
                ],
                tablefmt="github",
                disable_numparse=True,
            ),
        ]
    with_ops = {n: op_totals(recs) for n, recs in ops.items() if recs}
    if with_ops:
        diff = differences(with_ops) if len(with_ops) > 1 else []
        lines += [
            "",
            "What ran in which dtype in the actor update (op counts of the first counted step):",
            "",
        ]
        if diff:
            names = list(with_ops)
            lines.append(
                tabulate(
                    [[d["pass"], d["category"], d["dtypes"], *[d[n] for n in names]] for d in diff],
                    ["pass", "category", "dtypes (in->out)", *names],
                    tablefmt="github",
                )
            )
        else:
            (name, tot), *_ = with_ops.items()
            lines.append(
                tabulate(
                    [[*k, v] for k, v in sorted(tot.items(), key=str)],
                    ["pass", "category", "dtypes (in->out)", name],
                    tablefmt="github",
                )
            )
    if any(g != {"lost": "—", "underflow": "—"} for g in grads.values()):
        lines += [
            "",
            "Gradient health (per module, gradhealth.jsonl):",
            "",
            tabulate(
                [[n, g["lost"], g["underflow"]] for n, g in grads.items()],
                ["variant", "updates lost to rounding", "fp16 gradient underflow"],
                tablefmt="github",
            ),
        ]
    files = []
    if plots and any(depth_curve(recs) for recs in shadow.values()):
        path = Path(out_dir) / PLOT
        depth_plot(shadow, path)
        files.append(path)
        lines += ["", f"![shadow error vs depth]({PLOT})"]
    return lines, files


def depth_plot(shadow: Mapping[str, Sequence[Mapping[str, Any]]], path: Path) -> None:
    """Chain relative error vs block depth, one line per variant: forward (a block's output) and
    backward (the gradient it passes down)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, direction in zip(axes, ("forward", "backward")):
        for i, (name, recs) in enumerate(shadow.items()):
            pts = [(d, e) for d, e, _ in depth_curve(recs, direction) if e > 0 and math.isfinite(e)]
            if pts:
                ax.plot(*zip(*pts), marker=".", label=name, color=f"C{i}")  # one colour per variant
        ax.set(
            title=f"actor {direction}: relative error vs fp32 (zeros not drawn)",
            xlabel="block (execution order)",
            ylabel="relative error",
        )
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_yscale("log")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
