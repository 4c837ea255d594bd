"""`verlaudit.watch`: audit any PyTorch training loop in place, and write a standard run directory.

    with verlaudit.watch(model, opt, scaler=scaler, out_dir="runs/mine") as w:
        for batch in loader:
            w.batch(batch)                              # the collator's output, before the model
            with w.phase("actor_update"), torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(**batch).loss
            scaler.scale(loss).backward()
            scaler.step(opt)                            # the step is detected here: no call needed
            scaler.update()
            w.log({"actor/loss": loss})

Like `torch.utils.module_tracker`, hooks go on in ``__enter__`` and come off in ``__exit__``: a step
pre- and post-hook on each optimizer (steps are counted from them), a tap on the GradScaler's
``unscale_`` / ``update`` (the scale the backward ran at, skipped steps, the loss-scale history), and
a one-shot forward pre-hook per model that reads the autocast the first forward runs under (for an
inferred contract). Boundary calls (`Watch.batch`, `Watch.reward`, `Watch.rollout`, `Watch.forward`,
`Watch.loss`) hand the user's own values to the same checks our trainer's run through. The loop's
own precision (an autocast that does nothing, weights cast down and back up, the GradScaler's order,
an undeclared autocast under a declared contract) is checked by `verlaudit.integrations.loop_checks`
from the same hooks, plus a tap on ``torch.autocast`` and ``nn.Module._apply`` while the block is open;
its protocol (the GradScaler's order, the scheduler's and zero_grad's cadence, a loss without a graph,
low-precision log-probs) by `verlaudit.integrations.loop_protocol` over the taps of `loop_calls`, and
whether each update moves the policy toward the advantage by `verlaudit.integrations.loop_direction`.
The relations of the loop's objects across steps (a stale sampling copy, optimizer state that restarts, the
sampler's temperature in the loss, advantages with a graph, inference-mode tensors) are `loop_roles`'.
Everything lands in ``out_dir`` (manifest, metrics, findings, events, status), read by ``verlaudit diagnose``.
Exercised by `pytest tests/test_integrations_watch.py tests/test_watch_loop_checks.py tests/test_loop_protocol.py
tests/test_loop_roles.py`.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from trainer.events import PHASES
from trainer.precision import ROLES, TRAINABLE_ROLES, PrecisionPolicy
from verlaudit.audit.frames import user_frame
from verlaudit.audit.settings import AuditSettings
from verlaudit.integrations import contract, loop_calls, loop_checks
from verlaudit.integrations.loop_cancel import CancelAudit
from verlaudit.integrations.loop_direction import DirectionProbe
from verlaudit.integrations.loop_protocol import LoopProtocol
from verlaudit.integrations.loop_reference import ReferenceAudit
from verlaudit.integrations.loop_roles import RoleAudit
from verlaudit.integrations.loop_scale import ScaleTrace
from verlaudit.integrations.loop_tokens import TokenAudit
from verlaudit.integrations.loop_update import UpdateAudit
from verlaudit.integrations.session import AuditSession, ScalerTap, grad_norm


def _by_role(value: Any, what: str, kind: type) -> dict[str, Any]:
    if value is None:
        return {}
    if isinstance(value, kind):
        return {"actor": value}
    if isinstance(value, Mapping):
        for role, v in value.items():
            if role not in ROLES:
                raise ValueError(
                    f"watch({what}=...): unknown role {role!r}; expected one of {', '.join(ROLES)}"
                )
            if not isinstance(v, kind):
                raise ValueError(f"watch({what}=...): {role} is a {type(v).__name__}, not a {kind.__name__}")
        return dict(value)
    raise ValueError(
        f"watch({what}=...): got a {type(value).__name__}; pass a {kind.__name__} (the actor's) or a dict "
        f"role -> {kind.__name__}, roles from {', '.join(ROLES)}"
    )


def _name(fn: Any) -> str:
    return getattr(fn, "__name__", None) or type(fn).__name__


class Watch:
    """The handle `watch` returns; see the module docstring."""

    def __init__(
        self,
        models: nn.Module | Mapping[str, nn.Module],
        optimizer: Any = None,
        *,
        out_dir: str | Path,
        scaler: Any = None,
        precision: str | PrecisionPolicy | None = None,
        level: str = "boundary",
        settings: AuditSettings | None = None,
        device: str | torch.device | None = None,
        tokenizer: Any = None,
        name: str | None = None,
        config: Mapping[str, Any] | None = None,
    ) -> None:
        self.models = _by_role(models, "models", nn.Module)
        if not self.models:
            raise ValueError(
                "watch(models=...): no model given; pass the model you train (or a dict role -> model)"
            )
        self.optimizers = _by_role(optimizer, "optimizer", torch.optim.Optimizer)
        for role in self.optimizers:
            if role not in TRAINABLE_ROLES:
                raise ValueError(
                    f"watch(optimizer=...): {role} has no optimizer here; expected {TRAINABLE_ROLES}"
                )
            if role not in self.models:
                raise ValueError(
                    f"watch(optimizer=...): an optimizer for {role} but no {role} model in models"
                )
        self.out_dir = Path(out_dir)
        self.scaler = scaler
        if precision is not None:  # a wrong preset is an error here, before the loop starts
            contract.resolve(precision, self.models, device="cpu", autocast=None, scaler=False)
        self.precision = precision
        self.settings = settings or AuditSettings(level=level)
        param = next(next(iter(self.models.values())).parameters(), None)
        where = device if device is not None else param.device if param is not None else "cpu"
        self.device = torch.device(where)
        self.tokenizer = tokenizer
        self.name = name or self.out_dir.name
        self.config = dict(config or {})
        self.session: AuditSession | None = None
        self._contract: dict[str, Any] = {}
        self._handles: list[Any] = []
        self._forward_hooks: list[Any] = []
        self._tap: ScalerTap | None = None
        self._scale_trace: ScaleTrace | None = None
        self._norms: dict[str, float] = {}
        self._stepped: set[str] = set()
        self._regions = loop_checks.AutocastRegions()
        self._casts: list[loop_checks.CastTap] = []
        self._down: dict[str, tuple[torch.dtype, torch.dtype, str | None]] = {}
        """role -> the open cast below its contract's storage dtype (from, to, line)."""
        self._updates: dict[str, int] = {}
        """role -> optimizer steps taken (a round trip after one erases updates)."""
        self._protocol: LoopProtocol | None = None
        self._probes: dict[str, DirectionProbe] = {}
        """role -> whether its updates move it toward the advantage (`loop_direction`)."""
        self._update: UpdateAudit | None = None
        """Whether each step is the update of the loss (`loop_update`)."""
        self._tokens: dict[str, TokenAudit] = {}
        """role -> which tokens its loss reads, at which positions (`loop_tokens`)."""
        self._roles: RoleAudit | None = None
        self._reference: ReferenceAudit | None = None
        self._cancel: CancelAudit | None = None
        """The reference stays frozen and apart from the policy (`loop_reference`)."""
        """The objects' relations across steps: sampler versions, optimizer state (`loop_roles`)."""

    # -- context manager ---------------------------------------------------------------------------
    def __enter__(self) -> Watch:
        autocast = contract.active_autocast(self.device.type)
        policy, self._contract = contract.resolve(
            self.precision, self.models, device=self.device, autocast=autocast, scaler=self.scaler is not None
        )
        self.session = AuditSession(
            self.out_dir,
            models=self.models,
            policy=policy,
            settings=self.settings,
            device=self.device,
            manifest={
                "variant": self.name,
                "suite": "watch",
                "config": self._config_of(policy),
                "contract": self._contract,
                "integration": {"framework": "pytorch", "adapter": "verlaudit.watch"},
            },
            tokenizer_info=_tokenizer_info(self.tokenizer),
        )
        role_of = {id(opt): role for role, opt in self.optimizers.items()}
        for role, opt in self.optimizers.items():
            self._handles.append(opt.register_step_pre_hook(functools.partial(self._pre_step, role)))
            self._handles.append(opt.register_step_post_hook(functools.partial(self._post_step, role)))
        if self.scaler is not None:
            trace = ScaleTrace(next(iter(self.optimizers), "actor"), add=self._add, where=self._where)
            self._scale_trace = trace
            self._tap = ScalerTap(
                self.scaler,
                before_unscale=lambda opt, scale: self._unscale(role_of.get(id(opt)), scale, opt),
                after_update=self._after_update,
                before_step=lambda opt, scaled: self._scaler_step(role_of.get(id(opt)), opt, scaled),
                on_scale=trace.on_scale,
            )
        if self._contract["source"] == "inferred" and autocast is None:
            for model in self.models.values():
                first = loop_checks.Hook(self._first_forward)
                self._forward_hooks.append(model.register_forward_pre_hook(first))
        self._regions.install()
        self._protocol = LoopProtocol(
            self.models,
            self.optimizers,
            self.scaler,
            policy=lambda: self.session.policy if self.session is not None else None,
            add=self._add,
            where=self._where,
        )
        loop_calls.install(self._protocol)
        self._update = UpdateAudit(self.models, self.optimizers, add=self._add, where=self._where)
        loop_calls.install(self._update)
        self._roles = RoleAudit(
            self.models, self.optimizers, add=self._add, where=self._where, loss_line=self._loss_line
        )
        loop_calls.install(self._roles)
        self._cancel = CancelAudit(add=self._add, where=self._where)
        self._reference = ReferenceAudit(self.models, self.optimizers, add=self._add, where=self._where)
        for finding in self._protocol.setup():
            self._add(finding)
        for role in self.optimizers:
            if self.settings.level != "off":
                self._probes[role] = DirectionProbe(role, self.models[role])
                self._tokens[role] = TokenAudit(
                    role, add=self._add, where=self._where, loss_line=self._loss_line
                )
                tokens = loop_checks.Hook(functools.partial(self._tokens_check, role))
                self._handles.append(self.models[role].register_forward_hook(tokens, with_kwargs=True))
        for role, model in self.models.items():
            seen = loop_checks.Hook(functools.partial(self._forward_seen, role))
            self._handles.append(model.register_forward_pre_hook(seen, with_kwargs=True))
            done = loop_checks.Hook(self._forward_done)
            self._handles.append(model.register_forward_hook(done, always_call=True))
            check = loop_checks.Hook(functools.partial(self._forward_check, role))
            self._handles.append(model.register_forward_pre_hook(check))
            out = loop_checks.Hook(functools.partial(self._output_check, role))
            self._handles.append(model.register_forward_hook(out))
            self._casts.append(loop_checks.CastTap(model, functools.partial(self._cast, role)))
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> bool:
        if self._roles is not None:
            if exc is not None:
                self._roles.on_exception(exc)
            self._roles.finish()
        if self._reference is not None:
            self._reference.remove()
            self._reference.finish()
            loop_calls.remove(self._roles)
            self._roles.remove()
        if self._protocol is not None:
            if exc is None:
                self._add(self._protocol.finish())
            loop_calls.remove(self._protocol)
            self._protocol.remove()
        if self._update is not None:
            if exc is None:
                self._update.finish()
            loop_calls.remove(self._update)
        for h in self._handles + self._forward_hooks:
            h.remove()
        self._handles.clear()
        self._forward_hooks.clear()
        self._regions.remove()
        for tap in self._casts:
            tap.remove()
        self._casts.clear()
        if self._tap is not None:
            self._tap.remove()
        if self.session is not None:
            self.session.close(exc)
        return False

    # -- hooks ------------------------------------------------------------------------------------
    def _first_forward(self, module: nn.Module, args: Any) -> None:
        """The first forward decides an inferred contract's compute dtype: the autocast it runs under
        (if any) replaces the one seen at entry. The hooks come off after it."""
        for h in self._forward_hooks:
            h.remove()
        self._forward_hooks.clear()
        autocast = contract.active_autocast(self.device.type)
        if autocast is None or self.session is None:
            return
        policy, self._contract = contract.resolve(
            None, self.models, device=self.device, autocast=autocast, scaler=self.scaler is not None
        )
        self._contract["decided_at"] = "the first forward, under autocast"
        s = self.session
        s.policy = s.auditor.policy = policy
        for part in (s.auditor.probe, s.auditor.watch):
            if part is not None:
                part.policy = policy
        s.writer.update_manifest(
            policy=policy.to_dict(), contract=self._contract, config=self._config_of(policy)
        )

    def _config_of(self, policy: PrecisionPolicy) -> dict[str, Any]:
        """manifest.json's ``config``: the sections the readers use (algorithm, preset) and the user's."""
        return {
            "algo": {"name": self.config.get("algo", "custom")},
            "precision": {"preset": policy.preset},
            **{k: v for k, v in self.config.items() if k != "algo"},
        }

    def _unscale(self, role: str | None, scale: float, optimizer: Any = None) -> None:
        if self._protocol is not None and optimizer is not None:
            self._add(self._protocol.scaler_unscale(optimizer, _user_line()))
        if role is not None and self.session is not None:
            self.session.backward(role, scale)

    # -- the loop's own precision (`loop_checks`) -----------------------------------------------------
    def _add(self, finding: Any) -> None:
        if finding is not None and self.session is not None:
            self.session.auditor.findings.add(finding)

    def _where(self) -> dict[str, Any]:
        return self.session.auditor.context.where() if self.session is not None else {}

    def _forward_check(self, role: str, module: nn.Module, args: Any) -> None:
        """Each forward of a watched model: an open autocast that does nothing for it; fp16 autocast on
        a trained model without an enabled scaler."""
        regions = self._regions.stack
        if not regions or self._probing():
            return
        self._add(loop_checks.autocast_finding(role, module, regions, self._where()))
        dev = loop_checks.device_type(module)
        live = [r for r in regions if r["device"] == dev and r["enabled"]]
        scaled = self.scaler is not None and self.scaler.is_enabled()
        if live and live[-1]["dtype"] == "fp16" and role in self.optimizers and not scaled:
            self._add(loop_checks.fp16_no_scaler_finding(role, live[-1], self._where()))

    def _output_check(self, role: str, module: nn.Module, args: Any, output: Any) -> None:
        """A declared contract (a preset or a policy) whose compute dtype the forward did not keep."""
        s = self.session
        if s is None or self._contract.get("source") == "inferred" or role not in s.policy.roles:
            return
        if self._probing():
            return
        rp = s.policy[role]
        self._add(
            loop_checks.below_contract_finding(
                role, module, output, rp.compute_dtype, rp.param_dtype, self._where()
            )
        )

    def _cast(self, role: str, before: torch.dtype, after: torch.dtype, line: str | None) -> None:
        """A cast of a whole watched model: down from its contract's storage dtype is remembered; back up
        to it after one is a round trip."""
        if self.session is None:
            return
        store = self.session.policy[role].param_dtype if role in self.session.policy.roles else None
        bits = torch.finfo(before).bits, torch.finfo(after).bits
        if before == store and bits[1] < bits[0]:
            self._down[role] = (before, after, line)
        elif after == store and role in self._down:
            down = self._down.pop(role)
            self._add(
                loop_checks.round_trip_finding(
                    role,
                    self.models[role],
                    down,
                    (before, after, line),
                    updates_before=self._updates.get(role, 0),
                    where=self._where(),
                )
            )

    def _scaler_step(self, role: str | None, optimizer: Any, scaled: int) -> None:
        if role is not None and not scaled:
            self._add(loop_checks.unscaled_step_finding(role, _user_line(), self._where()))
        if self._protocol is not None:
            self._add(self._protocol.scaler_step(optimizer, _user_line()))

    def _forward_seen(self, role: str, module: nn.Module, args: Any, kwargs: Any) -> None:
        """Each forward of a watched model, with its arguments: whether it builds a graph, and the ids
        a trained model's direction probe measures on."""
        if self._protocol is not None:
            self._protocol.depth += 1
        probe = self._probes.get(role)
        if probe is not None and probe.busy:
            return
        if self._protocol is not None:
            self._protocol.on_forward(role)
        if self._roles is not None and role in self.optimizers and not self._probing():
            self._roles.on_forward_pre(role, args, kwargs, _user_line())
        if probe is not None:
            probe.on_forward(args, kwargs)

    def _forward_done(self, module: nn.Module, args: Any, output: Any) -> None:
        if self._protocol is not None:
            self._protocol.depth = max(0, self._protocol.depth - 1)

    def _loss_line(self) -> str | None:
        return self._protocol.loss_line if self._protocol is not None else None

    def _tokens_check(self, role: str, module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        """A trained model's forward: which tokens the loss built on its logits reads (`loop_tokens`)."""
        if role in self._tokens and not self._probing():
            self._tokens[role].on_forward(module, args, kwargs, output, _user_line())
            if self._roles is not None and torch.is_grad_enabled():
                self._roles.on_forward(role, args, kwargs, loop_checks.output_tensor(output), _user_line())
            if self._cancel is not None and torch.is_grad_enabled():
                self._cancel.on_forward(role, loop_checks.output_tensor(output), _user_line())

    def _probing(self) -> bool:
        return any(p.busy for p in self._probes.values())

    def _pre_step(self, role: str, optimizer: Any, args: Any, kwargs: Any) -> None:
        assert self.session is not None
        tap = self._tap
        if tap is not None and self.scaler.is_enabled() and not tap.in_step and tap.scaled:
            scale = float(self.scaler.get_scale())
            self._add(loop_checks.bypassed_scaler_finding(role, _user_line(), scale, self._where()))
        line = _user_line()
        cleared = self._protocol.cleared_line(role) if self._protocol is not None else None
        other = self._protocol is not None and self._protocol.holds_none(role)  # named at entry
        empty = loop_checks.has_no_grads(optimizer) or (cleared and loop_checks.all_grads_zero(optimizer))
        closure = len(args) > 1 or kwargs.get("closure") is not None  # args[0] is the optimizer
        if empty and not other and not closure:  # a closure (LBFGS) computes its gradients in the step
            self._add(loop_checks.no_grads_finding(role, line, self._where(), cleared=cleared))
        elif cleared and not other and self._protocol is not None:
            self._add(self._protocol.discarded_finding(role, line))
        elif not other and not closure and self._cancel is not None:
            self._add(self._cancel.before_step(role, optimizer, line))
        for finding in self._protocol.before_step(role, line) if self._protocol is not None else ():
            self._add(finding)
        if self._update is not None:
            self._update.before_step(role, line, closure=closure)
        if role in self._probes:
            self._probes[role].before_step()
        # under a GradScaler the tap reported the scaled gradients at unscale_; these are unscaled
        self.session.before_optimizer_step(role, optimizer, loss_scale=1.0)
        self._norms[role] = grad_norm(self.models[role])

    def _post_step(self, role: str, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self._protocol is not None:
            self._protocol.after_step(role)
        if self._update is not None:
            self._update.after_step(role, _user_line())
        if role in self._probes:
            line = self._protocol.loss_line if self._protocol is not None else None
            self._add(self._probes[role].after_step(line, self._where()))
        self._stepped.add(role)
        self._updates[role] = self._updates.get(role, 0) + 1
        if self._tap is not None and self.scaler.is_enabled():
            return  # the scaler's update says whether it skipped, and the scale after
        self._stepped_role(
            role, skipped=False, scaler_state={"mode": "none", "scale": 1.0, "found_inf": None}
        )
        self._maybe_finish()

    def _after_update(self) -> None:
        """GradScaler.update: every watched optimizer either stepped or was skipped by the scaler."""
        assert self._tap is not None and self.session is not None
        if self._protocol is not None:
            self._protocol.scaler_update()
        if self._scale_trace is not None:
            self._scale_trace.clear()
        state = self._tap.state()
        for role, opt in self.optimizers.items():
            if role not in self._stepped and not state.get("found_inf"):
                continue  # this optimizer was not part of the scaler's step
            if role not in self._stepped:  # skipped: no pre-hook ran
                self.session.before_optimizer_step(role, opt)
                self._norms[role] = math.nan
            self._stepped_role(role, skipped=bool(state.get("found_inf")), scaler_state=state)
        self._maybe_finish(force=True)

    def _stepped_role(self, role: str, *, skipped: bool, scaler_state: Mapping[str, Any]) -> None:
        assert self.session is not None
        self.session.optimizer_step(
            role,
            self.optimizers[role],
            scaler_state=scaler_state,
            skipped=skipped,
            grad_norm=self._norms.pop(role, math.nan),
        )

    def _maybe_finish(self, force: bool = False) -> None:
        assert self.session is not None
        if force or self._stepped >= set(self.optimizers):
            self._stepped.clear()
            self.session.finish_step()

    # -- the user's calls -------------------------------------------------------------------------
    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Marks a phase of the step (memory and time are accounted per phase); one of `PHASES`."""
        if name not in PHASES:
            raise ValueError(f"Watch.phase({name!r}): unknown phase; expected one of {', '.join(PHASES)}")
        with self._session().phase(name):
            yield

    def batch(self, batch: Mapping[str, Any], *, source: str | None = None, role: str = "actor") -> None:
        """The collated batch, before any model sees it (ids and masks must be integers, in the
        vocabulary, of one batch size). ``source`` names the collator in findings."""
        s = self._session()
        s.begin_step()
        s.auditor.on_batch(role=role, batch=batch, source=source or "user")
        if role in self._probes:
            self._probes[role].on_batch(batch)
        if role in self._tokens and hasattr(batch, "get"):
            self._tokens[role].on_prompts(batch.get("input_ids"))

    def reward(
        self,
        raw: Any,
        *,
        source: str | None = None,
        expected_shape: tuple[int, ...] | None = None,
        model: nn.Module | None = None,
    ) -> torch.Tensor:
        """What the reward function returned, exactly; returns it as the float32 tensor the checks
        compare it with. ``source``: the function's or model's name, as findings name it."""
        s = self._session()
        s.begin_step()
        rewards = _as_rewards(raw, self.device)
        shape = tuple(expected_shape) if expected_shape is not None else tuple(rewards.shape)
        kind = "model" if model is not None else "function"
        s.auditor.on_reward(
            source=f"{kind}:{source or 'user'}", raw=raw, rewards=rewards, expected_shape=shape, model=model
        )
        if "actor" in self._probes:
            self._probes["actor"].on_rewards(rewards)
        if self._roles is not None:
            self._roles.rl = True
        return rewards

    def reward_fn(self, fn: Callable[..., Any], *, source: str | None = None) -> Callable[..., Any]:
        """``fn`` wrapped so that every value it returns passes `reward` under its own name."""

        @functools.wraps(fn)
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            out = fn(*args, **kwargs)
            self.reward(out, source=source or _name(fn))
            return out

        return wrapped

    def rollout(self, **payload: Any) -> None:
        """The rollout's tokens and the log-probs it sampled them with (`trainer.events.Observer.on_rollout`'s
        keywords; ``engine``, ``engine_dtype`` and ``actor_compute_dtype`` default to the contract's)."""
        s = self._session()
        s.begin_step()
        actor = s.policy["actor"]
        payload.setdefault("engine", "user")
        payload.setdefault("engine_dtype", s.policy["rollout"].compute_dtype)
        payload.setdefault("actor_compute_dtype", actor.compute_dtype)
        missing = [k for k in ("prompt_ids", "response_ids", "response_mask", "logprobs") if k not in payload]
        if missing:
            raise ValueError(
                f"Watch.rollout(...): missing {', '.join(missing)}; pass them as keyword arguments"
            )
        s.auditor.on_rollout(**payload)
        if "actor" in self._tokens:
            self._tokens["actor"].on_prompts(payload.get("prompt_ids"))

    def forward(self, name: str, output: torch.Tensor, *, role: str = "actor") -> None:
        """A forward result crossing into the algorithm (``logprobs``, ``ref_logprobs``, ``values``)."""
        s = self._session()
        s.begin_step()
        s.auditor.on_forward(role=role, name=name, output=output)

    def loss(self, loss: torch.Tensor, *, role: str = "actor", **terms: torch.Tensor) -> None:
        """A micro-batch loss (unscaled) and its named terms, before backward."""
        s = self._session()
        s.begin_step()
        s.auditor.on_loss(role=role, loss=loss, terms=terms)
        if role in self._probes and "advantages" in terms:
            self._probes[role].on_advantages(terms["advantages"])

    def log(self, metrics: Mapping[str, Any]) -> None:
        """The step's own numbers (``actor/loss`` ...), added to its metrics line."""
        self._session().log(metrics)

    def _session(self) -> AuditSession:
        if self.session is None:
            raise ValueError(
                "verlaudit.watch: use the handle inside its with block (with verlaudit.watch(...) as w:)"
            )
        return self.session


def watch(
    models: nn.Module | Mapping[str, nn.Module],
    optimizer: Any = None,
    *,
    out_dir: str | Path,
    scaler: Any = None,
    precision: str | PrecisionPolicy | None = None,
    level: str = "boundary",
    **kwargs: Any,
) -> Watch:
    """Audits the training loop inside the ``with`` block; see the module docstring. ``models``: the
    model you train, or a dict role -> model (``actor``, ``reference``, ``critic``, ``reward``);
    ``optimizer``: the actor's, or a dict role -> optimizer; ``precision``: a preset name
    (``fp32``, ``bf16``, ``fp16``, ``bf16-pure``), a `PrecisionPolicy`, or None to infer it."""
    return Watch(
        models, optimizer, out_dir=out_dir, scaler=scaler, precision=precision, level=level, **kwargs
    )


def _user_line() -> str | None:
    """The user's file:line of the call that is running (the innermost frame outside torch and us)."""
    return user_frame(depth=3)


def _as_rewards(raw: Any, device: torch.device) -> torch.Tensor:
    if isinstance(raw, torch.Tensor):
        return raw.detach().to(device=device, dtype=torch.float32).reshape(-1)
    try:
        return torch.as_tensor(raw, dtype=torch.float32, device=device).reshape(-1)
    except (TypeError, ValueError, RuntimeError):
        return torch.full((len(raw) if hasattr(raw, "__len__") else 1,), math.nan, device=device)


def _tokenizer_info(tokenizer: Any) -> dict[str, Any]:
    if tokenizer is None:
        return {}
    return {
        "vocab_size": len(tokenizer),
        "pad_token_id": getattr(tokenizer, "pad_token_id", None),
        "eos_token_id": getattr(tokenizer, "eos_token_id", None),
        "padding_side": getattr(tokenizer, "padding_side", None),
    }
