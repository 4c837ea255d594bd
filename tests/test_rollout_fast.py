"""Static-cache decode engine against HF generate: `pytest tests/test_rollout_fast.py` (GPU part: `-m gpu`).

The static engine must be a drop-in for `HFGenerateEngine`: same seed -> same tokens, log-probs equal
up to the last bits of the logits (attention over a padded preallocated cache sums in another order).
Its decode step samples with torch.multinomial's own draw written out (multinomial's host-side input
check cannot be captured by a CUDA graph), so further tests pin that the draw is the same, that a
non-finite distribution still fails with multinomial's message, and that ``rollout.compile`` gives the
eager step's tokens.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

# the engine keeps no timing of its own: the benchmark's subclass records steps, capture and compile
from benchmarks.rollout_bench import TimedStaticDecodeEngine
from trainer.config import DataConfig, ModelConfig, TrainConfig
from trainer.data import PromptCollator, load_examples
from trainer.engines import build_engine
from trainer.logprobs import sequence_logprobs
from trainer.models import build_causal_lm
from trainer.precision import resolve_policy
from trainer.rollout import HFGenerateEngine, StaticDecodeEngine
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
    fast = TimedStaticDecodeEngine(actor, TOK, policy, device=device, max_new_tokens=R, **kw)
    return hf, fast


def _assert_same(a, b, atol=1e-5):
    assert torch.equal(a.response_ids, b.response_ids)
    assert torch.equal(a.response_mask, b.response_mask)
    assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.attention_mask, b.attention_mask)
    torch.testing.assert_close(a.logprobs, b.logprobs, atol=atol, rtol=0)


@pytest.mark.parametrize(
    "kw",
    [
        {},
        {"temperature": 0.6},
        {"temperature": 0.6, "top_k": 5},
        {"temperature": 0.6, "top_k": 50, "top_p": 0.5},
    ],
)
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
        return  # top-k / top-p renormalisation is checked against recomputation in tests/test_rollout.py
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


@pytest.mark.parametrize("fused", [False, True], ids=["hf-forward", "fused"])
@settings(max_examples=8, deadline=None)
@given(
    pads=st.lists(st.integers(min_value=0, max_value=6), min_size=2, max_size=2),
    seed=st.integers(min_value=0, max_value=2**16),
)
def test_any_left_padding_gives_hf_tokens(fused, pads, seed):
    """Our decode loop, over the HF forward or `rollout.engine: fused`'s own (tests/test_fused_decode.py)."""
    actor, policy = _ACTOR
    hf = HFGenerateEngine(actor, TOK, policy, device=CPU, max_new_tokens=R)
    fast = StaticDecodeEngine(actor, TOK, policy, device=CPU, max_new_tokens=R, fused=fused)
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
    assert type(build_engine(actor, TOK, policy, engine="static", **kw)) is StaticDecodeEngine
    with pytest.raises(ValueError, match="rollout.engine: 'paged'"):
        build_engine(actor, TOK, policy, engine="paged", **kw)
    with pytest.raises(ValueError, match="rollout.cuda_graphs: needs rollout.engine: static or fused"):
        build_engine(actor, TOK, policy, cuda_graphs=True, **kw)
    with pytest.raises(ValueError, match="rollout.cuda_graphs: CUDA graphs need a CUDA device"):
        build_engine(actor, TOK, policy, engine="static", cuda_graphs=True, **kw)
    with pytest.raises(ValueError, match="algo.temperature: must be > 0"):
        StaticDecodeEngine(actor, TOK, policy, temperature=0.0, **kw)


def _assert_graph_replays_eager(eager, graphs) -> None:
    """Seeds 0, 1, 0 through both engines: every call captures a fresh graph over fresh buffers; the
    graph replays the eager step's kernels (forward and sampling, compiled or not) on the same inputs
    and its random draws take the philox offsets the eager steps take, so the results are bitwise the
    same; the seeded fork of the generator makes a run reproducible, and another seed draws otherwise."""
    batch = _batch()
    runs = []
    for seed in (0, 1, 0):
        a = eager.generate(batch["input_ids"], batch["attention_mask"], num_samples=4, generator_seed=seed)
        b = graphs.generate(batch["input_ids"], batch["attention_mask"], num_samples=4, generator_seed=seed)
        assert torch.equal(a.response_ids, b.response_ids) and torch.equal(a.logprobs, b.logprobs)
        runs.append(b)
    assert torch.equal(runs[0].response_ids, runs[2].response_ids)
    assert not torch.equal(runs[0].response_ids, runs[1].response_ids)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("preset", ["fp32", "bf16", "bf16-pure"])
def test_cuda_graph_decode_replays_the_eager_loop(preset):
    cuda = torch.device("cuda")
    actor, policy = _actor(preset, device=cuda, eos_bias=1.0)
    eager = StaticDecodeEngine(actor, TOK, policy, device=cuda, max_new_tokens=R)
    graphs = TimedStaticDecodeEngine(actor, TOK, policy, device=cuda, max_new_tokens=R, cuda_graphs=True)
    _assert_graph_replays_eager(eager, graphs)
    assert graphs.name == "static-decode+cuda-graphs" and graphs.last_stats["capture_s"] > 0


# verlaudit's log parser and diagnose recognise sampling failures by this message (verlaudit/analysis/logs/records.py)
MULTINOMIAL_NAN = r"probability tensor contains either `inf`, `nan` or element < 0"


@settings(max_examples=20, deadline=None)
@given(
    rows=st.integers(min_value=1, max_value=5),
    vocab=st.integers(min_value=2, max_value=300),
    temperature=st.sampled_from([1.0, 0.7]),
    top_k=st.sampled_from([0, 1, 3]),
    seed=st.integers(min_value=0, max_value=2**31),
)
def test_device_draw_is_torch_multinomial(rows, vocab, temperature, top_k, seed):
    actor, policy = _ACTOR
    engine = StaticDecodeEngine(
        actor, TOK, policy, device=CPU, max_new_tokens=2, temperature=temperature, top_k=top_k
    )
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3
    torch.manual_seed(seed)
    ours, logsm = engine._sample(logits)
    # the reference: HF's sampler on the same processed scores, same generator state
    scores = logits / temperature
    if top_k:
        kth = torch.topk(scores, min(top_k, vocab), dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    torch.manual_seed(seed)
    ref = torch.multinomial(torch.softmax(scores, -1), num_samples=1).squeeze(1)
    assert torch.equal(ours, ref)
    torch.testing.assert_close(logsm, scores.log_softmax(-1), atol=0, rtol=0)
    if top_k == 1:  # one candidate left: the draw is the argmax whatever the seed
        assert torch.equal(ours, logits.argmax(-1))


def test_nonfinite_logits_fail_with_multinomials_message():
    actor, policy = _actor()
    with torch.no_grad():
        actor.lm_head.weight[3, 0] = float("nan")  # every row's logit 3 is NaN from the prefill on
    batch = _batch()
    hf = HFGenerateEngine(actor, TOK, policy, device=CPU, max_new_tokens=4)
    fast = StaticDecodeEngine(actor, TOK, policy, device=CPU, max_new_tokens=4)
    for engine in (hf, fast):  # same failure, same message, either engine
        with pytest.raises(RuntimeError, match=MULTINOMIAL_NAN):
            engine.generate(batch["input_ids"], batch["attention_mask"], generator_seed=0)


def test_decode_hook_sees_every_buffer_the_step_advances():
    """The benchmark's hook replays extra steps and restores the state it is given; if that state
    missed a buffer the step advances, the run would differ from one without the hook."""
    actor, policy = _actor(eos_bias=1.0)
    batch = _batch()
    engine = TimedStaticDecodeEngine(actor, TOK, policy, device=CPU, max_new_tokens=R)
    plain = engine.generate(batch["input_ids"], batch["attention_mask"], num_samples=2, generator_seed=3)
    calls = []

    def hook(replay, state):
        saved = {k: v.clone() for k, v in state.items()}
        rng = torch.get_rng_state()
        for _ in range(3):
            replay()
        assert not torch.equal(state["col"], saved["col"])  # the replays did advance the step
        calls.append(int(saved["col"]))
        for k, v in state.items():
            v.copy_(saved[k])
        torch.set_rng_state(rng)

    engine.on_decode_ready = hook
    hooked = engine.generate(batch["input_ids"], batch["attention_mask"], num_samples=2, generator_seed=3)
    # called once, after the first decode step: columns 0 (prefill) and 1 are written, 2 is next
    assert calls == [2]
    assert torch.equal(plain.response_ids, hooked.response_ids)
    assert torch.equal(plain.logprobs, hooked.logprobs)


def test_compile_option_errors():
    actor, policy = _ACTOR
    with pytest.raises(ValueError, match="rollout.compile: needs rollout.engine: static or fused"):
        build_engine(actor, TOK, policy, device=CPU, max_new_tokens=4, compile=True)
    with pytest.raises(ValueError, match="rollout.compile: needs rollout.engine: static or fused"):
        TrainConfig.from_dict({"rollout": {"compile": True}})
    cfg = TrainConfig.from_dict({"rollout": {"compile": True, "engine": "static"}})
    assert cfg.rollout.compile and TrainConfig.from_dict(cfg.to_dict()) == cfg
    engine = build_engine(actor, TOK, policy, device=CPU, max_new_tokens=4, engine="static", compile=True)
    assert engine.compile and engine.name == "static-decode+compile"


def test_compiled_decode_gives_the_eager_tokens():
    """Inductor on CPU (~30 s on 2 cores): the whole single-token forward traces as one graph
    (fullgraph=True raises on any break), the tokens equal the eager loop's and the second call
    reuses the compiled code (compile_s 0)."""
    actor, policy = _actor(eos_bias=1.0)
    batch = _batch()
    eager = StaticDecodeEngine(actor, TOK, policy, device=CPU, max_new_tokens=R)
    compiled = TimedStaticDecodeEngine(actor, TOK, policy, device=CPU, max_new_tokens=R, compile=True)
    for seed in (0, 1):
        a = eager.generate(batch["input_ids"], batch["attention_mask"], num_samples=2, generator_seed=seed)
        b = compiled.generate(batch["input_ids"], batch["attention_mask"], num_samples=2, generator_seed=seed)
        # fused fp32 kernels reduce in another order: logits move in the last bits, which flips a
        # sampled token only at a near-tie of probs / q (odds ~1e-6 per token here)
        assert torch.equal(a.response_ids, b.response_ids) and torch.equal(a.response_mask, b.response_mask)
        torch.testing.assert_close(a.logprobs, b.logprobs, atol=1e-5, rtol=0)
        stats = compiled.last_stats
        if seed == 0:
            assert stats["compile_s"] > 0 and stats["timed_steps"] == stats["decode_steps"] - 1
        else:
            assert stats["compile_s"] == 0 and stats["timed_steps"] == stats["decode_steps"]
    assert a.response_mask.sum(1).min() < R  # eos ended some rows: pad forcing ran in both


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("preset", ["fp32", "bf16-pure"])
def test_compiled_step_captured_replays_the_compiled_eager_loop(preset):
    cuda = torch.device("cuda")
    actor, policy = _actor(preset, device=cuda, eos_bias=1.0)
    kw = dict(device=cuda, max_new_tokens=R, compile=True)
    eager = StaticDecodeEngine(actor, TOK, policy, **kw)
    graphs = TimedStaticDecodeEngine(actor, TOK, policy, cuda_graphs=True, **kw)
    assert graphs.name == "static-decode+compile+cuda-graphs"
    _assert_graph_replays_eager(eager, graphs)
    assert graphs.last_stats["capture_s"] > 0 and graphs.last_stats["compile_s"] == 0


@pytest.mark.parametrize("engine_cls", [HFGenerateEngine, StaticDecodeEngine])
def test_rollout_carries_left_padding_to_its_micro_batches(engine_cls):
    """A rollout knows whether its prompts were left-padded (read once from the prompt mask), and a
    micro-batch of it keeps that, so its training forwards read no mask back from the device."""
    from tests.test_attention_mask import _HostReads
    from trainer.ppo import _select

    actor, policy = _ACTOR
    engine = engine_cls(actor, TOK, policy, device=CPU, max_new_tokens=4)
    batch = _batch()
    r = engine.generate(batch["input_ids"], batch["attention_mask"], num_samples=2, generator_seed=0)
    assert r.left_padded is True
    sub = _select(r, torch.tensor([0, 1]))  # row 0's prompt has 1 pad, as a micro-batch it is a new mask
    assert sub.left_padded is True and sub.attention_mask.data_ptr() != r.attention_mask.data_ptr()
    with _HostReads() as reads, torch.no_grad():
        sequence_logprobs(actor, sub.input_ids, sub.attention_mask, 4, left_padded=sub.left_padded)
    assert reads.n == 0
    unpadded = engine.generate(batch["input_ids"][:, 5:], batch["attention_mask"][:, 5:], generator_seed=0)
    assert batch["attention_mask"][:, 5:].all() and unpadded.left_padded is False
