"""Tokenizer, fp32 log-prob island and model builders: `pytest tests/test_models.py`."""

from __future__ import annotations

import math
import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer, LlamaForSequenceClassification

from trainer.config import ModelConfig
from trainer.logprobs import entropy_from_logits, logprobs_from_logits, sequence_logprobs
from trainer.models import (
    PRESETS,
    ValueModel,
    build_causal_lm,
    build_critic,
    build_reference,
    build_reward_model,
    is_checkpointing,
    load_tokenizer,
    preset_config,
    score_with_reward_model,
)
from trainer.precision import resolve_policy
from trainer.tokenizer import CHARACTERS, build_tokenizer

TOK = build_tokenizer()
FP32 = resolve_policy("fp32")
BF16 = resolve_policy("bf16")
BF16_PURE = resolve_policy("bf16-pure")


# ---------------------------------------------------------------- tokenizer


def test_tokenizer_special_ids_and_size():
    assert [TOK.pad_token_id, TOK.bos_token_id, TOK.eos_token_id, TOK.unk_token_id] == [0, 1, 2, 3]
    assert len(TOK) == 4 + len(CHARACTERS) == 100
    assert TOK.padding_side == "left"
    # "<bos>" then one id per character: '1' is the second digit -> 4 + 1
    assert TOK("12 a")["input_ids"] == [1, 5, 6, 4 + CHARACTERS.index(" "), 4 + CHARACTERS.index("a")]
    assert TOK("é", add_special_tokens=False)["input_ids"] == [TOK.unk_token_id]


@settings(max_examples=40, deadline=None)
@given(st.text(alphabet=CHARACTERS, max_size=30))
def test_tokenizer_roundtrip(text):
    ids = TOK(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(text)
    assert TOK.decode(ids) == text
    assert TOK.decode(TOK(text)["input_ids"], skip_special_tokens=True) == text


def test_tokenizer_save_load_left_padding(tmp_path):
    TOK.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    assert loaded.padding_side == "left"
    assert loaded.pad_token_id == 0 and loaded.eos_token_id == 2
    batch = loaded(["1", "123"], padding=True)
    assert batch["input_ids"] == [[0, 0, 1, 5], [1, 5, 6, 7]]
    assert batch["attention_mask"] == [[0, 0, 1, 1], [1, 1, 1, 1]]
    assert loaded.decode([5, 6, 2], skip_special_tokens=True) == "12"


def test_load_tokenizer_sources(tmp_path):
    tok = load_tokenizer(ModelConfig())
    assert len(tok) == 100 and "project character tokenizer" in tok.load_notes[0]
    right = build_tokenizer()
    right.padding_side = "right"
    right.save_pretrained(tmp_path)
    tok = load_tokenizer(ModelConfig(tokenizer=str(tmp_path)))
    assert tok.padding_side == "left"
    assert any("forced left" in n for n in tok.load_notes)
    with pytest.raises(ValueError, match=r"model.tokenizer: '/nonexistent/tok' does not exist"):
        load_tokenizer(ModelConfig(tokenizer="/nonexistent/tok"))


# ---------------------------------------------------------------- log-probs


def test_logprobs_hand_worked():
    # logits [0, ln 3]: softmax = [1/4, 3/4]; log p(1) = ln 0.75, log p(0) = ln 0.25
    logits = torch.tensor([[[0.0, math.log(3.0)], [0.0, math.log(3.0)]]])
    lp = logprobs_from_logits(logits, torch.tensor([[1, 0]]))
    torch.testing.assert_close(lp, torch.tensor([[math.log(0.75), math.log(0.25)]]))
    # entropy = -(1/4 ln 1/4 + 3/4 ln 3/4) = 0.5623...
    ent = entropy_from_logits(logits)
    torch.testing.assert_close(ent, torch.full((1, 2), -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))))
    # temperature 2: logits [0, ln3/2] -> p = [1/(1+sqrt3), sqrt3/(1+sqrt3)]
    lp_t = logprobs_from_logits(logits, torch.tensor([[1, 0]]), temperature=2.0)
    s3 = math.sqrt(3.0)
    torch.testing.assert_close(lp_t, torch.tensor([[math.log(s3 / (1 + s3)), math.log(1 / (1 + s3))]]))


@settings(max_examples=25, deadline=None)
@given(
    b=st.integers(1, 3),
    t=st.integers(1, 6),
    v=st.integers(2, 17),
    chunk=st.integers(1, 64),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
    temperature=st.sampled_from([1.0, 0.7, 1.5]),
    seed=st.integers(0, 1000),
)
def test_chunked_logprobs_equal_naive(b, t, v, chunk, dtype, temperature, seed):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(b, t, v, generator=g) * 4).to(dtype).requires_grad_()
    labels = torch.randint(0, v, (b, t), generator=g)
    naive_in = logits.detach().clone().requires_grad_()
    lp = logprobs_from_logits(logits, labels, temperature=temperature, chunk_elements=chunk)
    naive = (naive_in.float() / temperature).log_softmax(-1).gather(-1, labels[..., None]).squeeze(-1)
    assert lp.dtype == torch.float32 and lp.shape == (b, t)
    assert torch.equal(lp, naive)  # same ops per row: bit-identical, whatever the chunking

    w = torch.randn(b, t, generator=g)
    (lp * w).sum().backward()
    (naive * w).sum().backward()
    assert logits.grad.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(logits.grad.float(), naive_in.grad.float(), atol=tol, rtol=tol)

    logits.grad = None
    naive_in.grad = None
    ent = entropy_from_logits(logits, temperature=temperature, chunk_elements=chunk)
    logp = (naive_in.float() / temperature).log_softmax(-1)
    naive_ent = -(logp.exp() * logp).sum(-1)
    torch.testing.assert_close(ent, naive_ent, atol=1e-6, rtol=1e-6)
    (ent * w).sum().backward()
    (naive_ent * w).sum().backward()
    torch.testing.assert_close(logits.grad.float(), naive_in.grad.float(), atol=tol, rtol=tol)


def _tiny(policy=FP32, **overrides):
    return build_causal_lm(ModelConfig(overrides=overrides), TOK, policy["actor"], "cpu", seed=0)


def test_sequence_logprobs_left_padding_matches_unpadded_rows():
    model = _tiny()
    model.eval()
    # Row 0: prompt "12" (left-padded by 2), response "3<eos><pad>"; row 1: prompt "4567", response "89<eos>".
    pad, eos = TOK.pad_token_id, TOK.eos_token_id
    p0, p1 = TOK("12")["input_ids"], TOK("4567")["input_ids"]
    r0 = TOK("3", add_special_tokens=False)["input_ids"] + [eos, pad]
    r1 = TOK("89", add_special_tokens=False)["input_ids"] + [eos]
    ids = torch.tensor([[pad, pad] + p0 + r0, p1 + r1])
    mask = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 0], [1] * 8])
    with torch.no_grad():
        lp, ent = sequence_logprobs(model, ids, mask, 3, compute_entropy=True)
        assert lp.shape == (2, 3) and ent.shape == (2, 3) and lp.dtype == torch.float32
        for row, (prompt, resp, n_real) in enumerate([(p0, r0, 2), (p1, r1, 3)]):
            full = torch.tensor([prompt + resp[:n_real]])
            logits = model(full).logits[0].float()
            want = logits[len(prompt) - 1 : -1].log_softmax(-1).gather(-1, full[0, len(prompt) :, None])[:, 0]
            torch.testing.assert_close(lp[row, :n_real], want, atol=1e-5, rtol=1e-5)


def test_sequence_logprobs_temperature_and_bad_length():
    model = _tiny()
    ids = torch.tensor([TOK("1234")["input_ids"]])
    mask = torch.ones_like(ids)
    with torch.no_grad():
        lp1, _ = sequence_logprobs(model, ids, mask, 2)
        lp2, _ = sequence_logprobs(model, ids, mask, 2, temperature=2.0)
    assert not torch.allclose(lp1, lp2)
    with pytest.raises(ValueError, match="response_length 5 must be in"):
        sequence_logprobs(model, ids, mask, 5)


# ---------------------------------------------------------------- models


@pytest.mark.parametrize("preset,dtype", [("fp32", torch.float32), ("bf16-pure", torch.bfloat16)])
def test_build_from_preset_and_from_saved_dir(tmp_path, preset, dtype):
    policy = resolve_policy(preset, grad_checkpointing=True)
    model = build_causal_lm(ModelConfig(), TOK, policy["actor"], "cpu", seed=3)
    assert {p.dtype for p in model.parameters()} == {dtype}
    assert model.config.vocab_size == len(TOK) and model.config.hidden_size == 64
    assert model.config.num_hidden_layers == 2 and model.config.num_key_value_heads == 2
    assert model.config.use_cache is False and is_checkpointing(model)
    assert model.generation_config.pad_token_id == TOK.pad_token_id
    again = build_causal_lm(ModelConfig(), TOK, policy["actor"], "cpu", seed=3)
    other = build_causal_lm(ModelConfig(), TOK, policy["actor"], "cpu", seed=4)
    w = model.model.layers[0].mlp.up_proj.weight
    assert torch.equal(w, again.model.layers[0].mlp.up_proj.weight)
    assert not torch.equal(w, other.model.layers[0].mlp.up_proj.weight)

    model.save_pretrained(tmp_path)
    TOK.save_pretrained(tmp_path)
    cfg = ModelConfig(path=str(tmp_path))
    loaded = build_causal_lm(cfg, load_tokenizer(cfg), FP32["actor"], "cpu", seed=0)
    assert {p.dtype for p in loaded.parameters()} == {torch.float32}
    assert torch.equal(loaded.model.layers[0].mlp.up_proj.weight, w.float())
    assert not is_checkpointing(loaded)


def test_build_errors(tmp_path):
    actor = FP32["actor"]
    with pytest.raises(ValueError, match=r"model.path: '/no/such/dir' does not exist.*nothing is downloaded"):
        build_causal_lm(ModelConfig(path="/no/such/dir"), TOK, actor, "cpu", seed=0)
    (tmp_path / "weights.bin").write_text("x")
    with pytest.raises(ValueError, match=r"model.path: .*weights.bin' is a file"):
        build_causal_lm(ModelConfig(path=str(tmp_path / "weights.bin")), TOK, actor, "cpu", seed=0)
    with pytest.raises(ValueError, match=r"model.path: .* has no config.json"):
        build_causal_lm(ModelConfig(path=str(tmp_path)), TOK, actor, "cpu", seed=0)
    with pytest.raises(ValueError, match=r"model.preset: unknown preset 'gpt-9'; expected one of tiny-llama"):
        build_causal_lm(ModelConfig(preset="gpt-9"), TOK, actor, "cpu", seed=0)
    with pytest.raises(ValueError, match=r"model.overrides.num_layerz: not a LlamaConfig field"):
        build_causal_lm(ModelConfig(overrides={"num_layerz": 1}), TOK, actor, "cpu", seed=0)


def test_big_presets_are_llama_shapes():
    cfg = preset_config(ModelConfig(preset="llama2-7b"), TOK)
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.intermediate_size) == (
        4096,
        32,
        32,
        11008,
    )
    assert cfg.vocab_size == 32000 and cfg.pad_token_id == TOK.pad_token_id
    assert PRESETS["llama2-13b"]["hidden_size"] == 5120 and PRESETS["llama-1b"]["num_hidden_layers"] == 16


def test_qwen2_preset_has_qkv_biases_and_takes_qwen2_overrides():
    from verlaudit.plan.memory_model import Architecture

    small = {
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 256,
    }
    cfg = ModelConfig(preset="qwen2-7b", overrides=small)
    model = build_causal_lm(cfg, TOK, FP32["actor"], "cpu", seed=0)
    attn = model.model.layers[0].self_attn
    # Qwen2: q/k/v projections carry a bias, o_proj none (a LlamaConfig's attention_bias would add all four)
    assert [getattr(attn, n).bias is not None for n in ("q_proj", "k_proj", "v_proj", "o_proj")] == [
        True,
        True,
        True,
        False,
    ]
    assert type(model).__name__ == "Qwen2ForCausalLM"
    built = preset_config(cfg, TOK)  # transformers 5 keeps rope_theta in rope_parameters, 4.x on the config
    assert (getattr(built, "rope_parameters", None) or {"rope_theta": built.rope_theta})["rope_theta"] == 1e6
    arch = Architecture.from_config(built)
    assert arch.qkv_bias and not arch.o_bias
    with pytest.raises(ValueError, match=r"model.overrides.num_layerz: not a Qwen2Config field"):
        preset_config(ModelConfig(preset="qwen2-7b", overrides={"num_layerz": 1}), TOK)


def test_value_model_and_critic_copy_of_actor():
    actor = _tiny(BF16)
    critic = build_critic(ModelConfig(), TOK, BF16["critic"], "cpu", seed=0, actor=actor)
    assert isinstance(critic, ValueModel)
    assert {p.dtype for p in critic.parameters()} == {torch.float32}
    assert torch.equal(critic.backbone.embed_tokens.weight, actor.model.embed_tokens.weight)
    assert critic.backbone.embed_tokens.weight.data_ptr() != actor.model.embed_tokens.weight.data_ptr()
    # Same init without the actor: rebuilt from the seed.
    rebuilt = build_critic(ModelConfig(), TOK, BF16["critic"], "cpu", seed=0)
    assert torch.equal(
        rebuilt.backbone.layers[1].self_attn.q_proj.weight, actor.model.layers[1].self_attn.q_proj.weight
    )
    ids = torch.tensor([[0, 1, 5, 6], [1, 5, 6, 7]])
    mask = (ids != 0).long()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        values = critic(ids, mask)
    assert values.shape == (2, 4) and values.dtype == torch.float32
    values.sum().backward()
    assert critic.value_head.weight.grad is not None
    pure = build_critic(ModelConfig(), TOK, BF16_PURE["critic"], "cpu", seed=0, actor=actor)
    assert pure.value_head.weight.dtype == torch.bfloat16 and pure(ids, mask).dtype == torch.float32
    gc = build_critic(
        ModelConfig(), TOK, resolve_policy("fp32", grad_checkpointing=True)["critic"], "cpu", seed=0
    )
    assert gc.is_gradient_checkpointing and not critic.is_gradient_checkpointing


def test_critic_from_path(tmp_path):
    actor = _tiny()
    actor.save_pretrained(tmp_path)
    critic = build_critic(ModelConfig(critic_path=str(tmp_path)), TOK, FP32["critic"], "cpu", seed=0)
    assert torch.equal(critic.backbone.norm.weight, actor.model.norm.weight)
    with pytest.raises(ValueError, match=r"model.critic_path: '/nope' does not exist"):
        build_critic(ModelConfig(critic_path="/nope"), TOK, FP32["critic"], "cpu", seed=0)
    # a critic checkpoint whose embedding misses some of the tokenizer's ids is refused, as the actor's is
    from transformers import AutoModelForCausalLM, LlamaConfig

    small = tmp_path / "small"
    cfg = LlamaConfig(
        vocab_size=10, hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2
    )
    AutoModelForCausalLM.from_config(cfg).save_pretrained(small)
    with pytest.raises(ValueError, match=r"model.critic_path: '.*small' embeds 10 ids but the tokenizer has"):
        build_critic(ModelConfig(critic_path=str(small)), TOK, FP32["critic"], "cpu", seed=0)


def test_reference_is_frozen_cast_copy():
    actor = _tiny(resolve_policy("bf16", grad_checkpointing=True))
    ref = build_reference(actor, BF16["reference"])
    assert {p.dtype for p in ref.parameters()} == {torch.bfloat16}
    assert not ref.training and not any(p.requires_grad for p in ref.parameters())
    assert not is_checkpointing(ref) and is_checkpointing(actor)
    assert {p.dtype for p in actor.parameters()} == {torch.float32}  # the actor is untouched
    torch.testing.assert_close(ref.lm_head.weight.float(), actor.lm_head.weight, atol=1e-2, rtol=1e-2)


def test_reward_model_paths(tmp_path):
    assert build_reward_model(ModelConfig(), TOK, FP32["reward"], "cpu") is None
    ids = torch.tensor([[0, 1, 5, 6, 2], [1, 5, 6, 7, 2]])
    mask = (ids != 0).long()

    rm = build_reward_model(ModelConfig(reward_model="preset:tiny-llama"), TOK, BF16["reward"], "cpu")
    assert isinstance(rm, LlamaForSequenceClassification) and not rm.training
    assert rm.config.pad_token_id == 0 and rm.config.num_labels == 1
    with torch.no_grad():
        scores = score_with_reward_model(rm, ids, mask)
    assert scores.shape == (2,) and scores.dtype == torch.bfloat16  # raw, not cast

    rm32 = build_reward_model(ModelConfig(reward_model="preset:tiny-llama"), TOK, FP32["reward"], "cpu")
    rm32.save_pretrained(tmp_path / "rm")
    loaded = build_reward_model(ModelConfig(reward_model=str(tmp_path / "rm")), TOK, FP32["reward"], "cpu")
    with torch.no_grad():
        torch.testing.assert_close(
            score_with_reward_model(loaded, ids, mask), score_with_reward_model(rm32, ids, mask)
        )

    loader = tmp_path / "my_rm.py"
    loader.write_text(
        "import torch\n"
        "class Len(torch.nn.Module):\n"
        "    def forward(self, input_ids, attention_mask):\n"
        "        return attention_mask.sum(-1).half()\n"
        "def load(tokenizer, device):\n"
        "    return Len()\n"
        "def bad(tokenizer, device):\n"
        "    return 3\n"
    )
    user = build_reward_model(ModelConfig(reward_model=f"{loader}:load"), TOK, FP32["reward"], "cpu")
    # row 0 has 4 real tokens, row 1 has 5
    assert score_with_reward_model(user, ids, mask).tolist() == [4.0, 5.0]
    assert score_with_reward_model(user, ids, mask).dtype == torch.float16
    with pytest.raises(
        ValueError, match=r"model.reward_model: loader .*:bad' returned int; expected a torch.nn.Module"
    ):
        build_reward_model(ModelConfig(reward_model=f"{loader}:bad"), TOK, FP32["reward"], "cpu")
    with pytest.raises(ValueError, match=r"model.reward_model: 'nonsense' is neither an existing directory"):
        build_reward_model(ModelConfig(reward_model="nonsense"), TOK, FP32["reward"], "cpu")
    os.remove(loader)
