"""Taps on the torch calls an own loop makes between its forward and its optimizer step.

`verlaudit.watch` sees the optimizer's steps and the GradScaler's calls on their instances; what a loop
does between them goes through torch functions that no instance owns: ``clip_grad_norm_`` /
``clip_grad_value_``, an LR scheduler's ``step``, ``Tensor.backward``, ``zero_grad`` (an optimizer's or
a module's) and the log-softmax family
(``log_softmax`` as a function or a method, ``logsumexp``). `CallTaps` wraps those for as long as one
watch is open (the originals are put back when the last one closes) and calls the open watches'
`Listener` methods with the user's file:line of each call, before the original runs (so that a call
torch then refuses, a ``backward`` on a loss with no graph, is recorded first). The checks that read
them are in `verlaudit.integrations.loop_protocol`. Exercised by `pytest tests/test_loop_protocol.py`.
"""

from __future__ import annotations

import sys
from typing import Any

import torch

from verlaudit.audit.frames import user_frame

_LISTENERS: list[Any] = []
"""The open watches' listeners; the torch functions are wrapped while this is not empty."""
_SAVED: list[tuple[Any, str, Any, bool]] = []
"""(owner, name, original, was in the owner's own __dict__) of every wrapped attribute."""

_CLIP_OWNERS = (torch.nn.utils, torch.nn.utils.clip_grad)
_LOG_SOFTMAX = (
    (torch, "log_softmax"),
    (torch.Tensor, "log_softmax"),
    (torch.nn.functional, "log_softmax"),
    (torch.special, "log_softmax"),
    (torch, "logsumexp"),
    (torch.Tensor, "logsumexp"),
)


def at_line(line: str | None) -> str:
    """A user line as a finding names it: ``file:line (function)``, or "an unknown line"."""
    return line or "an unknown line"


def _line() -> str | None:
    return user_frame(depth=3)


def _user_caller() -> str | None:
    """The user's file:line when the frame calling the wrapped function is user code itself (not torch,
    a library or ours), else None."""
    line = user_frame(depth=3)
    f = sys._getframe(2)
    if line is None:
        return None
    file, _, rest = line.partition(":")
    if f.f_code.co_filename.endswith(file) and rest.startswith(f"{f.f_lineno} "):
        return line
    return None


def _clip(name: str, orig: Any) -> Any:
    def wrapped(parameters: Any, *args: Any, **kwargs: Any) -> Any:
        if _LISTENERS:
            params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
            limit = args[0] if args else kwargs.get("max_norm", kwargs.get("clip_value"))
            line = _line()
            _each("on_clip", name, params, limit, line)
            parameters = params
        return orig(parameters, *args, **kwargs)

    wrapped.__wrapped__ = orig  # type: ignore[attr-defined]
    return wrapped


def _sched_step(orig: Any) -> Any:
    def wrapped(self: Any, *args: Any, **kwargs: Any) -> Any:
        if _LISTENERS and not getattr(self, "_is_initial", False) and not args and not kwargs:
            line = _line()
            _each("on_scheduler_step", self, line)
        return orig(self, *args, **kwargs)

    wrapped.__wrapped__ = orig  # type: ignore[attr-defined]
    return wrapped


def _backward(orig: Any) -> Any:
    def wrapped(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if _LISTENERS:
            line = _line()
            _each("on_backward", self, line)
        return orig(self, *args, **kwargs)

    wrapped.__wrapped__ = orig  # type: ignore[attr-defined]
    return wrapped


def _zero_grad(orig: Any) -> Any:
    def wrapped(self: Any, *args: Any, **kwargs: Any) -> Any:
        if _LISTENERS:
            line = _line()
            _each("on_zero_grad", self, line)
        return orig(self, *args, **kwargs)

    wrapped.__wrapped__ = orig  # type: ignore[attr-defined]
    return wrapped


def _low(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.is_floating_point() and torch.finfo(t.dtype).bits < 32


def _log_softmax(name: str, orig: Any) -> Any:
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        out = orig(*args, **kwargs)
        line = _user_caller() if _LISTENERS and args and _low(args[0]) and _low(out) else None
        if line is not None:
            _each("on_log_softmax", name, args[0], out, line)
        return out

    wrapped.__wrapped__ = orig  # type: ignore[attr-defined]
    return wrapped


def _each(method: str, *args: Any) -> None:
    """Calls ``method`` of every open listener that has one (the role checks of `loop_roles`)."""
    for ls in list(_LISTENERS):
        fn = getattr(ls, method, None)
        if fn is not None:
            fn(*args)


def _built(method: str, orig: Any) -> Any:
    """An ``__init__`` (an optimizer's, an LR scheduler's, a GradScaler's): the new object and the user's
    line, after it is built."""

    def wrapped(self: Any, *args: Any, **kwargs: Any) -> Any:
        out = orig(self, *args, **kwargs)
        if _LISTENERS:
            _each(method, self, _line())
        return out

    wrapped.__wrapped__ = orig  # type: ignore[attr-defined]
    return wrapped


def _load_state(orig: Any) -> Any:
    def wrapped(self: Any, *args: Any, **kwargs: Any) -> Any:
        out = orig(self, *args, **kwargs)
        if _LISTENERS:
            _each("on_optimizer_loaded", self, _line())
        return out

    wrapped.__wrapped__ = orig  # type: ignore[attr-defined]
    return wrapped


def _inference_enter(orig: Any) -> Any:
    def wrapped(self: Any, *args: Any, **kwargs: Any) -> Any:
        if _LISTENERS and getattr(self, "mode", True):
            _each("on_inference_mode", _line())
        return orig(self, *args, **kwargs)

    wrapped.__wrapped__ = orig  # type: ignore[attr-defined]
    return wrapped


def _generate(orig: Any) -> Any:
    """transformers' ``GenerationMixin.generate``: the module, its sampling settings, its output."""

    def wrapped(self: Any, *args: Any, **kwargs: Any) -> Any:
        if not _LISTENERS:
            return orig(self, *args, **kwargs)
        line, inference = _line(), torch.is_inference_mode_enabled()
        out = orig(self, *args, **kwargs)
        _each("on_generate", self, args, kwargs, out, line, inference)
        return out

    wrapped.__wrapped__ = orig  # type: ignore[attr-defined]
    return wrapped


GRAD_DEPTH = [0]
"""``torch.autograd.grad`` calls running now: their gradients go to the caller, not into ``.grad``."""


def _autograd_grad(orig: Any) -> Any:
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        GRAD_DEPTH[0] += 1
        try:
            return orig(*args, **kwargs)
        finally:
            GRAD_DEPTH[0] -= 1

    wrapped.__wrapped__ = orig  # type: ignore[attr-defined]
    return wrapped


def _wrap(owner: Any, name: str, make: Any) -> None:
    own = name in vars(owner)
    orig = getattr(owner, name)
    _SAVED.append((owner, name, orig, own))
    setattr(owner, name, make(orig))


def install(listener: Any) -> None:
    """Adds ``listener`` (the torch functions are wrapped at the first)."""
    if not _LISTENERS:
        for owner in _CLIP_OWNERS:
            for name in ("clip_grad_norm_", "clip_grad_value_"):
                if hasattr(owner, name):
                    _wrap(owner, name, lambda o, n=name: _clip(n, o))
        _wrap(torch.optim.lr_scheduler.LRScheduler, "step", _sched_step)
        _wrap(torch.Tensor, "backward", _backward)
        _wrap(torch.optim.Optimizer, "zero_grad", _zero_grad)
        _wrap(torch.nn.Module, "zero_grad", _zero_grad)
        for owner, name in _LOG_SOFTMAX:
            _wrap(owner, name, lambda o, n=name: _log_softmax(n, o))
        _wrap(torch.optim.Optimizer, "__init__", lambda o: _built("on_optimizer_built", o))
        _wrap(torch.optim.Optimizer, "load_state_dict", _load_state)
        _wrap(torch.optim.lr_scheduler.LRScheduler, "__init__", lambda o: _built("on_scheduler_built", o))
        _wrap(torch.amp.GradScaler, "__init__", lambda o: _built("on_scaler_built", o))
        _wrap(torch.inference_mode, "__enter__", _inference_enter)
        _wrap(torch.autograd, "grad", _autograd_grad)
        gen = sys.modules.get("transformers.generation.utils")
        if gen is not None and hasattr(gen, "GenerationMixin"):
            _wrap(gen.GenerationMixin, "generate", _generate)
    _LISTENERS.append(listener)


def remove(listener: Any) -> None:
    """Removes ``listener``; the originals are put back when it was the last."""
    if listener in _LISTENERS:
        _LISTENERS.remove(listener)
    if _LISTENERS:
        return
    while _SAVED:
        owner, name, orig, own = _SAVED.pop()
        if own:
            setattr(owner, name, orig)
        else:
            delattr(owner, name)
