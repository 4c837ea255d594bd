"""Is an own loop's optimizer step the update of its loss? Two invariants, measured in place.

`verlaudit.watch` hears every optimizer step (pre- and post-hooks) and, through `verlaudit.integrations.
loop_calls`, every ``clip_grad_norm_`` / ``clip_grad_value_``, ``backward`` and ``zero_grad``. `UpdateAudit`
reads them against what a correct step is, whatever the loop's wording:

* **The step uses the processed gradients.** Whatever a loop does to its gradients (unscale, clip,
  scale, mask) must happen between the backward and the step: the order is backward ... unscale ... clip
  ... step ... zero_grad. At each audited step the gradients the step used are fingerprinted just after
  it (each tensor's norm, exact); when the gradients are next cleared (``zero_grad``), added to (the next
  ``backward``) or stepped on, the fingerprint is read again. If it changed, code between the step and
  that moment changed gradients the step had already applied: a clip after ``optimizer.step()`` bounds
  nothing. A clip seen by the tap in that interval is named with its line; any other change (an in-place
  ``p.grad.mul_``) with the step's line. A clip that changed nothing there (the norm below its limit) is
  still out of order, and said so. The other way round, a clip followed by a ``backward`` before the step
  (clip, backward, step) leaves the step with gradients the clip never saw; and a step with no backward
  since the last one, on gradients not cleared, applies the same update twice (a step with a closure,
  LBFGS, computes its own and is left alone).
* **Every trained parameter is in the optimizer, every optimizer tensor in the model.** At each step,
  a trainable parameter of the watched model that holds a non-zero gradient but is in no watched
  optimizer gets gradients and never changes (a head replaced, or a module added, after the optimizer
  was built): an error naming the modules. Tensors an optimizer holds that no watched model has and that
  get no gradient are the replaced modules' old tensors: named with it (alone, a warning).

Every check compares the loop with itself (the same tensors before and after), never with a threshold,
so a correct loop (plain, accumulated, GradScaler, clipped before the step, LoRA) stays clean. The
fingerprint costs one norm per gradient tensor twice per audited step, for the first `AUDITED_STEPS`
steps of each role. Exercised by `pytest tests/test_loop_update.py`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from verlaudit import kinds as K
from verlaudit.integrations.loop_calls import at_line as _at
from verlaudit.rundir import Finding

AUDITED_STEPS = 3
"""Optimizer steps per role whose gradients are fingerprinted (the order is the loop's, the same each step)."""


def _norms(params: list[torch.Tensor]) -> tuple[list[torch.Tensor], torch.Tensor]:
    """The parameters that hold a gradient, and each gradient's norm (float64, exact for a fingerprint)."""
    held = [p for p in params if p.grad is not None]
    if not held:
        return held, torch.zeros(0, dtype=torch.float64)
    norms = torch.empty(len(held), dtype=torch.float64)
    by_device: dict[torch.device, list[int]] = {}
    for k, p in enumerate(held):
        by_device.setdefault(p.grad.device, []).append(k)
    with torch.no_grad():
        for ks in by_device.values():  # one transfer per device, not per tensor
            norms[ks] = torch.stack([held[k].grad.detach().double().norm() for k in ks]).cpu()
    return held, norms


def _module_of(name: str) -> str:
    return name.rsplit(".", 1)[0] if "." in name else name


class UpdateAudit:
    """The update checks of one watch (a `loop_calls` listener). ``add(finding)`` records; ``where()``
    gives the step and phase."""

    def __init__(
        self,
        models: Mapping[str, torch.nn.Module],
        optimizers: Mapping[str, Any],
        *,
        add: Callable[[Finding | None], None],
        where: Callable[[], dict],
    ) -> None:
        self.models, self.optimizers = dict(models), dict(optimizers)
        self.add, self.where = add, where
        self.steps: dict[str, int] = {}
        self._audited: dict[str, int] = {}
        """role -> steps whose gradients were fingerprinted."""
        self._print: dict[str, tuple[list[torch.Tensor], torch.Tensor, str | None]] = {}
        """role -> (params, their gradients' norms just after the step, the step's line)."""
        self._clips: dict[str, tuple[str, Any, str | None]] = {}
        """role -> (clip function, limit, line) of a clip after its step, before the next backward."""
        self._quiet: dict[str, tuple] = {}
        """role -> the arguments of a clip-after-step finding whose clip changed nothing (said at the end
        unless a later one changes the gradients)."""
        self._reported: set[tuple[str, str]] = set()
        self._stale: dict[str, tuple] = {}
        """role -> the optimizer's tensors no model has (first seen), said at the end if alone."""
        self.backwards = 0
        """``backward()`` calls so far (a clip must follow the last one before its step)."""
        self._last_step: dict[str, tuple[str | None, int]] = {}
        """role -> (line, backwards before it) of its last optimizer step."""
        self._cleared: set[str] = set()
        """Roles whose gradients a zero_grad cleared since their last step."""
        self._last_clip: dict[str, tuple[str, Any, str | None, int]] = {}
        """role -> (function, limit, line, backwards before it) of the last clip since its last step."""

    def _opt_params(self, role: str) -> list[torch.Tensor]:
        return [p for g in self.optimizers[role].param_groups for p in g["params"]]

    # -- the watch's optimizer hooks ------------------------------------------------------------
    def before_step(self, role: str, line: str | None, closure: bool = False) -> None:
        """At ``role``'s optimizer step (pre-hook): gradients changed since the last step (never
        cleared), a step again on the gradients the last one applied, a clip that a backward followed,
        and the optimizer's membership. ``closure``: the step computes its own gradients (LBFGS)."""
        entry = self._print.get(role)
        self._compare(role, f"optimizer.step() at {_at(line)}")
        last = self._last_step.get(role)
        if (
            not closure
            and entry is not None
            and last is not None
            and last[1] == self.backwards
            and (role, K.LOOP_STEP_REPEATED) not in self._reported
        ):
            params, norms, _ = entry
            held = [k for k, p in enumerate(params) if p.grad is not None]
            if held and bool((_norms([params[k] for k in held])[1] > 0).any()):
                self._reported.add((role, K.LOOP_STEP_REPEATED))
                self.add(_repeated_finding(role, last[0], line, self.where()))
        clip = self._last_clip.pop(role, None)
        done = {(role, K.LOOP_GRADS_AFTER_STEP), (role, K.LOOP_CLIP_BEFORE_BACKWARD)} & self._reported
        if clip is not None and self.backwards > clip[3] and not done:
            self._reported.add((role, K.LOOP_CLIP_BEFORE_BACKWARD))
            self.add(_clip_before_backward_finding(role, clip, self.backwards - clip[3], line, self.where()))
        if (role, K.LOOP_PARAMS_OUTSIDE_OPTIMIZER) not in self._reported:
            self.add(self._membership(role, line))

    def after_step(self, role: str, line: str | None) -> None:
        self.steps[role] = self.steps.get(role, 0) + 1
        self._last_clip.pop(role, None)
        self._last_step[role] = (line, self.backwards)
        self._cleared.discard(role)
        self._print.pop(role, None)
        if self._audited.get(role, 0) >= AUDITED_STEPS or (role, K.LOOP_GRADS_AFTER_STEP) in self._reported:
            return
        params, norms = _norms(self._opt_params(role))
        if params:
            self._print[role] = (params, norms, line)
            if bool((norms > 0).any()):  # a step with gradients (a zero one tells nothing of a clip)
                self._audited[role] = self._audited.get(role, 0) + 1

    def finish(self) -> None:
        for role in list(self._print):
            self._compare(role, "the end of the watched block")
        for role, (stale, total, line, where) in self._stale.items():
            if (role, K.LOOP_PARAMS_OUTSIDE_OPTIMIZER) not in self._reported:
                self.add(_stale_finding(role, stale, total, line, where))
        for role, args in self._quiet.items():
            if (role, K.LOOP_GRADS_AFTER_STEP) not in self._reported:
                self._reported.add((role, K.LOOP_GRADS_AFTER_STEP))
                self.add(_after_step_finding(role, *args))

    # -- `loop_calls` ------------------------------------------------------------------------------
    def on_clip(self, name: str, params: list[torch.Tensor], limit: Any, line: str | None) -> None:
        ids = {id(p) for p in params if isinstance(p, torch.Tensor)}
        for role in self.optimizers:
            if not ids & {id(p) for p in self._opt_params(role)}:
                continue
            if role in self._print:  # between its step and the next clearing: after the step
                self._clips.setdefault(role, (name, limit, line))
            elif role not in self.steps or role in self._cleared:  # on cleared gradients, before the backward
                self._last_clip[role] = (name, limit, line, self.backwards)

    def on_backward(self, loss: torch.Tensor, line: str | None) -> None:
        self.backwards += 1
        for role in list(self._print):
            self._compare(role, f"the next backward() at {_at(line)}")

    def on_zero_grad(self, owner: Any, line: str | None) -> None:
        for role in self.optimizers:
            if owner is self.optimizers[role] or owner is self.models.get(role):
                self._cleared.add(role)
                if role in self._print:
                    self._compare(role, f"zero_grad() at {_at(line)}")

    def on_scheduler_step(self, scheduler: Any, line: str | None) -> None:
        """Not read here (`loop_protocol` checks the scheduler's cadence)."""

    def on_log_softmax(self, name: str, x: torch.Tensor, out: torch.Tensor, line: str | None) -> None:
        """Not read here (`loop_protocol` checks the log-probs' dtype)."""

    # -- the checks ---------------------------------------------------------------------------------
    def _compare(self, role: str, until: str) -> None:
        """The gradients of ``role`` now against their fingerprint just after its last step."""
        entry = self._print.pop(role, None)
        clip = self._clips.pop(role, None)
        if entry is None or (role, K.LOOP_GRADS_AFTER_STEP) in self._reported:
            return
        params, before, step_line = entry
        keep = [k for k, p in enumerate(params) if p.grad is not None]  # set to None: cleared, not changed
        if not keep:
            if clip is None:
                return
            changed, n_before, n_after = 0, float(before.norm()), 0.0
        else:
            _, now = _norms([params[k] for k in keep])
            was = before[keep]
            changed = int(((now != was) & (now > 0)).sum())  # zeroed in place is cleared, not changed
            n_before, n_after = float(was.norm()), float(now.norm())
        if not changed and clip is None:
            return
        args = (step_line, until, clip, changed, len(params), n_before, n_after, self.where())
        if not changed:
            self._quiet.setdefault(role, args)
            return
        self._reported.add((role, K.LOOP_GRADS_AFTER_STEP))
        self.add(_after_step_finding(role, *args))

    def _membership(self, role: str, line: str | None) -> Finding | None:
        held = {id(p) for opt in self.optimizers.values() for g in opt.param_groups for p in g["params"]}
        in_models = {id(p) for m in self.models.values() for p in m.parameters()}
        if not any(id(p) in held for p in self.models[role].parameters()):
            return None  # an optimizer of another model altogether: `loop_protocol` said so at entry
        outside = []
        with torch.no_grad():
            for name, p in self.models[role].named_parameters():
                if p.requires_grad and id(p) not in held and p.grad is not None and bool(p.grad.any()):
                    outside.append((name, p))
        stale = [p for p in self._opt_params(role) if id(p) not in in_models and p.grad is None]
        if outside:
            self._reported.add((role, K.LOOP_PARAMS_OUTSIDE_OPTIMIZER))
            trainable = [p for p in self.models[role].parameters() if p.requires_grad]
            return _outside_finding(
                role, outside, trainable, stale, line, self.steps.get(role, 0), self.where()
            )
        if stale and any(p.grad is not None for p in self._opt_params(role)):
            # said at the end unless a parameter outside the optimizer (the replacement) is found by then
            self._stale.setdefault(role, (stale, len(self._opt_params(role)), line, self.where()))
        return None


# ---------------------------------------------------------------- the findings


def _after_step_finding(
    role: str,
    step_line: str | None,
    until: str,
    clip: tuple[str, Any, str | None] | None,
    changed: int,
    total: int,
    n_before: float,
    n_after: float,
    where: dict,
) -> Finding:
    if clip is not None:
        name, limit, line = clip
        lim = f"{float(limit):g}" if isinstance(limit, (int, float)) else "its limit"
        what = (
            f"{name}({lim}) at {_at(line)} ran after the {role}'s optimizer.step() at {_at(step_line)}: the step "
            f"had already applied the unclipped gradients (norm {n_before:.3g})"
            + (
                f", and the clipped ones (norm {n_after:.3g}) are thrown away at {until} before any step uses "
                "them -- the clip bounds no update"
                if changed
                else f"; this time the clip changed nothing (the norm was within {lim}), but placed after the "
                "step it can never bound an update"
            )
        )
        return Finding(
            severity="error" if changed else "warning",
            kind=K.LOOP_GRADS_AFTER_STEP,
            message=f"gradient clipping out of order: {what}",
            role=role,
            where=f"{name} at {_at(line)} (after optimizer.step)",
            observed={
                "step_line": step_line,
                "clip_line": line,
                "grad_norm_at_step": n_before,
                "grad_norm_after_clip": n_after,
                "tensors_changed": changed,
                "tensors": total,
            },
            expected="backward -> (scaler.unscale_) -> clip -> optimizer.step -> zero_grad",
            fix=f"at {_at(line)}: clip before the step -- call torch.nn.utils.{name}(...) between loss.backward() "
            f"and optimizer.step() (at {_at(step_line)}); the order is backward, scaler.unscale_(opt) under a "
            "GradScaler, clip, step, zero_grad",
            **where,
        )
    return Finding(
        severity="error",
        kind=K.LOOP_GRADS_AFTER_STEP,
        message=f"the {role}'s gradients changed after the optimizer step that used them: {changed} of {total} "
        f"gradient tensors differ between optimizer.step() at {_at(step_line)} and {until} (norm {n_before:.3g} "
        f"-> {n_after:.3g}); code after the step processed gradients the step had already applied (a clip, a "
        "scaling or a mask in the wrong order), so no update sees it",
        role=role,
        where=f"gradients after optimizer.step at {_at(step_line)}",
        observed={
            "tensors_changed": changed,
            "tensors": total,
            "norm_at_step": n_before,
            "norm_after": n_after,
        },
        expected="gradients unchanged from the step until they are cleared",
        fix=f"move the gradient processing before optimizer.step() at {_at(step_line)}: the order is backward, "
        "unscale, clip / scale / mask, step, zero_grad",
        **where,
    )


def _repeated_finding(role: str, prev: str | None, line: str | None, where: dict) -> Finding:
    return Finding(
        severity="error",
        kind=K.LOOP_STEP_REPEATED,
        message=f"the {role}'s optimizer.step() at {_at(line)} ran again on the gradients its step at {_at(prev)} had "
        "already applied: no backward() between the two and the gradients were not cleared, so each update is "
        "applied twice (or more) per batch",
        role=role,
        where=f"optimizer step at {_at(line)} (again, no backward since {_at(prev)})",
        observed={"previous_step": prev, "backwards_between": 0},
        expected="one optimizer.step() per backward pass (or per accumulated group of them)",
        fix=f"call optimizer.step() once per update: remove the extra step at {_at(line)} (or put a backward of a "
        "new batch before it); with gradient accumulation, step once after the micro-batches",
        **where,
    )


def _clip_before_backward_finding(
    role: str, clip: tuple[str, Any, str | None, int], after: int, step_line: str | None, where: dict
) -> Finding:
    name, limit, line, _ = clip
    lim = f"{float(limit):g}" if isinstance(limit, (int, float)) else "its limit"
    return Finding(
        severity="error",
        kind=K.LOOP_CLIP_BEFORE_BACKWARD,
        message=f"gradient clipping out of order: {name}({lim}) at {_at(line)} ran before {after} backward() "
        f"call(s) that added to the {role}'s gradients ahead of its optimizer.step() at {_at(step_line)}: the step "
        "applies gradients the clip never saw, so it bounds no update",
        role=role,
        where=f"{name} at {_at(line)} (before the backward)",
        observed={"clip_line": line, "step_line": step_line, "backwards_after_clip": after},
        expected="backward -> (scaler.unscale_) -> clip -> optimizer.step -> zero_grad",
        fix=f"at {_at(line)}: clip after the last loss.backward() of the step and before optimizer.step() (at "
        f"{_at(step_line)}): the order is backward, scaler.unscale_(opt) under a GradScaler, clip, step, zero_grad",
        **where,
    )


def _modules(named: list[tuple[str, torch.Tensor]]) -> str:
    mods: dict[str, int] = {}
    for name, p in named:
        mods[_module_of(name)] = mods.get(_module_of(name), 0) + p.numel()
    return ", ".join(f"{m} ({n:,} values)" for m, n in list(mods.items())[:6]) + (
        f" and {len(mods) - 6} more" if len(mods) > 6 else ""
    )


def _outside_finding(
    role: str,
    outside: list[tuple[str, torch.Tensor]],
    trainable: list[torch.Tensor],
    stale: list[torch.Tensor],
    line: str | None,
    steps: int,
    where: dict,
) -> Finding:
    mods = _modules(outside)
    first = _module_of(outside[0][0])
    share = sum(p.numel() for _, p in outside) / max(1, sum(p.numel() for p in trainable))
    old = (
        f"; the optimizer still holds {len(stale)} tensor(s) the model no longer has (the replaced modules' "
        "old parameters)"
        if stale
        else ""
    )
    return Finding(
        # the optimizer's old tensors prove a replacement; without them leaving some out may be meant (but
        # their gradients still pile up, never cleared by the optimizer's zero_grad)
        severity="error" if stale else "warning",
        kind=K.LOOP_PARAMS_OUTSIDE_OPTIMIZER,
        message=f"trained parameters not in the optimizer: {first} of the {role} has a gradient at the optimizer "
        f"step at {_at(line)} but no param group of any watched optimizer holds it ({len(outside)} tensor(s), "
        f"{share:.1%} of the trainable weights: {mods}): it gets gradients and never updates -- the optimizer "
        f"was built before {first} was replaced or added{old}"
        + ("" if stale else f" (or {first} was left out of it without requires_grad_(False))"),
        role=role,
        where=f"{first} of the {role}, not in its optimizer (step at {_at(line)})",
        observed={
            "parameters": [n for n, _ in outside][:20],
            "tensors": len(outside),
            "share_of_trainable": share,
            "stale_optimizer_tensors": len(stale),
            "optimizer_steps_before": steps,
        },
        expected="every trainable parameter with a gradient in a param group of the optimizer",
        fix=f"build the optimizer after replacing {first} (torch.optim.AdamW(model.parameters(), ...) once the "
        f"model is final), or add it: opt.add_param_group({{'params': model.{first}.parameters()}}); if {first} "
        "is meant to stay frozen, requires_grad_(False) on its param",
        **where,
    )


def _stale_finding(
    role: str, stale: list[torch.Tensor], total: int, line: str | None, where: dict
) -> Finding:
    return Finding(
        severity="warning",
        kind=K.LOOP_OPTIMIZER_STALE_PARAMS,
        message=f"the {role}'s optimizer holds {len(stale)} of its {total} tensors that no watched model has and "
        f"that get no gradient (step at {_at(line)}): the optimizer was built on modules since replaced, so it "
        "steps tensors nothing uses",
        role=role,
        where=f"optimizer of the {role} (step at {_at(line)})",
        observed={
            "stale_tensors": len(stale),
            "tensors": total,
            "shapes": [list(p.shape) for p in stale][:10],
        },
        expected="an optimizer over the watched model's current parameters",
        fix="build the optimizer after the model's last change of modules (torch.optim.AdamW(model.parameters(), "
        "...) once the model is final)",
        **where,
    )
