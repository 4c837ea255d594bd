"""Non-finite checks of boundary tensors and losses, deferred: flags stay on the device until a settle point.

The auditor records a `BoundaryCheck` for each log-prob / value tensor crossing into the
algorithm and a `LossCheck` for each micro-batch loss; `DeviceChecks.settle` reads every pending
flag with one host read at a point where the trainer has synced anyway (the optimizer step, the
step's end, a failure), so no check costs a stream sync in the middle of a step. `findings` turns
the failed checks into `Finding`s. Exercised by `pytest tests/test_audit_collectors.py
tests/test_audit_faults.py`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from verlaudit import kinds as K
from verlaudit.rundir import Finding


@dataclasses.dataclass(frozen=True, kw_only=True)
class BoundaryCheck:
    """A boundary tensor's ``[has nan, has inf]``, still on the device."""

    role: str
    name: str
    step: int | None
    phase: str | None
    flags: torch.Tensor

    def values(self) -> torch.Tensor:
        return self.flags


@dataclasses.dataclass(frozen=True, kw_only=True)
class LossCheck:
    """A loss's finiteness and its named terms', with the loss's first element, still on the device."""

    role: str
    terms: tuple[str, ...]
    """Names of the floating terms, in the order of ``flags[1:]``."""
    step: int | None
    phase: str | None
    flags: torch.Tensor
    """``[loss finite, term finite, ...]``."""
    value: torch.Tensor

    def values(self) -> torch.Tensor:
        return torch.cat([self.flags.float(), self.value.float()])


@dataclasses.dataclass(frozen=True, kw_only=True)
class NonFiniteBoundary:
    role: str
    name: str
    step: int | None
    phase: str | None
    has_nan: bool
    has_inf: bool


@dataclasses.dataclass(frozen=True, kw_only=True)
class NonFiniteLoss:
    role: str
    step: int | None
    phase: str | None
    value: float
    """The loss's first element."""
    bad_terms: tuple[str, ...]
    """The terms that are non-finite themselves."""


class DeviceChecks:
    """Pending non-finite checks of the current step."""

    def __init__(self) -> None:
        self._pending: list[BoundaryCheck | LossCheck] = []

    def clear(self) -> None:
        self._pending = []

    def boundary(self, role: str, name: str, t: Any, *, step: int | None, phase: str | None) -> None:
        if isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel():
            t = t.detach()
            flags = torch.stack([t.isnan().any(), t.isinf().any()])
            self._pending.append(BoundaryCheck(role=role, name=name, step=step, phase=phase, flags=flags))

    def loss(
        self, role: str, loss: Any, terms: Mapping[str, Any], *, step: int | None, phase: str | None
    ) -> None:
        if not (isinstance(loss, torch.Tensor) and loss.numel()):
            return
        names = tuple(
            k for k, t in terms.items() if isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel()
        )
        flags = [torch.isfinite(loss.detach()).all()] + [
            torch.isfinite(terms[k].detach()).all() for k in names
        ]
        value = loss.detach().float().reshape(-1)[:1]
        self._pending.append(
            LossCheck(role=role, terms=names, step=step, phase=phase, flags=torch.stack(flags), value=value)
        )

    def settle(self) -> list[NonFiniteBoundary | NonFiniteLoss]:
        """Reads the pending checks (one host read for all) and returns the failed ones, in order."""
        checks, self._pending = self._pending, []
        if not checks:
            return []
        parts = [c.values() for c in checks]
        dev = parts[0].device
        flat = torch.cat([x.float().reshape(-1).to(dev) for x in parts]).tolist()  # the one read
        out: list[NonFiniteBoundary | NonFiniteLoss] = []
        i = 0
        for c, part in zip(checks, parts):
            vals, i = flat[i : i + part.numel()], i + part.numel()
            if isinstance(c, BoundaryCheck):
                has_nan, has_inf = vals[0] > 0, vals[1] > 0
                if has_nan or has_inf:
                    where = {"role": c.role, "step": c.step, "phase": c.phase}
                    out.append(NonFiniteBoundary(name=c.name, has_nan=has_nan, has_inf=has_inf, **where))
            elif vals[0] == 0:  # the loss is non-finite; vals[1:-1] are its terms' flags
                bad = tuple(k for k, ok in zip(c.terms, vals[1:-1]) if ok == 0)
                out.append(
                    NonFiniteLoss(role=c.role, step=c.step, phase=c.phase, value=vals[-1], bad_terms=bad)
                )
        return out


def findings(failed: Iterable[NonFiniteBoundary | NonFiniteLoss]) -> list[Finding]:
    """One error per failed check."""
    return [_boundary(r) if isinstance(r, NonFiniteBoundary) else _loss(r) for r in failed]


def _boundary(r: NonFiniteBoundary) -> Finding:
    observed = "nan+inf" if r.has_nan and r.has_inf else ("nan" if r.has_nan else "inf")
    return Finding(
        severity="error",
        kind=K.NONFINITE_BOUNDARY,
        role=r.role,
        where=r.name,
        step=r.step,
        phase=r.phase,
        observed=observed,
        expected="finite",
        message=f"{r.name} of {r.role} holds non-finite values",
        fix="see numerics/nonfinite_forward or numerics/overflow for the producing module "
        "(audit.level: full on this step)",
    )


def _loss(r: NonFiniteLoss) -> Finding:
    bad = list(r.bad_terms)
    return Finding(
        severity="error",
        kind=K.NONFINITE_LOSS,
        role=r.role,
        where="loss",
        step=r.step,
        phase=r.phase,
        observed={"loss": r.value, "nonfinite_terms": bad},
        expected="finite",
        message=f"{r.role} loss is non-finite" + (f" (terms: {', '.join(bad)})" if bad else ""),
        fix="find the producer (numerics/nonfinite_forward, numerics/overflow); set "
        "abort_on_nonfinite_loss to stop early",
    )
