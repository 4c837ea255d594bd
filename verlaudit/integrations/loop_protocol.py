"""What PyTorch's own semantics say a correct loop does between its forward and its optimizer step.

`LoopProtocol` is the `verlaudit.integrations.loop_calls` listener of one `verlaudit.watch`; it also
hears the watch's optimizer, GradScaler and forward hooks. Each check is an order or a count of calls,
exact evidence, never a threshold:

* **the GradScaler's protocol**, per optimizer step: scale -> backward -> ``unscale_`` (once) ->
  clip -> ``step`` -> ``update``. ``clip_grad_norm_`` / ``clip_grad_value_`` on gradients that still
  carry the scale (no ``unscale_`` of their optimizer since the scaled backward) clips the scaled norm,
  so after unscaling every update is the scale times smaller; a ``scaler.step`` on an optimizer the
  scaler already stepped since its last ``update`` (``update()`` never called) fails torch's own check,
  and a run whose scaler stepped without one ``update`` never adjusted its scale.
* **the cadence**: an LR scheduler stepped more than once per optimizer step (per micro-batch of a
  gradient accumulation) runs its schedule that many times faster than configured; ``zero_grad``
  after a backward that reached the parameters and before their step throws that backward away.
* **the graph**: ``backward()`` on a loss that has no autograd graph (the log-probs it is built from
  came from a forward under ``no_grad``, the rollout's, or were detached), named with the forwards
  that did or did not run with gradients since the last step.
* **the precision of what the loop computes**: a log-softmax / logsumexp the user's code ran on
  fp16/bf16 values, giving fp16/bf16 log-probs, where the contract keeps log-probs in fp32.

Findings are returned to the watch, which records them. Exercised by `pytest tests/test_loop_protocol.py`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from verlaudit import kinds as K
from verlaudit.dtypes import dtype_name as dn
from verlaudit.integrations import loop_calls
from verlaudit.integrations.loop_calls import at_line as _at
from verlaudit.rundir import Finding

_READY, _UNSCALED, _STEPPED = 0, 1, 2
"""torch.amp.grad_scaler.OptState's values."""


def scaler_stage(scaler: Any, optimizer: Any) -> int:
    """Where ``optimizer`` is in ``scaler``'s per-step protocol: 0 ready, 1 unscaled, 2 stepped."""
    state = getattr(scaler, "_per_optimizer_states", {}).get(id(optimizer)) or {}
    stage = state.get("stage")
    return int(getattr(stage, "value", stage)) if stage is not None else _READY


class LoopProtocol:
    """The protocol checks of one watch: ``optimizers`` role -> optimizer, ``scaler`` (or None),
    ``policy()`` the contract now, ``add(finding)`` records, ``where()`` the step and phase."""

    def __init__(
        self,
        models: Mapping[str, torch.nn.Module],
        optimizers: Mapping[str, Any],
        scaler: Any,
        *,
        policy: Callable[[], Any],
        add: Callable[[Finding | None], None],
        where: Callable[[], dict],
    ) -> None:
        self.models, self.optimizers, self.scaler = dict(models), dict(optimizers), scaler
        self.policy, self.add, self.where = policy, add, where
        self._params = {
            role: {id(p) for g in opt.param_groups for p in g["params"]}
            for role, opt in self.optimizers.items()
        }
        self._role_of_opt = {id(opt): role for role, opt in self.optimizers.items()}
        self.reached: dict[str, int] = {}
        """role -> backward passes that reached its parameters since its last optimizer step."""
        self.backwards = 0
        """``backward()`` calls since the last optimizer step (of any role): the micro-batches."""
        self.grad_forwards: dict[str, int] = {}
        """role -> forwards run with gradients enabled since its last optimizer step."""
        self.cleared: dict[str, str | None] = {}
        self.discarded: dict[str, int] = {}
        """role -> backward passes since its last step that a zero_grad threw away."""
        """role -> the line of a zero_grad that ran after a backward reached it, before its step."""
        self._sched: dict[int, list[Any]] = {}
        """id(scheduler) -> [role, calls since the role's last optimizer step, line]."""
        self.steps: dict[str, int] = {}
        self._scaler_steps: dict[int, str | None] = {}
        """id(optimizer) -> the line of its scaler.step since the last update."""
        self.scaler_steps = self.scaler_updates = 0
        self.loss_line: str | None = None
        self.depth = 0
        """Watched forwards open now: a log-softmax inside one is the model's, not the loop's."""
        """The line of the last ``backward()`` (the loss the direction probe names)."""
        self.accumulated: dict[str, bool] = {}
        """role -> the first backward since its last step found last step's gradients still there."""
        self._checked: set[str] = set()
        self._handles: list[Any] = []
        for role in self.optimizers:
            for p in self.models[role].parameters():
                if p.requires_grad and hasattr(p, "register_post_accumulate_grad_hook"):
                    self._handles.append(p.register_post_accumulate_grad_hook(self._reach(role)))
                    if id(p) in self._params[role]:  # one outside it is `loop_update`'s (never cleared by it)
                        self._handles.append(p.register_hook(self._incoming(role, p)))

    def _incoming(self, role: str, p: torch.Tensor) -> Callable[[torch.Tensor], None]:
        """A tensor hook (before the gradient is accumulated into ``p.grad``): the first of each step
        interval reads whether ``p.grad`` still holds a non-zero gradient from before the last step."""

        def hook(grad: torch.Tensor) -> None:
            if role in self._checked or not self.steps.get(role) or loop_calls.GRAD_DEPTH[0]:
                return  # a torch.autograd.grad returns its gradients: nothing is added to p.grad
            self._checked.add(role)
            g = p.grad
            if g is not None and bool(g.detach().any()):
                self.accumulated[role] = True

        return hook

    def _reach(self, role: str) -> Callable[[torch.Tensor], None]:
        def hook(p: torch.Tensor) -> None:
            self.reached[role] = self.reached.get(role, 0) + 1

        return hook

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    # -- the watch's own hooks --------------------------------------------------------------------
    def on_forward(self, role: str) -> None:
        if torch.is_grad_enabled():
            self.grad_forwards[role] = self.grad_forwards.get(role, 0) + 1

    def on_zero_grad(self, owner: Any, line: str | None) -> None:
        """``zero_grad`` of a watched optimizer or trained model (`loop_calls`)."""
        role = self._role_of_opt.get(id(owner))
        if role is None:
            role = next((r for r in self.optimizers if self.models.get(r) is owner), None)
        if role is not None:
            self.zero_grad(role, line)

    def zero_grad(self, role: str, line: str | None) -> None:
        """``optimizer.zero_grad()`` of ``role``: after a backward that reached it, before its step."""
        opt = self.optimizers[role]
        held = any(p.grad is not None for g in opt.param_groups for p in g["params"])
        if self.reached.get(role) and held:
            self.cleared[role] = line
            self.discarded[role] = self.backwards
        self.reached[role] = 0

    def discarded_finding(self, role: str, line: str | None) -> Finding | None:
        """At a step whose gradients are there: a zero_grad since the last step threw away earlier
        micro-batches' backward passes (zero_grad inside the gradient-accumulation loop)."""
        cleared, lost = self.cleared.get(role), self.discarded.get(role, 0)
        if cleared is None or not lost:
            return None
        kept = max(self.backwards - lost, 0)
        return Finding(
            severity="error",
            kind=K.LOOP_ZERO_GRAD_IN_ACCUMULATION,
            message=f"optimizer.zero_grad() at {_at(cleared)} ran after {lost} backward pass(es) had filled the "
            f"{role}'s gradients and before its optimizer step at {_at(line)}: those micro-batches' gradients "
            f"were thrown away, so the step applies only the last {kept} of {self.backwards} micro-batch(es)",
            role=role,
            where=f"zero_grad at {_at(cleared)}",
            observed={"backwards_discarded": lost, "backwards_applied": kept},
            expected="zero_grad once per optimizer step, before its first micro-batch's backward",
            fix=f"at {_at(cleared)}: move optimizer.zero_grad() out of the micro-batch loop, before the first "
            "backward of the optimizer step (or right after the step)",
            **self.where(),
        )

    def setup(self) -> list[Finding]:
        """At the watch's entry: an optimizer that does not hold its model's trainable parameters."""
        out = []
        for role in self.optimizers:
            trainable = [p for p in self.models[role].parameters() if p.requires_grad]
            missing = [p for p in trainable if id(p) not in self._params[role]]
            if trainable and missing:
                out.append(_optimizer_params_finding(role, trainable, missing, self.where()))
        return out

    def holds_none(self, role: str) -> bool:
        """Whether ``role``'s optimizer holds none of its model's parameters."""
        return not any(id(p) in self._params[role] for p in self.models[role].parameters())

    def before_step(self, role: str, line: str | None) -> list[Finding]:
        """At ``role``'s optimizer step (pre-hook): gradients left from the last step, the scheduler's
        cadence since it."""
        out = []
        if self.accumulated.get(role):
            out.append(_accumulated_finding(role, line, self.steps.get(role, 0), self.where()))
        calls = [(s, n, ln) for s, (r, n, ln) in self._sched.items() if r == role and n > 1]
        if not calls:
            return out
        _, n, sched_line = max(calls, key=lambda c: c[1])
        lr = float(self.optimizers[role].param_groups[0].get("lr", float("nan")))
        out.append(
            _scheduler_finding(
                role, n, self.backwards, sched_line, line, lr, self.steps.get(role, 0), self.where()
            )
        )
        return out

    def after_step(self, role: str) -> None:
        self.steps[role] = self.steps.get(role, 0) + 1
        self.reached[role] = 0
        self.grad_forwards[role] = 0
        self.cleared.pop(role, None)
        self.discarded.pop(role, None)
        self.accumulated.pop(role, None)
        self._checked.discard(role)
        self.backwards = 0
        for entry in self._sched.values():
            if entry[0] == role:
                entry[1] = 0

    def cleared_line(self, role: str) -> str | None:
        return self.cleared.get(role)

    def scaler_step(self, optimizer: Any, line: str | None) -> Finding | None:
        """``scaler.step(optimizer)``: one the scaler already stepped since its last update."""
        self.scaler_steps += 1
        role = self._role_of_opt.get(id(optimizer))
        prev = self._scaler_steps.get(id(optimizer), "")
        self._scaler_steps[id(optimizer)] = line
        if role is None or scaler_stage(self.scaler, optimizer) != _STEPPED:
            return None
        return _not_updated_finding(role, prev, line, float(self.scaler.get_scale()), self.where())

    def scaler_unscale(self, optimizer: Any, line: str | None) -> Finding | None:
        """``scaler.unscale_(optimizer)``: a second one since the last update, or one after the step."""
        role = self._role_of_opt.get(id(optimizer))
        stage = scaler_stage(self.scaler, optimizer)
        if role is None or stage == _READY:
            return None
        if stage == _STEPPED:
            prev = self._scaler_steps.get(id(optimizer))
            return _not_updated_finding(role, prev, line, float(self.scaler.get_scale()), self.where())
        return _unscale_twice_finding(role, line, float(self.scaler.get_scale()), self.where())

    def scaler_update(self) -> None:
        self.scaler_updates += 1
        self._scaler_steps.clear()

    def finish(self) -> Finding | None:
        """At the watch's exit: a scaler that stepped and was never updated."""
        if (
            self.scaler is None
            or not self.scaler.is_enabled()
            or not self.scaler_steps
            or self.scaler_updates
        ):
            return None
        role = next(iter(self.optimizers), "actor")
        line = next(iter(self._scaler_steps.values()), None)
        return _not_updated_finding(role, line, None, float(self.scaler.get_scale()), self.where())

    # -- `loop_calls` ------------------------------------------------------------------------------
    def on_clip(self, name: str, params: list[torch.Tensor], limit: Any, line: str | None) -> None:
        sc = self.scaler
        if sc is None or not sc.is_enabled():
            return
        ids = {id(p) for p in params if isinstance(p, torch.Tensor) and p.grad is not None}
        for role, opt in self.optimizers.items():
            if not ids & self._params[role] or scaler_stage(sc, opt) != _READY or not self.reached.get(role):
                continue
            self.add(_clip_finding(role, name, limit, float(sc.get_scale()), line, self.where()))

    def on_scheduler_step(self, scheduler: Any, line: str | None) -> None:
        role = self._role_of_opt.get(id(getattr(scheduler, "optimizer", None)))
        if role is None:
            return
        entry = self._sched.setdefault(id(scheduler), [role, 0, line])
        entry[1] += 1
        entry[2] = line

    def on_backward(self, loss: torch.Tensor, line: str | None) -> None:
        self.backwards += 1
        self.loss_line = line
        if loss.requires_grad or not self.optimizers:
            return
        role = next(iter(self.optimizers))
        self.add(_no_graph_finding(role, loss, line, self.grad_forwards.get(role, 0), self.where()))

    def on_log_softmax(self, name: str, x: torch.Tensor, out: torch.Tensor, line: str | None) -> None:
        if self.depth:
            return
        policy = self.policy()
        role = "actor" if "actor" in self.models else next(iter(self.models))
        rp = policy.roles.get(role) if policy is not None else None
        if rp is None or "logprobs" not in tuple(rp.fp32_islands):
            return
        self.add(_log_softmax_finding(role, name, x, out, line, self.where()))


# ---------------------------------------------------------------- the findings


def _clip_finding(role: str, name: str, limit: Any, scale: float, line: str | None, where: dict) -> Finding:
    lim = f"{float(limit):g}" if isinstance(limit, (int, float)) else "its limit"
    return Finding(
        severity="error",
        kind=K.LOOP_CLIP_SCALED,
        message=f"{name}({lim}) at {_at(line)} clipped the {role}'s gradients while they still carry the "
        f"GradScaler's loss scale ({scale:g}x): no scaler.unscale_(optimizer) before the clip, so it clips "
        f"the scaled norm to {lim} and after the scaler unscales them every update is {scale:g}x smaller "
        "than intended",
        role=role,
        where=f"{name} at {_at(line)}",
        observed={"loss_scale": scale, "limit": limit if isinstance(limit, (int, float)) else None},
        expected="scaler.unscale_(optimizer) before clipping",
        fix=f"at {_at(line)}: call scaler.unscale_(optimizer) before torch.nn.utils.{name}(...), then "
        "scaler.step(optimizer); scaler.update()",
        **where,
    )


def _not_updated_finding(role: str, prev: str | None, line: str | None, scale: float, where: dict) -> Finding:
    again = (
        f"scaler.step at {_at(line)} on the {role}'s optimizer, which the scaler already stepped at "
        f"{_at(prev)} with no scaler.update() since"
        if line is not None
        else f"the GradScaler stepped the {role}'s optimizer (at {_at(prev)}) and scaler.update() was never called"
    )
    return Finding(
        severity="error",
        kind=K.LOOP_SCALER_NOT_UPDATED,
        message=f"{again}: scaler.update() is missing, so the scaler never resets its per-step state (torch "
        f"refuses the next step) and never adjusts its scale (stuck at {scale:g}, overflows never backed off)",
        role=role,
        where=f"GradScaler at {_at(line if line is not None else prev)}",
        observed={"loss_scale": scale, "previous_step": prev},
        expected="scaler.update() after every scaler.step(optimizer)",
        fix=f"call scaler.update() right after scaler.step(optimizer) (at {_at(line or prev)}), once per "
        "optimizer step",
        **where,
    )


def _unscale_twice_finding(role: str, line: str | None, scale: float, where: dict) -> Finding:
    return Finding(
        severity="error",
        kind=K.LOOP_UNSCALE_TWICE,
        message=f"scaler.unscale_ at {_at(line)} on the {role}'s optimizer, whose gradients the GradScaler already "
        f"unscaled since its last update: a second unscale_ would divide them by the scale ({scale:g}) again "
        "(torch refuses it)",
        role=role,
        where=f"GradScaler at {_at(line)}",
        observed={"loss_scale": scale},
        expected="one scaler.unscale_(optimizer) per optimizer step, before clipping",
        fix=f"at {_at(line)}: call scaler.unscale_(optimizer) once per step (after backward, before clipping); "
        "scaler.step(optimizer) skips its own unscale_ then",
        **where,
    )


def _accumulated_finding(role: str, line: str | None, steps: int, where: dict) -> Finding:
    return Finding(
        severity="error",
        kind=K.LOOP_GRADS_NOT_CLEARED,
        message=f"the {role}'s gradients were not cleared after its optimizer step: the first backward before "
        f"optimizer step {steps} at {_at(line)} added to the previous step's gradient (no zero_grad since), so "
        "every step applies the sum of all gradients so far, old batches included",
        role=role,
        where=f"optimizer step at {_at(line)}",
        observed={"nonzero_grad_before_first_backward": True, "optimizer_steps_before": steps},
        expected="gradients cleared (zero_grad) between one optimizer step and the next backward",
        fix=f"call optimizer.zero_grad() once per optimizer step, before the first loss.backward() of the step "
        f"(or right after the optimizer step at {_at(line)})",
        **where,
    )


def _optimizer_params_finding(
    role: str, trainable: list[torch.Tensor], missing: list[torch.Tensor], where: dict
) -> Finding:
    n_all, n_miss = sum(p.numel() for p in trainable), sum(p.numel() for p in missing)
    share = n_miss / n_all if n_all else 0.0
    none = len(missing) == len(trainable)
    return Finding(
        severity="error" if none else "info",  # leaving some out of the optimizer can be a choice
        kind=K.LOOP_OPTIMIZER_PARAMS,
        message=f"the {role}'s optimizer does not hold {len(missing)} of the {len(trainable)} trainable parameter "
        f"tensors of the watched {role} ({share:.0%} of its trainable weights): they get gradients and are "
        + (
            "never updated -- the optimizer was built on other tensors (another model, a copy, or parameters "
            "replaced after it was built)"
            if none
            else "never updated"
        ),
        role=role,
        where=f"optimizer of the {role}",
        observed={
            "missing_tensors": len(missing),
            "trainable_tensors": len(trainable),
            "missing_share": share,
        },
        expected="an optimizer over the watched model's trainable parameters",
        fix=f"build the optimizer from the model you train, after any change to its parameters: "
        f"torch.optim.AdamW({role}.parameters(), ...) (or freeze what it should not train: requires_grad_(False))",
        **where,
    )


def _scheduler_finding(
    role: str,
    calls: int,
    backwards: int,
    sched_line: str | None,
    step_line: str | None,
    lr: float,
    steps: int,
    where: dict,
) -> Finding:
    per = (
        f" (once per micro-batch: {backwards} backward passes per optimizer step)"
        if backwards == calls
        else ""
    )
    zero = (
        f"; the {role}'s lr is already {lr:g} at optimizer step {steps}" if lr == 0 else f" (lr now {lr:g})"
    )
    return Finding(
        severity="error",
        kind=K.LOOP_SCHEDULER_CADENCE,
        message=f"the {role}'s LR scheduler stepped {calls} times (at {_at(sched_line)}) before optimizer step "
        f"{steps} at {_at(step_line)}{per}: its schedule decays {calls}x faster than configured{zero}",
        role=role,
        where=f"scheduler.step at {_at(sched_line)}",
        observed={"scheduler_steps_per_optimizer_step": calls, "backwards": backwards, "lr": lr},
        expected="one scheduler.step() per optimizer step",
        fix=f"at {_at(sched_line)}: call scheduler.step() once per optimizer step, right after opt.step() "
        "(outside the micro-batch / gradient-accumulation loop)",
        **where,
    )


def _no_graph_finding(
    role: str, loss: torch.Tensor, line: str | None, grad_forwards: int, where: dict
) -> Finding:
    if grad_forwards:
        why = (
            f"{grad_forwards} forward(s) of the {role} ran with gradients since its last optimizer step, and the "
            "loss is detached from them (a .detach(), .item() or torch.tensor(...) rebuild, or a no_grad block "
            "between the forward and the loss)"
        )
        fix = (
            f"at {_at(line)}: build the loss from the log-probs of the {role}'s forward without detaching them "
            "(no .detach() / .item() / torch.no_grad between the policy forward and the loss)"
        )
    else:
        why = (
            f"no forward of the {role} ran with gradients since its last optimizer step (only forwards under "
            "torch.no_grad / inference_mode, such as the rollout's generate), so the loss is built from "
            "log-probs that carry no gradient: the rollout's, not the policy's"
        )
        fix = (
            f"at {_at(line)}: recompute the log-probs with a forward of the policy under gradients "
            "(logits = model(input_ids=seq, attention_mask=mask).logits, then log_softmax and gather) and build "
            "the loss from them; keep the rollout's log-probs only as the old (behaviour) log-probs"
        )
    return Finding(
        severity="error",
        kind=K.LOOP_LOSS_NO_GRAPH,
        message=f"backward() at {_at(line)} on a loss with no autograd graph (requires_grad=False, "
        f"{dn(loss.dtype)} {tuple(loss.shape)}): {why}",
        role=role,
        where=f"backward at {_at(line)}",
        observed={"requires_grad": False, "grad_forwards_since_step": grad_forwards},
        expected="a loss whose graph reaches the policy's weights",
        fix=fix,
        **where,
    )


def _log_softmax_finding(
    role: str, name: str, x: torch.Tensor, out: torch.Tensor, line: str | None, where: dict
) -> Finding:
    low = dn(out.dtype)
    eps = torch.finfo(out.dtype).eps
    return Finding(
        severity="warning",
        kind=K.LOOP_LOGPROBS_LOW_PRECISION,
        message=f"{name} at {_at(line)} ran on {dn(x.dtype)} values {tuple(x.shape)} and returned {low} "
        f"log-probs: the contract keeps the {role}'s log-probs in fp32, and {low} carries about "
        f"{max(1, round(-torch.log10(torch.tensor(eps)).item()))} significant digits (spacing {eps * 4:.2g} "
        "at a log-prob of -4), so distinct token probabilities round together in the policy gradient",
        role=role,
        where=f"{name} at {_at(line)}",
        observed={"input_dtype": dn(x.dtype), "output_dtype": low, "shape": list(x.shape)},
        expected="fp32 log-probs (the logprobs island)",
        fix=f"at {_at(line)}: upcast the logits to fp32 before the {name} (logits.float().log_softmax(-1), or "
        f"{name}(..., dtype=torch.float32))",
        **where,
    )
