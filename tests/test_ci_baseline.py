"""CI regression check: the tiny CPU suite (shortened) through the real CLI, compared with the
committed baseline in reports/baselines/tiny_cpu/cpu/.

The baseline was produced by exactly these commands; rerun them (and commit) to update it:

    verlaudit run suites/tiny_cpu.yaml --steps 3 --variants fp32,fp16 --out /tmp/base
    verlaudit compare /tmp/base --baseline reports/baselines/tiny_cpu/cpu --update-baseline

Tolerances, chosen from measurement: two runs on the same CPU and torch build give bitwise-identical
`actor/loss` trajectories (max |d| = 0: fixed seed, one thread), so the loss tolerance is 1e-6 — room
for summation-order noise, far below what one differently sampled token does (> 1e-3). Step time is
machine-dependent: only a gross slowdown (x20) fails here. Memory is host RSS on CPU: the default
0.25 GB absolute slack applies (see verlaudit/analysis/compare.py).
"""

import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BASELINE = ROOT / "reports" / "baselines" / "tiny_cpu" / "cpu"
STEPS, VARIANTS = 3, ("fp16", "fp32")
TOLERANCES = "loss_atol=1e-6,loss_mean_atol=1e-7,step_time_ratio=20"


def verlaudit(*args, cwd):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "verlaudit", *map(str, args)], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=900)  # fmt: skip


def test_baseline_matches_this_test():
    # if the suite or this test changes, the baseline must be regenerated with the commands above
    assert sorted(p.name for p in BASELINE.iterdir() if p.is_dir()) == list(VARIANTS)
    for v in VARIANTS:
        m = json.loads((BASELINE / v / "manifest.json").read_text())
        assert m["config"]["steps"] == STEPS and m["seed"] == 0
        assert json.loads((BASELINE / v / "status.json").read_text())["state"] == "completed"


def test_tiny_suite_against_committed_baseline(tmp_path):
    out = tmp_path / "run"
    r = verlaudit("run", ROOT / "suites" / "tiny_cpu.yaml", "--steps", STEPS, "--variants", ",".join(VARIANTS),
                  "--out", out, "--no-progress", cwd=tmp_path)  # fmt: skip
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    junit, md = tmp_path / "compare.xml", tmp_path / "compare.md"
    r = verlaudit("compare", out, "--baseline", BASELINE, "--tolerances", TOLERANCES, "--junit", junit,
                  "--markdown", md, cwd=tmp_path)  # fmt: skip
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    root = ET.parse(junit).getroot()
    cases = root.findall("./testsuite/testcase")
    names = {(c.get("classname"), c.get("name")) for c in cases}
    for v in VARIANTS:
        assert (f"tiny_cpu.{v}", "trajectory:actor/loss") in names and (f"tiny_cpu.{v}", "memory") in names
    assert root.get("failures") == "0" and not root.findall(".//failure")
    assert "no regression" in md.read_text()

    # the same real runs, with a gate that cannot hold: one failure per variant, exit 1
    r = verlaudit("compare", out, "--baseline", BASELINE, "--tolerances", TOLERANCES, "--junit", junit,
                  "--gate", "max(actor/grad_norm) < 0", cwd=tmp_path)  # fmt: skip
    assert r.returncode == 1
    failures = ET.parse(junit).getroot().findall(".//testcase/failure")
    assert len(failures) == len(VARIANTS) and all("grad_norm" in f.get("message") for f in failures)

    # diagnose on the fresh runs: completed, no error-level cause
    r = verlaudit("diagnose", out, "--json", cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-3000:]
    assert {d["verdict"] for d in json.loads(r.stdout)["diagnoses"]} <= {"clean", "warning"}
