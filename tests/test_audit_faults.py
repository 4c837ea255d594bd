"""Planted faults through the real trainer on tiny CPU models, each caught with the right culprit,
and clean runs of every preset x algorithm with no error-level finding.

Run: `pytest tests/test_audit_faults.py` (about a minute on 2 cores).
"""

from __future__ import annotations

import copy

import pytest

from trainer.config import TrainConfig
from trainer.events import Fanout
from trainer.train import train
from verlaudit.audit import Auditor, AuditSettings
from verlaudit.audit.inject import FaultInjector

BASE = {
    "steps": 2, "device": "cpu",
    # a KL penalty in the reward, so the frozen reference runs too (verl's defaults build none)
    "algo": {"name": "ppo", "batch_size": 2, "mini_batch_size": 2, "micro_batch_size": 1, "group_size": 2,
             "use_kl_in_reward": True},
    "data": {"num_examples": 16, "prompt_length": 8, "response_length": 4},
    "precision": {"preset": "fp32"},
}  # fmt: skip


def run(extra=None, inject=None, level="full"):
    data = copy.deepcopy(BASE)
    for k, v in (extra or {}).items():
        data[k] = {**data.get(k, {}), **v} if isinstance(v, dict) else v
    a = Auditor(settings=AuditSettings(level=level, full_steps=3, every=0))
    observer = Fanout([FaultInjector(inject), a]) if inject else a
    try:
        with a:
            train(TrainConfig.from_dict(data), observer)
    except Exception:
        assert a.failure is not None  # the auditor saw it; it propagated (not swallowed)
    return a


def only(a, kind, role=None):
    found = a.findings.find(kind, role=role)
    assert len(found) == 1, [(f.kind, f.where) for f in a.findings.all()]
    return found[0]


@pytest.mark.parametrize("algo", ["ppo", "grpo", "dpo"])
@pytest.mark.parametrize("preset", ["fp32", "fp16", "bf16", "bf16-pure"])
def test_clean_runs_have_no_error_findings(algo, preset):
    kl = {"use_kl_in_reward": algo != "dpo"}  # DPO's reference enters through its loss
    a = run({"steps": 1, "algo": {"name": algo, **kl}, "precision": {"preset": preset}})
    assert a.failure is None
    assert [(f.kind, f.where) for f in a.findings.all() if f.severity == "error"] == []
    # the reference / critic copies are cast with the rotary buffers kept fp32 (trainer.precision.cast_module)
    assert a.findings.find("dtype/buffer_precision") == []


def test_collator_casting_ids_to_float():
    a = run({"data": {"collator": "tests.faults:float_ids_collator"}})
    f = a.findings.find("boundary/collator_float_ids")
    assert {x.where for x in f} == {
        "collator:tests.faults:float_ids_collator.input_ids",
        "collator:tests.faults:float_ids_collator.attention_mask",
    }
    assert a.failure["reason"] == "dtype_error" and a.failure["where"] == "model.embed_tokens"
    assert only(a, "runtime/dtype_error").expected == "int64"


def test_right_padded_prompts():
    f = only(
        run({"steps": 1, "data": {"collator": "tests.faults:right_padded_collator"}}), "boundary/padding_side"
    )
    assert (f.severity, f.observed, f.expected) == ("error", "right", "left")


@pytest.mark.parametrize("fn", ["float64_reward", "numpy_float64_reward"])
def test_reward_fn_returning_float64(fn):
    f = only(run({"steps": 1, "data": {"reward_fn": f"tests.faults:{fn}"}}), "boundary/reward_dtype")
    assert (
        f.severity == "warning" and f.where == f"reward:function:tests.faults:{fn}" and "fp64" in f.observed
    )


def test_reward_fn_returning_nan():
    f = only(run({"steps": 1, "data": {"reward_fn": "tests.faults:nan_reward"}}), "boundary/reward_nonfinite")
    assert f.severity == "error" and f.observed == "nan"


def test_reward_model_in_the_wrong_dtype():
    f = only(
        run({"steps": 1, "model": {"reward_model": "tests.faults:fp16_reward_model"}}),
        "boundary/reward_model",
    )
    assert (f.role, f.expected, f.severity) == ("reward", "fp32", "error") and "fp16" in f.observed


def test_nan_injected_in_one_layer():
    a = run(inject={"nan_in_module": "model.layers.1.mlp", "at_step": 1, "phase": "actor_update"})
    f = only(a, "numerics/nonfinite_forward")
    assert (f.where, f.role, f.step, f.phase) == ("model.layers.1.mlp", "actor", 1, "actor_update")
    assert (
        only(a, "numerics/skipped_step", role="actor").step == 1
    )  # fp32 without scaler: the guard skipped it


def test_fp16_layer_driven_to_overflow():
    a = run(
        {"precision": {"preset": "fp16"}},
        inject={
            "scale_module_output": {
                "module": "model.layers.0.mlp.down_proj",
                "factor": 1e8,
                "at_step": 1,
                "phase": "actor_update",
            }
        },
    )
    f = only(a, "numerics/overflow")
    assert (f.where, f.observed["value"], f.observed["dtype"]) == (
        "model.layers.0.mlp.down_proj",
        "inf",
        "fp16",
    )
    assert only(a, "numerics/skipped_step", role="actor").observed["mode"] == "dynamic"
    # the scaler skipped that step and the weights stayed finite: fp16 calibration, a warning, not an error
    assert f.severity == "warning" and "handled: the optimizer step was skipped" in f.message
    assert {g.severity for g in a.findings.find("numerics/nonfinite_loss", role="actor")} <= {"warning"}


def test_fp16_overflow_outside_the_scalers_reach_stays_an_error():
    # the same overflow in the frozen reference's forward: no optimizer step of its own can skip it
    a = run(
        {"precision": {"preset": "fp16"}},
        inject={
            "scale_module_output": {
                "module": "model.layers.0.mlp.down_proj",
                "factor": 1e8,
                "at_step": 1,
                "phase": "ref",
                "role": "reference",
            }
        },
    )
    f = only(a, "numerics/overflow", role="reference")
    assert (f.severity, f.phase, f.where) == ("error", "ref", "model.layers.0.mlp.down_proj")
    assert "handled" not in f.message


def test_boundary_level_still_sees_nonfinite_without_module_hooks():
    a = run(
        inject={"nan_in_module": "model.layers.1.mlp", "at_step": 1, "phase": "actor_update"},
        level="boundary",
    )
    assert a.probe is None and a.findings.find("numerics/nonfinite_forward") == []
    assert a.findings.find("numerics/skipped_step")


def test_module_cast_to_another_dtype_is_a_runtime_dtype_error():
    a = run(inject={"cast_module": {"module": "model.layers.0.mlp", "dtype": "bf16"}})
    assert a.failure["reason"] == "dtype_error"
    f = only(a, "runtime/dtype_error")
    assert (f.where, f.observed, f.expected) == ("model.layers.0.mlp.gate_proj", "fp32", "bf16")
    assert only(a, "dtype/module_input").where == "model.layers.0.mlp.gate_proj"
