"""Learning curves of the tiny CPU setups: reward (PPO, GRPO) or margin (DPO) at start and end, per precision.

    PYTHONPATH=. python benchmarks/learning_curves.py [--algos ppo,grpo,dpo] [--out reports/learning_curves_cpu.md]

tiny-llama (random init) on the built-in ``digits`` task, seed 0, one torch thread, CPU. "start" and
"end" are the means of the first and last 5 steps. The settings (`trainer.data.TINY_LEARNING_SETTINGS`) are the ones the suites
(`suites/tiny_cpu.yaml`, `grpo_tiny_cpu.yaml`, `dpo_tiny_cpu.yaml`) and tests/test_train.py use to show
learning on a ~100k-parameter model; the config defaults (lr 1e-4) are sized for real models.
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trainer.config import TrainConfig  # noqa: E402
from trainer.data import TINY_LEARNING_SETTINGS  # noqa: E402
from trainer.train import train  # noqa: E402

SETTINGS = TINY_LEARNING_SETTINGS
STEPS = {"ppo": 40, "grpo": 40, "dpo": 30}
PRESETS = ("fp32", "fp16", "bf16", "bf16-pure")


def curve(algo: str, preset: str) -> dict:
    cfg = TrainConfig.from_dict({"algo": {"name": algo, **SETTINGS[algo]}, "precision": {"preset": preset},
                                 "steps": STEPS[algo], "device": "cpu", "seed": 0, "threads": 1})  # fmt: skip
    t0 = time.perf_counter()
    history = train(cfg).history
    wall = time.perf_counter() - t0
    key = "rewards/margins" if algo == "dpo" else "critic/score/mean"
    values = [m[key] for m in history]
    k = 5
    return {"algo": algo, "preset": preset, "metric": key, "start": sum(values[:k]) / k,
            "end": sum(values[-k:]) / k, "steps": len(history), "wall_s": wall,
            "skipped": sum(m.get("actor/skipped", 0.0) for m in history)}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--algos", default="ppo,grpo,dpo")
    ap.add_argument("--out", default=None, help="write the markdown table here as well")
    args = ap.parse_args()
    torch.set_num_threads(1)
    lines = [
        f"# Learning curves on CPU ({platform.machine()}, torch {torch.__version__}, 1 thread)",
        "",
        f"Command: `PYTHONPATH=. python benchmarks/learning_curves.py --algos {args.algos}`",
        "",
        "| algo | precision | metric | start (first 5) | end (last 5) | steps | wall s | skipped steps |",
        "|---|---|---|---|---|---|---|---|",
    ]
    print("\n".join(lines), flush=True)
    for algo in args.algos.split(","):
        for preset in PRESETS:
            r = curve(algo, preset)
            row = (f"| {algo} | {preset} | {r['metric']} | {r['start']:.3f} | {r['end']:.3f} | {r['steps']} | "
                   f"{r['wall_s']:.1f} | {r['skipped']:.0f} |")  # fmt: skip
            print(row, flush=True)
            lines.append(row)
    if args.out:
        Path(args.out).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
