"""Gradient health on its own: fp16 underflow fractions and the loss scales that keep them, worked by
hand; the per-module table of updates lost to rounding; the findings. Powers of two throughout, so
nothing depends on a CPU's rounding.

Run: `pytest tests/test_audit_gradhealth.py`.
"""

from __future__ import annotations

import pytest
import torch

from verlaudit.audit import gradhealth, numerics


def test_fp16_underflow_by_hand():
    grads = [
        # m.weight: 0 (zero), 2^-20 (below fp16's smallest normal 2^-14: subnormal), 2^-10, 1.0
        ("m.weight", torch.tensor([0.0, 2.0**-20, 2.0**-10, 1.0])),
        # n.weight: 2^-30 and 2^10, 40 binades apart
        ("n.weight", torch.tensor([2.0**-30, 2.0**10])),
        ("n.bias", None),  # no gradient: left out
        ("e.weight", torch.empty(0)),  # an empty shard (FSDP): left out, not a division by zero
    ]
    rows = {
        r["module"]: r for r in gradhealth.fp16_underflow("actor", grads, 1.0, step=2, phase="actor_update")
    }
    m, n = rows["m"], rows["n"]
    assert (m["elements"], m["zero_frac"], m["subnormal_frac"]) == (4, 0.25, 0.25)
    # frexp exponents of m's non-zero elements: 2^-20 = 0.5 x 2^-19 -> -19; 2^-10 -> -9; 1.0 -> 1.
    # All but 0.1% of 3 elements means all of them: the smallest, 2^-20, must reach 2^-14: x 2^6 = 64.
    # The largest is below 2^1; it may grow to 2^12 (under fp16's 65504 / 8): x 2^11 = 2048.
    assert (m["scale_keep"], m["scale_max"], m["fits"]) == (64.0, 2048.0, True)
    # n: 2^-30 needs x 2^16; 2^10 (exponent 11) allows x 2^1: no fp16 scale keeps both
    assert (n["subnormal_frac"], n["scale_keep"], n["scale_max"], n["fits"]) == (0.5, 65536.0, 2.0, False)
    # held at a loss scale of 1024 the same gradients need 1024x the scale
    at_1024 = gradhealth.fp16_underflow("actor", grads[:1], 1024.0, step=2, phase=None)[0]
    assert (at_1024["scale_keep"], at_1024["scale_max"]) == (65536.0, 2097152.0)


def test_scales_keep_all_but_a_fraction():
    hist = [0] * gradhealth.BINS
    hist[gradhealth.OFFSET - 29] = 1  # one element at 2^-30 ...
    hist[gradhealth.OFFSET - 9] = 999  # ... and 999 at 2^-10
    # 0.1% of 1000 = 1 element may stay subnormal: the 2^-30 one; the 2^-10s (exponent -9) need 2^-4
    assert gradhealth.scales(hist, 1.0)[0] == 2.0**-4
    assert gradhealth.scales(hist, 1.0, keep_frac=0.0)[0] == 2.0**16
    assert gradhealth.scales([0] * gradhealth.BINS, 1.0) == (None, None)


def test_findings_name_the_worst_module_and_the_scale():
    grads = [
        ("m.weight", torch.tensor([0.0, 2.0**-20, 2.0**-10, 1.0])),
        ("n.weight", torch.tensor([2.0**-30, 2.0**10])),
    ]
    rows = gradhealth.fp16_underflow("actor", grads, 1.0, step=2, phase="actor_update")
    (f,) = gradhealth.findings(rows)
    assert (f.kind, f.where, f.observed["modules_over"]) == ("precision/fp16_underflow", "n", 2)
    assert "no single fp16 loss scale fits" in f.fix
    (g,) = gradhealth.findings(rows[:1])
    assert g.where == "m" and "raise the loss scale to 64" in g.fix
    assert gradhealth.findings(rows, warn=0.6) == []


def test_update_loss_table_per_module():
    torch.manual_seed(0)
    low = torch.nn.Parameter(torch.ones(64, dtype=torch.bfloat16))  # ulp at 1.0 is 2^-7
    high = torch.nn.Parameter(torch.ones(64))
    for p in (low, high):
        p.grad = torch.ones_like(p)
        p.grad[:16] = 0  # no gradient: not counted as a lost update
    named = [("a.weight", low), ("b.weight", high)]
    snap = numerics.snapshot(named)
    with torch.no_grad():
        low -= 1e-4  # far below half an ulp: every moving element rounds back to 1.0
        high -= 1e-4
    rows = {r["module"]: r for r in numerics.update_underflow_rows(snap, named)}
    assert rows["a"] == {"module": "a", "lost_frac": 1.0, "sampled": 48, "size": 64}
    assert rows["b"] == {"module": "b", "lost_frac": 0.0, "sampled": 48, "size": 64}
    overall, per_module = numerics.update_underflow_summary(list(rows.values()))
    assert overall == pytest.approx(0.5) and per_module == {"a": 1.0, "b": 0.0}
    (rec,) = gradhealth.update_loss(
        "actor", [rows["a"]], param_dtype="bf16", lr=1e-6, step=0, phase="actor_update"
    )
    assert rec["measure"] == "update_loss" and rec["lost_frac"] == 1.0 and rec["lr"] == 1e-6
