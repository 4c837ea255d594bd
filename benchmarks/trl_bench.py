"""TRL 1.16 side by side: DPOTrainer and GRPOTrainer timed on the shapes of our 7B suites
(suites/llama7b_h200.yaml, suites/llama7b_h200_grpo.yaml), in the same machine and session as ours.

    PYTHONUNBUFFERED=1 python benchmarks/trl_bench.py --out $OUT                        # H200, ~4 min
    PYTHONPATH=. python benchmarks/trl_bench.py --out /tmp/trl --preset tiny-llama --device cpu --steps 3

TRL is a benchmark-only tool, not a dependency of verlaudit: `pip install "trl==1.16.*"` (it pulls in
`datasets`). The GPU machine has neither; they travel as wheels in .whl (trl 1.16.0, datasets 4.8.5,
dill 0.4.1, multiprocess 0.70.19; everything else they need is installed there) and are installed
with `pip install --no-deps --target /tmp/site .whl/*.whl` before the run.

Shapes (issue 6), both on a random-init model built from `trainer.models` preset `llama2-7b` (the
same LlamaConfig as ours), loaded in fp32 with SDPA attention; TRL's `bf16` flag (autocast, fp32
masters), gradient checkpointing, fused AdamW (`optim="adamw_torch_fused"`), lr 1e-6 constant:
  DPO:  8 pairs per step, prompt 512 + completion 512 tokens (every sequence exactly 1024 tokens,
        checked after TRL's tokenization), beta 0.1, sigmoid loss, frozen reference = a copy of the
        policy (TRL's default would reload the same weights from the model's path; a random-init
        model has none, so the copy is passed as `ref_model`).
  GRPO: 8 prompts x 4 generations, 64 prompt + 256 new tokens (`min_new_tokens=256` keeps EOS out, so
        every completion is 256 tokens; checked in the reward), HF generate (dynamic cache, no vLLM),
        KL beta 0.01 (our kl_coef), per-device batch 8 x 4 accumulation = 32 completions per
        optimizer step, one generation round per step; reward: fraction of even token ids.
        GRPOTrainer has no `ref_model` argument: it reloads the reference from the policy's path,
        so `create_model_from_path` is replaced (for this process only) by a copy of the policy.
The tokenizer is built offline (WordLevel over words ``t<id>``, one token per word) with the model's
vocabulary size and pad/bos/eos set; datasets are built in memory (`Dataset.from_dict`). No eval, no
saving, no external logging, no dataset multiprocessing.

Per trainer: wall time of every optimizer step (a TrainerCallback synchronising the device at
`on_step_begin` / `on_step_end`), median of steps 2-4, peak allocated / reserved device memory (host
RSS peak on CPU), the loss TRL logged each step, and the trl / transformers / torch versions. Each
trainer runs in its own child process, so an OOM in one cannot poison the other. Writes
trl_bench.json and trl_bench.md under --out (and trl_<trainer>.json per child).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from benchmarks._common import environment, median, sync, write_json  # noqa: E402

GIB = 2**30
TRAINERS = ("dpo", "grpo")
SENTINEL_PATH = "trl-bench-random-init"  # the model's _name_or_path: no directory of that name exists
INSTALL_HINT = (
    'TRL is not installed: this benchmark needs trl 1.16 and datasets (pip install "trl==1.16.*"); '
    "on the GPU machine install the wheels carried in .whl first (see this script's docstring)"
)
# REFERENCE_NUMBERS.md, "What users would otherwise pick": TRL 1.16 on one H200. Its GRPO rows do not
# say which KL beta they ran; 102.4 GiB at 7B fits TRL's default beta 0 (no reference copy), so the
# default run here (beta 0.01, a 25 GiB fp32 reference) should sit ~25 GiB above it.
REFERENCE = {
    ("dpo", "llama2-7b"): "2.506 s, 129.2 GiB",
    ("dpo", "llama-1b"): "0.449 s, 19.6 GiB",
    ("grpo", "llama2-7b"): "13.00 s, 102.4 GiB",
    ("grpo", "llama-1b"): "9.24 s, 15.2 GiB",
}
SHAPES = {
    "dpo": dict(pairs=8, prompt_len=512, completion_len=512, beta=0.1),
    "grpo": dict(prompts=8, generations=4, prompt_len=64, new_tokens=256, beta=0.01, micro_batch=8),
}


def require_trl() -> None:
    try:
        import datasets  # noqa: F401
        import trl  # noqa: F401
    except ImportError as e:
        print(f"{INSTALL_HINT} ({type(e).__name__}: {e})", file=sys.stderr)
        raise SystemExit(2) from e


def versions() -> dict[str, str]:
    import accelerate
    import datasets
    import transformers
    import trl

    return {
        "trl": trl.__version__,
        "datasets": datasets.__version__,
        "accelerate": accelerate.__version__,
        "transformers": transformers.__version__,
        "torch": torch.__version__,
    }


def build_tokenizer(vocab_size: int):
    """A fast tokenizer with exactly ``vocab_size`` ids: <pad> <bos> <eos> <unk>, then words ``t4``...

    One whitespace-separated word is one token, so a text of n words is n ids and the sequence
    lengths of the benchmark are exact. No post-processor: nothing (no BOS) is added on encode.
    """
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<bos>", "<eos>", "<unk>"]
    vocab = {tok: i for i, tok in enumerate(specials)}
    vocab.update({f"t{i}": i for i in range(len(specials), vocab_size)})
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>", unk_token="<unk>"
    )
    if len(tok) != vocab_size:
        raise ValueError(f"tokenizer has {len(tok)} ids, expected {vocab_size}")
    return tok


def preset_vocab(preset: str) -> int:
    from trainer.models import PRESETS

    if preset not in PRESETS:
        raise ValueError(f"--preset: unknown preset {preset!r}; expected one of {', '.join(PRESETS)}")
    # Presets without a vocabulary take the tokenizer's; 128 keeps tiny-llama tiny.
    return PRESETS[preset].get("vocab_size", 128)


def build_model(preset: str, tok, device: torch.device):
    """fp32 random-init causal LM of ``preset`` (our LlamaConfig), SDPA, built on ``device``."""
    from transformers import AutoModelForCausalLM

    from trainer.config import ModelConfig
    from trainer.models import preset_config

    config = preset_config(ModelConfig(preset=preset), tok)
    torch.manual_seed(0)
    # Built on the device directly: a 7B fp32 init on the host takes minutes.
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")
    model.config._name_or_path = SENTINEL_PATH
    model.generation_config.pad_token_id = tok.pad_token_id
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.bos_token_id = tok.bos_token_id
    return model


def words(ids) -> str:
    return " ".join(f"t{int(i)}" for i in ids)


def random_ids(gen: torch.Generator, n: int, vocab: int) -> list[int]:
    # Ids 4.. are ordinary words; 0-3 are the special tokens.
    return torch.randint(4, vocab, (n,), generator=gen).tolist()


def make_timer(device: torch.device):
    from transformers import TrainerCallback

    class StepTimer(TrainerCallback):
        """Wall time of each optimizer step (data fetch excluded: Trainer prefetches before
        on_step_begin), and the logs TRL writes after it."""

        def __init__(self) -> None:
            self.times: list[float] = []
            self.logs: list[dict[str, Any]] = []
            self._t0 = 0.0

        def on_step_begin(self, args, state, control, **kwargs):
            sync(device)
            self._t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            sync(device)
            self.times.append(time.perf_counter() - self._t0)
            print(f"step {len(self.times)}: {self.times[-1]:.3f} s", flush=True)

        def on_log(self, args, state, control, logs=None, **kwargs):
            self.logs.append({k: v for k, v in (logs or {}).items() if isinstance(v, (int, float))})

    return StepTimer()


def common_args(out_dir: str, device: torch.device, steps: int) -> dict[str, Any]:
    """TrainingArguments shared by both trainers: only the step, nothing around it."""
    return dict(
        output_dir=out_dir,
        max_steps=steps,
        learning_rate=1e-6,
        lr_scheduler_type="constant",  # ours keeps lr fixed; the schedule costs nothing either way
        bf16=True,
        gradient_checkpointing=True,
        optim="adamw_torch_fused",
        report_to="none",
        save_strategy="no",
        eval_strategy="no",
        logging_steps=1,
        dataloader_num_workers=0,
        use_cpu=device.type == "cpu",
        seed=0,
        disable_tqdm=True,
    )


def run_dpo(preset: str, device: torch.device, steps: int, out_dir: str) -> dict[str, Any]:
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    s = SHAPES["dpo"]
    vocab = preset_vocab(preset)
    tok = build_tokenizer(vocab)
    gen = torch.Generator().manual_seed(0)
    n = s["pairs"] * steps
    # TRL appends EOS to each completion, so completions carry one word fewer.
    c_words = s["completion_len"] - 1
    data = {
        "prompt": [words(random_ids(gen, s["prompt_len"], vocab)) for _ in range(n)],
        "chosen": [" " + words(random_ids(gen, c_words, vocab)) for _ in range(n)],
        "rejected": [" " + words(random_ids(gen, c_words, vocab)) for _ in range(n)],
    }
    t0 = time.perf_counter()
    model = build_model(preset, tok, device)
    ref = copy.deepcopy(model)
    sync(device)
    init_s = time.perf_counter() - t0
    config = DPOConfig(
        **common_args(out_dir, device, steps),
        per_device_train_batch_size=s["pairs"],
        gradient_accumulation_steps=1,
        beta=s["beta"],
        max_length=s["prompt_len"] + s["completion_len"],
        precompute_ref_log_probs=False,
    )
    timer = make_timer(device)
    t0 = time.perf_counter()
    trainer = DPOTrainer(
        model=model,
        ref_model=ref,
        args=config,
        train_dataset=Dataset.from_dict(data),
        processing_class=tok,
        callbacks=[timer],
    )
    build_s = time.perf_counter() - t0
    lengths = sorted(
        {(len(r["prompt_ids"]), len(r["chosen_ids"]), len(r["rejected_ids"])) for r in trainer.train_dataset}
    )
    want = (s["prompt_len"], s["completion_len"], s["completion_len"])
    if lengths != [want]:
        raise ValueError(f"DPO sequences are not {want} tokens (prompt, chosen, rejected): {lengths[:5]}")
    return _train(trainer, timer, device) | {
        "shape": f"{s['pairs']} pairs x ({s['prompt_len']} + {s['completion_len']}) tokens",
        "init_s": init_s,
        "trainer_build_s": build_s,
        "token_lengths": {"prompt": want[0], "chosen": want[1], "rejected": want[2]},
        "params": sum(p.numel() for p in model.parameters()),
    }


# long: TRL's GRPO trainer set up, warmed up and timed in one place
def run_grpo(
    preset: str, device: torch.device, steps: int, out_dir: str, beta: float = SHAPES["grpo"]["beta"]
) -> dict[str, Any]:
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer
    from trl.trainer import grpo_trainer

    s = SHAPES["grpo"]
    vocab = preset_vocab(preset)
    tok = build_tokenizer(vocab)
    gen = torch.Generator().manual_seed(0)
    prompts = [words(random_ids(gen, s["prompt_len"], vocab)) for _ in range(s["prompts"] * steps)]
    completion_lengths: list[int] = []

    def even_token_fraction(prompts, completions, completion_ids, **kwargs) -> list[float]:
        completion_lengths.extend(len(c) for c in completion_ids)
        return [sum(1 for t in c if t % 2 == 0) / max(len(c), 1) for c in completion_ids]

    t0 = time.perf_counter()
    model = build_model(preset, tok, device)
    sync(device)
    init_s = time.perf_counter() - t0

    def copy_of_policy(model_id: str, *args: Any, **kwargs: Any):
        if model_id != SENTINEL_PATH:
            raise ValueError(f"GRPOTrainer asked for {model_id!r}; this benchmark only has its own policy")
        return copy.deepcopy(model)

    if not hasattr(grpo_trainer, "create_model_from_path"):
        raise RuntimeError(
            "trl.trainer.grpo_trainer.create_model_from_path is gone: TRL changed; update this"
        )
    grpo_trainer.create_model_from_path = copy_of_policy
    micro = s["micro_batch"]
    per_step = s["prompts"] * s["generations"]
    config = GRPOConfig(
        **common_args(out_dir, device, steps),
        per_device_train_batch_size=micro,
        gradient_accumulation_steps=per_step // micro,
        num_generations=s["generations"],
        max_completion_length=s["new_tokens"],
        generation_kwargs={"min_new_tokens": s["new_tokens"]},
        beta=beta,
        use_vllm=False,
    )
    if config.generation_batch_size != per_step:
        raise ValueError(f"GRPO generation batch is {config.generation_batch_size}, expected {per_step}")
    timer = make_timer(device)
    t0 = time.perf_counter()
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=even_token_fraction,
        args=config,
        train_dataset=Dataset.from_dict({"prompt": prompts}),
        processing_class=tok,
        callbacks=[timer],
    )
    build_s = time.perf_counter() - t0
    generate_s = time_generate(model, device)
    prompt_lengths = {len(tok(p)["input_ids"]) for p in prompts}
    if prompt_lengths != {s["prompt_len"]}:
        raise ValueError(f"GRPO prompts are {sorted(prompt_lengths)} tokens, expected {s['prompt_len']}")
    record = _train(trainer, timer, device)
    if set(completion_lengths) != {s["new_tokens"]}:
        raise ValueError(
            f"GRPO completions were {sorted(set(completion_lengths))} tokens, not {s['new_tokens']}"
        )
    return record | {
        "shape": f"{s['prompts']} prompts x {s['generations']} generations, "
        f"{s['prompt_len']} + {s['new_tokens']} tokens, KL beta {beta:g}",
        "init_s": init_s,
        "trainer_build_s": build_s,
        "generate_s": generate_s,
        "median_generate_s": median(generate_s[1:4]) if len(generate_s) > 1 else None,
        "kl_beta": beta,
        "reference_model": beta != 0.0,
        "completions": len(completion_lengths),
        "completions_per_step": per_step,
        "batching": f"per_device_train_batch_size {micro} x gradient_accumulation_steps {per_step // micro}",
        "params": sum(p.numel() for p in model.parameters()),
    }


def time_generate(model, device: torch.device) -> list[float]:
    """Wraps ``model.generate`` (after the reference copy is made) to record each rollout's wall
    time, so a GRPO step splits into generation and the rest."""
    times: list[float] = []
    inner = model.generate

    def timed(*args: Any, **kwargs: Any):
        sync(device)
        t0 = time.perf_counter()
        result = inner(*args, **kwargs)
        sync(device)
        times.append(time.perf_counter() - t0)
        return result

    model.generate = timed
    return times


def _train(trainer, timer, device: torch.device) -> dict[str, Any]:
    t0 = time.perf_counter()
    trainer.train()
    sync(device)
    opt = getattr(trainer.optimizer, "optimizer", trainer.optimizer)  # accelerate wraps it
    return {
        "optimizer": f"{type(opt).__name__} fused={opt.defaults.get('fused')}",
        "bf16_flag": trainer.args.bf16,
        "model_dtype": str(trainer.model.dtype),
        "train_total_s": time.perf_counter() - t0,
        "step_times_s": timer.times,
        # Step 1 holds allocator warm-up and lazy init; steps 2-4 are the steady state.
        "median_step_s": median(timer.times[1:4]) if len(timer.times) > 1 else None,
        "losses": [log["loss"] for log in timer.logs if "loss" in log],
        "logs": timer.logs,
    }


def memory(device: torch.device) -> dict[str, Any]:
    if device.type == "cuda":
        return {
            "peak_allocated_gib": torch.cuda.max_memory_allocated(device) / GIB,
            "peak_reserved_gib": torch.cuda.max_memory_reserved(device) / GIB,
        }
    # ru_maxrss is KiB on Linux.
    return {"peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}


def child(args: argparse.Namespace, device: torch.device, out: Path) -> int:
    """One trainer in this process; the record (or the error, OOM included) goes to trl_<which>.json."""
    which, preset, steps = args.child, args.preset, args.steps
    record: dict[str, Any] = {"trainer": which, "preset": preset, "steps": steps, "device": str(device)}
    try:
        record["versions"] = versions()
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        with tempfile.TemporaryDirectory(prefix=f"trl_{which}_") as tmp:
            if which == "dpo":
                record.update(run_dpo(preset, device, steps, tmp))
            else:
                record.update(run_grpo(preset, device, steps, tmp, beta=args.grpo_beta))
    except Exception as e:  # noqa: BLE001 - recorded in the JSON; the parent still renders the other trainer
        record["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
        record["traceback"] = traceback.format_exc()[-3000:]
        print(record["traceback"], file=sys.stderr, flush=True)
    record.update(memory(device))
    write_json(out / f"trl_{which}.json", record)
    return 1 if "error" in record else 0


def render(records: list[dict[str, Any]], env: dict[str, Any]) -> str:
    v = next((r["versions"] for r in records if "versions" in r), {})
    lines = [
        f"# TRL {v.get('trl', '?')} on {env.get('gpu_name', env.get('device', '?'))}",
        "",
        f"transformers {v.get('transformers', '?')}, torch {v.get('torch', '?')}, datasets "
        f"{v.get('datasets', '?')}, accelerate {v.get('accelerate', '?')}. fp32-loaded model, TRL's bf16 "
        "flag, gradient checkpointing, fused AdamW, SDPA. Step: median of steps 2-4.",
        "",
        "| trainer | preset | shape | step (median 2-4) | step times | peak allocated | reference |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in records:
        ref = REFERENCE.get((r["trainer"], r["preset"]), "—")
        if "error" in r:
            step, times = f"failed: {r['error'][:120]}", "—"
        else:
            step = f"{r['median_step_s']:.3f} s" if r.get("median_step_s") is not None else "—"
            if r.get("median_generate_s") is not None:
                step += f" (generate {r['median_generate_s']:.2f} s)"
            times = ", ".join(f"{t:.2f}" for t in r["step_times_s"])
        if "peak_allocated_gib" in r:
            mem = f"{r['peak_allocated_gib']:.1f} GiB"
        else:
            mem = f"{r.get('peak_rss_gib', float('nan')):.2f} GiB host RSS"
        lines.append(
            f"| {r['trainer'].upper()}Trainer | {r['preset']} | {r.get('shape', '—')} | {step} | {times} "
            f"| {mem} | {ref} |"
        )
    return "\n".join(lines) + "\n"


def parent(args: argparse.Namespace, which: list[str], out: Path) -> int:
    records = []
    for w in which:
        cmd = [
            sys.executable,
            __file__,
            "--child",
            w,
            "--out",
            str(out),
            "--preset",
            args.preset,
            "--device",
            args.device,
            "--steps",
            str(args.steps),
            "--grpo-beta",
            str(args.grpo_beta),
        ]
        print(f"== {w}: {' '.join(cmd)}", flush=True)
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(cmd, timeout=args.timeout, env={**os.environ, "PYTHONUNBUFFERED": "1"})
            rc = proc.returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
        path = out / f"trl_{w}.json"
        if path.exists():
            rec = json.loads(path.read_text())
        else:  # killed before it could write (host OOM, timeout): say so rather than drop the row
            rec = {"trainer": w, "preset": args.preset, "error": f"child exited {rc} without a record"}
        rec["child_wall_s"] = time.perf_counter() - t0
        records.append(rec)
    env = environment() | {"device": args.device}
    write_json(out / "trl_bench.json", {"environment": env, "results": records})
    table = render(records, env)
    (out / "trl_bench.md").write_text(table)
    print(table, flush=True)
    return 1 if any("error" in r for r in records) else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="directory for trl_bench.json / trl_bench.md")
    ap.add_argument("--which", default="dpo,grpo", help="comma-separated subset of dpo,grpo")
    ap.add_argument(
        "--preset", default="llama2-7b", help="trainer.models preset (tiny-llama for a smoke test)"
    )
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--steps", type=int, default=5, help="optimizer steps per trainer (median of steps 2-4)")
    ap.add_argument(
        "--grpo-beta",
        type=float,
        default=SHAPES["grpo"]["beta"],
        help="GRPO KL coefficient (0.01 = our suite's kl_coef; 0 = TRL's default, no reference model)",
    )
    ap.add_argument("--timeout", type=float, default=420.0, help="seconds per trainer before it is killed")
    ap.add_argument("--child", choices=TRAINERS, help=argparse.SUPPRESS)
    args = ap.parse_args()
    which = [w.strip() for w in args.which.split(",") if w.strip()]
    bad = [w for w in which if w not in TRAINERS]
    if bad or not which:
        ap.error(f"--which: {bad or which!r} not in {', '.join(TRAINERS)}")
    if args.steps < 2:
        ap.error("--steps: at least 2 (step 1 is warm-up and is left out of the median)")
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device here; use --device cpu with --preset tiny-llama")
    try:
        preset_vocab(args.preset)  # unknown preset: fail here, not in each child
    except ValueError as e:
        ap.error(str(e))
    require_trl()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.child:
        return child(args, device, out)
    return parent(args, which, out)


if __name__ == "__main__":
    sys.exit(main())
