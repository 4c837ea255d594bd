"""Gradient hooks a setup registered on parameters (trainer/setup_grad_hooks.py, recorded by
trainer.models.apply_setup; verlaudit/audit/grad_hooks.py: ``setup/grad_hooks``): the probe's gradient with
and without the hooks, at the loss scale the role's backward runs at. Members: an element-wise clamp under
fp16 (the hooks see the scaled gradient), a sign() hook, a x0.01 scale on the head, a clamp under bf16 that
still binds; neighbours: a hook that only observes, a clamp too wide to bind, a setup with no hook."""

from __future__ import annotations

import pytest
import torch

from tests.test_setup_cause import run_dir
from tests.test_setup_effect import Tok, lm
from trainer.config import ModelConfig
from trainer.models import apply_setup
from trainer.precision import TRAINABLE_ROLES, resolve_policy
from verlaudit import kinds as K
from verlaudit.analysis.diagnose.diagnosis import diagnose_run
from verlaudit.audit import setup_changes

SEEN = []


def clamp_tight(model, role, tok):
    for p in model.parameters():
        if p.requires_grad:
            p.register_hook(lambda g: g.clamp(-1e-3, 1e-3))


def clamp_bf16(model, role, tok):
    for p in model.parameters():
        p.register_hook(lambda g: g.clamp(-1e-6, 1e-6))


def sign_hooks(model, role, tok):
    for p in model.parameters():
        p.register_hook(lambda g: torch.sign(g) * 1e-4)


def head_scaled(model, role, tok):
    model.lm_head.weight.register_hook(lambda g: g * 0.01)


def observe_grads(model, role, tok):
    for p in model.parameters():
        p.register_hook(lambda g: SEEN.append(float(g.abs().max())))


def clamp_wide(model, role, tok):
    for p in model.parameters():
        p.register_hook(lambda g: g.clamp(-1e6, 1e6))


def nothing(model, role, tok):
    model.config.use_cache = False


def _findings(fn, preset):
    models = {"actor": lm()}
    out = apply_setup(models, ModelConfig(setup=f"tests.test_setup_grad_hooks:{fn.__name__}"), Tok())
    fs = setup_changes.findings({}, out, resolve_policy(preset), {"vocab_size": 100}, TRAINABLE_ROLES)
    return [f for f in fs if f.kind == K.SETUP_GRAD_HOOKS]


@pytest.mark.parametrize(
    ("fn", "preset", "severity", "words"),
    [
        (clamp_tight, "fp16", "error", ("a clamp", "x 65536", "before the GradScaler's unscale_", "sign(g)")),
        (clamp_bf16, "bf16", "error", ("a clamp", "(1)")),
        (sign_hooks, "fp32", "error", ("sign(g)",)),
        (head_scaled, "fp32", "warning", ("x 0.01", "lm_head.weight")),
    ],
)
def test_hooks_that_rewrite_the_gradient_are_named_with_the_setup_and_the_hook_line(
    fn, preset, severity, words
):
    (f,) = _findings(fn, preset)
    assert f.severity == severity and fn.__name__ in f.where, (f.severity, f.message)
    assert all(w in f.message for w in words), f.message
    assert "test_setup_grad_hooks.py:" in f.message  # the hook's own file:line
    assert f.fix.startswith("remove the gradient hooks") and "max_grad_norm" in f.fix


def test_the_fp16_clamp_binds_because_of_the_loss_scale():
    (f,) = _findings(clamp_tight, "fp16")
    by = f.observed["by_scale"]
    assert by["65536"]["changed"] > 0.5 > by["1"]["changed"]  # the same hook, unscaled, clamps few elements
    (g,) = _findings(clamp_tight, "fp32")
    assert g.severity != "error"  # without loss scaling the clamp at 1e-3 is not the update's sign


@pytest.mark.parametrize("fn", [observe_grads, clamp_wide])
def test_hooks_that_leave_the_gradient_alone_are_information(fn):
    for preset in ("fp32", "fp16", "bf16"):
        assert [f.severity for f in _findings(fn, preset)] == ["info"]


def test_no_hook_no_finding_and_the_probe_leaves_no_gradient_behind():
    assert _findings(nothing, "fp16") == []
    models = {"actor": lm()}
    out = apply_setup(models, ModelConfig(setup="tests.test_setup_grad_hooks:clamp_tight"), Tok())
    assert all(p.grad is None for p in out["actor"].parameters())


def test_the_hooks_head_the_diagnosis_as_a_setup_root():
    fs = _findings(clamp_tight, "fp16")
    d = diagnose_run(run_dir(fs, preset="fp16", algo="dpo"))
    assert d.causes and d.causes[0].kind == f"finding:{K.SETUP_GRAD_HOOKS}"
    assert "clamp_tight" in (d.causes[0].where or "")
