"""The auditor's parts on their own: settings round trips and field-path errors, the deferred
non-finite checks (one host read, named records), the step's metrics line, and a `ModuleProbe`
driven with a bare `StepContext` and a list as its findings sink (no `Auditor` at all).

Run: `pytest tests/test_audit_collectors.py`.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from trainer.precision import resolve_policy
from verlaudit.audit.context import PhaseTimer, StepContext
from verlaudit.audit.metrics import StepNumbers, audit_numbers, step_line
from verlaudit.audit.module_numerics import Provenance
from verlaudit.audit.nonfinite import DeviceChecks, NonFiniteBoundary, NonFiniteLoss, findings
from verlaudit.audit.probes import ModuleProbe
from verlaudit.audit.settings import LEVELS, AuditSettings

INF, NAN = float("inf"), float("nan")


# -- settings -------------------------------------------------------------------------------------
@given(level=st.sampled_from(LEVELS), full_steps=st.integers(0, 10**6), every=st.integers(0, 10**6))
def test_settings_round_trip(level, full_steps, every):
    s = AuditSettings(level=level, full_steps=full_steps, every=every)
    assert AuditSettings.from_dict(s.to_dict(), where="audit") == s


@pytest.mark.parametrize(
    "data, message",
    [
        ({"level": "loud"}, "audit.level: 'loud'; expected one of off, boundary, full"),
        ({"full_steps": -1}, "audit.full_steps: expected an integer >= 0"),
        ({"every": "3"}, "audit.every: expected an integer"),
        ({"every": True}, "audit.every: expected an integer"),
        (
            {"colour": 1},
            "audit.colour: unknown key; expected one of every, full_steps, level, opcount_steps, probe_plugins, rerun_plugins, shadow, shadow_matmul, shadow_param_grads, shadow_rows",
        ),
        ([1], "audit: expected a mapping"),
    ],
)
def test_settings_errors_name_the_field(data, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        AuditSettings.from_dict(data, where="audit")


# -- deferred non-finite checks -------------------------------------------------------------------
def test_device_checks_read_once_and_return_named_failures(monkeypatch):
    checks = DeviceChecks()
    where = {"step": 4, "phase": "actor_update"}
    checks.boundary("actor", "logprobs", torch.tensor([0.0, -1.0]), **where)  # finite: no record back
    checks.boundary("reference", "ref_logprobs", torch.tensor([NAN, INF]), **where)
    checks.boundary("critic", "values", torch.tensor([1, 2]), **where)  # integer: not checked at all
    checks.loss("actor", torch.tensor(INF), {"pg_loss": torch.tensor(1.0), "kl": torch.tensor(INF)}, **where)
    checks.loss("critic", torch.tensor(0.5), {"vf_loss": torch.tensor(0.5)}, **where)  # finite
    tolist, calls = torch.Tensor.tolist, []

    def counted(t):
        calls.append(t.numel())
        return tolist(t)

    monkeypatch.setattr(torch.Tensor, "tolist", counted)
    failed = checks.settle()
    monkeypatch.undo()
    # one read of every flag: 2 per boundary check (nan, inf) x 2, then per loss [loss, terms..., value]:
    # actor 1 + 2 + 1 = 4, critic 1 + 1 + 1 = 3 -> 11 values
    assert calls == [11]
    assert failed == [
        NonFiniteBoundary(role="reference", name="ref_logprobs", has_nan=True, has_inf=True, **where),
        NonFiniteLoss(role="actor", value=INF, bad_terms=("kl",), **where),
    ]
    boundary, loss = findings(failed)
    assert (boundary.kind, boundary.where, boundary.observed, boundary.step) == (
        "numerics/nonfinite_boundary",
        "ref_logprobs",
        "nan+inf",
        4,
    )
    assert (loss.kind, loss.observed, loss.message) == (
        "numerics/nonfinite_loss",
        {"loss": INF, "nonfinite_terms": ["kl"]},
        "actor loss is non-finite (terms: kl)",
    )
    assert checks.settle() == []  # settled checks are gone


# -- the step line ---------------------------------------------------------------------------------
def test_step_line_puts_the_parts_together_in_order():
    numbers = StepNumbers()
    numbers.put("reward/mean", 0.5)
    numbers.max("numerics/actor/update_underflow_frac", 0.25)
    numbers.max("numerics/actor/update_underflow_frac", 0.125)  # a smaller one later: the max stays
    numbers.add("numerics/actor/nonfinite_grads", 3)
    numbers.add("numerics/actor/nonfinite_grads", 2)
    numbers.ensure("numerics/actor/nonfinite_grads")  # already counted: stays 5
    audit = audit_numbers(["actor", "critic"], numbers.values, {"actor": 7.0})
    line = step_line(
        {"actor/loss": 1.0},
        memory={"perf/device_memory_peak_gb": 2.0},
        timing={"timing_s/rollout": 0.1},
        audit=audit,
        counts={"error": 1, "warning": 0, "info": 4},
        sampled=True,
    )
    assert list(line.items()) == [
        ("actor/loss", 1.0),
        ("perf/device_memory_peak_gb", 2.0),
        ("timing_s/rollout", 0.1),
        ("numerics/actor/nonfinite_grads", 5),
        ("numerics/critic/nonfinite_grads", 0),  # a trained role with nothing counted: 0, not missing
        ("reward/mean", 0.5),
        ("numerics/actor/update_underflow_frac", 0.25),
        ("numerics/actor/act_absmax", 7.0),
        ("audit/findings/error", 1),
        ("audit/findings/warning", 0),
        ("audit/full", 1.0),
    ]
    off = step_line({}, memory={}, timing={}, audit=None, counts={"error": 0, "warning": 0}, sampled=False)
    assert off == {"audit/findings/error": 0, "audit/findings/warning": 0, "audit/full": 0.0}


def test_phase_timer_and_context_nest_and_remember_where_it_died():
    ctx, timer = StepContext(), PhaseTimer()
    ctx.start_step(2, sampled=False)
    with pytest.raises(RuntimeError):
        with ctx.in_phase("actor_update"), timer.phase("actor_update"):
            assert ctx.where() == {"step": 2, "phase": "actor_update"}
            with ctx.in_phase("critic"):
                raise RuntimeError("boom")
    assert (ctx.phase, ctx.failed_phase) == (None, "critic")  # restored; the innermost phase recorded
    timing = timer.take()
    assert list(timing) == ["timing_s/actor_update"] and timing["timing_s/actor_update"] >= 0
    assert timer.take() == {}


# -- the probe on its own ----------------------------------------------------------------------------
class Log(nn.Module):
    def forward(self, x):
        return torch.log(x)  # NaN for negative entries


def hooks(model):
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


def test_probe_needs_only_a_context_and_a_sink():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), Log(), nn.Linear(4, 1))
    ctx, sink, provenance = StepContext(), [], Provenance()
    probe = ModuleProbe(
        {"actor": model}, policy=resolve_policy("fp32"), context=ctx, sink=sink, provenance=provenance
    )
    ctx.start_step(7, sampled=True)
    model(torch.ones(2, 4))  # before the probe is entered: nothing is hooked, nothing recorded
    assert hooks(model) == 0 and probe._log == []
    with probe, ctx.in_phase("ref"):
        assert hooks(model) == 2 * len(list(model.modules()))  # a pre and a post hook on each module
        model(-torch.ones(2, 4).abs() - torch.arange(4.0))  # the Linear's output has negative entries
        probe.flush()
    assert hooks(model) == 0  # off in __exit__
    nonfinite = [f for f in sink if f.kind == "numerics/nonfinite_forward"]
    # the Log module ("1") produced the NaN; the last Linear and the Sequential only propagated it
    assert [(f.where, f.role, f.step, f.phase) for f in nonfinite] == [("1", "actor", 7, "ref")]
    assert provenance.forward_propagated >= 2
    assert probe.absmax["actor"] > 0  # the first Linear's finite output
