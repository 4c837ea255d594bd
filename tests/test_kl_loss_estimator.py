"""A KL loss whose estimator has no expected gradient (`verlaudit.audit.config_pairs.k1_kl_loss`,
``config/kl_loss_no_gradient``): k1 (``kl_loss_type: kl`` / ``k1``) as the actor's KL loss is named with the
key and the fix (k3 / low_var_kl), as a cause by construction; the estimators that carry the KL's gradient,
the KL in the reward, a KL loss that is off or at coefficient 0, and DPO stay quiet. The claim itself is
checked on an exact categorical policy."""

from __future__ import annotations

import pytest
import torch

from tests.test_config_pairs import _config, _found, _run
from trainer.losses import kl_penalty
from verlaudit import kinds as K
from verlaudit.analysis.diagnose import pair_cause as PC
from verlaudit.analysis.diagnose.diagnosis import diagnose_run


@pytest.mark.parametrize(
    ("algo", "preset"),
    [
        ({"name": "grpo", "use_kl_loss": True, "kl_loss_coef": 0.001, "kl_loss_type": "k1"}, "fp32"),
        (
            {
                "name": "ppo",
                "use_kl_in_reward": False,
                "use_kl_loss": True,
                "kl_loss_coef": 0.05,
                "kl_loss_type": "kl",
            },
            "fp16",
        ),  # fmt: skip
        ({"name": "grpo", "use_kl_loss": True, "kl_loss_coef": 1.0, "kl_loss_type": "kl"}, "bf16-pure"),
    ],
)
def test_k1_as_the_kl_loss_is_a_cause_naming_the_key_and_the_estimator(algo, preset):
    tc = _config(algo, preset=preset)
    found = [f for f in _found(tc) if f.kind == K.CONFIG_KL_LOSS_NO_GRADIENT]
    assert len(found) == 1 and found[0].where == "algo.kl_loss_type" and found[0].severity == "info"
    assert "k1" in found[0].message and "expectation" in found[0].message
    causes = [c for c in PC.combo_causes(_run(tc, found)) if c.where == "algo.kl_loss_type"]
    assert causes and causes[0].severity == "warning"
    assert causes[0].fixes[0].suite == "algo.kl_loss_type: low_var_kl"
    assert "kl_loss_type=low_var_kl" in (causes[0].fixes[0].verl or "")
    top = diagnose_run(_run(tc, found, [{"actor/kl_loss": 1e-3}, {"actor/kl_loss": -2e-3}])).causes[0]
    assert top.where == "algo.kl_loss_type"


@pytest.mark.parametrize(
    "algo",
    [
        {"name": "grpo", "use_kl_loss": True, "kl_loss_coef": 0.01, "kl_loss_type": "low_var_kl"},
        {"name": "grpo", "use_kl_loss": True, "kl_loss_coef": 0.01, "kl_loss_type": "mse"},
        {"name": "grpo", "use_kl_loss": True, "kl_loss_coef": 0.01, "kl_loss_type": "k1+"},  # k2's gradient
        {"name": "grpo", "use_kl_loss": True, "kl_loss_coef": 0.0, "kl_loss_type": "kl"},
        {"name": "ppo", "use_kl_in_reward": True, "kl_coef": 0.05, "kl_penalty": "kl"},  # a value, not a loss
    ],
)
def test_estimators_with_the_kls_gradient_and_k1_in_the_reward_are_quiet(algo):
    assert [f for f in _found(_config(algo)) if f.kind == K.CONFIG_KL_LOSS_NO_GRADIENT] == []


def _expected_grad(estimator: str, logits: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """d/dlogits of E_{y ~ pi}[estimator(y)] with the samples' law held fixed (what a loss on sampled
    tokens differentiates): sum_y pi(y).detach() * grad est(y)."""
    theta = logits.clone().requires_grad_(True)
    logp = torch.log_softmax(theta, -1)
    est = kl_penalty(logp, torch.log_softmax(ref, -1), estimator)
    (torch.softmax(logits, -1).detach() * est).sum().backward()
    return theta.grad


def test_the_claim_k1s_expected_gradient_is_zero_and_k3s_is_the_kls():
    g = torch.Generator().manual_seed(0)
    logits, ref = (
        torch.randn(12, generator=g, dtype=torch.float64),
        torch.randn(12, generator=g, dtype=torch.float64),
    )
    theta = logits.clone().requires_grad_(True)
    p = torch.softmax(theta, -1)
    (p * (torch.log(p) - torch.log_softmax(ref, -1))).sum().backward()  # the true KL(pi || ref)
    true = theta.grad
    assert _expected_grad("kl", logits, ref).abs().max() < 1e-12 < true.abs().max()
    for est in ("low_var_kl", "mse"):
        got = _expected_grad(est, logits, ref)
        cos = torch.nn.functional.cosine_similarity(got, true, dim=0)
        assert cos > 0.5  # k2 / k3 pull towards the reference
