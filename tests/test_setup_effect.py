"""What a setup changed in what a model computes (trainer/setup_effect.py, written by
trainer.models.apply_setup; verlaudit/audit/setup_effect.py turns it into findings), and diagnose
naming the setup as the root of what it caused. Each change is planted by a setup function a user
could write; the setups a user normally writes (adapters that start at zero, a value head
re-initialised, caching flags, a cast) stay quiet."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, LlamaConfig

from tests.test_setup_cause import run_dir
from trainer.config import ModelConfig
from trainer.models import apply_setup
from trainer.precision import TRAINABLE_ROLES, resolve_policy
from verlaudit import kinds as K
from verlaudit.analysis.diagnose.diagnosis import diagnose_run
from verlaudit.audit import setup_changes
from verlaudit.rundir import Finding


class Tok:
    def __len__(self):
        return 100


CFG = dict(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
           num_key_value_heads=2, pad_token_id=0)  # fmt: skip


def lm(seed=0):
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(LlamaConfig(**CFG)).train()


def scorer():
    torch.manual_seed(1)
    return AutoModelForSequenceClassification.from_config(LlamaConfig(**CFG, num_labels=1)).eval()


# ---------------------------------------------------------------- setups a user could write
def big_eps(model, role, tok):
    for m in model.modules():
        if hasattr(m, "variance_epsilon"):
            m.variance_epsilon = 1.0


class Wrapper(nn.Module):
    def __init__(self, lm):
        super().__init__()
        self.lm = lm

    def forward(self, *a, **kw):
        return self.lm(*a, **kw)


def wrap(model, role, tok):
    return Wrapper(model)


class Adapter(nn.Module):
    def __init__(self, base, zero_b):
        super().__init__()
        self.base = base
        self.a = nn.Parameter(torch.randn(4, base.in_features) * 0.3)
        self.b = nn.Parameter(
            torch.zeros(base.out_features, 4) if zero_b else torch.randn(base.out_features, 4)
        )

    def forward(self, x):
        return self.base(x) + 8.0 * (x @ self.a.t()) @ self.b.t()


def _adapt(model, zero_b):
    model.requires_grad_(False)
    for layer in model.model.layers:
        layer.self_attn.q_proj = Adapter(layer.self_attn.q_proj, zero_b)
        layer.self_attn.v_proj = Adapter(layer.self_attn.v_proj, zero_b)


def adapters_random_b(model, role, tok):
    _adapt(model, zero_b=False)


def adapters_zero_b(model, role, tok):
    _adapt(model, zero_b=True)


def clamp_scores(model, role, tok):
    def hook(mod, args, out):
        out.logits = out.logits.clamp(-1e-4, 1e-4)
        return out

    model.register_forward_hook(hook)


def wide_clamp(model, role, tok):
    def hook(mod, args, out):
        out.logits = out.logits.clamp(-100.0, 100.0)
        return out

    model.register_forward_hook(hook)


_ACTOR: dict[str, nn.Module] = {}


def share_trunk(model, role, tok):
    if role == "actor":
        _ACTOR["actor"] = model
    elif role == "critic":
        model.model = _ACTOR["actor"].model


def copy_trunk(model, role, tok):
    if role == "actor":
        _ACTOR["actor"] = model
    elif role == "critic":
        model.model.load_state_dict(_ACTOR["actor"].model.state_dict())


def usual(model, role, tok):
    model.config.use_cache = False
    model.gradient_checkpointing_enable()


def to_bf16(model, role, tok):
    model.to(torch.bfloat16)


class Forwarding(nn.Module):
    """A wrapper that forwards what it lacks to the model (as PEFT's does)."""

    def __init__(self, lm):
        super().__init__()
        self.lm = lm

    def forward(self, *a, **kw):
        return self.lm(*a, **kw)

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(super().__getattr__("lm"), name)


def forwarding_wrapper(model, role, tok):
    return Forwarding(model)


def wrap_reward(model, role, tok):
    return Wrapper(model)


def share_frozen_base(model, role, tok):
    """An adapter policy and its reference share the frozen base weights (memory saving)."""
    if role == "actor":
        _ACTOR["actor"] = model
        adapters_zero_b(model, role, tok)
    elif role == "reference":
        actor = _ACTOR["actor"].model
        model.model.embed_tokens = actor.embed_tokens
        for mine, theirs in zip(model.model.layers, actor.layers, strict=True):
            mine.mlp = theirs.mlp
        model.requires_grad_(False)


def zero_value_head(model, role, tok):
    with torch.no_grad():
        model.lm_head.weight.zero_()


def setup_models(fn, roles):
    models = {r: scorer() if r == "reward" else lm() for r in roles}
    out = apply_setup(models, ModelConfig(setup=f"tests.test_setup_effect:{fn.__name__}"), Tok())
    fs = setup_changes.findings({}, out, resolve_policy("fp32"), {"vocab_size": 100}, TRAINABLE_ROLES)
    return out, fs


NEW = {K.SETUP_SETTINGS, K.SETUP_INTERFACE, K.SETUP_ADAPTER_INIT, K.SETUP_COLLAPSED, K.SETUP_SHARED}


@pytest.mark.parametrize(
    "fn, roles, kind, role, severity, words, fix_words",
    [
        (big_eps, ("actor", "reference"), K.SETUP_SETTINGS, "actor", "warning",
         ("variance_epsilon", "from 1e-06 to 1.0", "rms_norm_eps", "moved by"), ("leave variance_epsilon", "1e-06")),
        (wrap, ("actor",), K.SETUP_INTERFACE, "actor", "error", ("Wrapper", "generate", "LlamaForCausalLM"),
         ("return None", "in place", ".lm")),
        (adapters_random_b, ("actor",), K.SETUP_ADAPTER_INIT, "actor", "warning", ("none of them zero", "init"),
         ("zeros", "self_attn.q_proj.b")),
        (clamp_scores, ("reward",), K.SETUP_COLLAPSED, "reward", "error", ("distinct value", "saturates"),
         ("remove the clamp",)),
        (share_trunk, ("actor", "critic"), K.SETUP_SHARED, "critic", "error", ("share", "optimizers"),
         ("deepcopy", "own copy")),
    ],
)  # fmt: skip
def test_each_change_in_what_a_model_computes_is_a_finding_naming_the_setup(
    fn, roles, kind, role, severity, words, fix_words
):
    _, fs = setup_models(fn, roles)
    mine = [f for f in fs if f.kind == kind and f.role == role]
    assert len(mine) == 1, [(f.kind, f.role, f.message) for f in fs]
    f = mine[0]
    assert f.severity == severity and f.step is None and fn.__name__ in f.where
    assert all(w in f.message for w in words), f.message
    assert all(w in f.fix for w in fix_words), f.fix


@pytest.mark.parametrize(
    "fn, roles",
    [
        (adapters_zero_b, ("actor",)),
        (wide_clamp, ("reward",)),
        (copy_trunk, ("actor", "critic")),
        (usual, ("actor", "reference")),
        (to_bf16, ("reference",)),
        (forwarding_wrapper, ("actor",)),
        (wrap_reward, ("reward",)),
        (share_frozen_base, ("actor", "reference")),
        (zero_value_head, ("critic",)),
    ],
)
def test_the_setups_users_normally_write_stay_quiet(fn, roles):
    _, fs = setup_models(fn, roles)
    loud = [f for f in fs if f.kind in NEW and f.severity != "info"]
    assert not loud, [(f.kind, f.message) for f in loud]


def test_the_probe_restores_training_mode_and_rng():
    models = {"actor": lm()}
    torch.manual_seed(5)
    want = torch.rand(3)
    torch.manual_seed(5)
    out = apply_setup(models, ModelConfig(setup="tests.test_setup_effect:big_eps"), Tok())
    assert torch.equal(torch.rand(3), want) and out["actor"].training
    assert all(m.training for m in out["actor"].modules())


def test_a_wrapper_is_not_a_vocabulary_resize_nor_a_config_disagreement():
    _, fs = setup_models(wrap, ("actor", "reference"))
    kinds = {f.kind for f in fs}
    assert K.SETUP_VOCAB not in kinds and K.SETUP_ROLES_DIFFER not in kinds, [(f.kind, f.message) for f in fs]


# ---------------------------------------------------------------- diagnose: the setup is the root
def _symptoms(kind):
    if kind == "exception":
        status = {"state": "failed", "reason": "exception", "step": 0, "phase": "rollout", "role": "actor",
                  "error": "AttributeError: 'Wrapper' object has no attribute 'generate'"}  # fmt: skip
        return [], status
    if kind == K.REWARD_CONSTANT:
        f = Finding(severity="warning", kind=kind, message="every response got the same reward (1)", role="reward",
                    where="model.reward_model (rm)", step=1, phase="reward", fix="check the reward")  # fmt: skip
        return [f], None
    f = Finding(severity="error", kind=kind, message="before any update the reference is not the actor's start",
                role="reference", where="model", step=None, fix="copy the reference from the actor")  # fmt: skip
    return [f], None


@pytest.mark.parametrize(
    "fn, roles, symptom",
    [
        (wrap, ("actor",), "exception"),
        (clamp_scores, ("reward",), K.REWARD_CONSTANT),
        (adapters_random_b, ("actor",), K.REFERENCE_NOT_ACTOR),
        (big_eps, ("actor", "reference"), K.REFERENCE_NOT_ACTOR),
        (share_trunk, ("actor", "critic"), K.REFERENCE_NOT_ACTOR),
    ],
)
def test_the_setup_change_is_the_first_cause_with_its_own_fix(fn, roles, symptom):
    _, fs = setup_models(fn, roles)
    fs = [f for f in fs if f.kind in NEW]
    more, status = _symptoms(symptom)
    d = diagnose_run(run_dir(fs + more, status=status))
    first = d.causes[0]
    assert first.kind.removeprefix("finding:") in NEW and fn.__name__ in (first.where or ""), [
        (c.kind, c.title[:80]) for c in d.causes
    ]
    assert first.fixes and fn.__name__ in first.fixes[0].why
    cons = [c for c in d.causes if c.consequence_of == first.title]
    assert cons or symptom == "exception" and first.chain


def test_the_probe_compares_a_resized_vocabulary_on_the_rows_both_have():
    from trainer.setup_effect import compare_outputs

    a = torch.randn(8, 6, 100)
    b = torch.cat([a, torch.randn(8, 6, 28)], -1)
    got = compare_outputs(a, b)
    assert got["change"] == 0 and got["distinct"] == 8 and math.isfinite(got["range"][0])
