"""Audit overhead on CPU: what each audit level adds to a mid-size DPO step, side by side in one process.

On a GPU every host read of a device value (``.item()``, ``float(t)``, ``bool(t)``, ``.tolist()``,
``.cpu()``) is a stream sync; on CPU it is free, so wall time alone understates the GPU cost. This
script therefore reports, per level, the median step time, the host reads per step (calls of
those Tensor methods, counted by wrapping them; the trainer's own reads are in every level, so the
difference to ``off`` is the auditor's) and the aten ops dispatched per step that are not views (a
`TorchDispatchMode` counts them: on a GPU each is a kernel launch, so the difference to ``none`` is
the audit's launches). Levels run interleaved (none, off, boundary, full, full,
boundary, off, none) so machine drift shows as spread between passes. Run:
``PYTHONPATH=. python benchmarks/profile_audit_cpu.py`` (``--grad-ckpt`` as in the 7B suites; hidden 512, 8 layers, fp32, 3 steps; a few minutes on
2 CPU cores: fp16/bf16 autocast on CPU is ~10x slower, and the audit work measured here does not depend on it)
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
from collections import Counter
from collections.abc import Iterator

import torch

READS = ("item", "tolist", "cpu", "__bool__", "__float__", "__int__")


@contextlib.contextmanager
def count_host_reads() -> Iterator[Counter]:
    counts: Counter = Counter()
    saved = {name: getattr(torch.Tensor, name) for name in READS}

    def wrap(name, fn):
        def counted(self, *args, **kwargs):
            counts[name] += 1
            return fn(self, *args, **kwargs)

        return counted

    for name, fn in saved.items():
        setattr(torch.Tensor, name, wrap(name, fn))
    try:
        yield counts
    finally:
        for name, fn in saved.items():
            setattr(torch.Tensor, name, fn)


class _CountOps:
    """Counts the non-view aten ops dispatched while entered (views launch no kernel)."""

    def __init__(self) -> None:
        from torch.utils._python_dispatch import TorchDispatchMode

        counter = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
                if not func.is_view:
                    counter.n += 1
                return func(*args, **(kwargs or {}))

        self.n = 0
        self.mode = Mode()

    def __enter__(self) -> _CountOps:
        self.mode.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.mode.__exit__(*exc)


def build_config(hidden: int, layers: int, preset: str, steps: int, seq: int, ckpt: bool = False):
    from trainer.config import TrainConfig

    return TrainConfig.from_dict(
        {
            "model": {
                "preset": "tiny-llama",
                "overrides": {
                    "hidden_size": hidden,
                    "num_hidden_layers": layers,
                    "intermediate_size": hidden * 2,
                    "num_attention_heads": 8,
                    "num_key_value_heads": 4,
                },
            },
            "data": {"task": "digits", "prompt_length": seq, "response_length": seq},
            "algo": {"name": "dpo", "lr": 1e-4, "batch_size": 8, "mini_batch_size": 8, "micro_batch_size": 4},
            "precision": {"preset": preset, "grad_checkpointing": ckpt},
            "steps": steps,
            "threads": 2,
            "device": "cpu",
        }
    )


def run_level(cfg, level: str, count_ops: bool = False) -> dict:
    from trainer.train import train
    from verlaudit.audit import Auditor, AuditSettings

    observer = None
    if level != "none":
        settings = AuditSettings(level=level, full_steps=cfg.steps if level == "full" else 0, every=0)
        observer = Auditor(None, settings, device="cpu")
    ops = _CountOps() if count_ops else contextlib.nullcontext()
    with count_host_reads() as counts, ops:
        result = _train(train, cfg, observer)
    times = [m["perf/step_time_s"] for m in result.history]
    return {
        "level": level,
        "step_s": statistics.median(times[1:]),
        "reads_per_step": sum(counts.values()) / cfg.steps,
        "ops_per_step": ops.n / cfg.steps if count_ops else float("nan"),
    }


def _train(train, cfg, obs_cm):
    if obs_cm is None:
        return train(cfg, None)
    with obs_cm as auditor:
        return train(cfg, auditor)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--seq", type=int, default=16)
    ap.add_argument("--preset", default="fp32")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--passes", type=int, default=2)
    ap.add_argument("--levels", default="none,off,boundary,full")
    ap.add_argument("--grad-ckpt", action="store_true", help="activation checkpointing on")
    ap.add_argument("--ops", action="store_true", help="also count dispatched ops (slows every level alike)")
    args = ap.parse_args()
    torch.set_num_threads(2)
    cfg = build_config(args.hidden, args.layers, args.preset, args.steps, args.seq, args.grad_ckpt)
    levels = args.levels.split(",")
    runs: dict[str, list[dict]] = {lv: [] for lv in levels}
    for p in range(args.passes):
        for lv in levels if p % 2 == 0 else reversed(levels):
            runs[lv].append(run_level(cfg, lv, args.ops))
    base = statistics.median(r["step_s"] for r in runs[levels[0]])
    print(
        f"hidden={args.hidden} layers={args.layers} preset={args.preset} steps={args.steps} passes={args.passes}"
        f" grad_ckpt={args.grad_ckpt}"
    )
    print(
        f"{'level':10s} {'step_s':>8s} {'vs ' + levels[0]:>9s} {'host reads/step':>16s} {'ops/step':>9s}  "
        "per-pass step_s"
    )
    for lv in levels:
        ts = [r["step_s"] for r in runs[lv]]
        med = statistics.median(ts)
        reads = statistics.median(r["reads_per_step"] for r in runs[lv])
        ops = statistics.median(r["ops_per_step"] for r in runs[lv])
        print(
            f"{lv:10s} {med:8.3f} {med / base - 1:+8.1%} {reads:16.1f} {ops:9.0f}  "
            + " ".join(f"{t:.3f}" for t in ts)
        )


if __name__ == "__main__":
    main()
