"""The comparison report of a suite run, built only from its run directories.

`write_report(out_dir)` reads every run directory under ``out_dir`` (`verlaudit.rundir.read_run`),
makes one row per run (`run_row`) and one per variant (seeds aggregated, `aggregate`), and writes
report.md (tabulate), report.csv (per variant), report_runs.csv (per run / seed) and PNG plots of
loss, reward, memory per phase and loss scale. It works on runs that died half-way, on interrupted
suites and on directories copied from another machine. A variant run by several ranks (torchrun)
has rank 0's run directory with ``rank<k>/`` directories inside: its memory peak is the largest
over ranks (each rank's own peak is listed too), its findings are those of every rank, and its
status names the rank that failed first. A run with a rollout adds the mismatch section
(`verlaudit.analysis.report.mismatch`). Exercised by
`verlaudit run --report-only reports/tiny_cpu` and `pytest tests/test_report.py`.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
from tabulate import tabulate

from verlaudit.analysis.report import precision
from verlaudit.analysis.report.mismatch import mismatch_section
from verlaudit.rundir import (
    REPORT_CSV,
    REPORT_MD,
    REPORT_RUNS_CSV,
    RUNNER,
    SPEC,
    SUITE_COPY,
    WORKER_LOG,
    RunDir,
    is_run_dir,
    read_run,
    to_float,
)

REWARD_KEYS = {"dpo": "rewards/margins"}
DEFAULT_REWARD_KEY = "critic/score/mean"
ROLES = ("actor", "critic")


@dataclasses.dataclass
class Report:
    markdown: str
    variants: pd.DataFrame
    runs: pd.DataFrame
    files: list[Path]


def read_run_safe(path: Path) -> RunDir:
    """`read_run`, except that a damaged run directory becomes a failed row saying why, and a worker
    that died before writing anything (the runner left spec.json, runner.json, worker.log) is a
    failed row with its exit code and the last line of its log."""
    path = Path(path)
    if not is_run_dir(path) and (path / RUNNER).exists():
        spec = _json_or_empty(path / SPEC)
        record = _runner_record(path) or {}
        log = path / WORKER_LOG
        lines = (
            [ln for ln in log.read_text(errors="replace").splitlines() if ln.strip()] if log.exists() else []
        )
        status = {
            "state": "failed",
            "reason": f"worker exited {record.get('returncode')} before writing its run directory",
            "error": lines[-1].strip() if lines else "no worker.log",
        }
        manifest = {k: spec[k] for k in ("variant", "seed") if k in spec}
        return RunDir(path=path, manifest=manifest, metrics=[], findings=[], events=[], status=status)
    try:
        return read_run(path)
    except ValueError as e:
        return RunDir(
            path=Path(path),
            manifest={},
            metrics=[],
            findings=[],
            events=[],
            status={"state": "failed", "reason": "unreadable", "error": str(e)},
        )


def _values(run: RunDir, key: str) -> np.ndarray:
    return np.array([v for _, v in run.series(key)], dtype=float)


def _finite(a: np.ndarray) -> np.ndarray:
    return a[np.isfinite(a)]


def _max(a: np.ndarray) -> float:
    a = _finite(a)
    return float(a.max()) if a.size else math.nan


def reward_key(run: RunDir) -> str:
    algo = ((run.manifest.get("config") or {}).get("algo") or {}).get("name", "ppo")
    return REWARD_KEYS.get(algo, DEFAULT_REWARD_KEY)


def status_text(run: RunDir) -> str:
    """``completed``; ``failed at step N (phase): reason``; ``refused``; ``killed at step N``."""
    state = run.state
    if state == "completed":
        return "completed"
    if state == "empty":
        return "not started"
    last = max((int(m["step"]) for m in run.metrics if "step" in m), default=None)
    if state == "killed":
        return f"killed after step {last} (no status.json)" if last is not None else "killed (no status.json)"
    st = run.status or {}
    reason = st.get("reason") or "unknown"
    if reason == "refused":
        return "refused"
    step = st.get("step")
    where = f" at step {step}" if step is not None else ""
    phase = f" ({st['phase']})" if st.get("phase") else ""
    return f"{state}{where}{phase}: {reason}"


def _overflow_steps(run: RunDir) -> int:
    """Steps with non-finite gradients in any role (audit metric), or, without audit metrics, a loss
    scale that backed off."""
    steps: set[int] = set()
    for m in run.metrics:
        for role in ROLES:
            if to_float(m.get(f"numerics/{role}/nonfinite_grads", 0) or 0) > 0:
                steps.add(int(m["step"]))
    for role in ROLES:
        series = run.series(f"{role}/loss_scale")
        for (_, a), (s, b) in zip(series, series[1:]):
            if b < a:
                steps.add(s)
    return len(steps)


def _skipped_steps(run: RunDir) -> int:
    return sum(
        1 for m in run.metrics if any(to_float(m.get(f"{role}/skipped", 0) or 0) > 0 for role in ROLES)
    )


def rank_runs(run: RunDir) -> list[RunDir]:
    """The other ranks of a variant run under torchrun (``rank<k>/`` in rank 0's directory), by rank."""
    dirs = [d for d in run.path.glob("rank*") if d.name[4:].isdigit() and is_run_dir(d)]
    return [read_run_safe(d) for d in sorted(dirs, key=lambda d: int(d.name[4:]))]


def _failing(ranks: Sequence[RunDir]) -> tuple[int, RunDir]:
    """The rank whose status explains a failed variant: the first to fail (status ``failed_at``) for
    a reason of its own. Its peers fail after it (a closed gloo connection) or are interrupted or
    killed by torchrun: consequences, not the cause."""
    failed = [
        (to_float((r.status or {}).get("failed_at", math.inf)), k, r)
        for k, r in enumerate(ranks)
        if r.state == "failed" and (r.status or {}).get("reason") not in ("interrupted", None)
    ]
    if not failed:
        return 0, ranks[0]
    _, k, r = min(failed, key=lambda x: (x[0], x[1]))
    return k, r


def run_row(run: RunDir, trailing_window: int) -> dict[str, Any]:
    """The numbers of one run; NaN where the run never produced a metric. Training metrics come from
    rank 0 (the trainer averages them over ranks); memory peaks, findings and failures from all."""
    ranks = [run, *rank_runs(run)]
    peaks = [_max(_values(r, "perf/device_memory_peak_gb")) for r in ranks]
    allocs = [_max(_values(r, "perf/max_memory_allocated_gb")) for r in ranks]
    findings = [f for r in ranks for f in r.findings]
    k, failing = _failing(ranks) if run.state != "completed" else (0, run)
    loss = _values(run, "actor/loss")
    finite_loss = _finite(loss)
    tail = finite_loss[-trailing_window:]
    rkey = reward_key(run)
    rewards = _finite(_values(run, rkey))
    reward_tail, reward_head = rewards[-trailing_window:], rewards[:trailing_window]
    # shadowed steps (the fp32 shadow's extra forwards) are reported apart, in the Precision section
    steps_time = _finite(
        np.array(
            [
                to_float(m["perf/step_time_s"])
                for m in run.metrics
                if "perf/step_time_s" in m and not m.get("audit/shadow")
            ],
            dtype=float,
        )
    )
    sev = [f.severity for f in findings]
    top = next((f for f in findings if f.severity == "error"), None) or next(
        (f for f in findings if f.severity == "warning"), None
    )
    st = failing.status or {}
    status = status_text(failing) + (f" (rank {k})" if k else "")
    return {
        "variant": str(run.manifest.get("variant") or run.path.name),
        "seed": run.manifest.get("seed"),
        "run": run.path.name,
        "state": failing.state if st.get("reason") != "refused" else "refused",
        "status": status,
        "error": st.get("error") or "",
        "steps": (max((int(m["step"]) for m in run.metrics if "step" in m), default=-1) + 1),
        "ranks": len(ranks),
        "device_peak_gb": _max(np.array(peaks)),
        "rank_peaks_gb": " / ".join(_fmt(p, ".3f") for p in peaks) if len(ranks) > 1 else "",
        "memory_source": (run.manifest.get("memory") or {}).get("source") or "",
        "alloc_peak_gb": _max(np.array(allocs)),
        "step_time_s": float(np.median(steps_time)) if steps_time.size else math.nan,
        "loss_last": float(finite_loss[-1]) if finite_loss.size else math.nan,
        "loss_std": float(np.std(tail)) if tail.size >= 2 else math.nan,
        "loss_nonfinite": int(np.sum(~np.isfinite(loss))),
        "reward_key": rkey,
        "reward_start": float(np.mean(reward_head)) if reward_head.size else math.nan,
        "reward_mean": float(np.mean(reward_tail)) if reward_tail.size else math.nan,
        "reward_var": float(np.var(reward_tail)) if reward_tail.size >= 2 else math.nan,
        "overflow_steps": _overflow_steps(run),
        "skipped_steps": _skipped_steps(run),
        "errors": sev.count("error"),
        "warnings": sev.count("warning"),
        "infos": sev.count("info"),
        "top_finding": (
            f"{top.severity}: {top.kind} @ {top.where or top.role or '-'}"
            + (f" (rank {top.rank})" if top.rank else "")
            if top
            else ""
        ),
        "wall_s": (_runner_record(run.path) or {}).get("wall_s", math.nan),
    }


def _json_or_empty(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text(encoding="utf-8")) if path.exists() else {}
    except json.JSONDecodeError:
        return {}


def _runner_record(path: Path) -> dict[str, Any] | None:
    p = Path(path) / RUNNER
    try:
        return json.loads(p.read_text(encoding="utf-8")) if p.exists() else None
    except json.JSONDecodeError:
        return None


def aggregate(runs: pd.DataFrame) -> pd.DataFrame:
    """One row per variant. Seeds: reward = mean of per-seed trailing means, reward_seed_std = their
    spread; memory = max; step time = median; counts = sums; status = completed only if every seed did."""
    rows = []
    for variant, g in runs.groupby("variant", sort=False):
        states = list(g["state"])
        if all(s == "completed" for s in states):
            status = "completed"
        else:
            bad = g[g["state"] != "completed"]
            status = "; ".join(dict.fromkeys(bad["status"]))
            if len(g) > 1:
                status += f" ({len(bad)}/{len(g)} seeds)"
        rewards = g["reward_mean"].dropna()
        rows.append(
            {
                "variant": variant,
                "seeds": len(g),
                "status": status,
                "steps": int(g["steps"].min()),
                "device_peak_gb": g["device_peak_gb"].max(),
                "memory_source": ",".join(sorted(set(g["memory_source"]) - {""})),
                "ranks": int(g["ranks"].max()),
                "rank_peaks_gb": "; ".join(t for t in g["rank_peaks_gb"] if t),
                "alloc_peak_gb": g["alloc_peak_gb"].max(),
                "step_time_s": g["step_time_s"].median(),
                "loss_std": g["loss_std"].mean(),
                "loss_nonfinite": int(g["loss_nonfinite"].sum()),
                "reward_key": g["reward_key"].iloc[0],
                "reward_start": g["reward_start"].mean(),
                "reward_mean": rewards.mean() if len(rewards) else math.nan,
                "reward_seed_std": rewards.std(ddof=1) if len(rewards) >= 2 else math.nan,
                "reward_var": rewards.var(ddof=1) if len(rewards) >= 2 else g["reward_var"].mean(),
                "overflow_steps": int(g["overflow_steps"].sum()),
                "skipped_steps": int(g["skipped_steps"].sum()),
                "errors": int(g["errors"].sum()),
                "warnings": int(g["warnings"].sum()),
                "top_finding": next((t for t in g["top_finding"] if t), ""),
            }
        )
    return pd.DataFrame(rows)


def _fmt(v: Any, spec: str = ".3g") -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "—"
    return f"{v:{spec}}"


def markdown_table(variants: pd.DataFrame, trailing_window: int) -> str:
    rows = []
    for r in variants.to_dict("records"):
        reward = _fmt(r["reward_mean"], ".3f")
        if r["seeds"] > 1 and not math.isnan(r["reward_seed_std"]):
            reward += f" ± {r['reward_seed_std']:.3f}"
        loss = _fmt(r["loss_std"], ".3g") + (
            f" ({r['loss_nonfinite']} non-finite)" if r["loss_nonfinite"] else ""
        )
        rows.append(
            [
                r["variant"],
                r["status"],
                r["steps"],
                _fmt(r["device_peak_gb"], ".3f")
                + (f" ({r['memory_source']})" if r["memory_source"] else "")
                + (f" [per rank {r['rank_peaks_gb']}]" if r["rank_peaks_gb"] else ""),
                _fmt(r["alloc_peak_gb"], ".3f"),
                _fmt(r["step_time_s"], ".3f"),
                loss,
                _fmt(r["reward_start"], ".3f"),
                reward,
                _fmt(r["reward_var"], ".2g"),
                f"{r['overflow_steps']} / {r['skipped_steps']}",
                f"{r['errors']} / {r['warnings']}",
            ]
        )
    headers = [
        "variant", "status", "steps", "peak device GiB", "peak alloc GiB", "step s (median)",
        f"loss std (last {trailing_window})", f"reward (first {trailing_window})",
        f"reward (last {trailing_window})", "reward var", "overflow / skipped", "findings E / W",
    ]  # fmt: skip
    return tabulate(rows, headers=headers, tablefmt="github", disable_numparse=True)


def collect(out_dir: Path) -> list[RunDir]:
    """Run directories under ``out_dir`` in suite order (suite.json), then by name."""
    out_dir = Path(out_dir)
    if not out_dir.is_dir():
        raise ValueError(
            f"{out_dir}: no such directory; pass a suite output directory (reports/<suite>/<time>)"
        )
    order: list[str] = list((_suite_copy(out_dir).get("variants") or {}).keys())
    dirs = [d for d in sorted(out_dir.iterdir()) if is_run_dir(d) or (d / RUNNER).exists()]
    if not dirs:
        raise ValueError(
            f"{out_dir}: no run directories inside; is this the output directory of `verlaudit run`?"
        )
    runs = [read_run_safe(d) for d in dirs]

    def key(r: RunDir) -> tuple[int, int, str]:
        v = str(r.manifest.get("variant") or r.path.name)
        return (order.index(v) if v in order else len(order), int(r.manifest.get("seed") or 0), r.path.name)

    return sorted(runs, key=key)


def _suite_copy(out_dir: Path) -> dict[str, Any]:
    p = Path(out_dir) / SUITE_COPY
    if not p.exists():
        return {}
    try:
        return json.loads(p.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{p}: damaged ({e}); delete it to report without suite order") from None


def _not_run(suite: Mapping[str, Any], rows: pd.DataFrame) -> list[str]:
    """Runs the suite copy promises that left no directory (Ctrl-C before they started)."""
    seeds = suite.get("seeds") or [0]
    expected = [v if len(seeds) == 1 else f"{v}-s{s}" for v in (suite.get("variants") or {}) for s in seeds]
    present = set(rows["run"])
    return [name for name in expected if name not in present]


def _header(out_dir: Path, runs: Sequence[RunDir], suite: Mapping[str, Any], rows: pd.DataFrame) -> list[str]:
    m = next((r.manifest for r in runs if r.manifest.get("environment")), {})
    env = m.get("environment") or {}
    where = env.get("gpu_name") or f"CPU ({env.get('cpu_count', '?')} cores)"
    emu = (m.get("emulation") or {}).get("reason")
    audit = m.get("audit") or suite.get("audit") or {}
    wall = rows["wall_s"].dropna().sum()
    record = suite.get("run") or {}
    lines = [
        f"# verlaudit report: {suite.get('name') or out_dir.name}",
        "",
        f"- suite: `{suite.get('source', '?')}` — {suite.get('description', '').strip() or 'no description'}",
        f"- device: {where}; torch {env.get('torch', '?')}, transformers {env.get('transformers', '?')}, "
        f"python {env.get('python', '?')}",
        f"- target: {(m.get('emulation') or {}).get('target', '?')}" + (f" — {emu}" if emu else ""),
        f"- audit level: {audit.get('level', '?')} (full on the first {audit.get('full_steps', '?')} steps, "
        f"then every {audit.get('every', '?')})",
        f"- runs: {len(runs)}; summed wall time of the runs: {wall:.0f} s",
    ]
    if record.get("wall_s") is not None:
        lines.append(
            f"- command: `{record.get('command', '?')}`: {record['wall_s']:.0f} s wall in total on "
            f"{record.get('machine', '?')}, load average {record.get('load_at_start', '?')} at the start "
            f"({record.get('started_at', '')})"
        )
    return lines


_LEGEND = """\
Columns: *peak device GiB* is the largest `perf/device_memory_peak_gb` (NVML device memory on a GPU,
host RSS on CPU: the source is in brackets; with several ranks the largest rank's, each rank's after
"per rank"); *peak alloc GiB* the PyTorch allocator's peak (GPU only);
*step s* the median wall time of a training step; *loss std* the spread of `actor/loss` over the
trailing window; *reward* the mean of `{rk}` over the first and the last window of steps (across
seeds: their mean, and for the last window ± the std of the per-seed means) and *reward var* its variance (across seeds when repeated, else within the window);
*overflow* counts steps with non-finite gradients or a loss-scale back-off, *skipped* steps whose
optimizer step was skipped; *findings* are audit findings (distinct records) by severity."""


def write_report(out_dir: Path, trailing_window: int | None = None) -> Report:
    """Reads the run directories of ``out_dir`` and writes report.md, report.csv, report_runs.csv, *.png."""
    out_dir = Path(out_dir)
    runs = collect(out_dir)
    suite = _suite_copy(out_dir)
    window = trailing_window or int((suite.get("report") or {}).get("trailing_window", 10))
    rows = pd.DataFrame([run_row(r, window) for r in runs])
    variants = aggregate(rows)
    files = [out_dir / REPORT_CSV, out_dir / REPORT_RUNS_CSV]
    variants.to_csv(files[0], index=False)
    rows.to_csv(files[1], index=False)
    plots: list[Path] = []
    if (suite.get("report") or {}).get("plots", True):
        plots = write_plots(runs, out_dir)
    rk = ", ".join(dict.fromkeys(rows["reward_key"]))
    md = [
        *_header(out_dir, runs, suite, rows),
        "",
        markdown_table(variants, window),
        "",
        _LEGEND.format(rk=rk),
    ]
    notes = [
        f"- **{r['run']}**: {r['status']}"
        + (f" — {r['error']}" if r["error"] else "")
        + (f" — top finding {r['top_finding']}" if r["top_finding"] else "")
        for r in rows.to_dict("records")
        if r["state"] != "completed" or r["top_finding"]
    ]
    missing = _not_run(suite, rows)
    if missing:
        notes.append(f"- not run (interrupted before they started): {', '.join(missing)}")
    if notes:
        md += ["", "## Notes per run", "", *notes]
    if plots:
        md += ["", "## Plots", "", *[f"![{p.stem}]({p.name})" for p in plots]]
    extra, extra_files = precision.section(
        runs, out_dir, plots=(suite.get("report") or {}).get("plots", True)
    )
    md += extra
    plots += extra_files
    mismatch_md, mismatch_files = mismatch_section(
        runs, out_dir, plots=(suite.get("report") or {}).get("plots", True)
    )
    md += mismatch_md
    text = "\n".join(md) + "\n"
    (out_dir / REPORT_MD).write_text(text, encoding="utf-8")
    files += [out_dir / REPORT_MD, *plots, *mismatch_files]
    return Report(markdown=text, variants=variants, runs=rows, files=files)


def _line_plot(
    runs: Sequence[RunDir], keys: Sequence[str], title: str, ylabel: str, path: Path, log: bool = False
) -> bool:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    drawn = False
    for run in runs:
        for key in keys:
            pts = [(s, v) for s, v in run.series(key) if math.isfinite(v) and (v > 0 or not log)]
            if pts:
                ax.plot(*zip(*pts), label=run.path.name if len(keys) == 1 else f"{run.path.name} {key}")
                drawn = True
    if drawn:
        ax.set(title=title, xlabel="step", ylabel=ylabel)
        if log:
            ax.set_yscale("log", base=2)
        ax.legend(fontsize="small")
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(path, dpi=100)
    plt.close(fig)
    return drawn


def _memory_plot(runs: Sequence[RunDir], path: Path) -> bool:
    """Grouped bars: peak memory per phase per run; the overall peak when no phase was recorded."""
    import matplotlib.pyplot as plt

    # The allocator's per-phase peak separates phases; the device view (NVML, or host RSS on CPU)
    # includes all the process ever held, so it is the fallback.
    keys = {k for r in runs for m in r.metrics for k in m if k.startswith("memory/")}
    stat = "allocated_peak_gb" if any(k.endswith("/allocated_peak_gb") for k in keys) else "device_peak_gb"
    sources = {str((r.manifest.get("memory") or {}).get("source") or "device") for r in runs}
    source = "allocator" if stat == "allocated_peak_gb" else "/".join(sorted(sources))
    table: dict[str, dict[str, float]] = {}
    for run in runs:
        peaks: dict[str, float] = {}
        for m in run.metrics:
            for k, v in m.items():
                parts = k.split("/")
                if (
                    len(parts) == 3
                    and parts[0] == "memory"
                    and parts[2] == stat
                    and math.isfinite(to_float(v))
                ):
                    peaks[parts[1]] = max(peaks.get(parts[1], 0.0), to_float(v))
        if not peaks:
            overall = _max(_values(run, "perf/device_memory_peak_gb"))
            if math.isfinite(overall):
                peaks["overall"] = overall
        if peaks:
            table[run.path.name] = peaks
    if not table:
        return False
    df = pd.DataFrame(table).T.fillna(0.0)
    fig, ax = plt.subplots(figsize=(max(7, 1.2 * len(df)), 4.5))
    df.plot.bar(ax=ax, rot=0)
    ax.set(title=f"peak memory per phase ({source})", ylabel="GiB", xlabel="")
    ax.legend(
        fontsize="x-small", ncol=min(6, len(df.columns)), loc="upper center", bbox_to_anchor=(0.5, -0.08)
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def write_plots(runs: Sequence[RunDir], out_dir: Path) -> list[Path]:
    """loss.png, reward.png, memory.png, loss_scale.png: the ones with data to show."""
    import matplotlib

    matplotlib.use("Agg")  # no display on CI machines or GPU hosts
    out: list[Path] = []
    rkeys = list(dict.fromkeys(reward_key(r) for r in runs))
    jobs = [
        ("loss.png", lambda p: _line_plot(runs, ["actor/loss"], "actor loss", "actor/loss", p)),
        ("reward.png", lambda p: _line_plot(runs, rkeys, "reward", " / ".join(rkeys), p)),
        ("memory.png", lambda p: _memory_plot(runs, p)),
        (
            "loss_scale.png",
            lambda p: _line_plot(runs, ["actor/loss_scale"], "actor loss scale", "scale (log2)", p, log=True),
        ),
    ]
    for name, draw in jobs:
        path = Path(out_dir) / name
        if draw(path):
            out.append(path)
        elif path.exists():
            path.unlink()  # a stale plot from an earlier render would contradict the table
    return out
