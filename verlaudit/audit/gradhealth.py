"""Gradient health in low precision, per module: fp16 underflow at the current loss scale, and the
updates bf16 (or any) master weights lose to rounding.

`fp16_underflow` reads the gradients as the backward left them (still multiplied by the loss scale,
which is what the fp16 backward held) and counts per module the elements that are zero and those
below fp16's smallest normal (2^-14: subnormal in fp16, losing bits; below 2^-25 they round to 0),
from one histogram of binary exponents per parameter; from the same histogram it gives the loss
scale that would lift all but `KEEP_FRAC` of the non-zero elements to normal numbers and the largest
scale that keeps the largest one under fp16's max / 8 (`module_numerics.HEADROOM`). Zeros can be real
(an unused embedding row) or underflowed; the fp32 shadow's ``param_grad`` records tell them apart
(``zero_lost_frac``). `update_loss` turns `numerics.update_underflow_rows` (the sampled elements a step
left unchanged despite a non-zero gradient) into per-module records. `findings` names the worst
module. Exercised by `pytest tests/test_audit_gradhealth.py`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from verlaudit import kinds as K
from verlaudit.audit.module_numerics import HEADROOM
from verlaudit.audit.numerics import GRAD_UNDERFLOW_WARN
from verlaudit.rundir import Finding

KEEP_FRAC = 1e-3
"""Fraction of the non-zero gradient elements that may stay subnormal at the suggested scale."""
OFFSET = 160
"""Shift of binary exponents (frexp: |x| in [2^(e-1), 2^e)) into histogram bins; fp32 spans -148..128."""
BINS = 320
TINY_EXP = -14
"""fp16's smallest normal is 2^-14: |g| < 2^-14 exactly when frexp's exponent is <= -14."""
MAX_EXP = int(math.floor(math.log2(torch.finfo(torch.float16).max * HEADROOM)))
"""The largest power of two under fp16's max / 8 (2^12)."""


def _module_of(param: str) -> str:
    return param.rpartition(".")[0]


def exponent_histograms(
    named_grads: Iterable[tuple[str, torch.Tensor | None]],
) -> dict[str, tuple[int, int, list[int]]]:
    """Per module: (elements, zeros, histogram of frexp exponents of the non-zero elements), summed
    over its parameters, with one host read for all of them."""
    names, parts = [], []
    for name, g in named_grads:
        if g is None or not g.is_floating_point():
            continue
        g = g.to_local() if hasattr(g, "to_local") else g
        if not g.numel():  # no gradient elements, or an FSDP rank's empty shard
            continue
        flat = g.detach().reshape(-1)
        exp = torch.frexp(flat.float()).exponent.clamp_(-OFFSET, BINS - OFFSET - 1) + OFFSET
        hist = torch.bincount(exp.long(), minlength=BINS)
        zeros = (flat == 0).sum()
        hist[OFFSET] -= zeros  # frexp(0) has exponent 0: those are the zeros, not values in [0.5, 1)
        parts.append(torch.cat([torch.stack([zeros, torch.tensor(flat.numel(), device=flat.device)]), hist]))
        names.append(name)
    if not parts:
        return {}
    dev = parts[0].device
    rows = torch.stack([p.to(dev) for p in parts]).tolist()  # the one read
    out: dict[str, tuple[int, int, list[int]]] = {}
    for name, row in zip(names, rows):
        mod = _module_of(name)
        zeros, n, hist = int(row[0]), int(row[1]), [int(x) for x in row[2:]]
        if mod in out:
            n0, z0, h0 = out[mod]
            out[mod] = (n0 + n, z0 + zeros, [a + b for a, b in zip(h0, hist)])
        else:
            out[mod] = (n, zeros, hist)
    return out


def scales(hist: list[int], scale: float, keep_frac: float = KEEP_FRAC) -> tuple[float | None, float | None]:
    """(scale_keep, scale_max) for gradients held at ``scale`` with exponent histogram ``hist``:
    the scale at which all but ``keep_frac`` of the non-zero elements are fp16 normals, and the
    largest scale whose largest element stays under 2^`MAX_EXP`; powers of two times ``scale``.
    None when there is no non-zero element."""
    nonzero = sum(hist)
    if not nonzero:
        return None, None
    allowed, acc, e_q = keep_frac * nonzero, 0, None
    for i, c in enumerate(hist):
        acc += c
        if c and acc > allowed:
            e_q = i - OFFSET  # the smallest exponent whose elements must be kept
            break
    e_max = max(i for i, c in enumerate(hist) if c) - OFFSET
    # |x| >= 2^(e_q - 1): times 2^(TINY_EXP - e_q + 1) it is >= 2^TINY_EXP;  |x| < 2^e_max: times 2^(MAX_EXP - e_max) < 2^MAX_EXP
    return scale * 2.0 ** (TINY_EXP - e_q + 1), scale * 2.0 ** (MAX_EXP - e_max)


def fp16_underflow(
    role: str,
    named_grads: Iterable[tuple[str, torch.Tensor | None]],
    scale: float,
    *,
    step: int | None,
    phase: str | None,
) -> list[dict[str, Any]]:
    """Per-module records of gradients held at loss scale ``scale`` (see the module docstring)."""
    out = []
    for mod, (n, zeros, hist) in exponent_histograms(named_grads).items():
        sub = sum(hist[: TINY_EXP + OFFSET + 1])  # exponents <= -14
        keep, most = scales(hist, scale)
        out.append(
            {
                "measure": "fp16_underflow",
                "role": role,
                "module": mod,
                "step": step,
                "phase": phase,
                "elements": n,
                "zero_frac": zeros / n,
                "subnormal_frac": sub / n,
                "scale": scale,
                "scale_keep": keep,
                "scale_max": most,
                "fits": None if keep is None else keep <= most,
            }
        )
    return out


def update_loss(
    role: str,
    rows: Iterable[Mapping[str, Any]],
    *,
    param_dtype: str,
    lr: float | None,
    step: int | None,
    phase: str | None,
) -> list[dict[str, Any]]:
    """Per-module records from `numerics.update_underflow_rows`."""
    return [
        {
            "measure": "update_loss",
            "role": role,
            "step": step,
            "phase": phase,
            "param_dtype": param_dtype,
            "lr": lr,
            **dict(r),
        }
        for r in rows
    ]


def findings(records: list[Mapping[str, Any]], warn: float = GRAD_UNDERFLOW_WARN) -> list[Finding]:
    """One warning per role whose fp16 gradients sit below the smallest normal in more than ``warn``
    of some module's elements, naming the worst module and the scale that would keep them."""
    out = []
    by_role: dict[str, list[Mapping[str, Any]]] = {}
    for r in records:
        if r.get("measure") == "fp16_underflow" and r["subnormal_frac"] > warn:
            by_role.setdefault(r["role"], []).append(r)
    for role, rows in by_role.items():
        worst = max(rows, key=lambda r: r["subnormal_frac"])
        keep, most = worst["scale_keep"], worst["scale_max"]
        if keep is not None and keep <= most:
            fix = (
                f"raise the loss scale to {keep:g} (precision.overrides.{role}.init_scale; at most {most:g} "
                "before the largest gradient nears fp16's max), or use bf16"
            )
        else:
            fix = (
                f"no single fp16 loss scale fits: keeping the small gradients needs {keep:g}, the largest allows "
                f"{most:g}; use bf16 (fp32's exponent range)"
            )
        out.append(
            Finding(
                severity="warning",
                kind=K.FP16_UNDERFLOW,
                role=role,
                where=worst["module"],
                step=worst["step"],
                phase=worst["phase"],
                observed={
                    "subnormal_frac": round(worst["subnormal_frac"], 4),
                    "zero_frac": round(worst["zero_frac"], 4),
                    "scale": worst["scale"],
                    "scale_keep": keep,
                    "scale_max": most,
                    "modules_over": len(rows),
                },
                expected=f"<= {warn} of elements below fp16's smallest normal (6.1e-05)",
                message=f"{worst['subnormal_frac']:.1%} of {worst['module']}'s gradient elements are below fp16's smallest "
                f"normal at loss scale {worst['scale']:g} ({len(rows)} module(s) over {warn:.0%})",
                fix=fix,
            )
        )
    return out
