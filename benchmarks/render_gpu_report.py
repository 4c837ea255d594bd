"""Turns the JSON of benchmarks/h200_suite.sh into reports/gpu/h200_results.md.

Reads, from the directories given (the fetched $OUT of each device call): gpu.txt, plan.json,
update.json, audit.json, rollout_bench.md and suite_runs.tgz (the run directories of
``verlaudit run suites/llama7b_h200.yaml``: measured peaks beside the planner's). Missing parts are
reported as missing. Run: ``python benchmarks/render_gpu_report.py OUT1 [OUT2] [--out reports/gpu/h200_results.md]``.
"""

from __future__ import annotations

import argparse
import io
import json
import tarfile
from pathlib import Path

from tabulate import tabulate


def _load(dirs: list[Path], name: str):
    for d in dirs:
        p = d / name
        if p.is_file():
            return json.loads(p.read_text()) if name.endswith(".json") else p.read_text()
    return None


def _suite_peaks(dirs: list[Path]) -> dict[str, dict]:
    """variant -> {status, peak allocated GiB, median step s} read from the packed run directories."""
    out: dict[str, dict] = {}
    for d in dirs:
        tgz = d / "suite_runs.tgz"
        if not tgz.is_file():
            continue
        with tarfile.open(tgz) as tar:
            for m in tar.getmembers():
                parts = Path(m.name).parts
                if len(parts) < 3 or parts[-1] not in ("metrics.jsonl", "status.json"):
                    continue
                v = out.setdefault(parts[-2], {})
                text = tar.extractfile(m).read().decode()
                if parts[-1] == "status.json":
                    s = json.loads(text)
                    v["status"] = s.get("state") + (f" ({s.get('reason')})" if s.get("reason") else "")
                else:
                    rows = [json.loads(line) for line in io.StringIO(text) if line.strip()]
                    peaks = [
                        r.get("perf/max_memory_allocated_gb")
                        for r in rows
                        if r.get("perf/max_memory_allocated_gb")
                    ]
                    times = sorted(r["perf/step_time_s"] for r in rows[1:4] if "perf/step_time_s" in r)
                    v["peak_gib"] = max(peaks) if peaks else None
                    v["step_s"] = times[len(times) // 2] if times else None
    return out


def render(dirs: list[Path]) -> str:
    lines = ["# H200 results (issue 6)", ""]
    gpu = _load(dirs, "gpu.txt")
    lines += [f"GPU (nvidia-smi): `{(gpu or 'missing').strip()}`", ""]
    env = next(
        (j["environment"] for j in (_load(dirs, n) for n in ("update.json", "audit.json")) if j),
        None,
    )
    if env:
        lines += [f"torch {env.get('torch')}, transformers {env.get('transformers')}, CUDA {env.get('cuda')}, "
                  f"driver {env.get('driver')}, measured {env.get('time')}", ""]  # fmt: skip
    lines += ["Commands: `bash benchmarks/h200_suite.sh suite` and `bash benchmarks/h200_suite.sh bench` "
              "(one device call each), then `python benchmarks/render_gpu_report.py OUT...`.", ""]  # fmt: skip

    plan = _load(dirs, "plan.json")
    peaks = _suite_peaks(dirs)
    lines += [
        "## 7B suite (suites/llama7b_h200.yaml: DPO, 8 pairs x 1024 tokens, 4 steps): planner vs measured",
        "",
    ]
    if plan or peaks:
        rows = []
        pv = {v["variant"]: v for v in (plan or {}).get("variants", [])}
        for name in pv or peaks:
            p, m = pv.get(name, {}), peaks.get(name, {})
            pred, meas = p.get("peak_allocated_gib"), m.get("peak_gib")
            err = f"{100 * (pred - meas) / meas:+.1f}%" if pred and meas else "-"
            rows.append([name, m.get("status", "missing"), f"{pred:.1f}" if pred else "-",
                         "yes" if p.get("fits") else "no", f"{meas:.1f}" if meas else "-", err,
                         f"{m['step_s']:.2f}" if m.get("step_s") else "-"])  # fmt: skip
        lines += [tabulate(rows, ["variant", "status", "planned peak GiB", "planned fit", "measured peak GiB",
                                  "planner error", "step s (median 2-4)"], tablefmt="github"), ""]  # fmt: skip
    else:
        lines += ["missing (call 1 not run or failed)", ""]

    upd = _load(dirs, "update.json")
    lines += ["## Actor-update throughput (8 x 1024 tokens, grad ckpt, fused AdamW)", ""]
    if upd:
        mp = upd.get("matmul_peak", {})
        lines += [f"bf16 8192^3 matmul peak, same process: {mp.get('tflops', float('nan')):.0f} TFLOP/s", ""]
        rows = []
        for k, v in upd.items():
            if k.startswith("update/"):
                if "error" in v:
                    rows.append([k[7:], "error: " + v["error"], "", "", "", ""])
                else:
                    rows.append([k[7:], f"{v['step_s']:.3f}", f"{v['tokens_per_s']:.0f}", f"{v['model_tflops']:.0f}",
                                 f"{100 * v.get('mfu', float('nan')):.1f}%", f"{v.get('peak_allocated_gib', 0):.1f}"])  # fmt: skip
        lines += [tabulate(rows, ["case", "step s", "tokens/s", "model TFLOP/s (6N)", "MFU", "peak GiB"],
                           tablefmt="github"), "",
                  "Reference (plain transformers loop): 1.04 s, 318 TFLOP/s, 40% MFU, 102.4 GiB.", ""]  # fmt: skip
    else:
        lines += ["missing", ""]

    aud = _load(dirs, "audit.json")
    lines += ["## Audit overhead (same process, fresh setup per case)", ""]
    if aud and aud.get("summary"):
        rows = [[k, f"{v['step_s']:.3f}", f"{v['ratio_vs_none']:.3f}"] for k, v in aud["summary"].items()]
        lines += [
            tabulate(rows, ["audit level", "step s (median)", "ratio vs no observer"], tablefmt="github"),
            "",
        ]
        lines += ["Target: boundary (always-on) at or under 1.03.", ""]
    else:
        lines += ["missing", ""]

    ro = _load(dirs, "rollout_bench.md")  # written by benchmarks/rollout_bench.py
    lines += ["## Rollout (Llama-2-7B shape, bf16, batch 32, 128 + 128 tokens, sampling)", ""]
    lines += [ro.replace("\n# ", "\n### ").lstrip("# "), ""] if ro else ["missing", ""]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dirs", nargs="+", type=Path)
    ap.add_argument("--out", type=Path, default=Path("reports/gpu/h200_results.md"))
    args = ap.parse_args()
    text = render(args.dirs)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
