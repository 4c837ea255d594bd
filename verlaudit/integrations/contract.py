"""The precision contract of a run audited in place: given (a preset name or a `PrecisionPolicy`), or
inferred from the models' parameters and the autocast the forward runs under.

`resolve` returns the `PrecisionPolicy` the auditor checks against and a record of where it came from
(``source``: ``policy``, ``preset`` or ``inferred``, with the facts it was read from) for the manifest.
An inferred contract states what the run does, so it flags only what breaks it from within (a
collator's float ids, a bf16 reward, a role whose dtype changes mid-run), never the choice itself.
Exercised by `pytest tests/test_integrations_watch.py -k contract`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from trainer.precision import PRESETS, TRAINABLE_ROLES, PrecisionPolicy, resolve_policy
from verlaudit.dtypes import dtype_name as dn


def main_dtype(model: nn.Module) -> torch.dtype | None:
    """The dtype holding most of ``model``'s floating parameters (None without any)."""
    counts: dict[torch.dtype, int] = {}
    for p in model.parameters():
        if p.is_floating_point():
            counts[p.dtype] = counts.get(p.dtype, 0) + p.numel()
    return max(counts, key=lambda d: counts[d]) if counts else None


def param_dtype(model: nn.Module) -> torch.dtype:
    """`main_dtype`, fp32 for a model without floating parameters."""
    return main_dtype(model) or torch.float32


def active_autocast(device_type: str) -> torch.dtype | None:
    """The dtype of the autocast active on ``device_type`` now, or None."""
    if not torch.is_autocast_enabled(device_type):
        return None
    return torch.get_autocast_dtype(device_type)


def preset_for(actor_dtype: torch.dtype, autocast: torch.dtype | None) -> str:
    """The preset whose actor matches: fp32 weights under bf16 / fp16 autocast are ``bf16`` / ``fp16``;
    bf16 weights without autocast are ``bf16-pure``; anything else starts from ``fp32`` (with overrides)."""
    if actor_dtype == torch.float32:
        return {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(autocast, "fp32")  # type: ignore[arg-type]
    if actor_dtype == torch.bfloat16 and autocast in (None, torch.bfloat16):
        return "bf16-pure"
    return "fp32"


def contract_for(
    preset: str,
    models: Mapping[str, nn.Module],
    *,
    autocast: torch.dtype | None,
    device: str | torch.device,
    loss_scaling: str | None = None,
    reason: str,
) -> PrecisionPolicy:
    """``preset`` with each present role's storage set to what its model holds (frozen roles compute
    under the same autocast), every reason replaced by ``reason``."""
    overrides: dict[str, dict[str, Any]] = {}
    base = resolve_policy(preset, device=device, where="precision")
    for role, model in models.items():
        if role not in base.roles:
            continue
        pd = param_dtype(model)
        want = base[role]
        if pd == want.param_dtype and (role in TRAINABLE_ROLES or autocast in (None, want.compute_dtype)):
            continue
        cd = autocast if (autocast is not None and pd == torch.float32) else pd
        overrides[role] = {"param_dtype": pd, "compute_dtype": cd}
    if loss_scaling is not None:
        for role in TRAINABLE_ROLES:
            if role in models:
                overrides.setdefault(role, {})["loss_scaling"] = loss_scaling
    policy = resolve_policy(preset, overrides, device=device, where="precision")
    roles = {
        r: dataclasses.replace(
            p, reasons={f: reason for f in ("param_dtype", "compute_dtype", "loss_scaling")}
        )
        for r, p in policy.roles.items()
    }
    return PrecisionPolicy(preset=preset, roles=roles)


def resolve(
    precision: str | PrecisionPolicy | None,
    models: Mapping[str, nn.Module],
    *,
    device: str | torch.device,
    autocast: torch.dtype | None,
    scaler: bool,
) -> tuple[PrecisionPolicy, dict[str, Any]]:
    """(policy, how it was decided). ``precision``: a `PrecisionPolicy` (used as it is), a preset
    name (resolved for ``device``), or None (inferred from the actor's parameter dtype and
    ``autocast``, the autocast dtype seen around the models' first forward or at entry)."""
    if isinstance(precision, PrecisionPolicy):
        return precision, {"source": "policy", "preset": precision.preset}
    if isinstance(precision, str):
        if precision not in PRESETS:
            raise ValueError(
                f"watch(precision={precision!r}): unknown preset; expected one of {', '.join(PRESETS)}, "
                "a trainer.precision.PrecisionPolicy, or None to infer it from the model"
            )
        return resolve_policy(precision, device=device), {"source": "preset", "preset": precision}
    if precision is not None:
        raise ValueError(
            f"watch(precision=...): got a {type(precision).__name__}; pass a preset name "
            f"({', '.join(PRESETS)}), a trainer.precision.PrecisionPolicy, or None"
        )
    actor = models.get("actor") or next(iter(models.values()))
    pd = param_dtype(actor)
    preset = preset_for(pd, autocast)
    facts = {
        "actor_param_dtype": dn(pd),
        "autocast": dn(autocast) if autocast else None,
        "grad_scaler": scaler,
    }
    reason = (
        f"inferred: actor parameters {dn(pd)}, "
        + (f"autocast {dn(autocast)}" if autocast else "no autocast")
        + (", a GradScaler" if scaler else "")
    )
    policy = contract_for(
        preset,
        models,
        autocast=autocast,
        device=device,
        loss_scaling="dynamic" if scaler else None,
        reason=reason,
    )
    return policy, {"source": "inferred", "preset": preset, "from": facts}
