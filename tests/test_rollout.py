"""HF generate engine: shapes, masks, sampling log-probs, dtype handling: `pytest tests/test_rollout.py`."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trainer.config import DataConfig, ModelConfig
from trainer.data import PromptCollator, load_examples
from trainer.logprobs import sequence_logprobs
from trainer.models import build_causal_lm
from trainer.precision import resolve_policy
from trainer.rollout import HFGenerateEngine, _to_rollout
from trainer.tokenizer import build_tokenizer

TOK = build_tokenizer()
CPU = torch.device("cpu")


def _setup(preset="fp32", **engine_kwargs):
    policy = resolve_policy(preset)
    actor = build_causal_lm(ModelConfig(), TOK, policy["actor"], CPU, seed=0)
    engine = HFGenerateEngine(actor, TOK, policy["rollout"], device=CPU, max_new_tokens=6, **engine_kwargs)
    batch = PromptCollator(TOK, 10)(load_examples(DataConfig(num_examples=3), seed=0, pairs=False))
    return actor, engine, batch


def test_to_rollout_masks_after_first_eos():
    eos, pad = TOK.eos_token_id, TOK.pad_token_id
    prompt = torch.tensor([[0, 1, 5], [1, 5, 6]])
    # row 0 ends at step 1 (eos), HF then emits pad; row 1 never ends. Generation stopped after 3
    # columns, R = 4: column 3 is padding for both rows.
    gen = torch.tensor([[7, eos, pad], [7, 8, 9]])
    lp = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -0.25, -0.125]])
    r = _to_rollout(prompt, (prompt != 0).long(), gen, lp, 4, pad, eos)
    assert r.response_ids.tolist() == [[7, eos, pad, pad], [7, 8, 9, pad]]
    assert r.response_mask.tolist() == [[1, 1, 0, 0], [1, 1, 1, 0]]
    assert r.logprobs.tolist() == [[-1.0, -2.0, 0.0, 0.0], [-0.5, -0.25, -0.125, 0.0]]
    assert r.input_ids.tolist() == [[0, 1, 5, 7, eos, pad, pad], [1, 5, 6, 7, 8, 9, pad]]
    assert r.attention_mask.tolist() == [[0, 1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1, 0]]
    assert r.responses_text(TOK) == ["3", "345"]


def test_generate_shapes_modes_and_seed():
    actor, engine, batch = _setup()
    actor.train()
    r = engine.generate(batch["input_ids"], batch["attention_mask"], num_samples=2, generator_seed=7)
    assert actor.training  # restored
    assert engine.name == "hf-generate" and engine.engine_dtype == torch.float32
    assert r.prompt_ids.shape == (6, 10) and r.response_ids.shape == (6, 6) and r.input_ids.shape == (6, 16)
    assert torch.equal(r.prompt_ids[0], r.prompt_ids[1]) and torch.equal(
        r.prompt_ids[0], batch["input_ids"][0]
    )
    assert r.logprobs.dtype == torch.float32 and r.response_mask.dtype == torch.int64
    assert (r.logprobs <= 0).all() and (r.logprobs[r.response_mask == 0] == 0).all()
    again = engine.generate(batch["input_ids"], batch["attention_mask"], num_samples=2, generator_seed=7)
    assert torch.equal(r.response_ids, again.response_ids)
    other = engine.generate(batch["input_ids"], batch["attention_mask"], num_samples=2, generator_seed=8)
    assert not torch.equal(r.response_ids, other.response_ids)


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_rollout_logprobs_match_recomputation(temperature):
    actor, engine, batch = _setup(temperature=temperature)
    r = engine.generate(batch["input_ids"], batch["attention_mask"], num_samples=3, generator_seed=0)
    with torch.no_grad():
        lp, _ = sequence_logprobs(actor, r.input_ids, r.attention_mask, 6, temperature=temperature)
    m = r.response_mask.bool()
    torch.testing.assert_close(lp[m], r.logprobs[m], atol=1e-4, rtol=1e-4)


def test_top_k_log_probs_are_renormalised():
    actor, engine, batch = _setup(top_k=3)
    r = engine.generate(batch["input_ids"], batch["attention_mask"], generator_seed=0)
    with torch.no_grad():
        full, _ = sequence_logprobs(actor, r.input_ids, r.attention_mask, 6)
        logits = actor(r.input_ids, attention_mask=r.attention_mask).logits[:, -7:-1].float()
    m = r.response_mask.bool()
    # Under top-3 the sampled token is among the 3 largest logits, and its probability is its share of
    # those 3: log p_topk = log p_full - log(sum of the 3 largest full probabilities).
    top3 = logits.log_softmax(-1).topk(3, dim=-1).values.logsumexp(-1)
    torch.testing.assert_close(r.logprobs[m], (full - top3)[m], atol=1e-4, rtol=1e-4)
    rank = (logits > logits.gather(-1, r.response_ids[..., None])).sum(-1)
    assert (rank[m] < 3).all()


def test_top_p_log_probs_are_renormalised_over_the_nucleus():
    actor, engine, batch = _setup(temperature=0.8, top_p=0.3)
    r = engine.generate(batch["input_ids"], batch["attention_mask"], num_samples=2, generator_seed=0)
    with torch.no_grad():
        logits = actor(r.input_ids, attention_mask=r.attention_mask).logits[:, -7:-1].float() / 0.8
    probs = logits.softmax(-1)
    m = r.response_mask.bool()
    for i, j in m.nonzero().tolist():
        # plain nucleus: the most probable tokens, taken while the mass before them is below 0.3
        order = probs[i, j].argsort(descending=True).tolist()
        kept, before = [], 0.0
        for t in order:
            if before >= 0.3:
                break
            kept.append(t)
            before += float(probs[i, j, t])
        token = int(r.response_ids[i, j])
        assert token in kept and 1 < len(kept) < len(order)
        expected = float(probs[i, j, token].log() - probs[i, j, kept].sum().log())
        assert float(r.logprobs[i, j]) == pytest.approx(expected, abs=1e-4)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**31), p=st.sampled_from([0.1, 0.5, 0.9, 0.99]), vocab=st.integers(2, 200))
def test_top_p_is_transformers_top_p(seed, p, vocab):
    from transformers.generation.logits_process import TopPLogitsWarper

    from trainer.rollout import _TopP

    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(seed)) * 3
    ours = _TopP(p)(None, logits.clone())
    ref = TopPLogitsWarper(p)(None, logits.clone())
    assert torch.equal(torch.isinf(ours), torch.isinf(ref))
    torch.testing.assert_close(ours.log_softmax(-1), ref.log_softmax(-1))


def test_bf16_rollout_of_fp32_actor_generates_under_autocast():
    actor, engine, batch = _setup("bf16")
    assert next(actor.parameters()).dtype == torch.float32
    assert engine.engine_dtype == torch.bfloat16 and "autocast" in engine.dtype_reason
    seen = []
    hook = actor.lm_head.register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    try:
        r = engine.generate(batch["input_ids"], batch["attention_mask"], generator_seed=0)
    finally:
        hook.remove()
    assert seen and set(seen) == {torch.bfloat16}
    with torch.no_grad():
        lp32, _ = sequence_logprobs(actor, r.input_ids, r.attention_mask, 6)
    m = r.response_mask.bool()
    diff = (lp32[m] - r.logprobs[m]).abs()
    assert diff.max() > 0  # bf16 sampling distribution is not the fp32 one ...
    assert diff.max() < 0.5  # ... but close to it for a tiny model


def test_engine_argument_errors():
    actor, _, _ = _setup()
    policy = resolve_policy("fp32")["rollout"]
    with pytest.raises(ValueError, match="algo.temperature: must be > 0"):
        HFGenerateEngine(actor, TOK, policy, device=CPU, max_new_tokens=4, temperature=0.0)
    with pytest.raises(ValueError, match=r"rollout.top_p: must be in \(0, 1\]"):
        HFGenerateEngine(actor, TOK, policy, device=CPU, max_new_tokens=4, top_p=0.0)
    with pytest.raises(ValueError, match="algo.top_k: must be >= 0"):
        HFGenerateEngine(actor, TOK, policy, device=CPU, max_new_tokens=4, top_k=-1)
