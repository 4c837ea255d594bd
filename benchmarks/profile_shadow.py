"""What the fp32 shadow costs and where its time goes: the 7B DPO suite's bf16 step with the full audit and
the shadow on the even steps (step 0 also counts the ops and warms up), the boundary level on the odd
ones (1.003x a plain step), one shadowed step under cProfile. Writes the per-step times, the shadowed
step's extra time against the plain steps of the same run (the median of the unprofiled shadowed steps
after step 0 minus the median of the odd steps), the shadow's own time (``timing_s/shadow``, CUDA
events) and the top functions by cumulative and by own time. Run on the GPU machine: ``python
benchmarks/profile_shadow.py --out $OUT/shadow.txt`` (``--suite suites/dpo_tiny_cpu.yaml --device
cpu`` as a smoke test; ``--rows 1``, ``--no-param-grads``, ``--matmul tf32x3``, ``--profile-step -1``
to vary it).
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import io
import json
import pstats
import statistics
import tempfile
from pathlib import Path

import torch


class ProfileStep:
    """Forwards every event to the auditor; runs ``prof`` from the start to the end of ``step``."""

    def __init__(self, inner: object, prof: cProfile.Profile, step: int) -> None:
        self.inner, self.prof, self.step = inner, prof, step

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)

    def on_step_start(self, step: int) -> None:
        if step == self.step:
            self.prof.enable()
        self.inner.on_step_start(step)

    def on_step_end(self, step: int, metrics: object) -> None:
        self.inner.on_step_end(step, metrics)
        if step == self.step:
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            self.prof.disable()


def summary(history: list[dict[str, float]], profiled: int) -> list[str]:
    """The per-step lines (with the shadow's own time and its actor numbers, to compare settings) and
    the shadowed step's extra time against the plain (odd) steps."""
    lines = []
    for i, m in enumerate(history):
        kind = "full + shadow" if i % 2 == 0 else "boundary"
        extra = f", shadow {m['timing_s/shadow']:.3f} s" if "timing_s/shadow" in m else ""
        for key, label in (("logprob_err/mean", "log-prob err"), ("max_ratio", "max ratio")):
            if f"shadow/actor/{key}" in m:
                extra += f", {label} {m[f'shadow/actor/{key}']:.4g}"
        if "perf/max_memory_allocated_gb" in m:
            extra += f", max allocated {m['perf/max_memory_allocated_gb']:.1f} GiB"
        mark = " (cProfile)" if i == profiled else ""
        lines.append(f"step {i} ({kind}{mark}): {m['perf/step_time_s']:.3f} s{extra}")
    plain = [m["perf/step_time_s"] for i, m in enumerate(history) if i % 2 == 1]
    shadowed = [m["perf/step_time_s"] for i, m in enumerate(history) if i % 2 == 0 and i not in (0, profiled)]
    if plain and shadowed:
        p, s = statistics.median(plain), statistics.median(shadowed)
        lines.append(
            f"shadowed step {s:.3f} s vs plain step {p:.3f} s (median of steps "
            f"{[i for i in range(len(history)) if i % 2 == 1]}): extra {s - p:.3f} s = {(s - p) / p:.2f} plain steps"
        )
    else:
        lines.append("no unprofiled shadowed step after step 0: run more --steps for the comparison")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--suite", default="suites/llama7b_h200.yaml")
    ap.add_argument("--variant", default="bf16")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--rows", type=int, default=2)
    ap.add_argument("--no-param-grads", action="store_true", help="audit.shadow_param_grads: false")
    ap.add_argument("--matmul", default="fp32", help="audit.shadow_matmul: fp32 or tf32x3")
    ap.add_argument("--profile-step", type=int, default=4, help="the shadowed step under cProfile (-1: none)")
    ap.add_argument("--top", type=int, default=45)
    args = ap.parse_args()
    from trainer.train import train
    from verlaudit.audit import Auditor, AuditSettings
    from verlaudit.run.suite import load_suite
    from verlaudit.rundir import METRICS, RunWriter

    suite = load_suite(args.suite, variants=[args.variant], device=args.device)
    cfg = dataclasses.replace(suite.variants[args.variant], steps=args.steps)
    settings = AuditSettings(
        level="full",
        full_steps=0,
        every=2,
        shadow=True,
        shadow_rows=args.rows,
        shadow_param_grads=not args.no_param_grads,
        shadow_matmul=args.matmul,
    )
    prof = cProfile.Profile()
    with tempfile.TemporaryDirectory() as tmp:  # the auditor's metrics lines carry timing_s/shadow
        with RunWriter(tmp) as writer, Auditor(writer, settings, device=cfg.device) as auditor:
            train(cfg, ProfileStep(auditor, prof, step=args.profile_step))
        history = [json.loads(line) for line in (Path(tmp) / METRICS).read_text().splitlines() if line]
    head = (
        f"suite {args.suite} variant {args.variant} device {args.device} rows {args.rows} "
        f"param grads {not args.no_param_grads} matmul {args.matmul}"
    )
    lines = [head, *summary(history, args.profile_step)]
    text = "\n".join(lines) + "\n"
    if 0 <= args.profile_step < args.steps:
        s, t = io.StringIO(), io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("cumulative").print_stats(args.top)
        pstats.Stats(prof, stream=t).sort_stats("tottime").print_stats(args.top)
        text += "\n== by cumulative time\n" + s.getvalue() + "\n== by own time\n" + t.getvalue()
    with open(args.out, "w", encoding="utf-8") as f:
        f.write(text)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
