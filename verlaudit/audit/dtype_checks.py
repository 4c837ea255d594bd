"""The dtype contract: pure checks of observed dtypes against a role's `RolePolicy`.

Probes (`verlaudit.audit.probes`) turn each module call into a `ModuleCall` record; the functions
here turn records (and whole models, at setup) into `Finding`s and touch no hooks or files.
What is NOT a finding: fp32 weights under autocast (autocast casts them per op), fp32 outputs of
norms / log-probs / losses where the policy lists that fp32 island. Exercised by
`pytest tests/test_audit_checks.py`.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping

import torch
from torch import nn

from trainer.precision import TRAINABLE_ROLES, RolePolicy
from verlaudit import kinds as K
from verlaudit.dtypes import dtype_name as dn
from verlaudit.rundir import Finding

LOW = (torch.float16, torch.bfloat16)
INT_KEY = re.compile(r"(^|_)(input_ids|ids|labels|attention_mask|mask|position_ids)$")
"""Batch / keyword names that must hold integer (or bool) tensors: token ids, labels, masks."""

VERL_ROLLOUT_DTYPE = "actor_rollout_ref.rollout.dtype"
VERL_MODEL_DTYPE = "actor_rollout_ref.actor.fsdp_config.model_dtype"


def module_kind(name: str, module: nn.Module) -> str:
    """``embedding`` | ``norm`` | ``rotary`` | ``linear`` | ``other`` — decides which rules apply."""
    leaf = name.rsplit(".", 1)[-1].lower()
    cls = type(module).__name__.lower()
    if isinstance(module, nn.Embedding):
        return "embedding"
    if "norm" in leaf or "norm" in cls:
        return "norm"
    if "rotary" in leaf or "rotary" in cls:
        return "rotary"
    if isinstance(module, nn.Linear) or cls in ("conv1d",):
        return "linear"
    return "other"


@dataclasses.dataclass(frozen=True)
class ModuleCall:
    """What a forward hook saw for one call of one module (dtypes only: cheap and hashable)."""

    role: str
    name: str
    kind: str
    param_dtypes: tuple[torch.dtype, ...]
    """Distinct dtypes of the module's own floating parameters (not its children's)."""
    autocast: torch.dtype | None
    """The autocast dtype when autocast was on for the tensors' device, else None."""
    inputs: tuple[tuple[str, torch.dtype], ...]
    """(argument name or position, dtype) of the tensor inputs."""
    outputs: tuple[torch.dtype, ...]
    """Dtypes of the floating outputs."""


# long: one independent check per finding on a module's call
def check_module_call(
    call: ModuleCall, policy: RolePolicy, *, step: int | None, phase: str | None, stage: str = "all"
) -> list[Finding]:
    """Findings for one module call under ``policy`` (the role's, or the rollout's during rollout).
    ``stage``: ``pre`` checks parameters and inputs (before the forward runs, so a forward that then
    raises is already explained), ``post`` the outputs, ``all`` both."""
    out: list[Finding] = []
    where = call.name or "<root>"

    def add(severity: str, kind: str, message: str, observed, expected, fix: str) -> None:
        out.append(
            Finding(
                severity=severity,
                kind=kind,
                role=call.role,
                where=where,
                step=step,
                phase=phase,
                observed=observed,
                expected=expected,
                message=message,
                fix=fix,
            )
        )

    if stage == "post":
        _check_outputs(call, policy, add)
        return out
    if len(call.param_dtypes) > 1:
        add(
            "warning",
            K.MIXED_PARAMS,
            f"{where} holds parameters in {_names(call.param_dtypes)}",
            _names(call.param_dtypes),
            dn(policy.param_dtype),
            f"cast the whole module: module.to({_torch(policy.param_dtype)})",
        )
    own = call.param_dtypes[0] if len(call.param_dtypes) == 1 else None
    floats = [(k, d) for k, d in call.inputs if d.is_floating_point]
    ints = [(k, d) for k, d in call.inputs if not d.is_floating_point and d != torch.bool]

    if call.kind == "embedding":
        for _k, d in floats:
            add(
                "error",
                K.INT_BECAME_FLOAT,
                f"token ids entering embedding {where} are {dn(d)}",
                dn(d),
                "int64",
                "keep token ids integer: do not .to(dtype) or .float() the batch; cast only "
                "floating tensors (e.g. `{k: v.to(dtype) if v.is_floating_point() else v}`)",
            )
            break
    if not call.name:  # the model's own entry point: ids and masks must arrive as integers
        for k, d in floats:
            if INT_KEY.search(k) and k != "attention_mask":
                add(
                    "error",
                    K.INT_BECAME_FLOAT,
                    f"{k} reached the {call.role} model as {dn(d)}",
                    dn(d),
                    "int64",
                    f"pass {k} as a torch.long tensor",
                )
                break
    if call.kind in ("linear", "norm") and ints:
        k, d = ints[0]
        add(
            "error",
            K.FLOAT_BECAME_INT,
            f"{where} received an integer tensor ({dn(d)}) as {k}",
            dn(d),
            dn(policy.compute_dtype),
            "activations must stay floating; look for .long()/.int() upstream",
        )

    if call.autocast is None and own in LOW:
        for _k, d in floats:
            if d != own:
                add(
                    "error",
                    K.MODULE_INPUT,
                    f"{dn(d)} activations enter {dn(own)} module {where} outside autocast",
                    dn(d),
                    dn(own),
                    f"run this forward under torch.autocast(dtype={_torch(policy.compute_dtype)}), or cast the "
                    f"input with .to({_torch(own)}) at the role boundary",
                )
                break
    if call.kind == "linear" and policy.low_precision:
        effective = call.autocast if call.autocast is not None else own
        if effective is not None and effective != policy.compute_dtype:
            # fp32 where the policy says low precision: slower, never less precise; on a frozen role
            # (reward, reference: a user's fp32 model) it costs time only, so it is information
            sev = (
                "error"
                if effective != torch.float32
                else "info"
                if call.role not in TRAINABLE_ROLES
                else "warning"
            )
            add(
                sev,
                K.COMPUTE,
                f"{where} computed in {dn(effective)}; the {call.role} policy says "
                f"{dn(policy.compute_dtype)}",
                dn(effective),
                dn(policy.compute_dtype),
                f"wrap the {call.role} forward in policy['{call.role}'].autocast_ctx(device)"
                if policy.autocast
                else f"store the {call.role} weights in {dn(policy.compute_dtype)} (cast_model) "
                f"or enable autocast for it",
            )
    if stage == "all":
        _check_outputs(call, policy, add)
    return out


def _check_outputs(call: ModuleCall, policy: RolePolicy, add) -> None:
    where = call.name or "<root>"
    if (
        call.kind == "norm"
        and call.autocast in LOW
        and "norm" in policy.fp32_islands
        and any(d in LOW for d in call.outputs)
    ):
        add(
            "warning",
            K.ISLAND,
            f"norm {where} produced {_names(call.outputs)} under autocast; the policy keeps norms in fp32",
            _names(call.outputs),
            "fp32",
            "keep norm weights in fp32 under autocast (do not cast norms to the compute dtype)",
        )
    low_out = [d for d in call.outputs if d in LOW]
    floats_in = [d for _, d in call.inputs if d.is_floating_point]
    # nothing low-precision went in (inputs, own weights) and no autocast: a low-precision output was cast
    if (
        call.autocast is None
        and low_out
        and (floats_in or call.param_dtypes)
        and not any(d in LOW for d in (*floats_in, *call.param_dtypes))
    ):
        came = _names(tuple(floats_in) or call.param_dtypes)
        sev = "warning" if policy.compute_dtype in LOW else "error"
        add(
            sev,
            K.MODULE_OUTPUT,
            f"{where} returned {dn(low_out[0])} from {came} inputs and weights outside "
            f"autocast: a cast in its forward or in a forward hook (the {call.role} policy computes in "
            f"{dn(policy.compute_dtype)})",
            dn(low_out[0]),
            came,
            "remove the cast (a .to()/.half()/.bfloat16() in the forward or a forward hook): the modules after it "
            "compute on the lost precision or fail on mixed dtypes",
        )


def check_boundary_output(
    role: str, name: str, tensor: torch.Tensor, policy: RolePolicy, *, step: int | None, phase: str | None
) -> list[Finding]:
    """Log-probs, values and losses crossing into the algorithm must be fp32 islands."""
    island = "logprobs" if "logp" in name else "loss"
    if not isinstance(tensor, torch.Tensor) or not tensor.is_floating_point():
        dt = tensor.dtype if isinstance(tensor, torch.Tensor) else type(tensor).__name__
        return [Finding(severity="error", kind=K.ISLAND_NOT_FLOAT, role=role, where=name, step=step,
                        phase=phase, observed=str(dt), expected="fp32",
                        message=f"{name} of {role} is not a floating tensor ({dt})",
                        fix="compute it from the logits with trainer.logprobs (fp32)")]  # fmt: skip
    if tensor.dtype == torch.float32 or tensor.dtype == torch.float64:
        return []
    return [Finding(
        severity="error", kind=K.ISLAND, role=role, where=name, step=step, phase=phase,
        observed=dn(tensor.dtype), expected="fp32",
        message=f"{name} of {role} arrived in {dn(tensor.dtype)}; the policy keeps {island} in fp32 "
        f"(low-precision log-probs make PPO ratios and KL noisy)",
        fix="upcast the logits before log_softmax (trainer.logprobs.logprobs_from_logits) / take values "
        "and losses in fp32",
    )]  # fmt: skip


def check_param_storage(
    role: str,
    model: nn.Module,
    policy: RolePolicy,
    *,
    kind: str = K.PARAM_STORAGE,
    step: int | None = None,
    phase: str | None = None,
) -> list[Finding]:
    """One finding per role when parameters are not stored in ``policy.param_dtype``."""
    counts: dict[torch.dtype, int] = {}
    first: dict[torch.dtype, str] = {}
    for name, p in model.named_parameters():
        if p.is_floating_point():
            counts[p.dtype] = counts.get(p.dtype, 0) + p.numel()
            first.setdefault(p.dtype, name)
    wrong = {d: n for d, n in counts.items() if d != policy.param_dtype}
    if not wrong:
        return []
    d = max(wrong, key=lambda x: wrong[x])
    total = sum(counts.values())
    where = first[d].rsplit(".", 1)[0]
    # a frozen role kept WIDER than the policy (a user's fp32 reward model under bf16) loses nothing: its
    # forward is at least as precise as the policy asks; it costs memory only: information, not a fault
    wider = role not in TRAINABLE_ROLES and all(
        torch.finfo(x).bits > torch.finfo(policy.param_dtype).bits for x in wrong
    )
    reason = str((policy.reasons or {}).get("param_dtype", ""))
    if reason.startswith("per-role override"):  # setup12: the suite asked for this dtype by a key
        return [_not_realised(role, policy, counts, wrong, d, first[d], wider, step=step, phase=phase)]
    return [Finding(
        severity="info" if wider else "error", kind=kind, role=role, where=where, step=step, phase=phase,
        observed={dn(k): v for k, v in counts.items()}, expected=dn(policy.param_dtype),
        message=f"{wrong[d]} of {total} {role} parameters are stored in {dn(d)} (first: {first[d]}); the policy "
        f"stores {role} weights in {dn(policy.param_dtype)}"
        + (" (wider: more memory, no precision lost; a frozen role)" if wider else ""),
        fix=f"load/cast the {role} model with dtype={_torch(policy.param_dtype)} (trainer.precision.cast_model), "
        f"or set precision.overrides.{role}.param_dtype; verl: {VERL_MODEL_DTYPE}",
    )]  # fmt: skip


def _not_realised(role, policy, counts, wrong, d, first, wider, *, step, phase) -> Finding:
    """setup12: ``precision.overrides.<role>.param_dtype`` asked for one dtype and the model that the
    loader or setup built holds another: the run is not the precision the suite says."""
    key = f"precision.overrides.{role}.param_dtype"
    want = dn(policy.param_dtype)
    total = sum(counts.values())
    source = {"reward": "model.reward_model", "critic": "model.critic_path"}.get(
        role, "model.path / model.setup"
    )
    return Finding(
        severity="warning" if wider else "error", kind=K.PRECISION_NOT_REALISED, role=role, where=key,
        step=step, phase=phase, observed={dn(k): v for k, v in counts.items()}, expected=want,
        message=f"{key}: {want} was asked for, but the {role} model as built holds {wrong[d]} of its {total} "
        f"parameters in {dn(d)} (first: {first}): the loader or setup that built it ({source}) ignored the "
        f"role's dtype (the trainer leaves a loader's module as returned), so the {role} runs in {dn(d)}, not "
        f"the {want} the suite configures (configured and effective precision differ)",
        fix=f"cast the {role} model to the role's dtype in its loader (model.to(dtype) with the dtype passed in, "
        f"e.g. {_torch(policy.param_dtype)} / .half(), or from_pretrained(torch_dtype=...) honouring it), or drop "
        f"the override {key} so the suite says what runs",
    )  # fmt: skip


def check_buffers(role: str, model: nn.Module, policy: RolePolicy) -> list[Finding]:
    """Floating buffers kept in a dtype that loses precision (rotary ``inv_freq`` in bf16/fp16),
    one finding per module."""
    by_module: dict[str, list[tuple[str, torch.dtype]]] = {}
    for name, b in model.named_buffers():
        if b.is_floating_point() and b.dtype in LOW and "inv_freq" in name:
            by_module.setdefault(name.rsplit(".", 1)[0], []).append((name.rsplit(".", 1)[-1], b.dtype))
    out = []
    promised = "rotary" in policy.fp32_islands
    for module, bufs in by_module.items():
        d = bufs[0][1]
        out.append(
            Finding(
                severity="warning" if promised else "info",
                kind=K.BUFFER_PRECISION,
                role=role,
                where=module,
                observed={n: dn(x) for n, x in bufs},
                expected="fp32",
                message=f"rotary buffers {', '.join(n for n, _ in bufs)} of {module} are stored in {dn(d)}: "
                f"positions above {_exact_int_limit(d)} collide"
                + ("" if promised else " (the policy accepts it)"),
                fix="after model.to(dtype), restore the rotary buffers in fp32 (module.inv_freq = "
                "module.inv_freq.float()); HF recomputes cos/sin from inv_freq in fp32 only if it is fp32",
            )
        )
    return out


def check_grad_dtypes(
    role: str,
    named_params: Mapping[str, torch.Tensor] | list,
    policy: RolePolicy,
    *,
    step: int | None,
    phase: str | None,
) -> list[Finding]:
    """``.grad`` dtype against ``policy.grad_dtype`` (one finding per role, first parameter named)."""
    for name, p in named_params:
        g = getattr(p, "grad", None)
        if g is not None and g.dtype != policy.grad_dtype:
            return [Finding(
                severity="error", kind=K.GRAD, role=role, where=name.rsplit(".", 1)[0], step=step,
                phase=phase, observed=dn(g.dtype), expected=dn(policy.grad_dtype),
                message=f"gradient of {name} is {dn(g.dtype)}; the policy accumulates {role} gradients "
                f"in {dn(policy.grad_dtype)}",
                fix="keep master weights in the grad dtype (gradients take the parameter's dtype)",
            )]  # fmt: skip
    return []


def _exact_int_limit(dtype: torch.dtype) -> int:
    # consecutive integers stay exact up to 2**(mantissa bits + 1): bf16 keeps 7 bits, fp16 10
    return {torch.bfloat16: 2**8, torch.float16: 2**11}.get(dtype, 2**24)


def _names(dtypes) -> str:
    return "/".join(sorted({dn(d) for d in dtypes}))


def _torch(dtype: torch.dtype) -> str:
    return str(dtype)
