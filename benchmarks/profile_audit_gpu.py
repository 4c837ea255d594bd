"""Where the full audit level's time goes: the 7B DPO step with no observer and with the full audit on
every step, in one process, with Python's garbage collections timed and one step of each under
``torch.profiler``.

For each level (order none, full, full, none unless ``--levels``): a fresh ``trainer.train.train``
of ``--steps`` steps; every collection Python makes is timed through ``gc.callbacks`` and assigned to
the step it fell in (step boundaries from ``on_step_start`` / ``on_step_end``), so a slow step shows
whether a full (generation 2) collection sat in it. With ``--profile-step K`` step K of the first
pass of each level runs under the profiler: the top ops by self CPU and by device time, and the
number of kernel launches, go to the JSON. Run on the GPU machine:
``python benchmarks/profile_audit_gpu.py --out $OUT/profile.json`` (``--suite suites/dpo_tiny_cpu.yaml
--device cpu --steps 4`` as a smoke test).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import time
from typing import Any

import torch

from benchmarks._common import environment, median, write_json
from benchmarks.maxima_bench import METHODS
from trainer.events import Observer


class StepClock:
    """Marks step boundaries in wall time; forwards every other event to ``inner`` (the auditor, or
    the trainer's no-op observer) and steps the profiler at the end of each step. Not an `Observer`
    subclass: its no-op methods would shadow ``__getattr__``'s forwarding."""

    def __init__(self, inner: Observer | None, profiler: Any = None) -> None:
        self.inner = inner if inner is not None else Observer()
        self.profiler = profiler
        self.bounds: list[tuple[int, float, float]] = []
        self._start = 0.0

    def __getattr__(self, name: str) -> Any:  # only called for what this class does not define
        return getattr(self.inner, name)

    def on_step_start(self, step: int) -> None:
        self._start = time.perf_counter()
        self.inner.on_step_start(step)

    def on_step_end(self, step: int, metrics: Any) -> None:
        self.inner.on_step_end(step, metrics)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.bounds.append((step, self._start, time.perf_counter()))
        if self.profiler is not None:
            self.profiler.step()


class GcTimer:
    """Every collection: (generation, start, seconds, objects collected)."""

    def __init__(self) -> None:
        self.events: list[tuple[int, float, float, int]] = []
        self._t0 = 0.0

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            self.events.append(
                (info["generation"], self._t0, time.perf_counter() - self._t0, info["collected"])
            )

    def __enter__(self) -> GcTimer:
        gc.callbacks.append(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        gc.callbacks.remove(self)


def _profile_table(prof: Any, device: str) -> dict[str, Any]:
    events = prof.key_averages()
    dev_key = (
        "self_device_time_total" if hasattr(events[0], "self_device_time_total") else "self_cuda_time_total"
    )

    def top(key: str, n: int = 60) -> list[dict[str, Any]]:
        rows = sorted(events, key=lambda e: getattr(e, key, 0), reverse=True)[:n]
        return [
            {
                "name": e.key,
                "calls": e.count,
                "self_cpu_ms": e.self_cpu_time_total / 1e3,
                "self_device_ms": getattr(e, dev_key, 0) / 1e3,
            }
            for e in rows
        ]

    launches = sum(e.count for e in events if "cudaLaunchKernel" in e.key or "cuLaunchKernel" in e.key)
    return {
        "top_self_cpu": top("self_cpu_time_total"),
        "audit_ranges": [
            {
                "name": e.key,
                "calls": e.count,
                "cpu_ms": e.cpu_time_total / 1e3,
                "device_ms": getattr(e, dev_key.replace("self_", ""), 0) / 1e3,
            }
            for e in events
            if e.key.startswith("audit::")
        ],
        "top_self_device": top(dev_key) if device == "cuda" else [],
        "kernel_launches": launches,
        "self_cpu_total_ms": sum(e.self_cpu_time_total for e in events) / 1e3,
        "self_device_total_ms": sum(getattr(e, dev_key, 0) for e in events) / 1e3,
    }


def run_case(cfg: Any, level: str, steps: int, profile_step: int | None) -> dict[str, Any]:
    from trainer.train import train
    from verlaudit.audit import Auditor, AuditSettings

    cfg = dataclasses.replace(cfg, steps=steps)
    prof = None
    if profile_step is not None:
        acts = [torch.profiler.ProfilerActivity.CPU]
        if cfg.device == "cuda":
            acts.append(torch.profiler.ProfilerActivity.CUDA)
        prof = torch.profiler.profile(
            activities=acts, schedule=torch.profiler.schedule(wait=profile_step, warmup=0, active=1, repeat=1)
        )
    gc.collect()
    tracked_at_start = len(gc.get_objects())
    with GcTimer() as gct:
        if prof is not None:
            prof.__enter__()
        try:
            if level == "none":
                clock = StepClock(None, prof)
                result = train(cfg, clock)
            else:
                settings = AuditSettings(level=level, full_steps=steps if level == "full" else 0, every=0)
                with Auditor(None, settings, device=cfg.device) as auditor:
                    clock = StepClock(auditor, prof)
                    result = train(cfg, clock)
        finally:
            if prof is not None:
                prof.__exit__(None, None, None)
    tracked_at_end = len(gc.get_objects())
    per_step = []
    for step, t0, t1 in clock.bounds:
        inside = [e for e in gct.events if t0 <= e[1] < t1]
        per_step.append(
            {
                "step": step,
                "wall_s": t1 - t0,
                "gc_s": sum(e[2] for e in inside),
                "gc_gen2": sum(1 for e in inside if e[0] == 2),
                "gc_gen2_s": sum(e[2] for e in inside if e[0] == 2),
            }
        )
    times = [m["perf/step_time_s"] for m in result.history]
    steady = [t for i, t in enumerate(times) if i > 0 and i != profile_step]  # the profiled step is slower
    out: dict[str, Any] = {
        "level": level,
        "step_times_s": times,
        "profiled_step": profile_step,
        "median_steady_s": median(steady),
        "mean_steady_s": sum(steady) / max(1, len(steady)),
        "per_step": per_step,
        "gc_collections": len(gct.events),
        "gc_gen2_durations_s": [round(e[2], 4) for e in gct.events if e[0] == 2],
        "tracked_objects": [tracked_at_start, tracked_at_end],
    }
    if prof is not None:
        out["profile"] = _profile_table(prof, cfg.device)
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return out


ANNOTATE = (
    ("verlaudit.audit.probes", "Maxima.of"),
    ("verlaudit.audit.probes", "ModuleProbe.flush"),
    ("verlaudit.audit.auditor", "Auditor._model_state"),
    ("verlaudit.audit.auditor", "Auditor.on_backward"),
    ("verlaudit.audit.auditor", "Auditor.on_before_optimizer_step"),
    ("verlaudit.audit.auditor", "Auditor.on_optimizer_step"),
    ("verlaudit.audit.auditor", "Auditor.on_step_start"),
    ("verlaudit.audit.auditor", "Auditor.on_step_end"),
    ("verlaudit.audit.auditor", "Auditor.on_batch"),
    ("verlaudit.audit.auditor", "Auditor.on_forward"),
    ("verlaudit.audit.auditor", "Auditor.on_loss"),
    ("verlaudit.audit.optimizer", "OptimizerWatch.backward"),
    ("verlaudit.audit.optimizer", "OptimizerWatch.before_step"),
    ("verlaudit.audit.optimizer", "OptimizerWatch.after_step"),
)
"""Audit entry points wrapped in ``record_function`` with ``--annotate``: the profile then gives each
its CPU and device time (kernels launched inside it)."""


def annotate() -> None:
    import functools
    import importlib

    for module, qual in ANNOTATE:
        owner_name, _, fn_name = qual.rpartition(".")
        owner = getattr(importlib.import_module(module), owner_name)
        fn = getattr(owner, fn_name)

        def wrap(fn: Any, label: str) -> Any:
            @functools.wraps(fn)
            def inner(*a: Any, **k: Any) -> Any:
                with torch.profiler.record_function(label):
                    return fn(*a, **k)

            return inner

        setattr(owner, fn_name, wrap(fn, f"audit::{qual}"))


REDUCTIONS = METHODS
"""The reductions ``--maxima`` can swap into the probes: benchmarks/maxima_bench.py's, which times them alone."""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--suite", default="suites/llama7b_h200.yaml")
    ap.add_argument("--variant", default="bf16")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--levels", default="none,full,full,none")
    ap.add_argument("--profile-step", type=int, default=3, help="profile this step of each level's first run")
    ap.add_argument("--maxima", choices=tuple(REDUCTIONS), help="the probes' absolute-maximum reduction")
    ap.add_argument("--annotate", action="store_true", help="audit entry points as profiler ranges")
    args = ap.parse_args()
    if args.annotate:
        annotate()
    if args.maxima:
        from verlaudit.audit import probes

        probes.absmax = REDUCTIONS[args.maxima]
    from verlaudit.run.suite import load_suite

    suite = load_suite(args.suite, variants=[args.variant], device=args.device)
    cfg = suite.variants[args.variant]
    res: dict[str, Any] = {"environment": environment(), "args": vars(args), "runs": []}
    profiled: set[str] = set()
    for level in args.levels.split(","):
        pstep = None if level in profiled or args.profile_step < 0 else args.profile_step
        profiled.add(level)
        res["runs"].append(run_case(cfg, level, args.steps, pstep))
        write_json(args.out, res)
    for level in dict.fromkeys(args.levels.split(",")):
        runs = [r for r in res["runs"] if r["level"] == level]
        res.setdefault("summary", {})[level] = {
            "median_steady_s": median([r["median_steady_s"] for r in runs]),
            "mean_steady_s": sum(r["mean_steady_s"] for r in runs) / len(runs),
        }
    write_json(args.out, res)


if __name__ == "__main__":
    main()
