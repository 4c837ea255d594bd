"""A baseline directory's BASELINE.md: the commands that regenerate it and, when it has a
tolerances.json, how that model was derived, rendered from the file itself so that
`verlaudit compare --update-baseline` and `benchmarks/derive_tolerances.py` write the same notes.
Exercised by `pytest tests/test_tolerance.py` (the update keeps the model and its notes).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from verlaudit.analysis.ci.tolerance import K_MIN, LOFO_MARGIN, TOLERANCE_FILE
from verlaudit.rundir import SUITE_COPY, read_json


def write_notes(dest: Path, shown_as: str | None = None) -> None:
    """BASELINE.md: the commands that regenerate the baseline (the run command from the suite copy)
    and, when tolerances.json is there, how its model was derived (rendered from the file itself,
    so `--update-baseline` and the derivation script write the same notes)."""
    where = shown_as or str(dest)
    run_cmd = ((read_json(dest / SUITE_COPY) or {}).get("run") or {}).get("command")
    m = re.search(r"--out (\S+)", run_cmd or "")
    run_dir = m.group(1) if m else "<RUN>"
    model = dest / TOLERANCE_FILE
    data = json.loads(model.read_text(encoding="utf-8")) if model.is_file() else None
    derive = ((data or {}).get("derivation") or {}).get("command") or "python benchmarks/derive_tolerances.py"
    lines = [
        "# Baseline",
        "",
        "Regenerate with these commands, in this order, and commit the result:",
        "",
        f"    {run_cmd or 'verlaudit run <suite> --out <RUN>'}",
        f"    verlaudit compare {run_dir} --baseline {where} --update-baseline",
        f"    {derive}",
        "",
        "The first two write the runs (each variant keeps manifest.json, metrics.jsonl, findings.jsonl and "
        f"status.json; events.jsonl is not compared and is left out) and keep {TOLERANCE_FILE}; the "
        "third re-measures the tolerance model (its run time is below) and rewrites it, this file and the "
        "test fixture of its trajectories. Run it after any change to the suite or to the trainer's numerics.",
        "",
    ]
    if data is not None:
        lines.append(render_model(data))
    else:
        lines.append(
            f"No {TOLERANCE_FILE}: trajectories are compared with the flat loss_atol / "
            "loss_mean_atol tolerances.\n"
        )
    (dest / "BASELINE.md").write_text("\n".join(lines), encoding="utf-8")


def _env(env: Mapping[str, str], train: Mapping[str, Any]) -> str:
    parts = [f"{k}={v}" for k, v in env.items()] + [f"suite train.{k}: {v}" for k, v in train.items()]
    return "`" + " ".join(parts) + "`" if parts else "(none)"


def _probe(p: Mapping[str, Any] | None) -> str:
    if not p:
        return "-"
    return (
        f"ATen {p.get('aten_capability')}, bf16 matmul {p.get('onednn_bf16_matmul')}, "
        f"mkldnn {'on' if p.get('mkldnn_enabled') else 'off'}, {p.get('threads')} thread(s)"
    )


def render_model(data: Mapping[str, Any]) -> str:
    """The BASELINE.md section for a tolerances.json (its numbers and how they were derived)."""
    d = data.get("derivation") or {}
    variants = list(data["variants"])
    lines = ["## Tolerance model (tolerances.json)", ""]
    mach = d.get("machine") or {}
    if d:
        lines += [
            f"Derived by `{d['command']}` on {mach.get('date')}: {mach.get('cpu')} "
            f"({', '.join(mach.get('isa') or [])}; {mach.get('cores')} cores), torch {mach.get('torch')}, "
            f"Python {mach.get('python')}. Suite `{d.get('suite')}`, variants {', '.join(variants)}, "
            f"steps 0-{data['steps'] - 1}, one process per run, runs one after the other: "
            f"{len(d.get('conditions', []))} kernel conditions and {len(d.get('planted', []))} planted changes, "
            f"{d.get('wall_s_total', 0) / 60:.0f} min of wall time in all.",
            "",
        ]
    ks = ", ".join(f"{v} {data['variants'][v]['safety']:g}" for v in variants)
    lines += [
        "For each variant, metric and step s, over the conditions below:",
        "",
        "    spread(s)    = max - min of the metric at step s over all conditions",
        "    step_atol(s) = max(floor, k * max(spread(0..s)))     noise does not shrink along a trajectory",
        "    mean_atol(n) = the same over the mean of the first n steps (catches a one-sided drift)",
        f"    floor        = {data['floor_ulps']:g} * 2^-23 * max |reference trajectory|   (fp32 rounding)",
        f"    k            = {ks}   (per variant: 'Why k' below)",
        "",
        "`verlaudit compare` applies step_atol / mean_atol to the steps the model covers, for every metric in it; "
        "`loss_atol` / `loss_mean_atol` set in the suite's `compare:` mapping or with `--tolerances` win over the "
        "model, and steps beyond it use `loss_atol`. The markdown and JUnit output name the tolerance of each step.",
        "",
    ]
    lines += _conditions_md(d, variants)
    lines += _safety_md(d, data)
    lines += _steps_md(data, variants)
    lines += _planted_md(d, variants, data["steps"])
    lines += _external_md(d)
    return "\n".join(lines) + "\n"


def _conditions_md(d: Mapping[str, Any], variants: Sequence[str]) -> list[str]:
    if not d.get("conditions"):
        return []
    out = [
        "### Conditions",
        "",
        "Max |actor/loss - reference| over the steps, per variant; 'what torch reports' is "
        "a probe run under the same environment.",
        "",
        "| condition | environment | what torch reports | " + " | ".join(variants) + " |",
        "|---" * (3 + len(variants)) + "|",
    ]
    for c in d["conditions"]:
        diffs = " | ".join(f"{c['loss_vs_reference'][v]:.1e}" for v in variants)
        out.append(
            f"| {c['name']}: {c['description']} | {_env(c['env'], c['train_overrides'])} | "
            f"{_probe(c['probe'])} | {diffs} |"
        )
    committed = d.get("committed_runs_vs_reference") or {}
    if committed:
        out += [
            "",
            "The committed runs vs the reference condition (max |actor/loss| difference): "
            + ", ".join(f"{v} {x:.1e}" for v, x in committed.items() if x is not None)
            + " (0: they are the reference condition's runs).",
        ]
    return [*out, ""]


def _safety_md(d: Mapping[str, Any], data: Mapping[str, Any]) -> list[str]:
    loo = d.get("loo") or {}
    if not loo:
        return []
    excluded = d.get("not_a_machine") or {}
    metrics = list(next(iter(loo.values())))
    out = [
        "### Why k",
        "",
        "Leave one kernel setting out: the conditions that share a setting (e.g. every condition with "
        "`ATEN_CPU_CAPABILITY=avx2`) are treated as a machine we could not measure; the model is derived from the "
        "rest with k = 1, and the ratio is the left-out conditions' largest |d| to the rest over that tolerance. "
        "Above 1: that machine, unmeasured, would have failed the bare envelope. Largest ratio per variant and "
        "metric (and the setting):",
        "",
        "| variant | k | " + " | ".join(metrics) + " |",
        "|---" * (2 + len(metrics)) + "|",
    ]
    above = []
    for v, per_metric in loo.items():
        k = data["variants"][v]["safety"]
        cells = []
        for m, ratios in per_metric.items():
            f, r = max(ratios.items(), key=lambda kv: kv[1], default=("-", 0.0))
            cells.append(f"{r:.2f} ({f})")
            above += [f"{v} {m} {ff} ({rr:.3g})" for ff, rr in ratios.items() if rr > k]
        out.append(f"| {v} | {k:g} | " + " | ".join(cells) + " |")
    out += [
        "",
        f"k = max({d.get('k_min', K_MIN):g}, {d.get('lofo_margin', LOFO_MARGIN):g} x the largest ratio of the "
        "variant), rounded up to 0.1: an unmeasured machine may land further out than any setting we left out "
        "(hence the margin), and where every left-out setting stays inside (fp32 at its rounding floor) the "
        "minimum still leaves room for kernels no condition here reproduces (AMX, AVX512-FP16, GPU matmuls).",
    ]
    for f, why in excluded.items():
        out.append(f"Not counted: `{f}`: {why}.")
    if above:
        out += [
            "",
            "Left out, these would fail (covered only because they are measured here): "
            + "; ".join(above)
            + ".",
        ]
    return [*out, ""]


def _steps_md(data: Mapping[str, Any], variants: Sequence[str]) -> list[str]:
    out = ["### Per-step tolerances", "", "spread -> step_atol, per step:", ""]
    for v in variants:
        out.append(f"- **{v}** (preset {data['variants'][v]['preset']})")
        for m, mm in data["variants"][v]["metrics"].items():
            spreads = mm.get("spread") or [None] * len(mm["step_atol"])  # a hand-written model may omit it
            cells = ", ".join(
                f"{s:.1e}->{a:.1e}" if s is not None else f"{a:.1e}" for s, a in zip(spreads, mm["step_atol"])
            )
            out.append(f"  - `{m}`: {cells}; floor {mm['floor']:.1e}")
    return [*out, ""]


def _planted_md(d: Mapping[str, Any], variants: Sequence[str], steps: int) -> list[str]:
    if not d.get("planted"):
        return []
    out = [
        "### Planted changes",
        "",
        "Each change run once under the reference condition and checked against the "
        "model: the step by which it is caught (the first metric to leave its band, and where), or 'not caught'; "
        "then the largest k that would still catch it within the model's steps (and where).",
        "",
        "| change | " + " | ".join(variants) + " |",
        "|---" * (1 + len(variants)) + "|",
    ]
    for p in d["planted"]:
        cells = []
        for v in variants:
            r, f = p["result"][v], p["result"][v]["first"]
            head = (
                f"step {f['steps'] - 1} ({f['metric']} {f['where']})" if f else f"not caught in {steps} steps"
            )
            cells.append(f"{head}; k < {r['catching_k']:.3g} ({r['catching_at'] or '-'})")
        out.append(f"| {p['name']}: {p['description']} | " + " | ".join(cells) + " |")
    return [*out, ""]


def _external_md(d: Mapping[str, Any]) -> list[str]:
    if not d.get("external"):
        return []
    out = [
        "### External checks",
        "",
        "Values measured on other machines, against this machine's reference run "
        "and the model (|d| / step_atol; above 1 would be a false regression):",
        "",
    ]
    for e in d["external"]:
        pts = [
            f"{v} {p['metric']} step {p['step']}: {p['d']:.1e} / {p['atol']:.1e} = {p['d'] / p['atol']:.2f}"
            for v, ps in e["result"].items()
            for p in ps
        ]
        worst = max((p["d"] / p["atol"] for ps in e["result"].values() for p in ps), default=0.0)
        same = f" Bitwise equal to condition(s) {', '.join(e['same_as'])} here." if e.get("same_as") else ""
        out.append(
            f"- {e['name']}: {e['description']}.{same} Worst ratio {worst:.2f}. "
            + "; ".join(pts[:6])
            + (f"; ... ({len(pts)} points)" if len(pts) > 6 else "")
        )
    return [*out, ""]
