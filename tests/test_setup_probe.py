"""What a setup did that its metadata does not show (trainer/setup_probe.py, run by
trainer.models.apply_setup) and the audit's findings from it (verlaudit/audit/setup_changes.py): a
state dict that matched nothing, a forward with gradients off, tensors that train but are not
parameters, a buffer changed on the actor and not on its reference, a frozen head, a checkpoint
directory that lacked weights. Each is planted in a way other than the blind benches' own (a DDP
prefix, a backbone given the causal LM's keys, inference_mode, a dict of layers, a plain tensor, a
linear RoPE interpolation, a frozen value head), next to the correct setup that must stay silent."""

from __future__ import annotations

import copy
import os

import pytest
import torch
from torch import nn
from transformers import AutoModel, AutoModelForCausalLM, AutoModelForSequenceClassification, LlamaConfig

from trainer.config import ModelConfig
from trainer.models import ValueModel, apply_setup, build_reward_model
from trainer.precision import TRAINABLE_ROLES, resolve_policy
from verlaudit import kinds as K
from verlaudit.audit import setup_changes

NEW = {
    K.SETUP_LOAD,
    K.SETUP_NO_GRAPH,
    K.SETUP_UNREGISTERED,
    K.SETUP_ROLES_DIFFER,
    K.NEWLY_INITIALISED,
    K.SETUP_TRAINABLE,
}


class Tok:
    pad_token_id = 0

    def __len__(self):
        return 100


def cfg():
    return LlamaConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=2, num_key_value_heads=2, tie_word_embeddings=False)  # fmt: skip


def lm(seed=0):
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(cfg()).train()


def other_lm_state():
    return lm(seed=1).state_dict()


# ---------------------------------------------------------------- setups a user could write
def load_ddp_checkpoint(model, role, tok):
    """A checkpoint saved from a DDP-wrapped model: every key starts with 'module.'."""
    model.load_state_dict({"module." + k: v for k, v in other_lm_state().items()}, strict=False)


def load_lm_keys_into_backbone(model, role, tok):
    """The causal LM's state dict loaded into the backbone (keys carry 'model.' the backbone lacks)."""
    model.model.load_state_dict(other_lm_state(), strict=False)


def load_without_head(model, role, tok):
    """The backbone's weights loaded, the head deliberately left at init: correct."""
    sd = {k: v for k, v in other_lm_state().items() if not k.startswith("lm_head")}
    model.load_state_dict(sd, strict=False)


class InferenceHead(nn.Module):
    def __init__(self, head):
        super().__init__()
        self.head = head

    def forward(self, h):
        with torch.inference_mode():
            return self.head(h) * 0.5


def inference_mode_head(model, role, tok):
    model.lm_head = InferenceHead(model.lm_head)


class NoGradMLP(nn.Module):
    def __init__(self, mlp):
        super().__init__()
        self.mlp = mlp

    @torch.no_grad()
    def forward(self, x):
        return self.mlp(x)


def no_grad_last_mlp(model, role, tok):
    model.model.layers[-1].mlp = NoGradMLP(model.model.layers[-1].mlp)


class GradHead(nn.Module):
    def __init__(self, head):
        super().__init__()
        self.head = head

    def forward(self, h):
        return 30.0 * torch.tanh(self.head(h) / 30.0)


def soft_cap_with_grad(model, role, tok):
    model.lm_head = GradHead(model.lm_head)


class DictHead(nn.Module):
    def __init__(self, n):
        super().__init__()
        self.layers = {"a": nn.Linear(n, n), "b": nn.Linear(n, 1)}

    def forward(self, h):
        return self.layers["b"](torch.relu(self.layers["a"](h)))


def dict_value_head(model, role, tok):
    model.value_head = DictHead(model.config.hidden_size)


class ScaledHead(nn.Module):
    def __init__(self, head):
        super().__init__()
        self.head = head
        self.scale = torch.ones((), requires_grad=True)  # a plain tensor, not nn.Parameter

    def forward(self, h):
        return self.head(h) * self.scale


def learnt_temperature(model, role, tok):
    model.lm_head = ScaledHead(model.lm_head)


class ListHead(nn.Module):
    def __init__(self, n):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(n, n), nn.Linear(n, 1)])

    def forward(self, h):
        return self.layers[1](torch.relu(self.layers[0](h)))


def module_list_value_head(model, role, tok):
    model.value_head = ListHead(model.config.hidden_size)


def interpolate_positions(model, role, tok):
    """Linear position interpolation (x2) written into the rotary frequencies."""
    model.model.rotary_emb.inv_freq.mul_(0.5)


def bf16_rotary(model, role, tok):
    rot = model.model.rotary_emb
    rot.inv_freq = rot.inv_freq.to(torch.bfloat16)


def freeze_value_head(model, role, tok):
    model.value_head.requires_grad_(False)


def freeze_embeddings(model, role, tok):
    model.model.embed_tokens.weight.requires_grad_(False)


# ---------------------------------------------------------------- running them
def run_setup(fns, models):
    spec = {r: f"tests.test_setup_probe:{fn.__name__}" for r, fn in fns.items()}
    out = apply_setup(models, ModelConfig(setup=spec), Tok())
    policy = resolve_policy("fp32")
    fs = setup_changes.findings({}, out, policy, {"vocab_size": 100}, TRAINABLE_ROLES)
    return [f for f in fs if f.kind in NEW]


def actor_and_reference():
    actor = lm()
    return {"actor": actor, "reference": copy.deepcopy(actor).eval().requires_grad_(False)}


def critic():
    torch.manual_seed(0)
    return ValueModel(lm().model)


@pytest.mark.parametrize(
    "fn, severity, words",
    [
        (load_ddp_checkpoint, "error", ("0 matched", "extra prefix 'module.'", "strip 'module.'")),
        (load_lm_keys_into_backbone, "error", ("the actor's model", "strip 'model.'")),
    ],
)
def test_a_state_dict_that_matches_nothing_is_named_with_the_prefix_that_would_match(fn, severity, words):
    fs = run_setup({"actor": fn}, {"actor": lm()})
    assert [(f.kind, f.severity) for f in fs] == [(K.SETUP_LOAD, severity)], fs
    text = fs[0].message + fs[0].fix
    assert all(w in text for w in words), text
    assert fs[0].where == f"model.setup.actor (tests.test_setup_probe:{fn.__name__})"


def test_a_partial_load_that_leaves_the_head_out_is_silent():
    assert run_setup({"actor": load_without_head}, {"actor": lm()}) == []


def test_a_head_computed_under_inference_mode_leaves_the_loss_without_a_graph():
    fs = run_setup({"actor": inference_mode_head}, {"actor": lm()})
    assert [(f.kind, f.severity) for f in fs] == [(K.SETUP_NO_GRAPH, "error")], fs
    assert "lm_head (InferenceHead)" in fs[0].message and "backward fails" in fs[0].message
    assert "InferenceHead.forward" in fs[0].fix


def test_one_layer_run_under_no_grad_is_a_warning_naming_the_module():
    fs = run_setup({"actor": no_grad_last_mlp}, {"actor": lm()})
    assert [(f.kind, f.severity) for f in fs] == [(K.SETUP_NO_GRAPH, "warning")], fs
    assert "model.layers.1.mlp (NoGradMLP)" in fs[0].message


def test_a_wrapper_head_that_keeps_gradients_is_silent():
    assert run_setup({"actor": soft_cap_with_grad}, {"actor": lm()}) == []


def test_layers_held_in_a_dict_are_unregistered_tensors_the_optimizer_never_sees():
    fs = run_setup({"critic": dict_value_head}, {"critic": critic()})
    assert [(f.kind, f.severity) for f in fs] == [(K.SETUP_UNREGISTERED, "warning")], fs
    assert "value_head.layers['a'].weight" in fs[0].message and "nn.ModuleDict" in fs[0].fix


def test_a_plain_tensor_that_requires_grad_is_an_unregistered_tensor():
    fs = run_setup({"actor": learnt_temperature}, {"actor": lm()})
    assert [f.kind for f in fs] == [K.SETUP_UNREGISTERED], fs
    assert "lm_head.scale" in fs[0].message


def test_a_module_list_head_is_registered_and_silent():
    assert run_setup({"critic": module_list_value_head}, {"critic": critic()}) == []


def test_rotary_frequencies_changed_on_the_actor_only_make_the_reference_another_model():
    fs = run_setup({"actor": interpolate_positions}, actor_and_reference())
    assert [(f.kind, f.role) for f in fs] == [(K.SETUP_ROLES_DIFFER, "actor")], fs
    assert "model.rotary_emb.inv_freq" in fs[0].message and "reference" in fs[0].message
    assert "model.setup.reference" in fs[0].fix


@pytest.mark.parametrize("fns", [{"*": interpolate_positions}, {"actor": bf16_rotary}])
def test_the_same_change_on_both_roles_or_a_mere_rounding_is_silent(fns):
    models = actor_and_reference()
    if "*" in fns:
        spec = f"tests.test_setup_probe:{fns['*'].__name__}"
        out = apply_setup(models, ModelConfig(setup=spec), Tok())
        fs = setup_changes.findings({}, out, resolve_policy("fp32"), {"vocab_size": 100}, TRAINABLE_ROLES)
        assert [f for f in fs if f.kind in NEW] == []
    else:
        assert [f.kind for f in run_setup(fns, models)] == []


def test_a_frozen_value_head_is_a_warning_and_frozen_embeddings_are_not():
    fs = run_setup({"critic": freeze_value_head}, {"critic": critic()})
    assert [(f.kind, f.severity) for f in fs] == [(K.SETUP_TRAINABLE, "warning")], fs
    assert "value_head.weight" in fs[0].message and "keep the critic's head trainable" in fs[0].fix
    fs = run_setup({"actor": freeze_embeddings}, {"actor": lm()})
    assert [(f.kind, f.severity) for f in fs] == [(K.SETUP_TRAINABLE, "info")], fs


def test_the_probe_runs_no_user_hook_and_leaves_the_rng_where_it_was():
    calls = []
    model = lm()
    model.register_forward_pre_hook(lambda m, a: calls.append(1))
    torch.manual_seed(5)
    want = torch.rand(3)
    torch.manual_seed(5)
    from trainer.setup_probe import graph_probe

    assert graph_probe(model.train(), 100) is None
    assert torch.equal(torch.rand(3), want) and calls == []


def test_a_causal_lm_directory_as_reward_model_has_a_newly_initialised_score_head(tmp_path):
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg()).save_pretrained(tmp_path / "lm")
    rm_cfg = cfg()
    rm_cfg.num_labels = 1
    AutoModelForSequenceClassification.from_config(rm_cfg).save_pretrained(tmp_path / "rm")
    policy = resolve_policy("fp32").roles["reward"]
    bad = build_reward_model(ModelConfig(reward_model=str(tmp_path / "lm")), Tok(), policy, "cpu")
    good = build_reward_model(ModelConfig(reward_model=str(tmp_path / "rm")), Tok(), policy, "cpu")
    fs = setup_changes.load_findings({"reward": bad})
    assert [(f.kind, f.severity, f.role) for f in fs] == [(K.NEWLY_INITIALISED, "error", "reward")]
    assert "score.weight" in fs[0].message and "LlamaForCausalLM" in fs[0].message
    assert fs[0].where.startswith("model.reward_model (") and "classification" in fs[0].fix
    assert setup_changes.load_findings({"reward": good}) == []


def test_a_policy_checkpoint_without_its_head_is_one_error_for_the_actor_and_its_reference(tmp_path):
    torch.manual_seed(0)
    AutoModel.from_config(cfg()).save_pretrained(tmp_path / "backbone")
    from trainer.models import _keep_loading_report

    # what trainer.models.build_causal_lm does with model.path
    actor, info = AutoModelForCausalLM.from_pretrained(tmp_path / "backbone", output_loading_info=True)
    _keep_loading_report(actor, info, "model.path", str(tmp_path / "backbone"))
    fs = setup_changes.load_findings({"actor": actor, "reference": copy.deepcopy(actor)})
    assert [(f.kind, f.severity) for f in fs] == [(K.NEWLY_INITIALISED, "error")], fs
    assert "lm_head.weight" in fs[0].message and "actor and reference" in fs[0].message


# ---------------------------------------------------------------- in diagnose: the root, its consequences marked
def test_a_forward_without_graph_is_the_root_of_the_backward_that_fails():
    from tests.test_setup_cause import SPEC, assert_marked, run_dir, setup
    from verlaudit.analysis.diagnose.diagnosis import diagnose_run

    failed = {"state": "failed", "reason": "exception", "step": 0, "phase": "actor_update", "role": "actor",
              "error": "RuntimeError: element 0 of tensors does not require grad and does not have a grad_fn"}  # fmt: skip
    d = diagnose_run(
        run_dir([setup(K.SETUP_NO_GRAPH, "actor", "error", {"module": "lm_head"})], status=failed)
    )
    first = d.causes[0]
    assert first.kind == f"finding:{K.SETUP_NO_GRAPH}" and SPEC in first.title, [c.kind for c in d.causes]
    assert [c.kind for c in d.causes if c.consequence_of == first.title] == ["exception"]
    assert_marked(d, first)


def test_a_buffer_changed_on_the_actor_only_is_the_root_of_the_reference_finding():
    from tests.test_setup_cause import finding, run_dir, setup
    from verlaudit.analysis.diagnose.diagnosis import diagnose_run

    d = diagnose_run(
        run_dir(
            [
                setup(K.SETUP_ROLES_DIFFER, "actor", "warning", {"module": "model.rotary_emb.inv_freq"}),
                finding(K.REFERENCE_NOT_ACTOR, step=None, role="reference", where="model.layers.0.mlp"),
            ]
        )
    )
    first = d.causes[0]
    assert first.kind == f"finding:{K.SETUP_ROLES_DIFFER}" and first.severity == "error"
    assert [c.kind for c in d.causes[1:] if c.consequence_of == first.title] == [
        f"finding:{K.REFERENCE_NOT_ACTOR}"
    ]


class DetachedHead(nn.Module):
    def __init__(self, head):
        super().__init__()
        self.head = head

    def forward(self, h):
        return self.head(h).detach().float()


def detached_head(model, role, tok):
    model.lm_head = DetachedHead(model.lm_head)


def test_a_head_that_detaches_its_output_is_named_as_the_cut():
    fs = run_setup({"actor": detached_head}, {"actor": lm()})
    assert [(f.kind, f.severity) for f in fs] == [(K.SETUP_NO_GRAPH, "error")], fs
    assert "lm_head (DetachedHead)" in fs[0].message and "DetachedHead.forward" in fs[0].fix


DIR_ENV = "SETUP_PROBE_TEST_DIR"
"""The directory the from_pretrained setups below read from (set by the test: the plug-ins are
imported again by name, apart from this module)."""


def reload_from_backbone_dir(model, role, tok):
    """Replaces the model by one read from a directory that holds only a backbone."""
    return AutoModelForCausalLM.from_pretrained(os.path.join(os.environ[DIR_ENV], "backbone"))


def rm_loader_from_lm_dir(tokenizer, device):
    """A user reward-model loader that reads a causal-LM directory as a sequence classifier."""
    return AutoModelForSequenceClassification.from_pretrained(
        os.path.join(os.environ[DIR_ENV], "lm"), num_labels=1
    ).eval()


def test_a_setup_or_a_loader_that_reads_a_checkpoint_lacking_weights_is_named_for_them(tmp_path, monkeypatch):
    torch.manual_seed(0)
    AutoModel.from_config(cfg()).save_pretrained(tmp_path / "backbone")
    AutoModelForCausalLM.from_config(cfg()).save_pretrained(tmp_path / "lm")
    monkeypatch.setenv(DIR_ENV, str(tmp_path))
    fs = run_setup({"actor": reload_from_backbone_dir}, {"actor": lm()})
    assert [(f.kind, f.severity) for f in fs] == [(K.NEWLY_INITIALISED, "warning")], fs
    assert fs[0].where == "model.setup.actor (tests.test_setup_probe:reload_from_backbone_dir)"
    assert "lm_head.weight" in fs[0].message and "from_pretrained" in fs[0].message
    policy = resolve_policy("fp32").roles["reward"]
    spec = "tests.test_setup_probe:rm_loader_from_lm_dir"
    rm = build_reward_model(ModelConfig(reward_model=spec), Tok(), policy, "cpu")
    fs = setup_changes.load_findings({"reward": rm})
    assert [(f.kind, f.severity) for f in fs] == [(K.NEWLY_INITIALISED, "error")], fs
    assert spec in fs[0].where and "score.weight" in fs[0].message


def eager_norms(model, role, tok):
    """A larger RMSNorm epsilon on the actor's norms (for fp16 safety, say): a module setting."""
    for m in model.modules():
        if hasattr(m, "variance_epsilon"):
            m.variance_epsilon = 1e-3


def theta_in_config(model, role, tok):
    """A RoPE base written into the actor's config only (recorded even before a rotary is rebuilt)."""
    rp = getattr(model.config, "rope_parameters", None)
    if isinstance(rp, dict):
        model.config.rope_parameters = {**rp, "rope_theta": 1e6}
    else:
        model.config.rope_theta = 1e6


def test_a_module_setting_or_config_field_changed_on_the_actor_only_is_a_roles_difference():
    fs = run_setup({"actor": eager_norms}, actor_and_reference())
    assert [f.kind for f in fs] == [K.SETUP_ROLES_DIFFER], fs
    assert "model.norm.variance_epsilon: actor 0.001 vs reference 1e-06" in fs[0].message
    fs = run_setup({"actor": theta_in_config}, actor_and_reference())
    assert [f.kind for f in fs] == [K.SETUP_ROLES_DIFFER] and "config.rope_" in fs[0].message, fs
    assert "rope_scaling / rope_theta" in fs[0].fix


def new_head_loaded_from_wrong_keys(model, role, tok):
    """A new value head built by the setup, then given the old head's state dict under other names."""
    head = nn.Linear(model.config.hidden_size, 1)
    head.load_state_dict({"linear.weight": torch.zeros(1, model.config.hidden_size)}, strict=False)
    model.value_head = head


def test_a_load_into_a_module_the_setup_built_is_recorded_under_its_name():
    fs = run_setup({"critic": new_head_loaded_from_wrong_keys}, {"critic": critic()})
    assert [(f.kind, f.severity) for f in fs] == [(K.SETUP_LOAD, "error")], fs
    assert "the critic's value_head (Linear)" in fs[0].message


def unused_head_on_a_frozen_role(model, role, tok):
    """A new module (trainable by default) on the reference, which is frozen and never trains."""
    model.value_head = nn.Linear(model.config.hidden_size, 1)


def test_a_frozen_role_is_not_probed_for_a_graph_it_never_builds():
    assert run_setup({"reference": unused_head_on_a_frozen_role}, actor_and_reference()) == []
