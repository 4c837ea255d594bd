"""The memory planner's peak beside the measured one, per variant of a finished suite run.

Plans every run of SUITE from the config its manifest recorded (so ``checkpoint_layers: auto`` is
the number the run really used), reads each run directory's metrics (largest
``perf/max_memory_allocated_gb``, every step's ``perf/step_time_s``) and status, and prints a
markdown table: planned allocated peak, measured peak, planner error, step times.

    python benchmarks/planner_vs_runs.py suites/llama7b_h200_grpo.yaml reports/gpu/llama7b_h200_grpo_suite
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def measured(run_dir: Path) -> dict:
    """Status, largest allocator peak (GiB) and step times of one run directory."""
    status = json.loads((run_dir / "status.json").read_text()) if (run_dir / "status.json").is_file() else {}
    rows = []
    if (run_dir / "metrics.jsonl").is_file():
        rows = [
            json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()
        ]
    peaks = [
        r["perf/max_memory_allocated_gb"]
        for r in rows
        if isinstance(r.get("perf/max_memory_allocated_gb"), float)
    ]
    state = status.get("state", "?") + (f" ({status['reason']})" if status.get("reason") else "")
    return {
        "status": state,
        "peak_gib": max(peaks) if peaks else None,
        "steps_s": [r["perf/step_time_s"] for r in rows if "perf/step_time_s" in r],
    }


def main() -> int:
    from verlaudit.analysis.diagnose.failure import run_plan_inputs
    from verlaudit.plan.planner import GIB, plan_config
    from verlaudit.run.suite import load_suite
    from verlaudit.rundir import read_run

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("suite")
    ap.add_argument("runs", help="the suite run's output directory (one sub-directory per variant)")
    ap.add_argument(
        "--memory-gb", type=float, help="usable GiB per GPU the runs had (default: the suite's target)"
    )
    args = ap.parse_args()
    runs = Path(args.runs)
    suite = load_suite(args.suite)
    print(
        "| variant | checkpointed layers | compiled | status | planned peak GiB | measured peak GiB | planner error | step s (each step) |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for variant in suite.variants:
        run_dir = runs / variant
        if not (run_dir / "manifest.json").is_file():
            continue
        run = read_run(run_dir)
        cfg, policy, gpus, optimizer = run_plan_inputs(run)
        est, _ = plan_config(cfg, gpus=gpus, optimizer=optimizer, policy=policy)
        m = measured(run_dir)
        pc = cfg.precision
        layers = (
            "-"
            if not pc.grad_checkpointing
            else ("all" if pc.checkpoint_layers is None else str(pc.checkpoint_layers))
        )
        planned = est.peak_bytes / GIB
        err = f"{(planned - m['peak_gib']) / m['peak_gib']:+.1%}" if m["peak_gib"] else "-"
        steps = ", ".join(f"{s:.2f}" for s in m["steps_s"]) or "-"
        peak = f"{m['peak_gib']:.1f}" if m["peak_gib"] else "-"
        compiled = "yes" if cfg.model.compile else "no"
        print(
            f"| {variant} | {layers} | {compiled} | {m['status']} | {planned:.1f} | {peak} | {err} | {steps} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
