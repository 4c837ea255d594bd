"""Audit overhead: the same DPO step with no observer and with the auditor at each level, in one process.

Each case is a fresh ``trainer.train.train(config, observer)`` (the 7B DPO step of
suites/llama7b_h200.yaml, bf16 + grad ckpt by default) with ``observer`` = none (the trainer's no-op
observer), ``Auditor(level=off|boundary|full)``; ``full`` audits every step (full_steps = steps), so
its ratio is the worst case. Step time is the median of steps 2-4; ratios are against ``none``.
Cases run twice in alternating order (none, off, boundary, full, full, boundary, off, none) so drift
on the machine shows up as a difference between the two passes. Run:
``python benchmarks/bench_audit.py --out $OUT/audit.json`` (``--suite suites/dpo_tiny_cpu.yaml
--device cpu`` for a smoke test).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc

import torch

from benchmarks._common import environment, guarded, median, write_json


def run_case(cfg, level: str, steps: int) -> dict:
    from trainer.train import train
    from verlaudit.audit import Auditor, AuditSettings

    cfg = dataclasses.replace(cfg, steps=steps)
    if level == "none":
        result = train(cfg, None)
    else:
        settings = AuditSettings(level=level, full_steps=steps if level == "full" else 0, every=0)
        with Auditor(None, settings, device=cfg.device if cfg.device != "auto" else "cpu") as auditor:
            result = train(cfg, auditor)
    times = [m["perf/step_time_s"] for m in result.history]
    gc.collect()
    return {
        "level": level,
        "step_times_s": times,
        "step_s": median(times[1:4]) if len(times) >= 4 else median(times),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--suite", default="suites/llama7b_h200.yaml")
    ap.add_argument("--variant", default="bf16")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--levels", default="none,off,boundary,full")
    ap.add_argument("--passes", type=int, default=2)
    args = ap.parse_args()
    from verlaudit.run.suite import load_suite

    suite = load_suite(args.suite, variants=[args.variant], device=args.device)
    cfg = suite.variants[args.variant]
    res: dict = {"environment": environment(), "args": vars(args), "config": cfg.to_dict(), "runs": []}
    levels = args.levels.split(",")
    for p in range(args.passes):
        for level in levels if p % 2 == 0 else list(reversed(levels)):
            out: dict = {}
            guarded(out, "r", run_case, cfg, level, args.steps)
            res["runs"].append({"pass": p, "level": level, **out["r"]})
            write_json(args.out, res)
    base = [r["step_s"] for r in res["runs"] if r["level"] == "none" and "step_s" in r]
    summary = {}
    for level in levels:
        ts = [r["step_s"] for r in res["runs"] if r["level"] == level and "step_s" in r]
        if ts:
            summary[level] = {
                "step_s": median(ts),
                "ratio_vs_none": median(ts) / median(base) if base else None,
            }
    res["summary"] = summary
    write_json(args.out, res)


if __name__ == "__main__":
    main()
