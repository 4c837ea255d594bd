"""The report's Precision section from hand-written run directories: the shadow table with the
shadowed steps' time apart (and left out of the main table's step time), the chain's error vs depth
from the actor's grad pass, the op-count differences between variants, the gradient-health words,
and no section at all for runs without records.

Run: `pytest tests/test_report_precision.py`.
"""

from __future__ import annotations

from collections import Counter

from verlaudit.analysis.report import precision
from verlaudit.analysis.report.build import write_report
from verlaudit.rundir import GRADHEALTH, OPCOUNTS, SHADOW, Finding, RunWriter, read_run


def chain(depth, err, *, grad=True, direction="forward", step=0):
    return {
        "measure": "chain",
        "direction": direction,
        "role": "actor",
        "step": step,
        "phase": "actor_update",
        "grad": grad,
        "depth": depth,
        "rel_err": err,
        "module": f"b{depth}",
    }


def op(pass_, cat, din, dout, n, role="actor", kind="linear"):
    return {
        "step": 0,
        "role": role,
        "module": "m",
        "kind": kind,
        "phase": "actor_update",
        "pass": pass_,
        "category": cat,
        "in": din,
        "out": dout,
        "op": "x",
        "count": n,
    }


def write_run(root, name, *, matmul_dtype, lost=0.0, culprit=False):
    with RunWriter(root / name) as w:
        w.write_manifest({"variant": name, "seed": 0, "config": {"algo": {"name": "dpo"}}})
        w.metrics(
            0,
            {
                "perf/step_time_s": 5.0,
                "audit/shadow": 1.0,
                "timing_s/shadow": 4.0,
                "shadow/actor/logprob_err/mean": 0.01,
                "shadow/actor/max_ratio": 9.0 if culprit else 1.1,
            },
        )
        for s in (1, 2, 3):
            w.metrics(s, {"perf/step_time_s": 1.0 + s / 10})
        w.records(
            SHADOW,
            [
                chain(0, 0.0, grad=False),
                chain(0, 0.001),
                chain(1, 0.002),
                chain(1, 0.003, direction="backward"),
            ],
        )
        w.records(
            OPCOUNTS,
            [
                op("forward", "matmul", matmul_dtype, matmul_dtype, 7),
                op("forward", "view", "fp32", "fp32", 3),
            ],
        )
        w.records(
            GRADHEALTH,
            [
                {
                    "measure": "update_loss",
                    "role": "actor",
                    "module": "m",
                    "lost_frac": lost,
                    "sampled": 10,
                    "size": 10,
                    "lr": 1e-6,
                }
            ],
        )
        if culprit:
            w.finding(
                Finding(
                    severity="warning",
                    kind="precision/shadow_excess",
                    role="actor",
                    where="b1.mlp",
                    message="m",
                    observed={"ratio": 9.0},
                )
            )
        w.status("completed")


def test_precision_section_and_plot(tmp_path):
    write_run(tmp_path, "fp32", matmul_dtype="fp32")
    write_run(tmp_path, "bf16-pure", matmul_dtype="bf16", lost=0.98, culprit=True)
    rep = write_report(tmp_path)
    md = rep.markdown
    assert "## Precision: where it is lost" in md and "![shadow error vs depth](shadow_depth.png)" in md
    assert (tmp_path / "shadow_depth.png").exists() and tmp_path / "shadow_depth.png" in rep.files
    # the main table's step time is the median of the unshadowed steps 1.1, 1.2, 1.3
    assert list(rep.variants["step_time_s"]) == [1.2, 1.2]
    shadow_part, ops_part = md.split("fp32 shadow of the actor")[1].split("What ran in which dtype")
    assert cells(shadow_part, "bf16-pure") == [
        "bf16-pure",
        "0.01",
        "—",
        "—",
        "—",
        "9",
        "actor: b1.mlp (9x)",
        "4.000",
        "5.000",
        "1.200",
    ]
    assert cells(shadow_part, "fp32")[6] == "none"
    ops_part, grads_part = ops_part.split("Gradient health")
    # matmul dtypes differ between the variants (columns in report order: bf16-pure, fp32); views left out
    assert cells(ops_part, "forward") == ["forward", "matmul", "bf16", "7", "0"]
    assert "view" not in ops_part
    assert cells(grads_part, "bf16-pure")[1] == "98.0% overall; worst actor m 98% (lr 1e-06)"


def cells(text, first):
    """The cells of the first markdown table row of ``text`` whose first cell is ``first``."""
    for line in text.splitlines():
        parts = [c.strip() for c in line.strip().strip("|").split("|")]
        if parts and parts[0] == first:
            return parts
    raise AssertionError(f"no row {first!r}")


def test_depth_curve_prefers_the_grad_pass():
    recs = [
        chain(0, 0.5, grad=False),
        chain(1, 0.6, grad=False),
        chain(1, 0.002),
        chain(0, 0.001),
        chain(0, 0.9, step=5),
        chain(1, 0.003, direction="backward"),
    ]
    assert precision.depth_curve(recs) == [(0, 0.001, "b0"), (1, 0.002, "b1")]
    assert precision.depth_curve(recs, "backward") == [(1, 0.003, "b1")]
    assert precision.depth_curve([chain(0, 0.5, grad=False)]) == [(0, 0.5, "b0")]


def test_op_totals_and_differences():
    recs = [op("forward", "matmul", "bf16", "bf16", 4), op("forward", "pointwise", "bf16", "bf16", 9),
            op("forward", "pointwise", "fp32+bf16", "fp32", 2), op("forward", "reduction", "bf16", "bf16", 1, kind="norm"),
            op("optimizer", "reduction", "fp32", "fp32", 5, role=None), op("forward", "cast", "fp32", "bf16", 3)]  # fmt: skip
    tot = precision.op_totals(recs)
    assert tot == Counter(
        {
            ("forward", "matmul", "bf16"): 4,
            ("forward", "pointwise", "fp32+bf16->fp32"): 2,
            ("forward", "norm statistics", "bf16"): 1,
            ("optimizer", "reduction (outside modules)", "fp32"): 5,
            ("forward", "cast", "fp32->bf16"): 3,
        }
    )
    rows = precision.differences({"a": tot, "b": Counter({("forward", "matmul", "bf16"): 4})})
    assert {r["category"] for r in rows} == {
        "pointwise",
        "norm statistics",
        "reduction (outside modules)",
        "cast",
    }


def test_no_section_without_records(tmp_path):
    with RunWriter(tmp_path / "plain") as w:
        w.write_manifest({"variant": "plain"})
        w.metrics(0, {"perf/step_time_s": 1.0})
        w.status("completed")
    assert precision.section([read_run(tmp_path / "plain")], tmp_path) == ([], [])
    assert "Precision" not in write_report(tmp_path).markdown
