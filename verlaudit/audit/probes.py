"""Per-module probes: forward pre/post hooks and gradient tensor hooks on every module of every role.

Attached only while a step is sampled at the ``full`` audit level and removed right after (and
always in the auditor's ``__exit__``). The forward hook is registered with ``always_call=True`` so
the module stack stays balanced when a forward raises; the first module whose hook sees an
exception in flight is the innermost one that raised. Gradients are watched with tensor hooks
(not ``register_full_backward_hook``, which breaks on in-place ops and under checkpointing): on
each module's outputs (the gradient it receives) and on a ``view_as`` of its positional inputs
(the gradient it produces). Forward calls made while the trainer is in backward are activation
checkpointing recomputes and are not recorded twice.

The hooks read nothing back from the device: each call's absolute maxima stay device scalars in an
ordered log, which `ModuleProbe.flush` reads with one host read per device and replays in call order
(provenance, headroom, producers) when the auditor settles -- at the trainer's optimizer step, at
the step's end and on a failure, where the trainer has synced anyway. A host read per hooked tensor
cost +35% step time at 7B (reports/gpu/h200_results.md). Exercised by `pytest tests/test_audit_probes.py`.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from verlaudit.audit.dtype_checks import ModuleCall, check_module_call, module_kind
from verlaudit.audit.numerics import headroom_finding, producer_finding

if TYPE_CHECKING:  # pragma: no cover
    from verlaudit.audit.auditor import Auditor


def _tensors(obj: Any, key: str = "") -> list[tuple[str, torch.Tensor]]:
    """Tensors one level deep in args / outputs (tuples, lists, dicts and HF ModelOutputs)."""
    if isinstance(obj, torch.Tensor):
        return [(key, obj)]
    out: list[tuple[str, torch.Tensor]] = []
    if isinstance(obj, (tuple, list)):
        for i, x in enumerate(obj):
            if isinstance(x, torch.Tensor):
                out.append((f"{key}[{i}]" if key else f"arg{i}", x))
    elif isinstance(obj, Mapping):
        for k, x in obj.items():
            if isinstance(x, torch.Tensor):
                out.append((str(k), x))
    return out


def _capturing() -> bool:
    """A CUDA graph is being captured (the rollout's decode step): reading a value would abort the
    capture, and hooks do not run on replay anyway, so the probes stand aside; the prefill and the
    eager warm-up of that step are still checked."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _amax(t: torch.Tensor) -> torch.Tensor | None:
    """Absolute maximum as a device scalar (read later, with the step's others); NaN when ``t`` holds
    a NaN (amax propagates it), so one reduction answers both "is it finite" and "how close to the
    dtype's limit". None for an empty tensor."""
    if t.numel() == 0:
        return None
    return t.detach().abs().amax().float()


FLUSH_EVERY = 20_000
"""Recorded values after which the probe reads them back even before the step's next sync point
(an eager rollout under the full audit makes hundreds of thousands of module calls)."""


class ModuleProbe:
    """Hooks for the models of an `Auditor`; reads its step, phase and policy, writes its findings."""

    def __init__(self, auditor: Auditor, models: Mapping[str, nn.Module]) -> None:
        self.a = auditor
        self.info: dict[int, tuple[str, str, str, tuple[torch.dtype, ...]]] = {}
        for role, model in models.items():
            for name, m in model.named_modules():
                if id(m) in self.info:
                    continue  # shared module (e.g. a critic sharing the actor's backbone): first role wins
                own = tuple(
                    sorted({p.dtype for p in m.parameters(recurse=False) if p.is_floating_point()}, key=str)
                )
                self.info[id(m)] = (role, name, module_kind(name, m), own)
        self.modules = {id(m): m for model in models.values() for m in model.modules()}
        self.handles: list[Any] = []
        self.stack: list[tuple[str, str]] = []
        self._pending: list[list[torch.Tensor | None]] = []
        self._log: list[tuple] = []
        """Calls in order: ("fwd", role, name, in_amaxes, [(out_amax, dtype)], step, phase),
        ("gout" | "gin", role, name, amax, dtype, step, phase); read by `flush`."""
        self._seen: set[tuple] = set()
        self.failed_in: tuple[str, str] | None = None
        self.absmax: dict[str, float] = {}
        """Per role: largest finite activation absolute maximum seen this step."""

    @property
    def attached(self) -> bool:
        return bool(self.handles)

    def attach(self) -> None:
        if self.handles:
            return
        for m in self.modules.values():
            self.handles.append(m.register_forward_pre_hook(self._pre, with_kwargs=True))
            self.handles.append(m.register_forward_hook(self._post, with_kwargs=True, always_call=True))

    def detach(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()
        self.stack.clear()
        self._pending.clear()

    def _role(self, role: str) -> str:
        # the rollout engine generates with the actor's modules: judge them by the rollout contract
        return "rollout" if role == "actor" and self.a.phase_name == "rollout" else role

    def _pre(self, module: nn.Module, args: tuple, kwargs: dict) -> Any:
        if _capturing():
            return None
        role, name, kind, own = self.info[id(module)]
        self.stack.append((role, name))
        if self.a.in_backward:
            self._pending.append([])
            return None
        ins = _tensors(args) + _tensors(kwargs)
        self._check(module, role, name, kind, own, ins, (), "pre")
        self._pending.append([_amax(t) for _, t in ins if t.is_floating_point()])
        if not torch.is_grad_enabled():
            return None
        changed = False
        new_args = list(args)
        for i, x in enumerate(args):
            if isinstance(x, torch.Tensor) and x.is_floating_point() and x.requires_grad:
                v = x.view_as(x)  # a node of our own: its gradient is this module's contribution alone
                v.register_hook(self._grad_in_hook(role, name))
                new_args[i] = v
                changed = True
        return (tuple(new_args), kwargs) if changed else None

    def _post(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        if _capturing():
            return
        role, name, kind, own = self.info[id(module)]
        if self.stack:
            self.stack.pop()
        in_amaxes = self._pending.pop() if self._pending else []
        if output is None and sys.exc_info()[0] is not None:
            if self.failed_in is None:
                self.failed_in = (role, name)
            return
        if self.a.in_backward:
            return
        eff = self._role(role)
        outs = [t for _, t in _tensors(output) if t.is_floating_point()]
        self._check(
            module,
            role,
            name,
            kind,
            own,
            _tensors(args) + _tensors(kwargs),
            tuple(t.dtype for t in outs),
            "post",
        )
        out_amaxes = [(_amax(t), t.dtype) for t in outs]
        self._record(("fwd", eff, name, in_amaxes, out_amaxes, self.a.step, self.a.phase_name))
        if torch.is_grad_enabled():
            for t in outs:
                if t.requires_grad:
                    t.register_hook(self._grad_out_hook(eff, name))

    def _record(self, event: tuple) -> None:
        self._log.append(event)
        if len(self._log) >= FLUSH_EVERY:
            self.flush()

    def flush(self) -> None:
        """Reads every recorded maximum (one host read per device) and turns the calls, in order,
        into provenance, headroom and producer findings, and the per-role activation maxima."""
        log, self._log = self._log, []
        if not log:
            return
        values = _read([v for e in log for v in _scalars(e)])
        it = iter(values)
        for e in log:
            if e[0] == "fwd":
                _, role, name, ins, outs, step, phase = e
                in_vals = [next(it) if t is not None else 0.0 for t in ins]
                out_vals = [(next(it) if t is not None else 0.0, dtype) for t, dtype in outs]
                self._replay_forward(role, name, in_vals, out_vals, step, phase)
            else:
                kind, role, name, t, dtype, step, phase = e
                m = next(it) if t is not None else 0.0
                (self._replay_grad_out if kind == "gout" else self._replay_grad_in)(
                    role, name, m, dtype, step, phase
                )

    def _replay_forward(self, role, name, in_vals, out_vals, step, phase) -> None:
        in_finite = all(math.isfinite(x) for x in in_vals)
        in_max = max(in_vals, default=0.0)
        policy = self.a.policy[role]
        for m, dtype in out_vals:
            if not math.isfinite(m):
                what = "nan" if math.isnan(m) else "inf"
                if self.a.provenance.forward(role, name, in_finite, False, what):
                    self.a.add_findings([producer_finding(role, name, what, dtype, "forward", policy, step=step,
                                                          phase=phase, max_in=in_max)])  # fmt: skip
                break
            self.absmax[role] = max(self.absmax.get(role, 0.0), m)
            f = headroom_finding(role, name, dtype, m, "activation absmax", step=step, phase=phase)
            if f is not None:
                self.a.add_findings([f])

    def _replay_grad_out(self, role, name, m, dtype, step, phase) -> None:
        self.a.provenance.grad_output(role, name, math.isfinite(m))
        if self.a.policy[role].loss_scaling == "dynamic":
            return  # loss-scaled gradients sit near fp16's top on purpose; the scaler backs off on overflow
        f = headroom_finding(role, name, dtype, m, "gradient absmax", step=step, phase=phase)
        if f is not None:
            self.a.add_findings([f])

    def _replay_grad_in(self, role, name, m, dtype, step, phase) -> None:
        if math.isfinite(m):
            return
        what = "nan" if math.isnan(m) else "inf"
        if self.a.provenance.grad_input(role, name, False, what):
            self.a.add_findings([producer_finding(role, name, what, dtype, "backward", self.a.policy[role],
                                                  step=step, phase=phase)])  # fmt: skip

    def _check(self, module, role, name, kind, own, ins, outs, stage: str) -> None:
        """dtype contract of one call; each distinct dtype signature of a module is checked once."""
        eff = self._role(role)
        device = ins[0][1].device.type if ins else "cpu"
        ac = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None
        inputs = tuple((k, t.dtype) for k, t in ins)
        sig = (id(module), eff, ac, inputs, outs, stage)
        if sig in self._seen:
            return
        self._seen.add(sig)
        call = ModuleCall(
            role=eff, name=name, kind=kind, param_dtypes=own, autocast=ac, inputs=inputs, outputs=outs
        )
        self.a.add_findings(
            check_module_call(
                call, self.a.policy[eff], step=self.a.step, phase=self.a.phase_name, stage=stage
            )
        )

    def _grad_out_hook(self, role: str, name: str):
        def hook(grad: torch.Tensor) -> None:
            self._record(("gout", role, name, _amax(grad), grad.dtype, self.a.step, self.a.phase_name))

        return hook

    def _grad_in_hook(self, role: str, name: str):
        def hook(grad: torch.Tensor) -> None:
            eff = self._role(role)
            self._record(("gin", eff, name, _amax(grad), grad.dtype, self.a.step, self.a.phase_name))

        return hook


def _scalars(event: tuple) -> list[torch.Tensor]:
    if event[0] == "fwd":
        return [t for t in event[3] if t is not None] + [t for t, _ in event[4] if t is not None]
    return [event[3]] if event[3] is not None else []


def _read(scalars: list[torch.Tensor]) -> list[float]:
    """The values of device scalars, in order, with one host read per device."""
    out: list[float] = [0.0] * len(scalars)
    by_device: dict[torch.device, list[int]] = {}
    for i, t in enumerate(scalars):
        by_device.setdefault(t.device, []).append(i)
    for idx in by_device.values():
        for i, v in zip(idx, torch.stack([scalars[i] for i in idx]).tolist()):
            out[i] = v
    return out
