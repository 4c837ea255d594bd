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
