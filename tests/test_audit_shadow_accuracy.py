"""The fp32 shadow that reads its errors once a step against the shadow that read them as it went: the
same records, the same first module over its rounding, every error within 10%, and the host reads
per shadowed step counted.

tests/fixtures/shadow_before.json holds the errors the shadow of commit 59821be gave (each error read
with three host reads as it was measured, the linear's spread from a second fp32 matmul) on
`records`' case: a 3-layer tiny Llama whose ``model.layers.1.self_attn.o_proj`` rounds its output
through float8_e4m3 (16x bf16's unit roundoff), 4 x 24 tokens, 2 rows shadowed, loss scale 1024, in
bf16 and fp16 autocast. The new shadow computes the same sums on the device (the spread's numerator
from two reductions instead of a matmul: the same number up to rounding). The fixture was written on
one host; what it measures is the error of that host's bf16/fp16 kernels, so another CPU's kernels
(AVX2 vs AVX-512/AMX) move it: measured on 2026-12-02 over ATEN_CPU_CAPABILITY=avx2 / default / the
host's AVX-512+AMX, the forward and chain errors moved by at most 8.3% and the per-module weight
gradients (long fp16/bf16 accumulations in the backward) by at most 27%. So across hosts the bound is
15% (weight gradients 40%), still far below a planted excess (16x), and the culprits must be the same
list; on one host the two matmul modes must agree within 1%, the issue's 10% with room. The same
holds with the fp32 products as split TF32 ones (``matmul="tf32x3"``): on a CPU the products of the
TF32-rounded halves are computed exactly as a GPU's tensor cores compute them (fp32 products of
11-bit mantissas are exact, the sums fp32), so their accuracy is checked here.

Run: `pytest tests/test_audit_shadow_accuracy.py`.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.test_audit_shadow import BF16, FP16, FP32, Planted, shadowed, tiny_llama
from verlaudit.audit import shadow_checks, shadow_ops
from verlaudit.audit.settings import SHADOW_MATMULS

BEFORE = json.loads((Path(__file__).parent / "fixtures" / "shadow_before.json").read_text())
FLOOR = 1e-5
ACROSS_HOSTS = 0.15
ACROSS_HOSTS_PARAM_GRAD = 0.40
"""How far another CPU's fp16/bf16 kernels move an error from the fixture's (see the module's text)."""
"""Errors below this are fp32-level (norms, fp32 islands): the kernels' order decides them, so they are
only checked to stay below it."""
DTYPES = {"bf16": BF16, "fp16": FP16}


def records(dtype: torch.dtype, **probe) -> list[dict]:
    model = tiny_llama()
    attn = model.model.layers[1].self_attn
    attn.o_proj = Planted(attn.o_proj, "fp8")
    return shadowed(model, dtype, autocast=dtype, loss_scale=1024.0, **probe)


def errors(recs: list[dict]) -> dict[str, float]:
    """module|measure|direction -> its relative error (the log-prob record: its mean |d log p|)."""
    return {
        f"{r['module']}|{r['measure']}|{r.get('direction', '')}": r.get("rel_err", r.get("mean_abs"))
        for r in recs
    }


@pytest.mark.parametrize("matmul", ["fp32", "tf32x3"])
@pytest.mark.parametrize("name", ["bf16", "fp16"])
def test_the_same_records_and_culprit_as_before_within_the_kernels_spread(name, matmul):
    before = BEFORE[name]
    recs = records(DTYPES[name], matmul=matmul)
    found = shadow_checks.culprits(recs)
    assert [r["module"] for r in found] == before["culprits"]
    assert found[0]["module"] == before["first"] == "model.layers.1.self_attn.o_proj"
    got = errors(recs)
    assert set(got) == set(before["rel_err"])
    for key, old in before["rel_err"].items():
        if old > FLOOR:
            rel = ACROSS_HOSTS_PARAM_GRAD if "|param_grad|" in key else ACROSS_HOSTS
            assert got[key] == pytest.approx(old, rel=rel), key
        else:
            assert got[key] < FLOOR, (key, got[key])


@pytest.mark.parametrize("name", ["bf16", "fp16"])
def test_on_one_host_the_two_matmul_modes_give_the_same_errors(name):
    exact = errors(records(DTYPES[name], matmul="fp32"))
    split = errors(records(DTYPES[name], matmul="tf32x3"))
    assert set(exact) == set(split)
    for key, v in exact.items():
        if v > FLOOR:
            assert split[key] == pytest.approx(v, rel=0.01), key
        else:
            assert split[key] < FLOOR, (key, split[key])


def test_without_parameter_gradients_the_other_records_are_unchanged():
    full = records(BF16)
    lean = records(BF16, param_grads=False)
    assert not [r for r in lean if r["measure"] == "param_grad"]
    assert [r for r in full if r["measure"] == "param_grad"]  # the default still compares them
    want = {k: v for k, v in errors(full).items() if "|param_grad|" not in k}
    got = errors(lean)
    assert set(got) == set(want)
    for key, v in want.items():
        assert got[key] == pytest.approx(v, rel=1e-6, abs=1e-12), key
    assert shadow_checks.culprits(lean)[0]["module"] == "model.layers.1.self_attn.o_proj"


def test_one_host_read_per_shadowed_step(monkeypatch):
    # every way a tensor's value reaches Python: the old shadow made 379 such reads on this step
    # (three per error, two per linear's spread, more in the gradient counts and the log-prob)
    reads = []
    for attr in ("item", "tolist", "__float__", "__bool__", "__int__"):
        orig = getattr(torch.Tensor, attr)

        def counted(self, *a, _orig=orig, _attr=attr, **k):
            reads.append(_attr)
            return _orig(self, *a, **k)

        monkeypatch.setattr(torch.Tensor, attr, counted)
    recs = records(BF16)
    assert len(recs) > 80
    assert len(reads) <= 2, reads  # the records' values, read in `take` (CPU: a tolist per device)


def test_tf32x3_products_are_as_close_to_exact_as_fp32s(monkeypatch):
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(64, 4096, generator=g), torch.randn(4096, 96, generator=g)
    bias = torch.randn(96, generator=g)
    exact = a.double() @ b.double() + bias.double()

    def err(x):
        return float((x.double() - exact).norm() / exact.norm())

    split = []
    inner = shadow_ops._split_product
    monkeypatch.setattr(shadow_ops, "_split_product", lambda *args: split.append(1) or inner(*args))
    with shadow_ops.exact_fp32("cpu"):
        fp32 = torch.nn.functional.linear(a, b.t(), bias)
    assert not split
    with shadow_ops.exact_fp32("cpu", "tf32x3"):
        tf32x3 = torch.nn.functional.linear(a, b.t(), bias)
        batched = torch.bmm(a[None], b[None])[0] + bias
    assert len(split) == 2  # the linear's product and the bmm
    hi = shadow_ops.tf32_split(a)[0].double() @ shadow_ops.tf32_split(b)[0].double() + bias.double()
    # fp32 over K = 4096: ~2.6e-7; one TF32 product: ~2e-4; three of the split halves: as fp32
    assert err(tf32x3) < 2 * err(fp32) and err(batched) < 2 * err(fp32)
    assert err(hi) > 100 * err(fp32)


def test_a_role_that_computes_in_fp32_is_shadowed_with_exact_products(monkeypatch):
    split = []
    inner = shadow_ops._split_product
    monkeypatch.setattr(shadow_ops, "_split_product", lambda *args: split.append(1) or inner(*args))
    shadowed(tiny_llama(layers=1), FP32, backward=False, matmul="tf32x3")
    assert not split
    shadowed(tiny_llama(layers=1), BF16, autocast=BF16, backward=False, matmul="tf32x3")
    assert split
    assert SHADOW_MATMULS == shadow_ops.MATMULS


def test_a_weight_is_split_once_for_all_its_products_and_again_when_it_changes(monkeypatch):
    splits = []
    inner = shadow_ops.tf32_split
    monkeypatch.setattr(shadow_ops, "tf32_split", lambda x: splits.append(tuple(x.shape)) or inner(x))
    lin = torch.nn.Linear(32, 16)
    x = torch.randn(4, 32)
    with shadow_ops.exact_fp32("cpu", "tf32x3"):
        first = lin(x)
        again = lin(x)
        with torch.no_grad():
            lin.weight.mul_(2.0)  # a new version: its split is stale
        doubled = lin(x)
    assert splits.count((16, 32)) == 2 and splits.count((4, 32)) == 3  # the weight twice, the input each time
    assert torch.equal(first, again)
    assert torch.allclose(doubled - lin.bias, 2 * (first - lin.bias), rtol=1e-6, atol=1e-6)
    shadow_ops.forget_splits()
