"""An own loop's update whose gradient cancels to exactly 0 in the parameters while its loss reads the logits.

A policy-gradient loss built on two forwards of the policy over the same tokens, both with their graph
(the "old" log-probs of a ratio ``exp(logp - old_logp)`` recomputed without ``no_grad`` / ``detach``),
has a non-zero gradient w.r.t. each forward's logits and exactly 0 in the parameters: the two paths give
equal and opposite contributions, and the policy never moves. `CancelAudit` marks, per trained role, a
backward that reached a logit tensor with a non-zero gradient (a tensor hook on the first `CHECKED`
forwards), and at the role's optimizer step names a step whose every gradient is exactly 0 after such a
backward (`LOOP_GRADIENT_CANCELS`). Gradients that are 0 because nothing reached the logits (rewards
identical within every group) or that a zero_grad cleared are other checks'. Exercised by
`pytest tests/test_loop_reference.py`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from verlaudit import kinds as K
from verlaudit.integrations import loop_calls
from verlaudit.rundir import Finding

CHECKED = 8
"""Forwards with gradients per trained role whose logit gradient is looked at."""


class CancelAudit:
    def __init__(self, *, add: Callable[[Finding | None], None], where: Callable[[], dict]) -> None:
        self.add, self.where = add, where
        self._forwards: dict[str, int] = {}
        self._read: dict[str, int] = {}
        """role -> logit tensors with a non-zero gradient since its last step."""
        self._reported: set[str] = set()

    def on_forward(self, role: str, logits: Any, line: str | None) -> None:
        if role in self._reported or self._forwards.get(role, 0) >= CHECKED:
            return
        if not isinstance(logits, torch.Tensor) or not logits.requires_grad or not logits.is_floating_point():
            return
        self._forwards[role] = self._forwards.get(role, 0) + 1

        def hook(g: torch.Tensor) -> None:
            if not loop_calls.GRAD_DEPTH[0] and bool(g.detach().ne(0).any()):
                self._read[role] = self._read.get(role, 0) + 1

        logits.register_hook(hook)

    def before_step(self, role: str, optimizer: Any, line: str | None) -> Finding | None:
        read = self._read.pop(role, 0)
        if not read or role in self._reported:
            return None
        grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        if not grads or any(bool(x.detach().ne(0).any()) for x in grads):
            return None
        self._reported.add(role)
        return Finding(
            severity="error",
            kind=K.LOOP_GRADIENT_CANCELS,
            message=f"the {role}'s optimizer step at {line or 'an unknown line'} applies gradients that are exactly 0 "
            f"in every parameter, though the backward before it reached {read} logit tensor(s) of the {role} with a "
            "non-zero gradient: the loss's paths through the policy cancel -- typically a ratio exp(logp - "
            "old_logp) whose old log-probs were recomputed from the policy with their graph (no torch.no_grad() / "
            ".detach()), so both sides move together and the ratio's derivative is 0; the policy never changes",
            role=role,
            where=f"old log-probs of the loss before the step at {line or 'an unknown line'} (not detached)",
            observed={"logit_tensors_with_gradient": read, "parameter_gradients_nonzero": 0},
            expected="a non-zero parameter gradient when the loss's gradient w.r.t. the logits is non-zero",
            fix="compute the old (behaviour) log-probs without a graph: under torch.no_grad() before the update, or "
            "old_logp = old_logp.detach(); only the current log-probs carry the graph",
            **self.where(),
        )
