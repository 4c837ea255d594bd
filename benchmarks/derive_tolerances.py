"""Derives a baseline's trajectory tolerance model from measurement: the same suite under every CPU
kernel condition this machine can produce, then planted changes that the model must still catch.

    python benchmarks/derive_tolerances.py                # tiny_cpu, 5 steps, every variant and condition
    python benchmarks/derive_tolerances.py --reuse        # re-analyse the runs already in --work

Each condition is one `verlaudit run` of the suite (one process per variant, run one after the
other) with environment variables that change which kernels torch picks: ATen's vector ISA
(``ATEN_CPU_CAPABILITY``), oneDNN's ISA (``ONEDNN_MAX_CPU_ISA``), MKL's code path (``MKL_CBWR``),
the thread count (the suite's ``threads`` key and ``OMP_NUM_THREADS``) and oneDNN on/off
(``torch.backends.mkldnn.enabled``, set by a sitecustomize on PYTHONPATH for these runs only). A
probe under the same environment records what the condition actually changed (the ATen capability
torch reports, the oneDNN bf16 matmul implementation, mkldnn on/off), so a variable that this
torch build ignores shows up as such in BASELINE.md instead of as a silent no-op.

The per-step spread across conditions becomes the model (`verlaudit.analysis.ci.tolerance.derive`),
written to ``<baseline>/tolerances.json`` with BASELINE.md beside it; the raw trajectories go to a
test fixture that `tests/test_tolerance_replay.py` replays. Each planted change (lr, loss terms,
clipping) runs once under the reference condition and is checked against the model. Runs go one
after the other (the wall time of the whole matrix is in BASELINE.md). The suite is copied to a
temporary directory per condition: plug-in paths relative to the suite file must be made absolute.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from verlaudit.analysis.ci import tolerance  # noqa: E402
from verlaudit.analysis.ci.baseline_notes import write_notes  # noqa: E402
from verlaudit.rundir import read_run  # noqa: E402

MKLDNN_VAR = "VERLAUDIT_DERIVE_MKLDNN"
SITECUSTOMIZE = f"""\
# written by benchmarks/derive_tolerances.py: oneDNN off for the 'mkldnn-off' condition only
import os
if os.environ.get({MKLDNN_VAR!r}) == "0":
    import torch
    torch.backends.mkldnn.enabled = False
"""

# name -> (environment, suite `train` overrides, what it models)
CONDITIONS: dict[str, tuple[dict[str, str], dict[str, Any], str]] = {
    "reference": ({}, {}, "this machine as it is (the baseline's own condition)"),
    "reference-again": ({}, {}, "the reference again: run-to-run noise on one machine (expected 0)"),
    "aten-avx2": ({"ATEN_CPU_CAPABILITY": "avx2"}, {}, "ATen vector kernels of an AVX2 CPU"),
    "aten-default": ({"ATEN_CPU_CAPABILITY": "default"}, {}, "ATen scalar (non-vectorised) kernels"),
    "onednn-avx2": ({"ONEDNN_MAX_CPU_ISA": "AVX2"}, {}, "oneDNN limited to AVX2"),
    "onednn-avx512-core": ({"ONEDNN_MAX_CPU_ISA": "AVX512_CORE"}, {}, "oneDNN without AVX512-BF16"),
    "onednn-sse41": ({"ONEDNN_MAX_CPU_ISA": "SSE41"}, {}, "oneDNN limited to SSE4.1"),
    "onednn-all": ({"ONEDNN_MAX_CPU_ISA": "ALL"}, {}, "oneDNN with every ISA it knows (= default)"),
    "mkl-compatible": ({"MKL_CBWR": "COMPATIBLE"}, {}, "MKL's conditional-reproducibility code path"),
    "threads-2": ({"OMP_NUM_THREADS": "2"}, {"threads": 2}, "two threads instead of one"),
    "mkldnn-off": ({MKLDNN_VAR: "0"}, {}, "torch.backends.mkldnn.enabled = False"),
    "avx2-machine": (
        {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_CBWR": "COMPATIBLE"},
        {},
        "ATen, oneDNN and MKL all on their AVX2-era paths together",
    ),
    "generic-machine": (
        {
            "ATEN_CPU_CAPABILITY": "default",
            "ONEDNN_MAX_CPU_ISA": "SSE41",
            "MKL_CBWR": "COMPATIBLE",
            "OMP_NUM_THREADS": "2",
            MKLDNN_VAR: "0",
        },
        {"threads": 2},
        "everything above that differs, at once",
    ),
}
REFERENCE = "reference"
NOT_A_MACHINE = {
    "ATEN_CPU_CAPABILITY=default": "torch runs ATen's scalar kernels only on x86 CPUs without AVX2 (before "
    "2013, some Atom/Celeron); measured because CI may force it, left out of the safety factor",
}
"""Kernel settings whose leave-one-out ratio does not set k (why, per setting)."""

# name -> (suite `train.algo` key, new value or a factor on the suite's value, what it models)
PLANTED: dict[str, tuple[str, Any, str]] = {
    "lr-x1.002": ("lr", ("x", 1.002), "actor lr x1.002"),
    "lr-x1.005": ("lr", ("x", 1.005), "actor lr x1.005"),
    "lr-x1.01": ("lr", ("x", 1.01), "actor lr x1.01"),
    "lr-x1.02": ("lr", ("x", 1.02), "actor lr x1.02"),
    "lr-x1.05": ("lr", ("x", 1.05), "actor lr x1.05"),
    "lr-x1.1": ("lr", ("x", 1.1), "actor lr x1.1"),
    "entropy-coef": ("entropy_coef", 0.01, "an entropy bonus (entropy_coef 0 -> 0.01)"),
    "vf-coef": ("vf_coef", 0.4, "value-loss weight 0.5 -> 0.4"),
    "kl-coef": ("kl_coef", ("x", 2.0), "KL penalty coefficient x2"),
    "clip-ratio": ("clip_ratio", 0.3, "PPO ratio clip 0.2 -> 0.3"),
    "no-grad-clip": ("max_grad_norm", 0.0, "gradient clipping dropped (max_grad_norm 1.0 -> 0)"),
}

PROBE = r"""
import json
import torch
a = torch.randn(8, 64, dtype=torch.bfloat16); w = torch.randn(32, 64, dtype=torch.bfloat16)
torch.nn.functional.linear(a, w)
print("PROBE" + json.dumps({"aten_capability": torch.backends.cpu.get_cpu_capability(),
      "mkldnn_enabled": torch.backends.mkldnn.enabled, "threads": torch.get_num_threads()}))
"""


def probe(env: Mapping[str, str]) -> dict[str, Any]:
    """What the condition changed, as torch itself reports it (and oneDNN's verbose log)."""
    r = subprocess.run(
        [sys.executable, "-c", PROBE],
        env={**env, "ONEDNN_VERBOSE": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    out: dict[str, Any] = {}
    for line in r.stdout.splitlines():
        if line.startswith("PROBE"):
            out.update(json.loads(line[5:]))
        elif line.startswith("onednn_verbose") and ",exec," in line and ",matmul," in line:
            out["onednn_bf16_matmul"] = line.split(",")[6]
    out.setdefault("onednn_bf16_matmul", "not oneDNN")
    if r.returncode != 0:
        raise RuntimeError(f"probe failed: {r.stderr[-2000:]}")
    return out


def suite_copy(
    suite: Mapping[str, Any], train: Mapping[str, Any], algo: Mapping[str, Any], dest: Path
) -> Path:
    data = copy.deepcopy(dict(suite))
    data["train"] = {**data.get("train", {}), **train}
    data["train"]["algo"] = {**data["train"].get("algo", {}), **algo}
    dest.write_text(yaml.safe_dump(data, sort_keys=False), encoding="utf-8")
    return dest


def run_suite(
    suite_path: Path, out: Path, env: Mapping[str, str], steps: int, variants: Sequence[str]
) -> float:
    """One `verlaudit run` (its workers run one after the other); returns the wall time."""
    t0 = time.monotonic()
    cmd = [
        sys.executable,
        "-m",
        "verlaudit",
        "run",
        str(suite_path),
        "--steps",
        str(steps),
        "--variants",
        ",".join(variants),
        "--out",
        str(out),
        "--no-progress",
    ]
    r = subprocess.run(cmd, env=dict(env), capture_output=True, text=True, timeout=3600)
    if r.returncode != 0:
        raise RuntimeError(
            f"{' '.join(cmd)} failed ({r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
        )
    return time.monotonic() - t0


def trajectories(out: Path, variants: Sequence[str], metrics: Sequence[str]) -> dict[str, dict[str, list]]:
    """variant -> metric -> per-step values (None where a step did not record it)."""
    res: dict[str, dict[str, list]] = {}
    for v in variants:
        run = read_run(out / v)
        if run.state != "completed":
            raise RuntimeError(f"{out / v}: {run.state} ({run.status})")
        by_step = {int(m["step"]): m for m in run.metrics}
        res[v] = {k: [by_step[s].get(k) for s in sorted(by_step)] for k in metrics}
    return res


def complete(out: Path, variants: Sequence[str], steps: int) -> bool:
    try:
        runs = [read_run(out / v) for v in variants]
    except (OSError, ValueError):
        return False
    return all(len(r.metrics) == steps and r.state == "completed" for r in runs)


def base_env(site_dir: Path) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in {"ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_CBWR", MKLDNN_VAR}
    }
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(site_dir)])
    env["OMP_NUM_THREADS"] = "1"
    return env


def planted_algo(suite: Mapping[str, Any], key: str, change: Any) -> dict[str, Any]:
    algo = (suite.get("train") or {}).get("algo") or {}
    if isinstance(change, tuple):
        return {key: float(algo.get(key, _algo_default(key))) * change[1]}
    return {key: change}


def _algo_default(key: str) -> Any:
    from trainer.config import AlgoConfig

    return getattr(AlgoConfig(), key)


def measure(
    args: argparse.Namespace, suite: Mapping[str, Any], names: Sequence[str], kind: str, site_dir: Path
) -> dict[str, dict[str, Any]]:
    """Runs (or reuses) each condition or planted change; returns name -> record with trajectories."""
    records: dict[str, dict[str, Any]] = {}
    for name in names:
        if kind == "condition":
            extra_env, train, desc = CONDITIONS[name]
            algo: dict[str, Any] = {}
        else:
            key, change, desc = PLANTED[name]
            extra_env, train, algo = {}, {}, planted_algo(suite, key, change)
        env = {**base_env(site_dir), **extra_env}
        out = args.work / kind / name
        sp = suite_copy(suite, train, algo, site_dir / f"{kind}-{name}.yaml")
        if not (args.reuse and complete(out, args.variants, args.steps)):
            if out.exists():
                shutil.rmtree(out)
            (out.parent).mkdir(parents=True, exist_ok=True)
            (out.parent / f"{name}.wall_s").write_text(
                f"{run_suite(sp, out, env, args.steps, args.variants):.1f}"
            )
        wall_file = out.parent / f"{name}.wall_s"
        wall = float(wall_file.read_text()) if wall_file.is_file() else None
        rec = {
            "description": desc,
            "env": extra_env,
            "train_overrides": {**train, **({"algo": algo} if algo else {})},
            "probe": probe(env) if kind == "condition" else None,
            "wall_s": None if wall is None else round(wall, 1),
            "trajectories": trajectories(out, args.variants, tolerance.RECORDED_METRICS),
        }
        records[name] = rec
        print(f"{kind} {name}: {desc}; wall {rec['wall_s']} s; probe {rec['probe']}", flush=True)
    return records


def machine() -> dict[str, Any]:
    import platform

    import torch

    cpu, flags = "unknown", []
    try:
        info = Path("/proc/cpuinfo").read_text(encoding="utf-8")
        cpu = next(
            (ln.split(":", 1)[1].strip() for ln in info.splitlines() if ln.startswith("model name")), cpu
        )
        have = next((ln.split(":", 1)[1].split() for ln in info.splitlines() if ln.startswith("flags")), [])
        flags = [f for f in have if f in ISA_FLAGS]
    except OSError:
        pass
    return {
        "cpu": cpu,
        "isa": flags,
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%d"),
    }


ISA_FLAGS = (
    "avx2",
    "fma",
    "avx512f",
    "avx512bw",
    "avx512_vnni",
    "avx512_bf16",
    "avx512_fp16",
    "amx_bf16",
    "amx_fp16",
    "amx_tile",
)


def caught(
    model: Mapping[str, Any], variant: str, ref: Mapping[str, Sequence], other: Mapping[str, Sequence]
) -> dict[str, Any]:
    """When the model first catches ``other`` against ``ref`` (steps needed, metric, where), and the
    largest safety factor k that would still catch it within the model's steps (and where)."""
    vm, steps = model["variants"][variant]["metrics"], model["steps"]
    mms = {
        m: tolerance.MetricModel(
            step_atol=tuple(x["step_atol"]), mean_atol=tuple(x["mean_atol"]), floor=x["floor"]
        )
        for m, x in vm.items()
    }
    first = None
    for n in range(1, steps + 1):
        hits = [(m, w) for m, mm in mms.items() for w, _, _ in tolerance.violations(mm, ref[m], other[m], n)]
        if hits:
            first = {
                "steps": n,
                "metric": hits[0][0],
                "where": hits[0][1],
                "metrics": sorted({m for m, _ in hits}),
            }
            break
    # caught at k iff |d| > max(floor, k * envelope) somewhere: the largest such k is |d| / envelope
    # over the (metric, step) where |d| clears the floor
    best, at = 0.0, ""
    for m, x in vm.items():
        d = [o - r for o, r in zip(other[m][:steps], ref[m][:steps])]
        pairs = [(abs(v), e, f"step {i}") for i, (v, e) in enumerate(zip(d, tolerance.envelope(x["spread"])))]
        pairs += [
            (abs(v), e, f"mean of {i + 1}")
            for i, (v, e) in enumerate(zip(tolerance.prefix_means(d), tolerance.envelope(x["mean_spread"])))
        ]
        for dd, e, where in pairs:
            k = (dd / e if e > 0 else math.inf) if dd > x["floor"] else 0.0
            if k > best:
                best, at = k, f"{m} {where}"
    return {"first": first, "catching_k": best, "catching_at": at}


def factors(conditions: Mapping[str, Any]) -> dict[str, list[str]]:
    """Kernel setting -> the conditions that have it (settings that always come together are one)."""
    settings = {}
    for c, r in conditions.items():
        kv = {
            ("torch.backends.mkldnn.enabled" if k == MKLDNN_VAR else k): ("False" if k == MKLDNN_VAR else v)
            for k, v in r["env"].items()
            if k != "OMP_NUM_THREADS"
        }
        if "threads" in r["train_overrides"]:
            kv["threads"] = r["train_overrides"]["threads"]
        settings[c] = kv
    merged: dict[tuple[str, ...], list[str]] = {}
    for label, members in tolerance.factor_groups(settings).items():
        merged.setdefault(tuple(members), []).append(label)
    return {" & ".join(labels): list(members) for members, labels in merged.items()}


def leave_one_out(
    matrix: Mapping[str, Any], metrics: Sequence[str]
) -> dict[str, dict[str, dict[str, float]]]:
    """{variant: {metric: {kernel setting: leave-one-factor-out ratio}}}."""
    runs = {c: r["trajectories"] for c, r in matrix["conditions"].items()}
    groups = factors(matrix["conditions"])
    return {
        v: {m: tolerance.loo_ratios(runs, v, m, groups, reference=matrix["reference"]) for m in metrics}
        for v in runs[matrix["reference"]]
    }


def external_check(
    name: str, e: Mapping[str, Any], matrix: Mapping[str, Any], model: Mapping[str, Any]
) -> dict:
    """|d| / step_atol of each value measured elsewhere against the reference run, and the
    conditions here that reproduce those values bit for bit."""
    ref = matrix["conditions"][matrix["reference"]]["trajectories"]
    res: dict[str, list] = {}
    for v, metrics in e["trajectories"].items():
        vm = model["variants"].get(v)
        for m, pts in metrics.items():
            if not vm or m not in vm["metrics"]:
                continue
            for s, x in pts.items():
                d, atol = abs(x - ref[v][m][int(s)]), vm["metrics"][m]["step_atol"][int(s)]
                res.setdefault(v, []).append({"metric": m, "step": int(s), "d": d, "atol": atol})
    same = [
        c
        for c, r in matrix["conditions"].items()
        if all(
            r["trajectories"][v][m][int(s)] == x
            for v, ms in e["trajectories"].items()
            for m, pts in ms.items()
            for s, x in pts.items()
            if int(s) < model["steps"] and m in r["trajectories"][v]
        )
    ]
    return {"name": name, "description": e["description"], "result": res, "same_as": same}


def describe(
    matrix: Mapping[str, Any],
    model: Mapping[str, Any],
    loo: Mapping[str, Any],
    external: Mapping[str, Any],
    baseline_runs: Mapping[str, Any],
    command: str,
) -> dict[str, Any]:
    """The numbers BASELINE.md explains: conditions, leave-one-out ratios, planted changes,
    external trajectories, and whether the committed runs equal the reference condition."""
    ref_name = matrix["reference"]
    ref = matrix["conditions"][ref_name]["trajectories"]
    variants = list(model["variants"])
    conds = []
    for c, r in matrix["conditions"].items():
        diff = {
            v: max(
                (abs(a - b) for a, b in zip(r["trajectories"][v]["actor/loss"], ref[v]["actor/loss"])),
                default=0.0,
            )
            for v in variants
        }
        conds.append(
            {k: r[k] for k in ("description", "env", "train_overrides", "probe", "wall_s")}
            | {"name": c, "loss_vs_reference": diff}
        )
    planted = [
        {
            "name": n,
            "description": r["description"],
            "change": r["train_overrides"],
            "result": {v: caught(model, v, ref[v], r["trajectories"][v]) for v in variants},
        }
        for n, r in matrix["planted"].items()
    ]
    ext = [external_check(n, e, matrix, model) for n, e in external.items()]
    committed = {
        v: max((abs(a - b) for a, b in zip(t, ref[v]["actor/loss"])), default=None)
        for v, t in baseline_runs.items()
        if v in ref
    }
    return {
        "command": command,
        "machine": machine(),
        "suite": matrix["suite"],
        "variants": variants,
        "reference": ref_name,
        "conditions": conds,
        "loo": loo,
        "not_a_machine": NOT_A_MACHINE,
        "k_min": tolerance.K_MIN,
        "lofo_margin": tolerance.LOFO_MARGIN,
        "planted": planted,
        "external": ext,
        "committed_runs_vs_reference": committed,
        "wall_s_total": sum(
            r["wall_s"] or 0.0 for k in ("conditions", "planted") for r in matrix[k].values()
        ),
    }


def external_trajectories(path: Path | None) -> dict[str, Any]:
    """Trajectories measured elsewhere: {name: {description, trajectories: {variant: {metric: {step: value}}}}}."""
    if path is None or not path.is_file():
        return {}
    return json.loads(path.read_text(encoding="utf-8"))


def committed_losses(baseline: Path) -> dict[str, list[float]]:
    out = {}
    for d in sorted(baseline.iterdir()) if baseline.is_dir() else []:
        if (d / "metrics.jsonl").is_file():
            out[d.name] = [v for _, v in read_run(d).series("actor/loss")]
    return out


def recorded_args(argv: Sequence[str]) -> list[str]:
    """The command line minus --work / --reuse: where runs are cached does not change the result."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--work":
            skip = True
        elif a != "--reuse" and not a.startswith("--work="):
            out.append(a)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--suite", type=Path, default=ROOT / "suites" / "tiny_cpu.yaml")
    p.add_argument("--steps", type=int, default=5, help="steps per run (the model covers steps 0..N-1)")
    p.add_argument("--variants", help="comma-separated variants (default: every variant of the suite)")
    p.add_argument("--conditions", default=",".join(CONDITIONS), help="kernel conditions to run")
    p.add_argument("--planted", default=",".join(PLANTED), help="planted changes to run ('' for none)")
    p.add_argument(
        "--safety",
        type=float,
        help="one safety factor k for every variant (default: per variant, "
        "max(K_MIN, LOFO_MARGIN x the largest leave-one-factor-out ratio))",
    )
    p.add_argument(
        "--baseline", type=Path, help="where tolerances.json goes (default reports/baselines/<suite>/cpu)"
    )
    p.add_argument(
        "--fixture", type=Path, help="raw trajectories (default tests/fixtures/tolerance/<suite>.json)"
    )
    p.add_argument(
        "--external",
        type=Path,
        help="trajectories from other machines to check the model against "
        "(default tests/fixtures/tolerance/<suite>_external.json when it exists)",
    )
    p.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "derive_tolerances")
    p.add_argument("--reuse", action="store_true", help="reuse complete runs already in --work")
    args = p.parse_args(argv)
    suite = yaml.safe_load(args.suite.read_text(encoding="utf-8"))
    args.variants = [v for v in (args.variants or ",".join(suite.get("variants") or {})).split(",") if v]
    conditions = [c for c in args.conditions.split(",") if c]
    planted = [c for c in args.planted.split(",") if c]
    unknown = [c for c in conditions if c not in CONDITIONS] + [c for c in planted if c not in PLANTED]
    if unknown or REFERENCE not in conditions:
        p.error(f"unknown condition/planted change {unknown}, or '{REFERENCE}' missing")
    name = suite.get("name") or args.suite.stem
    baseline = args.baseline or ROOT / "reports" / "baselines" / name / "cpu"
    fixtures = ROOT / "tests" / "fixtures" / "tolerance"
    fixture = args.fixture or fixtures / f"{name}.json"
    external = external_trajectories(args.external or fixtures / f"{name}_external.json")
    args.work.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as td:
        site_dir = Path(td)
        (site_dir / "sitecustomize.py").write_text(SITECUSTOMIZE, encoding="utf-8")
        conds = measure(args, suite, conditions, "condition", site_dir)
        plants = measure(args, suite, planted, "planted", site_dir)
    presets = {
        v: (
            (read_run(args.work / "condition" / REFERENCE / v).manifest.get("config") or {}).get("precision")
            or {}
        ).get("preset", v)
        for v in args.variants
    }
    matrix = {
        "suite": name,
        "steps": args.steps,
        "reference": REFERENCE,
        "presets": presets,
        "conditions": conds,
        "planted": plants,
    }
    loo = leave_one_out(matrix, tolerance.MODELLED_METRICS)
    ks = args.safety or tolerance.safety_factors(loo, exclude=list(NOT_A_MACHINE))
    model = tolerance.derive(
        {c: r["trajectories"] for c, r in conds.items()}, reference=REFERENCE, safety=ks, presets=presets
    )
    command = " ".join(
        ["python benchmarks/derive_tolerances.py", *recorded_args(argv if argv is not None else sys.argv[1:])]
    )
    model["derivation"] = describe(matrix, model, loo, external, committed_losses(baseline), command.strip())
    fixture.parent.mkdir(parents=True, exist_ok=True)
    fixture.write_text(json.dumps(matrix, indent=1) + "\n", encoding="utf-8")
    baseline.mkdir(parents=True, exist_ok=True)
    (baseline / tolerance.TOLERANCE_FILE).write_text(json.dumps(model, indent=1) + "\n", encoding="utf-8")
    write_notes(baseline, os.path.relpath(baseline, ROOT))
    print(f"wrote {baseline / tolerance.TOLERANCE_FILE}, {baseline / 'BASELINE.md'} and {fixture}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
