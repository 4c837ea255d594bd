"""The tokenizer and the built models against the task's own text (verlaudit/audit/model_checks.py,
tokenizer_checks.py) and a setup's loads matched to the checkpoint they read (trainer/setup_probe.py
`moved_tensors`). Each fault is planted otherwise than the blind benches' (q/k projections swapped, a
hook that scales a critic, a pre-hook that replaces the mask by ones, a tokenizer numbered backwards,
a template reading 'message'), next to the correct counterpart that must stay silent."""

from __future__ import annotations

import copy
import json
import os
import random

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, LlamaConfig

from trainer.config import ModelConfig
from trainer.data import TASKS
from trainer.models import ValueModel, apply_setup
from trainer.precision import TRAINABLE_ROLES, resolve_policy
from trainer.tokenizer import build_tokenizer
from verlaudit import kinds as K
from verlaudit.audit import model_checks, setup_changes, tokenizer_checks

CONFIG = {"data": {"task": "digits"}}
OURS = {
    K.TOKENIZER_VOCAB,
    K.TOKENIZER_DECODE,
    K.CHAT_TEMPLATE_CONTENT,
    K.WEIGHTS_UNTRAINED,
    K.SETUP_LOAD_REMAPPED,
    K.SETUP_HOOK_OUTPUT,
    K.SETUP_MASK_IGNORED,
    K.PADDING_DEPENDENT,
    K.SETUP_VALUE_OFFSET,
    K.SETUP_ZERO_GRADIENT,
    K.SETUP_ROLES_DIFFER,
}


def tok():
    return build_tokenizer()


def cfg(t, **kw):
    args = dict(vocab_size=len(t), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                num_key_value_heads=2, tie_word_embeddings=False, pad_token_id=t.pad_token_id,
                bos_token_id=t.bos_token_id, eos_token_id=t.eos_token_id)  # fmt: skip
    args.update(kw)
    return LlamaConfig(**args)


def lm(seed=0, dtype=torch.float32):
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(cfg(tok())).to(dtype).train()


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny Llama fine-tuned on the copy task's answers (not the benches' digits), saved with its tokenizer."""
    t = tok()
    model = lm(seed=5)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    rng = random.Random(5)
    task = TASKS["digits"]
    for _ in range(120):
        pairs = [task.make_prompt_answer(rng) for _ in range(16)]
        ids, mask, answer = model_checks.batch(t, pairs, "cpu")
        logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1]
        nll = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1),
                                                reduction="none").view(ids.shape[0], -1)  # fmt: skip
        loss = (nll * answer[:, 1:]).sum() / answer[:, 1:].sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
    path = tmp_path_factory.mktemp("trained")
    model.save_pretrained(path)
    t.save_pretrained(path)
    return str(path)


def run_setup(fns, models):
    spec = {r: f"tests.test_model_checks:{fn.__name__}" for r, fn in fns.items()}
    return apply_setup(models, ModelConfig(setup=spec), tok())


def ours(fs):
    return [f for f in fs if f.kind in OURS]


# ---------------------------------------------------------------- setups a user could write
ENV = "VERLAUDIT_TEST_TRAINED_LM"


def load_swapped_qk(model, role, tokenizer):
    """A converter that maps the checkpoint's q_proj to k_proj and back (same shapes with these heads)."""
    src = AutoModelForCausalLM.from_pretrained(os.environ[ENV])
    swap = {"q_proj": "k_proj", "k_proj": "q_proj"}
    state = {}
    for k, v in src.state_dict().items():
        parts = k.split(".")
        state[".".join(swap.get(p, p) for p in parts)] = v
    model.load_state_dict(state, strict=True)


def load_faithfully(model, role, tokenizer):
    src = AutoModelForCausalLM.from_pretrained(os.environ[ENV])
    model.load_state_dict(dict(src.state_dict()), strict=True)


def _double(module, args, output):
    return output * 2.0


def scale_values(model, role, tokenizer):
    """Values doubled 'to match the reward scale'."""
    model.register_forward_hook(_double)


def _watch(module, args, output):
    module.seen = getattr(module, "seen", 0) + 1


def count_calls(model, role, tokenizer):
    """A hook that only observes."""
    model.register_forward_hook(_watch)


def _ones_mask(module, args, kwargs):
    if "attention_mask" in kwargs:
        kwargs["attention_mask"] = torch.ones_like(kwargs["attention_mask"])
    return args, kwargs


def dense_attention(model, role, tokenizer):
    """'Dense' attention: every mask replaced by ones."""
    model.register_forward_pre_hook(_ones_mask, with_kwargs=True)


def value_bias(model, role, tokenizer):
    with torch.no_grad():
        model.value_head.bias.fill_(-12.0)


def value_small(model, role, tokenizer):
    with torch.no_grad():
        model.value_head.weight.normal_(0.0, 0.01)
        model.value_head.bias.zero_()


class Bottleneck(torch.nn.Module):
    """A residual bottleneck adapter after an MLP: ``x + up(down(x))``."""

    def __init__(self, mlp, zero_down: bool):
        super().__init__()
        self.mlp = mlp
        h = mlp.down_proj.out_features
        self.down = torch.nn.Parameter(torch.zeros(4, h) if zero_down else torch.randn(4, h) * 0.02)
        self.up = torch.nn.Parameter(torch.zeros(h, 4))

    def forward(self, x):
        y = self.mlp(x)
        return y + (y @ self.down.t()) @ self.up.t()


def _adapters(model, zero_down):
    model.requires_grad_(False)
    for layer in model.model.layers:
        layer.mlp = Bottleneck(layer.mlp, zero_down)


def zero_adapters(model, role, tokenizer):
    _adapters(model, True)


def adapters(model, role, tokenizer):
    _adapters(model, False)


def softcapped_head(model, role, tokenizer):
    """The head's forward replaced (no hook): a muP-style output multiplier of 4 on the logits."""
    head = model.lm_head
    plain = head.forward
    head.forward = lambda x: 4.0 * plain(x)


def same_cap_both(model, role, tokenizer):
    softcapped_head(model, role, tokenizer)


# ---------------------------------------------------------------- the checks
def test_a_reference_whose_forward_a_setup_patched_is_not_the_actors_start():
    actor = lm()
    models = {"actor": actor, "reference": copy.deepcopy(actor).eval().requires_grad_(False)}
    out = run_setup({"reference": softcapped_head}, models)
    fs = ours(model_checks.findings(CONFIG, out, tok()))
    assert [(f.kind, f.severity) for f in fs] == [(K.SETUP_ROLES_DIFFER, "warning")], fs
    assert "softcapped_head" in fs[0].where and "KL" in fs[0].message
    actor = lm()
    models = {"actor": actor, "reference": copy.deepcopy(actor).eval().requires_grad_(False)}
    out = run_setup({"actor": same_cap_both, "reference": same_cap_both}, models)
    assert ours(model_checks.findings(CONFIG, out, tok())) == []


def test_adapters_whose_factors_both_start_at_zero_get_no_gradient():
    out = run_setup({"actor": zero_adapters}, {"actor": lm()})
    fs = ours(model_checks.findings(CONFIG, out, tok()))
    assert [(f.kind, f.severity) for f in fs] == [(K.SETUP_ZERO_GRADIENT, "error")], fs
    assert "mlp.down" in fs[0].message and "zero_adapters" in fs[0].where and "init" in fs[0].fix
    out = run_setup({"actor": adapters}, {"actor": lm()})
    assert ours(model_checks.findings(CONFIG, out, tok())) == []


def test_a_setup_that_loads_tensors_under_other_names_is_named(trained):
    os.environ[ENV] = trained
    out = run_setup({"actor": load_swapped_qk}, {"actor": lm()})
    fs = ours(
        setup_changes.findings({}, out, resolve_policy("fp32"), {"vocab_size": len(tok())}, TRAINABLE_ROLES)
    )
    assert [(f.kind, f.severity) for f in fs] == [(K.SETUP_LOAD_REMAPPED, "error")], fs
    assert "k_proj" in fs[0].message and "load_swapped_qk" in fs[0].where and "mapping" in fs[0].fix
    # the task's text says the same: the loaded policy does not know the answers
    fs = ours(model_checks.findings(CONFIG, out, tok()))
    assert fs == [], fs  # the remap finding already names it: no second cause for the same load


def test_a_faithful_load_and_its_trained_policy_are_silent(trained):
    os.environ[ENV] = trained
    out = run_setup({"actor": load_faithfully}, {"actor": lm()})
    fs = setup_changes.findings({}, out, resolve_policy("fp32"), {"vocab_size": len(tok())}, TRAINABLE_ROLES)
    assert ours(fs) == []
    assert ours(model_checks.findings({**CONFIG, "model": {"path": trained}}, out, tok())) == []


def test_a_checkpoint_whose_head_was_dropped_and_tied_is_named(trained, tmp_path):
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        src = f"{trained}/{f}"
        try:
            (tmp_path / f).write_text(open(src).read())
        except FileNotFoundError:
            pass
    state = load_file(f"{trained}/model.safetensors")
    state.pop("lm_head.weight")
    save_file(state, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    c = json.loads((tmp_path / "config.json").read_text())
    c["tie_word_embeddings"] = True
    (tmp_path / "config.json").write_text(json.dumps(c))
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path))
    fs = ours(model_checks.findings({**CONFIG, "model": {"path": str(tmp_path)}}, {"actor": model}, tok()))
    assert [(f.kind, f.severity) for f in fs] == [(K.WEIGHTS_UNTRAINED, "error")], fs
    assert "tie_word_embeddings" in fs[0].where and "lm_head" in fs[0].fix
    # the same directory with its head kept is silent
    good = AutoModelForCausalLM.from_pretrained(trained)
    assert ours(model_checks.findings({**CONFIG, "model": {"path": trained}}, {"actor": good}, tok())) == []


def test_a_hook_that_scales_a_critic_is_named_with_its_factor():
    torch.manual_seed(0)
    out = run_setup({"critic": scale_values}, {"critic": ValueModel(lm().model)})
    fs = ours(model_checks.findings(CONFIG, out, tok()))
    assert [(f.kind, f.severity) for f in fs] == [(K.SETUP_HOOK_OUTPUT, "warning")], fs
    assert "2" in fs[0].message and "scale_values" in fs[0].where and "_double" in fs[0].message


def test_an_observing_hook_is_silent():
    out = run_setup({"reference": count_calls}, {"reference": lm().eval()})
    assert ours(model_checks.findings(CONFIG, out, tok())) == []


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_hook_that_replaces_the_mask_is_named_and_a_clean_model_is_padding_invariant(dtype):
    out = run_setup({"actor": dense_attention}, {"actor": lm(dtype=dtype)})
    fs = ours(model_checks.findings(CONFIG, out, tok()))
    assert [(f.kind, f.severity) for f in fs] == [(K.SETUP_MASK_IGNORED, "error")], fs
    assert (
        "attention_mask" in fs[0].message and "dense_attention" in fs[0].where and "_ones_mask" in fs[0].fix
    )
    clean = {"actor": lm(dtype=dtype), "reference": lm(dtype=dtype).eval()}
    assert ours(model_checks.findings(CONFIG, clean, tok())) == []


def test_a_critic_value_head_far_from_the_rewards_is_named():
    torch.manual_seed(0)
    out = run_setup({"critic": value_bias}, {"critic": ValueModel(lm().model)})
    fs = ours(model_checks.findings(CONFIG, out, tok()))
    assert [(f.kind, f.severity) for f in fs] == [(K.SETUP_VALUE_OFFSET, "warning")], fs
    assert "bias" in fs[0].message and "-12" in fs[0].message and "value_bias" in fs[0].where
    torch.manual_seed(0)
    out = run_setup({"critic": value_small}, {"critic": ValueModel(lm().model)})
    assert ours(model_checks.findings(CONFIG, out, tok())) == []


def _renumbered(tmp_path):
    """The project's tokenizer with its vocabulary numbered backwards (same tokens, same size)."""
    t = tok()
    t.save_pretrained(tmp_path)
    spec = json.loads((tmp_path / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    n = len(vocab)
    specials = {a["content"] for a in spec.get("added_tokens", [])}
    plain = [k for k in vocab if k not in specials]
    ids = sorted(vocab[k] for k in plain)
    spec["model"]["vocab"] = {**{k: vocab[k] for k in vocab if k in specials},
                              **dict(zip(plain, reversed(ids), strict=True))}  # fmt: skip
    assert len(spec["model"]["vocab"]) == n
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec))
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tmp_path))


def test_a_tokenizer_numbered_otherwise_than_the_models_is_named(trained, tmp_path):
    other = _renumbered(tmp_path)
    config = {**CONFIG, "model": {"path": trained, "tokenizer": str(tmp_path)}}
    model = AutoModelForCausalLM.from_pretrained(trained)
    fs = ours(model_checks.findings(config, {"actor": model}, other))
    assert [(f.kind, f.severity) for f in fs] == [(K.TOKENIZER_VOCAB, "error")], fs
    assert "model.tokenizer" in fs[0].where and "model.path" in fs[0].fix
    same = {**CONFIG, "model": {"path": trained, "tokenizer": trained}}
    assert ours(model_checks.findings(same, {"actor": model}, tok())) == []


def test_a_decoder_that_does_not_give_back_the_text_is_named(tmp_path):
    t = tok()
    t.save_pretrained(tmp_path)
    spec = json.loads((tmp_path / "tokenizer.json").read_text())
    spec["decoder"] = None  # the library's default: tokens joined with spaces
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec))
    from transformers import AutoTokenizer

    spaced = AutoTokenizer.from_pretrained(str(tmp_path))
    config = {**CONFIG, "model": {"tokenizer": str(tmp_path)}}
    fs = ours(tokenizer_checks.findings(config, spaced, tokenizer_checks.texts(config)))
    assert [(f.kind, f.severity) for f in fs] == [(K.TOKENIZER_DECODE, "error")], fs
    assert "spaces" in fs[0].message and "decoder" in fs[0].fix
    assert tokenizer_checks.findings(CONFIG, tok(), tokenizer_checks.texts(CONFIG)) == []


def test_a_chat_template_that_drops_the_content_is_named():
    t = tok()
    verl = {"data": {"train_files": "x.parquet"}}
    t.chat_template = "{% for message in messages %}{{ message['message'] }}\n{% endfor %}"
    fs = tokenizer_checks.findings(verl, t, None)
    assert [(f.kind, f.severity) for f in fs] == [(K.CHAT_TEMPLATE_CONTENT, "error")], fs
    assert "'message'" in fs[0].message and "content" in fs[0].fix
    t.chat_template = (  # setupg: with the generation prompt (one without it is its own finding)
        "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant: {% endif %}"
    )
    assert tokenizer_checks.findings(verl, t, None) == []


def test_the_checks_leave_the_models_as_they_were():
    model = lm()
    ref = copy.deepcopy(model).eval()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    model_checks.findings(CONFIG, {"actor": model, "reference": ref}, tok())
    assert model.training and not ref.training
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())


def test_the_round_trip_reads_verl_files_too(tmp_path):
    import pandas as pd

    rows = [{"prompt": [{"role": "user", "content": f"{a}*{b}="}], "data_source": "x",
             "reward_model": {"style": "rule", "ground_truth": str(a * b)}} for a in range(2, 6) for b in range(3, 7)]  # fmt: skip
    pd.DataFrame(rows).to_parquet(tmp_path / "rows.parquet")
    config = {"data": {"train_files": str(tmp_path / "rows.parquet")}}
    t = tok()
    t.save_pretrained(tmp_path / "tok")
    spec = json.loads((tmp_path / "tok" / "tokenizer.json").read_text())
    spec["decoder"] = None
    (tmp_path / "tok" / "tokenizer.json").write_text(json.dumps(spec))
    from transformers import AutoTokenizer

    spaced = AutoTokenizer.from_pretrained(str(tmp_path / "tok"))
    fs = tokenizer_checks.findings(config, spaced, None)
    assert [f.kind for f in fs] == [K.TOKENIZER_DECODE] and "'2*3=' -> '2 * 3 ='" in fs[0].message, fs
    assert tokenizer_checks.findings(config, t, None) == []


def test_a_checkpoint_saved_with_its_layers_swapped_does_not_know_the_task(trained, tmp_path):
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        try:
            (tmp_path / f).write_text(open(f"{trained}/{f}").read())
        except FileNotFoundError:
            pass
    state = load_file(f"{trained}/model.safetensors")
    swapped = {k.replace("layers.0.", "layers.@.").replace("layers.1.", "layers.0.").replace("layers.@.", "layers.1."): v
               for k, v in state.items()}  # fmt: skip
    save_file(swapped, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path))
    fs = ours(model_checks.findings({**CONFIG, "model": {"path": str(tmp_path)}}, {"actor": model}, tok()))
    assert [(f.kind, f.severity) for f in fs] == [(K.WEIGHTS_UNTRAINED, "error")], fs
    assert fs[0].where == f"model.path ({tmp_path})" and "layer order" in fs[0].message


def test_a_model_with_absolute_positions_is_padding_invariant_as_the_trainer_calls_it():
    from transformers import GPT2Config, GPT2LMHeadModel

    t = tok()
    torch.manual_seed(0)
    gpt = GPT2LMHeadModel(GPT2Config(vocab_size=len(t), n_embd=32, n_layer=2, n_head=2, n_positions=64,
                                     bos_token_id=t.bos_token_id, eos_token_id=t.eos_token_id))  # fmt: skip
    assert ours(model_checks.findings(CONFIG, {"actor": gpt.train()}, t)) == []


def test_a_user_hooks_side_effects_during_the_checks_are_undone():
    model = lm()
    rot = model.model.rotary_emb

    def cast_and_count(module, args):
        rot.inv_freq = rot.inv_freq.to(torch.bfloat16)
        module.calls = getattr(module, "calls", 0) + 1

    model.register_forward_pre_hook(cast_and_count)
    model_checks.findings(CONFIG, {"actor": model}, tok())
    assert rot.inv_freq.dtype == torch.float32 and not hasattr(model, "calls")


CALLS = {"n": 0}


def test_a_hook_that_acts_on_its_third_call_still_does_so_in_the_run():
    model = lm()
    rot = model.model.rotary_emb
    seen = {"n": 0}

    def third_call(module, args):
        seen["n"] += 1
        CALLS["n"] += 1
        if seen["n"] == 3:
            rot.inv_freq = rot.inv_freq.to(torch.bfloat16)

    model.register_forward_pre_hook(third_call)
    model_checks.findings(CONFIG, {"actor": model}, tok())
    assert seen == {"n": 0} and CALLS == {"n": 0} and rot.inv_freq.dtype == torch.float32
    for _ in range(3):  # the run's third forward: the hook still holds the model's own rotary module
        model(input_ids=torch.tensor([[1, 5, 6]]))
    assert rot.inv_freq.dtype == torch.bfloat16 and model.model.rotary_emb is rot
