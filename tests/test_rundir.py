"""The run directory's tolerant reader: a killed writer leaves a truncated last line, never a crash.

Run: `pytest tests/test_rundir.py`.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from verlaudit.rundir import Finding, RunWriter, dumps, iter_jsonl, read_run

scalars = st.one_of(st.integers(-1000, 1000), st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=8),
                    st.booleans(), st.none())  # fmt: skip
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
