"""Gate expressions: parsing, evaluation on hand-worked series, and refusal of anything but the grammar."""

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from verlaudit.analysis.ci.gates import FUNCTIONS, check_gates, check_known_metrics, parse_gate

SERIES = {
    "actor/grad_norm": [1.0, 3.0, 8.0, 2.0],  # median 2.5, max 8, mean 3.5, last 2
    "rollout_corr/kl": [0.001, 0.002],
    "critic/score/mean": [0.25, 0.5, 0.75],  # mean 0.5
    "actor/loss": [0.5, float("nan"), 0.4],
}


@pytest.mark.parametrize(
    "expr, expected",
    [
        ("median(actor/grad_norm) < 5", True),  # 2.5 < 5
        ("median(actor/grad_norm) < 2", False),
        ("max(rollout_corr/kl) < 0.01", True),  # 0.002
        ("mean(critic/score/mean) >= 0.5", True),  # (0.25+0.5+0.75)/3 = 0.5, exact in binary
        ("last(actor/grad_norm) == 2", True),
        ("min(actor/grad_norm) > 0 and max(actor/grad_norm) < 5", False),  # max 8
        ("min(actor/grad_norm) > 5 or count(actor/grad_norm) == 4", True),
        ("not max(actor/grad_norm) < 5", True),
        ("std(actor/grad_norm) < 3", True),  # pstdev of [1,3,8,2]: sqrt(7.25)=2.69
        ("mean(actor/grad_norm, 2) == 5", True),  # last two steps: (8+2)/2
        ("max(actor/grad_norm) - min(actor/grad_norm) == 7", True),
        ("0 < last(actor/grad_norm) < 3", True),  # chained comparison
        ("-max(actor/grad_norm) < -7.5", True),
        ("max(actor/loss) < 10", False),  # NaN anywhere fails the gate
        ("count_nonfinite(actor/loss) == 1", True),
        ("max('actor/grad_norm') <= 8e0", True),
    ],
)
def test_evaluates_hand_worked_values(expr, expected):
    passed, values = parse_gate(expr).evaluate(SERIES)
    assert passed is expected
    assert values  # every aggregate that was computed is reported


def test_values_reported_by_check_gates():
    (rec,) = check_gates([parse_gate("median(actor/grad_norm) < 2")], SERIES)
    assert rec["passed"] is False
    assert rec["values"] == {"median(actor/grad_norm)": 2.5}
    assert "FAILED" in rec["message"] and "2.5" in rec["message"]


def test_missing_metric_in_one_run_fails_the_gate_not_the_program():
    (rec,) = check_gates([parse_gate("max(critic/vf_loss) < 1")], SERIES)
    assert rec["passed"] is False and "not recorded" in rec["message"]


def test_unknown_metric_everywhere_is_a_value_error_naming_it():
    with pytest.raises(ValueError, match=r"unknown metric 'actor/grad_nrom'.*actor/grad_norm"):
        check_known_metrics([parse_gate("max(actor/grad_nrom) < 1")], list(SERIES))


@pytest.mark.parametrize(
    "expr, match",
    [
        ("__import__('os').system('true')", "unexpected character '.'"),
        ("__import__('os') < 1", "unknown function '__import__'"),
        ("max(actor/loss).__class__ < 1", "unexpected character|after a complete expression|column"),
        ("lambda: 1", "bare name|lambda"),
        ("[x for x in (1,)] < 1", "unexpected character"),
        ("open('x') < 1", "unknown function 'open'"),
        ("eval('1') < 2", "unknown function 'eval'"),
        ("max(actor/loss)[0] < 1", "unexpected character"),
        ("max(max(actor/loss)) < 1", "expected '\\)'"),
        ("max(actor/loss)", "must compare"),
        ("max(actor/loss) <", "expected a number"),
        ("max(actor/loss) < 1 ;", "unexpected character"),
        ("median(actor/grad_norm, 0) < 1", "positive integer"),
        ("median(actor/grad_norm, 1.5) < 1", "positive integer"),
        ("actor/loss < 1", "bare name"),
        ("", "empty"),
        ("max(actor/loss) < 1 and", "expected a number"),
        ("(max(actor/loss) < 1", "expected '\\)'"),
    ],
)
def test_rejects_everything_outside_the_grammar(expr, match):
    with pytest.raises(ValueError, match=match):
        parse_gate(expr)


def test_every_whitelisted_function_parses_and_nothing_else_does():
    for name in FUNCTIONS:
        parse_gate(f"{name}(actor/loss) >= 0")
    for name in ("getattr", "exec", "compile", "globals", "print", "len"):
        with pytest.raises(ValueError, match="unknown function"):
            parse_gate(f"{name}(actor/loss) >= 0")


@given(st.lists(st.floats(min_value=-1e6, max_value=1e6), min_size=1, max_size=20))
def test_aggregates_agree_with_direct_computation(xs):
    s = {"m/x": xs}
    assert parse_gate(f"max(m/x) == {max(xs)!r}").evaluate(s)[0]
    assert parse_gate(f"min(m/x) == {min(xs)!r}").evaluate(s)[0]
    assert parse_gate(f"last(m/x) == {xs[-1]!r}").evaluate(s)[0]
    assert parse_gate(f"count(m/x) == {len(xs)}").evaluate(s)[0]
    lo, hi = min(xs), max(xs)
    _, vals = parse_gate("mean(m/x) >= 0 or 1 > 0").evaluate(s)
    assert lo - 1e-6 <= vals["mean(m/x)"] <= hi + 1e-6
    assert not math.isnan(vals["mean(m/x)"])
