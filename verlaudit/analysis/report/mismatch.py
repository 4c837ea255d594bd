"""The rollout-vs-trainer mismatch section of the comparison report: one row per variant, one plot.

For every run that logged the mismatch (``rollout_corr/*``, `trainer.mismatch.mismatch_metrics`):
the engine and the trainer / rollout compute dtypes, then over its steps the mean sequence k3, the mean
token k3 and its largest ratio to the dtype-roundoff model (``mismatch/k3_over_expected``,
`verlaudit.audit.mismatch`), the largest |p_rollout - p_train|, the smallest effective sample size
of the token IS ratios, the mean fraction of ratios outside [1/C, C], and the largest weight-push
probe difference (vLLM); seeds of a variant are averaged (extremes: the extreme over seeds).
Written as mismatch.csv, a markdown table, and mismatch.png (token k3 per step per variant, log
scale; steps with k3 exactly 0 are left out, and runs with no other step are named under the plot). `mismatch_section` is what `verlaudit.analysis.report.build.write_report` appends; a suite with no
rollout (DPO) gets nothing. Exercised by `pytest tests/test_mismatch_audit.py -k report`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
from tabulate import tabulate

from verlaudit.rundir import RunDir

MISMATCH_CSV = "mismatch.csv"
MISMATCH_PNG = "mismatch.png"
COLUMNS: tuple[tuple[str, str, str, str], ...] = (
    # (metric, column, statistic over the run's steps, format)
    ("rollout_corr/seq_k3_kl", "seq k3 (mean)", "mean", ".3g"),
    ("rollout_corr/k3_kl", "token k3 (mean)", "mean", ".3g"),
    ("mismatch/k3_over_expected", "k3 / rounding model (max)", "max", ".3g"),
    ("training/rollout_probs_diff_max", "max abs dp", "max", ".3g"),
    ("rollout_corr/token_ratio_eff_sample_size", "ESS (min)", "min", ".5f"),
    ("rollout_corr/token_ratio_fraction_outside", "outside [1/C, C] (mean)", "mean", ".3g"),
    ("rollout/weight_sync_probe_max_abs_diff", "push probe max abs dlogp", "max", ".3g"),
)
"""The section's numbers: one column per metric, reduced over the run's steps."""
PLOTTED = "rollout_corr/k3_kl"


def _stat(run: RunDir, key: str, how: str) -> float:
    v = np.array([x for _, x in run.series(key) if math.isfinite(x)], dtype=float)
    if not v.size:
        return math.nan
    return float({"mean": np.mean, "max": np.max, "min": np.min}[how](v))


def _dtypes(run: RunDir) -> str:
    roles: Mapping[str, Any] = (run.manifest.get("policy") or {}).get("roles") or {}
    trainer = (roles.get("actor") or {}).get("compute_dtype", "?")
    rollout = (roles.get("rollout") or {}).get("compute_dtype", "?")
    return f"{trainer} / {rollout}"


def _engine(run: RunDir) -> str:
    rollout = (run.manifest.get("config") or {}).get("rollout") or {}
    if rollout.get("engine"):
        return str(rollout["engine"])
    if rollout.get("fused"):
        return "fused"
    return "static" if rollout.get("cache") == "static" else "hf"


def mismatch_table(runs: Sequence[RunDir]) -> pd.DataFrame:
    """One row per variant that logged the mismatch (suite order); empty when none did."""
    rows = []
    for run in runs:
        if not run.series(PLOTTED):
            continue
        row: dict[str, Any] = {"variant": run.name, "engine": _engine(run), "trainer / rollout": _dtypes(run)}
        row.update({col: _stat(run, key, how) for key, col, how, _ in COLUMNS})
        rows.append(row)
    if not rows:
        return pd.DataFrame()
    df = pd.DataFrame(rows)
    how = {col: {"mean": "mean", "max": "max", "min": "min"}[h] for _, col, h, _ in COLUMNS}
    return df.groupby(["variant", "engine", "trainer / rollout"], sort=False, as_index=False).agg(how)


def markdown(table: pd.DataFrame) -> str:
    fmt = {col: spec for _, col, _, spec in COLUMNS}
    body = [
        [r["variant"], r["engine"], r["trainer / rollout"]]
        + ["—" if math.isnan(r[c]) else format(r[c], fmt[c]) for c in fmt]
        for r in table.to_dict("records")
    ]
    return tabulate(
        body,
        headers=["variant", "engine", "trainer / rollout", *fmt],
        tablefmt="github",
        disable_numparse=True,
    )


_LEGEND = """\
Per variant, over its steps (seeds averaged): *seq k3* is `rollout_corr/seq_k3_kl`, the k3 estimate of
KL(rollout || trainer) summed over each response; *token k3* `rollout_corr/k3_kl`; *k3 / rounding model*
the largest ratio of the token k3 to what the two dtypes' rounding explains (`mismatch/k3_over_expected`,
model in verlaudit/audit/mismatch.py); *max abs dp* the largest |p_rollout - p_train| of a sampled token;
*ESS* the normalised effective sample size of the token ratios pi/mu; *outside* the fraction of ratios
outside [1/C, C]; *push probe* the largest |engine - actor| log-prob after a weight push (vLLM)."""


def plot(runs: Sequence[RunDir], path: Path) -> bool:
    """Token k3 per step, one line per run (log scale); False (nothing written) without data."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    drawn = False
    for run in runs:
        pts = [(s, v) for s, v in run.series(PLOTTED) if math.isfinite(v) and v > 0]
        if pts:
            ax.plot(*zip(*pts), marker=".", label=f"{run.path.name} ({_dtypes(run)})")
            drawn = True
    if drawn:
        ax.set(title="rollout vs trainer mismatch", xlabel="step", ylabel="token k3 (rollout_corr/k3_kl)")
        ax.set_yscale("log")
        ax.legend(fontsize="x-small", ncol=2)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(path, dpi=100)
    plt.close(fig)
    return drawn


def mismatch_section(
    runs: Sequence[RunDir], out_dir: Path, *, plots: bool = True
) -> tuple[list[str], list[Path]]:
    """Markdown lines and files (mismatch.csv, mismatch.png) of the section; nothing without a rollout."""
    out_dir = Path(out_dir)
    table = mismatch_table(runs)
    png = out_dir / MISMATCH_PNG
    if table.empty:
        png.unlink(missing_ok=True)  # a stale plot from an earlier render would contradict the report
        return [], []
    files = [out_dir / MISMATCH_CSV]
    table.to_csv(files[0], index=False)
    lines = ["", "## Rollout vs trainer mismatch", "", markdown(table), "", _LEGEND]
    if plots and plot(runs, png):
        files.append(png)
        lines += ["", f"![mismatch]({png.name})"]
        zero = [r.path.name for r in runs if r.series(PLOTTED) and all(v == 0 for _, v in r.series(PLOTTED))]
        if zero:  # a log axis cannot show them: say so rather than leave them out silently
            lines += [
                "",
                f"Not on the plot, token k3 exactly 0 at every step (a log axis has no 0): {', '.join(zero)}.",
            ]
    return lines, files
