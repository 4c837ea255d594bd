"""Actor-update throughput and MFU against the bf16 matmul peak measured in the same process.

The step is the reference's (REFERENCE_NUMBERS.md): 8 x 1024 tokens, Llama-2-7B shape, bf16
autocast over fp32 masters, activation checkpointing, fused AdamW; built from the trainer's own
pieces (`trainer.models.build_causal_lm`, `trainer.common.make_optimizer` / `optimizer_step`,
`trainer.precision.LossScaler`). Two loss paths are timed side by side, one change each:
``chunked`` (our fp32 log-prob island, `trainer.logprobs.sequence_logprobs`) and ``hf-loss``
(transformers' loss with labels: a full fp32 copy of the logits). Model FLOPs = 6 N tokens (the
usual MFU numerator); ``mfu_with_attention`` adds the attention score/value matmuls, 12 L h T per token
(forward + backward, not halved for the causal mask: PaLM's definition).

A case is ``PRECISION:CKPT:LOSS[:compile]``. CKPT is ``ckpt`` (every layer), ``nockpt``, ``ckptN``
(the first N decoder layers checkpointed, the rest keep activations) or ``ckptauto`` (N chosen by
the memory planner as ``precision.checkpoint_layers: auto`` does: the fewest checkpointed layers whose
planned peak fits this GPU less 5%); ``compile`` routes every decoder layer through torch.compile
(``model.compile``). Each case records the planner's predicted peak beside the measured one.
Run: ``python benchmarks/bench_update.py --out $OUT/update.json`` (``--preset tiny-llama --device cpu``
for a smoke test).
"""

from __future__ import annotations

import argparse
import gc
import time

import torch

from benchmarks._common import environment, guarded, matmul_peak_tflops, median, sync, write_json


def planned(
    preset: str,
    precision: str,
    ckpt: bool,
    layers: int | None,
    loss_path: str,
    batch: int,
    seq: int,
    compiled: bool = False,
) -> tuple[float, float]:
    """The memory planner's device bytes (GiB) for this update step (fused AdamW, no padding)."""
    from trainer.config import ModelConfig
    from trainer.precision import resolve_policy
    from verlaudit.plan.memory_model import GIB, Estimate, Logits, Shape, TrainedModel, train_phases
    from verlaudit.plan.planner import architecture_of

    pol = resolve_policy(precision, grad_checkpointing=ckpt, checkpoint_layers=layers)["actor"]
    m = TrainedModel(
        arch=architecture_of(ModelConfig(preset=preset)), kind="causal_lm", policy=pol, compiled=compiled
    )
    shape = Shape(sequences=batch, seq_len=seq, logit_positions=seq, padded=False)
    lg = Logits(island="hf-loss" if loss_path == "hf-loss" else "chunked")
    est = Estimate(tuple(train_phases(m, shape, accumulation=False, resident={}, logits=lg)))
    return est.device_bytes() / GIB, est.peak_bytes / GIB


def auto_layers(
    preset: str, precision: str, loss_path: str, batch: int, seq: int, gib: float, compiled: bool = False
) -> int | None:
    """``checkpoint_layers: auto`` for this step: fewest checkpointed layers fitting ``gib`` x 0.95."""
    from trainer.config import ModelConfig
    from verlaudit.plan.planner import AUTO_HEADROOM, architecture_of, fewest_checkpointed_layers

    fit = fewest_checkpointed_layers(
        architecture_of(ModelConfig(preset=preset)).num_layers,
        lambda n: planned(preset, precision, True, n, loss_path, batch, seq, compiled)[0],
        gib * (1 - AUTO_HEADROOM),
    )
    return None if fit is None else fit[0]


def run_update(
    preset: str,
    precision: str,
    ckpt_spec: str,
    loss_path: str,
    device: torch.device,
    batch: int,
    seq: int,
    steps: int,
    compile_layers: bool = False,
) -> dict:
    from trainer.common import make_optimizer, optimizer_step
    from trainer.config import ModelConfig
    from trainer.events import NULL_OBSERVER
    from trainer.logprobs import sequence_logprobs
    from trainer.models import build_causal_lm, load_tokenizer
    from trainer.models import compile_layers as compile_fn
    from trainer.precision import LossScaler, resolve_policy

    ckpt = ckpt_spec != "nockpt"
    layers: int | None = None
    if ckpt_spec == "ckptauto":
        gib = torch.cuda.get_device_properties(device).total_memory / 2**30 if device.type == "cuda" else 24.0
        layers = auto_layers(preset, precision, loss_path, batch, seq, gib, compile_layers)
    elif ckpt_spec.startswith("ckpt") and ckpt_spec != "ckpt":
        layers = int(ckpt_spec[4:])
    policy = resolve_policy(precision, grad_checkpointing=ckpt, checkpoint_layers=layers, device=device)[
        "actor"
    ]
    plan_device, plan_alloc = planned(preset, precision, ckpt, layers, loss_path, batch, seq, compile_layers)
    mcfg = ModelConfig(preset=preset)
    tok = load_tokenizer(mcfg)
    model = build_causal_lm(mcfg, tok, policy, device, seed=0)
    if compile_layers:
        compile_fn(model)
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
        optimizer_step("actor", model, opt, scaler, NULL_OBSERVER, 1.0)
        sync(device)
        times.append(time.perf_counter() - t0)
        del loss
    step = median(times[1:4]) if len(times) >= 4 else median(times)
    tokens = batch * seq
    cfg = model.config
    attn_flops = 12 * cfg.num_hidden_layers * cfg.hidden_size * seq * tokens
    out = {
        "preset": preset, "precision": precision, "grad_checkpointing": ckpt, "checkpoint_layers": layers,
        "compile": compile_layers, "loss_path": loss_path,
        "batch": batch, "seq": seq, "params": n_params, "step_times_s": times, "step_s": step,
        "tokens_per_s": tokens / step, "model_tflops": 6 * n_params * tokens / step / 1e12,
        "model_tflops_with_attention": (6 * n_params * tokens + attn_flops) / step / 1e12,
        "planned_peak_allocated_gib": plan_alloc, "planned_device_gib": plan_device,
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
        parts = case.split(":")
        if len(parts) not in (3, 4) or (len(parts) == 4 and parts[3] != "compile"):
            raise SystemExit(f"--cases: {case!r}; expected PRECISION:CKPT:LOSS[:compile]")
        precision, ck, path = parts[:3]
        guarded(
            res,
            f"update/{case}",
            run_update,
            args.preset,
            precision,
            ck,
            path,
            device,
            args.batch,
            args.seq,
            args.steps,
            len(parts) == 4,
        )
        peak = res.get("matmul_peak", {}).get("tflops")
        r = res[f"update/{case}"]
        if peak and "model_tflops" in r:
            r["mfu"] = r["model_tflops"] / peak
            r["mfu_with_attention"] = r["model_tflops_with_attention"] / peak
        if "step_s" in r:
            print(
                f"{case}: {r['step_s']:.3f} s/step, MFU {r.get('mfu', float('nan')):.1%}, "
                f"peak {r.get('peak_allocated_gib', float('nan')):.1f} GiB (planned {r['planned_peak_allocated_gib']:.1f}), "
                f"layers ckpt {r['checkpoint_layers']}",
                flush=True,
            )
        else:
            print(f"{case}: {r}", flush=True)
        write_json(args.out, res)
    write_json(args.out, res)


if __name__ == "__main__":
    main()
