"""The `AuditCallback`'s overhead on a TRL DPO step: the same run with and without it, step times compared.

    python benchmarks/trl_callback_overhead.py                                   # CPU, tiny-llama (a smoke run)
    python benchmarks/trl_callback_overhead.py --device cuda --preset llama2-7b --bf16 --steps 12 --seq 512

Builds the model from a `trainer.models` preset (random init, the project's tokenizer: no hub), a frozen
reference copy, an in-memory preference dataset, and runs `trl.DPOTrainer` ``--steps`` steps twice per
pass (``--passes`` alternating passes, without then with the callback, so drift hits both). Step time
is the wall time between ``on_step_begin`` and ``on_step_end`` (after a device sync), the first
``--warmup`` steps dropped. Prints one JSON line: median and mean step seconds of each arm and the
overhead ratio (with / without - 1) by the median; the issue's target is <= 3% at the boundary level.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, TrainerCallback
from trl import DPOConfig, DPOTrainer

from trainer.config import ModelConfig
from trainer.models import PRESETS, preset_config
from trainer.tokenizer import build_tokenizer
from verlaudit.integrations.trl import AuditCallback


class StepTimer(TrainerCallback):
    def __init__(self, device: torch.device) -> None:
        self.device, self.t0, self.times = device, 0.0, []

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def on_step_begin(self, args, state, control, **kw):  # noqa: ANN001
        self._sync()
        self.t0 = time.perf_counter()

    def on_step_end(self, args, state, control, **kw):  # noqa: ANN001
        self._sync()
        self.times.append(time.perf_counter() - self.t0)


def one_run(opts: argparse.Namespace, tok, audited: bool, out: Path) -> list[float]:
    device = torch.device(opts.device)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(preset_config(ModelConfig(preset=opts.preset), tok))
    ref = copy.deepcopy(model).to(torch.bfloat16 if opts.bf16 else torch.float32)
    digits = "0123456789"
    n = opts.steps * opts.batch
    rows = [
        {
            "prompt": "".join(digits[(i + j) % 10] for j in range(opts.seq // 2)),
            "chosen": "".join(digits[(i * 3 + j) % 10] for j in range(opts.seq // 4)),
            "rejected": "".join(digits[(i * 7 + j) % 10] for j in range(opts.seq // 4)),
        }
        for i in range(n)
    ]
    args = DPOConfig(
        output_dir=str(out / "trl"),
        per_device_train_batch_size=opts.batch,
        max_steps=opts.steps,
        max_length=opts.seq,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        use_cpu=device.type == "cpu",
        bf16=opts.bf16,
        gradient_checkpointing=opts.grad_ckpt,
        seed=0,
    )
    trainer = DPOTrainer(
        model=model, ref_model=ref, args=args, train_dataset=Dataset.from_list(rows), processing_class=tok
    )
    timer = StepTimer(device)
    trainer.add_callback(timer)
    if audited:
        AuditCallback.attach(trainer, out / "run", level=opts.level)
    trainer.train()
    del trainer, model, ref
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return timer.times[opts.warmup :]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--preset", default="tiny-llama", choices=sorted(PRESETS))
    p.add_argument("--bf16", action="store_true", help="DPOConfig(bf16=True); reference stored in bf16")
    p.add_argument("--grad-ckpt", action="store_true", help="gradient checkpointing (a 7B step on one GPU)")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--passes", type=int, default=2)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--level", default="boundary", choices=["off", "boundary", "full"])
    opts = p.parse_args()
    if opts.steps <= opts.warmup:
        raise SystemExit(f"--steps {opts.steps}: must exceed --warmup {opts.warmup}")
    tok = build_tokenizer()
    times: dict[str, list[float]] = {"without": [], "with": []}
    with tempfile.TemporaryDirectory(prefix="trl-overhead-") as tmp:
        for i in range(opts.passes):
            for arm in ("without", "with"):
                times[arm] += one_run(opts, tok, arm == "with", Path(tmp) / f"{arm}{i}")
    med = {arm: statistics.median(t) for arm, t in times.items()}
    print(
        json.dumps(
            {
                "device": opts.device,
                "gpu": torch.cuda.get_device_name() if opts.device.startswith("cuda") else None,
                "preset": opts.preset,
                "bf16": opts.bf16,
                "level": opts.level,
                "steps_timed": {arm: len(t) for arm, t in times.items()},
                "median_s": med,
                "mean_s": {arm: statistics.fmean(t) for arm, t in times.items()},
                "overhead_median": med["with"] / med["without"] - 1.0,
            }
        )
    )


if __name__ == "__main__":
    main()
