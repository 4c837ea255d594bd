"""Candidates sharing a worker process (`verlaudit.run.batch`, `verlaudit.run.worker.run_many`): they run
in one process and write what one process per run writes; a failed run ends its process and the rest
go on in a fresh one; a process that dies inside a run has that run recorded and the rest go on; the
torch settings a run changes are put back. Run: `pytest tests/test_recommend_batch.py`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from verlaudit.run import batch, runner, worker
from verlaudit.run.hardware import PresentDevice
from verlaudit.run.recommend import candidates, recommend_suite
from verlaudit.run.suite import Suite, load_suite
from verlaudit.rundir import read_json

ROOT = Path(__file__).resolve().parent.parent
DPO = ROOT / "suites" / "dpo_tiny_cpu.yaml"
CPU_ONLY = PresentDevice(cuda=False, gpu_count=0)


def _suite(variants: tuple[str, ...], steps: int = 2) -> Suite:
    data = load_suite(DPO, variants=list(variants), device="cpu").to_dict()
    data["train"] = {**data["train"], "steps": steps}
    data["audit"] = {"level": "off"}
    return Suite.from_dict(data, source=str(DPO))


def test_runs_share_a_process_and_a_failure_hands_the_rest_to_a_fresh_one(tmp_path):
    suite = _suite(("fp32", "bf16", "bf16-pure"))
    plan = runner.plan_runs(suite, tmp_path, CPU_ONLY)
    first = plan.runs[0]
    oom = {"raise_in_phase": {"phase": "actor_update", "at_step": 1, "error": "oom"}}
    failing = dataclasses.replace(first, spec=dataclasses.replace(first.spec, inject=oom))
    plan = dataclasses.replace(plan, runs=(failing, *plan.runs[1:]))
    heard = []
    done, interrupted = batch.execute(plan, suite, tmp_path, progress=False, on_run=heard.append)
    assert (done, interrupted) == (["fp32", "bf16", "bf16-pure"], False)
    assert [p.name for p in heard] == done and all(p.record for p in heard)
    status = {n: read_json(tmp_path / n / "status.json") for n in done}
    assert status["fp32"]["state"] == "failed" and status["fp32"]["reason"] == "oom"
    assert status["bf16"]["state"] == status["bf16-pure"]["state"] == "completed"
    pid = {n: read_json(tmp_path / n / "manifest.json")["environment"]["pid"] for n in done}
    assert pid["bf16"] == pid["bf16-pure"] != pid["fp32"]  # the failure ended its process
    rec = {n: read_json(tmp_path / n / "runner.json") for n in done}
    assert [rec[n]["returncode"] for n in done] == [1, 0, 0] and all(
        r["shared_process"] for r in rec.values()
    )
    assert (
        "failed (oom)" in (tmp_path / "fp32" / "worker.log").read_text()
    )  # each run's output in its own log
    for n in done:
        assert len((tmp_path / n / "metrics.jsonl").read_text().splitlines()) == (1 if n == "fp32" else 2)


FAKE_WORKER = """
import json, os, sys
from pathlib import Path
for spec in sys.argv[1:]:
    run_dir = Path(spec).parent
    if (run_dir / "status.json").exists():
        continue
    if os.environ["FAKE_DIES"] == "before":
        sys.exit(1)
    (run_dir / "worker.log").write_text("started")
    if run_dir.name == "fp32":
        os._exit(9)  # a crash: no status
    (run_dir / "status.json").write_text(json.dumps({"state": "completed"}))
"""


@pytest.mark.parametrize("dies", ["inside", "before"])
def test_a_process_that_dies_has_its_run_recorded_and_the_rest_go_on(tmp_path, monkeypatch, dies):
    suite = _suite(("fp32", "bf16", "bf16-pure"))
    plan = runner.plan_runs(suite, tmp_path, CPU_ONLY)
    monkeypatch.setenv("FAKE_DIES", dies)
    monkeypatch.setattr(
        batch, "worker_command", lambda paths: [sys.executable, "-c", FAKE_WORKER, *map(str, paths)]
    )
    done, interrupted = batch.execute(plan, suite, tmp_path, progress=False)
    assert (done, interrupted) == (["fp32", "bf16", "bf16-pure"], False)
    rec = {n: json.loads((tmp_path / n / "runner.json").read_text()) for n in done}
    if dies == "inside":
        # the crash is fp32's alone: recorded as a dead worker (exit code, no status); the others run
        assert rec["fp32"]["returncode"] == 9 and not (tmp_path / "fp32" / "status.json").exists()
        assert [rec[n]["returncode"] for n in ("bf16", "bf16-pure")] == [0, 0]
    else:
        # a process that never starts a run still moves the queue on: no endless restarts
        assert [rec[n]["returncode"] for n in done] == [1, 1, 1]


def test_the_torch_settings_a_run_changes_are_put_back():
    before = (torch.get_num_threads(), torch.get_float32_matmul_precision(), torch.get_default_dtype())
    with worker._process_state_kept():
        torch.set_num_threads(1)
        torch.set_float32_matmul_precision("medium")
        torch.set_default_dtype(torch.float64)
    assert (
        torch.get_num_threads(),
        torch.get_float32_matmul_precision(),
        torch.get_default_dtype(),
    ) == before


def test_recommend_leaves_out_the_weight_gradient_comparison():
    suite = load_suite(DPO, device="cpu")
    rsuite = recommend_suite(suite, candidates(suite, ["bf16"], ["suite"]), steps=2, rows=2)
    assert rsuite.audit.shadow and not rsuite.audit.shadow_param_grads  # measure() reads none of it


SLEEPY_WORKER = """
import json, signal, sys, time
from pathlib import Path
signal.signal(signal.SIGINT, signal.default_int_handler)  # as worker.run sets it
run_dir = Path(sys.argv[1]).parent
(run_dir / "worker.log").write_text("started")
try:
    time.sleep(60)
except KeyboardInterrupt:  # the runner's SIGINT: the worker records it, as worker.run does
    (run_dir / "status.json").write_text(json.dumps({"state": "failed", "reason": "interrupted"}))
    sys.exit(1)
"""


def test_ctrl_c_stops_the_shared_process_and_returns_what_was_done(tmp_path, monkeypatch):
    import signal

    suite = _suite(("fp32", "bf16", "bf16-pure"))
    plan = runner.plan_runs(suite, tmp_path, CPU_ONLY)
    monkeypatch.setattr(
        batch, "worker_command", lambda paths: [sys.executable, "-c", SLEEPY_WORKER, *map(str, paths)]
    )

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    started = tmp_path / "fp32" / "worker.log"

    def ctrl_c_once_the_worker_sleeps():
        # the interrupt comes when the first worker is inside its sleep (not at a fixed time: a loaded
        # machine may take seconds to start a Python process)
        deadline = time.monotonic() + 120
        while not started.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGALRM)

    previous = signal.signal(signal.SIGALRM, interrupt)
    heard = []
    watcher = threading.Thread(target=ctrl_c_once_the_worker_sleeps, daemon=True)
    try:
        watcher.start()
        done, interrupted = batch.execute(plan, suite, tmp_path, progress=False, on_run=heard.append)
    finally:
        watcher.join(timeout=130)
        signal.signal(signal.SIGALRM, previous)
    assert started.exists(), "the first worker never started"
    assert (done, interrupted) == (["fp32"], True)
    assert heard[-1].not_started == ("bf16", "bf16-pure")
    assert read_json(tmp_path / "fp32" / "status.json")["reason"] == "interrupted"
    assert read_json(tmp_path / "fp32" / "runner.json")["interrupted"] is True
    assert not (tmp_path / "bf16" / "runner.json").exists()
