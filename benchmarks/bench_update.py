"""Actor-update throughput and MFU against the bf16 matmul peak measured in the same process.

The step is the reference's (REFERENCE_NUMBERS.md): 8 x 1024 tokens, Llama-2-7B shape, bf16
autocast over fp32 masters, activation checkpointing, fused AdamW; built from the trainer's own
pieces (`trainer.models.build_causal_lm`, `trainer.common.make_optimizer` / `optimizer_step`,
`trainer.precision.LossScaler`). Two loss paths are timed side by side, one change each:
``chunked`` (our fp32 log-prob island, `trainer.logprobs.sequence_logprobs`) and ``hf-loss``
(transformers' loss with labels: a full fp32 copy of the logits). Model FLOPs = 6 N tokens.
Run: ``python benchmarks/bench_update.py --out $OUT/update.json`` (``--preset tiny-llama --device cpu``
for a smoke test).
"""

from __future__ import annotations

import argparse
import gc
import time

import torch

from benchmarks._common import environment, guarded, matmul_peak_tflops, median, sync, write_json


def run_update(preset: str, precision: str, ckpt: bool, loss_path: str, device: torch.device, batch: int,
               seq: int, steps: int) -> dict:  # fmt: skip
    from trainer.common import make_optimizer, optimizer_step
    from trainer.config import ModelConfig
    from trainer.events import NULL_OBSERVER
    from trainer.logprobs import sequence_logprobs
    from trainer.models import build_causal_lm, load_tokenizer
    from trainer.precision import LossScaler, resolve_policy

    policy = resolve_policy(precision, grad_checkpointing=ckpt, device=device)["actor"]
    mcfg = ModelConfig(preset=preset)
    tok = load_tokenizer(mcfg)
    model = build_causal_lm(mcfg, tok, policy, device, seed=0)
    model.train()
    opt = make_optimizer(model, 1e-6, 0.0, device)
    scaler = LossScaler.for_policy(policy)
    n_params = sum(p.numel() for p in model.parameters())
    vocab = model.config.vocab_size
    g = torch.Generator(device="cpu").manual_seed(0)
    ids = torch.randint(0, vocab, (batch, seq), generator=g).to(device)
    mask = torch.ones_like(ids)
    times = []
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    for _ in range(steps):
        sync(device)
        t0 = time.perf_counter()
        with policy.autocast_ctx(device.type):
            if loss_path == "chunked":
                logprobs, _ = sequence_logprobs(model, ids, mask, seq - 1)
                loss = -logprobs.mean()
            else:
                loss = model(input_ids=ids, attention_mask=mask, labels=ids, use_cache=False).loss
        scaler.scale_loss(loss).backward()
        optimizer_step("actor", model, opt, scaler, policy, NULL_OBSERVER, 1.0)
        sync(device)
        times.append(time.perf_counter() - t0)
        del loss
    step = median(times[1:4]) if len(times) >= 4 else median(times)
    tokens = batch * seq
    out = {
        "preset": preset, "precision": precision, "grad_checkpointing": ckpt, "loss_path": loss_path,
        "batch": batch, "seq": seq, "params": n_params, "step_times_s": times, "step_s": step,
        "tokens_per_s": tokens / step, "model_tflops": 6 * n_params * tokens / step / 1e12,
    }  # fmt: skip
    if device.type == "cuda":
        out["peak_allocated_gib"] = torch.cuda.max_memory_allocated(device) / 1024**3
        out["peak_reserved_gib"] = torch.cuda.max_memory_reserved(device) / 1024**3
    del model, opt
    gc.collect()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--preset", default="llama2-7b")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--cases", default="bf16:ckpt:chunked,bf16:ckpt:hf-loss,bf16-pure:ckpt:chunked")
    args = ap.parse_args()
    device = torch.device(args.device)
    res: dict = {"environment": environment(), "args": vars(args)}
    if device.type == "cuda":
        guarded(res, "matmul_peak", matmul_peak_tflops, device)
    for case in args.cases.split(","):
        precision, ck, path = case.split(":")
        guarded(res, f"update/{case}", run_update, args.preset, precision, ck == "ckpt", path, device,
                args.batch, args.seq, args.steps)  # fmt: skip
        peak = res.get("matmul_peak", {}).get("tflops")
        if peak and "model_tflops" in res[f"update/{case}"]:
            res[f"update/{case}"]["mfu"] = res[f"update/{case}"]["model_tflops"] / peak
        write_json(args.out, res)
    write_json(args.out, res)


if __name__ == "__main__":
    main()
