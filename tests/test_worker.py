"""`python -m verlaudit.run.worker SPEC.json`: exit codes, run directory content, failures as results.

Run: `pytest tests/test_worker.py` (subprocesses; about half a minute on 2 cores).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from trainer.precision import resolve_policy
from verlaudit.run.worker import main as worker_main
from verlaudit.rundir import read_run

ROOT = Path(__file__).resolve().parents[1]
TRAIN = {
    "steps": 2, "device": "cpu", "threads": 1,
    "algo": {"name": "grpo", "batch_size": 2, "mini_batch_size": 4, "micro_batch_size": 2, "group_size": 2},
    "data": {"num_examples": 16, "prompt_length": 8, "response_length": 4},
    "precision": {"preset": "bf16"},
}  # fmt: skip


def resolved(train):
    """What the runner adds to a spec (here for a hand-written one): the device type and the policy."""
    return {"device": "cpu", "policy": resolve_policy(train["precision"]["preset"]).to_dict()}


def spec(tmp_path, **extra):
    train = extra.pop("train", TRAIN)
    s = {
        "variant": "v",
        "suite": "t",
        "seed": 3,
        "run_dir": str(tmp_path / "run"),
        "train": train,
        "audit": {"level": "full", "full_steps": 1, "every": 0},
        **resolved(train),
        **extra,
    }
    p = tmp_path / "spec.json"
    p.write_text(json.dumps(s))
    return p


def worker(path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-m", "verlaudit.run.worker", str(path)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_completed_run_directory(tmp_path):
    r = worker(spec(tmp_path))
    assert r.returncode == 0, r.stderr
    run = read_run(tmp_path / "run")
    assert run.state == "completed" and run.status["step"] == 1
    m = run.manifest
    assert (m["variant"], m["seed"], m["config"]["seed"]) == ("v", 3, 3)  # the spec's seed is the run's
    assert m["policy"]["preset"] == "bf16" and m["memory"]["source"] == "rss" and m["memory"]["reason"]
    assert {"python", "torch", "transformers", "vllm", "cuda", "device", "cpu_count"} <= set(m["environment"])
    # the audit's contribution, written by the worker when training ended: the run's memory peaks
    assert m["memory_summary"]["source"] == "rss" and m["memory_summary"]["phase_peak_gb"]["actor_update"] > 0
    assert [x["step"] for x in run.metrics] == [0, 1]
    first, second = run.metrics
    assert first["audit/full"] == 1.0 and second["audit/full"] == 0.0  # full_steps=1, every=0
    assert "numerics/actor/act_absmax" in first and "numerics/actor/act_absmax" not in second
    for key in (
        "actor/loss",
        "perf/device_memory_peak_gb",
        "memory/actor_update/device_peak_gb",
        "numerics/actor/nonfinite_grads",
        "audit/findings/error",
    ):
        assert key in second
    # verl's per-phase wall time: every phase the recipe marks, each inside the step's own time
    phases = {k for k in second if k.startswith("timing_s/")}
    assert {"timing_s/rollout", "timing_s/reward", "timing_s/actor_update"} <= phases
    assert sum(second[k] for k in phases) <= second["perf/step_time_s"] + 1e-3
    assert not any(f.severity == "error" for f in run.findings)


def test_dtype_error_exits_1_with_the_culprit(tmp_path):
    # fp32 preset (no autocast): an fp16 submodule meets fp32 activations and the matmul raises
    train = {**TRAIN, "precision": {"preset": "fp32"}}
    inject = {"cast_module": {"module": "model.layers.1.self_attn.q_proj", "dtype": "fp16"}}
    r = worker(spec(tmp_path, train=train, inject=inject))
    assert r.returncode == 1 and "dtype_error" in r.stderr
    run = read_run(tmp_path / "run")
    st = run.status
    assert (st["state"], st["reason"], st["where"], st["step"], st["phase"]) == (
        "failed",
        "dtype_error",
        "model.layers.1.self_attn.q_proj",
        0,
        "rollout",
    )
    assert "Traceback" in st["traceback"] and "\n" not in st["error"]
    assert [f.where for f in run.findings if f.kind == "runtime/dtype_error"] == [
        "model.layers.1.self_attn.q_proj"
    ]


@pytest.mark.parametrize("error, reason", [("oom", "oom"), ("interrupt", "interrupted")])
def test_oom_and_interrupt_become_status(tmp_path, error, reason):
    r = worker(
        spec(tmp_path, inject={"raise_in_phase": {"phase": "actor_update", "at_step": 1, "error": error}})
    )
    assert r.returncode == 1
    run = read_run(tmp_path / "run")
    assert (run.status["reason"], run.status["step"], run.status["phase"]) == (reason, 1, "actor_update")
    assert [x["step"] for x in run.metrics] == [0]  # what was written before the failure stays readable
    assert "phase_peak_gb_so_far" in run.status["memory"]
    # a failed run's manifest gets the audit's memory peaks too, up to the failure
    assert "actor_update" in run.manifest["memory_summary"]["phase_peak_gb"]
    if reason == "oom":
        assert [f.where for f in run.findings if f.kind == "memory/oom"] == ["actor_update"]


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda s: s.pop("run_dir"), "run_dir: missing"),
        (lambda s: s.update(colour="red"), "colour: unknown key"),
        (lambda s: s["train"]["algo"].update(lr=-1), "train.algo.lr: must be > 0"),
        (lambda s: s.update(audit={"level": "loud"}), "audit.level: 'loud'"),
        (lambda s: s.update(emulation={"memory_cap_gb": -4}), "emulation.memory_cap_gb"),
        (lambda s: s.pop("policy"), "policy: missing"),  # the runner decides it; the worker does not
    ],
)
def test_bad_spec_exits_2_naming_the_field(tmp_path, capsys, mutate, message):
    s = {
        "variant": "v",
        "run_dir": str(tmp_path / "run"),
        "train": json.loads(json.dumps(TRAIN)),
        **resolved(TRAIN),
    }
    mutate(s)
    p = tmp_path / "spec.json"
    p.write_text(json.dumps(s))
    assert worker_main([str(p)]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
def test_spec_for_a_gpu_on_a_machine_without_one_exits_2(tmp_path, capsys):
    train = {**TRAIN, "device": "cuda"}
    p = spec(tmp_path, train=train, device="cuda")
    assert worker_main([str(p)]) == 2
    assert "'cuda' requested but no CUDA GPU is visible" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()  # nothing half-written


def test_a_checkpoint_setting_the_trainer_replaces_is_recorded_with_both_values(tmp_path):
    # a checkpoint trained to end turns with another token than the tokenizer's eos: the rollout stops at
    # the tokenizer's, and the manifest and the log say so, with both values
    from tests.verl_job import tiny_qwen_dir

    model = tiny_qwen_dir(tmp_path / "model")
    gen = json.loads((model / "generation_config.json").read_text())
    (model / "generation_config.json").write_text(json.dumps({**gen, "eos_token_id": 7}))
    train = {**TRAIN, "steps": 1, "model": {"path": str(model)}, "precision": {"preset": "fp32"}}
    r = worker(spec(tmp_path, train=train, audit={"level": "off"}))
    assert r.returncode == 0, r.stderr
    recorded = {s["setting"]: s for s in read_run(tmp_path / "run").manifest["overridden"]}
    eos = recorded["model.path generation_config.eos_token_id"]
    assert eos["yours"] == 7 and eos["used"] != 7 and eos["differs"] is True
    assert "model.path generation_config.eos_token_id: yours is 7, the trainer uses" in r.stderr
    # the tokenizer's own settings: recorded too, a warning only where they differ
    side = recorded["model.path tokenizer padding_side"]
    assert side["used"] == "left" and side["differs"] == (side["yours"] != "left")


def test_fanout_passes_every_event_to_every_observer_in_order():
    import contextlib
    import inspect

    from trainer.events import Fanout, Observer

    events = [n for n, _ in inspect.getmembers(Observer, inspect.isfunction) if n.startswith("on_")]
    assert events and all(n in vars(Fanout) for n in events)  # an event Fanout would not pass on

    class Log(Observer):
        def __init__(self, name: str, heard: list) -> None:
            self.name, self.heard = name, heard

        def on_step_start(self, step):
            self.heard.append((self.name, "start", step))

        def on_loss(self, *, role, loss, terms):
            self.heard.append((self.name, "loss", role))

        @contextlib.contextmanager
        def phase(self, name):
            self.heard.append((self.name, "enter", name))
            yield
            self.heard.append((self.name, "exit", name))

    heard: list = []
    fan = Fanout([Log("a", heard), Log("b", heard)])
    fan.on_step_start(3)
    with fan.phase("actor_update"):
        fan.on_loss(role="actor", loss=None, terms={})
    fan.on_step_end(3, {})  # the base class's no-op on both
    assert heard == [
        ("a", "start", 3),
        ("b", "start", 3),
        ("b", "enter", "actor_update"),  # the last observer outermost
        ("a", "enter", "actor_update"),
        ("a", "loss", "actor"),
        ("b", "loss", "actor"),
        ("a", "exit", "actor_update"),
        ("b", "exit", "actor_update"),
    ]
