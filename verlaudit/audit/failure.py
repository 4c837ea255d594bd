"""A run that died, as a result: the status fields for status.json and the finding that explains it.

`failure_status` classifies the exception (`errors.classify`) and gathers where it happened (step,
phase, the module that raised, the allocator's view); `failure_findings` turns that record into a
``runtime/dtype_error`` or ``memory/oom`` finding with a fix. Both are pure: the `Auditor` calls them
when an exception leaves its ``with`` block. Exercised by `pytest tests/test_audit_faults.py
tests/test_audit_probes.py tests/test_worker.py`.
"""

from __future__ import annotations

from typing import Any

from trainer.precision import PrecisionPolicy
from verlaudit import kinds as K
from verlaudit.audit import errors
from verlaudit.dtypes import dtype_name
from verlaudit.rundir import Finding


def failure_status(
    exc: BaseException,
    *,
    culprit: tuple[str, str] | None,
    step: int | None,
    phase: str | None,
    memory: dict[str, Any],
    last_completed_step: int | None,
) -> dict[str, Any]:
    """Status fields for an exception leaving the run. ``culprit``: (role, module path) that raised."""
    reason = errors.classify(exc)
    role, where = culprit if culprit else (None, None)
    info: dict[str, Any] = {
        "reason": reason,
        "step": step,
        "phase": phase,
        "error": errors.one_line(exc),
        "role": role,
        "where": where,
        "traceback": errors.format_traceback(exc),
        "memory": memory,
        "last_completed_step": last_completed_step,
    }
    if reason == "dtype_error":
        parsed = errors.parse_dtype_error(str(exc)) or {}
        info.update(observed=parsed.get("observed"), expected=parsed.get("expected"))
    return info


def failure_findings(
    exc: BaseException, status: dict[str, Any], policy: PrecisionPolicy | None
) -> list[Finding]:
    """The finding a dtype error or an out-of-memory error leaves; none for other failures."""
    role, where, phase, step = status["role"], status["where"], status["phase"], status["step"]
    if status["reason"] == "dtype_error":
        obs, exp = status["observed"], status["expected"]
        return [
            Finding(
                severity="error",
                kind=K.RUNTIME_DTYPE_ERROR,
                role=role,
                where=where or "unknown",
                step=step,
                phase=phase,
                observed=obs,
                expected=exp,
                message=f"{type(exc).__name__} in {where or 'an unidentified module'}: {errors.one_line(exc, 200)}",
                fix=dtype_fix(obs, exp, where, policy, role),
            )
        ]
    if status["reason"] == "oom":
        return [
            Finding(
                severity="error",
                kind=K.OOM,
                role=role,
                where=phase or where,
                step=step,
                phase=phase,
                observed=status["memory"],
                expected=None,
                message=f"out of memory in phase {phase} at step {step}",
                fix="precision.grad_checkpointing: true, a smaller algo.micro_batch_size, or a lower-memory preset "
                "(verl: actor_rollout_ref.model.enable_gradient_checkpointing, ppo_micro_batch_size_per_gpu)",
            )
        ]
    return []


def dtype_fix(
    obs: str | None, exp: str | None, where: str | None, policy: PrecisionPolicy | None, role: str | None
) -> str:
    """What to change when a ``obs`` tensor met ``exp`` weights (or ids became floats)."""
    at = f" entering {where}" if where else ""
    if obs and exp and obs.startswith("fp") and exp.startswith("fp"):
        ac = ""
        if policy is not None and role in policy.roles:
            rp = policy[role]
            ac = f" (policy: {role} computes in {dtype_name(rp.compute_dtype)}" + (
                ", autocast)" if rp.autocast else ", no autocast)"
            )
        return (
            f"a {obs} tensor{at} met {exp} weights outside autocast{ac}: run the forward under "
            f"torch.autocast(dtype={exp}) or cast the input with .to({exp}) where it crosses into the model; "
            "do not cast individual submodules to a different dtype"
        )
    if exp in ("int64", "int32"):
        return f"token ids{at} became {obs}: keep ids and masks torch.long in the collator"
    return "make both operands the same dtype at the boundary where they meet"
