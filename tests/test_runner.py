"""`verlaudit run`: planning (device, GPU count, target emulation, bf16 refusal) and end-to-end runs.

The planning tests use a described machine (`PresentDevice`), so the H200-vs-A100 and V100 cases are
checked on CPU. The end-to-end tests run the real CLI and the real worker on suites/tiny_cpu.yaml
shortened with --steps. Run: `pytest -q tests/test_runner.py`.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from verlaudit import runner
from verlaudit.hardware import TARGETS, PresentDevice, get_target
from verlaudit.report import write_report
from verlaudit.rundir import read_run
from verlaudit.suite import Suite, load_suite

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "suites" / "tiny_cpu.yaml"
H200 = PresentDevice(cuda=True, gpu_count=1, gpu_name="NVIDIA H200", memory_gb=139.8, bf16=True)
CPU_ONLY = PresentDevice(cuda=False, gpu_count=0)


def _suite(target: str, gpus: int = 1, presets=("fp32", "fp16", "bf16", "bf16-pure"), **hw) -> Suite:
    return Suite.from_dict({
        "name": "s", "train": {"steps": 2}, "hardware": {"target": target, "gpus": gpus, **hw},
        "variants": {p: {"precision": {"preset": p}} for p in presets}})  # fmt: skip


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
    emu = plan.runs[0].spec["emulation"]
    assert emu["target"] == "a100-80gb" and emu["memory_cap_gb"] == 80.0
    assert "capped at 80.0 GiB of NVIDIA H200's 139.8 GiB" in emu["reason"]
    assert plan.runs[0].spec["train"]["device"] == "cuda"
    # hardware.memory_gb overrides the target's memory (a MIG slice, say)
    plan = runner.plan_runs(_suite("a100-80gb", memory_gb=20), tmp_path, H200)
    assert plan.runs[0].spec["emulation"]["memory_cap_gb"] == 20.0


def test_bigger_target_than_present_gpu_is_not_capped(tmp_path):
    small = PresentDevice(cuda=True, gpu_count=1, gpu_name="NVIDIA A10G", memory_gb=22.0, bf16=True)
    emu = runner.plan_runs(_suite("h200"), tmp_path, small).runs[0].spec["emulation"]
    assert emu["memory_cap_gb"] is None and "may OOM where the target would not" in emu["reason"]


def test_v100_target_refuses_bf16_variants_only(tmp_path):
    plan = runner.plan_runs(_suite("v100-32gb"), tmp_path, H200)
    refused = {p.run.variant: p.refused for p in plan.runs}
    assert refused["fp32"] is None and refused["fp16"] is None
    assert "v100-32gb (compute capability 7.0) has no native bf16" in refused["bf16"]
    assert "precision.preset: fp16" in refused["bf16-pure"]
    # a per-role override that brings bf16 back into an fp16 variant is refused as well
    s = Suite.from_dict({"name": "s", "hardware": {"target": "t4"}, "variants": {
        "mixed": {"precision": {"preset": "fp16", "overrides": {"rollout": {"compute_dtype": "bf16"}}}}}})  # fmt: skip
    (p,) = runner.plan_runs(s, tmp_path, H200).runs
    assert "roles rollout use bf16" in p.refused


def test_gpu_count_and_cpu_fallback_are_decided_before_starting(tmp_path):
    with pytest.raises(ValueError, match=r"needs 2 GPUs \(hardware.gpus\) but this machine has 1"):
        runner.plan_runs(_suite("a100-80gb", gpus=2), tmp_path, H200)
    with pytest.raises(ValueError, match="no CUDA GPU.*pass --device cpu"):
        runner.plan_runs(_suite("a100-80gb"), tmp_path, CPU_ONLY)
    plan = runner.plan_runs(_suite("a100-80gb", gpus=2), tmp_path, CPU_ONLY, device_override="cpu")
    assert plan.device == "cpu" and plan.runs[0].spec["emulation"]["memory_cap_gb"] is None
    assert any("not emulated on CPU" in n for n in plan.notes) and any(
        "gpus=2 ignored" in n for n in plan.notes
    )
    with pytest.raises(ValueError, match="--device cuda: no CUDA GPU"):
        runner.plan_runs(_suite("cpu"), tmp_path, CPU_ONLY, device_override="cuda")
    # a cpu suite stays on the CPU even where a GPU exists
    assert runner.plan_runs(_suite("cpu"), tmp_path, H200).device == "cpu"


def test_launch_command_is_the_worker_and_refuses_multi_gpu_for_now():
    assert runner.launch_command("x/spec.json", 1) == [
        sys.executable,
        "-m",
        "verlaudit.worker",
        "x/spec.json",
    ]
    with pytest.raises(ValueError, match="multi-GPU execution"):
        runner.launch_command("x/spec.json", 2)


def test_spec_follows_the_worker_contract(tmp_path):
    s = load_suite(TINY, seeds=[0, 1], steps=3)
    plan = runner.plan_runs(s, tmp_path, CPU_ONLY)
    spec = plan.runs[1].spec
    assert set(spec) == {"variant", "suite", "seed", "run_dir", "train", "audit", "emulation"}
    assert (spec["variant"], spec["seed"], spec["run_dir"]) == ("fp32", 1, str(tmp_path / "fp32-s1"))
    assert spec["train"]["seed"] == 1 and spec["train"]["steps"] == 3 and spec["train"]["device"] == "cpu"
    assert spec["audit"] == {"level": "full", "full_steps": 2, "every": 10}
    assert set(spec["emulation"]) == {"target", "memory_cap_gb", "reason"}


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
