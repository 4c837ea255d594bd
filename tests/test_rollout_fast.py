"""Static-cache decode engine against HF generate: `pytest tests/test_rollout_fast.py` (GPU part: `-m gpu`).

The static engine must be a drop-in for `HFGenerateEngine`: same seed -> same tokens, log-probs equal
up to the last bits of the logits (attention over a padded preallocated cache sums in another order).
"""

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
from trainer.rollout import HFGenerateEngine, StaticDecodeEngine, build_engine
from trainer.tokenizer import build_tokenizer

TOK = build_tokenizer()
CPU = torch.device("cpu")
R = 12


def _actor(preset="fp32", device=CPU, eos_bias=0.0):
    policy = resolve_policy(preset)
    actor = build_causal_lm(ModelConfig(), TOK, policy["actor"], device, seed=0)
    if eos_bias:
        # The tiny model's logits are O(0.1) over ~100 ids: a +3 bias makes eos ~17% likely per step,
        # so rows end at different steps and finished rows must be forced to pad like HF does.
        bias = torch.zeros(actor.lm_head.out_features, device=device, dtype=actor.lm_head.weight.dtype)
        bias[TOK.eos_token_id] = eos_bias
        actor.lm_head.bias = torch.nn.Parameter(bias)
    return actor, policy["rollout"]


def _batch(n=3):
    # prompt width 10, left-padded: rows have 9, 5 and 7 real tokens (see the masks in the asserts)
    return PromptCollator(TOK, 10)(load_examples(DataConfig(num_examples=n), seed=0, pairs=False))


def _both(actor, policy, device=CPU, **kw):
    hf = HFGenerateEngine(actor, TOK, policy, device=device, max_new_tokens=R, **kw)
    fast = StaticDecodeEngine(actor, TOK, policy, device=device, max_new_tokens=R, **kw)
    return hf, fast


def _assert_same(a, b, atol=1e-5):
    assert torch.equal(a.response_ids, b.response_ids)
    assert torch.equal(a.response_mask, b.response_mask)
    assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.attention_mask, b.attention_mask)
    torch.testing.assert_close(a.logprobs, b.logprobs, atol=atol, rtol=0)


@pytest.mark.parametrize("kw", [{}, {"temperature": 0.6}, {"temperature": 0.6, "top_k": 5}])
def test_static_engine_matches_hf_generate(kw):
    actor, policy = _actor()
    hf, fast = _both(actor, policy, **kw)
    batch = _batch()
    assert batch["attention_mask"].sum(1).tolist() == [9, 5, 7]  # left padding is exercised
    a = hf.generate(batch["input_ids"], batch["attention_mask"], num_samples=3, generator_seed=0)
    b = fast.generate(batch["input_ids"], batch["attention_mask"], num_samples=3, generator_seed=0)
    _assert_same(a, b)
    assert fast.name == "static-decode" and fast.last_stats["decode_steps"] == R - 1
    if fast.top_k:
        return  # top-k renormalisation is checked against recomputation in tests/test_rollout.py
    with torch.no_grad():
        lp, _ = sequence_logprobs(actor, b.input_ids, b.attention_mask, R, temperature=hf.temperature)
    m = b.response_mask.bool()
    torch.testing.assert_close(lp[m], b.logprobs[m], atol=1e-4, rtol=1e-4)


def test_rows_that_end_are_padded_and_all_ended_stops_early():
    actor, policy = _actor(eos_bias=3.0)
    hf, fast = _both(actor, policy)
    batch = _batch()
    a = hf.generate(batch["input_ids"], batch["attention_mask"], num_samples=4, generator_seed=1)
    b = fast.generate(batch["input_ids"], batch["attention_mask"], num_samples=4, generator_seed=1)
    _assert_same(a, b)
    lengths = b.response_mask.sum(1)
    assert lengths.min() < lengths.max() < R  # rows ended at different steps, all before the end
    # every row has ended by column max(lengths); the check runs after every 8th sampled column, so
    # the loop stops after ceil(max / 8) * 8 columns: 8 sampled columns are 7 decode steps.
    last = int(lengths.max())
    assert fast.last_stats["decode_steps"] == min(-(-last // 8) * 8, R) - 1


@settings(max_examples=8, deadline=None)
@given(
    pads=st.lists(st.integers(min_value=0, max_value=6), min_size=2, max_size=2),
    seed=st.integers(min_value=0, max_value=2**16),
)
def test_any_left_padding_gives_hf_tokens(pads, seed):
    actor, policy = _ACTOR
    hf, fast = _both(actor, policy)
    ids = torch.randint(4, len(TOK), (2, 8), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(ids)
    for row, n in enumerate(pads):
        mask[row, :n] = 0
        ids[row, :n] = TOK.pad_token_id
    a = hf.generate(ids, mask, generator_seed=seed)
    b = fast.generate(ids, mask, generator_seed=seed)
    _assert_same(a, b)


_ACTOR = _actor()


def test_bf16_rollout_of_fp32_actor_decodes_under_autocast():
    actor, policy = _actor("bf16")
    hf, fast = _both(actor, policy)
    assert fast.engine_dtype == torch.bfloat16 and "autocast" in fast.dtype_reason
    seen = []
    hook = actor.lm_head.register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    try:
        batch = _batch()
        r = fast.generate(batch["input_ids"], batch["attention_mask"], generator_seed=0)
    finally:
        hook.remove()
    assert len(seen) == R and set(seen) == {torch.bfloat16}  # one prefill + R-1 decode steps
    with torch.no_grad():
        lp32, _ = sequence_logprobs(actor, r.input_ids, r.attention_mask, R)
    m = r.response_mask.bool()
    diff = (lp32[m] - r.logprobs[m]).abs()
    assert 0 < diff.max() < 0.5  # sampled from bf16 logits, close to fp32 for a tiny model


def test_build_engine_and_option_errors():
    actor, policy = _actor()
    kw = dict(device=CPU, max_new_tokens=4)
    assert type(build_engine(actor, TOK, policy, **kw)) is HFGenerateEngine
    assert type(build_engine(actor, TOK, policy, cache="static", **kw)) is StaticDecodeEngine
    with pytest.raises(ValueError, match="rollout.cache: 'paged'"):
        build_engine(actor, TOK, policy, cache="paged", **kw)
    with pytest.raises(ValueError, match="rollout.cuda_graphs: needs rollout.cache: static"):
        build_engine(actor, TOK, policy, cuda_graphs=True, **kw)
    with pytest.raises(ValueError, match="rollout.cuda_graphs: CUDA graphs need a CUDA device"):
        build_engine(actor, TOK, policy, cache="static", cuda_graphs=True, **kw)
    with pytest.raises(ValueError, match="algo.temperature: must be > 0"):
        StaticDecodeEngine(actor, TOK, policy, temperature=0.0, **kw)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("preset", ["fp32", "bf16", "bf16-pure"])
def test_cuda_graph_decode_replays_the_eager_loop(preset):
    cuda = torch.device("cuda")
    actor, policy = _actor(preset, device=cuda, eos_bias=1.0)
    eager = StaticDecodeEngine(actor, TOK, policy, device=cuda, max_new_tokens=R)
    graphs = StaticDecodeEngine(actor, TOK, policy, device=cuda, max_new_tokens=R, cuda_graphs=True)
    batch = _batch()
    for seed in (0, 1):  # a second call captures a fresh graph over fresh buffers
        a = eager.generate(batch["input_ids"], batch["attention_mask"], num_samples=4, generator_seed=seed)
        b = graphs.generate(batch["input_ids"], batch["attention_mask"], num_samples=4, generator_seed=seed)
        # the graph replays the eager step's kernels on the same inputs: bitwise the same
        assert torch.equal(a.response_ids, b.response_ids) and torch.equal(a.logprobs, b.logprobs)
    assert graphs.name == "static-decode+cuda-graphs" and graphs.last_stats["capture_s"] > 0
