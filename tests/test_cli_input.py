"""Malformed input to every CLI verb is one line on stderr naming the file and the field, exit 2, no
traceback, and nothing started: hypothesis draws the malformation (a suite for `run` and `plan`, a run
directory for `diagnose` and `compare`, a file that is no log for `diagnose`). No worker runs: `run`
must fail before one starts (a started worker fails the test).

Run: `pytest tests/test_cli_input.py`.
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
import re
import tempfile
from pathlib import Path
from typing import Any
from unittest import mock

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from verlaudit import cli
from verlaudit.run import runner
from verlaudit.rundir import Finding, RunWriter

SETTINGS = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
KEY = st.text(alphabet="abcdefghijklmnopqrstuvwxyz_", min_size=3, max_size=10)


def cli_error(argv: list[str]) -> tuple[int, str]:
    """(exit code, stderr) of the verlaudit CLI run in-process; a worker start is an error."""
    err, out = io.StringIO(), io.StringIO()
    started = AssertionError("a worker was started for malformed input")
    with mock.patch.object(runner, "_run_one", side_effect=started):
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
            rc = cli.main(argv)
    return rc, err.getvalue()


def assert_one_line_error(verb: str, rc: int, err: str, file: Path | str, field: str) -> None:
    assert rc == 2, (rc, err)
    assert err.startswith(f"verlaudit {verb}: error: ") and err.endswith("\n") and err.count("\n") == 1, err
    assert "Traceback" not in err
    assert str(file) in err, (str(file), err)
    assert field in err, (field, err)


# ---- suites: run and plan -------------------------------------------------------------------------

VALID_SUITE: dict[str, Any] = {
    "name": "s",
    "train": {
        "steps": 1, "device": "cpu", "model": {"preset": "tiny-llama"},
        "data": {"task": "digits", "prompt_length": 8, "response_length": 2},
        "algo": {"name": "grpo", "lr": 0.001, "batch_size": 2}, "precision": {"preset": "fp32"},
    },
    "hardware": {"target": "cpu"},
    "audit": {"level": "boundary"},
    "variants": {"fp32": {}, "bf16": {"precision": {"preset": "bf16"}}},
}  # fmt: skip
SECTIONS = [(), ("train",), ("train", "model"), ("train", "data"), ("train", "algo"), ("train", "precision"),
            ("hardware",), ("audit",), ("variants", "bf16"), ("variants", "bf16", "precision")]  # fmt: skip


def _leaves(d: Any, path: tuple = ()) -> list[tuple]:
    if isinstance(d, dict) and d:
        return [leaf for k, v in d.items() for leaf in _leaves(v, (*path, k))]
    return [path]


def _at(d: dict, path: tuple) -> dict:
    for part in path:
        d = d.setdefault(part, {})
    return d


@st.composite
def malformed_suites(draw) -> tuple[dict[str, Any], str]:
    """A suite with one mistake, and the field its error must name."""
    data = copy.deepcopy(VALID_SUITE)
    kind = draw(
        st.sampled_from(
            [
                "wrong_type",
                "unknown_key",
                "no_train",
                "variants_list",
                "bad_steps",
                "bad_preset",
                "missing_plugin",
                "plugin_signature",
                "missing_model_dir",
            ]
        )
    )
    if kind == "wrong_type":  # a list is the wrong type for every field of the suite
        leaf = draw(st.sampled_from(_leaves(data)))
        _at(data, leaf[:-1])[leaf[-1]] = [1, 2]
        return data, ".".join(leaf) + ":"
    if kind == "unknown_key":
        section, key = draw(st.sampled_from(SECTIONS)), draw(KEY)
        target = _at(data, section)
        if key in target:
            key += "_x"
        target[key] = 1
        return data, ".".join((*section, key)) + ": unknown key"
    if kind == "no_train":
        del data["train"]
        return data, "train: missing"
    if kind == "variants_list":
        data["variants"] = list(data["variants"])
        return data, "variants: expected a non-empty mapping"
    if kind == "bad_steps":
        where = draw(st.sampled_from([("train",), ("variants", "fp32")]))
        _at(data, where)["steps"] = draw(st.integers(-5, 0))
        return data, ".".join(where) + ".steps: must be >= 1"
    if kind == "bad_preset":
        data["train"]["model"]["preset"] = draw(KEY)
        return data, "train.model.preset: unknown preset"
    if kind == "missing_plugin":
        field = draw(st.sampled_from(["dataset", "collator", "reward_fn"]))
        data["train"]["data"][field] = f"plugins/{draw(KEY)}.py:fn"
        return data, f"train.data.{field}: "
    if kind == "plugin_signature":  # a module plug-in the trainer cannot call with its arguments
        field, fn = draw(
            st.sampled_from(
                [
                    ("collator", "tests.faults:nan_reward"),
                    ("reward_fn", "tests.faults:fp16_reward_model"),
                    ("dataset", "tests.faults:float_ids_collator"),
                ]
            )
        )
        data["variants"]["bf16"]["data"] = {field: fn}
        return data, f"variants.bf16.data.{field}: {fn!r}: the trainer calls it as"
    data["variants"]["fp32"]["model"] = {"path": f"/no/such/{draw(KEY)}"}
    return data, "variants.fp32.model.path: "


def _write_suite(d: Path, data: Any) -> Path:
    p = d / "suite.yaml"
    p.write_text(yaml.safe_dump(data))
    return p


@SETTINGS
@given(case=malformed_suites(), steps=st.sampled_from([None, "2"]))
def test_run_on_a_malformed_suite(case, steps):
    data, field = case
    with tempfile.TemporaryDirectory() as tmp:
        p = _write_suite(Path(tmp), data)
        out = Path(tmp) / "out"
        rc, err = cli_error(["run", str(p), "--out", str(out)] + (["--steps", steps] if steps else []))
        assert_one_line_error("run", rc, err, p, field)
        # nothing ran; a variant the preflight refused keeps a run directory saying why (status failed)
        for d in out.iterdir() if out.exists() else ():
            assert d.is_dir() and json.loads((d / "status.json").read_text())["state"] == "failed", d


@SETTINGS
@given(case=malformed_suites())
def test_plan_on_a_malformed_suite(case):
    data, field = case
    with tempfile.TemporaryDirectory() as tmp:
        p = _write_suite(Path(tmp), data)
        assert_one_line_error("plan", *cli_error(["plan", str(p)]), p, field)


@SETTINGS
@given(text=st.sampled_from(["name: s\n  bad: [\n", "name: s\nname: t\n", "- 1\n- 2\n", "42\n", "[oops\n"]))
def test_run_and_plan_on_a_file_that_is_not_a_suite(text):
    with tempfile.TemporaryDirectory() as tmp:
        p = Path(tmp) / "suite.yaml"
        p.write_text(text)
        for verb in ("run", "plan"):
            rc, err = cli_error([verb, str(p)] + (["--out", f"{tmp}/o"] if verb == "run" else []))
            # a YAML error names file:line:column; a document of the wrong shape names the file
            assert_one_line_error(verb, rc, err, p, "YAML error" if "YAML" in err else "a suite is a mapping")


# ---- run directories: diagnose and compare --------------------------------------------------------


def _valid_run(path: Path) -> Path:
    with RunWriter(path) as w:
        w.write_manifest(
            {
                "variant": path.name,
                "suite": "t",
                "seed": 0,
                "config": {"algo": {"name": "ppo"}, "steps": 3},
                "policy": {"preset": "fp32", "roles": {}},
            }
        )
        for step in range(3):
            w.metrics(step, {"actor/loss": 1.0 - 0.1 * step, "actor/grad_norm": 0.5})
        w.finding(Finding(severity="warning", kind="dtype/x", message="m", where="a", step=0))
        w.event("memory", step=0, phase="rollout")
        w.status("completed", step=2, steps=3)
    return path


JSON_NOT_OBJECT = st.sampled_from(["[1, 2]", '"text"', "3", "null", "true"])
# (file, a corruption -> (text, the field or line its error names))
CORRUPTIONS = {
    "manifest.json": st.one_of(
        JSON_NOT_OBJECT.map(lambda t: (t, "expected a JSON object")),
        st.sampled_from([("seed", '"0"'), ("variant", "[1]"), ("config", "[]"), ("policy", '"fp32"'),
                         ("environment", "1.5")]).map(lambda kv: (f'{{"{kv[0]}": {kv[1]}}}', f"{kv[0]}: expected")),
    ),
    "status.json": st.one_of(
        JSON_NOT_OBJECT.map(lambda t: (t, "expected a JSON object")),
        st.sampled_from([('{"state": "running"}', "state: 'running'"), ('{"state": 1}', "state: expected"),
                         ('{"state": "failed", "step": "2"}', "step: expected an integer"),
                         ('{"state": "failed", "error": []}', "error: expected a string")]),
    ),
    "metrics.jsonl": st.sampled_from([
        ('{"step": 0}\n[1]\n', "metrics.jsonl:2: expected a JSON object"),
        ('{"step": 0}\n{"step": 1\n{"step": 2}\n', "metrics.jsonl:2: damaged line"),
        ('{"step": "0", "actor/loss": 1}\n', "metrics.jsonl:1: step: expected an integer"),
        ('{"step": 0, "actor/loss": {"a": 1}}\n', "metrics.jsonl:1: actor/loss: expected a number"),
        ('{"step": 0, "actor/loss": "low"}\n', "metrics.jsonl:1: actor/loss: expected a number"),
        ('"step"\n', "metrics.jsonl:1: expected a JSON object"),
    ]),
    "findings.jsonl": st.sampled_from([
        ('{"kind": "x", "message": "m"}\n', "findings.jsonl:1: severity: missing"),
        ('{"severity": "fatal", "kind": "x", "message": "m"}\n', "findings.jsonl:1: Finding.severity"),
        ('{"severity": "error", "kind": ["x"], "message": "m"}\n', "findings.jsonl:1: kind: expected a string"),
        ('{"severity": "error", "kind": "x", "message": "m", "step": "one"}\n', "findings.jsonl:1: step: expected"),
        ("[]\n", "findings.jsonl:1: expected a JSON object"),
    ]),
    "events.jsonl": st.sampled_from([('{"phase": "rollout"}\n', "events.jsonl:1: kind: expected a string")]),
}  # fmt: skip


@st.composite
def corrupted_run(draw) -> tuple[str, str, str]:
    file = draw(st.sampled_from(sorted(CORRUPTIONS)))
    text, field = draw(CORRUPTIONS[file])
    return file, text, field


@SETTINGS
@given(case=corrupted_run(), as_suite_dir=st.booleans())
def test_diagnose_on_a_malformed_run_directory(case, as_suite_dir):
    file, text, field = case
    with tempfile.TemporaryDirectory() as tmp:
        run = _valid_run(Path(tmp) / "v")
        (run / file).write_text(text)
        target = tmp if as_suite_dir else run  # a run directory, or the suite report directory above it
        assert_one_line_error("diagnose", *cli_error(["diagnose", str(target)]), run / file, field)


@SETTINGS
@given(case=corrupted_run(), which=st.sampled_from(["run", "baseline"]))
def test_compare_on_a_malformed_run_directory(case, which):
    file, text, field = case
    with tempfile.TemporaryDirectory() as tmp:
        now, base = _valid_run(Path(tmp) / "now" / "v"), _valid_run(Path(tmp) / "base" / "v")
        bad = now if which == "run" else base
        (bad / file).write_text(text)
        rc, err = cli_error(["compare", str(now.parent), "--baseline", str(base.parent)])
        assert_one_line_error("compare", rc, err, bad / file, field)


@SETTINGS
@given(
    content=st.one_of(
        st.just(b""),
        st.text(alphabet=" \t\n\r", max_size=50).map(str.encode),
        st.binary(min_size=64, max_size=4096).filter(lambda b: b"\0" in b),
        st.binary(min_size=1, max_size=64).map(lambda b: b"\x1f\x8b\x08\x00" + b + bytes(range(256))),
    )
)
def test_diagnose_on_a_file_that_is_no_log(content):
    with tempfile.TemporaryDirectory() as tmp:
        p = Path(tmp) / "train.log"
        p.write_bytes(content)
        rc, err = cli_error(["diagnose", str(p)])
        assert_one_line_error("diagnose", rc, err, p, "neither a log nor a run directory")
        assert re.search(r": (empty file|a binary file): ", err), err


def test_diagnose_on_dev_null():
    rc, err = cli_error(["diagnose", "/dev/null"])
    assert_one_line_error("diagnose", rc, err, "/dev/null", "neither a log nor a run directory")


def test_the_valid_inputs_of_these_tests_are_accepted(tmp_path):
    # the malformations above are the only thing wrong: the unchanged inputs pass the same checks
    with tempfile.TemporaryDirectory() as tmp:
        p = _write_suite(Path(tmp), VALID_SUITE)
        rc, err = cli_error(["plan", str(p)])
        assert rc == 0, err
    now, base = _valid_run(tmp_path / "now" / "v"), _valid_run(tmp_path / "base" / "v")
    assert cli_error(["diagnose", str(now)])[0] in (0, 1)
    rc, err = cli_error(["compare", str(now.parent), "--baseline", str(base.parent)])
    assert rc == 0, err
    assert json.loads((now / "manifest.json").read_text())["variant"] == "v"
