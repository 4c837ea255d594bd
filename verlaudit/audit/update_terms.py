"""Terms of the optimizer's update below the storage resolution of the weights they are applied to: a
decoupled weight decay (AdamW's ``p.mul_(1 - lr x weight_decay)``) smaller than half the spacing of the
parameter's dtype at its magnitude rounds back to the same weight, in place, and the decay never happens.
In bf16 that is every weight once lr x weight_decay < 2^-9 (about 2e-3), in fp16 below 2^-11; verl's and
most recipes' lr x weight_decay is 1e-5 to 1e-8. fp32 master weights (the optimizer steps fp32 copies) keep
it.

`decay_lost` measures it on an audited optimizer step, on the sample of each parameter the update-underflow
measurement takes before the step (`verlaudit.audit.numerics.snapshot`): the share of sampled nonzero
weights for which ``w x (1 - lr x wd)`` rounded to the parameter's dtype is ``w`` again, for the
parameters the optimizer steps in a low-precision dtype with a decoupled decay. `decay_findings` makes the
finding. (The whole update rounding away, a tiny lr, is ``numerics/update_underflow``.) Exercised by
`pytest tests/test_update_terms.py`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

from verlaudit import kinds as K
from verlaudit.dtypes import dtype_name as dn
from verlaudit.rundir import Finding

LOST_WARN = 0.5
"""The share of sampled weights whose decay rounded away past which it is a finding."""
LOW = (torch.bfloat16, torch.float16)
_HALF_SPACING = {torch.bfloat16: 2.0**-9, torch.float16: 2.0**-11}
"""Half the relative spacing of a dtype at the bottom of a binade: lr x wd below it loses the decay always."""


def decoupled(optimizer: Any, group: Mapping[str, Any]) -> bool:
    """Whether the optimizer applies ``weight_decay`` to the weights directly (AdamW, Lion), not through
    the gradient (Adam, SGD: L2, which is part of the update)."""
    if group.get("decoupled_weight_decay"):
        return True
    name = type(optimizer).__name__.lower()
    return "adamw" in name or "lion" in name or "lamb" in name


def decay_lost(
    optimizer: Any, named_params: Iterable[tuple[str, torch.Tensor]], snap: Mapping[str, tuple]
) -> dict[str, Any] | None:
    """On the weights sampled before the step (`snap`: name -> (index, values, grad != 0)): how many
    low-precision weights of the decaying groups the decay leaves unchanged. None when no group decays
    a low-precision parameter."""
    groups = getattr(optimizer, "param_groups", None)
    if not groups:
        return None
    names = {id(p): n for n, p in named_params}
    lost = total = 0
    dtypes: dict[str, int] = {}
    worst: dict[str, float] = {}
    terms: set[tuple[float, float]] = set()
    for g in groups:
        wd, lr = float(g.get("weight_decay") or 0.0), g.get("lr")
        lr = float(lr.item() if isinstance(lr, torch.Tensor) else lr or 0.0)
        if wd <= 0 or lr <= 0 or not decoupled(optimizer, g):
            continue
        for p in g.get("params", []):
            name = names.get(id(p))
            if name is None or name not in snap or p.dtype not in LOW:
                continue
            old = snap[name][1]
            nz = old != 0
            if not bool(nz.any()):
                continue
            kept = (old.float() * (1.0 - lr * wd)).to(old.dtype) == old
            n_lost, n = int((kept & nz).sum()), int(nz.sum())
            lost, total = lost + n_lost, total + n
            dtypes[dn(p.dtype)] = dtypes.get(dn(p.dtype), 0) + n
            worst[name.rsplit(".", 1)[0]] = max(worst.get(name.rsplit(".", 1)[0], 0.0), n_lost / n)
            terms.add((lr, wd))
    if not total:
        return None
    lr, wd = min(terms)
    dtype = max(dtypes, key=lambda k: dtypes[k])
    return {
        "fraction": round(lost / total, 4),
        "sampled": total,
        "dtype": dtype,
        "lr": lr,
        "weight_decay": wd,
        "top_modules": dict(sorted(worst.items(), key=lambda kv: -kv[1])[:5]),
    }


def decay_findings(
    role: str, got: Mapping[str, Any] | None, *, step: int, phase: str | None
) -> list[Finding]:
    """A ``numerics/decay_rounded_away`` warning when most sampled weights kept their value under the decay."""
    if not got or got["fraction"] <= LOST_WARN:
        return []
    lr, wd, dt = got["lr"], got["weight_decay"], got["dtype"]
    half = _HALF_SPACING.get({"bf16": torch.bfloat16, "fp16": torch.float16}.get(dt, torch.bfloat16), 2.0**-9)
    lr_key = "algo.critic_lr" if role == "critic" else "algo.lr"
    return [
        Finding(
            severity="warning",
            kind=K.DECAY_ROUNDED_AWAY,
            role=role,
            where="algo.weight_decay",
            step=step,
            phase=phase,
            observed=dict(got),
            expected=f"lr x weight_decay at least {2 * half:.2g} for {dt} weights, or fp32 master weights",
            message=f"algo.weight_decay {wd:g} at {lr_key} {lr:g} on {dt} weights (no fp32 master copy): the decoupled "
            f"decay multiplies each weight by 1 - {lr * wd:.3g}, below half the {dt} spacing at any magnitude "
            f"({half:.2g} relative), so it rounds back to the same weight: {got['fraction']:.0%} of "
            f"{got['sampled']} sampled {role} weights kept their value under it on this step; the weight decay "
            "is lost (rounded away) and never happens",
            fix=f"keep fp32 master weights so the decay is applied to fp32 copies (precision.preset: bf16, i.e. {dt} "
            f"compute with fp32 params; verl: actor_rollout_ref.actor.fsdp_config.model_dtype=fp32), or drop the "
            f"decay that cannot act (algo.weight_decay: 0); a {dt}-stored decay needs lr x weight_decay >= "
            f"{2 * half:.2g}",
        )
    ]
