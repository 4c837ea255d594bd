"""The decode step's kernels at the 7B rollout shape, one at a time: our decode attention (Triton,
per slot split / block / warps) against SDPA over the whole cache, and each weight GEMM of a decode
step (M = batch rows) through cuBLAS. (Inductor's autotuned GEMM templates were tried in the first
run and came out level with cuBLAS at these shapes: not repeated.)

    PYTHONPATH=. python benchmarks/decode_kernels_bench.py --out $OUT     # H200, ~3-5 min

The committed sweep (reports/gpu/decode_kernels.json) is this one; a second sweep with software
pipelining (stages 1-3, warps 1-4) and V loaded before the scores were computed gave nothing better
(stages made no difference, the early V load was 13% slower) and is not kept in the code.

Each figure is device time per call (20 calls captured in a CUDA graph, replays timed with CUDA
events), with the bytes the kernel must read and the rate that gives. Writes decode_kernels.json under --out. GPU only.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from trainer import decode_attention as DA  # noqa: E402


def timed(fn, reps: int = 20) -> float:
    """Seconds per call on the device: ``reps`` calls captured in one CUDA graph (as in the rollout's
    decode step, so no host launch time is counted), the graph replayed 5 times after 2 warm-ups,
    median replay / reps."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    times = []
    for i in range(7):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        if i >= 2:
            times.append(a.elapsed_time(b) / 1e3 / reps)
    return statistics.median(times)


def attention(rows, heads, kv, slots, d, filled, out: dict) -> None:
    dev = torch.device("cuda")
    q = torch.randn(rows, heads, d, device=dev, dtype=torch.bfloat16)
    k = torch.randn(rows, kv, slots, d, device=dev, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    valid = torch.ones(rows, slots, dtype=torch.bool, device=dev)
    valid[: rows // 8, :5] = False
    slot = torch.tensor([filled - 1], device=dev)
    scale = d**-0.5
    ref = DA.reference(q, k, v, valid, slot, scale)
    read = 2 * rows * kv * filled * d * 2
    rows_out = []
    t = timed(lambda: DA.reference(q, k, v, valid, slot, scale))
    rows_out.append({"kernel": "sdpa whole cache", "us": t * 1e6, "tb_s_of_filled": read / t / 1e12})
    for parts, block, warps, stages in itertools.product((1, 2, 4, 8), (16, 32, 64, 128), (2, 4, 8), (1,)):
        if slots // parts < block:
            continue
        try:
            got = DA.triton_decode_attention(
                q, k, v, valid, slot, scale, parts=parts, block=block, warps=warps, stages=stages
            )
            err = (got.float() - ref.float()).abs().max().item()
            t = timed(
                functools.partial(
                    DA.triton_decode_attention,
                    q,
                    k,
                    v,
                    valid,
                    slot,
                    scale,
                    parts=parts,
                    block=block,
                    warps=warps,
                    stages=stages,
                )
            )
            rows_out.append(
                {
                    "kernel": f"triton parts={parts} block={block} warps={warps} stages={stages}",
                    "us": t * 1e6,
                    "tb_s_of_filled": read / t / 1e12,
                    "max_abs_err": err,
                }
            )
        except Exception as e:  # a config the compiler refuses
            rows_out.append(
                {
                    "kernel": f"triton parts={parts} block={block} warps={warps} stages={stages}",
                    "error": str(e)[:200],
                }
            )
    default = DA.triton_decode_attention
    t = timed(lambda: default(q, k, v, valid, slot, scale))
    rows_out.append(
        {
            "kernel": "triton default choice",
            "us": t * 1e6,
            "tb_s_of_filled": read / t / 1e12,
            "parts": DA._parts(rows * heads, slots, dev),
        }
    )
    out["attention"] = {
        "shape": [rows, heads, kv, slots, d],
        "filled": filled,
        "bytes": read,
        "rows": rows_out,
    }


def gemms(m: int, shapes: dict, out: dict) -> None:
    dev = torch.device("cuda")
    res = []
    for name, (n, k) in shapes.items():
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        w = torch.randn(n, k, device=dev, dtype=torch.bfloat16)
        nbytes = n * k * 2
        t = timed(functools.partial(F.linear, x, w))
        row = {"gemm": name, "n": n, "k": k, "cublas_us": t * 1e6, "cublas_tb_s": nbytes / t / 1e12}
        print(json.dumps(row), flush=True)
        res.append(row)
    out["gemms"] = {"m": m, "rows": res}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--skip-gemms", action="store_true")
    args = ap.parse_args()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    out = {"command": " ".join(sys.argv), "gpu": torch.cuda.get_device_name(), "torch": torch.__version__}
    attention(32, 32, 32, 256, 128, 192, out)
    best = sorted((r for r in out["attention"]["rows"] if "us" in r), key=lambda r: r["us"])[:8]
    print(json.dumps(best, indent=0), flush=True)
    if not args.skip_gemms:  # Llama-2-7B decode step at batch 32
        gemms(
            32,
            {
                "qkv": (12288, 4096),
                "o": (4096, 4096),
                "gate_up": (22016, 4096),
                "down": (4096, 11008),
                "lm_head": (32000, 4096),
            },
            out,
        )
    (out_dir / "decode_kernels.json").write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
