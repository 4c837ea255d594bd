"""The memory planner: exact parameter counts, per-layer saved activations against what autograd
really saves, the H200 reference peaks (REFERENCE_NUMBERS.md) within stated tolerances, invariants,
and `verlaudit plan` end to end."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import LlamaConfig, LlamaForCausalLM

from trainer.precision import resolve_policy
from verlaudit import cli
from verlaudit.memory_model import (
    GIB,
    ActDtypes,
    Architecture,
    Estimate,
    Logits,
    Shape,
    TrainedModel,
    layer_saved_bytes,
    train_phases,
)

LLAMA2_7B = dict(
    hidden_size=4096,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=32,
    intermediate_size=11008,
    vocab_size=32000,
)


def test_llama2_7b_parameter_count_hand_worked():
    # per layer: attention 4 * 4096^2 = 67,108,864; MLP 3 * 4096 * 11008 = 135,266,304; two norms 8,192
    #   -> 202,383,360; x 32 = 6,476,267,520; embedding and LM head 2 * 32000 * 4096 = 262,144,000;
    #   final norm 4,096 -> 6,738,415,616 (REFERENCE_NUMBERS.md: "6.74 B parameters")
    arch = Architecture.from_config(LlamaConfig(**LLAMA2_7B))
    assert arch.layer_params == 202_383_360
    assert arch.params("causal_lm") == 6_738_415_616
    # critic: backbone + value head (4096 weights + 1 bias) = 6,738,415,616 - 131,072,000 + 4,097
    assert arch.params("value") == 6_607_347_713


@pytest.mark.parametrize(
    "kwargs",
    [
        LLAMA2_7B,
        dict(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=8,
             num_key_value_heads=2, vocab_size=77, tie_word_embeddings=True),
        dict(hidden_size=48, intermediate_size=80, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=4, vocab_size=50, head_dim=16, attention_bias=True, mlp_bias=True),
    ],
)  # fmt: skip
def test_parameter_count_equals_the_real_model(kwargs):
    cfg = LlamaConfig(**kwargs)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    assert Architecture.from_config(cfg).params("causal_lm") == sum(p.numel() for p in model.parameters())


def test_unknown_model_type_is_a_clear_error():
    with pytest.raises(ValueError, match="model_type 'gpt2' is not modelled"):
        Architecture.from_config({"model_type": "gpt2", "hidden_size": 8}, name="m")


def _measured_layer_bytes(preset: str, cfg: LlamaConfig, batch: int, seq: int) -> tuple[int, int]:
    """(bytes per token that autograd saves in decoder layer 1, excluding parameters, autocast's
    weight copies and the layer's own input; bytes of the shared rotary cos/sin it saves)."""
    pol = resolve_policy(preset)["actor"]
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to(pol.param_dtype)
    layer = model.model.layers[1]
    captured = {}
    hook = layer.register_forward_pre_hook(lambda m, a, k: captured.update(a=a, k=k), with_kwargs=True)
    ids = torch.randint(0, cfg.vocab_size, (batch, seq))
    with pol.autocast_ctx("cpu"):
        model(input_ids=ids, use_cache=False)
    hook.remove()
    kwargs = dict(captured["k"])
    x = (captured["a"][0] if captured["a"] else kwargs.pop("hidden_states")).detach().requires_grad_()
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    weights = {(o, i) for o, i in ((cfg.hidden_size, cfg.hidden_size), (cfg.intermediate_size, cfg.hidden_size),
                                   (cfg.hidden_size, cfg.intermediate_size))}  # fmt: skip
    saved: dict[int, int] = {}
    rotary = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal rotary
        key = t.untyped_storage().data_ptr()
        if key in params or key == x.untyped_storage().data_ptr() or key in saved:
            return t
        if t.dim() == 2 and tuple(t.shape) in weights and t.shape[0] != batch * seq:
            saved[key] = 0  # autocast's low-precision weight copy: counted as weight copies, not activations
        elif t.dim() == 4 and t.shape[0] == 1:
            saved[key] = 0
            rotary += t.untyped_storage().nbytes()  # cos / sin [1, 1, T, D], shared by every layer
        else:
            saved[key] = t.untyped_storage().nbytes()
        return t

    with pol.autocast_ctx("cpu"), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        layer(x, **kwargs)
    return sum(saved.values()), rotary


@pytest.mark.parametrize("preset", ["fp32", "bf16", "fp16", "bf16-pure"])
def test_layer_saved_bytes_match_autograd(preset):
    # Hand-worked for fp32, h=64, I=160, 4 heads: normalised tensors 2 x 4h, rsqrt 2 x 4, q/k/v input
    # 4h, q, k, v 12h, SDPA out 4h + lse 4 x 4, mid-layer residual 4h, MLP input 4h, MLP 16I
    # = 36h + 16I + 24 = 2304 + 2560 + 24 = 4888 bytes per token.
    cfg = LlamaConfig(hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=4, vocab_size=50, attn_implementation="sdpa")  # fmt: skip
    batch, seq = 2, 16
    measured, rotary = _measured_layer_bytes(preset, cfg, batch, seq)
    pol = resolve_policy(preset)["actor"]
    predicted = sum(
        layer_saved_bytes(
            Architecture.from_config(cfg), ActDtypes.of(pol), seq_len=seq, padded=False
        ).values()
    )
    if preset == "fp32":
        assert predicted == 4888
    assert measured == predicted * batch * seq
    assert rotary < 0.05 * measured  # the only saved tensor the model leaves out


REFERENCE_SINGLE = [
    # (preset, grad ckpt, measured peak allocated GiB), one H200, 8 x 1024, fused AdamW
    ("bf16", True, 102.4),
    ("bf16-pure", True, 52.1),
    ("fp16", True, 102.4),
    ("fp32", True, 103.8),
]
TOLERANCE = 0.02
"""Relative error allowed against a measured peak (the issue asks for 5%; the model is within ~1%)."""


def _reference_step(preset: str, ckpt: bool, sequences: int, world: int, optimizer: str) -> Estimate:
    """The plain transformers + AdamW step of REFERENCE_NUMBERS.md: labels -> HF loss over every
    position, no padding (causal SDPA without a mask)."""
    arch = Architecture.from_config(LlamaConfig(**LLAMA2_7B))
    pol = resolve_policy(preset, grad_checkpointing=ckpt)["actor"]
    m = TrainedModel(arch=arch, kind="causal_lm", policy=pol, world_size=world, optimizer=optimizer)
    shape = Shape(sequences=sequences, seq_len=1024, logit_positions=1024, padded=False)
    return Estimate(
        tuple(train_phases(m, shape, accumulation=False, resident={}, logits=Logits(island="hf-loss")))
    )


@pytest.mark.parametrize("preset,ckpt,measured", REFERENCE_SINGLE)
def test_single_h200_reference_peaks(preset, ckpt, measured):
    est = _reference_step(preset, ckpt, sequences=8, world=1, optimizer="fused")
    assert abs(est.peak_bytes / GIB - measured) / measured < TOLERANCE
    assert est.peak.name.endswith("bottom of backward")  # fused AdamW adds no step-time temporaries


def test_single_h200_bf16_without_checkpointing_does_not_fit():
    # Measured: OOM with 134.9 GiB allocated at the failing allocation, on a 140.4 GiB H200.
    est = _reference_step("bf16", False, sequences=8, world=1, optimizer="fused")
    assert est.peak_bytes / GIB > 134.9
    assert est.device_bytes() / GIB > 140.4


@pytest.mark.parametrize(
    "preset,measured", [("fp32", 62.8), ("fp16", 62.8), ("bf16", 62.8), ("bf16-pure", 31.7)]
)
def test_two_gpu_fsdp_reference_peaks(preset, measured):
    # 16 x 1024 per GPU, grad ckpt, torch's default (foreach) AdamW: its sqrt(exp_avg_sq) temporary
    # makes the optimizer step the peak: (4 + 4 + 8 + 4) x 6.74e9 / 2 B = 62.76 GiB.
    est = _reference_step(preset, True, sequences=16, world=2, optimizer="foreach")
    assert abs(est.peak_bytes / GIB - measured) / measured < TOLERANCE
    assert est.peak.name.endswith("optimizer step")


@pytest.mark.parametrize("preset", ["fp32", "fp16", "bf16"])
def test_two_gpu_without_checkpointing_does_not_fit_80gb(preset):
    est = _reference_step(preset, False, sequences=16, world=2, optimizer="foreach")
    assert est.device_bytes() / GIB > 80


TINY = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=40)  # fmt: skip


@settings(max_examples=40, deadline=None)
@given(
    preset=st.sampled_from(["fp32", "fp16", "bf16", "bf16-pure"]),
    seqs=st.integers(1, 16),
    seq_len=st.integers(2, 512),
    world=st.sampled_from([1, 2, 4]),
)
def test_invariants(preset, seqs, seq_len, world):
    arch = Architecture.from_config(LlamaConfig(**TINY))

    def peak(ckpt: bool, s: int, w: int) -> int:
        pol = resolve_policy(preset, grad_checkpointing=ckpt)["actor"]
        m = TrainedModel(arch=arch, kind="causal_lm", policy=pol, world_size=w)
        shape = Shape(sequences=s, seq_len=seq_len, logit_positions=seq_len)
        return Estimate(tuple(train_phases(m, shape, accumulation=False, resident={}))).peak_bytes

    # checkpointing costs at most the one boundary it keeps beyond what the layer saves (4 bytes x h
    # per token); a bigger batch never saves memory; more GPUs cost at most the FSDP working set (two
    # gathered layers + one layer's unsharded grads, <= 16 bytes per layer parameter)
    assert peak(True, seqs, world) <= peak(False, seqs, world) + 4 * arch.hidden_size * seqs * seq_len
    assert peak(False, seqs + 1, world) >= peak(False, seqs, world)
    assert peak(True, seqs, 2 * world) <= peak(True, seqs, world) + 16 * arch.layer_params
    # the step always holds at least params + grads + moments
    pol = resolve_policy(preset)["actor"]
    m = TrainedModel(arch=arch, kind="causal_lm", policy=pol, world_size=world)
    assert peak(True, seqs, world) >= sum(m.state().values()) + m.grads()


def test_plan_cli_on_the_7b_suite(capsys):
    assert cli.main(["plan", "suites/llama7b_h200.yaml", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    by = {v["variant"]: v for v in out["variants"]}
    assert by["bf16"]["fits"] is True and by["bf16-no-ckpt"]["fits"] is False
    # bf16-pure stores 8 bytes/param for the actor + 2 for the reference: 10 x 6.74e9 B = 62.8 GiB
    assert 62.8 < by["bf16-pure"]["peak_allocated_gib"] < 62.8 * 1.1
    assert by["bf16"]["target_gib"] == pytest.approx(140.4)
    assert cli.main(["plan", "suites/llama7b_h200.yaml", "--variants", "bf16"]) == 0
    text = capsys.readouterr().out
    assert "bottom of backward" in text and "actor optimizer moments" in text


@pytest.mark.parametrize(
    "argv,match",
    [
        (["suites/llama7b_h200.yaml", "--variants", "nope"], "nope"),
        (["suites/llama7b_h200.yaml", "--gpus", "0"], "--gpus: must be >= 1"),
        (["{tmp}/missing.yaml"], "no such suite file"),
        (["{tmp}/broken.yaml"], r"broken.yaml:3:\d+: YAML error"),
        (["{tmp}/unknown.yaml"], r"precision.preset: unknown preset 'bf61'"),
    ],
)
def test_plan_cli_bad_input_is_one_paragraph_exit_2(tmp_path, capsys, argv, match):
    import re

    (tmp_path / "broken.yaml").write_text("name: x\nvariants: [\n")
    (tmp_path / "unknown.yaml").write_text("name: x\nvariants:\n  a: {precision: {preset: bf61}}\n")
    assert cli.main(["plan", *(a.format(tmp=tmp_path) for a in argv)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("verlaudit plan: error: ") and "Traceback" not in err
    assert err.strip().count("\n") == 0 and re.search(match, err), err


def test_plan_tiny_suite_from_a_saved_model(tmp_path, capsys):
    # The real loading path: model.path points at a save_pretrained directory.
    cfg = LlamaConfig(**TINY)
    LlamaForCausalLM(cfg).save_pretrained(tmp_path / "m")
    suite = tmp_path / "s.yaml"
    suite.write_text(
        f"name: t\ntrain:\n  model: {{path: {tmp_path / 'm'}}}\n  algo: {{name: grpo, batch_size: 2, group_size: 2,"
        " mini_batch_size: 4, micro_batch_size: 2}\nhardware: {target: a100-80gb}\n"
        "variants:\n  a: {precision: {preset: bf16}}\n"
    )
    assert cli.main(["plan", str(suite), "--json"]) == 0
    (v,) = json.loads(capsys.readouterr().out)["variants"]
    n = Architecture.from_config(cfg).params("causal_lm")
    # fp32 master + grads + two fp32 moments + bf16 reference, at least
    assert v["peak_allocated_gib"] * GIB >= n * (4 + 4 + 8 + 2)
    assert v["fits"] is True


def test_run_world_size_reads_the_workers_distributed_record(tmp_path):
    # torchrun workers write manifest.distributed.world_size; without it a run is one process
    from verlaudit.plan import run_world_size
    from verlaudit.rundir import RunWriter, read_run

    for manifest, expected in (({"distributed": {"rank": 0, "world_size": 2}}, 2), ({"environment": {}}, 1)):
        d = tmp_path / str(expected)
        RunWriter(d).write_manifest(manifest)
        assert run_world_size(read_run(d)) == expected
