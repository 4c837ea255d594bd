"""Per-module probes: forward pre/post hooks and gradient tensor hooks on every module of every role.

    probe = ModuleProbe(models, policy=policy, context=ctx, sink=findings, provenance=provenance)
    with probe:        # hooks on, for one sampled step
        ...            # the step's forwards and backwards, recorded
        probe.flush()  # at a sync point: read the recorded maxima, turn them into findings

Like `torch.utils.module_tracker.ModuleTracker` it has one job, and its hooks live exactly as long
as the ``with``; they record between `start_step` and `end_step` (the ``with`` calls both). The
`Auditor` enters it for a run of consecutive steps sampled at the ``full`` level and marks each
step's start and end (registering the hooks anew each step would cost two handles per module).
It reads the step and phase from the `StepContext` it is given and puts findings into a `FindingSink`.

The forward hook is registered with ``always_call=True`` so the stack of pending input maxima
stays balanced when a forward raises; the first module whose hook sees an exception in flight is
the innermost one that raised (`failed_in`). Gradients are watched with tensor hooks (not
``register_full_backward_hook``, which breaks on in-place ops and under checkpointing): on each
module's outputs (the gradient it receives) and on a ``view_as`` of its positional inputs (the
gradient it produces). Forwards run while the trainer is in backward are checkpoint recomputes and
are not recorded twice.

The hooks read nothing back from the device (a host read per hooked tensor would be a stream sync
each; reports/gpu/h200_results.md has the cost): each call's absolute maxima stay device scalars in
an ordered log of `ForwardCall` / `GradCall` records, which `flush` reads with one host read per
device and replays in call order (`module_numerics.replay`: provenance, headroom, producers). A
tensor's maximum is taken once per step however many modules see it, and a call's new tensors in
one launch (`Maxima`). Their work is not counted as the model's ops (`opcount.suspended`).
Exercised by `pytest tests/test_audit_probes.py tests/test_audit_collectors.py
tests/test_audit_probe_cost.py`.
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from trainer.precision import PrecisionPolicy
from verlaudit.audit import guard as audit_guard
from verlaudit.audit import opcount
from verlaudit.audit.context import StepContext
from verlaudit.audit.dtype_checks import ModuleCall, check_module_call, module_kind
from verlaudit.audit.findings import FindingSink
from verlaudit.audit.module_numerics import ForwardCall, GradCall, Provenance, replay

FLUSH_EVERY = 20_000
"""Recorded calls after which the probe reads them back even before the step's next sync point
(an eager rollout under the full audit makes hundreds of thousands of module calls)."""


class ModuleProbe:
    """Hooks on every module of ``models`` while entered; findings go to ``sink``."""

    def __init__(
        self,
        models: Mapping[str, nn.Module],
        *,
        policy: PrecisionPolicy,
        context: StepContext,
        sink: FindingSink,
        provenance: Provenance,
    ) -> None:
        self.policy, self.ctx, self.sink, self.provenance = policy, context, sink, provenance
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
        self._pending: list[list[torch.Tensor | None]] = []
        """Input maxima of the forwards under way (a stack: modules nest), popped by the post hook."""
        self._log: list[ForwardCall | GradCall] = []
        """Calls in order, read by `flush`."""
        self._seen: set[tuple] = set()
        self.maxima = Maxima()
        """Absolute maxima of this step's tensors, each computed once (`Maxima`)."""
        self._cuda = torch.cuda.is_available()
        """Whether `_capturing` can be true at all (asked once: the hooks run thousands of times)."""
        self.failed_in: tuple[str, str] | None = None
        """(role, module path) of the innermost module whose forward raised."""
        self.active = False
        """Whether the hooks record (between `start_step` and `end_step`)."""
        self.absmax: dict[str, float] = {}
        """Per role: largest finite activation absolute maximum flushed since the probe was entered."""

    def __enter__(self) -> ModuleProbe:
        self.start_step()
        if not self.handles:
            for m in self.modules.values():
                self.handles.append(m.register_forward_pre_hook(self._pre, with_kwargs=True))
                self.handles.append(m.register_forward_hook(self._post, with_kwargs=True, always_call=True))
        return self

    def __exit__(self, *exc: object) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()
        self.end_step()

    def start_step(self) -> None:
        """Recording on for a sampled step (the `Auditor` keeps the hooks on across consecutive ones:
        registering them costs two handles per module and step)."""
        self.absmax = {}
        self.active = True

    def end_step(self) -> None:
        """Recording off (hooks still registered pass calls through) and the step's state dropped."""
        self.active = False
        self._pending.clear()
        self.maxima.clear()

    # -- hooks: record, read nothing back ---------------------------------------------------------
    # The hook bodies run a few thousand times a step: they allocate little, format no strings (the
    # names of a call's inputs are built only for a dtype signature not seen before, `_check`) and
    # mark their own work as not the model's (`opcount`) with a plain depth counter.
    def _role(self, role: str) -> str:
        # the rollout engine generates with the actor's modules: judge them by the rollout contract
        return "rollout" if role == "actor" and self.ctx.phase == "rollout" else role

    def _pre(self, module: nn.Module, args: tuple, kwargs: dict) -> Any:
        if not self.active:
            return None
        if self._cuda and torch.cuda.is_current_stream_capturing():
            return None  # see `_capturing`
        if self.ctx.in_backward:
            self._pending.append(_NONE)
            return None
        state = opcount._STATE  # the probe's own reductions are not the model's ops
        depth = getattr(state, "suspended", 0)
        state.suspended = depth + 1
        try:
            return self._pre_call(module, args, kwargs)
        except Exception as exc:  # noqa: BLE001  (the probe's bug: off for the run, the forward goes on)
            self._broke(exc)
            return None
        finally:
            state.suspended = depth

    def _broke(self, exc: Exception) -> None:
        self.active = False
        audit_guard.report("module probe", exc)

    def _pre_call(self, module: nn.Module, args: tuple, kwargs: dict) -> Any:
        ins = _floats(args, kwargs)
        self._check(module, args, kwargs, (), "pre")
        self._pending.append(self.maxima.of(ins) if ins else _NONE)
        if not ins or not torch.is_grad_enabled():
            return None
        new_args = None
        for i, x in enumerate(args):
            if isinstance(x, torch.Tensor) and x.requires_grad and x.is_floating_point():
                if new_args is None:
                    new_args = list(args)
                v = x.view_as(x)  # a node of our own: its gradient is this module's contribution alone
                role, name = self.info[id(module)][:2]
                v.register_hook(self._grad_hook(role, name, received=False))
                new_args[i] = v
        return None if new_args is None else (tuple(new_args), kwargs)

    def _post(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        if not self.active:
            return
        if self._cuda and torch.cuda.is_current_stream_capturing():
            return
        in_amaxes = self._pending.pop() if self._pending else _NONE
        if output is None and sys.exc_info()[0] is not None:
            if self.failed_in is None:
                self.failed_in = self.info[id(module)][:2]
            return
        if self.ctx.in_backward:
            return
        state = opcount._STATE
        depth = getattr(state, "suspended", 0)
        state.suspended = depth + 1
        try:
            self._post_call(module, args, kwargs, output, in_amaxes)
        except Exception as exc:  # noqa: BLE001
            self._broke(exc)
        finally:
            state.suspended = depth

    def _post_call(self, module: nn.Module, args: tuple, kwargs: dict, output: Any, in_amaxes: list) -> None:
        role, name = self.info[id(module)][:2]
        eff = self._role(role)
        outs = _floats(output)
        out_dtypes = tuple([t.dtype for t in outs])
        self._check(module, args, kwargs, out_dtypes, "post")
        amaxes = in_amaxes + self.maxima.of(outs) if outs else in_amaxes
        self._record(
            ForwardCall(eff, name, amaxes, len(in_amaxes), out_dtypes, self.ctx.step, self.ctx.phase)
        )
        if outs and torch.is_grad_enabled():
            hook = None
            for t in outs:
                if t.requires_grad:
                    hook = hook or self._grad_hook(eff, name, received=True)
                    t.register_hook(hook)

    def _grad_hook(self, role: str, name: str, *, received: bool):
        ctx, of = self.ctx, self.maxima.of

        def hook(grad: torch.Tensor) -> None:
            # a received gradient's role was judged when the output was made; a produced one's now
            eff = role if received else self._role(role)
            state = opcount._STATE
            depth = getattr(state, "suspended", 0)
            state.suspended = depth + 1
            try:
                (amax,) = of([grad])
                self._record(GradCall(received, eff, name, amax, grad.dtype, ctx.step, ctx.phase))
            except Exception as exc:  # noqa: BLE001  (in the user's backward: never raise from here)
                self._broke(exc)
            finally:
                state.suspended = depth

        return hook

    def _record(self, call: ForwardCall | GradCall) -> None:
        self._log.append(call)
        if len(self._log) >= FLUSH_EVERY:
            self.flush()

    def _check(self, module, args: tuple, kwargs: dict, outs: tuple, stage: str) -> None:
        """dtype contract of one call; each distinct dtype signature of a module is checked once."""
        role, name, kind, own = self.info[id(module)]
        eff = self._role(role)
        first = _first_tensor(args, kwargs)
        device = first.device.type if first is not None else "cpu"
        ac = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None
        # the signature holds positions and keyword names as they are; `_tensors` names them only
        # for a signature not seen before (the same names, so the same signatures as by name)
        arg_sig = tuple([x.dtype if isinstance(x, torch.Tensor) else None for x in args])
        kw_sig = (
            tuple([(k, x.dtype) for k, x in kwargs.items() if isinstance(x, torch.Tensor)]) if kwargs else ()
        )
        sig = (id(module), eff, ac, arg_sig, kw_sig, outs, stage)
        if sig in self._seen:
            return
        self._seen.add(sig)
        inputs = tuple((k, t.dtype) for k, t in _tensors(args) + _tensors(kwargs))
        call = ModuleCall(
            role=eff, name=name, kind=kind, param_dtypes=own, autocast=ac, inputs=inputs, outputs=outs
        )
        self.sink.extend(check_module_call(call, self.policy[eff], **self.ctx.where(), stage=stage))

    # -- settle: one read, then replay in call order ----------------------------------------------
    def flush(self) -> None:
        """Reads every recorded maximum (one host read per device) and turns the calls, in order,
        into provenance, headroom and producer findings, and the per-role activation maxima."""
        log, self._log = self._log, []
        if not log:
            return
        values = _read([v for call in log for v in call.scalars()])
        found = replay(log, values, policy=self.policy, provenance=self.provenance, absmax=self.absmax)
        self.sink.extend(found)


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


_NONE: list = []
"""The input maxima of a call with no floating inputs (or not recorded): shared, never appended to."""


def _floats(obj: Any, kwargs: Mapping | None = None) -> list[torch.Tensor]:
    """The floating tensors `_tensors` finds in ``obj`` (and ``kwargs``), in the same order, unnamed."""
    if isinstance(obj, torch.Tensor):
        out = [obj] if obj.is_floating_point() else []
    elif isinstance(obj, (tuple, list)):
        out = [x for x in obj if isinstance(x, torch.Tensor) and x.is_floating_point()]
    elif isinstance(obj, Mapping):
        out = [x for x in obj.values() if isinstance(x, torch.Tensor) and x.is_floating_point()]
    else:
        out = []
    if kwargs:
        out += [x for x in kwargs.values() if isinstance(x, torch.Tensor) and x.is_floating_point()]
    return out


def _first_tensor(args: tuple, kwargs: dict) -> torch.Tensor | None:
    for x in args:
        if isinstance(x, torch.Tensor):
            return x
    for x in kwargs.values():
        if isinstance(x, torch.Tensor):
            return x
    return None


def _capturing() -> bool:
    """A CUDA graph is being captured (the rollout's decode step): reading a value would abort the
    capture, and hooks do not run on replay anyway, so the probes stand aside; the prefill and the
    eager warm-up of that step are still checked."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


class Maxima:
    """Absolute maxima of tensors as device scalars, each tensor's computed once per step.

    Most of what a module receives is what another module returned a moment before (the residual
    stream, a norm's output read by q, k and v, an MLP returning its down projection's output), and
    most gradients a module passes on are the ones its producer receives. So a tensor's maximum is
    kept under its identity (a weak reference: no activation lives longer for it) and a view that
    covers all of a known tensor takes that tensor's; the rest of a call's tensors are reduced by
    `absmax` (one pass each, no ``abs()`` temporary, and NaN when a NaN is present, like amax), so one
    number still answers "finite?" and "how close to the dtype's top?".
    Values stay in their dtype until `_read`.
    """

    def __init__(self) -> None:
        self._known: dict[int, _Known] = {}

    def clear(self) -> None:
        self._known.clear()

    def _lookup(self, t: torch.Tensor) -> torch.Tensor | None:
        hit = self._known.get(id(t))
        if hit is not None and hit() is t:
            return hit.amax
        base = t._base
        if base is not None and base.numel() == t.numel():
            hit = self._known.get(id(base))
            if hit is not None and hit() is base:
                return hit.amax
        return None

    def of(self, tensors: list[torch.Tensor]) -> list[torch.Tensor | None]:
        """Each tensor's absolute maximum (None for an empty one)."""
        out: list[torch.Tensor | None] = [None] * len(tensors)
        todo: list[int] = []
        for i, t in enumerate(tensors):
            if t.numel():
                out[i] = self._lookup(t)
                if out[i] is None:
                    todo.append(i)
        if todo:  # detached: no autograd record, without a no_grad context per call
            got = absmax([tensors[i].detach() for i in todo])
            if len(self._known) > FLUSH_EVERY:
                self._known.clear()  # an eager rollout's many small tensors: keep the table small
            for i, m in zip(todo, got):
                out[i] = m
                self._known[id(tensors[i])] = _Known(tensors[i], m)
        return out


def absmax(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each tensor's absolute maximum as a device scalar in its dtype, NaN when it holds a NaN: one
    ``vector_norm(inf)`` per tensor (one pass, no ``abs()`` temporary). On the H200 that reads a 7B
    layer's activations at 3.2 TB/s where ``_foreach_norm(inf)`` over the same list reached 2.0
    (benchmarks/maxima_bench.py, reports/gpu/audit_price_h200/)."""
    return [torch.linalg.vector_norm(t, float("inf")) for t in tensors]


class _Known(weakref.ref):
    """A weak reference to a tensor that carries its absolute maximum (one object per known tensor)."""

    __slots__ = ("amax",)

    def __new__(cls, tensor: torch.Tensor, amax: torch.Tensor) -> _Known:
        return super().__new__(cls, tensor)  # no callback: ``amax`` is not one

    def __init__(self, tensor: torch.Tensor, amax: torch.Tensor) -> None:
        super().__init__(tensor)
        self.amax = amax


def _read(scalars: list[torch.Tensor]) -> list[float]:
    """The values of device scalars (any floating dtype), in order, with one host read per device."""
    out: list[float] = [0.0] * len(scalars)
    groups: dict[torch.device, dict[torch.dtype, list[int]]] = {}
    for i, t in enumerate(scalars):
        groups.setdefault(t.device, {}).setdefault(t.dtype, []).append(i)
    for by_dtype in groups.values():
        order = [i for idx in by_dtype.values() for i in idx]
        flat = torch.cat([torch.stack([scalars[i] for i in idx]).float() for idx in by_dtype.values()])
        for i, v in zip(order, flat.tolist()):
            out[i] = v
    return out
