"""The run directory's tolerant reader: a killed writer leaves a truncated last line, never a crash.

Run: `pytest tests/test_rundir.py`.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from verlaudit.rundir import Finding, RunWriter, dumps, iter_jsonl, read_run

scalars = st.one_of(
    st.integers(-1000, 1000),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=8),
    st.booleans(),
    st.none(),
)
records = st.lists(
    st.dictionaries(st.text(min_size=1, max_size=6), scalars, max_size=4), min_size=1, max_size=6
)


@settings(max_examples=60, deadline=None)
@given(recs=records, data=st.data())
def test_any_truncation_reads_back_a_prefix(tmp_path_factory, recs, data):
    path = tmp_path_factory.mktemp("r") / "m.jsonl"
    text = "".join(dumps(r) + "\n" for r in recs)
    cut = data.draw(st.integers(0, len(text.encode())))
    path.write_bytes(text.encode()[:cut])
    got = list(iter_jsonl(path))
    expected = [json.loads(dumps(r)) for r in recs]
    assert got == expected[: len(got)]
    # everything whose newline survived is read back: only the torn last line may be lost
    complete = text.encode()[:cut].count(b"\n")
    assert len(got) >= complete


def test_damaged_middle_line_names_file_and_line(tmp_path):
    p = tmp_path / "m.jsonl"
    p.write_text('{"step": 0}\n{"step": 1\n{"step": 2}\n')
    with pytest.raises(ValueError, match=r"m\.jsonl:2: damaged line"):
        list(iter_jsonl(p))


def test_replace_findings_keeps_appending_after_rewrite(tmp_path):
    w = RunWriter(tmp_path)
    a = Finding(severity="error", kind="dtype/x", message="m", where="a")
    w.finding(a)
    w.replace_findings([Finding(severity="error", kind="dtype/x", message="m", where="a", count=3)])
    w.finding(Finding(severity="warning", kind="dtype/y", message="m", where="b"))
    w.status("completed")
    run = read_run(tmp_path)
    assert [(f.kind, f.count) for f in run.findings] == [("dtype/x", 3), ("dtype/y", 1)]
    assert run.state == "completed"


def _run_dir(tmp_path, **files):
    """A valid 2-step run directory, with any file replaced by the given text."""
    w = RunWriter(tmp_path)
    w.write_manifest({"variant": "v", "seed": 0, "config": {"algo": {"name": "ppo"}}})
    for step in range(2):
        w.metrics(step, {"actor/loss": 0.5, "actor/grad_norm": float("nan")})
    w.finding(Finding(severity="warning", kind="dtype/x", message="m", where="a"))
    w.status("completed", step=1)
    w.close()
    for name, text in files.items():
        (tmp_path / name.replace("_", ".")).write_text(text)
    return tmp_path


@pytest.mark.parametrize(
    "file, text, message",
    [
        ("manifest_json", "[1, 2]", r"manifest\.json: expected a JSON object \{\.\.\.\}, got a list"),
        ("manifest_json", '"v"', r"manifest\.json: expected a JSON object .*got a string"),
        ("manifest_json", '{"seed": "zero"}', r"manifest\.json: seed: expected an integer, got a string"),
        ("manifest_json", '{"config": {"algo": [1]}}', r"manifest\.json: config\.algo: expected an object"),
        ("manifest_json", '{"policy": {"roles": [1]}}', r"manifest\.json: policy\.roles: expected an object"),
        ("status_json", "[]", r"status\.json: expected a JSON object"),
        ("status_json", '{"state": 3}', r"status\.json: state: expected a string"),
        (
            "status_json",
            '{"state": "done"}',
            r"status\.json: state: 'done'; expected one of completed, failed",
        ),
        ("status_json", '{"state": "failed", "step": 1.5}', r"status\.json: step: expected an integer"),
        # a complete last line of the wrong type is not a torn write: it is named, not skipped
        (
            "metrics_jsonl",
            '{"step": 0}\n[1, 2]\n',
            r"metrics\.jsonl:2: expected a JSON object per line, got a list",
        ),
        ("metrics_jsonl", '{"step": "0"}\n', r"metrics\.jsonl:1: step: expected an integer, got a string"),
        ("metrics_jsonl", '{"loss": 1}\n', r"metrics\.jsonl:1: step: expected an integer, got null"),
        (
            "metrics_jsonl",
            '{"step": 0, "actor/loss": [1]}\n',
            r"metrics\.jsonl:1: actor/loss: expected a number",
        ),
        (
            "metrics_jsonl",
            '{"step": 0, "actor/loss": "high"}\n',
            r"metrics\.jsonl:1: actor/loss: expected a number",
        ),
        ("findings_jsonl", '{"kind": "x", "message": "m"}\n', r"findings\.jsonl:1: severity: missing"),
        (
            "findings_jsonl",
            '{"severity": "bad", "kind": "x", "message": "m"}\n',
            r"findings\.jsonl:1: Finding\.severity",
        ),
        (
            "findings_jsonl",
            '{"severity": "error", "kind": 3, "message": "m"}\n',
            r"findings\.jsonl:1: kind: expected a string",
        ),
        ("events_jsonl", '{"step": 0}\n', r"events\.jsonl:1: kind: expected a string"),
    ],
)
def test_a_file_of_the_wrong_shape_is_named_not_a_traceback(tmp_path, file, text, message):
    path = _run_dir(tmp_path, **{file: text})
    with pytest.raises(ValueError, match=message):
        read_run(path)


def test_the_valid_run_dir_of_those_tests_reads(tmp_path):
    run = read_run(_run_dir(tmp_path))
    assert run.state == "completed" and [s for s, _ in run.series("actor/grad_norm")] == [0, 1]
