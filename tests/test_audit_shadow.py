"""The fp32 shadow on its own: the rounding model against measured errors, a planted lower precision
named, the chain and log-prob errors ordered by precision, the backward, hooks off and the model's
numbers untouched. No `Auditor`: a bare `StepContext` and the probe.

Tolerances are ratios with wide margins, never a CPU's rounding: measured errors differ by kernel
(AVX2 / AVX-512 / AMX accumulate in different orders), so each check is a factor of 2 around the
model or an order of magnitude apart. Also checked with ``ATEN_CPU_CAPABILITY=avx2
ONEDNN_MAX_CPU_ISA=AVX2`` and ``ATEN_CPU_CAPABILITY=default``.

Run: `pytest tests/test_audit_shadow.py`.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

from trainer.models import enable_checkpointing
from verlaudit.audit import shadow_checks
from verlaudit.audit.context import StepContext
from verlaudit.audit.shadow import (
    EXCESS,
    ShadowProbe,
    blocks,
    exact_fp32,
    expected_linear,
    hookless_copy,
    rel_err,
    unit_roundoff,
)

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32


def tiny_llama(layers=3, seed=0):
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=100,
        max_position_embeddings=64,
        use_cache=False,
    )
    return LlamaForCausalLM(cfg)


def hook_count(model):
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


def shadowed(model, compute, *, autocast=None, backward=True, loss_scale=1.0, rows=2, **probe_kw):
    """One forward (and backward) of ``model`` with the shadow on; returns the step's records."""
    ctx = StepContext(step=0, phase="actor_update")
    ids = torch.randint(0, 100, (4, 24), generator=torch.Generator().manual_seed(1))
    with ShadowProbe({"actor": model}, ctx, {"actor": compute}, rows=rows, **probe_kw) as probe:
        with torch.autocast("cpu", dtype=autocast or BF16, enabled=autocast is not None):
            out = model(input_ids=ids, attention_mask=torch.ones_like(ids))
        if backward:
            ctx.in_backward = True
            (out.logits.float().log_softmax(-1)[..., 0].mean() * loss_scale).backward()
            ctx.in_backward = False
    records, _ = probe.take()
    return records


class Planted(nn.Module):
    """Wraps a module and computes it below the contract: ``autocast`` runs it under bf16 autocast
    (an fp32 policy says fp32), ``fp8`` rounds its output through float8_e4m3 (u = 2^-4, 16x bf16's)."""

    def __init__(self, inner: nn.Module, how: str) -> None:
        super().__init__()
        self.inner, self.how = inner, how

    def forward(self, x):
        if self.how == "autocast":
            with torch.autocast("cpu", dtype=BF16):
                return self.inner(x).float()
        y = self.inner(x)
        return y.to(torch.float8_e4m3fn).to(y.dtype)


# -- the rounding model ---------------------------------------------------------------------------
def test_unit_roundoff():
    assert (
        unit_roundoff(BF16) == 2.0**-8 and unit_roundoff(FP16) == 2.0**-11 and unit_roundoff(FP32) == 2.0**-24
    )


@settings(max_examples=12, deadline=None)
@given(
    k=st.sampled_from([64, 256, 1024]),
    n=st.sampled_from([32, 128]),
    dtype=st.sampled_from([BF16, FP16]),
    stored_low=st.booleans(),
    cancel=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_linear_error_matches_the_rounding_model(k, n, dtype, stored_low, cancel, seed):
    """A linear in ``dtype`` (weight and input rounded when held in fp32, as autocast does; not when
    stored in ``dtype`` already) against exact fp32 on the same values: measured / model within 2x,
    with and without cancellation (outputs much smaller than their terms: spread s >> 1)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) / math.sqrt(k)
    x = torch.randn(32, k, generator=g)
    if cancel:  # each output sums terms of both signs that nearly cancel: y ~ 1e-2 of its terms
        x = x.abs() + 1.0
        w = w - w.mean(dim=1, keepdim=True)
    if stored_low:
        w, x = w.to(dtype).float(), x.to(dtype).float()
    with exact_fp32("cpu"):
        y32 = x @ w.t()
        spread = float(((x * x) @ (w * w).t()).sum() / (y32 * y32).sum())
    y = (x.to(dtype) @ w.to(dtype).t()).float()
    measured = rel_err([y], [y32])
    u = unit_roundoff(dtype)
    model = expected_linear(u_c=u, u_out=u, r_x=not stored_low, r_w=not stored_low, spread=spread, k_inner=k)
    assert 0.5 < measured / model < 2.0, (measured, model, spread)


def test_rounding_model_by_hand():
    # bf16, input and weight rounded, no cancellation (s = 1): RHO2 u^2 (1 + 1 + 1) with RHO2 = 1 / (8 ln 2)
    # = 0.18034, plus the fp32 accumulation term RHO2 2^-48 K (negligible)
    # -> sqrt(3 x 0.18034) x 2^-8 = 0.73554 x 0.00390625 = 0.0028732
    got = expected_linear(u_c=2**-8, u_out=2**-8, r_x=True, r_w=True, spread=1.0, k_inner=64)
    assert got == pytest.approx(0.0028732, rel=1e-4)
    # fp32 throughout: only the floor of 8 fp32 ulps (8 * 2^-24 = 4.77e-7) is left for K = 64
    assert (
        expected_linear(u_c=2**-24, u_out=2**-24, r_x=False, r_w=False, spread=1.0, k_inner=64) == 8 * 2**-24
    )


# -- the probe on a tiny Llama --------------------------------------------------------------------
@pytest.mark.parametrize(
    "setup",
    [
        ("fp32", FP32, None),
        ("bf16 autocast", BF16, BF16),
        ("fp16 autocast", FP16, FP16),
        ("bf16-pure", BF16, None),
    ],
    ids=lambda s: s[0],
)
def test_every_module_of_an_honest_model_is_explained_by_rounding(setup):
    _, compute, autocast = setup
    model = tiny_llama()
    if setup[0] == "bf16-pure":
        model.to(BF16)
    records = shadowed(model, compute, autocast=autocast)
    local = [r for r in records if r["measure"] == "local" and r["direction"] == "forward"]
    assert len(local) == len([m for _, b in blocks(model) for m in b.modules()])  # every module in a block
    assert max(r["ratio"] for r in local) < 2.0  # the model: linears ~1.0-1.1, the rest below
    assert shadow_checks.culprits(records) == []
    assert not [r for r in records if r["measure"] == "skipped"]


def test_planted_autocast_in_an_fp32_policy_is_the_module_named():
    model = tiny_llama()
    model.model.layers[1].mlp = Planted(model.model.layers[1].mlp, "autocast")
    records = shadowed(model, FP32)
    found = shadow_checks.culprits(records)
    assert found and all(r["module"].startswith("model.layers.1.mlp.") for r in found)
    assert found[0]["module"] == "model.layers.1.mlp.inner.gate_proj"  # the first to run below fp32
    assert found[0]["ratio"] > 100 * EXCESS  # bf16's 2^-8 where fp32's floor is 8 x 2^-24
    (warning,) = shadow_checks.findings(records)
    assert (warning.kind, warning.where, warning.role) == (
        "precision/shadow_excess",
        "model.layers.1.mlp.inner.gate_proj",
        "actor",
    )


def test_planted_fp8_rounding_in_a_bf16_policy_is_the_module_named():
    model = tiny_llama()
    attn = model.model.layers[1].self_attn
    attn.o_proj = Planted(attn.o_proj, "fp8")
    records = shadowed(model, BF16, autocast=BF16)
    found = shadow_checks.culprits(records)
    # its parents (self_attn, the layer) inherit the error but are not named: a culprit has none inside
    assert [r["module"] for r in found] == ["model.layers.1.self_attn.o_proj"]
    assert found[0]["ratio"] > 2 * EXCESS  # fp8's u is 16x bf16's


def test_code_that_casts_down_computes_in_fp32_in_the_shadow():
    class CastsDown(nn.Module):
        def forward(self, x):
            return x.to(torch.bfloat16).sum(-1, dtype=torch.float16) * torch.ones(1, dtype=torch.bfloat16)

    x = torch.randn(3, 5)
    with exact_fp32("cpu"):
        y = CastsDown()(x)
    assert y.dtype == FP32 and torch.equal(y, x.sum(-1))


def test_chain_and_logprob_errors_order_by_precision():
    errs = {}
    for name, compute, autocast in [("fp32", FP32, None), ("fp16", FP16, FP16), ("bf16", BF16, BF16)]:
        records = shadowed(tiny_llama(), compute, autocast=autocast, backward=False)
        errs[name] = shadow_checks.metrics(records)
        chain = [r for r in records if r["measure"] == "chain"]
        assert [r["depth"] for r in chain] == sorted(r["depth"] for r in chain)
        assert not any(r["restarted"] for r in chain[1:])  # carried from the embedding to the head
    assert errs["fp32"]["shadow/actor/logprob_err/mean"] < 1e-6
    # bf16's unit roundoff is 8x fp16's: its errors are several times larger, not within noise
    for key in ("shadow/actor/logprob_err/mean", "shadow/actor/output_rel_err"):
        assert errs["bf16"][key] > 3 * errs["fp16"][key] > 0


def test_backward_records_and_fp16_underflow_in_parameter_gradients():
    def param_grads(scale):
        records = shadowed(tiny_llama(), FP16, autocast=FP16, loss_scale=scale)
        return [r for r in records if r["measure"] == "param_grad"], records

    healthy, records = param_grads(1024.0)
    blocks_back = [r for r in records if r["measure"] == "local" and r["direction"] == "backward"]
    assert {r["module"] for r in blocks_back} >= {"lm_head", "model.layers.0", "model.layers.2"}
    assert max(r["ratio"] for r in blocks_back) < 2.0
    chain_back = [r for r in records if r["measure"] == "chain" and r["direction"] == "backward"]
    assert chain_back[0]["module"] == "lm_head" and chain_back[0]["seeded"]
    assert not any(r["seeded"] for r in chain_back[1:])  # each carried from the block above
    assert max(r["zero_lost_frac"] for r in healthy) < 0.01
    # a loss scaled by 2^-10 (gradients at the logits ~1e-7, fp16's subnormal range): inside the
    # blocks' backward the products fall below 2^-25 and round to 0 where fp32 keeps them
    starved, _ = param_grads(2.0**-10)
    assert max(r["zero_lost_frac"] for r in starved) > 0.3


def test_shadow_leaves_the_model_and_its_gradients_untouched():
    def run(with_shadow):
        model = tiny_llama()
        enable_checkpointing(model)  # the trainer's: non-reentrant
        model.train()
        before = hook_count(model)
        ids = torch.randint(0, 100, (4, 24), generator=torch.Generator().manual_seed(1))
        ctx = StepContext(step=0, phase="actor_update")
        probe = ShadowProbe({"actor": model}, ctx, {"actor": FP32})
        if with_shadow:
            probe.attach()
        logits = model(input_ids=ids).logits
        ctx.in_backward = True
        logits.float().log_softmax(-1)[..., 0].mean().backward()
        probe.detach()
        return (
            logits.detach(),
            [p.grad.clone() for p in model.parameters()],
            probe.take()[0],
            hook_count(model) - before,
        )

    plain_logits, plain_grads, _, _ = run(False)
    logits, grads, records, hooks = run(True)
    assert torch.equal(logits, plain_logits) and all(torch.equal(a, b) for a, b in zip(grads, plain_grads))
    assert hooks == 0
    # under checkpointing the recompute is not shadowed twice, and the backward is still measured
    assert len([r for r in records if r["module"] == "model.layers.0" and r["measure"] == "local"]) == 2


def test_one_pass_per_role_and_grad_mode_per_step():
    model = tiny_llama(layers=1)
    ctx = StepContext(step=0, phase="ref")
    ids = torch.randint(0, 100, (2, 8))
    with ShadowProbe({"reference": model}, ctx, {"reference": FP32}) as probe, torch.no_grad():
        model(input_ids=ids)
        model(input_ids=ids)  # a second micro-batch: not shadowed again
        ctx.phase = "rollout"
    assert len([r for r in probe.take()[0] if r["measure"] == "logprob"]) == 1


def test_hookless_copy_drops_hooks_and_casts():
    lin = nn.Linear(3, 2).to(BF16)
    lin.register_forward_hook(lambda *a: None)
    c = hookless_copy(lin, FP32)
    assert not c._forward_hooks and c.weight.dtype == FP32 and torch.equal(c.weight, lin.weight.float())
    assert c.weight.data_ptr() != lin.weight.data_ptr()


def test_rel_err():
    a, b = torch.tensor([3.0, 4.0]), torch.tensor([0.0, 0.0])
    assert rel_err([a], [a]) == 0.0 and rel_err([b], [b]) == 0.0 and rel_err([a], [b]) == math.inf
    assert rel_err([torch.tensor([3.0, 4.5])], [a]) == pytest.approx(0.1)  # |(0, .5)| / |(3, 4)|
    assert rel_err([torch.tensor([float("nan"), 0.0])], [a]) == math.inf


# -- the pure checks ------------------------------------------------------------------------------
def _rec(module, ratio, **kw):
    return {"measure": "local", "direction": "forward", "role": "actor", "step": 3, "phase": "actor_update",
            "module": module, "ratio": ratio, "rel_err": ratio * 1e-3, "expected": 1e-3, "dtype": "bf16",
            "allowed": "bf16", **kw}  # fmt: skip


def test_culprits_are_the_innermost_exceeding_modules():
    records = [_rec("a.b.c", 10.0), _rec("a.b", 8.0), _rec("a.d", 1.0), _rec("a", 6.0), _rec("e", 5.0)]
    assert [r["module"] for r in shadow_checks.culprits(records)] == ["a.b.c", "e"]
    (f,) = shadow_checks.findings(records)
    assert f.where == "a.b.c" and f.observed["also"] == ["e"] and f.step == 3


def test_metrics_take_the_largest_over_passes():
    records = [
        {"measure": "logprob", "role": "actor", "step": 0, "phase": "p", "tokens": 5, "mean_abs": 0.1, "max_abs": 0.5},
        {"measure": "logprob", "role": "actor", "step": 0, "phase": "q", "tokens": 5, "mean_abs": 0.3, "max_abs": 0.4},
        {"measure": "chain", "direction": "forward", "role": "actor", "step": 0, "phase": "p", "depth": 0, "rel_err": 0.0},
        {"measure": "chain", "direction": "forward", "role": "actor", "step": 0, "phase": "p", "depth": 3, "rel_err": 0.02},
        {"measure": "chain", "direction": "backward", "role": "actor", "step": 0, "phase": "p", "depth": 3, "rel_err": 0.01},
        {"measure": "chain", "direction": "backward", "role": "actor", "step": 0, "phase": "p", "depth": 1, "rel_err": 0.04},
        {**_rec("m", 1.5)},
    ]  # fmt: skip
    assert shadow_checks.metrics(records) == {
        "shadow/actor/logprob_err/mean": 0.3,
        "shadow/actor/logprob_err/max": 0.5,
        "shadow/actor/output_rel_err": 0.02,
        "shadow/actor/input_grad_rel_err": 0.04,
        "shadow/actor/max_ratio": 1.5,
    }


def test_shadow_memory_is_one_block_whatever_the_depth():
    # A checkpointed bf16-autocast tiny Llama (fp32 masters, as a 7B AMP run), one shadowed row of
    # four: the step's peak with the shadow, minus without, is what the shadow holds at the worst
    # moment. It should be about one block's fp32 copy (here 4 x 128^2 + 3 x 128 x 512 weights = 0.94
    # MiB; the backward's param gradients add at most two more, on an unrelated moment) and must not
    # grow with depth: the k-row chain inputs (1 x 256 x 128 fp32 = 0.125 MiB a block) are the only
    # per-block memory it may hold. Before, every block's input (the closure of its gradient hook,
    # alive as long as the graph) and output gradient (the whole batch's, 0.5 MiB) stayed to the step's
    # end: 3.4 MiB extra at 2 layers, 7.9 MiB at 6 (measured); now 0.94 MiB at both.
    from tests.peak_memory import peak_bytes

    def extra(layers):
        torch.manual_seed(0)
        cfg = LlamaConfig(
            hidden_size=128,
            intermediate_size=512,
            num_hidden_layers=layers,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=100,
            max_position_embeddings=256,
            use_cache=False,
        )
        model = LlamaForCausalLM(cfg)
        enable_checkpointing(model)
        model.train()
        ids = torch.randint(0, 100, (4, 256), generator=torch.Generator().manual_seed(1))
        ctx = StepContext(step=0, phase="actor_update")

        def step():
            with torch.autocast("cpu", dtype=BF16):
                logits = model(input_ids=ids).logits
            ctx.in_backward = True
            logits.float().log_softmax(-1)[..., 0].mean().backward()
            ctx.in_backward = False
            model.zero_grad(set_to_none=True)

        def shadowed_step():
            with ShadowProbe({"actor": model}, ctx, {"actor": BF16}, rows=1) as probe:
                step()
            return probe.take()[0]

        step()  # the first call's one-off allocations out of the way
        plain = peak_bytes(step)
        with_shadow = peak_bytes(shadowed_step)
        records = shadowed_step()
        assert {(r["measure"], r.get("direction")) for r in records if r["module"] == "model.layers.0"} == {
            ("local", "forward"),
            ("chain", "forward"),
            ("local", "backward"),
            ("chain", "backward"),
        }  # the shadow still measured the step
        block = sum(q.numel() * 4 for q in model.model.layers[0].parameters())
        return (with_shadow - plain) / block

    shallow, deep = extra(2), extra(6)
    assert shallow <= 2.0 and deep <= 2.0, (shallow, deep)  # in units of one block's fp32 weights
    assert deep - shallow <= 4 * 0.125 / 0.94, (shallow, deep)  # at most the k-row chain inputs
