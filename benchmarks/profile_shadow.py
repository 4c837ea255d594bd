"""Where the fp32 shadow's time goes: the 7B DPO suite's bf16 step with the full audit and the shadow
on the even steps (0 also counts the ops), the boundary level on the odd ones, step 2 under cProfile. Writes
the per-step times (step 2 against steps 1 and 3 is the shadowed step's extra time) and the top
functions by cumulative and by own time. Run on the GPU
machine: ``python benchmarks/profile_shadow.py --out $OUT/shadow_profile.txt`` (``--suite
suites/dpo_tiny_cpu.yaml --device cpu`` as a smoke test).
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import io
import pstats

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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--suite", default="suites/llama7b_h200.yaml")
    ap.add_argument("--variant", default="bf16")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--rows", type=int, default=2)
    ap.add_argument("--top", type=int, default=45)
    args = ap.parse_args()
    from trainer.train import train
    from verlaudit.audit import Auditor, AuditSettings
    from verlaudit.run.suite import load_suite

    suite = load_suite(args.suite, variants=[args.variant], device=args.device)
    cfg = dataclasses.replace(suite.variants[args.variant], steps=args.steps)
    settings = AuditSettings(level="full", full_steps=0, every=2, shadow=True, shadow_rows=args.rows)
    prof = cProfile.Profile()
    with Auditor(None, settings, device=cfg.device) as auditor:
        result = train(cfg, ProfileStep(auditor, prof, step=2))
    lines = [f"suite {args.suite} variant {args.variant} device {args.device} rows {args.rows}"]
    for i, m in enumerate(result.history):
        lines.append(
            f"step {i} ({'full + shadow' if i % 2 == 0 else 'boundary'}): {m['perf/step_time_s']:.3f} s"
        )
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("cumulative").print_stats(args.top)
    t = io.StringIO()
    pstats.Stats(prof, stream=t).sort_stats("tottime").print_stats(args.top)
    text = (
        "\n".join(lines) + "\n\n== by cumulative time\n" + s.getvalue() + "\n== by own time\n" + t.getvalue()
    )
    with open(args.out, "w", encoding="utf-8") as f:
        f.write(text)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
