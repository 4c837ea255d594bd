"""The contract against what ran (verlaudit/audit/contract.py): an fp32 role whose matmuls ran in bf16
under an autocast entered by user code (a ``model.setup`` that wraps the forward) is a finding naming the
role, the pass and the share of ops; clean fp32 / fp16 / bf16 runs, with their intended fp32 islands, have
none. Plus the pure check on hand-made op-count records.

Run: `pytest tests/test_audit_contract.py`.
"""

from __future__ import annotations

import json

import pytest

from trainer.config import TrainConfig
from trainer.precision import resolve_policy
from trainer.train import train
from verlaudit import kinds as K
from verlaudit.audit import Auditor, AuditSettings, contract

TINY = {
    "steps": 1, "device": "cpu", "threads": 1,
    "algo": {"name": "ppo", "batch_size": 2, "mini_batch_size": 2, "micro_batch_size": 2},
    "data": {"num_examples": 16, "prompt_length": 8, "response_length": 4},
}  # fmt: skip

AUTOCAST_SETUP = '''
import torch


def bf16_forward(model, role, tokenizer):
    """Wraps the forward in a bf16 autocast (as a library's "fast path" might)."""
    inner = model.forward

    def forward(*args, **kwargs):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return inner(*args, **kwargs)

    model.forward = forward
'''


def audited(extra):
    data = json.loads(json.dumps(TINY))
    for k, v in extra.items():
        data[k] = {**data.get(k, {}), **v} if isinstance(v, dict) else v
    a = Auditor(settings=AuditSettings(level="full", full_steps=1, every=0))
    with a:
        train(TrainConfig.from_dict(data), a)
    return a


def test_fp32_actor_under_a_user_bf16_autocast(tmp_path):
    (tmp_path / "s.py").write_text(AUTOCAST_SETUP)
    a = audited(
        {"model": {"setup": {"actor": f"{tmp_path}/s.py:bf16_forward"}}, "precision": {"preset": "fp32"}}
    )
    found = a.findings.find(K.CONTRACT_COMPUTE)
    assert found and {f.role for f in found} == {"actor"}, [
        (f.kind, f.role, f.where) for f in a.findings.all()
    ]
    fwd = next(f for f in found if f.observed["pass"] == "forward")
    assert fwd.severity == "error" and fwd.expected == "fp32" and fwd.observed["share"] > 0.9
    assert "bf16" in fwd.message and fwd.where not in (None, "(model)") and "torch.autocast(bf16)" in fwd.fix


@pytest.mark.parametrize("preset", ["fp32", "fp16", "bf16", "bf16-pure"])
@pytest.mark.parametrize("algo", ["ppo", "dpo"])
def test_clean_runs_keep_their_contract(algo, preset):
    a = audited({"algo": {"name": algo}, "precision": {"preset": preset}})
    assert a.findings.find(K.CONTRACT_COMPUTE) == []


def rec(role, pas, out, n, module="model.layers.0.mlp.up_proj", category="matmul"):
    return {"role": role, "module": module, "pass": pas, "category": category, "in": out, "out": out,
            "count": n, "phase": "actor_update", "kind": "linear", "op": "mm", "step": 0}  # fmt: skip


def test_pure_check_shares_and_islands():
    policy = resolve_policy("bf16")
    ok = [rec("actor", "forward", "bf16", 50), rec("actor", "forward", "fp32", 1, module="lm_head"),
          rec(None, "forward", "fp32", 9), rec("actor", "forward", "fp32", 30, category="softmax")]  # fmt: skip
    assert contract.findings(ok, policy, step=0) == []  # a head kept fp32; islands and ops outside models
    bad = [
        rec("actor", "backward", "bf16", 10),
        rec("actor", "backward", "fp32", 30, module="model.layers.1"),
    ]
    (f,) = contract.findings(bad, policy, step=0)
    assert (f.severity, f.where, f.observed["share"], f.expected) == ("error", "model.layers.1", 0.75, "bf16")
    assert "model.setup" in f.fix
