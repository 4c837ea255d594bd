"""A setup-time check of the audit that raises is the audit's own bug: the user's run must go on, the check
named on stderr and in an ``audit_check_failed`` event, the other checks' findings kept
(`verlaudit.audit.auditor.Auditor._check`). Run: `pytest tests/test_audit_guard.py`."""

from __future__ import annotations

import pytest

from trainer.config import TrainConfig
from trainer.train import train
from verlaudit.audit import Auditor, AuditSettings
from verlaudit.audit import resolution as resolution_module

CONFIG = {
    "steps": 1, "device": "cpu",
    "algo": {"name": "ppo", "batch_size": 2, "mini_batch_size": 2, "micro_batch_size": 1, "group_size": 2},
    "data": {"num_examples": 8, "prompt_length": 8, "response_length": 4},
    "precision": {"preset": "fp32"},
}  # fmt: skip


class Events:
    def __init__(self):
        self.seen = []

    def event(self, kind, **data):
        self.seen.append((kind, data))

    def __getattr__(self, name):  # the writer's other methods: accepted, not recorded
        return lambda *a, **k: None


def _boom(*args, **kwargs):
    raise RuntimeError("planted bug in a check")


@pytest.mark.parametrize("check", ["weight_grid", "user_hooks"])
def test_a_raising_setup_check_does_not_kill_the_run(monkeypatch, capsys, check):
    if check == "weight_grid":
        monkeypatch.setattr(resolution_module, "weight_grid", _boom)
    else:
        from verlaudit.audit import weights

        monkeypatch.setattr(weights, "user_hooks", _boom)
    a = Auditor(settings=AuditSettings(level="full", full_steps=1, every=0))
    a.writer = Events()
    with a:
        train(TrainConfig.from_dict(CONFIG), a)
    assert a.failure is None
    failed = [d for k, d in a.writer.seen if k == "audit_check_failed"]
    assert failed and {d["check"] for d in failed} == {check}  # once per role it ran for
    assert "planted bug in a check" in failed[0]["error"]
    assert f"setup check {check!r} failed" in capsys.readouterr().err


def test_without_a_failing_check_no_event_is_written():
    a = Auditor(settings=AuditSettings(level="full", full_steps=1, every=0))
    a.writer = Events()
    with a:
        train(TrainConfig.from_dict(CONFIG), a)
    assert a.failure is None
    assert [k for k, _ in a.writer.seen if k == "audit_check_failed"] == []


# -- per-step checks, hooks and dispatch modes (guard12) ---------------------------------------------------


class Writer(Events):
    """Also keeps the metrics lines: a step whose checks raised still writes its line."""

    def __init__(self):
        super().__init__()
        self.lines = []

    def metrics(self, step, line):
        self.lines.append((step, dict(line)))


GRPO = {
    **CONFIG,
    "steps": 2,
    "algo": {**CONFIG["algo"], "name": "grpo", "group_size": 2},
    "data": {**CONFIG["data"], "reward_fn": "tests.fault_plugins:float64_reward"},
}


def _run(config, **settings):
    a = Auditor(settings=AuditSettings(level="full", full_steps=2, every=0, **settings))
    a.writer = Writer()
    with a:
        train(TrainConfig.from_dict(config), a)
    return a


def _failed(a):
    return {d["check"]: d for k, d in a.writer.seen if k == "audit_check_failed"}


@pytest.mark.parametrize(
    "target, name",
    [
        ("verlaudit.audit.boundaries.check_rollout", "on_rollout"),  # an observer method's check
        ("verlaudit.audit.invariants_reward.RewardWatch.findings", "on_reward"),
        ("verlaudit.audit.dtype_checks.check_grad_dtypes", "on_backward"),
        ("verlaudit.audit.mismatch.MismatchWatch.step_end", "on_step_end"),  # the step's bookend: line kept
        (
            "verlaudit.audit.plugins.Recorder._record",
            "plugin recorder",
        ),  # a dispatch mode, inside the user's call
        ("verlaudit.audit.probes.ModuleProbe._post_call", "module probe"),  # a forward hook, inside the model
        ("verlaudit.audit.plugins.watch_findings", "_after_plugin_call"),
    ],
)
def test_a_raising_step_check_does_not_kill_the_run(monkeypatch, capsys, target, name):
    monkeypatch.setattr(target, _boom)
    a = _run(GRPO)
    assert a.failure is None
    failed = _failed(a)
    assert list(failed) == [name], failed
    assert "planted bug in a check" in failed[name]["error"]
    assert f"{name!r} failed and was skipped" in capsys.readouterr().err
    assert [s for s, _ in a.writer.lines] == [0, 1]  # every step's metrics line, written once
    assert all("actor/loss" in line or "actor/pg_loss" in line for _, line in a.writer.lines)
    assert a.last_completed_step == 1


def test_the_users_own_exception_still_fails_the_run():
    """Only the audit's work is guarded: a reward function that raises fails the run as it would unaudited."""
    config = {**GRPO, "data": {**GRPO["data"], "reward_fn": "tests.fault_plugins:raising_reward"}}
    a = Auditor(settings=AuditSettings(level="full", full_steps=2, every=0))
    a.writer = Writer()
    with pytest.raises(KeyError):
        with a:
            train(TrainConfig.from_dict(config), a)
    assert a.failure is not None and a.failure.get("phase") == "reward"
    assert _failed(a) == {}


def test_a_clean_run_reports_no_guarded_failure():
    a = _run(GRPO)
    assert a.failure is None and _failed(a) == {}
    assert a.writer.lines and all(line["audit/full"] == 1.0 for _, line in a.writer.lines)
