"""An own loop's reference stays frozen and apart from the policy: checked while `verlaudit.watch` is open.

A KL penalty (or a DPO margin) is measured against a reference: a model with the policy's structure whose
weights are the policy's *at the start*, never updated. Two ways it stops being one, whatever the code:

* **it shares the policy's parameter tensors** (a shallow ``copy.copy(model)``, a trunk assigned from the
  policy, a ``load_state_dict(..., assign=True)`` of the policy's own tensors): every update moves it too,
  and the log-ratio to it is 0 at every step (`LOOP_REFERENCE_SHARED`). Seen at any forward of a model of
  the trained model's class that is not the trained model (a global forward pre-hook, filtered by class
  before anything else is read), by the storage of its parameters;
* **a declared reference** (``models={"reference": ref}``) **whose weights change** during the loop (its
  parameters in the optimizer, or re-copied from the policy): compared by fingerprint at entry and exit
  (`LOOP_REFERENCE_MOVED`).

Exercised by `pytest tests/test_loop_reference.py`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch.nn.modules.module import register_module_forward_pre_hook

from verlaudit import kinds as K
from verlaudit.audit.frames import user_frame
from verlaudit.integrations.loop_roles import fingerprint
from verlaudit.rundir import Finding


def _storages(model: torch.nn.Module) -> dict[int, str]:
    return {p.untyped_storage().data_ptr(): n for n, p in model.named_parameters() if p.numel()}


class ReferenceAudit:
    """The reference checks of one watch; ``add(finding)`` records, ``where()`` the step and phase."""

    def __init__(
        self,
        models: Mapping[str, torch.nn.Module],
        optimizers: Mapping[str, Any],
        *,
        add: Callable[[Finding | None], None],
        where: Callable[[], dict],
    ) -> None:
        self.models, self.add, self.where = dict(models), add, where
        self.trained = {r: self.models[r] for r in optimizers}
        self._types = {type(m): r for r, m in self.trained.items()}
        self._storage = {r: _storages(m) for r, m in self.trained.items()}
        self._seen: set[int] = {id(m) for m in self.trained.values()}
        self._reported: set[str] = set()
        ref = self.models.get("reference")
        self._ref_start = fingerprint(ref) if ref is not None and ref not in self.trained.values() else None
        self._handle = register_module_forward_pre_hook(self._pre) if self._types else None

    def remove(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None

    def _pre(self, module: torch.nn.Module, args: Any) -> None:
        role = self._types.get(type(module))
        if role is None or id(module) in self._seen:
            return
        self._seen.add(id(module))
        try:
            theirs = self._storage[role]
            mine = _storages(module)
            shared = [theirs[d] for d in mine if d in theirs]
            if shared and K.LOOP_REFERENCE_SHARED not in self._reported:
                self._reported.add(K.LOOP_REFERENCE_SHARED)
                line = user_frame(depth=3)
                self.add(_shared_finding(role, type(module).__name__, line, shared, len(mine), self.where()))
        except Exception:  # noqa: BLE001 -- a check must never break the user's forward
            return

    def finish(self) -> None:
        ref = self.models.get("reference")
        if self._ref_start is None or ref is None:
            return
        now = fingerprint(ref)
        names = [n for n, _ in ref.named_parameters()]
        moved = [names[i] for i, (a, b) in enumerate(zip(now, self._ref_start)) if not torch.equal(a, b)]
        if moved:
            self.add(_moved_finding(moved, len(names), self.where()))


def _shared_finding(
    role: str, name: str, line: str | None, shared: list[str], total: int, where: dict
) -> Finding:
    at = line or "an unknown line"
    return Finding(
        severity="error",
        kind=K.LOOP_REFERENCE_SHARED,
        message=f"a {name} that is not the {role} but runs a forward at {at} shares {len(shared)} of its {total} "
        f"parameter tensors with the {role} ({', '.join(shared[:3])}{', ...' if len(shared) > 3 else ''}): it is "
        f"the {role}'s own weights, not a frozen copy -- every update moves it too, so a KL penalty or log-ratio "
        f"against it is 0 at every step (a shallow copy.copy, a submodule assigned from the {role}, or "
        "load_state_dict(assign=True) of its tensors)",
        role="reference",
        where=f"reference forward at {at}",
        observed={"shared_tensors": len(shared), "tensors": total, "examples": shared[:5]},
        expected=f"a reference with its own tensors, equal to the {role}'s at the start and never updated",
        fix=f"make the reference a deep copy made once before the loop: ref = copy.deepcopy({role}_model).eval() "
        "with ref.requires_grad_(False) (not copy.copy, not a shared submodule)",
        **where,
    )


def _moved_finding(moved: list[str], total: int, where: dict) -> Finding:
    return Finding(
        severity="error",
        kind=K.LOOP_REFERENCE_MOVED,
        message=f"the reference changed during the loop: {len(moved)} of its {total} parameter tensors "
        f"({', '.join(moved[:3])}{', ...' if len(moved) > 3 else ''}) differ from their values when the watch "
        "began -- a reference is the policy's start, frozen; one that moves (its parameters in an optimizer, or "
        "re-copied from the policy) makes the KL to it measure nothing",
        role="reference",
        where="reference weights",
        observed={"moved_tensors": len(moved), "tensors": total},
        expected="the reference's weights equal at every step",
        fix="freeze the reference: ref.requires_grad_(False), keep its parameters out of every optimizer, and "
        "copy it from the policy once, before the loop",
        **where,
    )
