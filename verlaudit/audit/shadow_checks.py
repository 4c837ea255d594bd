"""Pure functions over the fp32 shadow's records (`verlaudit.audit.shadow`): findings and metrics.

`culprits` picks the modules whose own error exceeds what their dtype's rounding explains and that
contain no such module themselves (a parent of a culprit inherits its error); `findings` turns the
first of them into a warning naming it, and skipped work into info findings; `metrics` gives the
step's flat ``shadow/<role>/...`` numbers. Exercised by `pytest tests/test_audit_shadow.py`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

from verlaudit import kinds as K
from verlaudit.audit.shadow import EXCESS
from verlaudit.rundir import Finding


def pass_key(r: Mapping[str, Any]) -> tuple:
    """The shadowed forward a record belongs to: a role's no-grad and grad forwards of one step and
    phase (PPO's old log-probs and its update) are two."""
    return (r.get("role"), r.get("step"), r.get("phase"), r.get("grad"))


def _forward_local(records: Iterable[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    return [r for r in records if r.get("measure") == "local" and r.get("direction") == "forward"]


def culprits(records: Iterable[Mapping[str, Any]], excess: float = EXCESS) -> list[Mapping[str, Any]]:
    """Forward ``local`` records over ``excess`` times the rounding model, without an exceeding
    module inside them, in the order the modules finished (deepest first within a parent)."""
    over = [
        r
        for r in _forward_local(records)
        if math.isfinite(r.get("ratio", 0.0)) and r["ratio"] > excess or r.get("rel_err") == math.inf
    ]
    out = []
    for r in over:
        inner = [
            o
            for o in over
            if o is not r and pass_key(o) == pass_key(r) and o["module"].startswith(r["module"] + ".")
        ]
        if not inner:
            out.append(r)
    return out


def findings(records: list[Mapping[str, Any]], excess: float = EXCESS) -> list[Finding]:
    """One warning per role and pass naming the first module whose error its rounding does not
    explain (the others listed), and an info finding per piece of shadow work that was skipped."""
    out: list[Finding] = []
    seen: set[tuple] = set()
    found = culprits(records, excess)
    for r in found:
        key = pass_key(r)
        if key in seen:
            continue
        seen.add(key)
        others = [o["module"] for o in found if pass_key(o) == key and o is not r]
        dtype, allowed = r.get("dtype"), r.get("allowed")
        below = (
            f"its output is {dtype} where its contract allows {allowed}"
            if dtype != allowed
            else (f"it is handed {allowed} and returns {dtype}")
        )
        out.append(
            Finding(
                severity="warning",
                kind=K.SHADOW_EXCESS,
                role=r["role"],
                where=r["module"],
                step=r["step"],
                phase=r["phase"],
                observed={
                    "rel_err": r["rel_err"],
                    "expected": r["expected"],
                    "ratio": r["ratio"],
                    "dtype": dtype,
                    "also": others[:5],
                },
                expected=f"rel err <= {excess:g} x {r['expected']:.3g} ({allowed} rounding)",
                message=f"{r['module']} adds a {r['rel_err']:.3g} relative error against its fp32 shadow, "
                f"{r['ratio']:.3g}x what {allowed} rounding explains ({below}); the first such module of this "
                f"{r['role']} forward" + (f" (also: {', '.join(others[:3])})" if others else ""),
                fix=f"find where this module casts below {allowed} (its op counts in opcounts.jsonl: casts and the "
                f"dtype of its matmuls); keep it in {allowed}, or if it amplifies its input's error (softmax over "
                "large scores), keep its inputs in fp32",
            )
        )
    skipped = {
        (r.get("role"), r["module"], r.get("reason")) for r in records if r.get("measure") == "skipped"
    }
    for role, module, reason in sorted(skipped, key=str):
        out.append(
            Finding(
                severity="info",
                kind=K.SHADOW_SKIPPED,
                role=role,
                where=module,
                message=f"the fp32 shadow skipped {module}: {reason}",
                observed=reason,
                fix="nothing to fix in the run; the shadow's numbers for this module are missing",
            )
        )
    return out


def metrics(records: Iterable[Mapping[str, Any]]) -> dict[str, float]:
    """Flat per-step numbers per role (largest over the role's shadowed passes):
    ``shadow/<role>/logprob_err/mean`` and ``/max`` (nats per token), ``shadow/<role>/output_rel_err``
    (the last block's chain error), ``shadow/<role>/input_grad_rel_err`` (the chain error of the
    gradient reaching the first block), ``shadow/<role>/max_ratio`` (largest local forward ratio)."""
    out: dict[str, float] = {}

    def put(key: str, value: Any) -> None:
        if isinstance(value, (int, float)) and not math.isnan(value):
            out[key] = max(out.get(key, -math.inf), float(value))

    last_fwd: dict[tuple, Mapping[str, Any]] = {}
    first_bwd: dict[tuple, Mapping[str, Any]] = {}
    for r in records:
        role = r.get("role")
        if role is None:
            continue
        key = pass_key(r)
        if r["measure"] == "logprob" and r.get("tokens"):
            put(f"shadow/{role}/logprob_err/mean", r["mean_abs"])
            put(f"shadow/{role}/logprob_err/max", r["max_abs"])
        elif r["measure"] == "chain" and r["direction"] == "forward":
            if key not in last_fwd or r["depth"] >= last_fwd[key]["depth"]:
                last_fwd[key] = r
        elif r["measure"] == "chain" and r["direction"] == "backward":
            if key not in first_bwd or r["depth"] <= first_bwd[key]["depth"]:
                first_bwd[key] = r
        elif r["measure"] == "local" and r["direction"] == "forward":
            put(f"shadow/{role}/max_ratio", r["ratio"])
    for (role, *_), r in last_fwd.items():
        put(f"shadow/{role}/output_rel_err", r["rel_err"])
    for (role, *_), r in first_bwd.items():
        put(f"shadow/{role}/input_grad_rel_err", r["rel_err"])
    return out
