"""The auditor: an `Observer` that checks a run against its precision contract while it trains.

    with Auditor(writer, AuditSettings(level="full", full_steps=2, every=10), device="cpu") as a:
        trainer.train.train(config, a)

The `Auditor` only routes the trainer's events (`trainer.events.Observer`): it keeps the
`StepContext` up to date and passes each payload to the part that owns it -- the pure checks in
`dtype_checks`, `boundaries` and `numerics`, the deferred non-finite checks (`nonfinite`), the
gradient and update numerics (`optimizer`), the rollout mismatch and weight push (`mismatch`), the
module probes (`probes`, hooks on only for steps sampled at the ``full`` level), memory (`memory`) and phase timing (`context.PhaseTimer`). Findings
go to a `FindingLog` (findings.jsonl); one metrics.jsonl line per step comes from `metrics.step_line`.
An exception leaving the ``with`` block becomes a finding and a ``failure`` dict for status.json
(`failure`), then propagates -- never swallowed. manifest.json is the worker's alone: it adds
``memory.summary()`` when training ends. Exercised by `pytest tests/test_audit_probes.py
tests/test_audit_faults.py` and `python -m verlaudit.run.worker SPEC.json`.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import weakref
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch import nn

from trainer.events import Observer
from trainer.precision import TRAINABLE_ROLES, PrecisionPolicy
from verlaudit import kinds as K
from verlaudit.audit import (
    boundaries,
    config_checks,
    config_pairs,
    config_ranges,
    data_information,
    dtype_checks,
    dynamics,
    errors,
    gradhealth,
    invariants,
    invariants_examples,
    invariants_reward,
    model_checks,
    nonfinite,
    numerics,
    opcount,
    plugins,
    precision_realised,
    probes_fork,
    probes_numpy,
    probes_run,
    resolution,
    reward_grid,
    reward_signal,
    setup_changes,
    weights,
)
from verlaudit.audit import guard as audit_guard
from verlaudit.audit.context import PhaseTimer, StepContext
from verlaudit.audit.failure import failure_findings, failure_status
from verlaudit.audit.findings import FindingLog
from verlaudit.audit.memory import MemoryMonitor
from verlaudit.audit.metrics import StepNumbers, audit_numbers, step_line
from verlaudit.audit.mismatch import MismatchWatch
from verlaudit.audit.module_numerics import Provenance
from verlaudit.audit.optimizer import OptimizerWatch, judge_overflow
from verlaudit.audit.precision_watch import PrecisionWatch
from verlaudit.audit.probes import ModuleProbe
from verlaudit.audit.settings import AuditSettings
from verlaudit.rundir import GRADHEALTH, RunWriter


def _guarded(*, keep_on: bool = False, uncounted: bool = True, fallback: str | None = None) -> Callable:
    """An observer method of the audit that raises is the audit's bug: reported once (`guard.Guard`) and
    left out for the rest of the run (``keep_on``: tried again each step, as the step's bookends must be);
    ``fallback`` names the method that does what the run needs of it anyway (the step's metrics line).
    ``uncounted``: the audit's own work in the method is not counted as the model's ops (`opcount`)."""

    def wrap(method: Callable) -> Callable:
        name = method.__name__

        @functools.wraps(method)
        def wrapper(self: Auditor, *args: Any, **kwargs: Any) -> Any:
            if not keep_on and self.guard.off(name):
                return None
            try:
                with opcount.suspended() if uncounted else contextlib.nullcontext():
                    return method(self, *args, **kwargs)
            except Exception as exc:  # noqa: BLE001  (any bug of the audit: the user's run goes on)
                self.guard.report(name, exc, step=self.context.step)
                if fallback is not None:
                    getattr(self, fallback)(*args, **kwargs)
                return None

        return wrapper

    return wrap


class Auditor(Observer):
    """Routes the trainer's events to the checks and collectors; writes metrics and findings."""

    def __init__(
        self,
        writer: RunWriter | None = None,
        settings: AuditSettings | None = None,
        *,
        device: str | torch.device = "cpu",
        memory_interval: float = 0.01,
    ) -> None:
        self.writer = writer
        this = weakref.ref(self)  # no closure over self: no cycle that keeps a finished run (and its models)
        self.guard = audit_guard.Guard(lambda: getattr(this(), "writer", None))
        """The audit's own failures: each reported once, the run never killed by one (`guard`)."""
        self._outer_guard: audit_guard.Guard | None = None
        self.settings = settings or AuditSettings()
        self.device = torch.device(device)
        self.context = StepContext()
        self.findings = FindingLog(writer)
        self.provenance = Provenance()
        self.memory = MemoryMonitor(self.device, interval=memory_interval)
        self.timer = PhaseTimer()
        self.numbers = StepNumbers()
        self.checks = nonfinite.DeviceChecks()
        self.opt_watch = OptimizerWatch(self.settings, self.numbers, self.context)
        self.accum = precision_realised.AccumWatch()
        """prec13: micro-batch gradients summed in fp32 beside a low-precision .grad (sampled steps)."""
        self.grid = reward_grid.GridWatch()
        """prec13: the reward function's values on a decimal grid, from a rounding in its module."""
        self._state_read: set[str] = set()
        """prec13: the roles whose optimizer state dtypes were read (once, after the first step taken)."""
        self.mismatch = MismatchWatch(self.numbers)
        self.probe: ModuleProbe | None = None
        self.watch: PrecisionWatch | None = None
        """The fp32 shadow, op counts and gradient health of sampled steps (``full`` level)."""
        self._step_hooks = contextlib.ExitStack()
        """The fp32 shadow's and op counter's hooks of a sampled step, closed at its end and on exit."""
        self._probe_on = False
        """The probe's hooks are registered: from a sampled step's start to the end of the last of a run
        of consecutive sampled ones (or that step's end when the shadow is on: its hooks go first)."""
        self.policy: PrecisionPolicy | None = None
        self.models: dict[str, nn.Module] = {}
        self.tokenizer_info: dict[str, Any] = {}
        self.config: dict[str, Any] = {}
        """The run's TrainConfig as a dict (`on_setup`): the plug-in specs a boundary finding names."""
        self.model_vocab_size: int | None = None
        self.names: dict[int, tuple[str, str]] = {}
        """id(module) -> (role, qualified name), to name the module a failure came from."""
        self.last_completed_step: int | None = None
        self.failure: dict[str, Any] | None = None
        """Status fields (reason, step, phase, culprit ...) when an exception left the run."""
        self.dtype_watch: weights.DtypeWatch | None = None
        self.dynamics: dynamics.DynamicsWatch | None = None
        """Clip, staleness, KL and group settings read from each step's metrics (`dynamics`)."""
        self.growth: weights.GrowthWatch | None = None
        """Weight-norm growth of the trainable roles since setup (the learning rate as a cause)."""
        self.updates: dict[str, int] = {}
        """Optimizer steps taken (not skipped) per role, for the growth's per-update rate."""
        self.group_size = 0
        """GRPO's responses per prompt (0: the run has no groups), for `reward_signal`."""
        self._groups: tuple[int, int, str] | None = None
        self._grid_seen: set[int] = set()  # combo: the models whose weights `resolution` read
        """This step's (identical groups, groups, reward source), from its last reward."""
        self.reward_watch = invariants_reward.RewardWatch()
        """The reward's invariants: a constant reward, one ranked against the task, one read at a position."""
        self.reward_probe = probes_run.RewardProbe(enabled=getattr(self.settings, "probe_plugins", True))
        """rfprobe: the reward function's contract, probed in forked copies of the process."""
        self.example_watch = invariants_examples.ExampleWatch(
            reload=getattr(self.settings, "probe_plugins", True)
        )
        """The examples' invariants (data24): empty prompts, duplicate rows, leaked answers, rounded answers."""
        self._form_probed = False
        """data13: whether the policy was measured on the prompts' form (once, at the first batch)."""

    # -- context manager -------------------------------------------------------------------------
    _frozen = False
    """Whether this auditor froze the heap (`heap_freeze`) and owes the thaw."""

    def __enter__(self) -> Auditor:
        self._outer_guard = audit_guard.activate(self.guard)
        self.memory.start()
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        try:
            if exc is not None:
                self._settle()
                self.failure = self._fail(exc)
        finally:
            self._step_hooks.close()
            self.accum.disarm()
            self._probe_hooks(on=False)
            self.memory.stop()
            self.findings.flush()
            if self._outer_guard is not None:
                audit_guard.restore(self._outer_guard)
                self._outer_guard = None
            if self._frozen:
                self._frozen = False
                heap_thaw()
        return False  # never swallow: the worker records status from self.failure and exits 1

    @property
    def _checking(self) -> bool:
        """Boundary checks and numerics run: the level is not ``off`` and the policy is known."""
        return self.settings.level != "off" and self.policy is not None

    # -- observer protocol ------------------------------------------------------------------------
    @_guarded(uncounted=False)
    def on_setup(self, *, config, policy, models, tokenizer_info) -> None:
        self.policy, self.models, self.tokenizer_info = policy, dict(models), dict(tokenizer_info)
        self.config = dict(config or {})
        self.names = {id(m): (role, n) for role, model in models.items() for n, m in model.named_modules()}
        self.model_vocab_size = boundaries.model_vocab_size(models.get("actor"))
        if self.settings.level == "off":
            return
        if not self._frozen:
            self._frozen = True
            heap_freeze()
        algo = (config or {}).get("algo") or {}
        self.group_size = int(algo.get("group_size") or 0) if algo.get("name") == "grpo" else 0
        self.growth = weights.GrowthWatch({"actor": algo.get("lr"), "critic": algo.get("critic_lr")})
        # what the user's model.setup changed first: diagnose names it as the culprit of what follows
        self._check("setup_changes", setup_changes.findings, config or {}, self.models, policy, tokenizer_info,
                    TRAINABLE_ROLES)  # fmt: skip
        # model24: the tokenizer and each role's forward on the task's own text, before any step
        self._check(
            "model_checks", model_checks.findings, config or {}, self.models, tokenizer_info.get("tokenizer")
        )
        # settings that make a loss or an update degenerate by construction, named before the first step
        configured = self._check("config_checks", config_checks.setup_findings, config or {})
        # numeric keys outside their sane range: information until diagnose sees the run confirm it
        roles = (policy.to_dict().get("roles") or {}) if hasattr(policy, "to_dict") else {}
        self._check("config_ranges", config_ranges.setup_findings, config or {}, roles)
        # combo: keys wrong in combination (one penalty twice, a scale key of another loss type, ...)
        self._check("config_pairs", config_pairs.setup_findings, config or {}, roles)
        self.dynamics = dynamics.DynamicsWatch(
            algo,
            rollout=(config or {}).get("rollout"),
            correction=(config or {}).get("rollout_correction"),
            reported={f.kind for f in configured},
        )
        self._model_state(step=None)
        # prec13: a role computing below the preset, measured against the same forward in fp32
        self._check("compute_realised", precision_realised.compute_findings, policy, self.models,
                    self.model_vocab_size)  # fmt: skip
        self._check("invariants", invariants.setup_findings, config or {}, self.models, TRAINABLE_ROLES)
        if "actor" in self.models:
            self._check(
                "tokenizer_eos",
                boundaries.check_tokenizer_eos,
                self.config,
                self.models["actor"],
                tokenizer_info,
            )
        for role, model in self.models.items():  # combo: weights a coarse grid zeroed (a quantised load)
            self._grid_seen.add(id(model))
            self._check(
                "weight_grid", resolution.weight_grid, role, model, resolution.source_key(config or {}, role)
            )
        self.dtype_watch = weights.DtypeWatch(self.models)
        for role, model in self.models.items():  # before the probe adds its own hooks
            self._check("user_hooks", weights.user_hooks, role, model)
        if self.settings.level == "full":
            self.probe = ModuleProbe(
                models, policy=policy, context=self.context, sink=self.findings, provenance=self.provenance
            )
            if self.settings.shadow or self.settings.opcount_steps:
                self.watch = PrecisionWatch(
                    models, policy, self.settings, self.context, self.numbers, self.writer
                )

    def _check(self, name: str, check: Callable[..., list], *args: Any) -> list:
        """Runs one setup-time check and keeps its findings. A check that raises is the audit's own bug, not
        the user's: it is reported (stderr and an ``audit_check_failed`` event naming the check and the error)
        and the run goes on without that check's findings, never killed by it."""
        try:
            found = list(check(*args))
        except Exception as exc:  # noqa: BLE001  (any exception of a check: the run must not die of it)
            self.guard.report(name, exc, what="setup check")
            return []
        self.findings.extend(found)
        return found

    @_guarded(keep_on=True, uncounted=False)
    def on_step_start(self, step: int) -> None:
        self.context.start_step(step, sampled=self.settings.is_full(step))
        self.timer.reset()
        self.provenance.reset()
        self.numbers.reset()
        self.checks.clear()
        self.opt_watch.start_step(step)
        self._step_hooks.close()
        self.accum.disarm()
        if self.context.sampled and self.policy is not None:
            for role in TRAINABLE_ROLES:
                if role in self.models and role in self.policy.roles:
                    self.accum.arm(role, self.models[role], self.policy[role])
        self._groups = None
        if self.context.sampled and self.dtype_watch is not None:
            # a full-audit step re-reads the models' dtypes (metadata, no device work) and weight norms
            self.findings.extend(self.dtype_watch.changes(step=step))
            self._model_state(step=step)
        if self.watch is not None and self.context.sampled:
            # before the probe: the shadow's hooks then see the inputs as the model passed them
            self._step_hooks.enter_context(self.watch.sampled_step())
        if self.probe is not None:
            self._probe_hooks(on=self.context.sampled)
            if self.context.sampled:
                self.probe.start_step()

    def _probe_hooks(self, *, on: bool) -> None:
        if self.probe is None or on == self._probe_on:
            return
        if on:
            self.probe.__enter__()
        else:
            self.probe.__exit__(None, None, None)
        self._probe_on = on

    def _model_state(self, *, step: int | None) -> None:
        """Storage dtypes, low-precision buffers and weights out of family or non-finite, for every role;
        at setup, then on full-audit steps (only what is not recorded yet)."""
        for role, model in self.models.items():
            kind = K.REWARD_MODEL_DTYPE if role == "reward" else K.PARAM_STORAGE
            found = dtype_checks.check_param_storage(role, model, self.policy[role], kind=kind, step=step)
            found += dtype_checks.check_buffers(role, model, self.policy[role])
            rms = weights.weight_rms(model.named_parameters())
            found += weights.weight_findings(role, rms, step=step)
            if self.growth is not None and role in TRAINABLE_ROLES:
                if step is None:
                    self.growth.start(role, model, rms)
                else:
                    updates = self.updates.get(role, 0)
                    found += self.growth.findings(role, model, rms, step=step, updates=updates)
            self.findings.extend(
                f for f in found if step is None or not self.findings.find(f.kind, role=role, where=f.where)
            )

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        if self.writer is not None:
            # the last phase started tells a killed run's diagnosis where it died (no status is written)
            self.writer.event("phase_start", step=self.context.step, phase=name)
        watch = self.watch.phase(name) if self.watch is not None else contextlib.nullcontext()
        with self.context.in_phase(name), self.timer.phase(name), self.memory.phase(name), watch:
            yield

    def plugin_call(self, point, source, call):
        """On sampled full-audit steps, the call runs under `plugins.Recorder` (and again under
        `plugins.Promote` for a reward model, or with ``audit.rerun_plugins``); its findings are recorded."""
        if not self.context.sampled or self.guard.off("plugin_call"):
            return call()
        try:  # the audit's work before the call: a bug of it runs the call plain (the user's own raises)
            recorder = plugins.Recorder(underflow=point != "reward_model")
            bools = probes_numpy.BoolAdd() if point != "reward_model" else contextlib.nullcontext()  # data24
            probed = self._reward_probe_before(point, source, call)  # rfprobe: forks before the real call
        except Exception as exc:  # noqa: BLE001
            self.guard.report("plugin_call", exc, step=self.context.step)
            return call()
        with recorder, bools:
            result = call()
        self._after_plugin_call(point, source, call, result, recorder, bools, probed)
        return result

    @_guarded(uncounted=False)
    def _after_plugin_call(self, point, source, call, result, recorder, bools, probed) -> None:
        """What the recorder and the probes saw of a plug-in's call, as findings (guarded: see above)."""
        if probed is not None:
            self.findings.extend(probed(result))
            self._probe_events()
        bound = probes_fork.bound_inputs(call) if point == "reward_fn" else None
        if bound is not None:  # prec13: values on a decimal grid, and the rounding in the user's module
            key = reward_signal.reward_key((self.config or {}).get("data") or {})
            got = probes_fork.scores(result, len(bound[2]))
            self.findings.extend(
                self.grid.observe(bound[0], bound[2], got, where=key, ctx=self.context.where())
            )
        if recorder.broken:
            return  # the recorder's own bug left its record half-made (reported): no findings from it
        with opcount.suspended():
            self.findings.extend(plugins.watch_findings(point, source, self._unprobed(call), result, recorder,
                                                        self.settings, **self.context.where()))  # fmt: skip
        if isinstance(bools, probes_numpy.BoolAdd):
            data = (self.config or {}).get("data") or {}
            key = (
                reward_signal.reward_key(data)
                if point == "reward_fn"
                else f"data.{point} ({data.get(point)})"
            )
            role = "reward" if point == "reward_fn" else "actor"
            self.findings.extend(bools.findings(where=key, ctx=self.context.where(), role=role))

    def _reward_probe_before(self, point, source, call):
        """rfprobe: the reward function's contract probed in forked children (`probes_run`), or None."""
        if point != "reward_fn":
            return None
        with opcount.suspended():
            return self.reward_probe.before(
                call,
                source=source,
                data=(self.config or {}).get("data") or {},
                group_size=self.group_size,
                ctx=self.context.where(),
            )

    def _probe_events(self) -> None:
        if self.writer is not None:
            for kind, data in self.reward_probe.events:
                self.writer.event(kind, **data)
        self.reward_probe.events.clear()

    def _unprobed(self, call):
        """``call`` with the module probes off: the higher-precision repeat of a plug-in (its inputs
        cast up) is the audit's own work, not a forward whose dtypes the contract judges."""

        def quiet():
            probe = self.probe
            was = probe.active if probe is not None else None
            if probe is not None:
                probe.active = False
            try:
                return call()
            finally:
                if probe is not None:
                    probe.active = was

        return quiet

    @_guarded()
    def on_batch(self, *, role, batch, source, examples=()) -> None:
        if self.settings.level != "off":
            self.findings.extend(
                boundaries.check_batch(
                    batch,
                    role=role,
                    source=source,
                    tokenizer_info=self.tokenizer_info,
                    rows=len(examples) or None,
                    **self.context.where(),
                )
            )
            self.findings.extend(
                invariants.batch_findings(
                    batch,
                    role=role,
                    source=source,
                    tokenizer_info=self.tokenizer_info,
                    examples=examples,
                    data=(self.config or {}).get("data") or {},
                    **self.context.where(),
                )
            )
            self.findings.extend(
                self.example_watch.findings(
                    batch,
                    examples=examples,
                    tokenizer_info=self.tokenizer_info,
                    data=(self.config or {}).get("data") or {},
                    source=source,
                    ctx={"role": role, **self.context.where()},
                )
            )
            if not self._form_probed and examples and isinstance(self.models.get("actor"), nn.Module):
                self._form_probed = True  # data13: the prompts' form measured on the policy, once
                probe = functools.partial(
                    data_information.form_probe, self.models["actor"], examples, tokenizer_info=self.tokenizer_info,
                    data=(self.config or {}).get("data") or {}, ctx={"role": role, **self.context.where()},
                )  # fmt: skip
                self.findings.extend(self._unprobed(probe)())

    @_guarded()
    def on_rollout(self, **payload: Any) -> None:  # Observer.on_rollout's keywords, checked as they are
        if self.settings.level == "off":
            return
        where = self.context.where()
        vocab = {
            "vocab_size": self.tokenizer_info.get("vocab_size"),
            "model_vocab_size": self.model_vocab_size,
        }
        self.findings.extend(boundaries.check_rollout(**payload, **vocab, **where))
        self.checks.boundary("rollout", "rollout_logprobs", payload["logprobs"], **where)
        self.mismatch.rollout(payload)
        if self.dynamics is not None:
            self.findings.extend(self.dynamics.rollout(payload, vocab=self.model_vocab_size, **where))

    @_guarded()
    def on_weight_sync(self, **record: Any) -> None:  # Observer.on_weight_sync's keywords
        if self.settings.level != "off":
            self.findings.extend(self.mismatch.weight_sync(record, **self.context.where()))

    @_guarded()
    def on_reward(self, *, source, raw, rewards, expected_shape, model, context=None) -> None:
        if self.settings.level == "off":
            return
        where = self.context.where()
        self.findings.extend(
            self.reward_watch.findings(
                source=source,
                rewards=rewards,
                context=context or {},
                config=self.config,
                pad_token_id=self.tokenizer_info.get("pad_token_id"),
                sampled=self.context.sampled,
                where=where,
                grouped=self.group_size >= 2,
            )
        )
        self.findings.extend(
            boundaries.check_reward(
                raw,
                rewards,
                source=source,
                expected_shape=tuple(expected_shape),
                train_device=self.device,
                **where,
            )
        )
        if model is not None and id(model) not in self._grid_seen:  # combo: weights a coarse grid zeroed
            self._grid_seen.add(id(model))
            source = resolution.source_key(self.config or {}, "reward")
            self._check("weight_grid", resolution.weight_grid, "reward", model, source)
        if model is not None and self.policy is not None:
            self.findings.extend(
                dtype_checks.check_param_storage(
                    "reward", model, self.policy["reward"], kind=K.REWARD_MODEL_DTYPE, **where
                )
            )
        if isinstance(rewards, torch.Tensor) and rewards.numel():
            r = rewards.detach().float()
            self.numbers.put("reward/mean", float(r.mean()))
            self.numbers.put("reward/std", float(r.std(unbiased=False)))
            counted = reward_signal.reward_groups(r, self.group_size)
            if (
                counted is not None
            ):  # the step's last reward is its sampled rows' (ReMax scores its baseline first)
                self._groups = (*counted, source)
                self.numbers.put(reward_signal.METRIC, counted[0] / counted[1])
                tiny = reward_signal.tiny_std_groups(r, self.group_size)  # combo: std normalisation's input
                if tiny is not None:
                    self.numbers.put(reward_signal.TINY_STD_METRIC, tiny)

    @_guarded()
    def on_forward(self, *, role, name, output) -> None:
        if not self._checking:
            return
        where = self.context.where()
        self.findings.extend(
            dtype_checks.check_boundary_output(role, name, output, self.policy[role], **where)
        )
        self.checks.boundary(role, name, output, **where)

    @_guarded()
    def on_loss(self, *, role, loss, terms) -> None:
        self.context.in_backward = True  # forwards until on_backward are checkpoint recomputes
        if not self._checking:
            return
        policy, where = self.policy[role], self.context.where()
        for name, t in {"loss": loss, **dict(terms)}.items():
            low = (
                isinstance(t, torch.Tensor)
                and t.is_floating_point()
                and t.dtype not in (torch.float32, torch.float64)
            )
            if low:
                self.findings.extend(dtype_checks.check_boundary_output(role, name, t, policy, **where))
        self.checks.loss(role, loss, terms, **where)

    @_guarded()
    def on_backward(self, *, role, model, loss_scale) -> None:
        self.context.in_backward = False
        if not self._checking:
            return
        policy, params = self.policy[role], list(model.named_parameters())
        if precision_realised.grad_overridden(policy):  # prec13: the key asked for another .grad dtype
            self.findings.extend(
                precision_realised.grad_findings(role, params, policy, **self.context.where())
            )
        else:
            self.findings.extend(dtype_checks.check_grad_dtypes(role, params, policy, **self.context.where()))
        self.accum.backward(role, model)
        if self.watch is not None:
            self.watch.backward(role, params, policy, loss_scale, sampled=self.context.sampled)
        if self.context.sampled:
            self.findings.extend(self.opt_watch.backward(role, params, policy))

    @_guarded()
    def on_before_optimizer_step(self, *, role, model, optimizer) -> None:
        if self._checking:
            self.opt_watch.before_step(role, model)
            where = self.context.where()
            self.findings.extend(self.accum.step(role, self.policy[role], self.config, **where))

    @_guarded()
    def on_optimizer_step(self, *, role, model, optimizer, scaler_state, skipped, grad_norm) -> None:
        if not self._checking:
            return
        self._settle()
        policy, where, skipped = self.policy[role], self.context.where(), bool(skipped)
        self.updates[role] = self.updates.get(role, 0) + (not skipped)
        if self.writer is not None:
            self.writer.event(
                "optimizer_step",
                step=where["step"],
                role=role,
                skipped=skipped,
                grad_norm=grad_norm,
                scaler=dict(scaler_state),
            )
        self.findings.extend(
            numerics.scaler_findings(role, scaler_state, skipped, grad_norm, policy, **where)
        )
        if skipped:
            judge_overflow(self.findings, model, scaler_state, role=role, ctx=self.context)
        found = self.opt_watch.after_step(
            role, model, optimizer, scaler_state, skipped=skipped, grad_norm=grad_norm, policy=policy
        )
        self.findings.extend(found)
        if not skipped and role not in self._state_read:  # prec13: the moments exist after a step taken
            self._state_read.add(role)
            self.findings.extend(precision_realised.optim_state_findings(role, optimizer, policy, **where))

    @_guarded(keep_on=True, fallback="_plain_step_end")
    def on_step_end(self, step: int, metrics: Mapping[str, float]) -> None:
        self._settle()
        if self._groups is not None:
            identical, groups, source = self._groups
            pg = metrics.get("actor/pg_loss")
            found = reward_signal.no_signal_finding(
                identical,
                groups,
                source=source,
                step=step,
                pg_loss=float(pg) if isinstance(pg, (int, float)) else None,
            )
            self.findings.extend([found] if found else [])
        self.opt_watch.end_step()
        self.accum.disarm()
        self._step_hooks.close()  # the shadow's and the counter's hooks off before their records are read
        if self.probe is not None:
            self.probe.end_step()
            if self.settings.shadow or not self.settings.is_full(step + 1):
                self._probe_hooks(on=False)
        if self.watch is not None and self.context.sampled:
            self.findings.extend(self.watch.end_step(step))
        self._write_update_rows()
        audit = None
        if self.settings.level != "off":
            self.findings.extend(self.mismatch.step_end(metrics, step=step))
            if self.dynamics is not None:
                self.findings.extend(self.dynamics.step_end(metrics, step=step))
            trained = [role for role in TRAINABLE_ROLES if role in self.models]
            absmax = self.probe.absmax if self.probe is not None and self.context.sampled else None
            audit = audit_numbers(trained, self.numbers.values, absmax)
        line = step_line(
            metrics,
            memory=self.memory.step_metrics(),
            timing=self.timer.take(),
            audit=audit,
            counts=self.findings.take_step_counts(),
            sampled=self.context.sampled,
        )
        if self.writer is not None:
            self.writer.metrics(step, line)
        self._line_step = step
        self.findings.flush()
        self.last_completed_step = step
        self._step_hooks.close()

    _line_step: int | None = None
    """The last step whose metrics line was written (the fallback below writes it once)."""

    def _plain_step_end(self, step: int, metrics: Mapping[str, float]) -> None:
        """`on_step_end` after a check of it raised: the step's metrics line (without the audit's numbers)
        and its findings are still written, and the step counts as completed."""
        self._step_hooks.close()
        if self.writer is not None and self._line_step != step:
            counts = self.findings.take_step_counts()
            line = step_line(metrics, memory={}, timing={}, audit=None, counts=counts, sampled=False)
            self.writer.metrics(step, line)
        self._line_step = step
        self.findings.flush()
        self.last_completed_step = step

    def _write_update_rows(self) -> None:
        """The per-module lost-update table of the step's measured optimizer steps (gradhealth.jsonl)."""
        rows, self.opt_watch.update_rows = self.opt_watch.update_rows, []
        if self.writer is None or self.policy is None:
            return
        for role, table, lr, where in rows:
            pd = dtype_checks.dn(self.policy[role].param_dtype)
            self.writer.records(
                GRADHEALTH, gradhealth.update_loss(role, table, param_dtype=pd, lr=lr, **where)
            )

    # -- settle points and failures ---------------------------------------------------------------
    def _settle(self) -> None:
        """Reads what the step left on the device (the probes' maxima, the pending non-finite checks)
        where the trainer has synced anyway: the optimizer step, the step's end, a failure."""
        if self.probe is not None:
            self.probe.flush()
        self.findings.extend(nonfinite.findings(self.checks.settle()))

    def _fail(self, exc: BaseException) -> dict[str, Any]:
        """Status fields for an exception leaving the run; records the matching finding."""
        culprit = errors.innermost_module(exc.__traceback__, self.names)
        if culprit is None and self.probe is not None:
            culprit = self.probe.failed_in  # the hook stack saw it where the traceback did not
        status = failure_status(
            exc,
            culprit=culprit,
            step=self.context.step,
            phase=self.context.failed_phase or self.context.phase,
            memory=self.memory.allocator_view(),
            last_completed_step=self.last_completed_step,
        )
        self.findings.extend(failure_findings(exc, status, self.policy))
        self.findings.flush()
        return status


_FREEZES = 0
"""Auditors in this process that froze the heap and have not thawed it yet."""


def heap_freeze() -> None:
    """Moves the objects alive at setup (the imports, the models' modules and parameters: about 440k
    on the 7B suite) out of the garbage collector's reach while the audit runs. The full level's
    records make enough short-lived containers that Python runs a full collection every few steps,
    and scanning that heap took 0.24-0.27 s each time on the H200's host, one step in five or six
    (reports/gpu/audit_price_h200/). Frozen, a full collection scans only what was made since.
    Objects freed by reference counting are still freed; the next `heap_thaw` hands the rest back."""
    global _FREEZES
    if _FREEZES == 0:
        gc.freeze()  # no collection first: garbage frozen now is collected after the thaw
    _FREEZES += 1


def heap_thaw() -> None:
    """The last auditor out returns the frozen objects to the collector (`gc.unfreeze`)."""
    global _FREEZES
    _FREEZES = max(0, _FREEZES - 1)
    if _FREEZES == 0:
        gc.unfreeze()
