"""What only a user's own loop can get wrong, seen by `verlaudit.watch` while it runs.

Our trainer owns its autocast, its casts and its loss scaler; a loop of the user's own writes them
itself, and each has a way to be silently wrong that no tensor at a boundary shows:

* `AutocastRegions` notes every ``torch.autocast`` region entered while a watch is open (its device
  type, dtype, whether the user asked for it on and whether torch kept it on, and the user's
  file:line), by wrapping the class's ``__init__`` / ``__enter__`` / ``__exit__`` for the watch's
  lifetime. `autocast_finding` reads the regions open at a watched model's forward: a region asked
  for on a device type the model's tensors are not on, or one torch switched off (its device is not
  available, or it does not support the dtype), does nothing, so the forward runs in the weights'
  dtype and not the contract's.
* `CastTap` wraps ``nn.Module._apply`` (what ``model.to(dtype)``, ``.float()``, ``.half()``,
  ``.bfloat16()`` call) for the watched models only and reports each change of its parameters' dtype with the
  user's line; `round_trip_finding` names a cast down from the contract's storage dtype followed by
  a cast back up: the master weights were rounded to the low dtype (measured: the share of values
  the low dtype holds exactly after it), and every update below its spacing since the last
  rounding is erased.
* `scaler_findings`: a GradScaler's ``step`` with no ``scale`` since its last ``update`` (the
  backward ran on the unscaled loss), an ``optimizer.step()`` outside ``scaler.step`` after a scaled
  backward (the gradients still carry the scale), an fp16 autocast forward with no enabled scaler,
  and an optimizer step that finds no gradient at all (``zero_grad`` between backward and step).

Every check is exact evidence (a flag torch set, a dtype, a call that did or did not happen), never a
threshold, so a correct loop stays clean. Exercised by `pytest tests/test_watch_loop_checks.py`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from verlaudit import kinds as K
from verlaudit.audit.frames import user_frame
from verlaudit.dtypes import dtype_name as dn
from verlaudit.integrations.contract import main_dtype
from verlaudit.rundir import Finding

_AUTOCAST = torch.amp.autocast_mode.autocast
_ORIG = {name: getattr(_AUTOCAST, name) for name in ("__init__", "__enter__", "__exit__")}
_TAPS: list[AutocastRegions] = []
"""The open watches' region recorders; the class methods are wrapped while this is not empty."""


def _init(self: Any, device_type: str, *args: Any, **kwargs: Any) -> None:
    enabled = kwargs.get("enabled", args[1] if len(args) > 1 else True)
    _ORIG["__init__"](self, device_type, *args, **kwargs)
    self._verlaudit_asked = bool(enabled)


def _enter(self: Any) -> Any:
    out = _ORIG["__enter__"](self)
    if _TAPS:
        region = {
            "device": str(getattr(self, "device", "?")),
            "dtype": dn(getattr(self, "fast_dtype", None)) if getattr(self, "fast_dtype", None) else None,
            "asked": bool(getattr(self, "_verlaudit_asked", True)),
            "enabled": bool(getattr(self, "_enabled", True)),
            "line": user_frame(depth=2),
            "id": id(self),
        }
        for tap in _TAPS:
            tap.stack.append(region)
    return out


def _exit(self: Any, *exc: Any) -> Any:
    for tap in _TAPS:
        for k in range(len(tap.stack) - 1, -1, -1):
            if tap.stack[k]["id"] == id(self):
                del tap.stack[k]
                break
    return _ORIG["__exit__"](self, *exc)


class AutocastRegions:
    """The autocast regions open now (outermost first), while `install`\\ ed."""

    def __init__(self) -> None:
        self.stack: list[dict[str, Any]] = []

    def install(self) -> None:
        if not _TAPS:
            _AUTOCAST.__init__, _AUTOCAST.__enter__, _AUTOCAST.__exit__ = _init, _enter, _exit
        _TAPS.append(self)

    def remove(self) -> None:
        if self in _TAPS:
            _TAPS.remove(self)
        if not _TAPS:
            for name, fn in _ORIG.items():
                setattr(_AUTOCAST, name, fn)


def device_type(model: nn.Module) -> str | None:
    p = next(model.parameters(), None)
    return p.device.type if p is not None else None


def autocast_finding(
    role: str, model: nn.Module, regions: list[dict[str, Any]], where: dict
) -> Finding | None:
    """The innermost open region the user asked for that does nothing for ``model``'s forward: on
    another device type than its tensors' (with none open on theirs), or switched off by torch."""
    dev = device_type(model)
    if dev is None or not regions:
        return None
    if any(r["device"] == dev and r["enabled"] for r in regions):
        return None  # an autocast is active where the tensors are
    dead = [r for r in regions if r["asked"] and (r["device"] != dev or not r["enabled"])]
    if not dead:
        return None
    r = dead[-1]
    line = r["line"] or "an unknown line"
    why = (
        f"it applies to {r['device']} tensors and the {role}'s are on {dev}"
        if r["device"] != dev
        else f"torch switched it off ({dev} autocast does not support {r['dtype']} here)"
    )
    if r["device"] != dev and not r["enabled"]:
        why += f" (and torch disabled it: no {r['device']} device is available)"
    pdt = dn(next(model.parameters()).dtype)
    return Finding(
        severity="warning",
        kind=K.LOOP_AUTOCAST_INACTIVE,
        message=f"torch.autocast(device_type={r['device']!r}, dtype={r['dtype']}) at {line} does nothing for the "
        f"{role}'s forward: {why}, so its matmuls run in {pdt}, not {r['dtype']}",
        role=role,
        where=f"autocast at {line}",
        observed={"region": {k: v for k, v in r.items() if k != "id"}, "tensors_on": dev, "param_dtype": pdt},
        expected=f"an enabled autocast on {dev}",
        fix=f"at {line}: torch.autocast(device_type={dev!r}, dtype=torch.{_torch_name(r['dtype'])}) -- the "
        "device type of the model's tensors (next(model.parameters()).device.type), not a fixed 'cuda'",
        **where,
    )


def _torch_name(dtype: str | None) -> str:
    return {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}.get(dtype or "", str(dtype))


_ORIG_APPLY = nn.Module._apply
_CAST_TAPS: dict[int, CastTap] = {}
"""id(model) -> the tap of a watched model; ``nn.Module._apply`` is wrapped while this is not empty."""


def _apply(self: nn.Module, fn: Any, *args: Any, **kwargs: Any) -> Any:
    tap = _CAST_TAPS.get(id(self))
    if tap is None or tap.model is not self:
        return _ORIG_APPLY(self, fn, *args, **kwargs)
    before = main_dtype(self)
    out = _ORIG_APPLY(self, fn, *args, **kwargs)
    after = main_dtype(self)
    if before is not None and after is not None and before != after:
        tap.on_cast(before, after, user_frame(depth=2))
    return out


class CastTap:
    """Calls ``on_cast(before, after, line)`` when a ``.to(dtype)`` / ``.float()`` / ``.half()`` /
    ``.bfloat16()`` of the whole ``model`` changes the dtype most of its parameters are in. It wraps
    ``nn.Module._apply`` on the class while a tap is open (`remove` undoes it) and acts only on the
    watched model itself, so a ``copy.deepcopy(model)`` cast for generation is not the model."""

    def __init__(
        self, model: nn.Module, on_cast: Callable[[torch.dtype, torch.dtype, str | None], None]
    ) -> None:
        self.model, self.on_cast = model, on_cast
        if not _CAST_TAPS:
            nn.Module._apply = _apply  # type: ignore[method-assign]
        _CAST_TAPS[id(model)] = self

    def remove(self) -> None:
        if _CAST_TAPS.get(id(self.model)) is self:
            del _CAST_TAPS[id(self.model)]
        if not _CAST_TAPS:
            nn.Module._apply = _ORIG_APPLY  # type: ignore[method-assign]


class Hook:
    """A module hook that a ``copy.deepcopy`` or a pickle of the hooked model drops (the copy gets a
    hook that does nothing): the watch it calls holds files and locks, and is about the original."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn

    def __call__(self, *args: Any) -> Any:
        return self.fn(*args)

    def __deepcopy__(self, memo: dict) -> Callable[..., None]:
        return inert

    def __reduce__(self) -> Any:
        return (_inert, ())


def inert(*args: Any) -> None:
    """What a copied model's watch hook does: nothing."""


def _inert() -> Callable[..., None]:
    return inert


def exact_share(model: nn.Module, low: torch.dtype) -> float:
    """The share of ``model``'s floating parameter values that ``low`` holds exactly (an fp32 model's
    random or trained values: about 2**-16 of them for bf16; after a rounding to bf16: all)."""
    with torch.no_grad():
        exact = total = 0
        for p in model.parameters():
            if p.is_floating_point():
                exact += int((p == p.to(low).to(p.dtype)).sum())
                total += p.numel()
    return exact / total if total else 0.0


def round_trip_finding(
    role: str,
    model: nn.Module,
    down: tuple[torch.dtype, torch.dtype, str | None],
    up: tuple[torch.dtype, torch.dtype, str | None],
    *,
    updates_before: int,
    where: dict,
) -> Finding:
    """A cast of ``model`` from its contract dtype down to a lower one (``down``: from, to, line) and back
    up (``up``): the weights the optimizer keeps in the high dtype were rounded to the low one."""
    high, low = dn(down[0]), dn(down[1])
    share = exact_share(model, down[1])
    erased = (
        f"; {updates_before} optimizer step(s) of the {role} ran before it, so every update smaller than "
        f"{low}'s spacing since the last rounding is erased"
        if updates_before
        else ""
    )
    return Finding(
        severity="error" if updates_before else "warning",
        kind=K.LOOP_WEIGHT_ROUND_TRIP,
        message=f"your loop cast the {role}'s {high} weights to {low} at {down[2]} and back to {high} at {up[2]}: "
        f"the round trip rounded the {high} master weights to {low} ({share:.1%} of their values are "
        f"{low}-exact after it){erased}",
        role=role,
        where=f"cast of the {role} at {down[2]}",
        observed={
            "down": [high, low, down[2]],
            "up": [dn(up[0]), dn(up[1]), up[2]],
            "low_exact_share": share,
            "optimizer_steps_before": updates_before,
        },  # fmt: skip
        expected=f"{high} weights that are never rounded to {low}",
        fix=f"at {down[2]}: do not cast the model you train; generate with a separate {low} copy "
        f"(copy.deepcopy(model).to(torch.{_torch_name(low)}), refreshed from the {high} weights after each "
        f"update) or under torch.autocast(dtype=torch.{_torch_name(low)}), keeping the {high} master weights",
        **where,
    )


def unscaled_step_finding(role: str, line: str | None, where: dict) -> Finding:
    """``scaler.step(optimizer)`` with no ``scaler.scale(loss)`` since the scaler's last update."""
    return Finding(
        severity="error",
        kind=K.LOOP_UNSCALED_BACKWARD,
        message=f"scaler.step at {line} for the {role}'s optimizer with no scaler.scale(loss) since the last "
        "update: the backward ran on the unscaled loss, so the GradScaler has no scale for the step (fp16 "
        "gradients below 6e-8 are already lost, and the scaler records no inf check)",
        role=role,
        where=f"GradScaler at {line}",
        observed={"scale_calls_since_update": 0},
        expected="scaler.scale(loss).backward() before scaler.step(optimizer)",
        fix=f"call scaler.scale(loss).backward() instead of loss.backward() before scaler.step(optimizer) "
        f"(at {line})",
        **where,
    )


def bypassed_scaler_finding(role: str, line: str | None, scale: float, where: dict) -> Finding:
    """``optimizer.step()`` called directly after a scaled backward: the gradients carry the scale."""
    return Finding(
        severity="error",
        kind=K.LOOP_SCALER_BYPASSED,
        message=f"optimizer.step() at {line} ran outside scaler.step after scaler.scale(loss).backward(): the "
        f"{role}'s gradients still carry the loss scale ({scale:g}x), so the update is that much too large",
        role=role,
        where=f"GradScaler at {line}",
        observed={"loss_scale": scale},
        expected="scaler.step(optimizer); scaler.update()",
        fix=f"at {line}: scaler.step(optimizer) then scaler.update() instead of optimizer.step() (or "
        "scaler.unscale_(optimizer) before it)",
        **where,
    )


def fp16_no_scaler_finding(role: str, region: dict[str, Any], where: dict) -> Finding:
    """An fp16 autocast forward of a trained model with no enabled GradScaler."""
    line = region["line"] or "an unknown line"
    return Finding(
        severity="warning",
        kind=K.LOOP_FP16_NO_SCALER,
        message=f"the {role}'s forward runs under fp16 autocast (at {line}) and no enabled GradScaler is "
        "watched: fp16 gradients below 6e-8 flush to zero and overflows are not skipped",
        role=role,
        where=f"autocast at {line}",
        observed={"region": {k: v for k, v in region.items() if k != "id"}, "grad_scaler": None},
        expected="torch.amp.GradScaler with fp16 autocast",
        fix="scaler = torch.amp.GradScaler(device); scaler.scale(loss).backward(); scaler.step(opt); "
        "scaler.update() (pass scaler= to verlaudit.watch), or autocast in bf16",
        **where,
    )


def output_tensor(output: Any) -> torch.Tensor | None:
    """The floating tensor a forward returned (a tensor, or a model output's ``logits``), else None."""
    t = output if isinstance(output, torch.Tensor) else getattr(output, "logits", None)
    if t is None and isinstance(output, (tuple, list)) and output:
        t = output[0]
    return t if isinstance(t, torch.Tensor) and t.is_floating_point() else None


def below_contract_finding(
    role: str, model: nn.Module, output: Any, compute: torch.dtype, store: torch.dtype, where: dict
) -> Finding | None:
    """A forward whose weights are the contract's but whose output is narrower than its compute dtype:
    an autocast (or a cast inside the model) the contract does not declare ran it in a lower dtype."""
    out = output_tensor(output)
    p = next(model.parameters(), None)
    if out is None or p is None or p.dtype != store or not out.dtype.is_floating_point:
        return None
    if torch.finfo(out.dtype).bits >= torch.finfo(compute).bits:
        return None
    line = user_frame(depth=3)
    return Finding(
        severity="warning",
        kind=K.LOOP_COMPUTE_BELOW_CONTRACT,
        message=f"the {role}'s forward at {line} returned {dn(out.dtype)} while the contract computes it in "
        f"{dn(compute)} (weights {dn(store)}): an autocast or cast the contract does not declare",
        role=role,
        where=f"forward of the {role} at {line}",
        observed={"output_dtype": dn(out.dtype), "param_dtype": dn(store)},
        expected=dn(compute),
        fix=f"at {line}: run the forward without the {dn(out.dtype)} autocast, or declare it: "
        f"verlaudit.watch(..., precision='{dn(out.dtype)}')",
        **where,
    )


def no_grads_finding(role: str, line: str | None, where: dict, *, cleared: str | None = None) -> Finding:
    """An optimizer step none of whose parameters has a gradient (``cleared``: the line of a zero_grad
    that ran after a backward had reached them: that backward was thrown away, an error)."""
    if cleared is not None:
        why = (
            f"optimizer.zero_grad() at {cleared} ran after loss.backward() had filled them and before this "
            "step, so the step applies no update and the policy never changes"
        )
    else:
        why = "zero_grad() ran between backward() and step(), or the backward never reached them"
    return Finding(
        severity="error" if cleared is not None else "warning",
        kind=K.LOOP_STEP_WITHOUT_GRADS,
        message=f"the {role}'s optimizer stepped at {line} with no gradient on any of its parameters: {why}",
        role=role,
        where=f"optimizer step at {line}",
        observed={"params_with_grad": 0, "zero_grad_after_backward": cleared},
        expected="gradients from this step's backward",
        fix=(f"move optimizer.zero_grad() at {cleared} before loss.backward(): " if cleared else "")
        + "order each step as opt.zero_grad(); loss.backward(); opt.step() (zero_grad before the backward)",
        **where,
    )


def has_no_grads(optimizer: Any) -> bool:
    """Whether none of ``optimizer``'s parameters holds a gradient."""
    params = [p for g in getattr(optimizer, "param_groups", ()) for p in g.get("params", ())]
    return bool(params) and all(p.grad is None for p in params)


def all_grads_zero(optimizer: Any) -> bool:
    """Whether every gradient ``optimizer``'s parameters hold is exactly zero (``zero_grad(set_to_none=False)``)."""
    grads = [
        p.grad
        for g in getattr(optimizer, "param_groups", ())
        for p in g.get("params", ())
        if p.grad is not None
    ]
    return all(not bool(g.any()) for g in grads)
