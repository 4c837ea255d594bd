"""Update terms below the storage resolution (verlaudit/audit/update_terms.py): a decoupled weight decay
that rounds back to the same weight, measured on the weights sampled before an audited step and checked
against what a real AdamW step does to them; and the precision a suite key asked for against the dtype the
role's model really has (verlaudit/audit/dtype_checks.py: a loader that ignores the override).

Run: `pytest tests/test_update_terms.py`.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from trainer.config import TrainConfig
from trainer.precision import resolve_policy
from trainer.train import train
from verlaudit import kinds as K
from verlaudit.audit import Auditor, AuditSettings, dtype_checks
from verlaudit.audit import numerics as N
from verlaudit.audit import update_terms as U
from verlaudit.rundir import RunWriter, read_run


def _model(dtype, seed=0):
    torch.manual_seed(seed)
    m = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 8)).to(dtype)
    return m


def _measured_and_real(dtype, lr, wd, opt=torch.optim.AdamW):
    """(the fraction `decay_lost` predicts, the fraction a real step with zero gradients leaves unchanged):
    with a zero gradient Adam's own update is 0, so only the decay acts."""
    m = _model(dtype)
    for p in m.parameters():
        p.grad = torch.zeros_like(p)
    o = opt(m.parameters(), lr=lr, weight_decay=wd, eps=1e-3)  # an eps fp16 holds (1e-8 is 0 there)
    snap = N.snapshot(m.named_parameters())
    got = U.decay_lost(o, m.named_parameters(), snap)
    before = [p.detach().clone() for p in m.parameters()]
    o.step()
    nz = [b != 0 for b in before]
    kept = sum(int(((p.detach() == b) & z).sum()) for p, b, z in zip(m.parameters(), before, nz, strict=True))
    return got, kept / sum(int(z.sum()) for z in nz)


@pytest.mark.parametrize(
    "dtype, lr, wd",
    [
        (torch.bfloat16, 1e-3, 0.01),  # bf16-pure at a usual lr: 1e-5, far below 2^-9
        (torch.bfloat16, 1e-2, 0.05),  # a large lr and decay: 5e-4, still below 2^-9
        (torch.float16, 1e-4, 0.1),  # fp16 weights: 1e-5 below 2^-11
        (torch.bfloat16, 1e-7, 0.01),  # a tiny lr
    ],
)
def test_a_decay_below_half_the_spacing_is_lost_and_the_finding_says_so(dtype, lr, wd):
    got, real = _measured_and_real(dtype, lr, wd)
    assert real > 0.99 and got["fraction"] > 0.99  # the prediction is what the step really did
    [f] = U.decay_findings("actor", got, step=0, phase="actor_update")
    assert f.kind == K.DECAY_ROUNDED_AWAY and f.severity == "warning" and f.where == "algo.weight_decay"
    name = {torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]
    assert name in f.message and "rounds back" in f.message and "fp32 master" in f.fix


@pytest.mark.parametrize(
    "dtype, lr, wd, opt",
    [
        (torch.float32, 1e-3, 0.01, torch.optim.AdamW),  # fp32 weights (master copies) keep the decay
        (torch.bfloat16, 1e-3, 0.0, torch.optim.AdamW),  # no decay
        (torch.bfloat16, 1e-3, 0.01, torch.optim.Adam),  # L2 through the gradient: part of Adam's update
    ],
)
def test_nothing_to_measure_without_a_low_precision_decoupled_decay(dtype, lr, wd, opt):
    got, _ = _measured_and_real(dtype, lr, wd, opt)
    assert got is None


def test_a_decay_above_the_spacing_acts_and_stays_quiet():
    got, real = _measured_and_real(torch.bfloat16, 0.1, 0.1)  # lr x wd = 0.01 > 2^-8: every weight moves
    assert real < 0.01 and got["fraction"] < 0.01
    assert U.decay_findings("actor", got, step=0, phase=None) == []


DPO = {
    "steps": 1, "device": "cpu",
    "algo": {"name": "dpo", "lr": 1e-3, "weight_decay": 0.01, "batch_size": 2, "mini_batch_size": 2,
             "micro_batch_size": 2},
    "data": {"num_examples": 8, "prompt_length": 8, "response_length": 4},
}  # fmt: skip


def _run(preset, run_dir):
    with (
        RunWriter(run_dir) as writer,
        Auditor(writer, AuditSettings(level="boundary", full_steps=1, every=0)) as a,
    ):
        train(TrainConfig.from_dict({**DPO, "precision": {"preset": preset}}), a)
    return a, read_run(run_dir)


def test_the_real_trainer_bf16_pure_loses_its_decay_and_fp32_master_does_not(tmp_path):
    pure, run = _run("bf16-pure", tmp_path / "pure")
    [f] = pure.findings.find(K.DECAY_ROUNDED_AWAY)
    assert (f.role, f.step, f.observed["dtype"]) == ("actor", 0, "bf16") and f.observed["fraction"] > 0.9
    [(step, lost)] = run.series("numerics/actor/decay_lost_frac")
    assert step == 0 and lost > 0.9
    master, _ = _run("bf16", tmp_path / "master")
    assert master.findings.find(K.DECAY_ROUNDED_AWAY) == []


# ---------------------------------------------------------------- precision asked for vs realised
@pytest.mark.parametrize(
    "preset, role, asked, built, severity",
    [
        ("fp32", "reward", "fp16", torch.float32, "warning"),  # a loader that ignores the reward override
        (
            "bf16",
            "reward",
            "fp32",
            torch.bfloat16,
            "error",
        ),  # from_pretrained(torch_dtype=bf16) over an fp32 ask
        ("fp32", "reference", "bf16", torch.float32, "warning"),  # a reference the setup kept in fp32
        ("bf16", "critic", "fp32", torch.bfloat16, "error"),  # a critic loader returning bf16 weights
    ],
)
def test_an_override_the_model_does_not_have_is_a_finding_naming_the_key(
    preset, role, asked, built, severity
):
    policy = resolve_policy(preset, {role: {"param_dtype": asked}})[role]
    [f] = dtype_checks.check_param_storage(role, _model(built), policy)
    assert f.kind == K.PRECISION_NOT_REALISED and f.severity == severity
    assert f.where == f"precision.overrides.{role}.param_dtype" and f"{asked} was asked for" in f.message
    assert "loader" in f.message and "cast" in f.fix and "drop the override" in f.fix


def test_an_override_the_model_has_and_a_preset_default_stay_as_they_were():
    policy = resolve_policy("fp32", {"reward": {"param_dtype": "fp16"}})["reward"]
    assert dtype_checks.check_param_storage("reward", _model(torch.float16), policy) == []
    # no override: a frozen role kept wider than the preset's bf16 is information, as before
    [f] = dtype_checks.check_param_storage("reward", _model(torch.float32), resolve_policy("bf16")["reward"])
    assert f.kind == K.PARAM_STORAGE and f.severity == "info"


# ---------------------------------------------------------------- diagnose: the key comes before what it explains
def _diagnosed(findings, **kw):
    from tests.test_setup_cause import run_dir
    from verlaudit.analysis.diagnose.diagnosis import diagnose_run

    return diagnose_run(run_dir(findings, **kw))


def test_an_override_the_loader_ignored_heads_the_kl_and_reward_symptoms():
    from verlaudit.rundir import Finding

    policy = resolve_policy("fp32", {"reward": {"param_dtype": "fp16"}})["reward"]
    [asked] = dtype_checks.check_param_storage("reward", _model(torch.float32), policy)
    kl = Finding(severity="warning", kind=K.KL_DOMINATES, role="actor", where="algo.kl_coef", step=2,
                 phase="reward", message="the KL penalty is 58x the task score's spread", fix="lower algo.kl_coef")  # fmt: skip
    d = _diagnosed([kl, asked])
    assert d.causes[0].where == "precision.overrides.reward.param_dtype", [c.title[:80] for c in d.causes]
    assert any(c.consequence_of == d.causes[0].title for c in d.causes)
    assert "loader" in d.causes[0].fixes[0].why


def test_an_actor_compute_override_below_the_rollout_is_the_root_of_the_rollout_dtype_finding():
    from verlaudit.rundir import Finding

    boundary = Finding(severity="warning", kind=K.ROLLOUT_DTYPE, role="rollout", where="rollout:hf-generate", step=0,
                       phase="rollout", message="hf-generate samples in fp32 while the actor trains in bf16",
                       fix="set precision.overrides.rollout.compute_dtype: bf16")  # fmt: skip
    d = _diagnosed([boundary], preset="fp32", overrides={"actor": {"compute_dtype": "bf16"}})
    first = d.causes[0]
    assert (
        first.where == "precision.overrides.actor.compute_dtype"
        and "rollout engine samples in fp32" in first.title
    )
    assert first.fixes[0].suite == "precision.overrides.actor.compute_dtype: fp32"
    assert any(c.consequence_of == first.title for c in d.causes)
