"""The fp32 shadow's rounding model against measured errors: linears in bf16 / fp16, operands rounded
(autocast over fp32) or stored low, with and without cancellation, at several inner dimensions.

For each case, ``seeds`` random draws: measured relative error of the low-precision product against
exact fp32 on the same values, divided by `verlaudit.audit.rounding.expected_linear`; the table gives
the median and the range of that ratio. Run it under each CPU kernel family the tests must pass on:

    PYTHONPATH=. python benchmarks/rounding_model.py
    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 PYTHONPATH=. python benchmarks/rounding_model.py
    ATEN_CPU_CAPABILITY=default PYTHONPATH=. python benchmarks/rounding_model.py
"""

from __future__ import annotations

import argparse
import math
import os
import statistics

import torch

from verlaudit.audit.shadow import exact_fp32, expected_linear, rel_err, unit_roundoff


def ratio(dtype: torch.dtype, k: int, *, stored_low: bool, cancel: bool, seed: int) -> float:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(128, k, generator=g) / math.sqrt(k)
    x = torch.randn(64, k, generator=g)
    if cancel:  # outputs far smaller than their terms
        x = x.abs() + 1.0
        w = w - w.mean(dim=1, keepdim=True)
    if stored_low:
        w, x = w.to(dtype).float(), x.to(dtype).float()
    with exact_fp32("cpu"):
        y32 = x @ w.t()
        spread = float(((x * x) @ (w * w).t()).sum() / (y32 * y32).sum())
    y = (x.to(dtype) @ w.to(dtype).t()).float()
    u = unit_roundoff(dtype)
    model = expected_linear(u_c=u, u_out=u, r_x=not stored_low, r_w=not stored_low, spread=spread, k_inner=k)
    return rel_err([y], [y32]) / model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=8)
    args = ap.parse_args()
    torch.set_num_threads(1)
    isa = f"ATEN_CPU_CAPABILITY={os.environ.get('ATEN_CPU_CAPABILITY', '(unset)')} " + (
        f"ONEDNN_MAX_CPU_ISA={os.environ.get('ONEDNN_MAX_CPU_ISA', '(unset)')}"
    )
    print(f"{isa}; torch {torch.__version__}; measured / model over {args.seeds} seeds")
    print(f"{'dtype':6s} {'operands':10s} {'cancel':6s} {'K':>5s} {'median':>7s} {'min':>6s} {'max':>6s}")
    for dtype in (torch.bfloat16, torch.float16):
        for stored_low in (False, True):
            for cancel in (False, True):
                for k in (64, 1024, 4096):
                    rs = [
                        ratio(dtype, k, stored_low=stored_low, cancel=cancel, seed=s)
                        for s in range(args.seeds)
                    ]
                    name = "bf16" if dtype == torch.bfloat16 else "fp16"
                    ops = "stored" if stored_low else "rounded"
                    print(
                        f"{name:6s} {ops:10s} {str(cancel):6s} {k:5d} {statistics.median(rs):7.3f} "
                        f"{min(rs):6.3f} {max(rs):6.3f}"
                    )


if __name__ == "__main__":
    main()
