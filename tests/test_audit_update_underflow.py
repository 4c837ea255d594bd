"""Lost updates (weights unchanged by an optimizer step despite a non-zero gradient) at the always-on
``boundary`` audit level: the sampled snapshot, its bounded size, and the warning through the real
trainer (bf16-pure at a tiny lr warns; fp32 master weights at the same lr do not).

Run: `pytest tests/test_audit_update_underflow.py` (about half a minute on 2 cores).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from trainer.config import TrainConfig
from trainer.train import train
from verlaudit.audit import Auditor, AuditSettings
from verlaudit.audit import numerics as N
from verlaudit.rundir import RunWriter, read_run

DPO = {
    "steps": 2, "device": "cpu",
    "algo": {"name": "dpo", "lr": 1e-7, "batch_size": 2, "mini_batch_size": 2, "micro_batch_size": 2},
    "data": {"num_examples": 8, "prompt_length": 8, "response_length": 4},
}  # fmt: skip


@given(numel=st.integers(0, 20_000), sample=st.integers(1, 512))
@settings(max_examples=60, deadline=None)
def test_sample_index_is_distinct_sorted_in_range_and_fixed(numel, sample):
    idx = N.sample_index(numel, sample)
    assert idx.numel() == numel if numel <= sample else 0 < idx.numel() <= sample
    if idx.numel():
        assert int(idx.min()) >= 0 and int(idx.max()) < numel
        assert bool((idx[1:] > idx[:-1]).all())  # sorted and distinct
    assert torch.equal(idx, N.sample_index(numel, sample))  # seeded: the same every call


def test_lost_fraction_by_hand():
    # bf16 weights, SGD lr 1e-4, grad 1: at 1.0 bf16's spacing below 1.0 is 2**-8 = 0.0039, so 1.0 - 1e-4
    # rounds back (lost); at 1e-3 the spacing is 2**-17 = 7.6e-6 < 1e-4 (kept). The last element has a
    # zero gradient and is not counted. Lost: 3 of the 6 with a gradient -> 0.5.
    p = nn.Parameter(torch.tensor([1.0, 1.0, 1.0, 1e-3, 1e-3, 1e-3, 1.0], dtype=torch.bfloat16))
    p.grad = torch.tensor([1, 1, 1, 1, 1, 1, 0], dtype=torch.bfloat16)
    snap = N.snapshot([("m.weight", p)])
    with torch.no_grad():
        p -= 1e-4 * p.grad
    frac, per_module = N.update_underflow(snap, [("m.weight", p)])
    assert frac == 0.5 and per_module == {"m": 0.5}
    assert (
        N.underflow_findings("actor", frac, per_module, _policy("bf16-pure"), 1e-4, step=0, phase=None) == []
    )


def test_snapshot_memory_is_bounded_by_the_sample():
    # a 300 x 500 weight (150,000 elements) sampled at 64: 64 values + 64 flags, not a copy of the tensor;
    # a 10-element bias is taken whole
    w, b = nn.Parameter(torch.randn(300, 500)), nn.Parameter(torch.randn(10))
    w.grad, b.grad = torch.ones_like(w), torch.ones_like(b)
    cache: dict = {}
    snap = N.snapshot([("l.weight", w), ("l.bias", b)], sample=64, cache=cache)
    idx, values, nonzero = snap["l.weight"]
    assert values.numel() <= 64 and nonzero.numel() == values.numel()
    assert snap["l.bias"][1].numel() == 10
    held = sum(t.numel() * t.element_size() for s in snap.values() for t in s)
    assert held <= (64 + 10) * (8 + 4 + 1)  # int64 index, fp32 value, bool flag per sampled element
    # the index is built once and reused: the next step samples the same elements
    again = N.snapshot([("l.weight", w), ("l.bias", b)], sample=64, cache=cache)
    assert again["l.weight"][0] is idx
    assert torch.equal(values, w.detach().reshape(-1)[idx])


def test_non_contiguous_parameter_is_sampled_without_a_copy_of_its_layout():
    # a transposed view: take() follows the logical (row-major) order, as the comparison after the step does
    base = torch.arange(12.0).reshape(3, 4)
    p = nn.Parameter(base.t())
    p.grad = torch.ones_like(p)
    idx, values, _ = N.snapshot([("t.weight", p)], sample=5)["t.weight"]
    assert torch.equal(values, p.detach().contiguous().reshape(-1)[idx])


def _policy(preset):
    from trainer.precision import resolve_policy

    return resolve_policy(preset)["actor"]


def _run(preset, run_dir):
    """The real DPO recipe at the boundary level; the auditor's metrics come back from the run directory."""
    with (
        RunWriter(run_dir) as writer,
        Auditor(writer, AuditSettings(level="boundary", full_steps=1, every=0)) as a,
    ):
        train(TrainConfig.from_dict({**DPO, "precision": {"preset": preset}}), a)
    return a, read_run(run_dir)


def test_bf16_pure_tiny_lr_warns_at_the_boundary_level_and_fp32_master_does_not(tmp_path):
    # lr 1e-7 with Adam moves each weight by ~1e-7; bf16 weights of magnitude ~0.02 have a spacing of
    # ~1.2e-4, so nearly every update rounds away. fp32 master weights (bf16 preset) have a spacing of
    # ~1.9e-9 there and keep them.
    pure, run = _run("bf16-pure", tmp_path / "pure")
    [f] = pure.findings.find("numerics/update_underflow")
    assert (f.kind, f.role, f.severity, f.step) == ("numerics/update_underflow", "actor", "warning", 0)
    assert f.observed["fraction"] > 0.9
    top = f.observed["top_modules"]
    assert f.where in top and top[f.where] == max(top.values())
    assert f.where.startswith("model.") or f.where == "lm_head"
    assert "precision.preset: bf16" in f.fix and "model_dtype=fp32" in f.fix
    # measured on step 0 (full_steps=1) only, without module hooks (boundary level)
    [(step, lost)] = run.series("numerics/actor/update_underflow_frac")
    assert step == 0 and lost > 0.9
    assert pure.probe is None
    assert [f.kind for f in run.findings].count("numerics/update_underflow") == 1

    master, run = _run("bf16", tmp_path / "master")
    assert master.findings.find("numerics/update_underflow") == []
    [(step, lost)] = run.series("numerics/actor/update_underflow_frac")
    assert step == 0 and lost < 0.1


@pytest.mark.parametrize("level, steps", [("off", []), ("boundary", [0, 3, 6]), ("full", [0, 3, 6])])
def test_update_schedule(level, steps):
    s = AuditSettings(level=level, full_steps=0, every=3)
    assert [i for i in range(8) if s.measures_updates(i)] == steps
