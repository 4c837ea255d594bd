"""Where precision is lost, per module, on the sampled steps: the `Auditor`'s collector that owns the
fp32 shadow (`shadow`), the op counter (`opcount`) and gradient health (`gradhealth`).

It is entered for a sampled step like the module probes (the hooks and the dispatch mode live only
that long), suspends op counting in the rollout phase (rollout engines may be compiled or CUDA
graphs, and their contract is checked at the boundary), and at the step's end writes the step's
records to shadow.jsonl, opcounts.jsonl and gradhealth.jsonl, returns the findings of the pure
checks and puts the step's numbers (``shadow/<role>/...``, ``timing_s/shadow``, ``audit/shadow``)
into the `StepNumbers`. Exercised by `pytest tests/test_audit_precision.py`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn

from trainer.precision import PrecisionPolicy, RolePolicy
from verlaudit import kinds as K
from verlaudit.audit import contract, gradhealth, opcount, shadow_checks
from verlaudit.audit.context import StepContext
from verlaudit.audit.dtype_checks import module_kind
from verlaudit.audit.metrics import StepNumbers
from verlaudit.audit.settings import AuditSettings
from verlaudit.audit.shadow import ShadowProbe
from verlaudit.rundir import GRADHEALTH, OPCOUNTS, SHADOW, Finding, RunWriter


class PrecisionWatch:
    """Shadow, op counts and gradient health of the sampled steps of one run."""

    def __init__(
        self,
        models: Mapping[str, nn.Module],
        policy: PrecisionPolicy,
        settings: AuditSettings,
        context: StepContext,
        numbers: StepNumbers,
        writer: RunWriter | None,
    ) -> None:
        self.policy, self.ctx, self.numbers, self.writer = policy, context, numbers, writer
        self.shadow: ShadowProbe | None = None
        if settings.shadow:
            compute = {role: policy[role].compute_dtype for role in models}
            self.shadow = ShadowProbe(
                models,
                context,
                compute,
                rows=settings.shadow_rows,
                param_grads=settings.shadow_param_grads,
                matmul=settings.shadow_matmul,
            )
        self.counter: opcount.OpCounter | None = None
        self._count_left = settings.opcount_steps
        if settings.opcount_steps:
            names = {
                id(m): (role, name, module_kind(name, m))
                for role, model in models.items()
                for name, m in model.named_modules()
            }
            self.counter = opcount.OpCounter(names, context)
        self._grad_records: list[dict[str, Any]] = []
        self._measured: set[str] = set()
        self._reported_disabled = False

    @contextlib.contextmanager
    def sampled_step(self) -> Iterator[None]:
        """Hooks and counting on for one sampled step."""
        self._measured.clear()
        with contextlib.ExitStack() as stack:
            if self.shadow is not None:
                stack.enter_context(self.shadow)
            if self.counter is not None and self._count_left > 0:
                self._count_left -= 1
                stack.enter_context(self.counter)
            yield

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        with opcount.suspended() if name == "rollout" else contextlib.nullcontext():
            yield

    def backward(
        self,
        role: str,
        params: list[tuple[str, nn.Parameter]],
        policy: RolePolicy,
        loss_scale: float,
        *,
        sampled: bool,
    ) -> None:
        """A backward finished: the ops that follow outside the models are the optimizer's (unscale,
        clip, step) until the next forward; on the first backward of an fp16 role in a sampled step,
        underflow per module at the scale the gradients still carry."""
        if self.counter is not None:
            self.counter.outside = "optimizer"
        if not sampled or policy.compute_dtype != torch.float16 or role in self._measured:
            return
        self._measured.add(role)
        with opcount.suspended():
            rows = gradhealth.fp16_underflow(
                role, ((n, p.grad) for n, p in params), float(loss_scale), **self.ctx.where()
            )
        self._grad_records += rows

    def end_step(self, step: int) -> list[Finding]:
        """Writes the step's records; returns the findings and puts the numbers in `StepNumbers`."""
        out: list[Finding] = []
        if self.shadow is not None:
            records, seconds = self.shadow.take()
            if records:
                self._write(SHADOW, records)
                out += shadow_checks.findings(records)
                for k, v in shadow_checks.metrics(records).items():
                    self.numbers.put(k, v)
                self.numbers.put("timing_s/shadow", seconds)
                self.numbers.put("audit/shadow", 1.0)
            if self.shadow.disabled and not self._reported_disabled:
                self._reported_disabled = True
                out.append(
                    Finding(
                        severity="info",
                        kind=K.SHADOW_SKIPPED,
                        where="shadow",
                        step=step,
                        message=f"the fp32 shadow does not run: {self.shadow.disabled}",
                        fix="run the shadow in a one-process variant of the suite",
                    )
                )
        if self.counter is not None:
            records = self.counter.take(step)
            if records:
                self._write(OPCOUNTS, records)
                islands = {r: p.fp32_islands for r, p in self.policy.roles.items() if p.low_precision}
                out += opcount.findings(records, islands, step=step)
                out += contract.findings(records, self.policy, step=step)
        grads, self._grad_records = self._grad_records, []
        if grads:
            self._write(GRADHEALTH, grads)
            out += gradhealth.findings(grads)
        return out

    def _write(self, name: str, records: list[dict[str, Any]]) -> None:
        if self.writer is not None:
            self.writer.records(name, records)
