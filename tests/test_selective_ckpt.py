"""Selective activation checkpointing (``precision.checkpoint_layers``), its planner model and
``auto`` resolution, and compiled decoder layers (``model.compile``).

Run: ``pytest tests/test_selective_ckpt.py``.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import LlamaConfig

from trainer.config import ModelConfig, PrecisionConfig, TrainConfig
from trainer.models import PRESETS, build_causal_lm, compile_layers, decoder_layers, load_tokenizer
from trainer.precision import resolve_policy
from verlaudit.plan.memory_model import GIB, Architecture, Estimate, Logits, Shape, TrainedModel, train_phases
from verlaudit.plan.planner import AUTO_HEADROOM, plan_config, resolve_checkpoint_layers

THREE_LAYERS = ModelConfig(preset="tiny-llama", overrides={"num_hidden_layers": 3})


def _model(checkpoint_layers, ckpt=True, seed=0, cfg=THREE_LAYERS):
    pol = resolve_policy("fp32", grad_checkpointing=ckpt, checkpoint_layers=checkpoint_layers)["actor"]
    tok = load_tokenizer(cfg)
    model = build_causal_lm(cfg, tok, pol, "cpu", seed=seed)
    model.train()
    return model


def _grads_and_mlp_calls(model):
    """Parameter gradients of one forward/backward, and how often each layer's MLP ran (2 = recomputed)."""
    calls = [0] * len(decoder_layers(model))
    handles = [
        layer.mlp.register_forward_pre_hook(lambda *_, i=i: calls.__setitem__(i, calls[i] + 1))
        for i, layer in enumerate(decoder_layers(model))
    ]
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 90, (2, 12), generator=g)
    out = model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False).logits
    out.float().pow(2).mean().backward()
    for h in handles:
        h.remove()
    return [p.grad.clone() for p in model.parameters()], calls


def test_first_n_layers_recompute_the_rest_keep_activations_same_gradients():
    full, calls_full = _grads_and_mlp_calls(_model(None))
    none, calls_none = _grads_and_mlp_calls(_model(None, ckpt=False))
    sel, calls_sel = _grads_and_mlp_calls(_model(1))
    assert calls_full == [2, 2, 2]  # every layer recomputed in backward
    assert calls_none == [1, 1, 1]
    assert calls_sel == [2, 1, 1]  # only the first layer is checkpointed
    # recomputation is deterministic on CPU: same gradients bit for bit whichever layers recompute
    for a, b, c in zip(full, none, sel):
        assert torch.equal(a, b) and torch.equal(a, c)


def test_checkpointing_leaves_no_input_require_grads_hook():
    # only reentrant checkpointing needs it; its requires_grad_() breaks the compiled decode forward
    model = _model(None)
    emb = model.get_input_embeddings()
    assert not emb._forward_hooks
    ids = torch.randint(3, 90, (1, 5))
    with torch.no_grad():
        assert not emb(ids).requires_grad


def test_checkpoint_layers_zero_keeps_every_layer():
    _, calls = _grads_and_mlp_calls(_model(0))
    assert calls == [1, 1, 1]
    assert all(not layer.gradient_checkpointing for layer in decoder_layers(_model(0)))


def test_more_layers_than_the_model_has_is_a_clear_error():
    with pytest.raises(ValueError, match=r"checkpoint_layers: 4, but the actor model has 3 decoder layers"):
        _model(4)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (
            {"grad_checkpointing": True, "checkpoint_layers": -1},
            r"precision\.checkpoint_layers: expected a number",
        ),
        (
            {"grad_checkpointing": True, "checkpoint_layers": True},
            r"precision\.checkpoint_layers: True matches none of",
        ),
        ({"grad_checkpointing": True, "checkpoint_layers": "half"}, r"checkpoint_layers: expected a number"),
        ({"grad_checkpointing": False, "checkpoint_layers": 2}, r"grad_checkpointing is off for every role"),
        ({"grad_checkpointing": False, "checkpoint_layers": "auto"}, r"auto needs grad_checkpointing"),
    ],
)
def test_bad_checkpoint_layers_name_the_field(kwargs, match):
    with pytest.raises(ValueError, match=match):
        TrainConfig.from_dict({"precision": {"preset": "bf16", **kwargs}})


def test_auto_is_for_the_harness_the_trainer_needs_a_number():
    pc = PrecisionConfig(preset="bf16", grad_checkpointing=True, checkpoint_layers="auto")
    with pytest.raises(ValueError, match="auto is chosen by `verlaudit run`"):
        pc.build_policy("cpu")
    # the config itself is valid (suites carry auto) and keeps it through a round trip
    cfg = TrainConfig.from_dict(
        {"precision": {"preset": "bf16", "grad_checkpointing": True, "checkpoint_layers": "auto"}}
    )
    assert TrainConfig.from_dict(cfg.to_dict()).precision.checkpoint_layers == "auto"


def _estimate(preset: str, n: int | None, ckpt: bool = True, seqs: int = 8) -> Estimate:
    arch = Architecture.from_config(LlamaConfig(**PRESETS["llama2-7b"]))
    pol = resolve_policy(preset, grad_checkpointing=ckpt, checkpoint_layers=n if ckpt else None)["actor"]
    m = TrainedModel(arch=arch, kind="causal_lm", policy=pol)
    shape = Shape(sequences=seqs, seq_len=1024, logit_positions=1024, padded=False)
    return Estimate(
        tuple(train_phases(m, shape, accumulation=False, resident={}, logits=Logits(island="hf-loss")))
    )


@pytest.mark.parametrize("preset", ["bf16", "bf16-pure", "fp32"])
def test_planner_selective_ends_match_full_and_no_checkpointing(preset):
    assert _estimate(preset, 32).peak_bytes == _estimate(preset, None).peak_bytes
    # nothing checkpointed: the same activations as checkpointing off (the top of backward)
    none, zero = _estimate(preset, None, ckpt=False), _estimate(preset, 0)
    assert none.peak_bytes == zero.peak_bytes


@settings(max_examples=20, deadline=None)
@given(
    preset=st.sampled_from(["fp32", "fp16", "bf16", "bf16-pure"]),
    n=st.integers(0, 31),
    seqs=st.integers(1, 16),
)
def test_planner_each_kept_layer_costs_memory(preset, n, seqs):
    # one more checkpointed layer never needs more memory than one fewer
    assert _estimate(preset, n + 1, seqs=seqs).peak_bytes <= _estimate(preset, n, seqs=seqs).peak_bytes


def test_planner_kept_layer_cost_hand_worked():
    # bf16 autocast over fp32 masters, 8 x 1024 tokens: a kept layer saves 30h + 8I bytes per token,
    # + 2 x 4 for the two fp32 rsqrt and 32 heads x 4 for SDPA's fp32 log-sum-exp, plus its fp32 input
    # (4h) in place of the 4h checkpoint boundary; and it keeps its bf16 weight copies (2 bytes x
    # 202_375_168 matmul params) alive to the top of backward:
    # (30 * 4096 + 8 * 11008 + 136) * 8192 + 2 * 202_375_168 = 1_729_167_360 + 404_750_336 bytes.
    top = {p.name: p.total for p in _estimate("bf16", 31).phases}
    top_full = {p.name: p.total for p in _estimate("bf16", 32).phases}
    key = "actor_update: top of backward"
    assert top[key] - top_full[key] == (30 * 4096 + 8 * 11008 + 136) * 8192 + 2 * 202_375_168


def _dpo_7b(n="auto", preset="bf16-pure"):
    return TrainConfig.from_dict(
        {
            "model": {"preset": "llama2-7b"},
            "data": {"prompt_length": 512, "response_length": 512},
            "algo": {"name": "dpo", "batch_size": 8, "mini_batch_size": 8, "micro_batch_size": 8},
            "precision": {"preset": preset, "grad_checkpointing": True, "checkpoint_layers": n},
        }
    )


@pytest.mark.parametrize("preset,target", [("bf16-pure", 139.8), ("bf16", 139.8), ("bf16", 80.0)])
def test_auto_picks_the_fewest_checkpointed_layers_that_fit(preset, target):
    cfg, note = resolve_checkpoint_layers(_dpo_7b(preset=preset), target_gib=target)
    n = cfg.precision.checkpoint_layers
    budget = target * (1 - AUTO_HEADROOM)

    def need(k):
        return plan_config(_dpo_7b(k, preset))[0].device_bytes() / GIB

    assert "checkpoint_layers auto" in note
    if n is None:  # nothing fits: all layers checkpointed, and the note says it does not fit
        assert need(32) > budget and "exceed" in note
    else:
        assert need(n) <= budget and f"{n} of 32" in note
        if n > 0:
            assert need(n - 1) > budget


def test_auto_on_cpu_checkpoints_everything():
    cfg, note = resolve_checkpoint_layers(_dpo_7b(), target_gib=None)
    assert cfg.precision.checkpoint_layers is None and "CPU" in note
    unchanged, none = resolve_checkpoint_layers(_dpo_7b(3), target_gib=80.0)
    assert unchanged.precision.checkpoint_layers == 3 and none is None


def test_compiled_layers_match_eager_and_stay_eager_with_a_cache_or_hooks():
    # Inductor on CPU (C++ codegen): one traced graph shared by the layers
    cfg = dataclasses.replace(THREE_LAYERS, overrides={"num_hidden_layers": 2})
    eager = _model(1, cfg=cfg)
    compiled = _model(1, cfg=cfg)
    assert compile_layers(compiled) == 2
    ge, _ = _grads_and_mlp_calls(eager)
    gc, calls = _grads_and_mlp_calls(compiled)  # the probe hook forces eager: every MLP call is counted
    assert calls == [2, 1]
    compiled.zero_grad()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 90, (2, 12), generator=g)
    out = compiled(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False).logits
    out.float().pow(2).mean().backward()
    ref = eager(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False).logits
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    for p, q in zip(compiled.parameters(), ge):
        torch.testing.assert_close(p.grad, q, rtol=1e-4, atol=1e-5)
    for a, b in zip(gc, ge):
        assert torch.equal(a, b)  # hooked (eager) pass: bitwise the eager model
    # generation passes a KV cache: the layers run eagerly, same tokens as the eager model
    compiled.eval()
    eager.eval()
    kw = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        assert torch.equal(compiled.generate(ids, **kw), eager.generate(ids, **kw))


def _compiled_layer_bytes(preset, cfg, monkeypatch, **kw):
    """Bytes per token a compiled decoder layer saves (tests/test_plan.py's hook measurement)."""
    import transformers.models.llama.modeling_llama as ml

    from tests.test_plan import _measured_layer_bytes

    torch._dynamo.reset()  # a fresh graph per case: the tests together would pass the recompile limit
    compiled = torch.compile(ml.LlamaDecoderLayer.forward, dynamic=False)
    monkeypatch.setattr(ml.LlamaDecoderLayer, "forward", lambda self, *a, **k: compiled(self, *a, **k))
    batch, seq = 2, 32
    saved, _ = _measured_layer_bytes(preset, cfg, batch, seq, **kw)
    return saved // (batch * seq)


@pytest.mark.parametrize(
    "preset",
    [
        "bf16",
        "bf16-pure",
        pytest.param("fp32", marks=pytest.mark.slow),
        pytest.param("fp16", marks=pytest.mark.slow),
    ],
)
def test_compiled_layer_saved_bytes_match_the_hooks(preset, monkeypatch):
    from verlaudit.plan.memory_model import ActDtypes, compiled_layer_saved_bytes

    cfg = LlamaConfig(
        hidden_size=128,
        intermediate_size=352,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        vocab_size=50,
        attn_implementation="sdpa",
    )
    d = ActDtypes.of(resolve_policy(preset)["actor"])
    measured = _compiled_layer_bytes(preset, cfg, monkeypatch)
    # the measurement leaves out the layer's own input (r h), which the model counts
    arch = Architecture.from_config(cfg)
    assert measured == compiled_layer_saved_bytes(arch, d, seq_len=32, padded=False) - d.r * 128


@pytest.mark.parametrize(
    "preset,padded,math",
    [
        ("bf16-pure", False, False),
        ("bf16", True, False),
        pytest.param("fp16", False, False, marks=pytest.mark.slow),
        pytest.param("fp32", True, False, marks=pytest.mark.slow),
        pytest.param("fp32", False, True, marks=pytest.mark.slow),
    ],
)
def test_compiled_gqa_layer_saved_bytes_match_the_hooks(preset, padded, math, monkeypatch):
    # 8 query heads of 24 over 2 kv heads: q = 192 is wider than h = 128, which tells o_proj's input
    # (c q) from the hidden-width tensors Inductor saves (3 c h). bf16-pure unpadded, per token:
    # 3 x 2 x 128 + 2 x (192 + 2 x 48) (q, k, v) + 2 x 192 + 4 x 8 (SDPA out, lse) + 3 x 2 x 352
    # + 2 x 24 (cos/sin) + 8 = 768 + 576 + 416 + 2112 + 48 + 8 = 3928, plus the input 2 x 128.
    # ``math``: the math kernel CUDA runs fp32 GQA on without a mask, forced here on CPU.
    from tests.test_plan import GQA
    from verlaudit.plan.memory_model import ActDtypes, compiled_layer_saved_bytes

    cfg = LlamaConfig(**dict(GQA.to_dict(), head_dim=24))
    d = ActDtypes.of(resolve_policy(preset)["actor"])
    measured = _compiled_layer_bytes(preset, cfg, monkeypatch, padded=padded, math=math)
    predicted = compiled_layer_saved_bytes(
        Architecture.from_config(cfg), d, seq_len=32, padded=padded, device_type="cuda" if math else "cpu"
    )
    if preset == "bf16-pure":
        assert predicted == 3928 + 256
    assert measured == predicted - d.r * 128


@pytest.mark.parametrize(
    "precision,layers,measured",
    [("bf16", 11, 109.869), ("bf16-pure", 0, 72.355)],  # H200, reports/gpu/h200_update_selective_compile.json
)
def test_planner_compiled_update_matches_the_h200(precision, layers, measured):
    from benchmarks.bench_update import planned

    _, alloc = planned("llama2-7b", precision, True, layers, "chunked", 8, 1024, compiled=True)
    assert abs(alloc - measured) / measured < 0.02


@pytest.mark.parametrize(
    "runs",
    [
        "llama7b_h200_suite",
        "llama7b_h200_suite_2",
        "llama7b_h200_grpo_suite",
        "llama7b_h200_grpo_fast_static",
    ],
)
def test_planner_matches_every_committed_h200_run(runs):
    # every completed 7B run on the H200, compiled or not, from the config its manifest recorded
    from pathlib import Path

    from benchmarks.planner_vs_runs import measured
    from verlaudit.analysis.diagnose.failure import run_plan_inputs
    from verlaudit.rundir import read_run

    root = Path(__file__).resolve().parents[1] / "reports" / "gpu" / runs
    checked = 0
    for run_dir in sorted(p for p in root.iterdir() if (p / "manifest.json").is_file()):
        m = measured(run_dir)
        if not m["peak_gib"] or not m["status"].startswith("completed"):
            continue
        cfg, policy, gpus, optimizer = run_plan_inputs(read_run(run_dir))
        est, _ = plan_config(cfg, gpus=gpus, optimizer=optimizer, policy=policy)
        assert abs(est.peak_bytes / GIB - m["peak_gib"]) / m["peak_gib"] < 0.02, run_dir.name
        checked += 1
    assert checked >= 1


@pytest.mark.parametrize("command", ["run", "plan"])
def test_too_many_checkpoint_layers_stop_before_any_run(tmp_path, capsys, command):
    from verlaudit import cli

    suite = tmp_path / "s.yaml"
    suite.write_text(
        "name: s\ntrain: {model: {preset: tiny-llama}, steps: 1, device: cpu}\n"
        "variants:\n  v1:\n    precision: {preset: fp32, grad_checkpointing: true, checkpoint_layers: 5}\n"
    )
    argv = [command, str(suite)] + (["--out", str(tmp_path / "out")] if command == "run" else [])
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "variants.v1.precision.checkpoint_layers: 5, but the model has 2 decoder layers" in err
    assert not (tmp_path / "out" / "v1").exists()  # nothing was started
