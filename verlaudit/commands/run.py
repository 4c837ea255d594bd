"""`verlaudit run SUITE.yaml`: every variant in its own process, then the comparison report.

The command: parse the flags, load and preflight the suite, plan the runs and execute them
(`verlaudit.run.runner`), print a summary line as each run ends and the report at the end
(`verlaudit.analysis.report.build`). Exit codes: 0 every variant completed (refused variants
included: refusing is the answer the suite asked for), 1 some variant failed or was killed, 2 bad
suite or arguments, 130 interrupted. Exercised by `verlaudit run suites/tiny_cpu.yaml` and
`pytest tests/test_runner.py`.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from verlaudit.analysis.report import build as report_mod
from verlaudit.integrations import tensorboard as tb
from verlaudit.run import runner, worker
from verlaudit.run.hardware import detect
from verlaudit.run.preflight import PreflightError, preflight_problems
from verlaudit.run.suite import AUDIT_LEVELS, DEVICES, load_suite

DEFAULT_SUITE = "suites/tiny_cpu.yaml"


def summary_line(run_dir: Path, record: Mapping[str, Any] | None = None) -> str:
    """One line per variant: status, steps, loss, reward, memory, time, findings."""
    row = report_mod.run_row(report_mod.read_run_safe(run_dir), trailing_window=10)
    parts = [f"{row['run']}: {row['status']}", f"{row['steps']} steps"]
    for label, key, fmt in (
        ("loss", "loss_last", ".4g"),
        ("reward", "reward_mean", ".3f"),
        ("peak", "device_peak_gb", ".2f"),
        ("step", "step_time_s", ".3f"),
    ):
        v = row.get(key)
        if v is not None and v == v:
            parts.append(
                f"{label} {v:{fmt}}"
                + (" GiB" if key == "device_peak_gb" else "s" if key == "step_time_s" else "")
            )
    parts.append(f"findings {row['errors']}E/{row['warnings']}W")
    if record and "wall_s" in record:
        parts.append(f"wall {record['wall_s']:.0f}s")
    return " | ".join(parts)


def _csv(value: str | None, cast: Any, flag: str) -> list[Any] | None:
    if value is None:
        return None
    items = [v.strip() for v in value.split(",") if v.strip()]
    try:
        return [cast(v) for v in items]
    except ValueError:
        raise ValueError(f"{flag}: {value!r}; expected a comma-separated list, e.g. {flag} 0,1") from None


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("suite", nargs="?", default=DEFAULT_SUITE, help=f"suite YAML (default {DEFAULT_SUITE})")
    p.add_argument("--steps", type=int, help="training steps for every variant (overrides the suite)")
    p.add_argument("--variants", help="comma-separated variant names to run (default: all)")
    p.add_argument("--seeds", help="comma-separated seeds (default: the suite's)")
    p.add_argument("--out", help="output directory (default reports/<suite>/<YYYYmmdd-HHMMSS>)")
    p.add_argument("--device", choices=DEVICES, help="run on cpu or cuda regardless of the suite's target")
    p.add_argument("--audit-level", choices=AUDIT_LEVELS, help="override the suite's audit.level")
    p.add_argument("--no-progress", action="store_true", help="no progress bars (summary lines only)")
    p.add_argument(
        "--tensorboard",
        action="store_true",
        help="also write TensorBoard event files of every run (OUT/tensorboard/<run>; needs tensorboard)",
    )
    p.add_argument(
        "--report-only", metavar="DIR", help="re-render report.md/csv/png from an existing output directory"
    )


def main(args: argparse.Namespace) -> int:
    if args.report_only:
        rep = report_mod.write_report(Path(args.report_only))
        print(rep.markdown)
        return 0
    suite = load_suite(
        args.suite,
        steps=args.steps,
        variants=_csv(args.variants, str, "--variants"),
        seeds=_csv(args.seeds, int, "--seeds"),
        device=args.device,
        audit_level=args.audit_level,
    )
    if getattr(args, "tensorboard", False):
        tb.require()  # before any run, not after them
    out_dir = Path(args.out) if args.out else runner.default_out_dir(suite)
    # plug-ins imported, model directories read, engines installed: before any worker starts
    problems = preflight_problems(suite)
    if problems:  # stop before any worker with the one-line error: a malformed suite wastes no run
        first = next(iter(problems.values()))
        if args.out:
            write_refusals(suite, out_dir, problems, args.device)
        raise PreflightError(str(first), variants=tuple(problems))
    if out_dir.exists() and any(out_dir.iterdir()):
        raise ValueError(
            f"--out {out_dir}: directory is not empty; choose a new one (or --report-only {out_dir})"
        )
    plan = runner.plan_runs(suite, out_dir, detect(), args.device)
    runs = len(plan.runs)
    print(f"verlaudit run: suite {suite.name} ({runs} run{'s' * (runs != 1)} on {plan.device}) -> {out_dir}")
    for note in plan.notes:
        print(f"  note: {note}")
    started, started_at, load = time.monotonic(), runner.now(), runner.loadavg()
    done, interrupted = runner.execute(
        plan, suite, out_dir, progress=not args.no_progress, on_run=print_progress
    )
    runner.record_run(
        out_dir, command=_command(args), started_at=started_at, load=load, wall_s=time.monotonic() - started
    )
    rep = report_mod.write_report(out_dir)
    print()
    print(rep.markdown)
    if getattr(args, "tensorboard", False):
        exported = tb.export_tree(out_dir)
        print(f"\ntensorboard: {len(exported)} run(s) -> tensorboard --logdir {out_dir / tb.TB_DIR}")
    print(f"\nreport: {out_dir / 'report.md'} (wall time {time.monotonic() - started:.0f} s)")
    if interrupted:
        return 130
    failed = [n for n in done if runner.failed(out_dir / n)]
    return 1 if failed else 0


def _one_line(e: BaseException) -> str:
    """The message as `verlaudit.cli` prints an error: one line."""
    return " ".join(line.strip() for line in str(e).splitlines() if line.strip())


def _sub_suite(suite: Any, names: Any) -> Any:
    keep = [v for v in suite.variants if v in names]
    return dataclasses.replace(
        suite,
        variants={v: suite.variants[v] for v in keep},
        overrides={v: suite.overrides[v] for v in keep if v in suite.overrides},
    )


def write_refusals(
    suite: Any, out_dir: Path, problems: Mapping[str, PreflightError], device: str | None
) -> list[Path]:
    """Every variant the preflight refused, as a refused run directory under
    ``--out`` (the manifest and a status with the one-line error), so that `verlaudit diagnose` on it
    names the key. Nothing is written into a directory that is not new or empty, nor when the suite
    cannot be planned."""
    if out_dir.exists() and any(out_dir.iterdir()):
        return []
    try:
        plan = runner.plan_runs(_sub_suite(suite, problems), out_dir, detect(), device)
    except ValueError:
        return []
    for planned in plan.runs:
        worker.write_refused(planned.spec, _one_line(problems[planned.run.variant]), why="preflight")
    return [p.spec.run_dir for p in plan.runs]


def _command(args: argparse.Namespace) -> str:
    """The command line as a user would type it again (tests call the CLI in-process: no sys.argv)."""
    parts = ["verlaudit run", str(args.suite)]
    for flag in ("steps", "variants", "seeds", "out", "device", "audit_level"):
        value = getattr(args, flag)
        if value is not None:
            parts.append(f"--{flag.replace('_', '-')} {value}")
    return " ".join(parts)


def print_progress(p: runner.Progress) -> None:
    """A run ended: its summary line (the refusal, or where Ctrl-C stopped the suite)."""
    if p.refused:
        print(f"{p.name}: refused: {p.refused}", flush=True)
    elif p.not_started is not None:
        print(
            f"interrupted during {p.name}; not started: {', '.join(p.not_started) or 'none'}", file=sys.stderr
        )
    else:
        print(summary_line(p.run_dir, p.record), flush=True)
