"""The precision contract checked against what actually ran: each role's matmuls, as the op counter
measured them (`verlaudit.audit.opcount`, opcounts.jsonl), against the compute dtype of its policy
(`trainer.precision.RolePolicy.compute_dtype`).

A role configured fp32 whose matmuls ran in bf16 (an autocast entered by user code or a library around
the forward), or a bf16 role whose matmuls ran in fp32 (a cast in a setup function, an autocast left
out), is one finding per role and pass (``contract/compute_dtype``) naming the module with the most
such ops and the share of the role's matmuls that ran so. Only matmuls inside the role's modules are
judged: the fp32 islands a policy intends (norms, softmax, log-probs, losses) are not matmuls, and
ops outside every module (the loss, log-probs from logits) are the islands' checks' (`opcount.findings`).
The rollout engine's effective dtype against the configured one is `engine_checks`'
(``boundary/rollout_engine_dtype``, from the engine's facts at the rollout boundary). Exercised by
`pytest tests/test_audit_contract.py`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from typing import Any

from verlaudit import kinds as K
from verlaudit.dtypes import dtype_name
from verlaudit.rundir import Finding

WARN_SHARE = 0.1
"""A role's matmuls in one pass may leave its compute dtype this often before it is a finding (a head
kept in fp32 on purpose is a few ops of many)."""
ERROR_SHARE = 0.5


def measured(records: Iterable[Mapping[str, Any]]) -> dict[tuple[str, str], dict[str, Counter]]:
    """(role, pass) -> {"dtypes": matmul ops by output dtype, "modules": off-contract candidates by module}."""
    out: dict[tuple[str, str], dict[str, Counter]] = {}
    for r in records:
        if r.get("category") != "matmul" or not r.get("role"):
            continue
        slot = out.setdefault((r["role"], r["pass"]), {"dtypes": Counter(), "modules": Counter()})
        slot["dtypes"][r["out"]] += r["count"]
        slot["modules"][(r["module"], r["out"])] += r["count"]
    return out


def findings(records: list[Mapping[str, Any]], policy: Any, *, step: int | None) -> list[Finding]:
    """A finding per role and pass whose matmuls ran in another dtype than its policy's compute dtype."""
    out = []
    for (role, pas), m in sorted(measured(records).items()):
        if role not in getattr(policy, "roles", {}):
            continue
        rp = policy[role]
        want = dtype_name(rp.compute_dtype)
        total = sum(m["dtypes"].values())
        off = {d: n for d, n in m["dtypes"].items() if d != want}
        share = sum(off.values()) / total if total else 0.0
        if share <= WARN_SHARE or sum(off.values()) < 2:
            continue
        got = max(off, key=off.get)
        (module, _), _ = max(((k, n) for k, n in m["modules"].items() if k[1] == got), key=lambda kn: kn[1])
        lower = _bits(got) < _bits(want)
        why = (
            "an autocast entered around the forward by user code or a library"
            if lower
            else "weights cast up in a setup function, or the autocast the policy asks for not entered"
        )
        fix = (
            f"remove the torch.autocast({got}) around the {role}'s {pas} (user code, model.setup or a library), "
            f"or set precision.overrides.{role}.compute_dtype: {got} if {got} is what you want"
            if lower
            else f"keep the {role} model in {want} (check model.setup for .float() / .to()), or set "
            f"precision.overrides.{role}.compute_dtype: {got}"
        )
        out.append(
            Finding(
                severity="error" if share >= ERROR_SHARE else "warning",
                kind=K.CONTRACT_COMPUTE,
                role=role,
                where=module or "(model)",
                step=step,
                observed={
                    "pass": pas,
                    "matmuls_by_dtype": dict(m["dtypes"]),
                    "share": round(share, 4),
                    "modules": len({k[0] for k in m["modules"] if k[1] != want}),
                },
                expected=want,
                message=f"the policy computes {role} in {want}, but {sum(off.values())} of its {total} {pas} "
                f"matmuls ({share:.0%}) ran in {'/'.join(sorted(off))} (most in {module or 'the model'}): "
                f"most likely {why}",
                fix=fix,
            )
        )
    return out


def _bits(label: str) -> int:
    return {"fp64": 64, "fp32": 32, "bf16": 16, "fp16": 16}.get(label, 32)
