"""The diagnosis of a rollout-vs-trainer mismatch beyond what the dtypes explain: one `Cause` from a
run's ``mismatch/beyond_dtype`` finding (`verlaudit.audit.mismatch`), its metrics and the findings
that say why.

The cause names the boundary (``rollout:<engine> vs actor``: the engine's log-probs against the
actor's recomputed ones), the numbers (token k3 against the dtype-roundoff model, the IS-ratio
statistics) and the fixes, most specific first: what the run recorded as different (a sampling
setting, the weight push, the KV cache or the engine's dtype: their findings' own fixes), then verl's
rollout correction when it is off (truncated importance weights; rejection when ratios leave
[1/C, C]), then the dtype change that shrinks the part rounding does explain. Suite keys with their
verl keys (`verlaudit.verl_keys`). Exercised by `pytest tests/test_mismatch_audit.py -k diagnose`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from verlaudit import kinds as K
from verlaudit import verl_keys as V
from verlaudit.analysis.causes import Cause, Fix
from verlaudit.rundir import Finding, RunDir

KIND = K.MISMATCH_BEYOND_DTYPE
RELATED = (K.ROLLOUT_SAMPLING, K.WEIGHT_SYNC, K.ROLLOUT_KV_CACHE, K.ROLLOUT_ENGINE_DTYPE, K.ROLLOUT_LOGPROBS)
"""Finding kinds that say what, besides rounding, differs between the engine and the trainer."""
_VERL_DTYPE = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def _series(run: RunDir, key: str) -> list[tuple[int, float]]:
    return [(s, v) for s, v in run.series(key) if math.isfinite(v)]


def _dtypes(run: RunDir) -> tuple[str | None, str | None]:
    """(actor compute dtype, rollout compute dtype) from the manifest's resolved policy."""
    roles: Mapping[str, Any] = (run.manifest.get("policy") or {}).get("roles") or {}
    return (roles.get("actor") or {}).get("compute_dtype"), (roles.get("rollout") or {}).get("compute_dtype")


def mismatch_causes(run: RunDir) -> list[Cause]:
    """One warning-level cause when the run recorded a mismatch beyond dtype rounding, else none."""
    found = sorted(
        (f for f in run.findings if f.kind == KIND), key=lambda f: f.step if f.step is not None else 0
    )
    if not found:
        return []
    top = found[0]
    engine = (top.where or "rollout:?").removeprefix("rollout:")
    trainer, rollout = _dtypes(run)
    related = [f for f in run.findings if f.kind in RELATED and f.severity != "info"]
    evidence = _evidence(run, top, found, trainer, rollout)
    evidence += [f"{f.kind} at {f.where} (step {f.step}): {f.message}" for f in related[:4]]
    fixes = [Fix(None, None, f.fix) for f in related if f.fix]
    fixes = list(dict.fromkeys(fixes))[:3]
    fixes += _correction_fixes(run)
    fixes += _dtype_fixes(trainer, rollout)
    unknown = []
    if not related:
        unknown.append(
            "what else differs: the run records no sampling, weight-push or KV-cache difference; compare the "
            "engine's and the trainer's forward on the worst tokens (rollout_corr/worst_token_*), and note "
            "that the rounding model was fitted on a 2-layer model (reports/mismatch_cpu): on a deep model "
            "part of the excess can be rounding"
        )
    what = (
        f"The log-probs {engine} recorded for the sampled tokens and the actor's recomputed ones differ by "
        "more than rounding in their dtypes explains, so PPO's ratios and the KL estimates start away from 1 "
        "for another reason: "
        + ("the findings below name it." if related else "the run does not record which.")
    )
    return [
        Cause(
            "warning",
            "rollout_mismatch",
            f"Rollout-vs-trainer mismatch beyond dtype rounding at rollout:{engine} vs actor "
            f"from step {top.step}",
            what,
            evidence=evidence,
            fixes=fixes,
            unknown=unknown,
            step=top.step,
            phase=top.phase,  # the step's rollout: what the rollout or a setup did before it explains it
            where=f"rollout:{engine} vs actor",
            score=15.0,
            data={"engine": engine, "trainer_dtype": trainer, "rollout_dtype": rollout},
        )
    ]


def _evidence(
    run: RunDir, top: Finding, found: list[Finding], trainer: str | None, rollout: str | None
) -> list[str]:
    k3 = _series(run, "rollout_corr/k3_kl")
    ratio = dict(_series(run, "mismatch/k3_over_expected"))
    expected = dict(_series(run, "mismatch/k3_expected"))
    out = []
    if k3:
        step, worst = max(k3, key=lambda sv: sv[1])
        over = sum(1 for s, v in k3 if isinstance(top.expected, (int, float)) and v > top.expected)
        line = f"token k3 (rollout_corr/k3_kl) up to {worst:.3g} at step {step}"
        if step in ratio and step in expected:
            line += f": {ratio[step]:.3g}x the {expected[step]:.3g} that rounding explains"
        if isinstance(top.expected, (int, float)):
            line += f" (reported above {top.expected:.3g}; {over} of {len(k3)} steps above)"
        out.append(line)
    else:
        out.append(f"{top.message} (step {top.step}, x{top.count})")
    out.append(f"rollout computes in {rollout or '?'}, the actor in {trainer or '?'} (the manifest's policy)")
    stats = []
    for key, name, pick in (
        ("rollout_corr/seq_kl", "sequence KL k1", max),
        ("rollout_corr/token_ratio_fraction_outside", "ratios outside [1/C, C]", max),
        ("rollout_corr/token_ratio_eff_sample_size", "ESS", min),
        ("training/rollout_probs_diff_max", "|dp| max", max),
    ):
        values = [v for _, v in _series(run, key)]
        if values:
            stats.append(f"{name} {'max' if pick is max else 'min'} {pick(values):.3g}")
    if stats:
        out.append("; ".join(stats))
    probe, tol = (
        _series(run, "rollout/weight_sync_probe_max_abs_diff"),
        _series(run, "rollout/weight_sync_probe_tolerance"),
    )
    if probe:
        out.append(
            f"weight-push probe: max |engine - actor| log-prob {max(v for _, v in probe):.3g}"
            + (f" (tolerance {tol[0][1]:.3g})" if tol else "")
        )
    return out


def _cfg(run: RunDir, *path: str) -> Any:
    cur: Any = run.manifest.get("config") or {}
    for p in path:
        cur = cur.get(p) if isinstance(cur, Mapping) else None
    return cur


def _correction_fixes(run: RunDir) -> list[Fix]:
    """verl's rollout correction, when the run had it off: truncated IS, and rejection when ratios
    left [1/C, C]."""
    rc = _cfg(run, "rollout_correction") or {}
    out = []
    if not rc.get("rollout_is"):
        c = rc.get("rollout_is_threshold") or 2.0
        c = c if isinstance(c, str) else f"{c:g}"  # a number, or IcePop's lower_upper
        out.append(
            Fix(
                f"rollout_correction.rollout_is: token, rollout_correction.rollout_is_threshold: {c}",
                f"{V.correction_override('rollout_is', 'token')} / "
                f"{V.correction_override('rollout_is_threshold', c)}",
                "truncated importance weights min(pi/mu, C) on each token's policy loss: the update stays "
                "unbiased up to the truncation while the cause is found",
            )
        )
    outside = [v for _, v in _series(run, "rollout_corr/token_ratio_fraction_outside")]
    if not rc.get("rollout_rs") and outside and max(outside) > 0:
        out.append(
            Fix(
                "rollout_correction.rollout_rs: token_k1, rollout_correction.rollout_rs_threshold: 0.5_2.0",
                f"{V.correction_override('rollout_rs', 'token_k1')} / "
                f"{V.correction_override('rollout_rs_threshold', '0.5_2.0')}",
                f"mask the tokens whose ratio leaves [0.5, 2] ({max(outside):.3g} of them at worst) out of "
                "the update",
            )
        )
    return out


def _dtype_fixes(trainer: str | None, rollout: str | None) -> list[Fix]:
    """The dtype change that shrinks the part rounding explains: one dtype on both sides, or fp16 for bf16."""
    if trainer is None or rollout is None:
        return []
    if trainer != rollout:
        return [
            Fix(
                f"precision.overrides.rollout.compute_dtype: {trainer}",
                f"{V.ROLLOUT_DTYPE}={_VERL_DTYPE.get(trainer, trainer)}",
                "the engine in the trainer's dtype: both sides then share their rounding",
            )
        ]
    if trainer == "bf16":
        return [
            Fix(
                "precision.preset: fp16",
                f"{V.ROLLOUT_DTYPE}=float16 / {V.PARAM_DTYPE_FP16}",
                "fp16 has 3 more mantissa bits than bf16: 64x less rounding mismatch in k3 by the model "
                "(Qi et al. 2025 train and roll out in fp16 for this reason); needs loss scaling",
            )
        ]
    return []
