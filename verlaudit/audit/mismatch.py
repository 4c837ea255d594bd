"""Rollout-vs-trainer mismatch in the audit: how much the engine and trainer dtypes explain, the weight
push into the engine, and the `MismatchWatch` collector the `Auditor` routes both events to.

The dtype-roundoff model. Per token, the log-ratio r = log pi_train - log mu_rollout of a sampled
token is the difference of two computations of the same log-softmax, each carrying the rounding of
its own dtype. Model each side's logit error as proportional to its unit roundoff u (fp32 2^-24,
bf16 2^-8, fp16 2^-11) and independent of the other's, so E[r^2] = alpha^2 (u_train^2 + u_rollout^2),
and since k3 = exp(r) - 1 - r ~ r^2 / 2 for small r::

    expected token k3 (rollout_corr/k3_kl) = ALPHA^2 (u_train^2 + u_rollout^2) / 2

alpha, the logit error in units of u, was fitted on the crossing cells (trainer and rollout in
different dtypes, fp32 on one side) of ``reports/mismatch_cpu/mismatch_bench.md``: alpha^2 = 4.0-4.6
over the HF, fused and vLLM engines with bf16 and fp16 (hence `ALPHA` = 2). Cells with the same low
precision on both sides share part of their rounding and measure below the model (0.14-0.47 of it);
fp32 on both sides measures above it (3.7-7.4x, where the fp32 reductions' order is all that differs),
under `K3_FLOOR`. A step whose ``rollout_corr/k3_kl`` exceeds ``max(K3_FLOOR, MARGIN x expected)`` is
a ``mismatch/beyond_dtype`` finding: something other than rounding moves the probabilities (sampling
settings, a stale or failed weight push, an engine bug). `MARGIN` = 100 in k3 is 10x in alpha: the
spread between engines and the growth of alpha with depth and logit scale (the model above was
fitted on a 2-layer, 128-wide model; ``benchmarks/h200_mismatch.sh`` measures 1B and 7B models).

The weight-push probe (``on_weight_sync``): the engine's teacher-forced log-probs of n fixed tokens
against the actor's in the engine dtype: both sides round in that dtype, so each |r| has standard
deviation sqrt(2) ALPHA u and the largest of n stays below sqrt(2 ln 2n) of those; the tolerance is
that times sqrt(MARGIN), at least `PROBE_FLOOR` (fp32: vLLM's and torch's CPU GEMMs reduce in
different orders, 3e-6 measured). A probe beyond it, or parameters that did not match the engine, is a
``rollout/weight_sync`` error. Metrics every step: ``mismatch/k3_expected``, ``mismatch/k3_over_expected``
and ``rollout/weight_sync_probe_tolerance``. Exercised by `pytest tests/test_mismatch_audit.py`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from trainer.precision import dtype_name
from verlaudit import kinds as K
from verlaudit import verl_keys as V
from verlaudit.audit import rounding
from verlaudit.audit.metrics import StepNumbers
from verlaudit.rundir import Finding

UNIT_ROUNDOFF = {
    d: rounding.unit_roundoff(d) for d in (torch.float32, torch.bfloat16, torch.float16, torch.float64)
}
"""The dtypes this model was fitted for, with their unit roundoff (`verlaudit.audit.rounding.unit_roundoff`:
half the spacing of the dtype's numbers at 1)."""
ALPHA = 2.0
"""Logit error in units of the unit roundoff, fitted on reports/mismatch_cpu (module docstring)."""
MARGIN = 100.0
"""How far above the model a token k3 may go before it is more than rounding (module docstring)."""
K3_FLOOR = 1e-8
"""The least token k3 that is reported (an rms log-ratio of 1.4e-4): fp32 pairs stay far below it."""
PROBE_FLOOR = 1e-4
"""The least probe tolerance (fp32 engines; the same bound as tests/test_vllm_engine.py's)."""
K3 = "rollout_corr/k3_kl"


def unit_roundoff(dtype: torch.dtype) -> float:
    """u of ``dtype``; ValueError for a dtype the model does not know."""
    if dtype not in UNIT_ROUNDOFF:
        raise ValueError(f"no unit roundoff for {dtype}; expected one of fp32, bf16, fp16, fp64")
    return UNIT_ROUNDOFF[dtype]


def expected_k3(trainer: torch.dtype, rollout: torch.dtype) -> float:
    """The token k3 the two dtypes' rounding explains: ALPHA^2 (u_t^2 + u_r^2) / 2."""
    return ALPHA**2 * (unit_roundoff(trainer) ** 2 + unit_roundoff(rollout) ** 2) / 2


def k3_limit(trainer: torch.dtype, rollout: torch.dtype) -> float:
    """The largest token k3 still taken for rounding: max(K3_FLOOR, MARGIN x `expected_k3`)."""
    return max(K3_FLOOR, MARGIN * expected_k3(trainer, rollout))


def probe_tolerance(dtype: torch.dtype, tokens: int) -> float:
    """Largest |engine - actor| log-prob over ``tokens`` probe tokens that rounding in ``dtype`` explains."""
    sigma = math.sqrt(2.0) * ALPHA * unit_roundoff(dtype)
    return max(PROBE_FLOOR, math.sqrt(MARGIN) * sigma * math.sqrt(2.0 * math.log(2 * max(tokens, 1))))


def _dn(dtype: Any) -> str:
    return dtype_name(dtype) if isinstance(dtype, torch.dtype) else str(dtype)


def weight_sync_findings(
    record: Mapping[str, Any], *, step: int | None = None, phase: str | None = None
) -> list[Finding]:
    """``on_weight_sync``'s record -> findings: parameters that did not match the engine, and a probe
    that disagrees beyond `probe_tolerance` (or is not finite)."""
    engine, dtype = str(record.get("engine", "engine")), record.get("engine_dtype")
    ctx = {"role": "rollout", "step": step, "phase": phase}
    where = f"rollout:{engine}.weight_sync"
    out: list[Finding] = []
    bad = list(record.get("mismatched") or [])
    if bad:
        shown = "; ".join(f"{m.get('name')} ({m.get('reason')})" for m in bad[:3])
        out.append(
            Finding(
                severity="error",
                kind=K.WEIGHT_SYNC,
                message=f"{len(bad)} parameter(s) did not match {engine}'s model "
                f"by name, shape or dtype: {shown}" + (" ..." if len(bad) > 3 else ""),
                where=f"{where}.params",
                observed=[m.get("name") for m in bad[:10]],
                expected="every actor parameter pushed by name, shape and dtype",
                fix="build the engine from the actor's own config and keep the actor's parameter "
                "names and dtypes after the engine is built (rebuild the engine otherwise)",
                **ctx,
            )
        )
    diff, n = record.get("probe_max_abs_diff"), int(record.get("probe_tokens") or 0)
    if diff is not None and n and isinstance(dtype, torch.dtype) and dtype in UNIT_ROUNDOFF:
        tol = probe_tolerance(dtype, n)
        if not math.isfinite(float(diff)) or float(diff) > tol:
            out.append(
                Finding(
                    severity="error",
                    kind=K.WEIGHT_SYNC,
                    message=f"after the push {engine}'s log-probs of {n} fixed "
                    f"tokens differ from the actor's by up to {float(diff):.3g}, beyond the {tol:.3g} "
                    f"that {_dn(dtype)} rounding explains: the engine does not compute with the "
                    "actor's current weights",
                    where=f"{where}.probe",
                    observed=float(diff),
                    expected=tol,
                    fix="check the push: every parameter loaded (none left on the "
                    "engine's initial weights), prefix / KV caches reset after it",
                    **ctx,
                )
            )
    return out


def excess_finding(
    k3: float,
    *,
    trainer: torch.dtype,
    rollout: torch.dtype,
    engine: str,
    step: int | None = None,
    phase: str | None = None,
) -> Finding | None:
    """``mismatch/beyond_dtype`` when the step's token k3 exceeds `k3_limit` (or is not finite)."""
    limit = k3_limit(trainer, rollout)
    if math.isfinite(k3) and k3 <= limit:
        return None
    expected = expected_k3(trainer, rollout)
    pair = f"{_dn(rollout)} rollout vs {_dn(trainer)} trainer"
    return Finding(
        severity="warning",
        kind=K.MISMATCH_BEYOND_DTYPE,
        message=f"rollout-vs-trainer mismatch beyond dtype rounding: token k3 {k3:.3g} is "
        f"{k3 / expected:.3g}x what "
        f"{pair} rounding explains ({expected:.3g}; reported above {limit:.3g})",
        role="rollout",
        where=f"rollout:{engine}",
        step=step,
        phase=phase,
        observed=k3,
        expected=limit,
        fix=f"find what else differs between {engine} and the trainer (sampling settings, the weight push); "
        f"meanwhile correct for it ({V.correction_override('rollout_is', 'token')})",
    )


class MismatchWatch:
    """Collector for the mismatch: the facts of the step's rollout (``on_rollout``), the weight push
    (``on_weight_sync``), and at the step's end the excess check and the metrics (see the module doc)."""

    def __init__(self, numbers: StepNumbers) -> None:
        self.numbers = numbers
        self._pair: tuple[str, torch.dtype, torch.dtype] | None = None
        """(engine, trainer compute dtype, engine compute dtype) of the step's rollout whose log-probs
        a loss uses."""

    def rollout(self, payload: Mapping[str, Any]) -> None:
        if not (payload.get("trainer_facts") or {}).get("used", True):
            return  # ReMax's greedy baseline: no ratio is taken against it
        facts = payload.get("engine_facts") or {}
        compute = facts.get("compute_dtype", payload["engine_dtype"])
        self._pair = (str(payload["engine"]), payload["actor_compute_dtype"], compute)

    def weight_sync(self, record: Mapping[str, Any], *, step: int | None, phase: str | None) -> list[Finding]:
        dtype, n = record.get("engine_dtype"), int(record.get("probe_tokens") or 0)
        if isinstance(dtype, torch.dtype) and dtype in UNIT_ROUNDOFF and n:
            self.numbers.put("rollout/weight_sync_probe_tolerance", probe_tolerance(dtype, n))
        return weight_sync_findings(record, step=step, phase=phase)

    def step_end(self, metrics: Mapping[str, Any], *, step: int | None) -> list[Finding]:
        pair, self._pair = self._pair, None
        k3 = metrics.get(K3)
        if pair is None or not isinstance(k3, (int, float)):
            return []
        engine, trainer, rollout = pair
        if trainer not in UNIT_ROUNDOFF or rollout not in UNIT_ROUNDOFF:
            return []
        expected = expected_k3(trainer, rollout)
        self.numbers.put("mismatch/k3_expected", expected)
        self.numbers.put("mismatch/k3_over_expected", float(k3) / expected)
        found = excess_finding(
            float(k3), trainer=trainer, rollout=rollout, engine=engine, step=step, phase="rollout"
        )
        return [found] if found else []
