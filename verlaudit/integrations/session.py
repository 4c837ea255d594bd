"""One audited run outside our trainer: the `Auditor`, its run directory, and the step lifecycle.

An adapter (`verlaudit.integrations.watch`, `verlaudit.integrations.trl`) knows when its host starts a
step, computes a loss, steps the optimizer; `AuditSession` turns those moments into the observer
protocol's calls in the documented order (`trainer.events`): it opens the step lazily at its first
event, marks backward / before-step / step for each optimizer step, and closes the step with one
metrics line (the host's numbers, the loss-scale history as ``<role>/loss_scale`` and
``<role>/skipped``, the audit's own). It is the only writer of manifest.json and status.json here,
as the worker is for our runs; `ScalerTap` reads a `torch.amp.GradScaler` (the scale before the
gradients are unscaled, whether the step was skipped) without changing what it does.
Exercised by `pytest tests/test_integrations_watch.py tests/test_integrations_trl.py`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import platform
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from trainer.precision import PrecisionPolicy
from verlaudit.audit import Auditor
from verlaudit.audit.settings import AuditSettings
from verlaudit.rundir import Finding, RunWriter


def grad_norm(model: nn.Module) -> float:
    """The total 2-norm of ``model``'s gradients, one host read (nan for a non-finite gradient)."""
    grads = [p.grad.detach() for p in model.parameters() if p.grad is not None]
    if not grads:
        return 0.0
    norms = torch._foreach_norm(grads, 2.0)
    return float(torch.linalg.vector_norm(torch.stack([n.float().to(norms[0].device) for n in norms])))


class ScalerTap:
    """Wraps a GradScaler's ``unscale_``, ``update``, ``scale`` and ``step`` on the instance (undone by
    `remove`): calls ``before_unscale(optimizer, scale)`` while the gradients are still scaled, keeps
    whether the last ``update`` followed non-finite gradients (the scaler forgets it there), then calls
    ``after_update()``; counts ``scale`` calls since the last update and calls ``before_step(optimizer,
    scale calls)`` at each ``step`` (`verlaudit.integrations.loop_checks` reads both); ``on_scale(input,
    output, scale)`` after each ``scale`` (`verlaudit.integrations.loop_scale`)."""

    def __init__(
        self,
        scaler: Any,
        before_unscale: Callable[[Any, float], None] | None = None,
        after_update: Callable[[], None] | None = None,
        before_step: Callable[[Any, int], None] | None = None,
        on_scale: Callable[[Any, Any, float], None] | None = None,
    ) -> None:
        self.scaler = scaler
        self._on_scale = on_scale
        self._after_update = after_update
        self._before_step = before_step
        self.found_inf: bool | None = None
        self.scale_before: float | None = None
        self.steps = self.skipped = self.backoffs = self.growths = 0
        self.scaled = 0
        """``scale`` calls since the last ``update`` (0 at a ``step``: the backward was not scaled)."""
        self.in_step = False
        """Inside ``scaler.step``: an optimizer step now is the scaler's, not a bypass."""
        self._before_unscale = before_unscale
        self._orig = {name: getattr(scaler, name) for name in ("unscale_", "update", "scale", "step")}
        scaler.unscale_ = self._unscale
        scaler.update = self._update
        scaler.scale = self._scale
        scaler.step = self._step

    def _scale(self, outputs: Any) -> Any:
        self.scaled += 1
        out = self._orig["scale"](outputs)
        if self._on_scale is not None and self.scaler.is_enabled():
            self._on_scale(outputs, out, float(self.scaler.get_scale()))
        return out

    def _step(self, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
        if self._before_step is not None and self.scaler.is_enabled():
            self._before_step(optimizer, self.scaled)
        self.in_step = True
        try:
            return self._orig["step"](optimizer, *args, **kwargs)
        finally:
            self.in_step = False

    def _unscale(self, optimizer: Any) -> Any:
        if self._before_unscale is not None and self.scaler.is_enabled():
            self._before_unscale(optimizer, float(self.scaler.get_scale()))
        return self._orig["unscale_"](optimizer)

    def _update(self, new_scale: Any = None) -> Any:
        enabled = self.scaler.is_enabled()
        if enabled:
            states = getattr(self.scaler, "_per_optimizer_states", {})
            found = [
                v for s in states.values() for v in s.get("found_inf_per_device", {}).values()
            ]  # set by step(); update() clears them
            self.found_inf = bool(sum(float(v) for v in found)) if found else False
            self.scale_before = float(self.scaler.get_scale())
        out = self._orig["update"](new_scale)
        self.scaled = 0
        if enabled:
            self.steps += 1
            scale = float(self.scaler.get_scale())
            self.skipped += int(bool(self.found_inf))
            self.backoffs += int(scale < self.scale_before)
            self.growths += int(scale > self.scale_before)
            if self._after_update is not None:
                self._after_update()
        return out

    def state(self) -> dict[str, Any]:
        """`trainer.precision.LossScaler.state`'s fields, for the auditor's scaler checks."""
        if not self.scaler.is_enabled():
            return {"mode": "none", "scale": 1.0, "found_inf": None}
        scale = float(self.scaler.get_scale())
        event = None
        if self.scale_before is not None and scale != self.scale_before:
            event = "backoff" if scale < self.scale_before else "growth"
        return {
            "mode": "dynamic",
            "scale": scale,
            "growth_tracker": int(getattr(self.scaler, "_growth_tracker", 0) or 0),
            "found_inf": self.found_inf,
            "event": event,
            "steps": self.steps,
            "skipped_steps": self.skipped,
            "backoffs": self.backoffs,
            "growths": self.growths,
        }

    def remove(self) -> None:
        for name in self._orig:
            self.scaler.__dict__.pop(name, None)


def environment(device: torch.device) -> dict[str, Any]:
    """Versions and hardware for the manifest (the worker's fields that need no NVML)."""
    import os

    import transformers

    env: dict[str, Any] = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cuda": torch.version.cuda,
        "device": str(device),
        "cpu_count": os.cpu_count(),
    }
    if device.type == "cuda":
        env["gpu_name"] = torch.cuda.get_device_name(device)
        env["total_memory_gb"] = torch.cuda.get_device_properties(device).total_memory / 1024**3
    return env


class AuditSession:
    """An `Auditor` on a run directory, driven step by step by an adapter."""

    def __init__(
        self,
        out_dir: str | Path,
        *,
        models: Mapping[str, nn.Module],
        policy: PrecisionPolicy,
        settings: AuditSettings,
        device: torch.device,
        manifest: Mapping[str, Any],
        tokenizer_info: Mapping[str, Any] | None = None,
        rank: int = 0,
    ) -> None:
        self.path = Path(out_dir)
        self.models = dict(models)
        self.device = device
        self.writer = RunWriter(self.path, rank=rank)
        self.auditor = Auditor(self.writer, settings, device=device)
        self.policy = policy
        self.step: int | None = None
        """The open step (0-based), None between steps."""
        self.next_step = 0
        self._metrics: dict[str, float] = {}
        self._skips: dict[str, list[float]] = {}
        self._backward_seen: set[str] = set()
        self._done = False
        """Every optimizer of the open step has stepped: the next event opens a new step (metrics
        logged before it still belong to this one)."""
        self._closed = False
        self.writer.write_manifest(
            {
                **manifest,
                "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                "policy": policy.to_dict(),
                "audit": settings.to_dict(),
                "environment": environment(device),
                "memory": {"source": self.auditor.memory.source, "reason": self.auditor.memory.reason},
            }
        )
        self._intended: list[tuple[Callable[[Finding], bool], str]] = []
        log = self.auditor.findings
        add = log.add
        log.add = lambda f: add(self._as_intended(f))  # type: ignore[method-assign]
        self.auditor.__enter__()
        self.auditor.on_setup(
            config=manifest.get("config") or {},
            policy=policy,
            models=self.models,
            tokenizer_info=dict(tokenizer_info or {}),
        )

    def intend(self, pick: Callable[[Finding], bool], note: str) -> None:
        """Findings ``pick`` selects are what the user asked for (TRL's ``cast_lm_head_to_fp32``): kept,
        as info with ``note``, those already recorded and those to come."""
        self._intended.append((pick, note))
        self.auditor.findings.relabel(pick, "info", note)

    def _as_intended(self, f: Finding) -> Finding:
        for pick, note in self._intended:
            if f.severity != "info" and pick(f):
                return dataclasses.replace(f, severity="info", message=f"{f.message}; {note}")
        return f

    # -- the step ------------------------------------------------------------------------------
    def begin_step(self) -> int:
        """Opens the next step unless one is open (a finished one is closed first); returns its number."""
        if self._done:
            self.end_step()
        if self.step is None:
            self.step, self.next_step = self.next_step, self.next_step + 1
            self._metrics, self._skips = {}, {}
            self._backward_seen = set()
            self.auditor.on_step_start(self.step)
        return self.step

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        self.begin_step()
        with self.auditor.phase(name):
            yield

    def finish_step(self) -> None:
        """The step's optimizers have all stepped; it closes at the next step's first event."""
        self._done = self.step is not None

    def log(self, metrics: Mapping[str, Any]) -> None:
        """Adds the host's numbers to the open (or just finished) step's metrics line; non-numbers
        are left out."""
        if self.step is None:
            self.begin_step()
        for k, v in metrics.items():
            if isinstance(v, torch.Tensor) and v.numel() == 1:
                v = float(v.detach())
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                self._metrics[str(k)] = float(v)

    def backward(self, role: str, loss_scale: float) -> None:
        """The role's gradients of this optimizer step are populated (times ``loss_scale``)."""
        self.begin_step()
        self._backward_seen.add(role)
        self.auditor.on_backward(role=role, model=self.models[role], loss_scale=loss_scale)

    def before_optimizer_step(self, role: str, optimizer: Any, *, loss_scale: float = 1.0) -> None:
        """Gradients unscaled and clipped; ``backward`` is called first if nothing reported it."""
        if role not in self._backward_seen:
            self.backward(role, loss_scale)
        self.auditor.on_before_optimizer_step(role=role, model=self.models[role], optimizer=optimizer)

    def optimizer_step(
        self,
        role: str,
        optimizer: Any,
        *,
        scaler_state: Mapping[str, Any],
        skipped: bool,
        grad_norm: float,
    ) -> None:
        self.begin_step()
        self.auditor.on_optimizer_step(
            role=role,
            model=self.models[role],
            optimizer=optimizer,
            scaler_state=scaler_state,
            skipped=skipped,
            grad_norm=grad_norm,
        )
        self._backward_seen.discard(role)
        self._skips.setdefault(role, []).append(1.0 if skipped else 0.0)
        if scaler_state.get("mode") == "dynamic":
            self._metrics[f"{role}/loss_scale"] = float(scaler_state["scale"])
        if math.isfinite(grad_norm):
            self._metrics.setdefault(f"{role}/grad_norm", float(grad_norm))
        lr = optimizer.param_groups[0].get("lr") if hasattr(optimizer, "param_groups") else None
        if isinstance(lr, (int, float)):
            self._metrics.setdefault(f"{role}/lr", float(lr))

    def end_step(self, metrics: Mapping[str, Any] | None = None) -> None:
        """Closes the open step with its metrics line (nothing when no step is open)."""
        if metrics:
            self.log(metrics)
        self._done = False
        if self.step is None:
            return
        for role, skips in self._skips.items():
            self._metrics[f"{role}/skipped"] = sum(skips) / len(skips)
        step, self.step = self.step, None
        self.auditor.on_step_end(step, dict(self._metrics))

    # -- the end -------------------------------------------------------------------------------
    def close(self, exc: BaseException | None = None, *, steps: int | None = None) -> None:
        """Ends the run: the auditor's failure record or ``completed``, then the memory summary."""
        if self._closed:
            return
        self._closed = True
        try:
            if exc is None:
                self.end_step()
        finally:
            self.auditor.__exit__(type(exc) if exc else None, exc, exc.__traceback__ if exc else None)
            self.writer.update_manifest(memory_summary=self.auditor.memory.summary())
            if exc is None:
                self.writer.status("completed", step=self.auditor.last_completed_step, steps=steps)
            else:
                failure = self.auditor.failure or {
                    "reason": "interrupted" if isinstance(exc, KeyboardInterrupt) else "exception",
                    "error": f"{type(exc).__name__}: {exc}",
                }
                self.writer.status("failed", **failure, failed_at=time.time())
            self.writer.close()
