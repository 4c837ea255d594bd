"""Training dynamics as causes (verlaudit/audit/weights.py `GrowthWatch`) and fixes checked against the run
(verlaudit/analysis/diagnose/fixcheck.py): the planted fault and its clean control for each."""

from __future__ import annotations

import types

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from verlaudit import kinds as K
from verlaudit.analysis.causes import Cause, Fix
from verlaudit.analysis.diagnose import fixcheck
from verlaudit.analysis.diagnose.rules import explains
from verlaudit.audit import weights
from verlaudit.rundir import Finding


def _model():
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=40, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32
    )
    return LlamaForCausalLM(cfg)


def _watched(model):
    watch = weights.GrowthWatch({"actor": 0.2})
    watch.start("actor", model, weights.weight_rms(model.named_parameters()))
    return watch


def test_every_layer_growing_names_the_learning_rate():
    model = _model()
    watch = _watched(model)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.mul_(6.0)
    (f,) = watch.findings("actor", model, weights.weight_rms(model.named_parameters()), step=1, updates=2)
    assert f.kind == K.WEIGHT_GROWTH and K.class_of(f.kind) == "learning_rate"
    assert "algo.lr" in f.fix and f.observed["lr"] == 0.2 and f.observed["median_growth"] > 5
    assert explains("learning_rate", "overflow") and explains("learning_rate", "nonfinite")
    # reported once per role
    assert (
        watch.findings("actor", model, weights.weight_rms(model.named_parameters()), step=10, updates=20)
        == []
    )


def test_one_layer_growing_or_small_updates_are_not_the_learning_rate():
    model = _model()
    watch = _watched(model)
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.weight.mul_(50.0)  # one module: not every layer
        for p in model.parameters():
            if p.dim() >= 2:
                p.add_(torch.randn_like(p) * 0.01)  # an ordinary update
    assert (
        watch.findings("actor", model, weights.weight_rms(model.named_parameters()), step=1, updates=1) == []
    )


def _run(config, findings=()):
    return types.SimpleNamespace(manifest={"config": config}, findings=list(findings))


def _cause(*fixes):
    return Cause("warning", "finding:x", "x", "x", fixes=list(fixes))


def test_a_fix_that_sets_the_value_the_run_has_is_dropped():
    run = _run({"algo": {"temperature": 1.0, "lr": 2e-3}})
    same, other, placeholder = (
        Fix("algo.temperature: 1.0", None, "more diverse"),
        Fix("algo.temperature: 1.2", None, "more diverse"),
        Fix("algo.lr: <half>", None, "smaller steps"),
    )
    assert fixcheck.already_set(run, same) and not fixcheck.already_set(run, other)
    assert not fixcheck.already_set(run, placeholder)
    assert not fixcheck.already_set(run, Fix("algo.max_grad_norm: 1.0", None, ""))  # not in the manifest
    (c,) = fixcheck.checked(run, [_cause(same, placeholder)])
    assert c.fixes == [placeholder]


def test_no_larger_loss_scale_in_a_run_that_overflows():
    raise_it = Fix(
        None, None, "raise the loss scale to 65536 (precision.overrides.actor.init_scale), or use bf16"
    )
    overflow = Finding(severity="error", kind=K.OVERFLOW, message="Inf", role="actor")
    headroom = Finding(severity="warning", kind=K.HEADROOM, message="near max", role="actor")
    cfg = {"precision": {"preset": "fp16"}}
    (c,) = fixcheck.checked(_run(cfg, [overflow]), [_cause(raise_it)])
    assert c.fixes == [fixcheck.BF16]
    (c,) = fixcheck.checked(_run(cfg, [headroom]), [_cause(raise_it)])  # near the maximum is not over it
    assert c.fixes == [raise_it]
    (c,) = fixcheck.checked(_run(cfg), [_cause(raise_it)])
    assert c.fixes == [raise_it]
    larger = Fix(None, None, "use dynamic loss scaling with a larger init_scale, or bf16")
    lower = Fix(None, None, "lower the loss scale (precision.overrides.actor.init_scale: 1024)")
    (c,) = fixcheck.checked(_run(cfg, [overflow]), [_cause(larger, lower)])
    assert c.fixes == [lower]
