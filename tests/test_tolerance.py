"""The trajectory tolerance model (`verlaudit.analysis.ci.tolerance`): its arithmetic on hand-worked
trajectories, its invariants (hypothesis), its file format, and `verlaudit compare` using it.
Replays of the committed derivation (every kernel condition passes, planted changes fail) are in
tests/test_tolerance_replay.py."""

import json
import math
import xml.etree.ElementTree as ET

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from verlaudit import cli
from verlaudit.analysis.ci import baseline_notes, compare, tolerance
from verlaudit.rundir import RunWriter

FLOOR = 16 * 2**-23  # FLOOR_ULPS x fp32 epsilon, per unit of the reference's magnitude


def runs_of(**conds):
    """{condition: {"v": {"m": values}}}"""
    return {c: {"v": {"m": list(vals)}} for c, vals in conds.items()}


def test_metric_model_by_hand():
    runs = runs_of(A=[1.0, 2.0, 3.0], B=[1.1, 1.9, 3.0], C=[1.0, 2.05, 2.7])
    mm = tolerance.metric_model(runs, "v", "m", reference="A", safety=2.0)
    # spread per step: 1.1-1.0, 2.05-1.9, 3.0-2.7 -> envelope the same (already increasing)
    assert mm["spread"] == pytest.approx([0.1, 0.15, 0.3])
    assert mm["step_atol"] == pytest.approx([0.2, 0.3, 0.6])  # k = 2
    # prefix means: A 1, 1.5, 2; B 1.1, 1.5, 2.0; C 1.0, 1.525, 1.91667 -> spread 0.1, 0.025, 0.0833;
    # the envelope keeps 0.1 (the mean tolerance never shrinks as more steps are compared)
    assert mm["mean_spread"] == pytest.approx([0.1, 0.025, 0.25 / 3])
    assert mm["mean_atol"] == pytest.approx([0.2, 0.2, 0.2])
    assert mm["floor"] == pytest.approx(FLOOR * 3.0)  # max |reference| = 3


def test_spread_shrinking_later_keeps_the_envelope_and_floor_applies():
    # the conditions agree from step 1 on: the tolerance stays at step 0's, and where every step
    # agrees the floor (fp32 rounding of the magnitude) is all that is left
    runs = runs_of(A=[0.5, 0.5, 0.5], B=[0.6, 0.5, 0.5])
    assert tolerance.metric_model(runs, "v", "m", reference="A", safety=1.0)["step_atol"] == pytest.approx(
        [0.1, 0.1, 0.1]
    )
    flat = tolerance.metric_model(runs_of(A=[0.5, 0.5], B=[0.5, 0.5]), "v", "m", reference="A", safety=4.0)
    assert flat["step_atol"] == [FLOOR * 0.5] * 2 and flat["spread"] == [0.0, 0.0]


def test_derive_covers_the_common_steps_and_names_presets():
    runs = {"A": {"v": {"m": [1.0, 2.0, 3.0]}}, "B": {"v": {"m": [1.0, 2.0]}}}
    model = tolerance.derive(runs, reference="A", safety=4.0, metrics=("m",), presets={"v": "fp16"})
    assert model["steps"] == 2 and model["variants"]["v"]["preset"] == "fp16"
    assert len(model["variants"]["v"]["metrics"]["m"]["step_atol"]) == 2
    with pytest.raises(ValueError, match="reference condition 'X'"):
        tolerance.derive(runs, reference="X", safety=4.0, metrics=("m",))


def test_leave_one_factor_out_by_hand():
    runs = runs_of(A=[1.0, 2.0], B=[1.0, 2.2], C=[1.0, 2.1], D=[1.0, 2.15])
    groups = tolerance.factor_groups({"A": {}, "B": {"X": "1"}, "C": {"Y": "1"}, "D": {"X": "1", "Y": "1"}})
    assert groups == {"X=1": ["B", "D"], "Y=1": ["C", "D"]}
    r = tolerance.loo_ratios(runs, "v", "m", groups, reference="A")
    # without B, D: (A, C) spread 0, 0.1; B's largest distance 0.2 at step 1 -> 2; D's 0.15 -> 1.5
    # without C, D: (A, B) spread 0, 0.2; C's largest distance 0.1 -> 0.5, D's 0.15 -> 0.75
    # (at step 0 every condition agrees and the floor keeps the ratio at 0)
    assert r == {"X=1": pytest.approx(2.0), "Y=1": pytest.approx(0.75)}


def test_safety_factor_per_variant_by_hand():
    loo = {"a": {"m1": {"X=1": 1.5, "Y=1": 9.0}, "m2": {"X=1": 2.44}}, "b": {"m1": {"X=1": 0.3}}}
    # a: Y=1 not counted -> largest 2.44 -> 2 x 2.44 = 4.88 -> 4.9 (rounded up to 0.1); b: 0.6 < 4 -> 4
    assert tolerance.safety_factors(loo, exclude=["Y=1"]) == {"a": 4.9, "b": 4.0}
    assert tolerance.safety_factors(loo) == {"a": 18.0, "b": 4.0}


def test_violations_by_hand():
    mm = tolerance.MetricModel(step_atol=(0.1, 0.2, 0.4), mean_atol=(0.1, 0.1, 0.1), floor=0.0)
    assert tolerance.violations(mm, [1, 2, 3], [1.05, 2.15, 3.3]) == [
        ("mean of 3", pytest.approx(0.5 / 3), 0.1)  # each step inside, the one-sided mean 0.1667 is not
    ]
    # d = +0.05, +0.25, -0.1: step 1 outside 0.2; the mean 0.0667 inside 0.1
    assert tolerance.violations(mm, [1, 2, 3], [1.05, 2.25, 2.9]) == [("step 1", pytest.approx(0.25), 0.2)]
    assert tolerance.violations(mm, [1, 2, 3], [1.05, 2.25, 2.9], steps=1) == []  # first step only
    assert tolerance.violations(mm, [1, 2, 3], [1, math.nan, 3])[0][:2] == ("step 1", math.inf)


trajectories = st.lists(
    st.lists(st.floats(-10, 10, allow_nan=False), min_size=4, max_size=4), min_size=2, max_size=5
)


@settings(max_examples=60, deadline=None)
@given(trajectories, st.floats(1.0, 10.0))
def test_every_measured_condition_passes_against_every_other(conds, k):
    runs = {f"c{i}": {"v": {"m": xs}} for i, xs in enumerate(conds)}
    mm_json = tolerance.metric_model(runs, "v", "m", reference="c0", safety=k)
    mm = tolerance.MetricModel(
        step_atol=tuple(mm_json["step_atol"]), mean_atol=tuple(mm_json["mean_atol"]), floor=mm_json["floor"]
    )
    assert all(b >= a for a, b in zip(mm.step_atol, mm.step_atol[1:]))  # non-decreasing along the trajectory
    assert all(a >= mm.floor for a in mm.step_atol)
    for a in conds:
        for b in conds:
            assert tolerance.violations(mm, a, b) == []


def write_run(path, losses, preset="fp16", grad=None):
    with RunWriter(path) as w:
        w.write_manifest(
            {
                "variant": path.name,
                "suite": "tiny",
                "config": {"steps": len(losses), "precision": {"preset": preset}},
                "environment": {"device": "cpu"},
            }
        )
        for s, x in enumerate(losses):
            w.metrics(s, {"actor/loss": x, "actor/grad_norm": (grad or [1.0] * len(losses))[s]})
        w.status("completed")
    return path


def write_model(
    dest, variant="fp16", loss=(1e-4, 2e-4, 4e-4), grad=(1e-3, 1e-3, 1e-3), mean=(1e-4, 1e-4, 1e-4)
):
    metrics = {
        "actor/loss": {"floor": 1e-8, "step_atol": list(loss), "mean_atol": list(mean)},
        "actor/grad_norm": {"floor": 1e-8, "step_atol": list(grad), "mean_atol": list(grad)},
    }
    data = {
        "format": 1,
        "steps": len(loss),
        "floor_ulps": 16.0,
        "variants": {variant: {"preset": "fp16", "safety": 4.0, "metrics": metrics}},
    }
    (dest / tolerance.TOLERANCE_FILE).write_text(json.dumps(data))
    return data


def test_compare_uses_the_model_per_step_and_says_so(tmp_path):
    base_losses = [0.1, 0.2, 0.3, 0.4]
    write_run(tmp_path / "base" / "fp16", base_losses)
    write_model(tmp_path / "base")
    # d = +5e-5, -1.5e-4, +3e-4 inside the model's 1e-4, 2e-4, 4e-4; step 3 is beyond the model: the
    # default loss_atol 0.05 applies to its 0.01, and to the mean of 4 steps (0.0102 / 4 = 0.00255) the
    # default loss_mean_atol 0.01
    now = write_run(tmp_path / "now" / "fp16", [0.10005, 0.19985, 0.3003, 0.41])
    md, junit = tmp_path / "s.md", tmp_path / "j.xml"
    argv = [
        str(now.parent),
        "--baseline",
        str(tmp_path / "base"),
        "--markdown",
        str(md),
        "--junit",
        str(junit),
    ]
    assert cli.main(["compare", *argv]) == 0
    text = md.read_text()
    assert "steps 0-2 \\|d\\|<=[0.0001, 0.0002, 0.0004] (model fp16)" in text
    assert "step 3 \\|d\\|<=0.05 (loss_atol (default))" in text
    assert "trajectory:actor/grad_norm" in text  # every metric of the model is checked
    case = ET.parse(junit).getroot().find("./testsuite/testcase[@name='trajectory:actor/loss']")
    assert case.find("system-out").text.startswith(
        "tolerance: steps 0-2 |d|<=[0.0001, 0.0002, 0.0004] (model fp16); step 3 |d|<=0.05 (loss_atol (default))"
    )
    # the same run against a model with a tighter step 1: fails there, naming step and tolerance
    write_model(tmp_path / "base", loss=(1e-4, 1e-4, 4e-4))
    checks = compare.compare_runs(
        compare.load_runs(tmp_path / "base", "B")[0],
        compare.load_runs(now.parent, "R")[0],
        compare.load_settings({}),
        tolerance.load_model(tmp_path / "base"),
    )
    c = next(c for c in checks if c.check == "trajectory:actor/loss")
    assert c.verdict == "fail" and "step 1: 0.19985 vs 0.2 (|d| 0.00015 > 0.0001)" in c.message


def test_explicit_tolerances_win_over_the_model(tmp_path):
    write_run(tmp_path / "base" / "fp16", [0.1, 0.2, 0.3])
    write_model(tmp_path / "base", loss=(1e-9, 1e-9, 1e-9), mean=(1e-9, 1e-9, 1e-9))
    now = write_run(tmp_path / "now" / "fp16", [0.1001, 0.2, 0.3])
    args = [str(now.parent), "--baseline", str(tmp_path / "base")]
    assert cli.main(["compare", *args]) == 1  # the model: 1e-4 > 1e-9
    assert cli.main(["compare", *args, "--tolerances", "loss_atol=1e-3,loss_mean_atol=1e-3"]) == 0
    s = compare.load_settings({"tolerances": {"loss_atol": 1e-3}}, ["loss_mean_atol=1e-3"])
    assert s.explicit_for_variant("fp16") == {
        "loss_atol": "suite compare.tolerances",
        "loss_mean_atol": "--tolerances",
    }
    base, cur = (compare.load_runs(p, "x")[0]["fp16"] for p in (tmp_path / "base", now.parent))
    mm = tolerance.load_model(tmp_path / "base").variants["fp16"].metrics["actor/loss"]
    c = compare.check_trajectory(
        "fp16", "actor/loss", base, cur, s.for_variant("fp16"), ("fp16", mm), s.explicit_for_variant("fp16")
    )
    assert (
        c.verdict == "pass" and "steps 0-2 |d|<=0.001 (loss_atol (suite compare.tolerances))" in c.tolerance
    )


def test_model_found_by_preset_for_another_variant_name(tmp_path):
    assert tolerance.load_model(tmp_path) is None  # no tolerances.json: no model
    write_model(tmp_path, variant="fp16")
    model = tolerance.load_model(tmp_path)
    assert model.for_variant("fp16-s1", "fp16")[0] == "fp16"
    assert model.for_variant("mine", "fp16")[0] == "fp16 (preset fp16)"
    assert model.for_variant("mine", "bf16") is None


@pytest.mark.parametrize(
    ("content", "match"),
    [
        ("{", "not readable JSON"),
        ('{"format": 2}', "format: expected 1"),
        ('{"format": 1, "variants": []}', "variants: expected a non-empty mapping"),
        (
            '{"format": 1, "variants": {"fp16": {"metrics": {"actor/loss": {"floor": 0, "step_atol": [-1], '
            '"mean_atol": [1]}}}}}',
            r"variants.fp16.metrics.actor/loss.step_atol: expected a non-empty list",
        ),
        (
            '{"format": 1, "variants": {"fp16": {"metrics": {"actor/loss": {"floor": 0, "step_atol": [1], '
            '"mean_atol": [1]}}}}, "steps": 1}',
            r"variants.fp16.safety: expected a number >= 1",
        ),
        (
            '{"format": 1, "variants": {"fp16": {"safety": 4, "metrics": {"actor/loss": {"floor": 0, '
            '"step_atol": [1], "mean_atol": [1]}}}}, "steps": 0}',
            "steps: expected an integer >= 1",
        ),
    ],
)
def test_malformed_model_names_file_and_field(tmp_path, content, match, capsys):
    (tmp_path / tolerance.TOLERANCE_FILE).write_text(content)
    with pytest.raises(ValueError, match=match) as e:
        tolerance.load_model(tmp_path)
    assert str(tmp_path / tolerance.TOLERANCE_FILE) in str(e.value)
    write_run(tmp_path / "fp16", [0.1])
    assert cli.main(["compare", str(tmp_path / "fp16"), "--baseline", str(tmp_path)]) == 2
    assert "Traceback" not in capsys.readouterr().err


def test_update_baseline_keeps_the_model_and_its_notes(tmp_path, capsys):
    dest = tmp_path / "baseline"
    write_run(tmp_path / "now" / "fp16", [0.1, 0.2, 0.3, 0.4])
    assert cli.main(["compare", str(tmp_path / "now"), "--baseline", str(dest), "--update-baseline"]) == 0
    assert "no tolerances.json" in capsys.readouterr().out
    data = write_model(dest)
    baseline_notes.write_notes(dest)
    assert "## Tolerance model (tolerances.json)" in (dest / "BASELINE.md").read_text()
    assert cli.main(["compare", str(tmp_path / "now"), "--baseline", str(dest), "--update-baseline"]) == 0
    out = capsys.readouterr().out
    assert "kept" in out and "steps >= 3 use loss_atol" in out
    assert json.loads((dest / tolerance.TOLERANCE_FILE).read_text()) == data
    notes = (dest / "BASELINE.md").read_text()
    assert "## Tolerance model (tolerances.json)" in notes and "verlaudit compare <RUN>" in notes
