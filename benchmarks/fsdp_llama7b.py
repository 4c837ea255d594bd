"""Two-GPU FSDP2 benchmark of the Llama-2-7B shape through the trainer's own pieces.

Reproduces the 2 x H200 rows of /work/shared/REFERENCE_NUMBERS.md (each GPU capped at 80 GiB with
`torch.cuda.set_per_process_memory_fraction`, A100-80G emulation; global batch 32 x 1024, 16 per GPU)
with `trainer.precision` policies, `trainer.distributed.build_sharded` / `shard_model`,
`trainer.precision.LossScaler` and `trainer.logprobs.logprobs_from_logits`. Per variant: peak
allocated per rank, step time (median of steps 2-4), loss scale, skipped steps, loss trajectory,
the fraction of one weight matrix the last optimizer step left unchanged (lost to rounding), or
the OOM as a result.

    PYTHONUNBUFFERED=1 python benchmarks/fsdp_llama7b.py --out $OUT           # all variants, ~7 min
    python benchmarks/fsdp_llama7b.py --out /tmp/b --device cpu --preset tiny  # CPU smoke (gloo)

The driver launches one `torchrun` job per variant (an OOM or a hang cannot poison the next), with
a per-variant timeout and an overall time budget, and writes `fsdp_llama7b.json` and
`fsdp_llama7b.md` under --out. Each rank writes its own record, so a rank that dies alone still
reports.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# name -> (precision preset, grad checkpointing, reshard_after_forward). Ordered by value: the
# rows that fit come first, so a tight budget drops the expected OOMs, not the measurements.
VARIANTS: dict[str, tuple[str, bool, bool]] = {
    "bf16_ckpt": ("bf16", True, True),
    "fp16_ckpt": ("fp16", True, True),
    "bf16pure_ckpt": ("bf16-pure", True, True),
    "bf16_ckpt_shard_grad_op": ("bf16", True, False),
    "fp32_ckpt": ("fp32", True, True),
    "bf16_nockpt": ("bf16", False, True),
    "fp16_nockpt": ("fp16", False, True),
    "fp32_nockpt": ("fp32", False, True),
}
REFERENCE = {  # REFERENCE_NUMBERS.md, two H200s capped at 80 GB, plain PyTorch FSDP2
    "fp32_nockpt": "OOM at step 0",
    "fp32_ckpt": "62.8 GiB, 17.29 s",
    "fp16_nockpt": "OOM at step 0",
    "fp16_ckpt": "62.8 GiB, 2.01 s (scale 65536)",
    "bf16_nockpt": "OOM at step 0",
    "bf16_ckpt": "62.8 GiB, 1.95 s",
    "bf16pure_ckpt": "31.7 GiB, 1.90 s, loss frozen at lr 1e-6",
    "bf16_ckpt_shard_grad_op": "(no reference row)",
}
GIB = 2**30
# NVLink multicast stays off on the shared hosts (device KINDS.md): keep these in every child.
SAFE_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


# ------------------------------------------------------------------------------------------ worker
def _llama_config(preset: str):
    from transformers import LlamaConfig

    from trainer.models import PRESETS

    # "tiny": the trainer's tiny-llama with a fixed vocabulary (no tokenizer in this benchmark)
    kwargs = {**PRESETS["tiny-llama"], "vocab_size": 128} if preset == "tiny" else PRESETS[preset]
    return LlamaConfig(**kwargs, attn_implementation="sdpa", use_cache=False)


def _make_optimizer(model, lr: float, device):
    import torch

    params = [p for p in model.parameters() if p.requires_grad]
    if device.type == "cuda":
        try:
            return torch.optim.AdamW(params, lr=lr, fused=True), "fused"
        except (RuntimeError, NotImplementedError) as e:  # recorded, not hidden
            return torch.optim.AdamW(params, lr=lr, foreach=True), f"foreach (fused refused: {e})"
    return torch.optim.AdamW(params, lr=lr), "default"


def _step(model, ids, labels, role, scaler, opt, dev_type):
    from trainer import distributed as D
    from trainer.logprobs import logprobs_from_logits

    params = [p for p in model.parameters() if p.requires_grad]
    with role.autocast_ctx(dev_type):
        logits = model(input_ids=ids, use_cache=False).logits
    # labels are the ids shifted left (last column a dummy, dropped by the mean's slice): the
    # logits stay contiguous, no [B, T-1, V] copy. Log-probs in fp32, chunked (the fp32 island).
    lp = logprobs_from_logits(logits, labels)
    loss = -lp[:, :-1].mean()
    del logits
    scaler.scale_loss(loss).backward()
    found = scaler.unscale_(params)
    norm = D.clip_grad_norm_(params, 1.0)
    if scaler.should_step():
        opt.step()
    scaler.update()
    opt.zero_grad(set_to_none=True)
    return float(loss), float(norm), found


# long: one rank's whole measurement, setup to teardown, in order
def _worker(args: argparse.Namespace) -> None:
    import torch

    from trainer import distributed as D
    from trainer.models import enable_checkpointing, is_checkpointing
    from trainer.precision import LossScaler, resolve_policy

    preset, ckpt, reshard = VARIANTS[args.variant]
    rec: dict = {
        "variant": args.variant,
        "preset": preset,
        "grad_ckpt": ckpt,
        "reshard_after_forward": reshard,
    }
    out = Path(args.work) / f"{args.variant}.rank{os.environ.get('RANK', '0')}.json"
    step, phase = -1, "setup"
    try:
        info = D.init_distributed(args.device)
        rec["dist"] = info.to_dict()
        dev = info.device
        if dev.type == "cuda":
            torch.backends.cuda.matmul.allow_tf32 = False  # as in the reference measurements
            torch.backends.cudnn.allow_tf32 = False
            total = torch.cuda.get_device_properties(dev).total_memory
            frac = min(1.0, args.cap_gib * GIB / total)
            torch.cuda.set_per_process_memory_fraction(frac, dev)
            rec["memory_cap"] = {"gib": args.cap_gib, "fraction": frac, "total_gib": total / GIB}
        role = resolve_policy(preset, grad_checkpointing=ckpt, device=dev)["actor"]
        rec["policy"] = role.to_dict()
        rec["fsdp_mixed_precision"] = D.fsdp_mixed_precision(role)[1]
        config = _llama_config(args.preset)
        from transformers import LlamaForCausalLM

        def make():
            m = LlamaForCausalLM(config)
            if ckpt:
                enable_checkpointing(m)  # flags only: safe on the meta device, before sharding
            return m

        t0 = time.perf_counter()
        model = D.build_sharded(make, role, info, seed=0, reshard_after_forward=reshard)
        model.train()
        rec["grad_ckpt_active"] = is_checkpointing(model)  # the flag survived sharding
        rec["build_s"] = time.perf_counter() - t0
        rec["params_b"] = sum(p.numel() for p in model.parameters()) / 1e9
        opt, rec["optimizer"] = _make_optimizer(model, args.lr, dev)
        scaler = LossScaler.for_policy(role)
        g = torch.Generator(device="cpu").manual_seed(1234 + info.rank)  # each rank its half of the batch
        ids = torch.randint(0, config.vocab_size, (args.batch_per_rank, args.seq), generator=g).to(dev)
        labels = torch.roll(ids, -1, dims=1)
        probe = model.model.layers[0].mlp.down_proj.weight  # one matrix watched for lost updates
        steps = rec["steps"] = []
        for step in range(args.steps):
            phase = "step"
            before = probe.detach().to_local().clone() if step == args.steps - 1 else None
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            t = time.perf_counter()
            loss, norm, found = _step(model, ids, labels, role, scaler, opt, dev.type)
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            s = {
                "step": step,
                "time_s": time.perf_counter() - t,
                "loss": loss,
                "grad_norm": norm,
                "found_inf": found,
                "loss_scale": scaler.scale,
            }
            if before is not None:
                s["unchanged_frac"] = float((probe.detach().to_local() == before).float().mean())
            if dev.type == "cuda":
                s["max_allocated_gib"] = torch.cuda.max_memory_allocated(dev) / GIB
                s["max_reserved_gib"] = torch.cuda.max_memory_reserved(dev) / GIB
            steps.append(s)
            print(f"[{args.variant} rank {info.rank}] {json.dumps(s)}", flush=True)
        rec["status"] = "completed"
    except torch.OutOfMemoryError as e:
        rec.update(status="oom", step=step, phase=phase, error=str(e).splitlines()[0][:300])
        rec["allocated_at_failure_gib"] = torch.cuda.memory_allocated() / GIB
    except Exception as e:  # recorded with its traceback, then the process exits non-zero
        rec.update(status="failed", step=step, phase=phase, error=f"{type(e).__name__}: {e}"[:500])
        rec["traceback"] = traceback.format_exc()[-4000:]
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        rec["max_allocated_gib"] = torch.cuda.max_memory_allocated() / GIB
        rec["max_reserved_gib"] = torch.cuda.max_memory_reserved() / GIB
    out.write_text(json.dumps(rec, indent=1))
    if rec["status"] != "completed":
        # a rank that failed alone would leave its peer waiting in a collective: leave at once,
        # torchrun then stops the peer, and the driver reads whatever records were written.
        sys.stdout.flush()
        os._exit(3)
    D.destroy()


# ------------------------------------------------------------------------------------------ driver
def _summarise(name: str, records: list[dict], proc_info: dict) -> dict:
    row: dict = {"variant": name, "reference": REFERENCE.get(name), **proc_info}
    if not records:
        row["status"] = "no record" + (" (timeout)" if proc_info.get("timed_out") else "")
        return row
    statuses = {r["status"] for r in records}
    row["status"] = "oom" if "oom" in statuses else ("failed" if "failed" in statuses else "completed")
    row["ranks"] = len(records)
    if all("max_allocated_gib" in r for r in records):  # absent on CPU
        row["peak_allocated_gib_per_rank"] = [round(r["max_allocated_gib"], 2) for r in records]
        row["peak_allocated_gib"] = max(row["peak_allocated_gib_per_rank"])
        row["peak_reserved_gib"] = round(max(r["max_reserved_gib"] for r in records), 2)
    first = records[0]
    for key in (
        "preset",
        "grad_ckpt",
        "grad_ckpt_active",
        "reshard_after_forward",
        "optimizer",
        "build_s",
        "params_b",
        "fsdp_mixed_precision",
        "memory_cap",
    ):
        row[key] = first.get(key)
    bad = [r for r in records if r["status"] != "completed"]
    if bad:
        row.update(
            {k: bad[0].get(k) for k in ("step", "phase", "error", "allocated_at_failure_gib", "traceback")}
        )
    steps = first.get("steps", [])
    if steps and all(len(r.get("steps", [])) == len(steps) for r in records):
        # each rank's loss is the mean over its half of the batch: the global loss is their mean
        row["loss"] = [
            round(statistics.mean(r["steps"][i]["loss"] for r in records), 5) for i in range(len(steps))
        ]
        row["loss_scale"] = steps[-1]["loss_scale"]
        row["skipped_steps"] = sum(s["found_inf"] for s in steps)
        row["unchanged_frac_last_step"] = steps[-1].get("unchanged_frac")
        times = [
            max(r["steps"][i]["time_s"] for r in records if len(r.get("steps", [])) > i)
            for i in range(len(steps))
        ]
        row["step_times_s"] = [round(t, 3) for t in times]
        row["step_time_s"] = statistics.median(times[2:5]) if len(times) >= 3 else None
    return row


def _markdown(rows: list[dict], args: argparse.Namespace) -> str:
    lines = [
        f"# FSDP2 {args.preset}, {args.nproc} ranks, {args.batch_per_rank} x {args.seq} tokens per rank, "
        f"memory cap {args.cap_gib} GiB per GPU, {args.steps} steps, AdamW lr {args.lr}",
        "",
        f"Command: `{' '.join(sys.argv)}`. Step time: median of steps 2-4 (slowest rank).",
        "",
        "| variant | status | peak allocated / GPU (per rank) | step | loss scale | skipped | loss first -> last "
        "| unchanged by last step | reference |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        status = r["status"] + (f" at step {r.get('step')}" if r["status"] in ("oom", "failed") else "")
        peak = r.get("peak_allocated_gib_per_rank")
        peak_s = f"{max(peak):.1f} GiB ({', '.join(f'{p:.1f}' for p in peak)})" if peak else "-"
        st = f"{r['step_time_s']:.2f} s" if r.get("step_time_s") else "-"
        loss = f"{r['loss'][0]:.4f} -> {r['loss'][-1]:.4f}" if r.get("loss") else "-"
        unch = r.get("unchanged_frac_last_step")
        lines.append(
            f"| {r['variant']} | {status} | {peak_s} | {st} | {r.get('loss_scale', '-')} | "
            f"{r.get('skipped_steps', '-')} | {loss} | {'-' if unch is None else f'{unch:.1%}'} | {r.get('reference')} |"
        )
    return "\n".join(lines) + "\n"


def _driver(args: argparse.Namespace) -> int:
    names = list(VARIANTS) if args.variants == "all" else args.variants.split(",")
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        raise SystemExit(f"--variants: unknown {unknown}; expected any of {', '.join(VARIANTS)}")
    out, work = Path(args.out), Path(args.work)
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, **SAFE_ENV, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(ROOT)}
    deadline = time.monotonic() + args.budget_s
    rows = []
    for name in names:
        left = deadline - time.monotonic()
        if left < 45:
            rows.append(
                {
                    "variant": name,
                    "status": f"not run: {args.budget_s} s budget spent",
                    "reference": REFERENCE.get(name),
                }
            )
            continue
        for f in work.glob(f"{name}.rank*.json"):
            f.unlink()
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}",
               __file__, "--worker", "--variant", name, "--work", str(work), "--device", args.device,
               "--preset", args.preset, "--steps", str(args.steps), "--batch-per-rank", str(args.batch_per_rank),
               "--seq", str(args.seq), "--cap-gib", str(args.cap_gib), "--lr", str(args.lr)]  # fmt: skip
        timeout = min(args.timeout_s * (2.5 if name.startswith("fp32_ckpt") else 1), left)
        t0 = time.monotonic()
        print(f"== {name} (timeout {timeout:.0f} s)", flush=True)
        try:
            proc = subprocess.run(cmd, env=env, cwd=ROOT, timeout=timeout, capture_output=True, text=True)
            info = {"returncode": proc.returncode, "timed_out": False}
            tail = proc.stdout[-1500:] + proc.stderr[-1500:]
        except subprocess.TimeoutExpired as e:
            info = {"returncode": None, "timed_out": True}
            tail = str(e.stdout or "")[-1500:] + str(e.stderr or "")[-1500:]
        info["wall_s"] = round(time.monotonic() - t0, 1)
        records = [json.loads(f.read_text()) for f in sorted(work.glob(f"{name}.rank*.json"))]
        row = _summarise(name, records, info)
        if row["status"] not in ("completed", "oom"):
            row["output_tail"] = tail
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k not in ("traceback", "output_tail")}), flush=True)
        (out / "fsdp_llama7b.json").write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))
    (out / "fsdp_llama7b.json").write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))
    md = _markdown(rows, args)
    (out / "fsdp_llama7b.md").write_text(md)
    print(md)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--out", default=os.environ.get("OUT", "fsdp_bench_out"), help="where the JSON and table go"
    )
    p.add_argument("--work", default="/tmp/fsdp_llama7b_work", help="per-rank records (not returned)")
    p.add_argument("--variants", default="all", help=f"comma list of {', '.join(VARIANTS)}")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--preset", default="llama2-7b", help="trainer.models preset, or 'tiny' for a CPU smoke")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--steps", type=int, default=5, help="steps per variant; step time = median of 2-4")
    p.add_argument("--batch-per-rank", type=int, default=16)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--cap-gib", type=float, default=80.0, help="per-GPU memory cap (A100-80G emulation)")
    p.add_argument("--lr", type=float, default=1e-6)
    p.add_argument("--timeout-s", type=float, default=120.0, help="per variant (fp32_ckpt gets 2.5x)")
    p.add_argument("--budget-s", type=float, default=500.0, help="all variants together")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--variant", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        _worker(args)
        return 0
    return _driver(args)


if __name__ == "__main__":
    sys.exit(main())
