"""`verlaudit run` end to end with two processes per variant: torchrun, gloo, FSDP2, per-rank run dirs.

The suite is suites/tiny_cpu_fsdp.yaml (PPO, actor / critic / reference sharded over 2 CPU ranks) plus
a variant whose rank 1 alone raises at step 1. Checked: the report has every variant with each
rank's memory peak, rank 1 writes ``rank1/`` with findings stamped ``rank: 1``, both ranks log the
same averaged training metrics, and a failure on one rank is reported as that rank's, promptly
(the failing rank leaves at once instead of leaving its peer blocked in a collective).
Run: `pytest -q tests/test_distributed_e2e.py` (about a minute on 2 cores).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import yaml

from verlaudit.analysis.report.build import write_report
from verlaudit.rundir import read_run

ROOT = Path(__file__).resolve().parent.parent
SUITE = ROOT / "suites" / "tiny_cpu_fsdp.yaml"


def _suite(tmp_path: Path) -> Path:
    data = yaml.safe_load(SUITE.read_text())
    fault = str(Path(__file__).resolve().parent / "runner_faults.py") + ":fails_on_rank1_second_step"
    data["variants"]["rank1-fails"] = {"data": {"reward_fn": fault}}
    path = tmp_path / "fsdp.yaml"
    path.write_text("# Run: verlaudit run fsdp.yaml\n" + yaml.safe_dump(data, sort_keys=False))
    return path


def test_two_rank_suite_end_to_end(tmp_path):
    out = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    cmd = [
        sys.executable,
        "-m",
        "verlaudit",
        "run",
        str(_suite(tmp_path)),
        "--steps",
        "2",
        "--out",
        str(out),
        "--no-progress",
    ]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stdout + proc.stderr  # rank1-fails failed; the others completed
    assert "2 gloo processes per variant" in proc.stdout

    rep = write_report(out)
    v = rep.variants.set_index("variant")
    assert list(v.index) == ["fp32", "fp16-shard-grad-op", "rank1-fails"]
    for name in ("fp32", "fp16-shard-grad-op"):
        assert v.loc[name, "status"] == "completed" and int(v.loc[name, "steps"]) == 2
        assert int(v.loc[name, "ranks"]) == 2
        # "a / b": one host-RSS peak per rank, and the variant's peak is the larger
        per_rank = [float(x) for x in v.loc[name, "rank_peaks_gb"].split(" / ")]
        assert len(per_rank) == 2 and all(p > 0 for p in per_rank)
        assert abs(float(v.loc[name, "device_peak_gb"]) - max(per_rank)) < 1e-3
        assert f"[per rank {v.loc[name, 'rank_peaks_gb']}]" in rep.markdown

    # the failing rank is named, with its step and the planted error; its peer did not hang
    assert v.loc["rank1-fails", "status"].startswith("failed at step 1 (reward): exception (rank 1)")
    rank1 = json.loads((out / "rank1-fails" / "rank1" / "status.json").read_text())
    assert rank1["rank"] == 1 and "planted failure on rank 1" in rank1["error"]

    for name in ("fp32", "fp16-shard-grad-op"):
        r0, r1 = read_run(out / name), read_run(out / name / "rank1")
        assert r0.manifest["distributed"]["world_size"] == 2 and r1.manifest["distributed"]["rank"] == 1
        assert r0.manifest["config"]["sharding"] == ("full_shard" if name == "fp32" else "shard_grad_op")
        assert all(f.rank == 0 for f in r0.findings) and all(f.rank == 1 for f in r1.findings)
        # trainer metrics are averaged over ranks before either writes them: equal on both ranks,
        # although each rank trained on its own half of the batch
        for key in ("actor/loss", "critic/vf_loss", "critic/score/mean", "actor/grad_norm"):
            assert r0.series(key) == r1.series(key), key
    # fp16 on CPU leaves rotary buffers fp32 under an fp16 policy: a warning on both ranks
    fp16 = [read_run(out / "fp16-shard-grad-op"), read_run(out / "fp16-shard-grad-op" / "rank1")]
    assert all(any(f.severity == "warning" for f in r.findings) for r in fp16)
