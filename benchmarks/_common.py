"""Shared helpers of the GPU benchmark scripts: environment record, JSON output, timing.

Every script writes one JSON file and never raises past main(): a failure is recorded in the JSON
(``error``) so the driver (benchmarks/h200_suite.sh) still sees it.
Exercised by `bash benchmarks/h200_suite.sh` on a GPU, or each script with ``--device cpu``.
"""

from __future__ import annotations

import json
import os
import platform
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch


def environment() -> dict[str, Any]:
    import transformers

    env: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cuda": torch.version.cuda,
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        env.update(gpu_name=p.name, total_memory_gib=p.total_memory / 1024**3)
        try:
            import pynvml

            pynvml.nvmlInit()
            env["driver"] = pynvml.nvmlSystemGetDriverVersion()
        except Exception as e:  # noqa: BLE001 - the driver version is informative only; say why it is absent
            env["driver"] = f"unknown ({type(e).__name__})"
    return env


def write_json(path: str | os.PathLike, data: dict[str, Any]) -> None:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(data, indent=2, default=str))
    print(f"wrote {p}", flush=True)


def guarded(results: dict[str, Any], key: str, fn, *args, **kwargs) -> Any:
    """Runs one measurement; an exception (OOM included) becomes ``results[key] = {error: ...}``."""
    try:
        results[key] = fn(*args, **kwargs)
    except Exception as e:  # noqa: BLE001 - recorded in the JSON, the next measurement still runs
        results[key] = {
            "error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}",
            "traceback": traceback.format_exc()[-2000:],
        }
        print(f"{key}: {results[key]['error']}", file=sys.stderr, flush=True)
    finally:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
    return results[key]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median(xs: list[float]) -> float:
    s = sorted(xs)
    n = len(s)
    return s[n // 2] if n % 2 else 0.5 * (s[n // 2 - 1] + s[n // 2])


def matmul_peak_tflops(device: torch.device, n: int = 8192, iters: int = 10) -> dict[str, Any]:
    """bf16 n^3 matmul on random data (zeros run faster and would flatter the peak)."""
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    sync(device)
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        a @ b
        sync(device)
        times.append(time.perf_counter() - t0)
    t = median(times)
    return {"n": n, "median_s": t, "tflops": 2 * n**3 / t / 1e12}
