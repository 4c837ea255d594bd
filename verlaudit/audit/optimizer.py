"""Gradients and optimizer steps: gradient underflow, non-finite gradients, lost updates, skipped steps.

`OptimizerWatch` follows one role's backward -> before-step -> step sequence: it holds references to
the gradients the optimizer is about to use (counted only when the scaler found non-finite ones),
snapshots a sample of the weights on measured steps (`AuditSettings.measures_updates`) to count
the updates the step lost to rounding, and writes its numbers into the step's `StepNumbers`.
`judge_overflow` re-judges a skipped step's overflow findings once the weights are known to be
finite. The counting and the findings are `verlaudit.audit.numerics`' pure functions.
Exercised by `pytest tests/test_audit_probes.py tests/test_audit_update_underflow.py
tests/test_audit_faults.py`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from trainer.precision import TRAINABLE_ROLES, RolePolicy
from verlaudit import kinds as K
from verlaudit.audit import numerics, update_terms
from verlaudit.audit.context import StepContext
from verlaudit.audit.findings import FindingLog
from verlaudit.audit.metrics import StepNumbers
from verlaudit.audit.settings import AuditSettings
from verlaudit.rundir import Finding


class OptimizerWatch:
    """Per-role gradient and update numerics between a backward and its optimizer step."""

    def __init__(self, settings: AuditSettings, numbers: StepNumbers, context: StepContext) -> None:
        self.settings, self.numbers, self.ctx = settings, numbers, context
        self._held_grads: dict[str, list[tuple[str, torch.Tensor]]] = {}
        self._snap: dict[str, dict] = {}
        self._update_due: set[str] = set()
        """Roles whose next optimizer step is measured for lost updates; a skipped step (fp16 scale
        calibration) passes the measurement on to the role's next optimizer step."""
        self._update_index: dict[tuple[str, int, str], torch.Tensor] = {}
        self.update_rows: list[tuple[str, list[dict[str, Any]], float | None, dict[str, Any]]] = []
        """(role, `numerics.update_underflow_rows`, lr, step and phase) of this step's measured optimizer
        steps: the per-module table, taken by whoever writes it."""

    def start_step(self, step: int) -> None:
        self._snap = {}
        if self.settings.measures_updates(step):
            self._update_due = set(TRAINABLE_ROLES)

    def end_step(self) -> None:
        self._held_grads.clear()

    def backward(
        self, role: str, params: list[tuple[str, nn.Parameter]], policy: RolePolicy
    ) -> list[Finding]:
        """Gradients of a sampled step's micro-batch, still scaled: underflow against an fp16 compute
        dtype (three reductions per parameter; bf16 and fp32 share fp32's exponent range, where
        gradients do not underflow, so they are not counted)."""
        if policy.compute_dtype != torch.float16:
            return []
        stats = numerics.grad_stats(params, policy.compute_dtype, nonfinite=False)
        self.numbers.max(f"numerics/{role}/grad_underflow_frac", stats.underflow_frac)
        return numerics.grad_findings(role, stats, policy, skipped=False, **self.ctx.where())

    def before_step(self, role: str, model: nn.Module) -> None:
        # References only, no device work: the trainer's scaler already checked every gradient
        # (scaler_state["found_inf"]), so they are counted in `after_step` only when it found some.
        # zero_grad(set_to_none=True) drops the trainer's references, not these.
        self._held_grads[role] = [(n, p.grad) for n, p in model.named_parameters() if p.grad is not None]
        if role in self._update_due:
            self._snap[role] = numerics.snapshot(model.named_parameters(), cache=self._update_index)

    def after_step(
        self,
        role: str,
        model: nn.Module,
        optimizer: Any,
        scaler_state: Mapping[str, Any],
        *,
        skipped: bool,
        grad_norm: float,
        policy: RolePolicy,
    ) -> list[Finding]:
        """Non-finite gradients the scaler found, and the updates a measured step lost to rounding."""
        out: list[Finding] = []
        held = self._held_grads.pop(role, [])
        found = scaler_state.get("found_inf")
        if found is None:  # a trainer without our LossScaler: a non-finite norm or a skip says the same
            found = skipped or not math.isfinite(float(grad_norm))
        key = f"numerics/{role}/nonfinite_grads"
        if found and held:
            stats = numerics.grad_counts(held, policy.compute_dtype, underflow=False)
            self.numbers.add(key, stats.nonfinite)
            out += numerics.grad_findings(role, stats, policy, skipped=skipped, **self.ctx.where())
        else:
            self.numbers.ensure(key, 0)
        del held
        snap = self._snap.pop(role, None)
        if snap and not skipped:
            self._update_due.discard(role)
            # setup12: a decoupled weight decay below the stored weights' spacing rounds away in place
            decay = update_terms.decay_lost(optimizer, model.named_parameters(), snap)
            if decay is not None:
                self.numbers.max(f"numerics/{role}/decay_lost_frac", decay["fraction"])
                out += update_terms.decay_findings(role, decay, **self.ctx.where())
            rows = numerics.update_underflow_rows(snap, model.named_parameters())
            frac, per_module = numerics.update_underflow_summary(rows)
            self.numbers.max(f"numerics/{role}/update_underflow_frac", frac)
            lr = optimizer.param_groups[0].get("lr") if hasattr(optimizer, "param_groups") else None
            self.update_rows.append((role, rows, lr, self.ctx.where()))
            out += numerics.underflow_findings(role, frac, per_module, policy, lr, **self.ctx.where())
        return out


OVERFLOW_KINDS = (K.OVERFLOW, K.NONFINITE_LOSS, K.NONFINITE_BOUNDARY)
"""Findings a handled fp16 overflow is allowed to turn from errors into warnings."""


def judge_overflow(
    findings: FindingLog, model: nn.Module, scaler_state: Mapping[str, Any], *, role: str, ctx: StepContext
) -> None:
    """A skipped step whose weights stayed finite: the scaler handled this step's fp16 overflow in
    ``role``'s update (calibration, not a fault), so its overflow and the non-finite loss / log-probs
    it caused become warnings. Overflows elsewhere (reference, rollout) stay errors: no scaler
    stands between them and the run."""
    at = (ctx.step, role, ctx.phase)
    found = findings.find(K.OVERFLOW, role=role)
    if not any((f.step, f.role, f.phase) == at and f.severity == "error" for f in found):
        return
    if not weights_finite(model):
        return  # non-finite values reached the weights: the errors stand
    backed = (
        f", loss scale backed off to {scaler_state.get('scale'):g}"
        if scaler_state.get("mode") == "dynamic"
        else ""
    )
    findings.relabel(
        lambda f: f.kind in OVERFLOW_KINDS and (f.step, f.role, f.phase) == at,
        "warning",
        f"handled: the optimizer step was skipped{backed} and the weights stayed finite",
    )


def weights_finite(model: nn.Module) -> bool:
    """Whether every floating parameter is finite (one host read: the per-tensor max-norms stacked)."""
    weights = [p.detach() for p in model.parameters() if p.is_floating_point()]
    weights = [w.to_local() if hasattr(w, "to_local") else w for w in weights]
    if not weights:
        return True
    norms = torch._foreach_norm(weights, float("inf"))
    return bool(torch.isfinite(torch.stack([n.float() for n in norms])).all())
