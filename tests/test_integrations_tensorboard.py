"""TensorBoard export of a run directory: the metrics as scalars, the findings and status as text, the
loss-scale history per optimizer step, read back with TensorBoard's own reader; the command and its
errors. Run: `pytest tests/test_integrations_tensorboard.py`."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("tensorboard")

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402
from tensorboard.util.tensor_util import make_ndarray  # noqa: E402

from verlaudit import cli  # noqa: E402
from verlaudit.rundir import Finding, RunWriter  # noqa: E402


def fake_run(path):
    with RunWriter(path) as w:
        w.write_manifest({"variant": "v", "config": {"algo": {"name": "dpo"}}})
        for step, scale in enumerate([8.0, 4.0, 4.0]):
            w.metrics(step, {"actor/loss": 1.0 / (step + 1), "actor/loss_scale": scale})
            w.event(
                "optimizer_step",
                step=step,
                role="actor",
                skipped=step == 0,
                scaler={"mode": "dynamic", "scale": scale},
            )
        w.finding(
            Finding(
                severity="warning",
                kind="boundary/reward_dtype",
                message="reward is bf16",
                where="reward:function:f",
                step=1,
            )
        )
        w.status("completed", step=2)


def read(logdir):
    ea = EventAccumulator(str(logdir), size_guidance={"tensors": 0})
    ea.Reload()
    return ea


def values(ea, tag):
    return [(e.step, make_ndarray(e.tensor_proto).item()) for e in ea.Tensors(tag)]


def test_a_run_directory_becomes_event_files(tmp_path, capsys):
    fake_run(tmp_path / "run")
    assert cli.main(["tensorboard", str(tmp_path / "run")]) == 0
    assert "tensorboard --logdir" in capsys.readouterr().out
    ea = read(tmp_path / "run" / "tensorboard")
    assert values(ea, "actor/loss")[1] == (1, 0.5)
    assert [v for _, v in values(ea, "loss_scale/actor/per_optimizer_step")] == [8.0, 4.0, 4.0]
    assert [v for _, v in values(ea, "loss_scale/actor/skipped")] == [1.0, 0.0, 0.0]
    (step, text) = values(ea, "findings")[0]
    assert step == 1 and b"boundary/reward_dtype" in text and b"reward:function:f" in text
    assert b"completed" in values(ea, "status")[0][1]


def test_a_suite_directory_gets_one_folder_per_run(tmp_path):
    fake_run(tmp_path / "suite" / "a")
    fake_run(tmp_path / "suite" / "b")
    assert cli.main(["tensorboard", str(tmp_path / "suite"), "--logdir", str(tmp_path / "tb")]) == 0
    assert sorted(p.name for p in (tmp_path / "tb").iterdir()) == ["a", "b"]
    assert values(read(tmp_path / "tb" / "b"), "actor/loss_scale")[0] == (0, 8.0)


def test_not_a_run_directory_is_a_one_line_error(tmp_path, capsys):
    assert cli.main(["tensorboard", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "neither a run directory" in err and err.count("\n") == 1


def test_run_with_tensorboard_checks_the_package_before_any_run(tmp_path, monkeypatch, capsys):
    from verlaudit.integrations import tensorboard as tb

    def missing():
        raise ValueError("TensorBoard export needs the tensorboard package (No module named 'tensorboard')")

    monkeypatch.setattr(tb, "require", missing)
    out = tmp_path / "out"
    suite = str(Path(__file__).resolve().parents[1] / "suites" / "tiny_cpu.yaml")
    assert cli.main(["run", suite, "--steps", "1", "--tensorboard", "--out", str(out)]) == 2
    assert "needs the tensorboard package" in capsys.readouterr().err
    assert not out.exists()  # refused before the suite ran
