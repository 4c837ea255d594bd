"""`verlaudit run`: planning (device, GPU count, target emulation, bf16 refusal) and end-to-end runs.

The planning tests use a described machine (`PresentDevice`), so the H200-vs-A100 and V100 cases are
checked on CPU. The end-to-end tests run the real CLI and the real worker on suites/tiny_cpu.yaml
shortened with --steps. Run: `pytest -q tests/test_runner.py`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from verlaudit import cli
from verlaudit.analysis.report.build import write_report
from verlaudit.run import runner
from verlaudit.run.hardware import TARGETS, PresentDevice, get_target
from verlaudit.run.spec import RunSpec
from verlaudit.run.suite import Suite, load_suite
from verlaudit.rundir import read_run

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "suites" / "tiny_cpu.yaml"
H200 = PresentDevice(cuda=True, gpu_count=1, gpu_name="NVIDIA H200", memory_gb=139.8, bf16=True)
CPU_ONLY = PresentDevice(cuda=False, gpu_count=0)


def _suite(target: str, gpus: int = 1, presets=("fp32", "fp16", "bf16", "bf16-pure"), **hw) -> Suite:
    return Suite.from_dict(
        {
            "name": "s",
            "train": {"steps": 2},
            "hardware": {"target": target, "gpus": gpus, **hw},
            "variants": {p: {"precision": {"preset": p}} for p in presets},
        }
    )


def test_hardware_targets():
    assert get_target("A100").name == "a100-80gb" and get_target("v100").bf16 is False
    assert all(
        t.bf16 == (t.compute_capability is None or t.compute_capability >= (8, 0)) for t in TARGETS.values()
    )
    with pytest.raises(ValueError, match="hardware.target: unknown target 'b200'; expected one of cpu"):
        get_target("b200")


def test_a100_target_on_an_h200_caps_memory(tmp_path):
    plan = runner.plan_runs(_suite("a100-80gb"), tmp_path, H200)
    assert plan.device == "cuda" and not any(p.refused for p in plan.runs)
    emu = plan.runs[0].spec.emulation
    assert emu.target == "a100-80gb" and emu.memory_cap_gb == 80.0
    assert "capped at 80 GiB of NVIDIA H200's 139.8 GiB" in emu.reason
    assert plan.runs[0].spec.train.device == "cuda:0" and plan.runs[0].spec.device == "cuda"
    # hardware.memory_gb overrides the target's memory (a MIG slice, say)
    plan = runner.plan_runs(_suite("a100-80gb", memory_gb=20), tmp_path, H200)
    assert plan.runs[0].spec.emulation.memory_cap_gb == 20.0


def test_bigger_target_than_present_gpu_is_not_capped(tmp_path):
    small = PresentDevice(cuda=True, gpu_count=1, gpu_name="NVIDIA A10G", memory_gb=22.0, bf16=True)
    emu = runner.plan_runs(_suite("h200"), tmp_path, small).runs[0].spec.emulation
    assert emu.memory_cap_gb is None and "may OOM where the target would not" in emu.reason


def test_v100_target_refuses_bf16_variants_only(tmp_path):
    plan = runner.plan_runs(_suite("v100-32gb"), tmp_path, H200)
    refused = {p.run.variant: p.refused for p in plan.runs}
    assert refused["fp32"] is None and refused["fp16"] is None
    assert "v100-32gb (compute capability 7.0) has no native bf16" in refused["bf16"]
    assert "precision.preset: fp16" in refused["bf16-pure"]
    # a per-role override that brings bf16 back into an fp16 variant is refused as well
    s = Suite.from_dict(
        {
            "name": "s",
            "train": {},
            "hardware": {"target": "t4"},
            "variants": {
                "mixed": {
                    "precision": {"preset": "fp16", "overrides": {"rollout": {"compute_dtype": "bf16"}}}
                }
            },
        }
    )
    (p,) = runner.plan_runs(s, tmp_path, H200).runs
    assert "roles rollout use bf16" in p.refused


def test_gpu_count_and_cpu_fallback_are_decided_before_starting(tmp_path):
    with pytest.raises(ValueError, match=r"needs 2 GPUs \(hardware.gpus\) but this machine has 1"):
        runner.plan_runs(_suite("a100-80gb", gpus=2), tmp_path, H200)
    with pytest.raises(ValueError, match="no CUDA GPU.*pass --device cpu"):
        runner.plan_runs(_suite("a100-80gb"), tmp_path, CPU_ONLY)
    plan = runner.plan_runs(_suite("a100-80gb", gpus=2), tmp_path, CPU_ONLY, device_override="cpu")
    assert plan.device == "cpu" and plan.runs[0].spec.emulation.memory_cap_gb is None
    assert any("not emulated on CPU" in n for n in plan.notes) and any(
        "gpus=2 on CPU: 2 gloo processes" in n for n in plan.notes
    )
    assert plan.runs[0].spec.train.device == "cpu" and plan.runs[0].spec.device == "cpu"
    # two GPUs: the spec says plain "cuda" (each rank takes cuda:LOCAL_RANK; "cuda:0" would put
    # both ranks on one GPU and init_distributed refuses it); one GPU keeps the explicit cuda:0
    two = PresentDevice(cuda=True, gpu_count=2, gpu_name="NVIDIA H200", memory_gb=139.8, bf16=True)
    assert runner.plan_runs(_suite("a100-80gb", gpus=2), tmp_path, two).runs[0].spec.train.device == "cuda"
    assert runner.plan_runs(_suite("a100-80gb"), tmp_path, two).runs[0].spec.train.device == "cuda:0"
    with pytest.raises(ValueError, match="--device cuda: no CUDA GPU"):
        runner.plan_runs(_suite("cpu"), tmp_path, CPU_ONLY, device_override="cuda")
    # a cpu suite stays on the CPU even where a GPU exists
    assert runner.plan_runs(_suite("cpu"), tmp_path, H200).device == "cpu"


def test_launch_command_is_the_worker_or_torchrun_for_several_gpus():
    assert runner.launch_command("x/spec.json", 1) == [
        sys.executable,
        "-m",
        "verlaudit.run.worker",
        "x/spec.json",
    ]
    assert runner.launch_command("x/spec.json", 2) == [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        "-m",
        "verlaudit.run.worker",
        "x/spec.json",
    ]


def test_spec_follows_the_worker_contract(tmp_path):
    s = load_suite(TINY, seeds=[0, 1], steps=3)
    plan = runner.plan_runs(s, tmp_path, CPU_ONLY)
    spec = plan.runs[1].spec.to_dict()
    assert set(spec) == {f.name for f in dataclasses.fields(RunSpec)}  # spec.json holds every field
    assert (spec["variant"], spec["seed"], spec["run_dir"]) == ("fp32", 1, str(tmp_path / "fp32-s1"))
    assert spec["train"]["seed"] == 1 and spec["train"]["steps"] == 3 and spec["train"]["device"] == "cpu"
    assert spec["audit"] == {
        "level": "full",
        "full_steps": 2,
        "every": 10,
        "shadow": False,
        "shadow_rows": 2,
        "shadow_param_grads": True,
        "shadow_matmul": "fp32",
        "rerun_plugins": False,
        "probe_plugins": True,
        "opcount_steps": 1,
    }
    assert set(spec["emulation"]) == {"target", "memory_cap_gb", "reason"}
    # resolved once, here: the worker reads the device type and the policy instead of deciding them
    assert spec["device"] == "cpu" and spec["policy"]["preset"] == "fp32"
    assert spec["policy"]["roles"]["actor"]["param_dtype"] == "fp32"


def test_refused_variants_get_a_run_dir_and_a_report_row(tmp_path):
    s = _suite("v100-32gb", presets=("bf16", "bf16-pure"))
    plan = runner.plan_runs(s, tmp_path, CPU_ONLY, device_override="cpu")
    done, interrupted = runner.execute(plan, s, tmp_path, progress=False)  # nothing starts: all refused
    assert done == ["bf16", "bf16-pure"] and not interrupted
    run = read_run(tmp_path / "bf16")
    assert run.status["reason"] == "refused" and "no native bf16" in run.status["error"]
    assert run.manifest["policy"]["roles"]["actor"]["compute_dtype"] == "bf16"
    rep = write_report(tmp_path)
    assert list(zip(rep.variants["variant"], rep.variants["status"])) == [
        ("bf16", "refused"),
        ("bf16-pure", "refused"),
    ]
    assert "no native bf16" in rep.markdown  # the reason is in the notes, not only in status.json


# --- end to end: the real CLI, the real worker, the real trainer -------------------------------------


def _metric_mean_tail(run_dir: Path, key: str, window: int) -> float:
    values = [json.loads(line)[key] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    tail = values[-window:]
    return sum(tail) / len(tail)


def test_tiny_cpu_suite_end_to_end_through_the_cli(tmp_path, capsys):
    out = tmp_path / "out"
    rc = cli.main(["run", str(TINY), "--steps", "2", "--out", str(out), "--no-progress"])
    printed = capsys.readouterr().out
    assert rc == 0, printed
    rep = write_report(out)  # re-rendered from the run directories alone
    assert list(rep.variants["variant"]) == ["fp32", "fp16", "bf16", "bf16-pure"]
    assert list(rep.variants["status"]) == ["completed"] * 4 and list(rep.variants["steps"]) == [2] * 4
    window = load_suite(TINY).report.trailing_window
    for row in rep.runs.to_dict("records"):
        # the table's numbers are the run's own metrics
        assert row["reward_mean"] == pytest.approx(
            _metric_mean_tail(out / row["run"], "critic/score/mean", window)
        )
        assert row["device_peak_gb"] > 0 and row["memory_source"] == "rss" and row["step_time_s"] > 0
        assert row["errors"] == 0
        manifest = json.loads((out / row["run"] / "manifest.json").read_text())
        assert (
            manifest["config"]["precision"]["preset"] == row["variant"]
            and manifest["config"]["device"] == "cpu"
        )
    for name in ("fp32: completed", "| bf16-pure ", "report.md"):
        assert name in printed
    for name in ("report.md", "report.csv", "report_runs.csv", "loss.png", "reward.png", "suite.json"):
        assert (out / name).exists(), name


def _broken_suite(tmp_path: Path, steps: int) -> Path:
    data = yaml.safe_load(TINY.read_text())
    data["name"] = "broken"
    data["train"]["steps"] = steps
    fault = str(Path(__file__).resolve().parent / "runner_faults.py") + ":nan_reward_after_first_step"
    data["variants"] = {
        "fp32": {"precision": {"preset": "fp32"}},
        "nan-reward": {"data": {"reward_fn": fault}, "abort_on_nonfinite_loss": 1},
    }
    path = tmp_path / "broken.yaml"
    path.write_text("# Run: verlaudit run broken.yaml\n" + yaml.safe_dump(data))
    return path


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}


def test_failed_variant_is_reported_while_the_others_complete(tmp_path):
    out = tmp_path / "out"
    cmd = [
        sys.executable,
        "-m",
        "verlaudit",
        "run",
        str(_broken_suite(tmp_path, 2)),
        "--out",
        str(out),
        "--no-progress",
        "--audit-level",
        "boundary",
    ]
    proc = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 1, proc.stdout + proc.stderr  # a variant failed; the report was still written
    rep = write_report(out)
    status = dict(zip(rep.variants["variant"], rep.variants["status"]))
    assert status["fp32"] == "completed"
    assert status["nan-reward"].startswith("failed at step 1") and status["nan-reward"].endswith(
        ": nonfinite"
    )
    assert "nan-reward: failed at step 1" in proc.stdout and "| nan-reward " in proc.stdout
    assert int(rep.variants.set_index("variant").loc["fp32", "steps"]) == 2


def test_ctrl_c_stops_the_child_keeps_what_was_written_and_exits_130(tmp_path):
    out = tmp_path / "out"
    cmd = [
        sys.executable,
        "-m",
        "verlaudit",
        "run",
        str(TINY),
        "--steps",
        "500",
        "--variants",
        "fp32,fp16",
        "--out",
        str(out),
        "--no-progress",
        "--audit-level",
        "off",
    ]
    # as from a terminal: a test run from a shell's background job inherits SIGINT ignored
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    metrics = out / "fp32" / "metrics.jsonl"
    deadline = time.monotonic() + 300
    while not (metrics.exists() and metrics.read_text().count("\n") >= 2):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.5)
    proc.send_signal(signal.SIGINT)
    # a bound, not a timing claim: on a loaded 2-core machine the child's current step and the report take a while
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 130, stdout + stderr
    run = read_run(out / "fp32")
    assert run.status["state"] == "failed" and run.status["reason"] == "interrupted"
    assert len(run.metrics) >= 2 and not (out / "fp16").exists()
    report = (out / "report.md").read_text()
    assert (
        "failed at step" in report
        and "interrupted" in report
        and "not run (interrupted before they started): fp16" in report
    )
    assert "not started: fp16" in stderr


def test_the_worker_inherits_the_callers_environment_and_sets_no_machine_settings():
    # NCCL / NVSHMEM settings are the host's business: exported by the caller, passed through as they are
    env = runner.worker_env({"PATH": "/bin"})
    assert not [k for k in env if k.startswith(("NCCL_", "NVSHMEM_", "TORCH_SYMM_MEM_"))]
    assert env["PATH"] == "/bin" and env["PYTHONUNBUFFERED"] == "1"
    assert runner.worker_env({"NCCL_NVLS_ENABLE": "0"})["NCCL_NVLS_ENABLE"] == "0"
