"""Rollout tokens/s: HF ``generate`` with the dynamic (default) and the static KV cache, and our engine.

Llama-2-7B shape in bf16, 128 prompt + 128 new tokens, sampling, every row forced to the full length
(``min_new_tokens``) so tokens/s counts the same work in every case. ``engine`` is
`trainer.rollout.HFGenerateEngine` (dynamic cache, per-token log-prob recorder) at the same shape.
The floor: every decode step reads all weights once (2 N bytes) at the measured copy bandwidth.
Run: ``python benchmarks/bench_rollout.py --out $OUT/rollout.json`` (``--preset tiny-llama --device cpu``
for a smoke test).
"""

from __future__ import annotations

import argparse
import time

import torch

from benchmarks._common import environment, guarded, median, sync, write_json


def copy_bandwidth(device: torch.device, gib: float = 4.0) -> dict:
    """Device-to-device copy, counting bytes read plus bytes written."""
    n = int(gib * 1024**3) // 2
    a = torch.empty(n, dtype=torch.bfloat16, device=device).normal_()
    b = torch.empty_like(a)
    for _ in range(2):
        b.copy_(a)
    sync(device)
    ts = []
    for _ in range(5):
        t0 = time.perf_counter()
        b.copy_(a)
        sync(device)
        ts.append(time.perf_counter() - t0)
    return {"tb_per_s": 2 * a.numel() * 2 / median(ts) / 1e12}


def run_generate(model, tok, device, batch: int, prompt: int, new: int, cache: str, reps: int = 2) -> dict:
    from transformers import GenerationConfig

    g = torch.Generator(device="cpu").manual_seed(0)
    ids = torch.randint(3, model.config.vocab_size, (batch, prompt), generator=g).to(device)
    mask = torch.ones_like(ids)
    cfg = GenerationConfig(do_sample=True, max_new_tokens=new, min_new_tokens=new, top_k=0, top_p=1.0,
                           temperature=1.0, use_cache=True, pad_token_id=tok.pad_token_id,
                           eos_token_id=tok.eos_token_id)  # fmt: skip
    if cache == "static":
        cfg.cache_implementation = "static"
    times = []
    for _ in range(reps + 1):  # the first call warms up (and, for static, allocates the cache)
        sync(device)
        t0 = time.perf_counter()
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=mask, generation_config=cfg)
        sync(device)
        times.append(time.perf_counter() - t0)
    produced = out.shape[1] - prompt
    t = median(times[1:])
    return {"cache": cache, "batch": batch, "new_tokens": produced, "times_s": times, "total_s": t,
            "new_tokens_per_s": batch * produced / t, "ms_per_decode_step": 1000 * t / produced}  # fmt: skip


def run_engine(model, tok, device, batch: int, prompt: int, new: int) -> dict:
    from trainer.precision import resolve_policy
    from trainer.rollout import HFGenerateEngine

    policy = resolve_policy("bf16-pure", device=device)["rollout"]
    engine = HFGenerateEngine(model, tok, policy, device=device, max_new_tokens=new)
    g = torch.Generator(device="cpu").manual_seed(0)
    ids = torch.randint(3, model.config.vocab_size, (batch, prompt), generator=g).to(device)
    mask = torch.ones_like(ids)
    times = []
    for i in range(3):
        sync(device)
        t0 = time.perf_counter()
        r = engine.generate(ids, mask, generator_seed=i)
        sync(device)
        times.append(time.perf_counter() - t0)
    tokens = int(r.response_mask.sum())
    t = median(times[1:])
    return {"engine": engine.name, "batch": batch, "times_s": times, "total_s": t,
            "new_tokens_per_s": tokens / t, "mean_response_len": tokens / batch}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--preset", default="llama2-7b")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--batches", default="32,128")
    args = ap.parse_args()
    from trainer.config import ModelConfig
    from trainer.models import build_causal_lm, load_tokenizer
    from trainer.precision import resolve_policy

    device = torch.device(args.device)
    res: dict = {"environment": environment(), "args": vars(args)}
    if device.type == "cuda":
        guarded(res, "copy_bandwidth", copy_bandwidth, device)
    mcfg = ModelConfig(preset=args.preset)
    tok = load_tokenizer(mcfg)
    model = build_causal_lm(
        mcfg, tok, resolve_policy("bf16-pure", device=device)["actor"], device, seed=0
    ).eval()
    n = sum(p.numel() for p in model.parameters())
    res["params"] = n
    bw = res.get("copy_bandwidth", {}).get("tb_per_s")
    for b in [int(x) for x in args.batches.split(",")]:
        for cache in ("dynamic", "static") if b == 32 else ("dynamic",):
            guarded(
                res,
                f"generate/{cache}/b{b}",
                run_generate,
                model,
                tok,
                device,
                b,
                args.prompt,
                args.new,
                cache,
            )
            write_json(args.out, res)
    guarded(res, "engine/b32", run_engine, model, tok, device, 32, args.prompt, args.new)
    if bw:
        floor_s = 2 * n / (bw * 1e12)  # one read of the bf16 weights per decode step
        res["floor"] = {"ms_per_decode_step": 1000 * floor_s, "new_tokens_per_s_b32": 32 / floor_s}
    write_json(args.out, res)


if __name__ == "__main__":
    main()
