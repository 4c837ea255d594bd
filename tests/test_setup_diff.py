"""What model.setup changed: the trainer's before/after record (trainer/setup_diff.py, written by
trainer.models.apply_setup) and the audit's ``setup/*`` findings from it (verlaudit/audit/setup_changes.py).
Each change is planted by a setup function a user could write; a setup that changes nothing leaves
no record and no finding."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM, LlamaConfig

from trainer.config import ModelConfig
from trainer.models import apply_setup
from trainer.precision import TRAINABLE_ROLES, resolve_policy
from trainer.setup_diff import changes, snapshot
from verlaudit import kinds as K
from verlaudit.audit import setup_changes


class Tok:
    def __len__(self):
        return 100


def lm(tied=False):
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=2, tie_word_embeddings=tied)  # fmt: skip
    return AutoModelForCausalLM.from_config(cfg).train()


def half(model, role, tok):
    model.half()


def pad_vocab(model, role, tok):
    model.resize_token_embeddings(len(tok), pad_to_multiple_of=64, mean_resizing=False)


def freeze_all_but_embeddings(model, role, tok):
    for name, p in model.named_parameters():
        p.requires_grad_("embed_tokens" in name)


def untie(model, role, tok):
    head = model.get_output_embeddings()
    head.weight = nn.Parameter(head.weight.detach().clone())


class HalfNorm(nn.Module):
    def __init__(self, n):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n, dtype=torch.float16))

    def forward(self, x):
        return self.weight * x.half()


def swap_norm(model, role, tok):
    model.model.norm = HalfNorm(model.model.norm.weight.shape[0])


def hook(model, role, tok):
    for layer in model.model.layers:
        layer.register_forward_hook(lambda m, a, out: out.to(torch.bfloat16))


def train_with_dropout(model, role, tok):
    for m in model.modules():
        if hasattr(m, "attention_dropout"):
            m.attention_dropout = 0.3
    model.train()


def nothing(model, role, tok):
    model.config.use_cache = False


def record(fn, role="actor", tied=False):
    model = lm(tied)
    if role in ("reference", "reward"):
        model.eval()
    out = apply_setup({role: model}, ModelConfig(setup={role: f"tests.test_setup_diff:{fn.__name__}"}), Tok())
    return out[role]


def found(model, role="actor"):
    return setup_changes.findings(
        {}, {role: model}, resolve_policy("fp32"), {"vocab_size": 100}, TRAINABLE_ROLES
    )


@pytest.mark.parametrize(
    "fn, role, kind, severity, words",
    [
        (
            half,
            "critic",
            K.SETUP_DTYPE,
            "warning",
            ("in fp16, from fp32", "the policy stores critic weights in fp32"),
        ),
        (pad_vocab, "actor", K.SETUP_VOCAB, "warning", ("from 100 to 128 rows", "the tokenizer has 100 ids")),
        (
            freeze_all_but_embeddings,
            "actor",
            K.SETUP_TRAINABLE,
            "warning",
            ("model.embed_tokens.weight", "frozen"),
        ),
        (swap_norm, "actor", K.SETUP_DTYPE, "warning", ("model.norm.weight", "LlamaRMSNorm -> HalfNorm")),
        (hook, "actor", K.SETUP_HOOKS, "info", ("model.layers.0, model.layers.1",)),
        (
            train_with_dropout,
            "reward",
            K.SETUP_MODE,
            "warning",
            ("training mode with dropout", "call to call"),
        ),
    ],
)
def test_each_change_a_setup_makes_is_a_finding_naming_the_setup_function(fn, role, kind, severity, words):
    fs = [f for f in found(record(fn, role), role) if f.kind == kind]
    assert len(fs) == 1, found(record(fn, role), role)
    f = fs[0]
    assert f.severity == severity and f.role == role and f.step is None
    assert f.where == f"model.setup.{role} (tests.test_setup_diff:{fn.__name__})"
    assert all(w in f.message for w in words), f.message
    assert f.fix and fn.__name__ in f.fix


def test_untying_the_head_is_a_ties_change_not_a_freeze():
    kinds = {f.kind for f in found(record(untie, tied=True))}
    assert kinds == {K.SETUP_TIES}


def test_a_setup_that_changes_nothing_the_audit_reads_leaves_no_finding():
    model = record(nothing)
    assert model.setup_changes["changes"] == [] and found(model) == []


def test_a_model_without_setup_carries_no_record():
    assert found(lm()) == []


def test_freezing_a_small_part_is_info_and_a_cast_the_policy_says_is_info():
    def freeze_embeddings(model, role, tok):
        model.model.embed_tokens.weight.requires_grad_(False)

    m = lm()
    before = snapshot(m)
    freeze_embeddings(m, "actor", Tok())
    m.setup_changes = {"key": "model.setup", "spec": "s:f", "changes": changes(before, snapshot(m))}
    assert [f.severity for f in found(m)] == ["info"]
    m = lm()
    before = snapshot(m)
    m.to(torch.bfloat16)
    m.setup_changes = {"key": "model.setup", "spec": "s:f", "changes": changes(before, snapshot(m))}
    policy = resolve_policy("bf16-pure")
    fs = setup_changes.findings({}, {"actor": m}, policy, {"vocab_size": 100}, TRAINABLE_ROLES)
    assert [(f.kind, f.severity) for f in fs] == [(K.SETUP_DTYPE, "info")]


def test_a_plain_module_without_config_or_embeddings_is_recorded_too():
    m = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.1)).eval()
    before = snapshot(m)
    m.half()
    assert [c["aspect"] for c in changes(before, snapshot(m))] == ["dtype"]
