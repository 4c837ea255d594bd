"""The comparison report from run directories alone: hand-worked numbers, seeds, failures, files.

Run: `pytest -q tests/test_report.py`.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from verlaudit import cli
from verlaudit.analysis.report.build import collect, run_row, write_report
from verlaudit.rundir import Finding, RunWriter, read_run


def _run(
    root: Path,
    name: str,
    *,
    variant: str,
    seed: int = 0,
    algo: str = "ppo",
    metrics: list[dict],
    status: dict | None,
    findings: list[Finding] = (),
) -> Path:
    with RunWriter(root / name) as w:
        w.write_manifest(
            {
                "variant": variant,
                "suite": "t",
                "seed": seed,
                "config": {"algo": {"name": algo}},
                "memory": {"source": "rss", "reason": "no NVML on CPU"},
                "environment": {"python": "3.11", "torch": "2.x", "cpu_count": 2},
            }
        )
        for i, m in enumerate(metrics):
            w.metrics(i, m)
        for f in findings:
            w.finding(f)
        if status is not None:
            w.status(**status)
    return root / name


LOSSES = [4.0, 3.0, 2.0, 1.0, 3.0]
REWARDS = [0.0, 0.1, 0.2, 0.4, 0.6]


def _metrics(**extra_per_step) -> list[dict]:
    out = []
    for i, (loss, r) in enumerate(zip(LOSSES, REWARDS)):
        m = {"actor/loss": loss, "critic/score/mean": r, "perf/step_time_s": [0.5, 0.1, 0.3, 0.2, 0.4][i],
             "perf/device_memory_peak_gb": [1.0, 1.5, 1.2, 1.1, 1.0][i], "actor/loss_scale": 65536.0,
             "actor/skipped": 0.0}  # fmt: skip
        for k, vals in extra_per_step.items():
            m[k.replace("__", "/")] = vals[i]
        out.append(m)
    return out


def test_run_row_hand_worked(tmp_path):
    p = _run(
        tmp_path,
        "fp16",
        variant="fp16",
        status={"state": "completed", "step": 4},
        metrics=_metrics(
            actor__loss_scale=[65536.0, 32768.0, 32768.0, 16384.0, 16384.0],
            actor__skipped=[0.0, 1.0, 0.0, 0.5, 0.0],
        ),
        findings=[
            Finding(severity="warning", kind="numerics/fp16_headroom", message="m", where="lm_head"),
            Finding(severity="error", kind="dtype/module_input", message="m", where="model.norm"),
            Finding(severity="info", kind="x", message="m"),
        ],
    )
    row = run_row(read_run(p), trailing_window=3)
    assert row["status"] == "completed" and row["steps"] == 5
    assert row["device_peak_gb"] == 1.5 and row["memory_source"] == "rss"
    assert row["step_time_s"] == pytest.approx(0.3)  # median of 0.5 0.1 0.3 0.2 0.4
    # last 3 losses 2, 1, 3: mean 2, population std sqrt((0 + 1 + 1) / 3)
    assert row["loss_std"] == pytest.approx(math.sqrt(2 / 3))
    assert row["loss_last"] == 3.0 and row["loss_nonfinite"] == 0
    # last 3 rewards 0.2 0.4 0.6: mean 0.4, variance (0.04 + 0 + 0.04) / 3
    assert row["reward_mean"] == pytest.approx(0.4) and row["reward_var"] == pytest.approx(0.08 / 3)
    # scale backed off at steps 1 and 3; steps 1 and 3 skipped (0.5 = half the optimizer steps)
    assert row["overflow_steps"] == 2 and row["skipped_steps"] == 2
    assert (row["errors"], row["warnings"], row["infos"]) == (1, 1, 1)
    assert row["top_finding"] == "error: dtype/module_input @ model.norm"
    assert math.isnan(row["alloc_peak_gb"])  # no allocator metric on CPU


def test_failed_killed_refused_and_dpo_rows(tmp_path):
    nan_metrics = _metrics(
        actor__loss=[1.0, 2.0, float("nan"), float("inf"), 1.0],
        numerics__actor__nonfinite_grads=[0, 0, 3, 0, 0],
    )
    failed = _run(
        tmp_path,
        "f",
        variant="f",
        metrics=nan_metrics[:4],
        status={"state": "failed", "reason": "nonfinite", "step": 3, "phase": "actor_update", "error": "E"},
    )
    row = run_row(read_run(failed), trailing_window=10)
    assert row["status"] == "failed at step 3 (actor_update): nonfinite" and row["steps"] == 4
    # two non-finite losses; the std uses the finite ones (1, 2): 0.5
    assert row["loss_nonfinite"] == 2 and row["loss_std"] == pytest.approx(0.5)
    assert row["overflow_steps"] == 1
    killed = _run(tmp_path, "k", variant="k", metrics=_metrics()[:2], status=None)
    with open(killed / "metrics.jsonl", "a") as f:
        f.write('{"step": 2, "actor/lo')  # the writer died mid-line
    row = run_row(read_run(killed), trailing_window=10)
    assert row["status"] == "killed after step 1 (no status.json)" and row["steps"] == 2
    refused = _run(
        tmp_path,
        "r",
        variant="r",
        metrics=[],
        status={"state": "failed", "reason": "refused", "error": "no bf16"},
    )
    row = run_row(read_run(refused), trailing_window=10)
    assert (row["status"], row["state"], row["steps"], row["error"]) == ("refused", "refused", 0, "no bf16")
    dpo = _run(
        tmp_path,
        "d",
        variant="d",
        algo="dpo",
        status={"state": "completed"},
        metrics=[{"actor/loss": 0.7, "rewards/margins": m} for m in (0.1, 0.3)],
    )
    row = run_row(read_run(dpo), trailing_window=10)
    assert row["reward_key"] == "rewards/margins" and row["reward_mean"] == pytest.approx(0.2)


def test_seeds_aggregate_and_files(tmp_path):
    (tmp_path / "suite.json").write_text(
        json.dumps(
            {
                "name": "t",
                "source": "suites/t.yaml",
                "seeds": [0, 1],
                "variants": {"b": {}, "a": {}},
                "report": {"trailing_window": 2, "plots": True},
            }
        )
    )
    for seed, shift in ((0, 0.0), (1, 0.2)):
        _run(
            tmp_path,
            f"b-s{seed}",
            variant="b",
            seed=seed,
            status={"state": "completed"},
            metrics=_metrics(critic__score__mean=[r + shift for r in REWARDS]),
        )
    _run(tmp_path, "a-s0", variant="a", seed=0, status={"state": "completed"}, metrics=_metrics())
    _run(
        tmp_path,
        "a-s1",
        variant="a",
        seed=1,
        metrics=_metrics()[:2],
        status={
            "state": "failed",
            "reason": "oom",
            "step": 1,
            "phase": "rollout",
            "error": "CUDA out of memory",
        },
    )
    (tmp_path / "not-a-run").mkdir()
    rep = write_report(tmp_path)
    # suite order (b before a), one row per variant
    assert list(rep.variants["variant"]) == ["b", "a"] and len(rep.runs) == 4
    b = rep.variants.iloc[0]
    # trailing window 2: seed 0 rewards mean(0.4, 0.6) = 0.5, seed 1: 0.7 -> mean 0.6, std sqrt(0.02) = 0.1414
    assert b["reward_mean"] == pytest.approx(0.6) and b["reward_seed_std"] == pytest.approx(math.sqrt(0.02))
    assert b["reward_var"] == pytest.approx(0.02) and b["status"] == "completed" and b["seeds"] == 2
    a = rep.variants.iloc[1]
    assert a["status"] == "failed at step 1 (rollout): oom (1/2 seeds)" and a["steps"] == 2
    assert "| b " in rep.markdown and "0.600 ± 0.141" in rep.markdown
    assert "CUDA out of memory" in rep.markdown
    for name in (
        "report.md",
        "report.csv",
        "report_runs.csv",
        "loss.png",
        "reward.png",
        "memory.png",
        "loss_scale.png",
    ):
        assert (tmp_path / name).stat().st_size > 0, name
    assert (tmp_path / "report.csv").read_text().count("\n") == 3  # header + 2 variants


def test_report_only_through_the_cli(tmp_path, capsys):
    _run(tmp_path, "x", variant="x", status={"state": "completed"}, metrics=_metrics())
    assert cli.main(["run", "--report-only", str(tmp_path)]) == 0
    assert "| x " in capsys.readouterr().out and (tmp_path / "report.md").exists()
    assert cli.main(["run", "--report-only", str(tmp_path / "nothing")]) == 2
    assert "no such directory" in capsys.readouterr().err


def test_collect_rejects_a_directory_without_runs(tmp_path):
    with pytest.raises(ValueError, match="no run directories inside"):
        collect(tmp_path)


def test_a_worker_that_died_before_writing_is_a_failed_row(tmp_path):
    # what the runner leaves when the worker crashes at import or start-up: no manifest, metrics, status
    d = tmp_path / "bf16"
    d.mkdir()
    (d / "spec.json").write_text(json.dumps({"variant": "bf16", "seed": 0}))
    (d / "runner.json").write_text(json.dumps({"returncode": 1, "wall_s": 4.0}))
    (d / "worker.log").write_text(
        "Traceback (most recent call last):\nValueError: Expected a torch.device with a specified index\n"
    )
    rep = write_report(tmp_path)
    (status,) = rep.variants["status"]
    assert status == "failed: worker exited 1 before writing its run directory"
    assert "ValueError: Expected a torch.device with a specified index" in rep.markdown
