"""The objects an own loop is made of keep fixed relations across its steps: checked while `watch` is open.

A loop is a policy, the copy it samples with, a reference, an optimizer (with a scheduler, a GradScaler)
and the tensors the rollout hands to the update. Each relation below holds in every correct loop; a fault
of the family breaks one, whatever the code that breaks it looks like. `RoleAudit` is a
`verlaudit.integrations.loop_calls` listener of one watch (it hears the constructors of optimizers, LR
schedulers and GradScalers, ``load_state_dict``, ``torch.inference_mode`` and transformers' ``generate``),
plus a global optimizer step hook and the trained models' forward hooks:

* **versions.** A model the loop samples with (``generate``) that is not the trained one but has its
  parameters (names and shapes) is fingerprinted at every generate (a strided sample of each tensor) and
  compared with the trained model's fingerprint at each of its versions (one per optimizer step): a copy
  whose weights stay those of one version while the policy moves two or more steps past it was never
  synced (`LOOP_STALE_SAMPLER`); a copy refreshed every step (lag 0, or a constant one-step lag) is clean.
* **identity and state.** The per-parameter state of the optimizer that steps the trained parameters
  persists: its ``step`` count at each step is one more than at the last. A count that starts again is a
  new optimizer per step, a ``state.clear()``, or a ``load_state_dict`` of an earlier state
  (`LOOP_OPTIMIZER_RECREATED`, naming which and its line); an LR scheduler or a GradScaler built again
  after a step restarts its schedule or its loss scale (`LOOP_SCHEDULER_RECREATED`, `LOOP_SCALER_RECREATED`).
* **the sampler's settings in the loss.** The gradient of ``log_softmax(z / T)[y]`` w.r.t. the logits
  ``z`` is ``(e_y - softmax(z / T)) / T``: off the target token, ``log|g_j| = const + z_j / T``. The
  temperature the loss reads the logits at is that slope's inverse, measured on the trained model's
  forward over the sequences a ``generate`` sampled; it must be the temperature they were sampled at
  (`LOOP_TEMPERATURE_MISMATCH`).
* **graph hygiene.** A tensor made under ``torch.inference_mode`` in a forward that builds a graph, or in
  the exception it raises, is named with the line that entered inference mode (`LOOP_INFERENCE_TENSOR`).

Exercised by `pytest tests/test_loop_roles.py`.
"""

from __future__ import annotations

import itertools
import math
import weakref
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

from verlaudit import kinds as K
from verlaudit.integrations import loop_calls
from verlaudit.integrations.loop_calls import at_line as _at
from verlaudit.integrations.loop_checks import output_tensor
from verlaudit.integrations.loop_tokens import _hash_rows
from verlaudit.rundir import Finding

SAMPLE = 16
"""Values sampled per tensor for a fingerprint (evenly spaced over the flattened tensor)."""
STALE_LAG = 2
"""Optimizer steps the policy has moved past the copy's weights, with the copy unchanged, to call it stale."""
TEMPERATURE_OFF = 0.15
"""Relative difference of the loss's temperature from the sampler's that is named (the fit is exact to ~1%)."""
_SERIAL = itertools.count(1)


def _signature(model: torch.nn.Module) -> tuple:
    return tuple((n, tuple(p.shape)) for n, p in model.named_parameters())


def fingerprint(model: torch.nn.Module) -> list[torch.Tensor]:
    """Per parameter, ``SAMPLE`` of its values at evenly spaced flat positions (fp32, on the CPU)."""
    out = []
    with torch.no_grad():
        for p in model.parameters():
            flat = p.detach().reshape(-1)
            n = flat.numel()
            if not n:
                out.append(torch.zeros(0))
                continue
            idx = torch.linspace(0, n - 1, min(SAMPLE, n), device=flat.device).long()
            out.append(flat[idx].float().cpu())
    return out


def _same(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether sampled values ``a`` (a copy's, stored in ``dtype``) are ``b`` (the policy's) up to rounding."""
    eps = torch.finfo(dtype).eps if dtype.is_floating_point else 0.0
    return bool(((a - b).abs() <= eps * b.abs() + 1e-30).all())


def _first_tensor(x: Any) -> torch.Tensor | None:
    if isinstance(x, torch.Tensor):
        return x
    seq = getattr(x, "sequences", None)
    return seq if isinstance(seq, torch.Tensor) else None


def _inference_tensors(args: Any, kwargs: Mapping[str, Any]) -> list[str]:
    names = [f"argument {i}" for i, a in enumerate(args) if isinstance(a, torch.Tensor) and a.is_inference()]
    names += [k for k, v in kwargs.items() if isinstance(v, torch.Tensor) and v.is_inference()]
    return names


class RoleAudit:
    """The cross-step relations of one watch's objects. ``models``/``optimizers`` role -> object;
    ``add(finding)`` records; ``where()`` the step and phase; ``loss_line()`` the last backward's line."""

    def __init__(
        self,
        models: Mapping[str, torch.nn.Module],
        optimizers: Mapping[str, Any],
        *,
        add: Callable[[Finding | None], None],
        where: Callable[[], dict],
        loss_line: Callable[[], str | None],
    ) -> None:
        self.models, self.optimizers = dict(models), dict(optimizers)
        self.add, self.where, self.loss_line = add, where, loss_line
        self.trained = {r: self.models[r] for r in self.optimizers}
        self._params = {
            r: {id(p) for p in m.parameters() if p.requires_grad} for r, m in self.trained.items()
        }
        self._sig = {r: _signature(m) for r, m in self.trained.items()}
        self.reported: set[tuple[str, str]] = set()
        self.steps: dict[str, int] = {}
        """role -> optimizer steps that moved its parameters (any optimizer holding them)."""
        self._last_opt: dict[str, tuple[int | None, str | None]] = {}
        """role -> (serial, line) of the optimizer of its last step (serial None: built before the block)."""
        self._state_param: dict[str, torch.Tensor] = {}
        """role -> the parameter whose optimizer state is followed; ``_p_steps`` the steps that held it."""
        self._p_steps: dict[str, int] = {}
        self._loaded: dict[int, str | None] = {}
        """id(optimizer) -> the line of a load_state_dict since its last step."""
        self._built: dict[str, list[tuple[str, int, str | None]]] = {"scheduler": [], "scaler": []}
        """what -> (role, steps of the role when it was built, line), for LR schedulers and GradScalers."""
        self.inference_line: str | None = None
        self._inference_seen: tuple[str, list[str], str | None, dict] | None = None
        """(role, names, line, where) of the first forward with gradients that received inference tensors."""
        # versions: role -> [(version, fingerprint)], id(copy) -> state
        self._history: dict[str, list[tuple[int, list[torch.Tensor]]]] = {}
        self._copies: dict[int, dict[str, Any]] = {}
        self._foreign: dict[int, dict[str, Any]] = {}
        """id(model) -> a sampler of another structure than the trained model: its own fingerprint, and the
        mean |log-prob difference| from the trained model on the tokens it sampled, per policy version."""
        self._sampled_by: dict[int, int] = {}
        # temperatures: row hash -> (temperature, generate line)
        self._sampled: dict[int, tuple[float, str | None]] = {}
        self._checked_t: dict[str, int] = {}
        self.rl = False
        """Whether the loop is an RL loop (it passed rewards, or sampled with ``generate``)."""
        self._logits: dict[str, tuple[torch.Tensor, str | None]] = {}
        self._coupling_checks: dict[str, int] = {}
        self._handle = register_optimizer_step_post_hook(self._after_any_step)

    def remove(self) -> None:
        self._handle.remove()

    def _report(self, role: str, kind: str, finding: Finding) -> None:
        if (role, kind) not in self.reported:
            self.reported.add((role, kind))
            self.add(finding)

    def _roles_of(self, optimizer: Any) -> list[str]:
        ids = {id(p) for g in getattr(optimizer, "param_groups", ()) for p in g["params"]}
        return [r for r, ps in self._params.items() if ps & ids]

    # -- identity and state ----------------------------------------------------------------------
    def on_optimizer_built(self, optimizer: Any, line: str | None) -> None:
        optimizer._verlaudit_built = (next(_SERIAL), line)

    def on_inference_mode(self, line: str | None) -> None:
        self.inference_line = line

    def on_optimizer_loaded(self, optimizer: Any, line: str | None) -> None:
        self._loaded[id(optimizer)] = line

    def on_scheduler_built(self, scheduler: Any, line: str | None) -> None:
        for role in self._roles_of(getattr(scheduler, "optimizer", None)):
            self._rebuilt("scheduler", role, line)

    def on_scaler_built(self, scaler: Any, line: str | None) -> None:
        for role in self.trained:
            self._rebuilt("scaler", role, line)

    def _rebuilt(self, what: str, role: str, line: str | None) -> None:
        built = self._built[what]
        prev = [b for b in built if b[0] == role]
        built.append((role, self.steps.get(role, 0), line))
        if not prev or self.steps.get(role, 0) <= prev[-1][1]:
            return  # the first one, or two built before any step between them
        if what == "scheduler" and (role, K.LOOP_OPTIMIZER_RECREATED) in self.reported:
            return  # a new optimizer per step takes a new scheduler with it: one fault, one finding
        n = len(prev) + 1
        self._report(
            role, _REBUILT_KIND[what], _rebuilt_finding(what, role, n, prev[0][2], line, self.where())
        )

    def _after_any_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        try:
            for role in self._roles_of(optimizer):
                self._state_check(role, optimizer)
        except Exception:  # noqa: BLE001 -- a check must never break the user's step
            return

    def _state_check(self, role: str, optimizer: Any) -> None:
        self.steps[role] = self.steps.get(role, 0) + 1
        self._new_version(role)
        serial, line = getattr(optimizer, "_verlaudit_built", (None, None))
        loaded = self._loaded.pop(id(optimizer), None)
        p = self._state_param.get(role)
        if p is None:
            p = next(
                (
                    q
                    for g in optimizer.param_groups
                    for q in g["params"]
                    if id(q) in self._params[role] and "step" in optimizer.state.get(q, {})
                ),
                None,
            )
            if p is None:
                return  # an optimizer without a per-parameter step count (SGD): nothing restarts
            self._state_param[role] = p
        if not any(q is p for g in optimizer.param_groups for q in g["params"]):
            return  # another optimizer of this role (one per parameter group)
        self._p_steps[role] = n = self._p_steps.get(role, 0) + 1
        prev = self._last_opt.get(role)
        self._last_opt[role] = (serial, line)
        if "step" not in optimizer.state.get(p, {}):
            return
        count = int(float(optimizer.state[p]["step"]))
        if n < 2 or count != 1:
            return
        if prev is not None and prev[0] != serial and serial is not None:
            how = "new"
        elif loaded is not None:
            how, line = "loaded", loaded
        else:
            how, line = "cleared", None
        self._report(
            role,
            K.LOOP_OPTIMIZER_RECREATED,
            _state_finding(role, type(optimizer).__name__, how, line, count, n, self.where()),
        )

    # -- versions ---------------------------------------------------------------------------------
    def _new_version(self, role: str) -> None:
        hist = self._history.get(role)
        if hist is not None:
            hist.append((self.steps.get(role, 0), fingerprint(self.trained[role])))
            del hist[:-8]

    def on_generate(
        self, module: Any, args: Any, kwargs: Mapping[str, Any], out: Any, line: str | None, inference: bool
    ) -> None:
        try:
            self._on_generate(module, args, kwargs, out, line, inference)
        except Exception:  # noqa: BLE001 -- a check must never break the user's rollout
            return

    def _on_generate(
        self, module: Any, args: Any, kwargs: Mapping[str, Any], out: Any, line: str | None, inference: bool
    ) -> None:
        if inference:
            self.inference_line = line
        self.rl = True
        role = next((r for r, m in self.trained.items() if m is module), None)
        if role is None and isinstance(module, torch.nn.Module):
            sig = _signature(module)
            role = next((r for r, s in self._sig.items() if s == sig and s), None)
            if role is not None:
                self._copy_check(role, module, line)
        seq = _first_tensor(out)
        if role is None and isinstance(module, torch.nn.Module) and self.trained:
            if any(module is m for m in self.models.values()):
                return
            role = next(iter(self.trained))
            self._foreign_generate(module, seq, line)
        if role is None:
            return
        sample = kwargs.get("do_sample")
        config = kwargs.get("generation_config") or getattr(module, "generation_config", None)
        if sample is None:
            sample = getattr(config, "do_sample", False)
        temp = kwargs.get("temperature")
        if temp is None:
            temp = getattr(config, "temperature", 1.0)
        if seq is None or not sample or temp is None or seq.dim() != 2:
            return
        if len(self._sampled) > 4096:
            self._sampled.clear()
        for h in _hash_rows(seq.detach()):
            self._sampled[h] = (float(temp), line)

    def _copy_check(self, role: str, copy: torch.nn.Module, line: str | None) -> None:
        """A generate on a copy of ``role``'s model: which of its tensors lag the policy now (decided at
        `finish`: a copy synced every few steps changes before the run ends, a stale one never does)."""
        hist = self._history.setdefault(role, [])
        if not hist:
            hist.append((self.steps.get(role, 0), fingerprint(self.trained[role])))
        fp = fingerprint(copy)
        dtypes = [p.dtype for p in copy.parameters()]
        state = self._copies.setdefault(
            id(copy),
            {
                "first": fp,
                "changed": [False] * len(fp),
                "line": line,
                "role": role,
                "names": [n for n, _ in copy.named_parameters()],
                "class": type(copy).__name__,
            },
        )
        for i, (a, b) in enumerate(zip(fp, state["first"])):
            state["changed"][i] = state["changed"][i] or not torch.equal(a, b)
        now = self.steps.get(role, 0)
        behind = []  # per tensor: the newest version of the policy it equals, when that is STALE_LAG behind
        for i, (a, dt) in enumerate(zip(fp, dtypes)):
            match = [v for v, h in hist if _same(a, h[i], dt)]
            moved = any(not torch.equal(hist[0][1][i], h[i]) for _, h in hist)
            if moved and (not match or now - max(match) >= STALE_LAG):
                behind.append((i, max(match) if match else None))
        state["behind"], state["now"], state["last"] = behind, now, line

    def _foreign_generate(self, module: torch.nn.Module, seq: Any, line: str | None) -> None:
        """A generate on a model that is not the trained one and has not its parameters (a base model under
        an adapter, another wrapper): whether it follows the policy is measured on its outputs (`on_forward`)."""
        fp = fingerprint(module)
        st = self._foreign.get(id(module))
        if st is None or st["ref"]() is not module:
            st = self._foreign[id(module)] = {
                "ref": weakref.ref(module), "line": line, "first": fp, "changed": False, "d": [],
                "class": type(module).__name__,
            }  # fmt: skip
        st["changed"] = st["changed"] or any(not torch.equal(a, b) for a, b in zip(fp, st["first"]))
        if isinstance(seq, torch.Tensor) and seq.dim() == 2:
            if len(self._sampled_by) > 4096:
                self._sampled_by.clear()
            for h in _hash_rows(seq.detach()):
                self._sampled_by[h] = id(module)

    def _foreign_compare(
        self, role: str, kwargs: Mapping[str, Any], ids: torch.Tensor, logits: torch.Tensor
    ) -> None:
        """The trained model's forward over sequences another model sampled: the log-probs both give the
        sampled tokens, once per step (an extra no-grad forward of the sampler)."""
        owners = {self._sampled_by.get(h) for h in _hash_rows(ids.detach())}
        if len(owners) != 1 or None in owners:
            return
        st = self._foreign.get(owners.pop())
        model = st["ref"]() if st is not None else None
        now = self.steps.get(role, 0)
        if model is None or len(st["d"]) >= 6 or (st["d"] and st["d"][-1][0] == now):
            return
        mask = kwargs.get("attention_mask")
        with torch.no_grad():
            other = output_tensor(
                model(input_ids=ids, attention_mask=mask) if mask is not None else model(ids)
            )
            if other is None or tuple(other.shape) != tuple(logits.shape):
                return
            tgt = ids[:, 1:, None]
            mine = logits.detach()[:, :-1].float().log_softmax(-1).gather(-1, tgt)
            theirs = other[:, :-1].float().log_softmax(-1).gather(-1, tgt.to(other.device)).to(mine.device)
            st["d"].append((now, float((mine - theirs).abs().mean())))

    def finish(self) -> None:
        """At the watch's exit: a sampling copy with tensors that never changed and lag the policy."""
        for st in self._foreign.values():
            d = st["d"]
            if st["changed"] or len(d) < 3 or d[-1][0] - d[0][0] < STALE_LAG:
                continue
            if d[-1][1] > max(4 * d[0][1], 1e-3) and d[-1][1] >= max(x for _, x in d):
                role = next(iter(self.trained))
                self._report(role, K.LOOP_STALE_SAMPLER, _drift_finding(role, st, self.where()))
        for state in self._copies.values():
            behind = [(i, v) for i, v in state.get("behind", ()) if not state["changed"][i]]
            if not behind:
                continue
            names = state["names"]
            of = max((v for _, v in behind if v is not None), default=None)
            self._report(
                state["role"],
                K.LOOP_STALE_SAMPLER,
                _stale_finding(
                    state["role"], state["class"], state["line"], state["last"],
                    [names[i] for i, _ in behind], len(names), of, state["now"], self.where(),
                ),
            )  # fmt: skip
        self._copies.clear()

    # -- the forwards of the trained model ----------------------------------------------------------
    def on_forward_pre(self, role: str, args: Any, kwargs: Mapping[str, Any], line: str | None) -> None:
        if not torch.is_grad_enabled() or torch.is_inference_mode_enabled():
            return
        names = _inference_tensors(args, kwargs)
        if names and self._inference_seen is None:
            self._inference_seen = (role, names, line, self.where())

    def on_exception(self, exc: BaseException) -> None:
        """The loop raised: an error about an inference tensor is named at the line that made it (with the
        inference tensors a forward with gradients received, when one did; one that worked is no fault)."""
        text = str(exc)
        if "nference tensor" not in text:
            return
        role, names, line, where = self._inference_seen or (next(iter(self.trained), "actor"), [], None, None)
        finding = self._inference_finding(role, names, line, text.split("\n")[0], where)
        self._report(role, K.LOOP_INFERENCE_TENSOR, finding)

    def _inference_finding(
        self, role: str, names: list[str], line: str | None, error: str | None, where: dict | None
    ) -> Finding:
        origin = self.inference_line
        what = (
            f"{', '.join(names)} passed to the {role}'s forward with gradients at {_at(line)} "
            f"{'is an inference tensor' if len(names) == 1 else 'are inference tensors'}"
            if names
            else "a tensor the loop trains on is an inference tensor"
        )
        return Finding(
            severity="error",
            kind=K.LOOP_INFERENCE_TENSOR,
            message=f"{what}, made under torch.inference_mode() (entered at {_at(origin)}): autograd cannot save "
            "an inference tensor for backward nor update it in place, so the training forward or its backward "
            f"fails ({error}) -- the cause is the rollout's inference mode, not the module or op that raised",
            role=role,
            where=f"torch.inference_mode at {_at(origin)}",
            observed={"inference_tensors": names, "inference_mode_line": origin, "error": error},
            expected="tensors a graph is built on made outside inference mode (under no_grad, or cloned)",
            fix=f"at {_at(origin)}: run the rollout under torch.no_grad() instead of torch.inference_mode(), or "
            "clone its outputs (seq.clone()) outside inference mode before the training forward uses them",
            **(where if where is not None else self.where()),
        )

    def on_forward(
        self, role: str, args: Any, kwargs: Mapping[str, Any], logits: Any, line: str | None
    ) -> None:
        """A trained model's forward with gradients: its logits wait for the next backward (`on_backward`);
        over sequences a ``generate`` sampled, hook the gradient of its logits to read the temperature the
        loss takes them at."""
        if (
            self.rl
            and self._coupling_checks.get(role, 0) < COUPLING_CHECKS
            and isinstance(logits, torch.Tensor)
            and logits.dim() == 3
            and logits.shape[0] >= 2
            and logits.requires_grad
            and logits.numel() <= COUPLING_MAX
        ):
            self._logits[role] = (logits, line)
        self._temperature_hook(role, args, kwargs, logits, line)
        if self._foreign and isinstance(logits, torch.Tensor) and logits.dim() == 3:
            ids = kwargs.get("input_ids", args[0] if args else None)
            if (
                isinstance(ids, torch.Tensor)
                and ids.dim() == 2
                and tuple(ids.shape) == tuple(logits.shape[:2])
            ):
                try:
                    self._foreign_compare(role, kwargs, ids, logits)
                except Exception:  # noqa: BLE001 -- a check must never break the user's forward
                    pass

    def on_backward(self, loss: Any, line: str | None) -> None:
        """The user's ``backward()``: before it runs, whether each row's terms of the loss depend on the
        other rows' logits (a second derivative across rows, on the logits of the last forward only)."""
        for role in list(self._logits):
            logits, fwd_line = self._logits.pop(role)
            if (role, K.LOOP_CONSTANT_WITH_GRAD) in self.reported:
                continue
            try:
                self._coupling_checks[role] = self._coupling_checks.get(role, 0) + 1
                found = row_coupling(loss, logits)
            except Exception:  # noqa: BLE001 -- a check must never break the user's backward
                continue
            if found is not None:
                self._report(
                    role,
                    K.LOOP_CONSTANT_WITH_GRAD,
                    _coupling_finding(role, found, line, fwd_line, self.where()),
                )

    def _temperature_hook(
        self, role: str, args: Any, kwargs: Mapping[str, Any], logits: Any, line: str | None
    ) -> None:
        if (
            not self._sampled
            or self._checked_t.get(role, 0) >= 4
            or (role, K.LOOP_TEMPERATURE_MISMATCH) in self.reported
        ):
            return
        if not isinstance(logits, torch.Tensor) or logits.dim() != 3 or not logits.requires_grad:
            return
        ids = kwargs.get("input_ids", args[0] if args else None)
        if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or tuple(ids.shape) != tuple(logits.shape[:2]):
            return
        hits = [self._sampled.get(h) for h in _hash_rows(ids.detach())]
        if not hits or any(h is None for h in hits):
            return
        temps = {h[0] for h in hits}
        if len(temps) != 1:
            return
        self._checked_t[role] = self._checked_t.get(role, 0) + 1
        temp, gen_line = hits[0]
        z = logits.detach()

        def hook(g: torch.Tensor) -> None:
            if loop_calls.GRAD_DEPTH[0]:
                return  # a torch.autograd.grad, not the loss's backward
            try:
                with torch.no_grad():
                    est = loss_temperature(z, g.detach(), ids)
                if est is not None and abs(est / temp - 1) > TEMPERATURE_OFF:
                    self._report(
                        role,
                        K.LOOP_TEMPERATURE_MISMATCH,
                        _temperature_finding(role, est, temp, gen_line, line, self.loss_line(), self.where()),
                    )
            except Exception:  # noqa: BLE001 -- a check must never break the user's backward
                return

        logits.register_hook(hook)


def loss_temperature(z: torch.Tensor, g: torch.Tensor, ids: torch.Tensor, top: int = 16) -> float | None:
    """The temperature a loss reads logits ``z`` at, from its gradient ``g`` (both [B, T, V]): at each
    position where the gradient is one token's log-prob (peaked at the next token), the slope of
    ``log|g_j|`` on ``z_j`` over the ``top`` largest other logits is ``1 / T``; the median over positions.
    None when no position reads one token's log-prob, or the fits are not linear (another loss)."""
    a = g.float().abs()
    peak, arg = a.max(-1)
    nxt = torch.full_like(ids, -1)
    nxt[:, :-1] = ids[:, 1:]
    pos = ((peak > 0) & (arg == nxt.to(arg.device)) & (peak >= 0.4 * a.sum(-1))).nonzero()
    if pos.shape[0] < 4:
        return None
    pos = pos[torch.linspace(0, pos.shape[0] - 1, min(64, pos.shape[0])).long()]
    slopes = []
    for b, t in pos.tolist():
        zz, gg = z[b, t].float(), a[b, t]
        zz = zz.clone()
        gg = gg.clone()
        zz[arg[b, t]] = -math.inf
        k = min(top, zz.numel() - 1)
        zv, idx = zz.topk(k)
        gv = gg[idx]
        ok = gv > 0
        if int(ok.sum()) < 4:
            continue
        x, y = zv[ok].double(), gv[ok].double().log()
        x0, y0 = x - x.mean(), y - y.mean()
        sxx = float((x0 * x0).sum())
        if sxx <= 1e-12:
            continue
        slope = float((x0 * y0).sum()) / sxx
        resid = y0 - slope * x0
        r2 = 1 - float((resid * resid).sum()) / max(float((y0 * y0).sum()), 1e-30)
        if r2 > 0.98 and slope > 0:
            slopes.append(slope)
    if len(slopes) < max(2, len(pos) // 2):
        return None
    return 1.0 / float(torch.tensor(slopes).median())


COUPLING_CHECKS = 2
"""Backward passes per trained role whose loss is checked for rows coupled through it."""
COUPLING_MAX = 1 << 24
"""Largest logits (elements) the check differentiates twice (its cost is a second backward over the logits)."""
COUPLED = 1e-4
"""A row's second derivative w.r.t. another row's logits, relative to its own, that is a dependence (0 exactly
when the rows' terms are separate; float noise is far below)."""


def row_coupling(loss: torch.Tensor, logits: torch.Tensor) -> dict[str, Any] | None:
    """Whether the loss's gradient at some row depends on another row's logits: ``d2 loss / dz_b dz_0`` for
    a direction on row 0's read positions, compared at the other rows with row 0's own. A sum of per-row
    terms whose weights (advantages, rewards, old log-probs) are constants gives exactly 0 there."""
    if not isinstance(loss, torch.Tensor) or not loss.requires_grad or loss.numel() != 1:
        return None
    (g,) = torch.autograd.grad(loss, logits, retain_graph=True, create_graph=True, allow_unused=True)
    if g is None or not g.requires_grad:
        return None
    read = g.detach().abs().amax(-1) > 0
    rows = read.any(-1).nonzero().flatten()
    if rows.numel() < 2:
        return None
    a = int(rows[0])
    v = torch.zeros_like(logits)
    gen = torch.Generator().manual_seed(7)
    v[a] = torch.randn(v[a].shape, generator=gen).to(v) * read[a, :, None]
    (hv,) = torch.autograd.grad((g * v).sum(), logits, retain_graph=True, allow_unused=True)
    if hv is None:
        return None
    hv = hv.detach().float()
    own = float(hv[a].abs().max())
    others = hv.abs().amax((1, 2))
    others[a] = 0
    cross = float(others.max())
    if not (cross > 0 and cross > COUPLED * max(own, 1e-30)):
        return None
    return {
        "row": a,
        "rows_coupled": int((others > COUPLED * max(own, 1e-30)).sum()),
        "rows": int(rows.numel()),
        "cross_to_own": cross / max(own, 1e-30),
    }


_REBUILT_KIND = {"scheduler": K.LOOP_SCHEDULER_RECREATED, "scaler": K.LOOP_SCALER_RECREATED}


# ---------------------------------------------------------------- the findings


def _state_finding(
    role: str, name: str, how: str, line: str | None, count: int, n: int, where: dict
) -> Finding:
    if how == "new":
        what = f"a new {name} is built at {_at(line)} between steps: the optimizer that steps the {role} is another object each step"
        fix = f"at {_at(line)}: build the optimizer once, before the loop (outside the step), and reuse it every step"
    elif how == "loaded":
        what = f"the {name}'s state is reloaded at {_at(line)} (load_state_dict of an earlier state) between steps"
        fix = (
            f"at {_at(line)}: do not reload the optimizer's state inside the loop (only when resuming a run)"
        )
    else:
        what = (
            f"the {name}'s per-parameter state is emptied between steps (optimizer.state cleared or replaced)"
        )
        fix = (
            "keep the optimizer's state across steps: remove the optimizer.state.clear() / reset in the loop"
        )
    return Finding(
        severity="error",
        kind=K.LOOP_OPTIMIZER_RECREATED,
        message=f"the {role}'s optimizer state restarts every step: {what}. At the {role}'s optimizer step {n} its "
        f"state's step count is {count} (it must count the steps, {n}): the moment estimates restart from zero "
        "and every update is the optimizer's first (Adam's bias-corrected first step is ~lr x sign(gradient), "
        "whatever the gradient's size), so no momentum or adaptive scale is ever built",
        role=role,
        where=f"optimizer at {_at(line)}" if line else f"{role}'s optimizer state",
        observed={"optimizer": name, "how": how, "state_step": count, "optimizer_steps": n, "line": line},
        expected="one optimizer for the whole run, its per-parameter state counting every step",
        fix=fix,
        **where,
    )


def _rebuilt_finding(
    what: str, role: str, n: int, first: str | None, line: str | None, where: dict
) -> Finding:
    if what == "scheduler":
        effect = (
            "each new scheduler starts its schedule again (its step count at 0, the learning rate at the "
            "schedule's first value): the warmup or decay never progresses"
        )
        fix = (
            f"at {_at(line)}: build the LR scheduler once, after the optimizer and before the loop, and call "
            "its step() once per optimizer step"
        )
    else:
        effect = (
            "each new GradScaler starts again at its initial scale with no growth or backoff history: the loss "
            "scale never adapts, and a first step that overflows at the initial scale is skipped every time"
        )
        fix = f"at {_at(line)}: build the GradScaler once, before the loop, and reuse it (scale, step, update) every step"
    return Finding(
        severity="error",
        kind=K.LOOP_SCHEDULER_RECREATED if what == "scheduler" else K.LOOP_SCALER_RECREATED,
        message=f"the {role}'s {'LR scheduler' if what == 'scheduler' else 'GradScaler'} is built again between "
        f"optimizer steps ({n} built, at {_at(line)}; the first at {_at(first)}): {effect}",
        role=role,
        where=f"{what} built at {_at(line)}",
        observed={"built": n, "line": line, "first_line": first},
        expected=f"one {what} for the whole run",
        fix=fix,
        **where,
    )


def _stale_finding(
    role: str,
    name: str,
    first: str | None,
    line: str | None,
    behind: list[str],
    total: int,
    of: int | None,
    now: int,
    where: dict,
) -> Finding:
    version = (
        f"still the {role}'s weights before its optimizer step {of + 1}" if of is not None
        else f"none of the {role}'s recent versions"
    )  # fmt: skip
    return Finding(
        severity="error",
        kind=K.LOOP_STALE_SAMPLER,
        message=f"the rollout samples with a stale copy of the {role}: the {name} whose generate runs at {_at(line)} "
        f"(first used at {_at(first)}) has the {role}'s parameters, but {len(behind)} of its {total} weight tensors "
        f"({', '.join(behind[:3])}{', ...' if len(behind) > 3 else ''}) are {version} and never change, while the "
        f"{role} has taken {now} optimizer step(s): the copy was never synced, every rollout after the first "
        "update comes from old weights, and the updates grow more off-policy each step (no ratio corrects it)",
        role=role,
        where=f"rollout sampler at {_at(line)}",
        observed={"stale_tensors": len(behind), "tensors": total, "matches_version": of, "policy_steps": now},
        expected=f"the sampler's weights equal the {role}'s at each rollout (or lag a constant, declared number of steps)",
        fix=f"at {_at(line)}: sample with the policy itself, or sync the copy before each rollout "
        f"(sampler.load_state_dict(policy.state_dict())) so it is the same model as the one trained",
        **where,
    )


def _coupling_finding(
    role: str, found: dict, loss_line: str | None, fwd_line: str | None, where: dict
) -> Finding:
    return Finding(
        severity="error",
        kind=K.LOOP_CONSTANT_WITH_GRAD,
        message=f"the loss at {_at(loss_line)} differentiates through its advantages: the gradient of its terms "
        f"for row {found['row'] + 1} changes with the logits of {found['rows_coupled']} other row(s) of the forward "
        f"at {_at(fwd_line)} (a second derivative across rows {found['cross_to_own']:.1e} of the row's own, where a "
        "policy-gradient loss, a sum of per-row terms weighted by constants, has exactly 0): a reward, advantage, "
        "baseline or KL penalty computed from the policy's log-probs carries their graph (not detached), so the "
        "update follows the gradient of the advantage too instead of the policy gradient",
        role=role,
        where=f"advantage / reward of the loss at {_at(loss_line)} (not detached)",
        observed=dict(found),
        expected="advantages, rewards, KL penalties and old log-probs that are constants of the loss (no graph)",
        fix=f"at {_at(loss_line)}: detach what weights the log-probs -- compute the shaped reward / KL penalty / "
        "advantage from logp.detach() (or under torch.no_grad()), e.g. adv = adv.detach()",
        **where,
    )


def _drift_finding(role: str, st: dict, where: dict) -> Finding:
    (v0, d0), (v1, d1) = st["d"][0], st["d"][-1]
    return Finding(
        severity="error",
        kind=K.LOOP_STALE_SAMPLER,
        message=f"the rollout samples with a model that does not follow the {role}: the {st['class']} whose "
        f"generate runs at {_at(st['line'])} never changes its weights, while its log-probs of the tokens it "
        f"sampled drift from the {role}'s (mean |difference| {d0:.2g} at the {role}'s version {v0}, {d1:.2g} at "
        f"version {v1}): the {role} trains on responses of a model it is no longer (a base model without the "
        "trained adapters, or a copy never synced), more off-policy every step",
        role=role,
        where=f"rollout sampler at {_at(st['line'])}",
        observed={"logprob_drift": [[v, round(x, 6)] for v, x in st["d"]], "sampler": st["class"]},
        expected=f"the sampler computes what the {role} computes at each rollout (its log-probs agree)",
        fix=f"at {_at(st['line'])}: sample with the trained model itself (adapters enabled / merged), or sync "
        "the sampler from it before each rollout (load_state_dict of the merged weights)",
        **where,
    )


def _temperature_finding(
    role: str,
    est: float,
    temp: float,
    gen_line: str | None,
    fwd_line: str | None,
    loss_line: str | None,
    where: dict,
) -> Finding:
    return Finding(
        severity="error",
        kind=K.LOOP_TEMPERATURE_MISMATCH,
        message=f"the loss at {_at(loss_line)} reads the {role}'s logits at temperature {est:.2f}, but the rollout "
        f"sampled these responses at temperature {temp:g} (generate at {_at(gen_line)}): its gradient w.r.t. the "
        f"logits of the forward at {_at(fwd_line)} is softmax(logits / {est:.2f}) off the sampled token, so the "
        "log-probs it trains on are not the ones the responses were sampled with; a ratio against the sampler's "
        "log-probs is off from 1 before any update (the clip fires on tokens the policy never moved)",
        role=role,
        where=f"log-probs of the loss at {_at(loss_line)}",
        observed={"loss_temperature": round(est, 3), "sampling_temperature": temp},
        expected="log-probs recomputed at the sampling temperature: log_softmax(logits / T)",
        fix=f"at {_at(loss_line)}: divide the logits by the sampling temperature before the log-softmax "
        f"((logits / {temp:g}).log_softmax(-1)), or sample at the temperature the loss uses",
        **where,
    )
