"""Learning curves of the tiny CPU setups: reward (PPO, GRPO and verl's other estimators) or margin (DPO)
at start and end, per precision.

    PYTHONPATH=. python benchmarks/learning_curves.py [--runs ppo,grpo,dpo,rloo,...] [--out reports/learning_curves_cpu.md]

tiny-llama (random init) on the built-in ``digits`` task, seed 0, one torch thread, CPU. "start" and
"end" are the means of the first and last 5 steps. The settings (`trainer.data.TINY_LEARNING_SETTINGS`)
are the ones the suites (`suites/tiny_cpu.yaml`, `grpo_tiny_cpu.yaml`, `dpo_tiny_cpu.yaml`) and
tests/test_train.py use to show learning on a ~100k-parameter model; the config defaults (lr 1e-4) are
sized for real models. Every critic-free run (``RUNS``) is the GRPO settings with one verl option changed (and its switch).
"""

from __future__ import annotations

import argparse
import os
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
RUNS: dict[str, tuple[str, dict]] = {
    "ppo": ("ppo", {}),
    "grpo": ("grpo", {}),
    "dpo": ("dpo", {}),
    "rloo": ("grpo", {"adv_estimator": "rloo"}),
    "reinforce_plus_plus": ("grpo", {"adv_estimator": "reinforce_plus_plus"}),
    "reinforce_plus_plus_baseline": ("grpo", {"adv_estimator": "reinforce_plus_plus_baseline"}),
    "remax": ("grpo", {"adv_estimator": "remax"}),
    "gpg": ("grpo", {"adv_estimator": "gpg", "loss_mode": "gpg"}),
    "opo": ("grpo", {"adv_estimator": "opo"}),
    "grpo_passk": ("grpo", {"adv_estimator": "grpo_passk"}),
    "drgrpo": ("grpo", {"norm_adv_by_std_in_grpo": False, "loss_agg_mode": "seq-mean-token-sum-norm"}),
    "gspo": ("grpo", {"loss_mode": "gspo"}),
    "cispo": ("grpo", {"loss_mode": "cispo"}),
    "sapo": ("grpo", {"loss_mode": "sapo"}),
    "geo_mean": ("grpo", {"loss_mode": "geo_mean"}),
    "grpo_vectorized": ("grpo", {"adv_estimator": "grpo_vectorized"}),
    "rloo_vectorized": ("grpo", {"adv_estimator": "rloo_vectorized"}),
    "token_sum": ("grpo", {"loss_agg_mode": "token-sum"}),
    "kl_loss_k3plus": ("grpo", {"use_kl_loss": True, "kl_loss_type": "k3+"}),
    # verl's example bounds (examples/dppo_trainer: 0.15 for TV, 0.05 for KL, clip_ratio_c 10000)
    "dppo_tv": ("grpo", {"loss_mode": "dppo_tv", "clip_ratio": 0.15, "clip_ratio_c": 10000.0}),
    "dppo_kl": ("grpo", {"loss_mode": "dppo_kl", "clip_ratio": 0.05, "clip_ratio_c": 10000.0}),
    # the tiny model's token probabilities are ~1/vocab: at verl's bounds no token ever leaves the trust region
    "dppo_kl_tight": ("grpo", {"loss_mode": "dppo_kl", "clip_ratio": 0.0005, "clip_ratio_c": 10000.0}),
    "dro": ("grpo", {"loss_mode": "dro", "dro_beta": 0.1}),
    "bypass_ppo_clip": ("grpo", {"loss_mode": "bypass_mode", "rollout_correction": {"bypass_mode": True}}),
    "bypass_reinforce": (
        "grpo",
        {
            "loss_mode": "bypass_mode",
            "rollout_correction": {"bypass_mode": True, "loss_type": "reinforce", "rollout_is": "token"},
        },
    ),
    "icepop": ("grpo", {"rollout_correction": {"rollout_is": "token", "rollout_is_threshold": "0.5_2.0"}}),
    "optimal_token_baseline": ("grpo", {"adv_estimator": "optimal_token_baseline"}),
    "tir_optimal_token_baseline": ("grpo", {"adv_estimator": "tir_optimal_token_baseline"}),
    "gdpo": ("grpo", {"adv_estimator": "gdpo", "gdpo_reward_keys": ["correct", "digits"]}),
}
"""Run name -> (recipe, ``algo`` options on top of its tiny learning settings; ``rollout_correction``: that
section's options)."""
DATA: dict[str, dict] = {"gdpo": {"reward_fn": "trainer.data:digits_parts"}}
"""Run name -> ``data`` options, for a run that needs them (GDPO: the digits reward in its two parts)."""
NEW_ESTIMATORS = ",".join(n for n in RUNS if n not in ("ppo", "grpo", "dpo"))
STEPS = {"ppo": 40, "grpo": 40, "dpo": 30}
PRESETS = ("fp32", "fp16", "bf16", "bf16-pure")


def curve(run: str, preset: str) -> dict:
    algo, extra = RUNS[run]
    extra = dict(extra)
    correction = extra.pop("rollout_correction", {})
    cfg = TrainConfig.from_dict(
        {
            "algo": {"name": algo, **SETTINGS[algo], **extra},
            "rollout_correction": correction,
            "data": DATA.get(run, {}),
            "precision": {"preset": preset},
            "steps": STEPS[algo],
            "device": "cpu",
            "seed": 0,
            "threads": 1,
        }
    )
    t0 = time.perf_counter()
    history = train(cfg).history
    wall = time.perf_counter() - t0
    key = "rewards/margins" if algo == "dpo" else "critic/score/mean"
    values = [m[key] for m in history]
    k = 5
    return {"run": run, "preset": preset, "metric": key, "start": sum(values[:k]) / k,
            "end": sum(values[-k:]) / k, "steps": len(history), "wall_s": wall,
            "skipped": sum(m.get("actor/skipped", 0.0) for m in history)}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", default=f"ppo,grpo,dpo,{NEW_ESTIMATORS}", help=f"any of {', '.join(RUNS)}")
    ap.add_argument("--out", default=None, help="write the markdown report here as well")
    args = ap.parse_args()
    runs = args.runs.split(",")
    unknown = [r for r in runs if r not in RUNS]
    if unknown:
        ap.error(f"--runs: unknown {', '.join(unknown)}; expected any of {', '.join(RUNS)}")
    torch.set_num_threads(1)
    lines = [
        f"# Learning curves on CPU ({platform.machine()}, torch {torch.__version__}, 1 thread)",
        "",
        f"Command: `PYTHONPATH=. python benchmarks/learning_curves.py --runs {args.runs}`",
        "",
        "| run | algo options | precision | metric | start (first 5) | end (last 5) | steps | wall s | skipped steps |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    print("\n".join(lines), flush=True)
    results = []
    for run in runs:
        data = "".join(f", data.{k}: {v}" for k, v in DATA.get(run, {}).items())
        options = (", ".join(f"{k}: {v}" for k, v in RUNS[run][1].items()) or "(recipe defaults)") + data
        for preset in PRESETS:
            r = curve(run, preset)
            results.append(r)
            row = (
                f"| {run} | {RUNS[run][0]}; {options} | {preset} | {r['metric']} | {r['start']:.3f} | "
                f"{r['end']:.3f} | {r['steps']} | {r['wall_s']:.1f} | {r['skipped']:.0f} |"
            )
            print(row, flush=True)
            lines.append(row)
    flat = [f"{r['run']}/{r['preset']}" for r in results if r["end"] <= r["start"]]
    import transformers

    lines += [
        "",
        f"Machine: {os.cpu_count()} CPU cores ({platform.machine()}, shared with other jobs: wall times are "
        f"noisy), {torch.get_num_threads()} torch thread, no GPU, Python "
        f"{platform.python_version()}, transformers {transformers.__version__}. tiny-llama (random init), digits "
        "task, seed 0. Settings: `trainer.data.TINY_LEARNING_SETTINGS` plus each run's algo options.",
        f"Runs whose end is not above their start: {', '.join(flat) if flat else 'none'}. "
        f"Skipped steps in total: {sum(r['skipped'] for r in results):.0f}.",
    ]
    print("\n".join(lines[-3:]), flush=True)
    if args.out:
        Path(args.out).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
