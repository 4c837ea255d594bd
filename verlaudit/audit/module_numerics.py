"""Per-module numerics the probes replay: who produced a NaN / Inf, and fp16 values near the top.

The probes record one `ForwardCall` or `GradCall` per hooked call, with its absolute maxima still
on the device; `replay` takes the records with the values read back and returns the findings.
`Provenance` keeps, per step, the first module (in execution order) whose forward output -- or, in
backward, whose input gradient -- became non-finite while what it received was finite: the
producer, told apart from the modules that only propagated it; `producer_finding` names it.
`headroom_finding` warns about fp16 activations and gradients close to fp16's largest value.
Exercised by `pytest tests/test_audit_probes.py tests/test_audit_collectors.py`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable

import torch

from trainer.precision import PrecisionPolicy, RolePolicy
from verlaudit import kinds as K
from verlaudit.dtypes import dtype_name as dn
from verlaudit.rundir import Finding

HEADROOM = 1 / 8
"""Warn when an fp16 absolute maximum exceeds this fraction of the dtype's largest finite value."""


def headroom_finding(
    role: str, where: str, dtype: torch.dtype, value: float, what: str, *, step: int | None, phase: str | None
) -> Finding | None:
    """fp16 activations / gradients closer than `HEADROOM` to the largest finite value."""
    if dtype != torch.float16 or not math.isfinite(value):
        return None
    limit = torch.finfo(dtype).max
    if value <= limit * HEADROOM:
        return None
    return Finding(
        severity="warning",
        kind=K.HEADROOM,
        role=role,
        where=where,
        step=step,
        phase=phase,
        observed={what: value},
        expected=f"< {limit * HEADROOM:g} (1/8 of fp16 max {limit:g})",
        message=f"{what} of {where} reached {value:g}, {value / limit:.0%} of fp16's maximum",
        fix="keep this module in fp32 or bf16 (precision.preset: bf16), or scale it down",
    )


class Provenance:
    """First producer of non-finite values per step, forward and backward."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.forward_producer: tuple[str, str, str] | None = None
        self.forward_propagated = 0
        self.backward_producer: tuple[str, str, str] | None = None
        self._grad_out_finite: dict[tuple[str, str], bool] = {}

    def forward(self, role: str, name: str, inputs_finite: bool, outputs_finite: bool, what: str) -> bool:
        """Returns True when this call is the step's first producer."""
        if outputs_finite:
            return False
        if not inputs_finite or self.forward_producer is not None:
            self.forward_propagated += 1
            return False
        self.forward_producer = (role, name, what)
        return True

    def grad_output(self, role: str, name: str, finite: bool) -> None:
        self._grad_out_finite[(role, name)] = finite

    def grad_input(self, role: str, name: str, finite: bool, what: str) -> bool:
        if finite or self.backward_producer is not None or self.forward_producer is not None:
            return False
        if self._grad_out_finite.get((role, name), True):
            self.backward_producer = (role, name, what)
            return True
        return False


def producer_finding(
    role: str,
    where: str,
    what: str,
    dtype: torch.dtype | None,
    direction: str,
    policy: RolePolicy,
    *,
    step: int,
    phase: str | None,
    max_in: float | None = None,
) -> Finding:
    """The producer of a non-finite value; ``direction`` is ``forward`` or ``backward``."""
    overflow = what == "inf" and dtype == torch.float16
    if direction == "forward":
        kind = K.OVERFLOW if overflow else K.NONFINITE_FORWARD
        msg = f"{where} produced {what} in its forward output from finite inputs" + (
            f" (fp16 max is {torch.finfo(torch.float16).max:g})" if overflow else ""
        )
        fix = (
            "run this module in bf16 or fp32 (precision.preset: bf16) or rescale it"
            if overflow
            else "inspect this module's weights and inputs at this step (division by zero, log of <= 0, "
            "sqrt of negative), lower the learning rate"
        )
        sev = "error"
    else:
        kind = K.NONFINITE_BACKWARD
        msg = f"backward of {where} produced {what} gradients from a finite incoming gradient"
        fix = "dynamic loss scaling skips these steps; if persistent, lower init_scale or use bf16"
        sev = "warning" if policy.loss_scaling == "dynamic" else "error"
    return Finding(
        severity=sev,
        kind=kind,
        role=role,
        where=where,
        step=step,
        phase=phase,
        observed={"value": what, "dtype": dn(dtype), "input_absmax": max_in},
        expected="finite",
        message=msg,
        fix=fix,
    )


@dataclasses.dataclass(slots=True)
class ForwardCall:
    """One forward call: the absolute maxima of its floating inputs and outputs, on the device (one
    list, the inputs' first: a probe keeps thousands of these until the step's sync point, and each
    object that lives that long brings Python's next full garbage collection closer)."""

    role: str
    name: str
    amaxes: list[torch.Tensor | None]
    """The inputs' maxima (the first ``n_in``), then the outputs' (None: an empty tensor)."""
    n_in: int
    dtypes: tuple[torch.dtype, ...]
    """The outputs' dtypes."""
    step: int | None
    phase: str | None

    def scalars(self) -> list[torch.Tensor]:
        return [t for t in self.amaxes if t is not None]


@dataclasses.dataclass(slots=True)
class GradCall:
    """One gradient: ``received`` (at a module's output) or produced (at its input), on the device."""

    received: bool
    role: str
    name: str
    amax: torch.Tensor | None
    dtype: torch.dtype
    step: int | None
    phase: str | None

    def scalars(self) -> list[torch.Tensor]:
        return [self.amax] if self.amax is not None else []


def replay(
    calls: Iterable[ForwardCall | GradCall],
    values: Iterable[float],
    *,
    policy: PrecisionPolicy,
    provenance: Provenance,
    absmax: dict[str, float],
) -> list[Finding]:
    """The recorded calls in order, with their maxima read back (``values``, in `scalars` order):
    provenance, headroom and producer findings. ``absmax`` keeps each role's largest finite
    activation maximum."""
    it = iter(values)
    found: list[Finding] = []
    for call in calls:
        if isinstance(call, ForwardCall):
            vals = [next(it) if t is not None else 0.0 for t in call.amaxes]
            ins, outs = vals[: call.n_in], list(zip(vals[call.n_in :], call.dtypes))
            found += _replay_forward(call, ins, outs, policy, provenance, absmax)
        else:
            m = next(it) if call.amax is not None else 0.0
            found += _replay_grad(call, m, policy, provenance)
    return found


def _replay_forward(
    call: ForwardCall,
    ins: list[float],
    outs: list[tuple[float, torch.dtype]],
    policy: PrecisionPolicy,
    provenance: Provenance,
    absmax: dict[str, float],
) -> list[Finding]:
    role, name, where = call.role, call.name, {"step": call.step, "phase": call.phase}
    in_finite = all(math.isfinite(x) for x in ins)
    found: list[Finding] = []
    for m, dtype in outs:
        if not math.isfinite(m):
            what = "nan" if math.isnan(m) else "inf"
            if provenance.forward(role, name, in_finite, False, what):
                max_in = max(ins, default=0.0)
                found.append(
                    producer_finding(role, name, what, dtype, "forward", policy[role], **where, max_in=max_in)
                )
            break
        absmax[role] = max(absmax.get(role, 0.0), m)
        f = headroom_finding(role, name, dtype, m, "activation absmax", **where)
        if f is not None:
            found.append(f)
    return found


def _replay_grad(call: GradCall, m: float, policy: PrecisionPolicy, provenance: Provenance) -> list[Finding]:
    role, name, where = call.role, call.name, {"step": call.step, "phase": call.phase}
    if call.received:
        provenance.grad_output(role, name, math.isfinite(m))
        if policy[role].loss_scaling == "dynamic":
            return []  # loss-scaled gradients sit near fp16's top on purpose; the scaler backs off on overflow
        f = headroom_finding(role, name, call.dtype, m, "gradient absmax", **where)
        return [f] if f is not None else []
    if math.isfinite(m):
        return []
    what = "nan" if math.isnan(m) else "inf"
    if provenance.grad_input(role, name, False, what):
        return [producer_finding(role, name, what, call.dtype, "backward", policy[role], **where)]
    return []
