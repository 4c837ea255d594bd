"""CI regression check: the tiny CPU suite (shortened) through the real CLI, compared with the
committed baseline in reports/baselines/tiny_cpu/cpu/ and its tolerance model.

The baseline and its model were produced by exactly these commands; rerun them (and commit) to update
them, e.g. after a change to the trainer's numerics or to the suite:

    verlaudit run suites/tiny_cpu.yaml --steps 3 --variants fp32,fp16 --out /tmp/base
    verlaudit compare /tmp/base --baseline reports/baselines/tiny_cpu/cpu --update-baseline
    python benchmarks/derive_tolerances.py

Trajectory tolerances come from the baseline's tolerances.json: per variant, metric and step, the
spread of the suite's trajectories across CPU kernel conditions times a safety factor (BASELINE.md
beside it gives the numbers). The run is repeated under other kernels (ATen AVX2 and scalar) to show
that a CI machine whose CPU differs passes, and with planted changes (a slightly larger lr, an
entropy bonus, no gradient clipping) to show that the model still catches them. Step time is
machine-dependent: only a gross slowdown (x20) fails here. Memory is host RSS on CPU: the default
0.25 GB absolute slack applies (see verlaudit/analysis/ci/compare.py).
"""

import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
BASELINE = ROOT / "reports" / "baselines" / "tiny_cpu" / "cpu"
SUITE = ROOT / "suites" / "tiny_cpu.yaml"
STEPS, VARIANTS = 3, ("fp16", "fp32")
TOLERANCES = "step_time_ratio=20"  # trajectories: the baseline's tolerances.json
KERNELS = {
    "as-is": {},
    "aten-avx2": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"},
    "aten-default": {"ATEN_CPU_CAPABILITY": "default"},
}
"""Environments that change torch's CPU kernels (fp16 rounds differently under each)."""


def verlaudit(*args, cwd, env=None):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "verlaudit", *map(str, args)],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )


def run_tiny(tmp_path, suite=SUITE, variants=VARIANTS, env=None):
    out = tmp_path / "run"
    r = verlaudit(
        "run",
        suite,
        "--steps",
        STEPS,
        "--variants",
        ",".join(variants),
        "--out",
        out,
        "--no-progress",
        cwd=tmp_path,
        env=env,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return out


def test_baseline_matches_this_test():
    # if the suite or this test changes, the baseline must be regenerated with the commands above
    assert sorted(p.name for p in BASELINE.iterdir() if p.is_dir()) == list(VARIANTS)
    for v in VARIANTS:
        m = json.loads((BASELINE / v / "manifest.json").read_text())
        assert m["config"]["steps"] == STEPS and m["seed"] == 0
        assert json.loads((BASELINE / v / "status.json").read_text())["state"] == "completed"
    model = json.loads((BASELINE / "tolerances.json").read_text())
    assert model["steps"] >= STEPS and set(VARIANTS) <= set(model["variants"])


@pytest.mark.parametrize("kernels", list(KERNELS))
def test_tiny_suite_against_committed_baseline(tmp_path, kernels):
    env = KERNELS[kernels]
    out = run_tiny(tmp_path, env=env)
    junit, md = tmp_path / "compare.xml", tmp_path / "compare.md"
    r = verlaudit(
        "compare",
        out,
        "--baseline",
        BASELINE,
        "--tolerances",
        TOLERANCES,
        "--junit",
        junit,
        "--markdown",
        md,
        cwd=tmp_path,
    )
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    root = ET.parse(junit).getroot()
    names = {(c.get("classname"), c.get("name")) for c in root.findall("./testsuite/testcase")}
    for v in VARIANTS:
        assert (f"tiny_cpu.{v}", "trajectory:actor/loss") in names and (f"tiny_cpu.{v}", "memory") in names
    assert root.get("failures") == "0" and not root.findall(".//failure")
    text = md.read_text()
    assert "no regression" in text and "steps 0-2 \\|d\\|<=" in text and "(model fp16)" in text
    if env:
        return  # the rest does not depend on the kernels
    # the same real runs, with a gate that cannot hold: one failure per variant, exit 1
    r = verlaudit(
        "compare",
        out,
        "--baseline",
        BASELINE,
        "--tolerances",
        TOLERANCES,
        "--junit",
        junit,
        "--gate",
        "max(actor/grad_norm) < 0",
        cwd=tmp_path,
    )
    assert r.returncode == 1
    failures = ET.parse(junit).getroot().findall(".//testcase/failure")
    assert len(failures) == len(VARIANTS) and all("grad_norm" in f.get("message") for f in failures)

    # diagnose on the fresh runs: completed, no error-level cause
    r = verlaudit("diagnose", out, "--json", cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-3000:]
    assert {d["verdict"] for d in json.loads(r.stdout)["diagnoses"]} <= {"clean", "warning"}


PLANTED = {
    "lr-x1.02": ("lr", 2.0e-3 * 1.02),  # the suite's lr 2e-3; the smallest change tried (see BASELINE.md)
    "entropy-bonus": ("entropy_coef", 0.01),  # a loss term added (the suite has none)
    "no-grad-clip": ("max_grad_norm", 0.0),  # the 1.0 gradient clip dropped
}


@pytest.mark.parametrize("change", list(PLANTED))
def test_planted_change_fails_against_the_baseline(tmp_path, change):
    key, value = PLANTED[change]
    suite = yaml.safe_load(SUITE.read_text())
    assert key not in suite["train"]["algo"] or suite["train"]["algo"][key] != value
    suite["train"]["algo"][key] = value
    planted = tmp_path / "tiny_cpu.yaml"
    planted.write_text(yaml.safe_dump(suite))
    out = run_tiny(tmp_path, suite=planted, variants=("fp16",))
    junit = tmp_path / "compare.xml"
    r = verlaudit(
        "compare", out, "--baseline", BASELINE, "--tolerances", TOLERANCES, "--junit", junit, cwd=tmp_path
    )
    assert r.returncode == 1, r.stdout[-4000:]
    cases = ET.parse(junit).getroot().findall("./testsuite/testcase[@classname='tiny_cpu.fp16']")
    failed = {c.get("name") for c in cases if c.find("failure") is not None}
    # fp16 fails on its trajectories and on nothing else (fp32 was not run: its status fails too)
    assert failed and all(n.startswith("trajectory:") for n in failed), failed
