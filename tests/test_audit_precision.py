"""The shadow, the op counter and gradient health wired into the `Auditor`, through the real trainer
on tiny CPU models: the run directory gets shadow.jsonl, opcounts.jsonl and gradhealth.jsonl on the
sampled steps only, the metrics their numbers, and training computes exactly what it computes
without them.

Run: `pytest tests/test_audit_precision.py`.
"""

from __future__ import annotations

import pytest

from trainer.config import TrainConfig
from trainer.train import train
from verlaudit.audit import Auditor, AuditSettings
from verlaudit.rundir import GRADHEALTH, OPCOUNTS, SHADOW, RunWriter, read_records, read_run

BASE = {
    "steps": 3, "device": "cpu", "threads": 1,
    "algo": {"name": "dpo", "batch_size": 4, "mini_batch_size": 4, "micro_batch_size": 2, "lr": 1e-3},
    "data": {"num_examples": 16, "prompt_length": 8, "response_length": 4},
}  # fmt: skip


def run(tmp_path, preset, *, shadow=True, opcount=1, full_steps=1, algo=None, lr=None):
    data = {**BASE, "precision": {"preset": preset}}
    if algo:
        data["algo"] = {**BASE["algo"], "name": algo, "use_kl_in_reward": True}
    if lr:
        data["algo"] = {**data["algo"], "lr": lr}
    settings = AuditSettings(
        level="full", full_steps=full_steps, every=0, shadow=shadow, opcount_steps=opcount
    )
    with RunWriter(tmp_path) as writer, Auditor(writer, settings) as auditor:
        result = train(TrainConfig.from_dict(data), auditor)
    return result, read_run(tmp_path)


def test_records_and_numbers_of_sampled_steps(tmp_path):
    _, rd = run(tmp_path, "bf16")
    shadow = read_records(tmp_path, SHADOW)
    ops = read_records(tmp_path, OPCOUNTS)
    assert {r["step"] for r in shadow} == {0} and {r["step"] for r in ops} == {0}  # sampled: step 0 only
    assert {(r["role"], r["measure"]) for r in shadow} >= {
        ("actor", "local"),
        ("actor", "logprob"),
        ("reference", "chain"),
        ("actor", "param_grad"),
    }
    m0, m1 = rd.metrics[0], rd.metrics[1]
    assert m0["audit/shadow"] == 1.0 and m0["timing_s/shadow"] > 0 and "audit/shadow" not in m1
    assert 0 < m0["shadow/actor/logprob_err/mean"] < 0.05 and m0["shadow/actor/max_ratio"] < 2.0
    # the auditor's own reductions (probe maxima, non-finite checks, the shadow) are not the model's
    assert not [r for r in ops if r["op"] in ("amax", "isnan", "isinf", "frexp", "bincount")]
    assert not [r for r in ops if "fp64" in (r["in"], r["out"])]  # the shadow's error sums (in the hooks)
    assert {r["pass"] for r in ops} >= {"forward", "backward", "optimizer"}
    matmuls = {
        r["in"] for r in ops if r["category"] == "matmul" and r["role"] == "actor" and r["pass"] == "forward"
    }
    assert matmuls == {"bf16"}
    assert [f.kind for f in rd.findings if f.kind.startswith("precision/")] == []  # an honest bf16 run
    lost = [r for r in read_records(tmp_path, GRADHEALTH) if r["measure"] == "update_loss"]
    assert lost and {r["role"] for r in lost} == {"actor"} and all(r["phase"] == "actor_update" for r in lost)


def test_training_is_unchanged_by_the_shadow_and_the_counter(tmp_path):
    with_all, _ = run(tmp_path / "a", "bf16")
    without, _ = run(tmp_path / "b", "bf16", shadow=False, opcount=0)
    keys = ("actor/loss", "actor/grad_norm", "rewards/margins")
    assert [[m[k] for k in keys] for m in with_all.history] == [[m[k] for k in keys] for m in without.history]


def test_fp16_gradient_health_and_ppo_roles(tmp_path):
    _, rd = run(tmp_path, "fp16", algo="ppo", full_steps=1)
    under = [r for r in read_records(tmp_path, GRADHEALTH) if r["measure"] == "fp16_underflow"]
    assert {r["role"] for r in under} == {"actor", "critic"}
    assert all(r["scale"] == 65536.0 and 0 <= r["subnormal_frac"] <= 1 for r in under)
    roles = {r["role"] for r in read_records(tmp_path, SHADOW) if r["measure"] == "local"}
    assert roles == {"actor", "critic", "reference"}  # the rollout is not shadowed


@pytest.mark.parametrize("shadow, opcount", [(False, 0), (True, 0), (False, 1), (False, 2)])
def test_each_part_only_when_asked(tmp_path, shadow, opcount):
    run(tmp_path, "fp32", shadow=shadow, opcount=opcount, full_steps=3)
    assert {r["step"] for r in read_records(tmp_path, SHADOW)} == ({0, 1, 2} if shadow else set())
    assert {r["step"] for r in read_records(tmp_path, OPCOUNTS)} == set(range(opcount))  # the first sampled


def test_lost_updates_named_per_module_at_a_tiny_lr(tmp_path):
    _, rd = run(tmp_path, "bf16-pure", lr=1e-7, shadow=False, opcount=0)
    lost = [r for r in read_records(tmp_path, GRADHEALTH) if r["measure"] == "update_loss"]
    assert min(r["lost_frac"] for r in lost if r["sampled"] > 100) > 0.9  # bf16 masters at lr 1e-7
    assert any(f.kind == "numerics/update_underflow" for f in rd.findings)
