"""`verlaudit compare`: planted regressions are flagged, an identical rerun passes, JUnit XML parses
back with the right counts, tolerances come from the suite copy and the command line."""

import json
import shutil
import xml.etree.ElementTree as ET

import pytest

from verlaudit import cli
from verlaudit.analysis.ci import compare
from verlaudit.rundir import Finding, RunWriter


def write_run(
    path, *, losses=None, mem=1.0, step_time=0.1, skipped=None, findings=(), status="completed", source="nvml"
):
    losses = losses if losses is not None else [1.0 - 0.05 * s for s in range(10)]
    with RunWriter(path) as w:
        w.write_manifest(
            {
                "variant": path.name,
                "suite": "tiny",
                "config": {"steps": len(losses)},
                "environment": {"device": "cpu"},
                "memory": {"source": source},
            }
        )
        for s, loss in enumerate(losses):
            w.metrics(
                s,
                {
                    "actor/loss": loss,
                    "actor/grad_norm": 0.5 + 0.1 * s,
                    "actor/skipped": (skipped or {}).get(s, 0.0),
                    "perf/device_memory_peak_gb": mem,
                    "perf/step_time_s": step_time,
                },
            )
        for f in findings:
            w.finding(f)
        w.status(
            status, **({} if status == "completed" else {"reason": "oom", "step": 3, "phase": "actor_update"})
        )
    return path


def report(root, compare_cfg=None, **per_variant):
    root.mkdir(parents=True)
    (root / "suite.json").write_text(json.dumps({"name": "tiny", "compare": compare_cfg or {}}))
    for name in ("fp32", "bf16"):
        write_run(root / name, **per_variant.get(name, {}))
    return root


def run_cli(argv):
    """`verlaudit compare ...` through the real command line (ValueError -> one-line error, exit 2)."""
    return cli.main(["compare", *argv])


def verdicts(checks):
    return {(c.variant, c.check): c.verdict for c in checks}


def test_identical_rerun_passes_and_junit_parses(tmp_path):
    base, now = report(tmp_path / "base"), report(tmp_path / "now")
    junit, md = tmp_path / "j.xml", tmp_path / "s.md"
    assert run_cli([str(now), "--baseline", str(base), "--junit", str(junit), "--markdown", str(md)]) == 0
    root = ET.parse(junit).getroot()
    cases = root.findall("./testsuite/testcase")
    # per variant: status, memory, step_time, trajectory:actor/loss, findings, overflow = 6; two variants
    assert len(cases) == 12 and root.get("tests") == "12" and root.get("failures") == "0"
    assert not root.findall(".//failure")
    assert {c.get("classname") for c in cases} == {"tiny.fp32", "tiny.bf16"}
    assert "no regression" in md.read_text()


def test_planted_regressions_each_flagged(tmp_path):
    base = report(tmp_path / "base")
    drift = [1.0 - 0.05 * s + 0.02 for s in range(10)]  # +0.02 everywhere: inside atol 0.05, mean 0.02 > 0.01
    err = Finding(
        severity="error",
        kind="dtype/module_input",
        role="actor",
        where="model.layers.0.mlp",
        message="fp32 into bf16",
        step=1,
    )
    now = report(
        tmp_path / "now",
        fp32={"losses": drift, "mem": 1.06, "step_time": 0.2},
        bf16={"findings": [err], "skipped": {4: 1.0}},
    )
    checks = compare.compare_runs(
        *[compare.load_runs(p, "x")[0] for p in (base, now)], compare.load_settings({})
    )
    v = verdicts(checks)
    assert v[("fp32", "memory")] == "fail"  # 1.06 > 1.0 * 1.05
    assert v[("fp32", "step_time")] == "fail"  # x2.0 > x1.5
    assert v[("fp32", "trajectory:actor/loss")] == "fail"
    drift_msg = next(c.message for c in checks if c.check == "trajectory:actor/loss" and c.variant == "fp32")
    assert "one-sided drift: mean residual +0.02" in drift_msg
    assert v[("bf16", "findings")] == "fail" and v[("bf16", "overflow")] == "fail"
    assert v[("bf16", "memory")] == "pass" and v[("bf16", "trajectory:actor/loss")] == "pass"
    junit = tmp_path / "j.xml"
    assert run_cli([str(now), "--baseline", str(base), "--junit", str(junit)]) == 1
    failures = ET.parse(junit).getroot().findall(".//testcase/failure")
    assert len(failures) == 5


def test_single_step_spike_and_nan_fail_trajectory(tmp_path):
    base = write_run(tmp_path / "b" / "fp32")
    spike = [1.0 - 0.05 * s for s in range(10)]
    spike[7] += 0.2  # |d| 0.2 > 0.05 at one step; mean 0.02 > 0.01 too, but the step is named
    now = write_run(tmp_path / "n" / "fp32", losses=spike)
    c = compare.check_trajectory(
        "fp32",
        "actor/loss",
        *(compare.load_runs(p, "x")[0]["fp32"] for p in (base, now)),
        compare.DEFAULT_TOLERANCES,
    )
    assert c.verdict == "fail" and "step 7" in c.message
    nan = [1.0 - 0.05 * s for s in range(10)]
    nan[3] = float("nan")
    now2 = write_run(tmp_path / "n2" / "fp32", losses=nan)
    c = compare.check_trajectory(
        "fp32",
        "actor/loss",
        compare.load_runs(base, "x")[0]["fp32"],
        compare.load_runs(now2, "x")[0]["fp32"],
        compare.DEFAULT_TOLERANCES,
    )
    assert c.verdict == "fail" and "non-finite at step(s) [3]" in c.message


def test_completed_before_failed_now(tmp_path):
    base = report(tmp_path / "base")
    now = report(tmp_path / "now", bf16={"status": "failed", "losses": [1.0, 0.95, 0.9]})
    checks = compare.compare_runs(
        *[compare.load_runs(p, "x")[0] for p in (base, now)], compare.load_settings({})
    )
    v = verdicts(checks)
    assert v[("bf16", "status")] == "fail"
    msg = next(c.message for c in checks if c.check == "trajectory:actor/loss" and c.variant == "bf16")
    assert "7 baseline step(s) missing now (from step 3)" in msg


def test_rss_memory_uses_absolute_slack_and_mixed_sources_skip(tmp_path):
    base = write_run(tmp_path / "b" / "fp32", mem=0.80, source="rss")
    now = write_run(tmp_path / "n" / "fp32", mem=0.90, source="rss")  # +12.5% but +0.1 GB < 0.25 GB slack
    b, n = (compare.load_runs(p, "x")[0]["fp32"] for p in (base, now))
    assert compare.check_memory("fp32", b, n, compare.DEFAULT_TOLERANCES).verdict == "pass"
    now2 = write_run(tmp_path / "n2" / "fp32", mem=1.10, source="rss")  # +0.3 GB
    n2 = compare.load_runs(now2, "x")[0]["fp32"]
    assert compare.check_memory("fp32", b, n2, compare.DEFAULT_TOLERANCES).verdict == "fail"
    now3 = write_run(tmp_path / "n3" / "fp32", mem=0.8, source="nvml")
    n3 = compare.load_runs(now3, "x")[0]["fp32"]
    assert compare.check_memory("fp32", b, n3, compare.DEFAULT_TOLERANCES).verdict == "skip"


def test_suite_tolerances_and_gates_and_cli_override(tmp_path):
    drift = [1.0 - 0.05 * s + 0.02 for s in range(10)]
    base = report(tmp_path / "base")
    cfg = {"tolerances": {"loss_mean_atol": 0.03}, "gates": ["max(actor/grad_norm) < 1.0"]}
    now = report(tmp_path / "now", compare_cfg=cfg, fp32={"losses": drift})
    runs = [compare.load_runs(p, "x")[0] for p in (base, now)]
    v = verdicts(compare.compare_runs(*runs, compare.load_settings(cfg)))
    assert v[("fp32", "trajectory:actor/loss")] == "pass"  # 0.02 <= 0.03 from the suite
    assert v[("fp32", "gate:max(actor/grad_norm) < 1.0")] == "fail"  # 0.5 + 0.1*9 = 1.4
    # the command line wins over the suite
    assert run_cli([str(now), "--baseline", str(base), "--tolerances", "loss_mean_atol=0.001"]) == 1
    s = compare.load_settings(cfg, ["loss_mean_atol=0.001"], ["median(actor/grad_norm) < 2"])
    assert s.tolerances["loss_mean_atol"] == 0.001 and len(s.gates) == 2


@pytest.mark.parametrize(
    "cfg, cli, match",
    [
        ({"tolerance": {}}, [], "compare.tolerance: unknown key"),
        ({"tolerances": {"loss_atl": 1}}, [], "compare.tolerances.loss_atl: unknown tolerance"),
        ({"tolerances": {"loss_atol": -1}}, [], "non-negative"),
        ({"gates": ["__import__('os') < 1"]}, [], r"compare.gates\[0\].*unknown function"),
        ({}, ["loss_atol"], "expected key=value"),
        ({}, ["nope=1"], "unknown tolerance"),
    ],
)
def test_bad_settings_name_the_field(cfg, cli, match):
    with pytest.raises(ValueError, match=match):
        compare.load_settings(cfg, cli)


def test_unknown_gate_metric_is_bad_input(tmp_path):
    base, now = report(tmp_path / "base"), report(tmp_path / "now")
    assert run_cli([str(now), "--baseline", str(base), "--gate", "max(actor/grad_nrom) < 1"]) == 2


def _damaged(root):
    run = write_run(root / "run")
    (run / "manifest.json").write_text('{"variant": "run", "config": {')  # cut mid-write
    return run


@pytest.mark.parametrize(
    "case,match",
    [
        ("missing", "RUN .*nope: no such directory"),
        ("not_a_run", "contains no run directories"),
        ("damaged", "manifest.json: not valid JSON"),
        ("gate", "unknown metric 'actor/grad_nrom'"),
    ],
)
def test_cli_bad_input_is_one_paragraph_exit_2(tmp_path, capsys, case, match):
    import re

    base = report(tmp_path / "base")
    (tmp_path / "empty").mkdir()
    argv = {
        "missing": [str(tmp_path / "nope"), "--baseline", str(base)],
        "not_a_run": [str(tmp_path / "empty"), "--baseline", str(base)],
        "damaged": [str(_damaged(tmp_path / "d")), "--baseline", str(base / "fp32")],
        "gate": [str(base), "--baseline", str(base), "--gate", "max(actor/grad_nrom) < 1"],
    }[case]
    assert run_cli(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("verlaudit compare: error: ") and "Traceback" not in err
    assert err.strip().count("\n") == 0 and re.search(match, err), err


def test_cli_on_the_h200_fixture_exit_0_then_1(tmp_path, capsys):
    # The real H200 run directories: bf16 against itself passes (exit 0). A baseline in which
    # bf16-no-ckpt completed (the bf16 run under that name) makes today's OOM a status regression (exit 1).
    from pathlib import Path

    fixture = Path(__file__).parent / "fixtures" / "h200_dpo_suite"
    assert run_cli([str(fixture / "bf16"), "--baseline", str(fixture / "bf16")]) == 0
    base = tmp_path / "base"
    shutil.copytree(fixture / "bf16", base / "bf16")
    shutil.copytree(fixture / "bf16", base / "bf16-no-ckpt")
    capsys.readouterr()
    assert run_cli([str(fixture), "--baseline", str(base), "--junit", str(tmp_path / "j.xml")]) == 1
    out = capsys.readouterr().out
    assert "bf16-no-ckpt" in out and "fail" in out
    cases = ET.parse(tmp_path / "j.xml").getroot().iter("testcase")
    failed = {(c.get("classname"), c.get("name")) for c in cases if c.find("failure") is not None}
    # status, the empty loss trajectory and the new memory/oom error finding; bf16 itself passes
    assert failed == {
        ("llama7b_h200.bf16-no-ckpt", n) for n in ("status", "trajectory:actor/loss", "findings")
    }


def test_update_baseline_writes_copy_and_reports_changes(tmp_path, capsys):
    now = report(tmp_path / "now")
    dest = tmp_path / "baselines" / "tiny" / "cpu"
    assert run_cli([str(now), "--baseline", str(dest)]) == 2  # no baseline yet: says how to create one
    assert "--update-baseline" in capsys.readouterr().err
    assert run_cli([str(now), "--baseline", str(dest), "--update-baseline"]) == 0
    assert "creating baseline" in capsys.readouterr().out
    assert sorted(p.name for p in dest.iterdir()) == ["BASELINE.md", "bf16", "fp32", "suite.json"]
    assert run_cli([str(now), "--baseline", str(dest)]) == 0
    shutil.rmtree(now)
    report(now, fp32={"mem": 2.0})
    assert run_cli([str(now), "--baseline", str(dest), "--update-baseline"]) == 0
    out = capsys.readouterr().out
    assert "fp32 memory: 1 -> 2" in out
    assert run_cli([str(now), "--baseline", str(dest)]) == 0  # the new baseline is the new normal


def test_variant_sets_differ(tmp_path):
    base = report(tmp_path / "base")
    now = tmp_path / "now"
    now.mkdir()
    write_run(now / "fp32")
    write_run(now / "fp16")
    v = verdicts(
        compare.compare_runs(*[compare.load_runs(p, "x")[0] for p in (base, now)], compare.load_settings({}))
    )
    assert v[("bf16", "status")] == "fail" and v[("fp16", "status")] == "skip"


def test_device_slug():
    from verlaudit.rundir import RunDir

    def mk(env):
        return RunDir(
            path=None, manifest={"environment": env}, metrics=[], findings=[], events=[], status=None
        )

    assert compare.device_slug(mk({"device": "cpu"})) == "cpu"
    assert compare.device_slug(mk({"device": "cuda:0", "gpu_name": "NVIDIA H200"})) == "nvidia-h200"


def test_the_suite_names_the_baseline(tmp_path, monkeypatch):
    # compare.baseline, relative to the suite file when the suite loaded, is the default for --baseline
    base = report(tmp_path / "base")
    now = report(tmp_path / "now", compare_cfg={"baseline": str(base)})
    monkeypatch.chdir(tmp_path)  # reports/baselines/... (the default without it) does not exist here
    assert run_cli([str(now)]) == 0
    assert run_cli([str(now), "--baseline", str(tmp_path / "none")]) == 2  # the command line wins
