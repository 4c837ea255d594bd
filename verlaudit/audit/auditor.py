"""The auditor: an `Observer` that checks a run against its precision contract while it trains.

    with Auditor(writer, AuditSettings(level="full", full_steps=2, every=10), device="cpu") as a:
        trainer.train.train(config, a)

Collect -> analyse -> write: the observer methods and the module probes collect, the pure checks
in `dtype_checks`, `boundaries` and `numerics` analyse, and `FindingLog` / `RunWriter` write
findings.jsonl and one metrics.jsonl line per step. Hooks go on only for sampled steps at the
``full`` level and all come off in ``__exit__``. An exception leaving the ``with`` block is turned
into a finding and a ``failure`` dict (for status.json) and then propagates — never swallowed.
Exercised by `pytest tests/test_audit_auditor.py` and `python -m verlaudit.run.worker SPEC.json`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
import traceback
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn

from trainer.events import Observer
from trainer.precision import TRAINABLE_ROLES, PrecisionPolicy
from verlaudit.audit import boundaries, dtype_checks, errors, numerics
from verlaudit.audit.findings import FindingLog
from verlaudit.audit.memory import MemoryMonitor
from verlaudit.audit.probes import ModuleProbe
from verlaudit.rundir import Finding, RunWriter

LEVELS = ("off", "boundary", "full")


@dataclasses.dataclass(frozen=True, kw_only=True)
class AuditSettings:
    """How much to audit, and on which steps."""

    level: str = "full"
    """``off``: metrics, memory and status only; ``boundary``: + batch/rollout/reward/loss checks and
    optimizer numerics; ``full``: + per-module hooks on sampled steps."""
    full_steps: int = 2
    """The first ``full_steps`` steps are audited at the full level ..."""
    every: int = 10
    """... and every ``every``-th step after (0: never); the others at the boundary level. Lost
    updates (`numerics.update_underflow`) are measured on the same steps at both levels, and on
    step 0 even when ``full_steps`` is 0."""

    def __post_init__(self) -> None:
        if self.level not in LEVELS:
            raise ValueError(f"audit.level: {self.level!r}; expected one of {', '.join(LEVELS)}")
        if isinstance(self.full_steps, bool) or not isinstance(self.full_steps, int) or self.full_steps < 0:
            raise ValueError(f"audit.full_steps: expected an integer >= 0, got {self.full_steps!r}")
        if isinstance(self.every, bool) or not isinstance(self.every, int) or self.every < 0:
            raise ValueError(f"audit.every: expected an integer >= 0 (0: never), got {self.every!r}")

    def is_full(self, step: int) -> bool:
        if self.level != "full":
            return False
        return step < self.full_steps or (self.every > 0 and step % self.every == 0)

    def measures_updates(self, step: int) -> bool:
        """Whether this step snapshots a sample of the weights to count updates lost to rounding:
        cheap (`numerics.UPDATE_SAMPLE` elements per tensor, one host read), but not free, so only
        on `is_full`'s schedule, at the boundary level too."""
        if self.level == "off":
            return False
        return step < max(1, self.full_steps) or (self.every > 0 and step % self.every == 0)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class Auditor(Observer):
    """Checks every boundary, samples module hooks and numerics, writes metrics and findings."""

    def __init__(self, writer: RunWriter | None = None, settings: AuditSettings | None = None, *,
                 device: str | torch.device = "cpu", memory_interval: float = 0.01) -> None:  # fmt: skip
        self.writer = writer
        self.settings = settings or AuditSettings()
        self.device = torch.device(device)
        self.findings = FindingLog(writer)
        self.provenance = numerics.Provenance()
        self.memory = MemoryMonitor(self.device, interval=memory_interval)
        self.policy: PrecisionPolicy | None = None
        self.models: dict[str, nn.Module] = {}
        self.tokenizer_info: dict[str, Any] = {}
        self.config: dict[str, Any] = {}
        self.names: dict[int, tuple[str, str]] = {}
        self.probe: ModuleProbe | None = None
        self.step: int | None = None
        self.phase_name: str | None = None
        self.in_backward = False
        self.sampled = False
        self.last_completed_step: int | None = None
        self.failure: dict[str, Any] | None = None
        self._num: dict[str, float] = {}
        self._timing: dict[str, float] = {}
        """Seconds per phase this step (``timing_s/<phase>``)."""
        self._snap: dict[str, dict] = {}
        self._update_due: set[str] = set()
        """Roles whose next optimizer step is measured for lost updates; a skipped step (fp16 scale
        calibration) passes the measurement on to the role's next optimizer step."""
        self._update_index: dict[tuple[str, int, str], torch.Tensor] = {}
        self._held_grads: dict[str, list[tuple[str, torch.Tensor]]] = {}
        self._checks: list[tuple] = []
        """Non-finite checks of boundary tensors, still on the device: read together in `_settle`."""
        self._failed_phase: str | None = None

    # -- context manager -------------------------------------------------------------------------
    def __enter__(self) -> Auditor:
        self.memory.start()
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        try:
            if exc is not None:
                self._settle()
                self.failure = self._failure(exc)
        finally:
            if self.probe is not None:
                self.probe.detach()
            self.memory.stop()
            self.findings.flush()
        return False  # never swallow: the worker records status from self.failure and exits 1

    @property
    def level(self) -> str:
        return self.settings.level

    def add_findings(self, findings: list[Finding]) -> None:
        self.findings.extend(findings)

    # -- observer protocol ------------------------------------------------------------------------
    def on_setup(self, *, config, policy, models, tokenizer_info) -> None:
        self.policy, self.models = policy, dict(models)
        self.tokenizer_info, self.config = dict(tokenizer_info), dict(config)
        self.names = {id(m): (role, n) for role, model in models.items() for n, m in model.named_modules()}
        self.model_vocab_size = boundaries.model_vocab_size(models.get("actor"))
        if self.level == "off":
            return
        for role, model in models.items():
            kind = "boundary/reward_model" if role == "reward" else "dtype/param_storage"
            self.add_findings(dtype_checks.check_param_storage(role, model, policy[role], kind=kind))
            self.add_findings(dtype_checks.check_buffers(role, model, policy[role]))
        if self.level == "full":
            self.probe = ModuleProbe(self, models)

    def on_step_start(self, step: int) -> None:
        self.step, self.in_backward = step, False
        self._timing = {}
        self.provenance.reset()
        self._num, self._snap, self._checks = {}, {}, []
        self.sampled = self.settings.is_full(step)
        if self.settings.measures_updates(step):
            self._update_due = set(TRAINABLE_ROLES)
        if self.probe is not None:
            self.probe.absmax = {}
            if self.sampled:
                self.probe.attach()
            else:
                self.probe.detach()

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        previous, self.phase_name = self.phase_name, name
        t0 = time.perf_counter()
        try:
            with self.memory.phase(name):
                yield
        except BaseException:
            if self._failed_phase is None:  # innermost phase first: that is where it died
                self._failed_phase = name
            raise
        finally:
            # verl's timing_s/<phase>: host wall time, no extra device sync (a sync per phase would
            # cost overlap). On a GPU, work still queued when a phase ends is counted in the phase
            # that next waits for it; the rollout and the optimizer step end on host reads.
            self._timing[name] = self._timing.get(name, 0.0) + time.perf_counter() - t0
            self.phase_name = previous

    def _ctx(self) -> dict[str, Any]:
        return {"step": self.step, "phase": self.phase_name}

    def on_batch(self, *, role, batch, source) -> None:
        if self.level != "off":
            self.add_findings(boundaries.check_batch(batch, role=role, source=source,
                                                     tokenizer_info=self.tokenizer_info, **self._ctx()))  # fmt: skip

    def on_rollout(self, *, engine, engine_dtype, actor_compute_dtype, prompt_ids, response_ids, response_mask,
                   logprobs) -> None:  # fmt: skip
        if self.level == "off":
            return
        self.add_findings(boundaries.check_rollout(
            engine=engine, engine_dtype=engine_dtype, actor_compute_dtype=actor_compute_dtype, prompt_ids=prompt_ids,
            response_ids=response_ids, response_mask=response_mask, logprobs=logprobs,
            vocab_size=self.tokenizer_info.get("vocab_size"), model_vocab_size=self.model_vocab_size,
            **self._ctx()))  # fmt: skip
        self._nonfinite_boundary("rollout", "rollout_logprobs", logprobs)

    def on_reward(self, *, source, raw, rewards, expected_shape, model) -> None:
        if self.level == "off":
            return
        self.add_findings(boundaries.check_reward(raw, rewards, source=source, expected_shape=tuple(expected_shape),
                                                  train_device=self.device, **self._ctx()))  # fmt: skip
        if model is not None and self.policy is not None:
            self.add_findings(dtype_checks.check_param_storage("reward", model, self.policy["reward"],
                                                               kind="boundary/reward_model", **self._ctx()))  # fmt: skip
        if isinstance(rewards, torch.Tensor) and rewards.numel():
            r = rewards.detach().float()
            self._num["reward/mean"], self._num["reward/std"] = float(r.mean()), float(r.std(unbiased=False))

    def on_forward(self, *, role, name, output) -> None:
        if self.level == "off" or self.policy is None:
            return
        self.add_findings(
            dtype_checks.check_boundary_output(role, name, output, self.policy[role], **self._ctx())
        )
        self._nonfinite_boundary(role, name, output)

    def _nonfinite_boundary(self, role: str, name: str, t: Any) -> None:
        if isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel():
            t = t.detach()
            # [has nan, has inf] stays on the device: no stream sync in the middle of the step
            self._checks.append(
                ("boundary", role, name, self._ctx(), torch.stack([t.isnan().any(), t.isinf().any()]))
            )

    def on_loss(self, *, role, loss, terms) -> None:
        self.in_backward = True  # forwards until on_backward are checkpoint recomputes
        if self.level == "off" or self.policy is None:
            return
        policy = self.policy[role]
        for name, t in {"loss": loss, **dict(terms)}.items():
            if (
                isinstance(t, torch.Tensor)
                and t.is_floating_point()
                and t.dtype not in (torch.float32, torch.float64)
            ):
                self.add_findings(dtype_checks.check_boundary_output(role, name, t, policy, **self._ctx()))
        if isinstance(loss, torch.Tensor) and loss.numel():
            names = [
                k
                for k, t in terms.items()
                if isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel()
            ]
            flags = [torch.isfinite(loss.detach()).all()] + [
                torch.isfinite(terms[k].detach()).all() for k in names
            ]
            value = loss.detach().float().reshape(-1)[:1]
            self._checks.append(("loss", role, names, self._ctx(), (torch.stack(flags), value)))

    def _settle(self) -> None:
        """Reads the step's pending boundary checks with one host read (a point where the trainer has
        synced anyway: the optimizer step, the step end, a failure) and turns them into findings."""
        if self.probe is not None:
            self.probe.flush()  # the full level's per-module maxima, read in the same sync
        checks, self._checks = self._checks, []
        if not checks:
            return
        parts = [
            c[4] if c[0] == "boundary" else torch.cat([c[4][0].float(), c[4][1].float()]) for c in checks
        ]
        dev = parts[0].device
        flat = torch.cat([x.float().reshape(-1).to(dev) for x in parts]).tolist()
        i = 0
        for (what, role, name, ctx, _), part in zip(checks, parts):
            vals, i = flat[i : i + part.numel()], i + part.numel()
            if what == "boundary":
                has_nan, has_inf = vals[0] > 0, vals[1] > 0
                if has_nan or has_inf:
                    self.add_findings([Finding(
                        severity="error", kind="numerics/nonfinite_boundary", role=role, where=name, **ctx,
                        observed="nan+inf" if has_nan and has_inf else ("nan" if has_nan else "inf"), expected="finite",
                        message=f"{name} of {role} holds non-finite values",
                        fix="see numerics/nonfinite_forward or numerics/overflow for the producing module "
                        "(audit.level: full on this step)",
                    )])  # fmt: skip
            elif vals[0] == 0:  # the loss is non-finite; name holds the term names, vals[1:-1] their flags
                self.provenance.loss_nonfinite = True
                bad = [k for k, ok in zip(name, vals[1:-1]) if ok == 0]
                self.add_findings([Finding(
                    severity="error", kind="numerics/nonfinite_loss", role=role, where="loss", **ctx,
                    observed={"loss": vals[-1], "nonfinite_terms": bad}, expected="finite",
                    message=f"{role} loss is non-finite" + (f" (terms: {', '.join(bad)})" if bad else ""),
                    fix="find the producer (numerics/nonfinite_forward, numerics/overflow); set "
                    "abort_on_nonfinite_loss to stop early",
                )])  # fmt: skip

    def on_backward(self, *, role, model, loss_scale) -> None:
        self.in_backward = False
        if self.level == "off" or self.policy is None:
            return
        params = list(model.named_parameters())
        self.add_findings(dtype_checks.check_grad_dtypes(role, params, self.policy[role], **self._ctx()))
        if self.sampled:
            stats = numerics.grad_stats(
                params, self.policy[role].compute_dtype, scale=loss_scale, nonfinite=False
            )
            key = f"numerics/{role}/grad_underflow_frac"
            self._num[key] = max(self._num.get(key, 0.0), stats.underflow_frac)
            self.add_findings(
                numerics.grad_findings(role, stats, self.policy[role], skipped=False, **self._ctx())
            )

    def on_before_optimizer_step(self, *, role, model, optimizer) -> None:
        if self.level == "off" or self.policy is None:
            return
        # References only, no device work: the trainer's scaler already checked every gradient
        # (scaler_state["found_inf"]), so they are counted in on_optimizer_step only when it found
        # some. zero_grad(set_to_none=True) drops the trainer's references, not these.
        self._held_grads[role] = [(n, p.grad) for n, p in model.named_parameters() if p.grad is not None]
        if role in self._update_due:
            self._snap[role] = numerics.snapshot(model.named_parameters(), cache=self._update_index)

    def on_optimizer_step(self, *, role, model, optimizer, scaler_state, skipped, grad_norm) -> None:
        if self.level == "off" or self.policy is None:
            return
        self._settle()
        policy = self.policy[role]
        if self.writer is not None:
            self.writer.event("optimizer_step", step=self.step, role=role, skipped=bool(skipped),
                              grad_norm=grad_norm, scaler=dict(scaler_state))  # fmt: skip
        self.add_findings(
            numerics.scaler_findings(role, scaler_state, bool(skipped), grad_norm, policy, **self._ctx())
        )
        if skipped:
            self._judge_overflow(role, model, scaler_state)
        held = self._held_grads.pop(role, [])
        found = scaler_state.get("found_inf")
        if found is None:  # a trainer without our LossScaler: a non-finite norm or a skip says the same
            found = bool(skipped) or not math.isfinite(float(grad_norm))
        key = f"numerics/{role}/nonfinite_grads"
        if found and held:
            stats = numerics.grad_counts(held, policy.compute_dtype, underflow=False)
            self._num[key] = self._num.get(key, 0) + stats.nonfinite
            self.add_findings(
                numerics.grad_findings(role, stats, policy, skipped=bool(skipped), **self._ctx())
            )
        else:
            self._num.setdefault(key, 0)
        del held
        snap = self._snap.pop(role, None)
        if snap and not skipped:
            self._update_due.discard(role)
            frac, per_module = numerics.update_underflow(snap, model.named_parameters())
            key = f"numerics/{role}/update_underflow_frac"
            self._num[key] = max(self._num.get(key, 0.0), frac)
            lr = optimizer.param_groups[0].get("lr") if hasattr(optimizer, "param_groups") else None
            self.add_findings(numerics.underflow_findings(role, frac, per_module, policy, lr, **self._ctx()))

    def _judge_overflow(self, role: str, model: nn.Module, scaler_state: Mapping[str, Any]) -> None:
        """A skipped step whose weights stayed finite: the scaler handled this step's fp16 overflow in
        ``role``'s update (calibration, not a fault), so its overflow and the non-finite loss / log-probs
        it caused become warnings. Overflows elsewhere (reference, rollout) stay errors: no scaler
        stands between them and the run."""
        ctx = (self.step, role, self.phase_name)
        found = self.findings.find("numerics/overflow", role=role)
        if not any((f.step, f.role, f.phase) == ctx and f.severity == "error" for f in found):
            return
        weights = [p.detach() for p in model.parameters() if p.is_floating_point()]
        weights = [w.to_local() if hasattr(w, "to_local") else w for w in weights]
        if weights and not bool(
            torch.isfinite(torch.stack([n.float() for n in torch._foreach_norm(weights, float("inf"))])).all()
        ):
            return  # non-finite values reached the weights: the errors stand
        backed = (
            f", loss scale backed off to {scaler_state.get('scale'):g}"
            if scaler_state.get("mode") == "dynamic"
            else ""
        )
        kinds = ("numerics/overflow", "numerics/nonfinite_loss", "numerics/nonfinite_boundary")
        self.findings.relabel(lambda f: f.kind in kinds and (f.step, f.role, f.phase) == ctx, "warning",
                              f"handled: the optimizer step was skipped{backed} and the weights stayed finite")  # fmt: skip

    def on_step_end(self, step: int, metrics: Mapping[str, float]) -> None:
        self._settle()
        self._held_grads.clear()
        out = dict(metrics)
        out.update(self.memory.step_metrics())
        out.update({f"timing_s/{name}": v for name, v in self._timing.items()})
        self._timing = {}
        if self.level != "off":
            for role in TRAINABLE_ROLES:
                if role in self.models:
                    out.setdefault(f"numerics/{role}/nonfinite_grads", 0)
            out.update(self._num)
            if self.probe is not None and self.sampled:
                for role, v in self.probe.absmax.items():
                    out[f"numerics/{role}/act_absmax"] = v
        counts = self.findings.take_step_counts()
        out["audit/findings/error"], out["audit/findings/warning"] = counts["error"], counts["warning"]
        out["audit/full"] = 1.0 if self.sampled else 0.0
        if self.writer is not None:
            self.writer.metrics(step, out)
        self.findings.flush()
        self.last_completed_step = step
        if self.probe is not None:
            self.probe.detach()

    # -- failures ---------------------------------------------------------------------------------
    def _failure(self, exc: BaseException) -> dict[str, Any]:
        """Status fields for an exception leaving the run; records the matching finding."""
        reason = errors.classify(exc)
        culprit = errors.innermost_module(exc.__traceback__, self.names)
        if culprit is None and self.probe is not None:
            culprit = self.probe.failed_in
        role, where = culprit if culprit else (None, None)
        ctx = {"step": self.step, "phase": self._failed_phase or self.phase_name}
        info: dict[str, Any] = {
            "reason": reason, **ctx, "error": errors.one_line(exc), "role": role, "where": where,
            "traceback": "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))[-8000:],
            "memory": self.memory.allocator_view(), "last_completed_step": self.last_completed_step,
        }  # fmt: skip
        if reason == "dtype_error":
            parsed = errors.parse_dtype_error(str(exc)) or {}
            obs, exp = parsed.get("observed"), parsed.get("expected")
            info.update(observed=obs, expected=exp)
            self.add_findings([Finding(
                severity="error", kind="runtime/dtype_error", role=role, where=where or "unknown", **ctx,
                observed=obs, expected=exp,
                message=f"{type(exc).__name__} in {where or 'an unidentified module'}: {errors.one_line(exc, 200)}",
                fix=_dtype_fix(obs, exp, where, self.policy, role),
            )])  # fmt: skip
        elif reason == "oom":
            view = info["memory"]
            self.add_findings([Finding(
                severity="error", kind="memory/oom", role=role, where=ctx["phase"] or where, **ctx, observed=view,
                expected=None, message=f"out of memory in phase {ctx['phase']} at step {self.step}",
                fix="precision.grad_checkpointing: true, a smaller algo.micro_batch_size, or a lower-memory preset "
                "(verl: actor_rollout_ref.model.enable_gradient_checkpointing, ppo_micro_batch_size_per_gpu)",
            )])  # fmt: skip
        self.findings.flush()
        return info


def _dtype_fix(obs: str | None, exp: str | None, where: str | None, policy: PrecisionPolicy | None,
               role: str | None) -> str:  # fmt: skip
    at = f" entering {where}" if where else ""
    if obs and exp and obs.startswith("fp") and exp.startswith("fp"):
        ac = ""
        if policy is not None and role in (policy.roles if policy else {}):
            ac = f" (policy: {role} computes in {dtype_checks.dn(policy[role].compute_dtype)}" + (
                ", autocast)" if policy[role].autocast else ", no autocast)"
            )
        return (
            f"a {obs} tensor{at} met {exp} weights outside autocast{ac}: run the forward under "
            f"torch.autocast(dtype={exp}) or cast the input with .to({exp}) where it crosses into the model; "
            "do not cast individual submodules to a different dtype"
        )
    if exp in ("int64", "int32"):
        return f"token ids{at} became {obs}: keep ids and masks torch.long in the collator"
    return "make both operands the same dtype at the boundary where they meet"
