"""Rollout engine throughput at the Llama-2-7B shape: HF generate (dynamic and static cache) beside our
static decode loop, eager and with the decode step captured as a CUDA graph, in one process.

    PYTHONUNBUFFERED=1 python benchmarks/rollout_bench.py --out $OUT                 # H200, ~2 min
    python benchmarks/rollout_bench.py --out /tmp/rb --device cpu --preset tiny-llama  # CPU smoke

Shape (issue 6): bf16 weights (``bf16-pure`` rollout role), batch 32, 128-token prompts (four rows
left-padded), 128 new tokens, plain sampling (temperature 1, no top-k). Per engine: median wall time
of ``--repeats`` calls after one warm-up, new tokens/s (batch x 128 / wall), peak allocated memory,
and for our engines the prefill / decode / graph-capture split. The weight-bandwidth floor is the
bytes of every weight a decode step reads (all but the embedding table) over the device-to-device
copy bandwidth measured in the same run (bytes read + written / time), so one decode step of batch B
can emit at most B / floor tokens per second. Same-seed agreement between the engines is recorded,
not asserted. Writes rollout_bench.json and rollout_bench.md under --out.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

GIB = 2**30
ENGINES = ("ours_static", "ours_static_graphs", "hf_static", "hf_dynamic")


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def environment(dev: torch.device) -> dict:
    import transformers

    env = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cuda": torch.version.cuda,
        "device": str(dev),
    }
    if dev.type == "cuda":
        props = torch.cuda.get_device_properties(dev)
        env.update(gpu_name=props.name, total_memory_gb=round(props.total_memory / GIB, 1))
        try:
            q = ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]
            env["driver"] = subprocess.run(q, capture_output=True, text=True, timeout=30).stdout.strip()
        except (OSError, subprocess.SubprocessError) as e:
            env["driver"] = f"unknown ({e})"
    return env


def copy_bandwidth(dev: torch.device) -> float:
    """Device-to-device copy, bytes read + written per second (median of 10 after 3 warm-ups)."""
    if dev.type != "cuda":
        return float("nan")
    src = torch.empty(2 * GIB, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    times = []
    for i in range(13):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src)
        b.record()
        b.synchronize()
        if i >= 3:
            times.append(a.elapsed_time(b) / 1e3)
    del src, dst
    return 2 * 2 * GIB / statistics.median(times)


def build(preset: str, dev: torch.device):
    from trainer.config import ModelConfig
    from trainer.models import build_causal_lm
    from trainer.precision import resolve_policy
    from trainer.tokenizer import build_tokenizer

    tok = build_tokenizer()
    policy = resolve_policy("bf16-pure")
    model = build_causal_lm(ModelConfig(preset=preset), tok, policy["actor"], dev, seed=0)
    return model, tok, policy["rollout"]


def prompts(vocab: int, batch: int, width: int, dev: torch.device):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(4, vocab, (batch, width), generator=g)
    mask = torch.ones_like(ids)
    for row, pad in enumerate((1, 7, 31, 64)[:batch]):  # a few left-padded rows, like a real batch
        pad = min(pad, width // 2)
        mask[row, :pad] = 0
        ids[row, :pad] = 0
    return ids.to(dev), mask.to(dev)


def make_runner(name: str, model, tok, policy, dev: torch.device, new: int):
    """A callable (ids, mask, seed) -> (Rollout or None, stats) for one engine."""
    from transformers import GenerationConfig

    from trainer.rollout import HFGenerateEngine, StaticDecodeEngine

    if name == "hf_static":
        # HF's own static-cache generate, the issue's 3.7K tokens/s reference; plain sampling. Its
        # automatic torch.compile of static-cache decoding stays off (it fails in 5.17, see the issue)
        cfg = GenerationConfig(
            do_sample=True,
            max_new_tokens=new,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            use_cache=True,
            cache_implementation="static",
            disable_compile=True,
            pad_token_id=tok.pad_token_id,
            eos_token_id=tok.eos_token_id,
        )

        def run(ids, mask, seed):
            torch.manual_seed(seed)
            model.generate(input_ids=ids, attention_mask=mask, generation_config=cfg)
            return None, {}

        return run
    kw = dict(device=dev, max_new_tokens=new)
    if name == "hf_dynamic":
        engine = HFGenerateEngine(model, tok, policy, **kw)
    else:
        engine = StaticDecodeEngine(model, tok, policy, cuda_graphs=name.endswith("graphs"), **kw)

    def run(ids, mask, seed):
        r = engine.generate(ids, mask, generator_seed=seed)
        return r, dict(getattr(engine, "last_stats", {}))

    return run


def measure(name, runner, ids, mask, dev, repeats: int) -> tuple[dict, object]:
    b = ids.shape[0]
    if dev.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(dev)
    rollout, _ = runner(ids, mask, 0)  # warm-up (kernels, cuBLAS handles, allocator)
    walls, stats = [], []
    for i in range(repeats):
        _sync(dev)
        t0 = time.perf_counter()
        r, st = runner(ids, mask, 1 + i)
        _sync(dev)
        walls.append(time.perf_counter() - t0)
        stats.append(st)
        rollout = r if i == 0 else rollout
    wall = statistics.median(walls)
    new = rollout.response_ids.shape[1] if rollout is not None else None
    row = {
        "engine": name,
        "wall_s": wall,
        "walls_s": walls,
        "max_memory_allocated_gb": torch.cuda.max_memory_allocated(dev) / GIB if dev.type == "cuda" else None,
    }
    if rollout is not None:
        row["new_tokens_per_s"] = b * new / wall
        row["mean_response_len"] = float(rollout.response_mask.sum(1).float().mean())
        m = rollout.response_mask.bool()
        row["mean_logprob"] = float(rollout.logprobs[m].mean())
    if stats and stats[0]:
        for key in stats[0]:
            row[key] = statistics.median(s[key] for s in stats)
        row["decode_ms_per_step"] = 1e3 * row["decode_s"] / max(row["decode_steps"], 1)
    return row, rollout


def agreement(a, b) -> dict:
    """Same-seed agreement of two rollouts. In bf16 a last-bit logit difference can flip one sampled
    token of a near-uniform random-init model, after which the row's contexts differ: log-probs are
    compared only up to each row's first differing token (same context on both sides)."""
    same = a.response_ids == b.response_ids
    prefix = same.long().cumprod(1).bool() & (a.response_mask & b.response_mask).bool()
    return {
        "first_token_match": float(same[:, 0].float().mean()),
        "rows_identical": float(same.all(1).float().mean()),
        "mean_identical_prefix": float(prefix.sum(1).float().mean()),
        "logprob_max_abs_diff_same_context": float((a.logprobs - b.logprobs)[prefix].abs().max())
        if prefix.any()
        else None,
    }


def markdown(res: dict) -> str:
    env, floor = res["environment"], res["floor"]
    lines = [
        f"Shape: {res['shape']}; GPU {env.get('gpu_name')} (driver {env.get('driver')}), torch {env['torch']}, "
        f"transformers {env['transformers']}, CUDA {env['cuda']}.",
        f"Weight-bandwidth floor: {floor['weight_gb']:.2f} GB of decode-step weights at "
        f"{floor['copy_bw_tb_s']:.2f} TB/s copy bandwidth = {floor['ms_per_step']:.2f} ms per step = "
        f"{floor['tokens_per_s']:.0f} new tokens/s.",
        "",
        "| engine | new tokens/s | % of floor | wall s | prefill s | decode ms/step | capture s | peak GiB |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for row in res["rows"]:
        if "error" in row:
            lines.append(f"| {row['engine']} | failed: {row['error']} | | | | | | |")
            continue

        def f(key, fmt, row=row):
            return format(row[key], fmt) if row.get(key) is not None else "-"

        tps = row.get("new_tokens_per_s") or res["shape_tokens"] / row["wall_s"]
        lines.append(
            f"| {row['engine']} | {tps:.0f} | {100 * tps / floor['tokens_per_s']:.0f}% | {row['wall_s']:.3f} | "
            f"{f('prefill_s', '.3f')} | {f('decode_ms_per_step', '.2f')} | {f('capture_s', '.3f')} | "
            f"{f('max_memory_allocated_gb', '.1f')} |"
        )
    lines += ["", "Same-seed agreement: " + json.dumps(res["agreement"])]
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--preset", default="llama2-7b")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--engines", default=",".join(ENGINES))
    args = ap.parse_args()
    dev = torch.device(args.device)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    res: dict = {
        "command": " ".join(sys.argv),
        "environment": environment(dev),
        "shape": f"{args.preset} bf16, batch {args.batch}, {args.prompt} prompt + {args.new} new tokens, sampling",
        "shape_tokens": args.batch * args.new,
        "rows": [],
        "agreement": {},
    }
    bw = copy_bandwidth(dev)
    model, tok, policy = build(args.preset, dev)
    embed = model.get_input_embeddings().weight
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if p is not embed)
    # bw already counts bytes read + written, i.e. the memory traffic rate; a decode step's traffic is
    # (at least) one read of every weight
    step_s = weight_bytes / bw if bw == bw else float("nan")
    res["floor"] = {
        "weight_gb": weight_bytes / 1e9,
        "copy_bw_tb_s": bw / 1e12,
        "ms_per_step": 1e3 * step_s,
        "tokens_per_s": args.batch / step_s,
    }
    print(json.dumps(res["environment"]), json.dumps(res["floor"]), flush=True)
    ids, mask = prompts(model.config.vocab_size, args.batch, args.prompt, dev)
    rollouts = {}
    for name in args.engines.split(","):
        try:
            runner = make_runner(name, model, tok, policy, dev, args.new)
            row, rollouts[name] = measure(name, runner, ids, mask, dev, args.repeats)
        except Exception as e:  # one engine failing must not cost the others' numbers
            row = {
                "engine": name,
                "error": f"{type(e).__name__}: {e}"[:400],
                "traceback": traceback.format_exc(),
            }
        print(json.dumps({k: v for k, v in row.items() if k != "traceback"}), flush=True)
        res["rows"].append(row)
    for a, b in [("ours_static", "ours_static_graphs"), ("hf_dynamic", "ours_static")]:
        if rollouts.get(a) is not None and rollouts.get(b) is not None:
            res["agreement"][f"{a} vs {b}"] = agreement(rollouts[a], rollouts[b])
    (out / "rollout_bench.json").write_text(json.dumps(res, indent=1))
    (out / "rollout_bench.md").write_text(markdown(res))
    print(markdown(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
