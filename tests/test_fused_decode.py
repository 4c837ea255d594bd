"""The fused decode forward and its attention kernel: `pytest tests/test_fused_decode.py` (GPU: `-m gpu`).

`rollout.engine: fused` swaps the HF forward of the static engine for our own (weights snapshotted in the
rollout dtype, q/k/v and gate/up fused, attention over the written slots only). It must compute what
the HF model computes in that dtype: in fp32 the same tokens as HF generate for the same seed, for
Llama (GQA), Mistral and Qwen2 (biased q/k/v) layouts; in bf16 the logits of the HF model loaded in
bf16. The decode attention is checked against a softmax written out by hand and, where triton is
installed, the Triton kernel against it under Triton's CPU interpreter (and on the GPU, natively).
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM, MistralConfig, Qwen2Config, Qwen3Config

from tests.test_rollout_fast import (
    TOK,
    R,
    TimedStaticDecodeEngine,
    _actor,
    _assert_graph_replays_eager,
    _assert_same,
    _batch,
)
from trainer import decode_attention as DA
from trainer import fused_decode
from trainer.config import TrainConfig
from trainer.logprobs import causal_mask_with_self
from trainer.rollout import HFGenerateEngine, StaticDecodeEngine

CPU = torch.device("cpu")


def _engines(actor, policy, device=CPU, **kw):
    hf = HFGenerateEngine(actor, TOK, policy, device=device, max_new_tokens=R, **kw)
    fused = StaticDecodeEngine(actor, TOK, policy, device=device, max_new_tokens=R, fused=True, **kw)
    return hf, fused


@pytest.mark.parametrize("kw", [{}, {"temperature": 0.6, "top_k": 5}])
def test_fused_engine_gives_hf_generate_tokens_in_fp32(kw):
    actor, policy = _actor(eos_bias=1.0)
    assert actor.config.num_key_value_heads < actor.config.num_attention_heads  # GQA is exercised
    hf, fused = _engines(actor, policy, **kw)
    batch = _batch()
    a = hf.generate(batch["input_ids"], batch["attention_mask"], num_samples=3, generator_seed=0)
    b = fused.generate(batch["input_ids"], batch["attention_mask"], num_samples=3, generator_seed=0)
    _assert_same(a, b)
    assert fused.name == "static-decode+fused"
    assert b.response_mask.sum(1).min() < R  # eos ended rows: pad forcing ran


_ACTOR = _actor()  # left padding of any width: tests/test_rollout_fast.py runs its property test fused too


def _other_layout(config_cls, tmp_path, **extra):
    """A tiny model of another family, through save_pretrained / from_pretrained (the loading path)."""
    cfg = config_cls(
        vocab_size=len(TOK),
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        pad_token_id=TOK.pad_token_id,
        eos_token_id=TOK.eos_token_id,
        bos_token_id=TOK.bos_token_id,
        tie_word_embeddings=False,
        **extra,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").save_pretrained(tmp_path)
    return AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32, attn_implementation="sdpa")


@pytest.mark.parametrize("family", ["mistral", "qwen2"])
def test_mistral_and_qwen2_layouts(family, tmp_path):
    if family == "mistral":
        model = _other_layout(MistralConfig, tmp_path, sliding_window=None)
    else:
        model = _other_layout(Qwen2Config, tmp_path)
        with torch.no_grad():  # Qwen2's q/k/v biases start at zero: make them matter
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.5)
    _, policy = _ACTOR
    hf, fused = _engines(model, policy)
    batch = _batch()
    _assert_same(
        hf.generate(batch["input_ids"], batch["attention_mask"], num_samples=2, generator_seed=4),
        fused.generate(batch["input_ids"], batch["attention_mask"], num_samples=2, generator_seed=4),
    )


def test_unsupported_models_are_refused_with_the_reason(tmp_path):
    model = _other_layout(Qwen3Config, tmp_path, head_dim=16)
    _, policy = _ACTOR
    with pytest.raises(
        ValueError,
        match=r"rollout.engine: fused: model_type 'qwen3' \(fused decode covers .*use rollout.engine: static",
    ):
        StaticDecodeEngine(model, TOK, policy, device=CPU, max_new_tokens=4, fused=True)
    model.config.model_type = "llama"  # a Llama-typed config over Qwen3 layers (q/k norms): still refused
    assert fused_decode.unsupported(model) == "Qwen3DecoderLayer is not a Llama-style decoder layer"
    # the older spelling (rollout.fused + rollout.cache) is one line naming the key that replaced it
    with pytest.raises(ValueError, match=r"^rollout.fused: replaced by rollout.engine: fused"):
        TrainConfig.from_dict({"rollout": {"fused": True}})
    with pytest.raises(
        ValueError, match=r"^v.rollout.cache: replaced by rollout.engine .*remove rollout.cache$"
    ):
        TrainConfig.from_dict({"rollout": {"cache": "static"}}, where="v")
    cfg = TrainConfig.from_dict({"rollout": {"engine": "fused"}})
    assert TrainConfig.from_dict(cfg.to_dict()) == cfg


def _prefill_logits(weights, ids, mask):
    b, p = ids.shape
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    cos, sin = weights.rotary_table(p, CPU)
    cache = weights.new_cache(b, p, CPU)
    full = causal_mask_with_self(mask.bool(), p)
    args = (weights.shape, ids, cos, sin, positions, full, torch.arange(p), cache, *weights.args())
    return fused_decode.forward(*args)


@pytest.mark.parametrize("preset", ["bf16", "bf16-pure"])
def test_bf16_snapshot_computes_what_the_bf16_loaded_model_computes(preset):
    """A bf16 rollout of an fp32-master actor decodes as an engine loaded with the weights in bf16
    (casts once per rollout, residual stream and K/V in bf16), not as autocast over fp32 weights."""
    actor, _ = _actor(preset)
    weights = fused_decode.FusedWeights(actor, torch.bfloat16)
    bf16_model = copy.deepcopy(actor).to(torch.bfloat16)
    batch = _batch()
    ids, mask = batch["input_ids"], batch["attention_mask"]
    ours = _prefill_logits(weights, ids, mask)
    with torch.no_grad():
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        theirs = bf16_model(input_ids=ids, attention_mask=mask, position_ids=pos).logits[:, -1]
    assert ours.dtype == theirs.dtype == torch.bfloat16
    # fused GEMMs round the same bf16 products with another blocking: a bf16 ulp or two at O(1)
    torch.testing.assert_close(ours.float(), theirs.float(), atol=3e-2, rtol=0)
    # what the snapshot holds beyond the model: fp32 masters -> every matmul weight again in bf16;
    # bf16 weights -> only the fused q/k/v and gate/up copies (o, down and the head are views)
    cfg, n = actor.config, actor.config.num_hidden_layers
    h, kv, inter = cfg.hidden_size, cfg.num_key_value_heads * cfg.hidden_size // cfg.num_attention_heads, 128
    fused_elems = n * (h * (h + 2 * kv) + 2 * inter * h)
    others = n * (h * h + inter * h + 2 * h) + h + actor.lm_head.weight.numel()
    expected = 2 * (fused_elems + others) if preset == "bf16" else 2 * fused_elems
    assert weights.nbytes() == expected
    # and the planner's term for it (verlaudit plan's rollout phase with rollout.engine: fused)
    from trainer.precision import resolve_policy
    from verlaudit.plan import memory_model as mm
    from verlaudit.plan.planner import rollout_policy

    arch = mm.Architecture.from_config(actor.config)
    d = mm.ActDtypes.of(rollout_policy(resolve_policy(preset)))
    assert mm.fused_snapshot_bytes(arch, d) == expected


def _hand_attention(q, k, v, valid, slot, scale):
    """softmax(q.k * scale) . v over the valid slots <= slot, one (row, head) at a time, in fp64."""
    b, h, d = q.shape
    group = h // k.shape[1]
    out = torch.zeros(b, h, d, dtype=torch.float64)
    for i in range(b):
        for j in range(h):
            keep = [s for s in range(int(slot) + 1) if valid[i, s]]
            kk, vv = k[i, j // group, keep].double(), v[i, j // group, keep].double()
            w = torch.softmax(kk @ q[i, j].double() * scale, dim=0)
            out[i, j] = w @ vv
    return out


CASES = [  # rows, heads, kv heads, slots, head dim, dtype, parts (None: the kernel's own choice)
    (2, 4, 4, 200, 64, torch.float32, None),
    (3, 8, 2, 130, 32, torch.bfloat16, 4),
    (2, 4, 1, 64, 16, torch.float16, 1),
    (1, 2, 2, 256, 32, torch.float32, 2),
]


def _case(rows, heads, kv, slots, d, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(rows, heads, d, generator=g).to(device, dtype)
    k = torch.randn(rows, kv, slots, d, generator=g).to(device, dtype)
    v = torch.randn(rows, kv, slots, d, generator=g).to(device, dtype)
    valid = torch.rand(rows, slots, generator=g) > 0.3
    valid[:, :3] = False  # left padding
    slot = torch.tensor([slots - 40])
    valid[:, slots - 40] = True  # the slot just written is always valid
    valid[:, slots - 39 :] = True  # not yet written: must be ignored though "valid"
    return q, k, v, valid.to(device), slot.to(device)


@pytest.mark.parametrize("case", CASES[:2])
def test_reference_attention_is_the_hand_softmax(case):
    q, k, v, valid, slot = _case(*case[:6], CPU)
    scale = case[4] ** -0.5
    out = DA.reference(q, k, v, valid, slot, scale)
    tol = 1e-5 if case[5] == torch.float32 else 2e-2
    torch.testing.assert_close(out.double(), _hand_attention(q, k, v, valid, slot, scale), atol=tol, rtol=0)
    # the custom op (what the forward calls) off CUDA is the reference
    assert torch.equal(DA.decode_attention(q, k, v, valid, slot, scale), out)


@pytest.mark.skipif(not DA.triton_available(), reason="triton is not installed (it ships with CUDA torch)")
def test_triton_kernel_under_the_interpreter():
    """Every case through the Triton kernels on CPU. The interpreter must be chosen before triton is
    first imported (triton's own library functions are built then), hence a fresh process."""
    script = (
        "import torch\n"
        "from tests.test_fused_decode import CASES, CPU, _case, _hand_attention\n"
        "from trainer import decode_attention as DA\n"
        "for case in CASES:\n"
        "    q, k, v, valid, slot = _case(*case[:6], CPU)\n"
        "    out = DA.triton_decode_attention(q, k, v, valid, slot, case[4] ** -0.5, parts=case[6])\n"
        "    ref = _hand_attention(q, k, v, valid, slot, case[4] ** -0.5)\n"
        "    tol = 1e-5 if case[5] == torch.float32 else 2e-2\n"
        "    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=0)\n"
        "print('ok', len(CASES))\n"
    )
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["ok", str(len(CASES))]


def test_compiled_fused_decode_gives_the_eager_tokens():
    """Inductor on CPU: the fused single-token forward, custom attention op included, traces as one
    graph (fullgraph) and gives the eager fused loop's tokens."""
    actor, policy = _actor(eos_bias=1.0)
    batch = _batch()
    eager = StaticDecodeEngine(actor, TOK, policy, device=CPU, max_new_tokens=R, fused=True)
    compiled = TimedStaticDecodeEngine(
        actor, TOK, policy, device=CPU, max_new_tokens=R, fused=True, compile=True
    )
    a = eager.generate(batch["input_ids"], batch["attention_mask"], num_samples=2, generator_seed=0)
    b = compiled.generate(batch["input_ids"], batch["attention_mask"], num_samples=2, generator_seed=0)
    assert torch.equal(a.response_ids, b.response_ids)
    torch.testing.assert_close(a.logprobs, b.logprobs, atol=1e-5, rtol=0)
    assert compiled.name == "static-decode+fused+compile" and compiled.last_stats["compile_s"] > 0


GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.gpu
@GPU
@pytest.mark.parametrize("case", CASES + [(32, 32, 32, 256, 128, torch.bfloat16, None)])
def test_triton_kernel_on_the_gpu(case):
    q, k, v, valid, slot = _case(*case[:6], torch.device("cuda"))
    scale = case[4] ** -0.5
    out = DA.triton_decode_attention(q, k, v, valid, slot, scale, parts=case[6])
    ref = _hand_attention(q.cpu(), k.cpu(), v.cpu(), valid.cpu(), slot.cpu(), scale)
    tol = 1e-5 if case[5] == torch.float32 else 2e-2
    torch.testing.assert_close(out.double().cpu(), ref, atol=tol, rtol=0)


@pytest.mark.gpu
@GPU
@pytest.mark.parametrize("preset", ["fp32", "bf16", "bf16-pure"])
@pytest.mark.parametrize("compile", [False, True])
def test_fused_graph_replays_the_fused_eager_loop(preset, compile):
    cuda = torch.device("cuda")
    actor, policy = _actor(preset, device=cuda, eos_bias=1.0)
    kw = dict(device=cuda, max_new_tokens=R, fused=True, compile=compile)
    eager = StaticDecodeEngine(actor, TOK, policy, **kw)
    graphs = StaticDecodeEngine(actor, TOK, policy, cuda_graphs=True, **kw)
    _assert_graph_replays_eager(eager, graphs)
