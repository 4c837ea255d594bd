"""Planted faults for tests and demos, applied from the worker spec's ``inject`` — never by the trainer.

    {"nan_in_module": "model.layers.1.mlp", "at_step": 2, "phase": "actor_update", "role": "actor"}
    {"scale_module_output": {"module": "model.layers.0.mlp.down_proj", "factor": 1e6, "at_step": 0}}
    {"cast_module": {"module": "model.layers.0.mlp", "dtype": "bf16"}}      # a runtime dtype error
    {"raise_in_phase": {"phase": "actor_update", "at_step": 1, "error": "oom"}}  # a simulated OOM

Collator and reward faults need no injector: point ``data.collator`` / ``data.reward_fn`` at the
functions in ``tests/faults.py``. The worker runs the injector beside the auditor through
`trainer.events.Fanout`. Exercised by `pytest tests/test_worker.py`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn

from trainer.events import PHASES, Observer
from trainer.precision import parse_dtype

INJECT_KEYS = (
    "nan_in_module",
    "at_step",
    "phase",
    "role",
    "scale_module_output",
    "cast_module",
    "raise_in_phase",
)
ERRORS = ("oom", "dtype", "runtime", "interrupt")


def _module(models: Mapping[str, nn.Module], role: str, path: str, where: str) -> nn.Module:
    if role not in models:
        raise ValueError(f"{where}.role: no {role!r} model in this run; roles: {', '.join(models)}")
    try:
        return models[role].get_submodule(path)
    except AttributeError:
        names = [n for n, _ in models[role].named_modules() if n][:8]
        raise ValueError(f"{where}: {role} has no module {path!r}; e.g. {', '.join(names)}") from None


class FaultInjector(Observer):
    """Registers the planted faults of a spec's ``inject`` mapping on the role models at setup."""

    def __init__(self, spec: Mapping[str, Any], where: str = "inject") -> None:
        if not isinstance(spec, Mapping):
            raise ValueError(f"{where}: expected a mapping, got {type(spec).__name__}")
        for k in spec:
            if k not in INJECT_KEYS:
                raise ValueError(f"{where}.{k}: unknown fault; expected one of {', '.join(INJECT_KEYS)}")
        self.spec, self.where = dict(spec), where
        self.step = -1
        self.phase_name: str | None = None
        self.handles: list[Any] = []
        ph = self.spec.get("phase")
        if ph is not None and ph not in PHASES:
            raise ValueError(f"{where}.phase: {ph!r}; expected one of {', '.join(PHASES)}")
        r = self.spec.get("raise_in_phase")
        if r is not None and (not isinstance(r, Mapping) or r.get("error", "oom") not in ERRORS):
            raise ValueError(
                f"{where}.raise_in_phase: expected {{phase, at_step, error: {'|'.join(ERRORS)}}}"
            )

    def on_setup(self, *, config, policy, models, tokenizer_info) -> None:
        s, w = self.spec, self.where
        if "nan_in_module" in s:
            m = _module(models, s.get("role", "actor"), s["nan_in_module"], f"{w}.nan_in_module")
            self.handles.append(m.register_forward_hook(self._nan_hook(), prepend=True))
        if "scale_module_output" in s:
            sc = s["scale_module_output"]
            m = _module(models, sc.get("role", "actor"), sc["module"], f"{w}.scale_module_output.module")
            self.handles.append(m.register_forward_hook(self._scale_hook(sc), prepend=True))
        if "cast_module" in s:
            cm = s["cast_module"]
            m = _module(models, cm.get("role", "actor"), cm["module"], f"{w}.cast_module.module")
            m.to(parse_dtype(cm.get("dtype", "bf16"), f"{w}.cast_module.dtype"))

    def on_step_start(self, step: int) -> None:
        self.step = step

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        previous, self.phase_name = self.phase_name, name
        r = self.spec.get("raise_in_phase")
        try:
            if r and r.get("phase") == name and int(r.get("at_step", 0)) == self.step:
                _raise(r.get("error", "oom"))
            yield
        finally:
            self.phase_name = previous

    def _active(self, at_step: int, phase: str | None) -> bool:
        return self.step == at_step and (phase is None or phase == self.phase_name)

    def _nan_hook(self):
        def hook(module: nn.Module, args: Any, output: Any) -> Any:
            if not self._active(int(self.spec.get("at_step", 0)), self.spec.get("phase")):
                return None
            return _map_first(output, lambda t: _poison(t))

        return hook

    def _scale_hook(self, sc: Mapping[str, Any]):
        factor = float(sc.get("factor", 1e6))
        start = int(sc.get("at_step", 0))

        def hook(module: nn.Module, args: Any, output: Any) -> Any:
            if self.step < start or (sc.get("phase") and sc.get("phase") != self.phase_name):
                return None
            # scale in fp32 and round back, as a real layer would: large values overflow to inf, zeros stay 0
            return _map_first(output, lambda t: (t.float() * factor).to(t.dtype))

        return hook

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()


def _poison(t: torch.Tensor) -> torch.Tensor:
    out = t.clone()
    out.view(-1)[0] = float("nan")
    return out


def _map_first(output: Any, fn) -> Any:
    if isinstance(output, torch.Tensor):
        return fn(output) if output.is_floating_point() else None
    if isinstance(output, tuple) and output and isinstance(output[0], torch.Tensor):
        return (fn(output[0]), *output[1:])
    return None


def _raise(kind: str) -> None:
    if kind == "oom":
        raise torch.OutOfMemoryError(
            "CUDA out of memory. Tried to allocate 2.00 GiB (planted by verlaudit inject.raise_in_phase)"
        )
    if kind == "interrupt":
        raise KeyboardInterrupt("planted by verlaudit inject.raise_in_phase")
    if kind == "dtype":
        raise RuntimeError("expected scalar type BFloat16 but found Float (planted by verlaudit inject)")
    raise RuntimeError("planted failure (verlaudit inject.raise_in_phase)")
