"""What a setup did to a model's weights and its forward (trainer/setup_values.py, recorded by
trainer.models.apply_setup; verlaudit/audit/setup_values.py turns it into findings), and diagnose taking
the setup's change as the root of what follows from it. Each family has several members a user could
write, and the setups users normally write stay quiet."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.test_setup_cause import run_dir
from tests.test_setup_effect import Tok, lm
from trainer.config import ModelConfig
from trainer.models import apply_setup
from trainer.precision import TRAINABLE_ROLES, resolve_policy
from verlaudit import kinds as K
from verlaudit.analysis.diagnose.diagnosis import diagnose_run
from verlaudit.audit import setup_changes
from verlaudit.rundir import Finding

MINE = {K.SETUP_WEIGHTS, K.SETUP_HOOK_EFFECT, K.SETUP_NOT_DETERMINISTIC, K.SETUP_MODULES, K.SETUP_NO_GRAPH}


# ---------------------------------------------------------------- weights a setup rewrote
def reinit_linears(model, role, tok):
    for m in model.modules():
        if isinstance(m, nn.Linear):
            m.reset_parameters()


def reinit_embeddings(model, role, tok):
    nn.init.normal_(model.get_input_embeddings().weight, std=0.02)


def head_times_tenth(model, role, tok):
    with torch.no_grad():
        model.lm_head.weight.mul_(0.1)


def mlp_times_three(model, role, tok):
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.down_proj.weight.mul_(3.0)


def zero_norms(model, role, tok):
    with torch.no_grad():
        for layer in model.model.layers:
            layer.input_layernorm.weight.zero_()


def tie_head(model, role, tok):
    model.lm_head.weight = model.model.embed_tokens.weight


# ---------------------------------------------------------------- hooks a setup registered
def _neftune(mod, args, out):
    if mod.training:
        return out + torch.zeros_like(out).uniform_(-1.0, 1.0)
    return out


def neftune(model, role, tok):
    model.get_input_embeddings().register_forward_hook(_neftune)


def scale_embeddings(model, role, tok):
    model.get_input_embeddings().register_forward_hook(lambda m, a, o: o * 8.0)


def noisy_pre_hook(model, role, tok):
    def pre(mod, args):
        return (args[0] + 0.5 * torch.randn_like(args[0]),) + tuple(args[1:])

    model.model.norm.register_forward_pre_hook(pre)


def halve_in_training(model, role, tok):
    def hook(mod, args, out):
        return out * 0.5 if mod.training else out

    model.model.layers[0].mlp.register_forward_hook(hook)


# ---------------------------------------------------------------- forwards a setup changed without a hook
class NoisyAct(nn.Module):
    def forward(self, x):
        return F.dropout(F.silu(x), p=0.5, training=True)  # dropout forced on, in eval mode too


def noisy_activation(model, role, tok):
    for layer in model.model.layers:
        layer.mlp.act_fn = NoisyAct()


class TrainOnlyScale(nn.Module):
    def forward(self, x):
        return F.silu(x) * (0.3 if self.training else 1.0)


def train_only_activation(model, role, tok):
    for layer in model.model.layers:
        layer.mlp.act_fn = TrainOnlyScale()


def relu_activation(model, role, tok):
    for layer in model.model.layers:
        layer.mlp.act_fn = nn.ReLU()


# ---------------------------------------------------------------- setups users normally write
def observe(model, role, tok):
    seen = []
    model.get_input_embeddings().register_forward_hook(lambda m, a, o: seen.append(o.shape) and None)


def upcast_logits(model, role, tok):
    model.lm_head.register_forward_hook(lambda m, a, o: o.float())


def load_sft(model, role, tok):
    torch.manual_seed(9)
    other = lm(seed=9)
    model.load_state_dict(other.state_dict())


def new_value_head(model, role, tok):
    model.value_head = nn.Linear(32, 1)
    nn.init.zeros_(model.value_head.bias)


def critic_head_reinit(model, role, tok):
    nn.init.normal_(model.lm_head.weight, std=0.01)


def to_bf16(model, role, tok):
    model.to(torch.bfloat16)


def freeze_norms(model, role, tok):
    for n, p in model.named_parameters():
        if "norm" in n:
            p.requires_grad_(False)


def setup_models(fn, roles):
    models = {r: lm() for r in roles}
    out = apply_setup(models, ModelConfig(setup=f"tests.test_setup_values:{fn.__name__}"), Tok())
    fs = setup_changes.findings({}, out, resolve_policy("fp32"), {"vocab_size": 100}, TRAINABLE_ROLES)
    return out, fs


@pytest.mark.parametrize(
    "fn, kind, severity, words, fix_words",
    [
        (reinit_linears, K.SETUP_WEIGHTS, "error", ("re-initialised 15 of its", "uncorrelated"),
         ("reset_parameters", "head only")),
        (reinit_embeddings, K.SETUP_WEIGHTS, "warning", ("re-initialised 1 of", "embed_tokens"), ("init",)),
        (head_times_tenth, K.SETUP_WEIGHTS, "warning", ("lm_head.weight", "by 0.1", "temperature of 10"),
         ("remove the scaling of lm_head.weight", "temperature")),
        (mlp_times_three, K.SETUP_WEIGHTS, "warning", ("multiplied 2 weight tensor(s)", "by 3"), ("remove the scaling",)),
        (zero_norms, K.SETUP_WEIGHTS, "warning", ("set 2 weight tensor(s) to zero", "input_layernorm"), ("do not zero",)),
        (tie_head, K.SETUP_WEIGHTS, "warning", ("tied lm_head.weight to model.embed_tokens.weight",), ("do not tie",)),
        (neftune, K.SETUP_HOOK_EFFECT, "error", ("_neftune", "training mode only", "eval mode", "model.embed_tokens"),
         ("remove the forward hook", "noise")),
        (scale_embeddings, K.SETUP_HOOK_EFFECT, "warning", ("multiplies the output it receives by 8",), ("remove the forward hook", "scale")),
        (noisy_pre_hook, K.SETUP_HOOK_EFFECT, "error", ("pre-hook", "model.norm", "in eval mode too"), ("remove the pre-hook",)),
        (halve_in_training, K.SETUP_HOOK_EFFECT, "error", ("in training mode only", "50%"), ("same in training and eval",)),
        (noisy_activation, K.SETUP_NOT_DETERMINISTIC, "error", ("two eval-mode calls",), ("no random numbers",)),
        (train_only_activation, K.SETUP_NOT_DETERMINISTIC, "error", ("training and eval mode differ",), ("same computation",)),
        (relu_activation, K.SETUP_MODULES, "warning", ("SiLUActivation -> ReLU", "moved by"), ("keep the checkpoint's SiLUActivation",)),
    ],
)  # fmt: skip
def test_each_change_is_a_finding_naming_the_setup_the_module_and_its_undo(
    fn, kind, severity, words, fix_words
):
    _, fs = setup_models(fn, ("actor",))
    mine = [f for f in fs if f.kind == kind and f.role == "actor"]
    assert len(mine) == 1, [(f.kind, f.severity, f.message[:120]) for f in fs]
    f = mine[0]
    assert f.severity == severity and fn.__name__ in f.where, (f.severity, f.where)
    assert all(w in f.message for w in words), f.message
    assert all(w in f.fix for w in fix_words), f.fix


@pytest.mark.parametrize(
    "fn, roles",
    [
        (observe, ("actor", "reference")),
        (upcast_logits, ("actor", "reference")),
        (load_sft, ("actor",)),
        (new_value_head, ("critic",)),
        (to_bf16, ("reference",)),
        (freeze_norms, ("actor",)),
    ],
)
def test_the_setups_users_normally_write_stay_quiet(fn, roles):
    _, fs = setup_models(fn, roles)
    loud = [f for f in fs if f.kind in MINE and f.severity != "info"]
    assert not loud, [(f.kind, f.message) for f in loud]


def test_a_critics_head_reinitialised_is_its_setups_job():
    _, fs = setup_models(critic_head_reinit, ("critic",))
    # lm_head is no value head by name: re-initialising a critic's head-like layer is only reported as such
    assert all(f.kind != K.SETUP_WEIGHTS or f.role == "critic" for f in fs)


def test_the_probes_leave_training_mode_rng_and_the_hooks_as_they_were():
    models = {"actor": lm()}
    torch.manual_seed(5)
    want = torch.rand(3)
    torch.manual_seed(5)
    out = apply_setup(models, ModelConfig(setup="tests.test_setup_values:neftune"), Tok())
    assert torch.equal(torch.rand(3), want) and all(m.training for m in out["actor"].modules())
    hooks = list(out["actor"].get_input_embeddings()._forward_hooks.values())
    assert [h.__name__ for h in hooks] == ["_neftune"]


def test_the_scale_and_the_noise_are_measured_on_the_hooks_own_tensor():
    out, _ = setup_models(scale_embeddings, ("actor",))
    [c] = [c for c in out["actor"].setup_changes["changes"] if c["aspect"] == "hook_effect"]
    assert math.isclose(c["eval"]["scale"], 8.0, rel_tol=1e-6) and c["eval"]["noise"] == 0
    out, _ = setup_models(neftune, ("actor",))
    [c] = [c for c in out["actor"].setup_changes["changes"] if c["aspect"] == "hook_effect"]
    assert c["eval"]["change"] == 0 and c["train"]["noise"] > 0.1


# ---------------------------------------------------------------- diagnose: the setup's change is the root
def _consequence(kind):
    if kind == K.MISMATCH_BEYOND_DTYPE:
        return Finding(severity="warning", kind=kind, message="rollout-vs-trainer mismatch beyond dtype rounding",
                       role="rollout", where="rollout:hf-generate", step=0, phase="rollout", fix="rollout_is")  # fmt: skip
    if kind == K.WEIGHTS_UNTRAINED:
        return Finding(severity="error", kind=kind, message="the policy's NLL is no better than unigram", role="actor",
                       where="model.path (ckpt)", step=None, fix="check the checkpoint")  # fmt: skip
    return Finding(severity="error", kind=kind, message="before any update the reference is not the actor's start",
                   role="reference", where="lm_head.weight", step=None, fix="run the setup on the reference")  # fmt: skip


@pytest.mark.parametrize(
    "fn, roles, symptom",
    [
        (neftune, ("actor",), K.MISMATCH_BEYOND_DTYPE),
        (halve_in_training, ("actor",), K.MISMATCH_BEYOND_DTYPE),
        (noisy_activation, ("actor",), K.MISMATCH_BEYOND_DTYPE),
        (reinit_linears, ("actor",), K.REFERENCE_NOT_ACTOR),
        (head_times_tenth, ("actor", "reference"), K.WEIGHTS_UNTRAINED),
        (scale_embeddings, ("actor", "reference"), K.WEIGHTS_UNTRAINED),
        (relu_activation, ("actor", "reference"), K.WEIGHTS_UNTRAINED),
    ],
)
def test_the_setups_change_is_the_first_cause_and_its_fix_undoes_it(fn, roles, symptom):
    _, fs = setup_models(fn, roles)
    d = diagnose_run(run_dir([*fs, _consequence(symptom)]))
    first = d.causes[0]
    assert fn.__name__ in (first.where or "") and first.kind.removeprefix("finding:") in MINE, [
        (c.kind, c.title[:90]) for c in d.causes
    ]
    assert first.fixes and fn.__name__ in first.fixes[0].why
    assert any(c.consequence_of == first.title for c in d.causes), [
        (c.kind, c.consequence_of) for c in d.causes
    ]


def temperature_on_the_output(model, role, tok):
    def hook(mod, args, out):
        out.logits = out.logits / 2.0
        return out

    model.register_forward_hook(hook)


def test_a_hook_on_the_whole_models_output_is_measured_on_its_logits():
    _, fs = setup_models(temperature_on_the_output, ("reference",))
    [f] = [f for f in fs if f.kind == K.SETUP_HOOK_EFFECT]
    assert (
        f.role == "reference"
        and f.severity == "warning"
        and "by 0.5" in f.message
        and "remove the forward hook" in f.fix
    )


def test_a_clamp_that_collapses_a_scorer_is_left_to_the_collapse_finding():
    from tests.test_setup_effect import clamp_scores, scorer

    out = apply_setup(
        {"reward": scorer()}, ModelConfig(setup=f"tests.test_setup_effect:{clamp_scores.__name__}"), Tok()
    )
    fs = setup_changes.findings({}, out, resolve_policy("fp32"), {"vocab_size": 100}, TRAINABLE_ROLES)
    kinds = [f.kind for f in fs if f.severity != "info"]
    assert K.SETUP_COLLAPSED in kinds and K.SETUP_HOOK_EFFECT not in kinds, kinds
