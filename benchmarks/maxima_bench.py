"""How fast can the audit take the absolute maximum of a step's activations? The module probes reduce
every hooked tensor to its absolute maximum (`verlaudit.audit.probes.Maxima`); on the 7B DPO step that
is hundreds of GB of reads. This times the candidate reductions on tensors of a 7B decoder layer's
shapes (``--tokens`` x hidden 4096 and x MLP 11008, bf16), each as a list per call the way the hooks
see them, and reports the effective bandwidth:

- ``foreach``: ``torch._foreach_norm(ts, inf)`` (what the probes use today),
- ``vector_norm``: ``torch.linalg.vector_norm(t, inf)`` per tensor,
- ``aminmax``: ``torch.aminmax(t)`` per tensor, then ``max(-min, max)`` (one pass, NaN kept),
- ``abs_amax``: ``t.abs().amax()`` per tensor (a temporary: two passes).

Each result is checked against ``abs().amax()`` in float32, NaN included. Run on the GPU machine:
``python benchmarks/maxima_bench.py --out $OUT/maxima.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Callable

import torch


def _foreach(ts: list[torch.Tensor]) -> list[torch.Tensor]:
    return list(torch._foreach_norm(ts, float("inf")))


def _vector_norm(ts: list[torch.Tensor]) -> list[torch.Tensor]:
    return [torch.linalg.vector_norm(t, float("inf")) for t in ts]


def _aminmax(ts: list[torch.Tensor]) -> list[torch.Tensor]:
    out = []
    for t in ts:
        lo, hi = torch.aminmax(t)
        out.append(torch.maximum(hi, -lo))
    return out


def _abs_amax(ts: list[torch.Tensor]) -> list[torch.Tensor]:
    return [t.abs().amax() for t in ts]


METHODS: dict[str, Callable[[list[torch.Tensor]], list[torch.Tensor]]] = {
    "foreach": _foreach,
    "vector_norm": _vector_norm,
    "aminmax": _aminmax,
    "abs_amax": _abs_amax,
}


def time_method(fn: Callable, calls: list[list[torch.Tensor]], repeat: int) -> list[float]:
    times = []
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        for ts in calls:
            fn(ts)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return times


def overlap(args: argparse.Namespace, dev: torch.device) -> dict:
    """Matmuls of a decoder layer's MLP on the main stream, each output reduced to its absolute
    maximum: on the same stream after it, or on a side stream that waits for it (the reduction then
    runs beside the next matmul). Wall time of each, and of the matmuls alone."""
    x = torch.randn(args.tokens, 4096, device=dev, dtype=torch.bfloat16)
    w = torch.randn(4096, 11008, device=dev, dtype=torch.bfloat16)
    side = torch.cuda.Stream(device=dev)

    def run(mode: str) -> float:
        keep = []
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(24):
            y = x @ w
            if mode == "same":
                keep.append(torch.linalg.vector_norm(y, float("inf")))
            elif mode == "side":
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    keep.append(torch.linalg.vector_norm(y, float("inf")))
                y.record_stream(side)
        torch.cuda.current_stream().wait_stream(side)
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / 1e3

    out = {}
    for mode in ("none", "same", "side"):
        run(mode)
        out[mode] = statistics.median(run(mode) for _ in range(args.repeat))
        print(f"overlap {mode:5s} {out[mode] * 1e3:8.2f} ms", flush=True)
    return out


def snapshot_cost(dev: torch.device, repeat: int) -> dict:
    """`numerics.snapshot` on fp32 tensors of Llama-2-7B's parameter shapes (its gradients alike)."""
    from verlaudit.audit import numerics

    shapes = [(32000, 4096)] + [(4096, 4096)] * 4 * 32 + [(11008, 4096), (4096, 11008), (11008, 4096)] * 32
    params = []
    for i, s in enumerate(shapes):
        p = torch.nn.Parameter(torch.randn(*s, device=dev))
        p.grad = torch.randn_like(p)
        params.append((f"p{i}", p))
    cache: dict = {}
    numerics.snapshot(params, cache=cache)
    times = []
    for _ in range(repeat):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        numerics.snapshot(params, cache=cache)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    med = statistics.median(times)
    print(f"snapshot of {len(shapes)} fp32 tensors: {med * 1e3:.2f} ms", flush=True)
    del params
    torch.cuda.empty_cache()
    return {"tensors": len(shapes), "median_s": med}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    dev = torch.device("cuda")
    torch.manual_seed(0)
    calls: list[list[torch.Tensor]] = []
    for _ in range(args.layers):  # per layer: the calls a decoder layer's hooks make, a few tensors each
        h = [torch.randn(args.tokens, 4096, device=dev, dtype=torch.bfloat16) for _ in range(3)]
        m = [torch.randn(args.tokens, 11008, device=dev, dtype=torch.bfloat16) for _ in range(2)]
        calls += [[h[0]], [h[1], h[2]], [m[0]], [m[1]], [h[0], m[0]]]
    nbytes = sum(t.numel() * t.element_size() for ts in calls for t in ts)
    calls[0][0][5, 7] = float("nan")  # NaN must come back as NaN
    want = [[t.float().abs().amax().item() for t in ts] for ts in calls]
    res: dict = {"tokens": args.tokens, "gbytes_per_pass": nbytes / 1e9, "methods": {}}
    for name, fn in METHODS.items():
        got = [[v.float().item() for v in fn(ts)] for ts in calls]
        ok = all((g != g and w != w) or g == w for gs, ws in zip(got, want) for g, w in zip(gs, ws))
        fn(calls[0])
        times = time_method(fn, calls, args.repeat)
        med = statistics.median(times)
        res["methods"][name] = {"correct": ok, "median_s": med, "gb_per_s": nbytes / 1e9 / med}
        print(f"{name:12s} correct={ok} {med * 1e3:8.2f} ms  {nbytes / 1e9 / med:7.0f} GB/s", flush=True)
    del calls
    torch.cuda.empty_cache()
    res["overlap"] = overlap(args, dev)
    res["snapshot"] = snapshot_cost(dev, args.repeat)
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(res, f, indent=2)


if __name__ == "__main__":
    main()
