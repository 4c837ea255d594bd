"""Cost of the plug-in recorder (`verlaudit.audit.plugins`) at the full audit level: the same run with the
auditor watching every plug-in call and with an auditor whose ``plugin_call`` only calls.

Each case is a fresh ``trainer.train.train(config, auditor)`` of one suite variant (tiny PPO by
default: suites/tiny_cpu.yaml, fp32) at level ``full`` on every step (``full_steps`` = steps, the worst
case), same seed. ``watched``: the real `Auditor` (the recorder over the reward function and the
collator, the fp32 re-run of a reward model); ``plain``: `PlainAuditor`, identical but for
``plugin_call``. Both time their plug-in calls (the recorder, its settle and its findings included),
so the recorder's own cost is read apart from the step-time noise of a shared machine. The cases
alternate (watched, plain, plain, watched, ...) over ``--repeats`` pairs. Run:
``python benchmarks/plugin_recorder_overhead.py --out /tmp/rec.json`` (``--variant bf16``, ``--steps``);
on a GPU: ``--suite suites/llama7b_h200_grpo.yaml --variant grpo-bf16 --device cuda``.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import time

from benchmarks._common import environment, median, write_json
from verlaudit.audit import Auditor, AuditSettings


class TimedAuditor(Auditor):
    """The auditor, with the wall time of its plug-in calls summed (``plugin_s``)."""

    plugin_s = 0.0
    plugin_calls = 0

    def plugin_call(self, point, source, call):
        t0 = time.perf_counter()
        try:
            return self._plugin_call(point, source, call)
        finally:
            self.plugin_s += time.perf_counter() - t0
            self.plugin_calls += 1

    def _plugin_call(self, point, source, call):
        return super().plugin_call(point, source, call)


class PlainAuditor(TimedAuditor):
    """The same auditor without the recorder: a plug-in call is only the call."""

    def _plugin_call(self, point, source, call):
        return call()


def run_case(cfg, mode: str, steps: int, device: str = "cpu") -> dict:
    from trainer.train import train

    cls = TimedAuditor if mode == "watched" else PlainAuditor
    settings = AuditSettings(level="full", full_steps=steps, every=0)
    t0 = time.perf_counter()
    with cls(None, settings, device=device) as auditor:
        result = train(dataclasses.replace(cfg, steps=steps), auditor)
    wall = time.perf_counter() - t0
    times = [m["perf/step_time_s"] for m in result.history]
    gc.collect()
    return {
        "mode": mode,
        "wall_s": wall,
        "step_s": median(times),
        "plugin_s": auditor.plugin_s,
        "plugin_calls": auditor.plugin_calls,
        "plugin_findings": sorted({f.kind for f in auditor.findings.all() if f.kind.startswith("plugin/")}),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--suite", default="suites/tiny_cpu.yaml")
    ap.add_argument("--variant", default="fp32")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default="cpu", help="cpu, or cuda (the suite's variant on the GPU)")
    args = ap.parse_args()
    from verlaudit.run.suite import load_suite

    suite = load_suite(args.suite, variants=[args.variant], device=args.device)
    cfg = suite.variants[args.variant]
    runs = []
    for r in range(args.repeats):
        for mode in ("watched", "plain") if r % 2 == 0 else ("plain", "watched"):
            runs.append({"repeat": r, **run_case(cfg, mode, args.steps, args.device)})
            print(runs[-1], flush=True)
            # the finished case's auditor (and through it its models) is garbage only now that run_case has
            # returned; a 7B run's models must be gone before the next case builds its own (session 12: the
            # second case ran out of GPU memory when they were left to the cycle collector's next pass)
            gc.collect()
            if args.device == "cuda":
                import torch

                torch.cuda.empty_cache()
    summary = {}
    for mode in ("watched", "plain"):
        rs = [x for x in runs if x["mode"] == mode]
        summary[mode] = {k: median([x[k] for x in rs]) for k in ("wall_s", "step_s", "plugin_s")}
    w, p = summary["watched"], summary["plain"]
    summary["recorder_s_per_step"] = (w["plugin_s"] - p["plugin_s"]) / args.steps
    summary["step_ratio"] = w["step_s"] / p["step_s"]
    print(summary)
    write_json(args.out, {"environment": environment(), "args": vars(args), "runs": runs, "summary": summary})


if __name__ == "__main__":
    main()
