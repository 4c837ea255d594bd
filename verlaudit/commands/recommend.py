"""`verlaudit recommend SUITE.yaml`: rank precision recipes by measured cost among those within a
tolerance of fp32.

The command: the candidates and their suite (`verlaudit.run.recommend`), the planner's memory for
each, a short run of those that fit (`verlaudit.run.batch`: one worker process for them all, a fresh
one after a failure; ``--isolate``: one process each, `verlaudit.run.runner`), each measured from its run directory,
then the ranking printed and written as recommend.md. Exit 0 when the best candidate is within
tolerance, 1 when none is, 130 interrupted. Exercised by `pytest tests/test_recommend.py`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

from verlaudit.analysis.report import build as report_mod
from verlaudit.audit.settings import SHADOW_MATMULS
from verlaudit.run import batch, runner
from verlaudit.run.hardware import detect
from verlaudit.run.preflight import preflight
from verlaudit.run.recommend import (
    CHECKPOINTING,
    RECIPES,
    Measured,
    Tolerance,
    candidates,
    measure,
    planned,
    rank,
    recommend_suite,
    render,
)
from verlaudit.run.suite import Suite, load_suite
from verlaudit.rundir import RECOMMEND_MD


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("suite", help="suite YAML: its model, algorithm, data and hardware.target are used")
    p.add_argument(
        "--recipes",
        default=",".join(RECIPES),
        help=f"comma-separated recipes (of {', '.join(RECIPES)}); ones that do not apply are left out",
    )
    p.add_argument(
        "--checkpointing",
        default="suite",
        help=f"comma-separated checkpointing choices crossed with the recipes (of {', '.join(CHECKPOINTING)})",
    )
    p.add_argument(
        "--steps", type=int, default=4, help="steps per candidate (the first is shadowed; the rest timed)"
    )
    p.add_argument("--tolerance", help="e.g. logprob=0.05,update_loss=0.25,ratio=4 (the defaults)")
    p.add_argument("--rank-by", choices=("time", "memory"), default="time", help="cost to rank by")
    p.add_argument("--rows", type=int, default=2, help="rows of each shadowed micro-batch run in fp32")
    p.add_argument(
        "--shadow-matmul",
        choices=SHADOW_MATMULS,
        default="fp32",
        help="the shadow's fp32 products: exact, or three TF32 products of split operands (tf32x3: as "
        "accurate, about a third of the time on a GPU, two more block copies of memory)",
    )
    p.add_argument("--device", choices=("cpu", "cuda"), help="run on cpu or cuda regardless of the target")
    p.add_argument(
        "--out", help="directory for the candidates' runs (default reports/<suite>/recommend-<time>)"
    )
    p.add_argument("--json", action="store_true", help="print the ranking as JSON after the table")
    p.add_argument(
        "--isolate",
        action="store_true",
        help="one process per candidate (as verlaudit run); default: the candidates share one, a failure "
        "ends it and the rest go on in a fresh one",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bars")


def main(args: argparse.Namespace) -> int:
    if args.steps < 2:
        raise ValueError(f"--steps: {args.steps}; at least 2 (the first is shadowed, the others are timed)")
    if args.rows < 1:
        raise ValueError(f"--rows: must be >= 1, got {args.rows}")
    tol = Tolerance.parse(args.tolerance)
    suite = load_suite(args.suite, device=args.device)
    recipes = [r for r in args.recipes.split(",") if r]
    cands = candidates(suite, recipes, [c for c in args.checkpointing.split(",") if c])
    if not cands:
        raise ValueError(
            f"--recipes: none of {args.recipes} applies to {suite.train.algo.name} (no critic / reference)"
        )
    rsuite = recommend_suite(suite, cands, steps=args.steps, rows=args.rows, matmul=args.shadow_matmul)
    # what the candidates name (the suite's train: section; not the suite's own variants, which do not
    # run here): plug-ins imported, paths and signatures checked, before any candidate is planned or run
    preflight(dataclasses.replace(rsuite, lines=suite.lines))
    measured = planned(rsuite)
    out_dir, interrupted = _run(rsuite, suite, [m for m in measured if m.fits], args)
    ranked = rank(measured, tol, args.rank_by)
    text = render(ranked, cands, tol, args.rank_by)
    if interrupted:
        text = "Interrupted: the candidates not run are out as 'not run'.\n\n" + text
    print(text)
    if out_dir is not None:
        (out_dir / RECOMMEND_MD).write_text(text + "\n", encoding="utf-8")
    if args.json:
        print(json.dumps([{**dataclasses.asdict(m), "fits": m.fits} for m in ranked], indent=2, default=str))
    if interrupted:
        return 130
    return 0 if ranked and not ranked[0].lost else 1


def _run(
    rsuite: Suite, suite: Suite, fitting: list[Measured], args: argparse.Namespace
) -> tuple[Path | None, bool]:
    """Runs the candidates that fit through the runner and measures each from its run directory;
    returns the output directory (None when nothing ran) and whether the user interrupted."""
    if not fitting:
        return None, False
    default = runner.default_out_dir(suite)
    out_dir = Path(args.out) if args.out else default.with_name("recommend-" + default.name)
    if out_dir.exists() and any(out_dir.iterdir()):
        raise ValueError(f"--out {out_dir}: directory is not empty; choose a new one")
    names = [m.name for m in fitting]
    rsuite = dataclasses.replace(
        rsuite,
        variants={k: rsuite.variants[k] for k in names},
        overrides={k: rsuite.overrides[k] for k in names},
    )
    plan = runner.plan_runs(rsuite, out_dir, detect(), args.device)
    print(
        f"verlaudit recommend: {len(names)} candidate run(s) of {args.steps} steps on {plan.device} -> {out_dir}"
    )
    execute = runner.execute if args.isolate else batch.execute
    done, interrupted = execute(plan, rsuite, out_dir, progress=not args.no_progress)
    report_mod.write_report(out_dir)
    for m in fitting:
        if m.name in done:
            measure(report_mod.read_run_safe(out_dir / m.name), m)
    return out_dir, interrupted
