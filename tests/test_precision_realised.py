"""Precision asked for vs precision that happened (prec13, `verlaudit.audit.precision_realised`): optimizer
moments and gradients in another dtype than their key says, a role computing below the preset (measured),
and many micro-batch gradients summed into a bf16 .grad (measured against an fp32 sum). Each planted case
fires, and its correct neighbour stays clean. Run: `pytest tests/test_precision_realised.py`."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from trainer.config import TrainConfig
from trainer.precision import resolve_policy
from trainer.train import train
from verlaudit import kinds as K
from verlaudit.audit import Auditor, AuditSettings
from verlaudit.audit import precision_realised as pr

DATA = {"num_examples": 16, "prompt_length": 8, "response_length": 4}
ALGOS = {
    "ppo": {"name": "ppo", "batch_size": 4, "mini_batch_size": 4, "micro_batch_size": 2},
    "grpo": {"name": "grpo", "batch_size": 2, "group_size": 2, "mini_batch_size": 4, "micro_batch_size": 2},
    "dpo": {"name": "dpo", "batch_size": 4, "mini_batch_size": 4, "micro_batch_size": 2},
}


def _run(algo, preset, overrides=None, *, steps=1, **algo_keys):
    cfg = {
        "steps": steps,
        "device": "cpu",
        "threads": 1,
        "algo": {**ALGOS[algo], **algo_keys},
        "data": DATA,
        "precision": {"preset": preset, **({"overrides": overrides} if overrides else {})},
    }
    a = Auditor(settings=AuditSettings(level="full", full_steps=steps, every=0))
    with a:
        train(TrainConfig.from_dict(cfg), a)
    assert a.failure is None, a.failure
    return a.findings.all()


def _kinds(found, kind):
    return [f for f in found if f.kind == kind]


# -- optimizer state and gradients: requested vs realised --------------------------------------------------


@pytest.mark.parametrize(
    "algo, preset, role",
    [
        ("grpo", "bf16", "actor"),
        ("ppo", "fp32", "critic"),
        ("dpo", "fp16", "actor"),
        ("ppo", "bf16", "actor"),
    ],
)
def test_an_optim_state_override_the_optimizer_ignores_is_named(algo, preset, role):
    found = _run(algo, preset, {role: {"optim_state_dtype": "bf16"}})
    hits = [f for f in _kinds(found, K.PRECISION_NOT_REALISED) if f.role == role]
    assert hits, [f.kind for f in found]
    f = hits[0]
    assert f.where == f"precision.overrides.{role}.optim_state_dtype"
    assert f.observed == {"fp32": f.observed["fp32"]} and f.expected == "bf16"
    assert "exp_avg" in f.message and "optim_state_dtype" in f.fix and f.severity == "warning"


@pytest.mark.parametrize("algo, preset", [("grpo", "bf16"), ("ppo", "fp32"), ("dpo", "bf16-pure")])
def test_optimizer_state_as_the_preset_says_is_clean(algo, preset):
    found = _run(algo, preset)
    assert not _kinds(found, K.PRECISION_NOT_REALISED)


def test_an_optim_state_override_that_matches_the_parameters_is_clean():
    # bf16 parameters keep bf16 moments: the key says what happens
    found = _run("grpo", "bf16", {"actor": {"param_dtype": "bf16", "optim_state_dtype": "bf16"}})
    assert not _kinds(found, K.PRECISION_NOT_REALISED)


def test_a_grad_dtype_override_the_gradients_do_not_follow_is_named():
    found = _run("ppo", "bf16", {"critic": {"grad_dtype": "bf16"}})
    hits = [f for f in _kinds(found, K.PRECISION_NOT_REALISED) if f.where.endswith("grad_dtype")]
    assert hits and hits[0].role == "critic" and hits[0].observed == "fp32"
    assert not _kinds(found, K.GRAD)  # one finding, the key's, not the generic .grad error too


def test_the_optim_state_reader_on_objects():
    p = nn.Parameter(torch.zeros(3, 2))
    opt = torch.optim.SGD([p], lr=0.1, momentum=0.9)
    p.grad = torch.ones_like(p)
    opt.step()
    pol = resolve_policy("bf16", {"actor": {"optim_state_dtype": "bf16"}})["actor"]
    (f,) = pr.optim_state_findings("actor", opt, pol)
    assert "momentum_buffer" in f.message and f.observed == {"fp32": 1}
    assert pr.optim_state_findings("actor", opt, resolve_policy("bf16")["actor"]) == []
    assert pr.optim_state_findings("actor", object(), pol) == []  # no state to read: nothing said


# -- a role computing below the preset, measured ------------------------------------------------------------


@pytest.mark.parametrize(
    "algo, role, keys",
    [
        ("ppo", "critic", {}),
        ("grpo", "reference", {"use_kl_loss": True}),
        ("dpo", "actor", {}),
    ],
)
def test_a_role_computing_below_the_preset_is_measured(algo, role, keys):
    found = _run(algo, "fp32", {role: {"compute_dtype": "bf16"}}, **keys)
    hits = [f for f in _kinds(found, K.COMPUTE_BELOW_CONTRACT) if f.role == role]
    assert hits, [f.kind for f in found]
    f = hits[0]
    assert f.where == f"precision.overrides.{role}.compute_dtype" and f.severity == "warning"
    assert 1e-5 < f.observed["relative_difference"] < 0.2
    assert "%" in f.message and "compute_dtype" in f.fix


@pytest.mark.parametrize(
    "preset, overrides",
    [
        ("fp32", None),
        ("bf16", {"critic": {"compute_dtype": "bf16"}}),
        ("bf16", {"critic": {"compute_dtype": "fp32"}}),
    ],
)
def test_compute_at_or_above_the_preset_is_clean(preset, overrides):
    found = _run("ppo", preset, overrides)
    assert not _kinds(found, K.COMPUTE_BELOW_CONTRACT)


# -- gradients accumulated in a bf16 .grad -------------------------------------------------------------------


def _accumulate(n, dtype, *, seed=0, spread=1.0):
    """n micro-batch gradients through the real hook path of a one-parameter model."""
    torch.manual_seed(seed)
    model = nn.Linear(64, 64, bias=False).to(dtype)
    pol = resolve_policy("bf16-pure")["actor"] if dtype == torch.bfloat16 else resolve_policy("fp32")["actor"]
    w = pr.AccumWatch()
    w.arm("actor", model, pol)
    for i in range(n):
        x = (torch.randn(2, 64) * (1 + spread * i / n)).to(dtype)
        model(x).float().pow(2).sum().div(n).backward()
        w.backward("actor", model)
    cfg = {"algo": {"micro_batch_size": 1, "mini_batch_size": n}, "precision": {"preset": "bf16-pure"}}
    out = w.step("actor", pol, cfg, step=0, phase="update")
    w.disarm()
    return out


@pytest.mark.parametrize("n, seed", [(64, 0), (128, 1), (96, 2)])
def test_many_bf16_additions_into_one_grad_are_measured(n, seed):
    (f,) = _accumulate(n, torch.bfloat16, seed=seed)
    assert f.kind == K.GRAD_ACCUMULATION_ROUNDING and f.observed["micro_batches"] == n
    assert f.observed["relative_error"] > pr.ROUNDINGS * f.observed["one_rounding"]
    assert "micro_batch_size" in f.fix and "bf16" in f.message


@pytest.mark.parametrize("n, dtype", [(2, torch.bfloat16), (64, torch.float32), (3, torch.bfloat16)])
def test_few_additions_or_fp32_gradients_are_clean(n, dtype):
    assert _accumulate(n, dtype) == []


def test_a_bf16_pure_run_with_micro_batch_1_is_named_and_its_neighbour_is_not():
    hot = _run("grpo", "bf16-pure", batch_size=8, group_size=4, mini_batch_size=32, micro_batch_size=1)
    cold = _run("grpo", "bf16-pure", batch_size=8, group_size=4, mini_batch_size=32, micro_batch_size=16)
    assert _kinds(hot, K.GRAD_ACCUMULATION_ROUNDING), [f.kind for f in hot]
    assert not _kinds(cold, K.GRAD_ACCUMULATION_ROUNDING)


@pytest.mark.parametrize("algo, roles", [("ppo", {"actor", "critic"}), ("dpo", {"actor"})])
def test_micro_batch_1_accumulation_in_ppo_and_dpo_names_each_trained_role(algo, roles):
    found = _run(algo, "bf16-pure", batch_size=32, mini_batch_size=32, micro_batch_size=1)
    hits = _kinds(found, K.GRAD_ACCUMULATION_ROUNDING)
    assert {f.role for f in hits} == roles, [(f.kind, f.role) for f in found]
    assert all(f.observed["micro_batches"] == 32 for f in hits)
