"""`verlaudit compare RUN --baseline DIR`: a run against its baseline, as a CI regression report.

The command: read both sides and the suite's `compare:` settings, run the checks
(`verlaudit.analysis.ci.compare`), print the markdown, write JUnit XML / markdown files when asked,
or update the baseline. Exit 1 when a check fails, 0 otherwise, 2 on bad input. Exercised by
`pytest tests/test_compare.py tests/test_ci_baseline.py`.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from verlaudit.analysis.ci import tolerance as tolmodel
from verlaudit.analysis.ci.compare import (
    DEFAULT_TOLERANCES,
    compare_runs,
    config_differences,
    default_baseline,
    load_runs,
    load_settings,
    model_note,
    render_junit,
    render_markdown,
    write_baseline,
)
from verlaudit.rundir import is_run_dir


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run", help="run directory or suite report directory to check")
    p.add_argument(
        "--baseline",
        help="baseline run or report directory (default: the suite's compare.baseline, else "
        "reports/baselines/<suite>/<device>)",
    )
    p.add_argument("--junit", metavar="FILE", help="write JUnit XML (one test case per variant x check)")
    p.add_argument(
        "--markdown", metavar="FILE", help="write the markdown summary (for a pull-request comment)"
    )
    p.add_argument(
        "--tolerances",
        action="append",
        default=[],
        metavar="K=V[,K=V]",
        help=f"override tolerances: {', '.join(f'{k} (default {v:g})' for k, v in DEFAULT_TOLERANCES.items())}",
    )
    p.add_argument(
        "--gate",
        action="append",
        default=[],
        metavar="EXPR",
        help="gate expression, e.g. 'median(actor/grad_norm) < 5' (repeatable)",
    )
    p.add_argument(
        "--update-baseline",
        action="store_true",
        help="copy RUN into the baseline directory and print what changed (exit 0)",
    )


def main(args: argparse.Namespace) -> int:
    run_path = Path(args.run)
    now_runs, suite = load_runs(run_path, "RUN")
    settings = load_settings(suite.get("compare"), args.tolerances, args.gate)
    # --baseline, else the suite's compare.baseline (resolved against the suite file when it loaded)
    named = args.baseline or (suite.get("compare") or {}).get("baseline")
    base_path = Path(named) if named else default_baseline(now_runs, suite)
    suite_name = str(suite.get("name") or next(iter(now_runs.values())).manifest.get("suite") or "suite")
    has_baseline = base_path.is_dir() and (
        is_run_dir(base_path) or any(is_run_dir(c) for c in base_path.iterdir())
    )
    if args.update_baseline:
        if has_baseline:
            base_runs, _ = load_runs(base_path, "BASELINE")
            checks = compare_runs(base_runs, now_runs, settings, tolmodel.load_model(base_path))
            changed = [c for c in checks if c.verdict != "pass"]
            print(
                f"updating baseline {base_path}; what changed ({len(changed)} of {len(checks)} checks differ):"
            )
            for c in changed:
                print(f"  {c.variant} {c.check}: {c.baseline} -> {c.now} ({c.message})")
            for n in config_differences(base_runs, now_runs):
                print(f"  config: {n}")
        else:
            print(
                f"creating baseline {base_path} from {run_path} ({len(now_runs)} runs: {', '.join(now_runs)})"
            )
        write_baseline(now_runs, run_path, base_path)
        print(model_note(tolmodel.load_model(base_path), now_runs, base_path))
        return 0
    if not has_baseline:
        raise ValueError(
            f"baseline {base_path}: no run directories there; create one with "
            f"`verlaudit compare {run_path} --baseline {base_path} --update-baseline`"
        )
    base_runs, _ = load_runs(base_path, "BASELINE")
    checks = compare_runs(base_runs, now_runs, settings, tolmodel.load_model(base_path))
    md = render_markdown(checks, str(run_path), str(base_path), config_differences(base_runs, now_runs))
    print(md)
    if args.markdown:
        Path(args.markdown).write_text(md, encoding="utf-8")
    if args.junit:
        Path(args.junit).write_text(render_junit(checks, suite_name), encoding="utf-8")
    return 1 if any(c.verdict == "fail" for c in checks) else 0
