"""A legal key that makes the step vanish or lose its anchor (verlaudit/audit/update_effect.py
``dynamics/null_update`` judged against what Adam's step at that lr is, ``dynamics/preference_flat``; the
trainer's ``<role>/weight_rms``, ``dpo/logratio_abs`` and ``dpo/beta_margin_abs``): members of each family on
PPO / GRPO / DPO, the correct neighbours that stay quiet, and the metrics hand-worked on a real DPO run."""

from __future__ import annotations

import math

import pytest
import torch

from trainer.config import TrainConfig
from trainer.train import train
from trainer.update_stats import update_size, weight_sample
from verlaudit import kinds as K
from verlaudit.audit.dynamics import DynamicsWatch

PPO = {"name": "ppo", "batch_size": 8, "mini_batch_size": 8, "ppo_epochs": 1, "max_grad_norm": 1.0}
GRPO = {"name": "grpo", "batch_size": 4, "group_size": 4, "mini_batch_size": 16, "max_grad_norm": 1.0}
DPO = {"name": "dpo", "batch_size": 8, "mini_batch_size": 8, "beta": 0.1, "dpo_loss": "sigmoid"}


def _run(algo, *steps):
    w = DynamicsWatch(algo)
    return [f for i, m in enumerate(steps) for f in w.step_end(m, step=i)]


def _of(found, kind):
    return [f for f in found if f.kind == kind]


# ---------------------------------------------------------------- a learning rate that leaves the weights


def _adam(lr, rms=0.02, steps=1, **more):
    """A step's metrics as Adam at ``lr`` moves weights of rms ``rms``: ~lr per element per optimizer step."""
    return {"update_rel": lr * steps / rms, "lr": lr, "weight_rms": rms, "grad_norm": 0.7, **more}


@pytest.mark.parametrize(
    ("algo", "role", "key", "lr", "rms"),
    [
        ({**GRPO, "lr": 1e-8}, "actor", "lr", 1e-8, 0.02),  # 5e-7 of the weights a step: above 1e-7, null
        ({**PPO, "critic_lr": 3e-8}, "critic", "critic_lr", 3e-8, 0.05),  # PPO's critic
        ({**DPO, "lr": 2e-8}, "actor", "lr", 2e-8, 0.01),  # DPO on small weights
        ({**GRPO, "lr": 5e-8, "mini_batch_size": 4}, "actor", "lr", 5e-8, 0.03),  # 4 optimizer steps a batch
    ],
)
def test_a_learning_rate_whose_adam_steps_are_null_is_named_with_its_key(algo, role, key, lr, rms):
    n = (
        -(-algo["batch_size"] * algo.get("group_size", 1) // algo["mini_batch_size"])
        if algo["name"] == "grpo"
        else 1
    )
    steps = [{f"{role}/{k}": v for k, v in _adam(lr, rms, n).items()} for _ in range(3)]
    if role == "critic":
        steps = [{**m, "actor/update_rel": 0.01, "actor/lr": 1e-3} for m in steps]
    (f,) = _of(_run(algo, *steps), K.NULL_UPDATE)
    assert f.where == f"algo.{key}" and f.role == role and f.severity == "warning"
    assert f"algo.{key}: 1e-0" in f.fix and "rms(w)" in f.message


def test_a_learning_rate_in_common_use_or_a_step_beyond_what_the_lr_asks_is_quiet():
    # verl's default lr 1e-6 (7B weights, rms 0.02): 5e-5 a step
    assert (
        _of(
            _run({**GRPO, "lr": 1e-6}, *[{f"actor/{k}": v for k, v in _adam(1e-6).items()}] * 3),
            K.NULL_UPDATE,
        )
        == []
    )
    # the blind controls, lr 1e-3
    assert (
        _of(_run({**GRPO, "lr": 1e-3}, *[{"actor/update_rel": 0.02, "actor/lr": 1e-3}] * 3), K.NULL_UPDATE)
        == []
    )
    # a low lr key whose weights still move 100x Adam's step at it (another optimizer's doing): not the key
    big = {"actor/update_rel": 5e-6, "actor/lr": 1e-9, "actor/weight_rms": 0.02, "actor/grad_norm": 1.0}
    assert _of(_run({**GRPO, "lr": 1e-9}, *[big] * 3), K.NULL_UPDATE) == []
    # no gradient at all: the loss's question
    zero = {"actor/update_rel": 0.0, "actor/lr": 1e-8, "actor/weight_rms": 0.02, "actor/grad_norm": 0.0}
    assert _of(_run({**GRPO, "lr": 1e-8}, *[zero] * 3), K.NULL_UPDATE) == []


def test_update_size_reports_the_weights_rms_beside_the_relative_step():
    model = torch.nn.Linear(64, 32)
    before = weight_sample(model)
    w = model.weight.detach().clone()
    with torch.no_grad():
        model.weight.add_(1e-8 * torch.sign(torch.randn_like(model.weight)))  # Adam's first step at lr 1e-8
    got = update_size(before)
    rms = float(w.pow(2).mean().sqrt())
    assert got["weight_rms"] == pytest.approx(rms, rel=1e-6)
    moved = float((model.weight.detach() - w).norm() / w.norm())  # fp32 rounds each 1e-8 to its spacing
    assert got["update_rel"] == pytest.approx(moved, rel=1e-5)
    assert 0.5 < got["update_rel"] * rms / 1e-8 < 1.5  # ~lr / rms(w): what the null-update check compares


# ---------------------------------------------------------------- a preference loss held at log 2


def _flat(beta, drift, margin_nats, loss=None, n=3):
    """Steps of a DPO run whose log-ratios grow to ``drift`` nats with a margin of ``margin_nats``."""
    out = []
    for i in range(n):
        d, h = drift * i / (n - 1), margin_nats * i / (n - 1)
        x = beta * h
        out.append({"dpo/logratio_abs": d, "dpo/beta_margin_abs": x,
                    "actor/loss": math.log1p(math.exp(-x)) if loss is None else loss})  # fmt: skip
    return out


@pytest.mark.parametrize(
    ("algo", "drift", "margin"),
    [
        ({**DPO, "beta": 1e-4}, 0.6, 0.3),  # sigmoid, fp16-like numbers
        ({**DPO, "beta": 1e-5, "dpo_loss": "robust", "label_smoothing": 0.1}, 2.0, 1.5),
        ({**DPO, "beta": 5e-4, "dpo_loss": "hinge"}, 0.4, 0.8),
        ({**DPO, "beta": 2e-4, "label_smoothing": 0.2}, 1.0, 0.5),  # cDPO
    ],
)
def test_a_beta_that_keeps_the_loss_at_its_zero_margin_value_is_named(algo, drift, margin):
    (f,) = _of(_run(algo, *_flat(algo["beta"], drift, margin)), K.PREFERENCE_FLAT)
    assert f.where == "algo.beta" and f.severity == "warning" and f.fix.startswith("set algo.beta: 0.1")
    assert f.observed["margin_nats"] == pytest.approx(margin, rel=1e-6)


def test_a_moving_dpo_identical_pairs_a_still_policy_and_other_losses_are_quiet():
    # the control: beta 0.1, margins of 0.3-3 nats from the second step: beta x margin 0.03-0.3
    assert _of(_run(DPO, *_flat(0.1, 1.0, 3.0)), K.PREFERENCE_FLAT) == []
    # a small beta while the policy has not moved (lr too small): the lr's question, not beta's
    assert _of(_run({**DPO, "beta": 1e-4}, *_flat(1e-4, 1e-3, 1e-3)), K.PREFERENCE_FLAT) == []
    # pairs that do not separate (identical sides): the margin stays 0 whatever beta is
    assert _of(_run({**DPO, "beta": 1e-4}, *_flat(1e-4, 1.0, 1e-4)), K.PREFERENCE_FLAT) == []
    # IPO reads beta as its tau (config_pairs' question); one step is not a run
    assert (
        _of(_run({**DPO, "beta": 1e-4, "dpo_loss": "ipo"}, *_flat(1e-4, 1.0, 1.0)), K.PREFERENCE_FLAT) == []
    )
    assert _of(_run({**DPO, "beta": 1e-4}, *_flat(1e-4, 1.0, 1.0, n=2)), K.PREFERENCE_FLAT) == []
    # GRPO never
    assert _of(_run(GRPO, *_flat(1e-4, 1.0, 1.0)), K.PREFERENCE_FLAT) == []


def _dpo_run(beta, steps=3):
    cfg = {
        "algo": {
            **DPO,
            "beta": beta,
            "lr": 1e-3,
            "batch_size": 4,
            "mini_batch_size": 4,
            "micro_batch_size": 4,
        },
        "data": {"prompt_length": 12, "response_length": 4, "num_examples": 64},
        "precision": {"preset": "fp32"},
        "steps": steps,
        "device": "cpu",
        "seed": 0,
    }
    return train(TrainConfig.from_dict(cfg)).history


def test_the_dpo_metrics_on_a_real_run_beta_flat_and_beta_usual():
    flat, usual = _dpo_run(1e-4), _dpo_run(0.1)
    for hist in (flat, usual):
        assert hist[0]["dpo/logratio_abs"] == pytest.approx(
            0.0, abs=1e-5
        )  # step 0: the policy is the reference
        assert hist[-1]["dpo/logratio_abs"] > 0.05  # lr 1e-3 moves it
    assert max(m["dpo/beta_margin_abs"] for m in flat) < 1e-3
    assert usual[-1]["dpo/beta_margin_abs"] > 1e-3
    w = DynamicsWatch({**DPO, "beta": 1e-4})
    assert _of([f for i, m in enumerate(flat) for f in w.step_end(m, step=i)], K.PREFERENCE_FLAT)
    w = DynamicsWatch(DPO)
    assert not _of([f for i, m in enumerate(usual) for f in w.step_end(m, step=i)], K.PREFERENCE_FLAT)
