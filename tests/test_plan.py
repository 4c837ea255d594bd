"""The memory planner: exact parameter counts, per-layer saved activations against what autograd
really saves, the H200 reference peaks (REFERENCE_NUMBERS.md) within stated tolerances, invariants,
and `verlaudit plan` end to end."""

from __future__ import annotations

import contextlib
import functools
import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import LlamaConfig, LlamaForCausalLM

from trainer.precision import resolve_policy
from verlaudit import cli
from verlaudit.plan.memory_model import (
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
        dict(
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=3,
            num_attention_heads=8,
            num_key_value_heads=2,
            vocab_size=77,
            tie_word_embeddings=True,
        ),
        dict(
            hidden_size=48,
            intermediate_size=80,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=4,
            vocab_size=50,
            head_dim=16,
            attention_bias=True,
            mlp_bias=True,
        ),
    ],
)
def test_parameter_count_equals_the_real_model(kwargs):
    cfg = LlamaConfig(**kwargs)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    assert Architecture.from_config(cfg).params("causal_lm") == sum(p.numel() for p in model.parameters())


def test_unknown_model_type_is_a_clear_error():
    with pytest.raises(ValueError, match="model_type 'gpt2' is not modelled"):
        Architecture.from_config({"model_type": "gpt2", "hidden_size": 8}, name="m")


def _measured_layer_bytes(
    preset: str, cfg: LlamaConfig, batch: int, seq: int, *, padded: bool = False, math: bool = False
) -> tuple[int, int]:
    """(bytes that autograd saves in decoder layer 1, excluding parameters, autocast's weight copies
    and the layer's own input; bytes of the shared rotary cos/sin it saves). ``padded``: row 0 ends
    in padding, so HF builds an attention mask; ``math``: SDPA forced onto torch's math kernel."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    pol = resolve_policy(preset)["actor"]
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to(pol.param_dtype)
    layer = model.model.layers[1]
    # autocast's weight copies are told from activations by shape (a linear saves W or W^T), so no
    # weight dimension may equal the token count
    weights = {s for p in layer.parameters() if p.dim() == 2 for s in (tuple(p.shape), tuple(p.shape)[::-1])}
    assert not any(batch * seq in s for s in weights), "pick batch x seq unlike any weight dimension"
    captured = {}
    hook = layer.register_forward_pre_hook(lambda m, a, k: captured.update(a=a, k=k), with_kwargs=True)
    ids = torch.randint(0, cfg.vocab_size, (batch, seq))
    mask = torch.ones_like(ids)
    mask[0, -2:] = 0 if padded else 1
    # a compiled layer (tests/test_selective_ckpt.py) is traced here: the kernel choice is baked in
    kernel = functools.partial(sdpa_kernel, SDPBackend.MATH) if math else contextlib.nullcontext
    with kernel(), pol.autocast_ctx("cpu"):
        model(input_ids=ids, attention_mask=mask, use_cache=False)
    hook.remove()
    kwargs = dict(captured["k"])
    assert (kwargs.get("attention_mask") is not None) == padded  # unpadded: HF's causal fast path, no mask
    x = (captured["a"][0] if captured["a"] else kwargs.pop("hidden_states")).detach().requires_grad_()
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}
    rotary = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal rotary
        key = t.untyped_storage().data_ptr()
        if key in params or key == x.untyped_storage().data_ptr() or key in saved:
            return t
        if t.dim() == 2 and tuple(t.shape) in weights:
            saved[key] = 0  # autocast's low-precision weight copy: counted as weight copies, not activations
        elif t.dim() == 4 and t.shape[0] == 1:
            saved[key] = 0
            rotary += t.untyped_storage().nbytes()  # cos / sin [1, 1, T, D], shared by every layer
        else:
            saved[key] = t.untyped_storage().nbytes()
        return t

    with kernel(), pol.autocast_ctx("cpu"), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        layer(x, **kwargs)
    return sum(saved.values()), rotary


@pytest.mark.parametrize("preset", ["fp32", "bf16", "fp16", "bf16-pure"])
def test_layer_saved_bytes_match_autograd(preset):
    # Hand-worked for fp32, h=64, I=160, 4 heads: normalised tensors 2 x 4h, rsqrt 2 x 4, q/k/v input
    # 4h, q, k, v 12h, SDPA out 4h + lse 4 x 4, mid-layer residual 4h, MLP input 4h, MLP 16I
    # = 36h + 16I + 24 = 2304 + 2560 + 24 = 4888 bytes per token.
    cfg = LlamaConfig(
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        vocab_size=50,
        attn_implementation="sdpa",
    )
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


GQA = LlamaConfig(hidden_size=128, intermediate_size=352, num_hidden_layers=2, num_attention_heads=8,
                  num_key_value_heads=2, vocab_size=50, attn_implementation="sdpa")  # fmt: skip
"""8 query heads over 2 kv heads of 16: q = 128, kv = 32 (tests/test_selective_ckpt.py compiles it too)."""


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("preset", ["fp32", "bf16", "fp16", "bf16-pure"])
def test_gqa_layer_saved_bytes_match_autograd(preset, padded):
    # Without a mask transformers passes enable_gqa and SDPA saves k and v at the kv width; with one,
    # repeat_kv expands them to q's width first. bf16-pure, h=128, I=352, T=12: unpadded 24h + 8I +
    # 2 x 4 (rsqrt) + 8 x 4 (lse) - 2 x 2 x (128 - 32) (k, v narrower) = 3072 + 2816 + 40 - 384
    # = 5544 bytes per token; padded adds k and v's 384 back and the bf16 mask bias 2 x 12 = 24.
    batch, seq = 2, 12
    measured, _ = _measured_layer_bytes(preset, GQA, batch, seq, padded=padded)
    arch, d = Architecture.from_config(GQA), ActDtypes.of(resolve_policy(preset)["actor"])
    predicted = sum(layer_saved_bytes(arch, d, seq_len=seq, padded=padded, device_type="cpu").values())
    if preset == "bf16-pure":
        assert predicted == (5544 + 384 + 24 if padded else 5544)
    assert measured == predicted * batch * seq
    # on CUDA the 16-bit kernels (flash, cuDNN) take GQA as CPU's does
    if d.c == 2:
        assert predicted == sum(layer_saved_bytes(arch, d, seq_len=seq, padded=padded).values())


def test_gqa_fp32_on_cuda_takes_the_math_kernel():
    # fp32 without a mask: CUDA has no fused GQA kernel for fp32 (torch 2.11), so SDPA runs the math
    # kernel, measured here by forcing it on CPU: k and v expanded (+2 x 4 x 96 = 768), the fp32
    # probabilities [B, H, T, T] (4 x 8 x 12 = 384 per token) and no log-sum-exp (-4 x 8 = 32):
    # 1120 bytes per token more than CPU's flash kernel saves.
    batch, seq = 2, 12
    arch, d = Architecture.from_config(GQA), ActDtypes.of(resolve_policy("fp32")["actor"])

    def predicted(device_type: str) -> int:
        return sum(layer_saved_bytes(arch, d, seq_len=seq, padded=False, device_type=device_type).values())

    assert predicted("cuda") - predicted("cpu") == 1120
    assert _measured_layer_bytes("fp32", GQA, batch, seq, math=True)[0] == predicted("cuda") * batch * seq
    assert _measured_layer_bytes("fp32", GQA, batch, seq)[0] == predicted("cpu") * batch * seq


def test_attention_kernel_rule():
    from verlaudit.plan.memory_model import attention_kernel

    bf16, fp32 = ActDtypes(r=2, c=2, casts=False), ActDtypes(r=4, c=4, casts=False)
    mha = Architecture.from_config(LlamaConfig(**LLAMA2_7B))
    wide = Architecture.from_config(dict(GQA.to_dict(), head_dim=288))  # over SDPA's 256: repeat_kv
    gqa = Architecture.from_config(GQA)
    assert {
        attention_kernel(mha, d, padded=p, device_type=t)
        for d in (bf16, fp32)
        for p in (0, 1)
        for t in ("cuda", "cpu")
    } == {"fused"}
    assert (
        attention_kernel(gqa, bf16, padded=True) == attention_kernel(wide, bf16, padded=False) == "expanded"
    )
    assert attention_kernel(gqa, bf16, padded=False) == "fused"
    assert attention_kernel(gqa, fp32, padded=False, device_type="cpu") == "fused"
    assert attention_kernel(gqa, fp32, padded=False, device_type="cuda") == "math"
    with pytest.raises(ValueError, match="device_type 'xpu'"):
        attention_kernel(gqa, fp32, padded=False, device_type="xpu")


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
    # The real loading path: model.path points at a save_pretrained directory (embedding every id of the
    # project's tokenizer, which the run uses: the preflight refuses a smaller vocabulary).
    cfg = LlamaConfig(**{**TINY, "vocab_size": 128})
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
    from verlaudit.analysis.diagnose.failure import run_world_size
    from verlaudit.rundir import RunWriter, read_run

    for manifest, expected in (({"distributed": {"rank": 0, "world_size": 2}}, 2), ({"environment": {}}, 1)):
        d = tmp_path / str(expected)
        RunWriter(d).write_manifest(manifest)
        assert run_world_size(read_run(d)) == expected


def test_shadow_bytes_by_hand():
    from verlaudit.plan.memory_model import shadow_bytes

    arch = Architecture.from_config(LLAMA2_7B | {"model_type": "llama"})
    parts = shadow_bytes(arch, seq_len=1024, rows=2, param_bytes=4)
    # largest block with a backward: a decoder layer, 4 x 4096^2 + 3 x 4096 x 11008 + 2 x 4096
    # = 202,383,360 weights (the head's 32000 x 4096 = 131,072,000 is smaller); its fp32 copy, fp32
    # gradients and fp32-master gradients: 12 bytes each = 2.26 GiB
    assert parts["shadow: block copy + param grads"] == 202_383_360 * 12
    # 2 rows x 1024 tokens: chain inputs 32 layers x 2048 x 4096 x 4 B = 1 GiB; one layer's fp32
    # activations 2048 x (10 x 4096 + 4 x 11008) x 4 B = 0.65 GiB; logits 4 x 2048 x 32000 x 4 B = 0.98 GiB
    assert parts["shadow: chain inputs"] == GIB
    assert parts["shadow: one layer's fp32 activations"] == 2048 * 84_992 * 4
    assert parts["shadow: fp32 logits"] == 4 * 2048 * 32000 * 4
    assert 4.8 < sum(parts.values()) / GIB < 5.0  # beside a 7B AMP step's 121 GiB on a 140 GiB H200
