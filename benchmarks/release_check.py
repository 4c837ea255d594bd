"""Does a finished in-process run give its device memory back without waiting for the cycle collector?

Two runs of one suite variant back to back in one process, with the cycle collector off: after each returns,
the GPU memory still allocated (``torch.cuda.memory_allocated``) before and after an explicit ``gc.collect()``.
Before session 13's change to trainer/train.py the first run's models stayed allocated until a gc pass (the
first import of the model stack inside ``train()`` pinned its frames), and a second 7B case could run out of
memory.

    PYTHONPATH=. python benchmarks/release_check.py --suite suites/llama7b_h200_grpo.yaml --variant grpo-bf16 \
        --steps 1 --out $OUT/release.json
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import time

from benchmarks._common import environment, write_json
from trainer.train import train
from verlaudit.run.suite import load_suite


def gib(n: int) -> float:
    return round(n / 2**30, 3)


def one_run(cfg, steps: int) -> float:
    t0 = time.perf_counter()
    train(dataclasses.replace(cfg, steps=steps))
    return time.perf_counter() - t0


def main() -> None:
    import torch

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--suite", required=True)
    p.add_argument("--variant", required=True)
    p.add_argument("--steps", type=int, default=1)
    p.add_argument("--runs", type=int, default=2)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    cfg = load_suite(args.suite, variants=[args.variant], device="cuda").variants[args.variant]
    gc.collect()
    gc.disable()
    rows = []
    for i in range(args.runs):
        wall = one_run(cfg, args.steps)
        before = torch.cuda.memory_allocated()
        gc.collect()
        after = torch.cuda.memory_allocated()
        rows.append(
            {
                "run": i,
                "wall_s": round(wall, 1),
                "allocated_gib_before_gc": gib(before),
                "allocated_gib_after_gc": gib(after),
                "peak_gib": gib(torch.cuda.max_memory_allocated()),
            }
        )
        print(rows[-1], flush=True)
        torch.cuda.reset_peak_memory_stats()
    write_json(args.out, {"environment": environment(), "args": vars(args), "runs": rows})


if __name__ == "__main__":
    main()
