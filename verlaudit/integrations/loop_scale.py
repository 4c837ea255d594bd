"""An own loop that multiplies its loss by the GradScaler's scale more than once (`ScaleTrace`,
``loop/loss_scaled_twice``): ``scaler.scale(x)`` on an ``x`` that already carries a ``scaler.scale`` output in
its autograd graph (passed on to a helper that scales again, or rescaled after a sum). The backward then runs
on loss x scale^2 (2^32 at the default scale 65536): every fp16 gradient overflows, the scaler skips the step
and halves, and the run looks like a loss-scale collapse, whose root is the second ``scale`` call; its
``unscale_`` divides by the scale once, so even a step that does not overflow is scale x too large.

The trace keeps the last few outputs' autograd nodes of the scaler's current step (cleared at ``update``) and
walks the new input's graph up to `WALK` nodes; a loop that scales one loss per micro-batch (accumulation)
scales inputs with no scaled ancestor and is quiet. Wired by `verlaudit.integrations.watch` through
`verlaudit.integrations.session.ScalerTap`; exercised by `pytest tests/test_loop_scale.py`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from verlaudit import kinds as K
from verlaudit.audit.frames import user_frame
from verlaudit.rundir import Finding

WALK = 512
"""Autograd nodes walked back from a scaled input looking for an earlier scale's output (a loss is a few
nodes from its scaled self; the walk stops at the leaves)."""
KEEP = 8
"""Outputs of ``scale`` kept per scaler step (micro-batches of one step)."""


def _value(t: Any) -> float | None:
    if isinstance(t, torch.Tensor) and t.numel() == 1:
        try:
            return float(t.detach())
        except RuntimeError:
            return None
    return None


def _holds(start: Any, targets: list[Any]) -> Any:
    """The first of ``targets`` (autograd nodes) reached from ``start`` walking ``next_functions``."""
    seen, todo = set(), [start]
    while todo and len(seen) < WALK:
        node = todo.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        for t in targets:
            if node is t:
                return t
        todo.extend(n for n, _ in getattr(node, "next_functions", ()))
    return None


class ScaleTrace:
    """Notes each ``scaler.scale`` call of one watch (``on_scale``) and reports a second scaling of an
    already scaled loss once per run (``add``: the watch's finding sink; ``where``: its step context)."""

    def __init__(self, role: str, add: Callable[[Finding | None], None], where: Callable[[], dict]) -> None:
        self.role, self._add, self._where = role, add, where
        self._outs: list[tuple[Any, str | None, float | None]] = []
        self.reported = False

    def on_scale(self, inp: Any, out: Any, scale: float) -> None:
        if not isinstance(inp, torch.Tensor) or not isinstance(out, torch.Tensor):
            return  # an iterable of losses: each is scaled on its own
        line = user_frame(depth=3)
        if not self.reported and inp.grad_fn is not None and self._outs:
            hit = _holds(inp.grad_fn, [node for node, _, _ in self._outs])
            if hit is not None:
                first = next((ln, v) for node, ln, v in self._outs if node is hit)
                self.reported = True
                self._add(self._finding(first, line, _value(inp), _value(out), scale))
        if out.grad_fn is not None:
            self._outs = [*self._outs[-(KEEP - 1) :], (out.grad_fn, line, _value(out))]

    def clear(self) -> None:
        """The scaler's ``update``: a new step's losses."""
        self._outs = []

    def _finding(self, first, line, inp, out, scale) -> Finding:
        first_line, first_value = first
        loss = first_value / scale if first_value is not None and scale else None
        ratio = out / loss if out is not None and loss else None
        shown = (
            f" (the loss {loss:.4g}, scaled once {first_value:.4g}, twice {out:.4g}: {ratio:.3g}x the loss)"
            if ratio is not None
            else ""
        )
        return Finding(
            severity="error",
            kind=K.LOOP_LOSS_SCALED_TWICE,
            role=self.role,
            where=f"scaler.scale at {line}",
            message=f"the loss is scaled twice: scaler.scale at {line} multiplies a value that scaler.scale at "
            f"{first_line} already multiplied by the loss scale ({scale:g}), so the backward runs on loss x "
            f"scale^2 = {scale * scale:.4g} x the loss{shown}; the GradScaler's unscale_ divides the gradients "
            "by the scale once, so they stay scale x too large: under fp16 every gradient overflows, every "
            "step is skipped and the scale halves each step (the loss-scale collapse is this double scaling)",
            observed={
                "loss_scale": scale,
                "first_scale_at": first_line,
                "second_scale_at": line,
                "gradient_factor": scale * scale,
                "loss": loss,
                "backward_value": out,
            },
            expected="scaler.scale(loss).backward() once per loss: one multiplication by the scale",
            fix=f"scale once: remove the scaler.scale call at {line} or the one at {first_line} (pass the "
            "unscaled loss to a helper that scales it, or call .backward() on the scaled loss directly)",
            **self._where(),
        )
