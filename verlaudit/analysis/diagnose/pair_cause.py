"""Keys wrong in combination as causes (`pair_causes`), and a tensor's resolution lost where it crosses a
16-bit boundary (`resolution_causes`).

`verlaudit.audit.config_pairs` records at setup, as ``info``, every combination of its table (`PAIRS`)
the run sets, with the metric tests that would show the consequence (``observed["confirm"]``) or, for a
combination wrong whatever the run shows, ``observed["by_construction"]``. `pair_causes` makes each a
cause at its row's severity when the run confirms it (or by construction), stamped at setup, with the fix
that sets one of the keys to a value it does not have.

`resolution_causes` checks one invariant for every tensor of `TENSORS`: a tensor a role computes in
fp16 / bf16 (its ``compute_dtype`` or ``param_dtype``, the lower) and that is on that dtype's grid (its own
std is 0 or at least the smallest a grid allows, `grid_min_std`: a reward model whose head upcasts to fp32
is not) keeps the information it carries only while its spread (the std of the signal it must represent: the returns a critic's values predict, the
scores a reward model's outputs rank) is more than `RESOLUTION_UNITS` of the dtype's spacing at its
magnitude; an offset signal (returns around 50 with a std of 0.1 in bf16, whose spacing at 50 is 0.25)
is rounded to a few steps of its own spread. The cause names the tensor, the role, the magnitude, the
spacing and the fix (that role in fp32 through ``precision.overrides.<role>``, or centre the values).
`adv_norm_causes` reads an advantage normalisation that divides by a std the run's rewards make tiny:
GRPO's group std (the audit's ``reward/tiny_std_group_frac``), REINFORCE++'s batch whitening
(``reward/std``). All read only the run directory. Exercised by `pytest tests/test_config_pairs.py`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from verlaudit import kinds as K
from verlaudit import verl_keys as V
from verlaudit.analysis.causes import Cause, Fix
from verlaudit.analysis.diagnose.config_cause import confirmed
from verlaudit.analysis.diagnose.runview import cfg, fmt, role_policy
from verlaudit.rundir import RunDir

MAJORITY = 0.5
"""The share of recorded steps that must show a metric-read cause (one noisy step is not a run)."""

PAIR_KINDS = frozenset(
    {
        K.CONFIG_PENALTY_TWICE,
        K.LABEL_SMOOTHING,
        K.CONFIG_LOSS_TYPE_SCALE,
        K.CONFIG_LOSS_AGG_FP16,
        K.CONFIG_CLIP_ZERO_WIDTH,
        K.CONFIG_TEMPERATURE_DTYPE,
        K.CONFIG_KL_LOSS_NO_GRADIENT,
    }
)


def pair_causes(run: RunDir) -> list[Cause]:
    """One cause per `config_pairs` finding the run confirms or that is wrong by construction."""
    out: list[Cause] = []
    for f in run.findings:
        obs = f.observed if isinstance(f.observed, dict) else {}
        if f.kind not in PAIR_KINDS or f.severity != "info" or "pair" not in obs:
            continue
        lines = [
            line
            for test in obs.get("confirm") or []
            if isinstance(test, dict) and (line := confirmed(test, run.series(str(test.get("metric")))))
        ]
        if not lines and not obs.get("by_construction"):
            continue
        if f.kind == K.CONFIG_CLIP_ZERO_WIDTH and any(
            g.kind == K.CLIP_SATURATED and g.where == f.where for g in run.findings
        ):  # the run measured the clipping itself: `dynamics/clip_saturated` says it with the fraction
            continue
        why = f.fix or ""
        verl = why.split("(verl: ", 1)[1].split(")", 1)[0] if "(verl: " in why else None
        key = str(obs.get("fix_key") or f.where)
        shown = lines[0] if lines else "wrong whatever the run's metrics show (by construction)"
        keys = ", ".join(f"{k} {v}" for k, v in (obs.get("keys") or {}).items())
        out.append(
            Cause(
                str(obs.get("severity") or "warning"),
                f"finding:{f.kind}",
                f"{f.kind}: {f.where} wrong in combination ({keys})",
                f.message,
                evidence=[*lines, f"{keys} ({obs.get('source')})"],
                fixes=[Fix(f"{key}: {obs.get('fix_value')}", verl, f"{why}; the run: {shown}")],
                step=None,
                where=f.where,
                phase=None,
                role=f.role,
                cls=K.class_of(f.kind),
                seq=-1.0,
            )
        )
    return out


# ---------------------------------------------------------------- std normalisation of tiny spreads

TINY_STD_METRIC = "reward/tiny_std_group_frac"
"""The audit's share of GRPO groups whose rewards differ with a std below 1e-3
(`verlaudit.audit.reward_signal.tiny_std_groups`)."""
TINY_STD_SHARE = 0.25
"""The mean share of such groups from which the std division trains on them: a quarter of the batch's
groups with advantages of +-1 made from differences of less than 1e-3."""
STD_ESTIMATORS = ("grpo", "grpo_vectorized", "gdpo")
"""The estimators that read ``norm_adv_by_std_in_grpo`` (verl's GRPO outcome advantage, GDPO's per part)."""


BATCH_WHITENED = ("reinforce_plus_plus", "reinforce_plus_plus_baseline")
"""The estimators that whiten the advantages over the batch (divide by the batch's std)."""
TINY_BATCH_STD = 1e-3
"""A batch reward std (``reward/std``) under which the whitening multiplies the reward differences by
1000 or more (the bound of `TINY_STD_METRIC`'s groups, over the batch)."""


def _adv_cause(key: str, fix: Fix, line: str, divides: str) -> Cause:
    return Cause(
        "warning",
        K.ADV_NORM_TINY_STD,
        f"{K.ADV_NORM_TINY_STD}: {key} divides the advantages by a reward std near 0 ({divides}: reward "
        "differences of a tie-break or noise become +-1)",
        f"the advantage normalisation ({key}) divides the reward deviations by their std ({divides}); rewards "
        "that differ only by a std below 1e-3 (a tie-break, float noise, a length bonus while no response is "
        "right) get advantages of +-1, as large as a right-vs-wrong difference's, so the policy is trained on "
        "a difference the reward does not mean",
        evidence=[line],
        fixes=[fix],
        step=None,
        where=key,
        phase=None,
        role="actor",
        cls=K.cause_class(K.ADV_NORM_TINY_STD),
        seq=-1.0,
    )


def adv_norm_causes(run: RunDir) -> list[Cause]:
    """``adv_norm_tiny_std``: an advantage normalisation that divides by a std the run's rewards make
    tiny: GRPO's per-group std (`TINY_STD_METRIC` at least `TINY_STD_SHARE` on average), or the batch
    whitening of REINFORCE++ (``reward/std`` between 0 and `TINY_BATCH_STD` at most steps)."""
    if cfg(run, "algo", "name") != "grpo":
        return []
    est = cfg(run, "algo", "adv_estimator") or "grpo"
    if est in STD_ESTIMATORS and cfg(run, "algo", "norm_adv_by_std_in_grpo") is not False:
        test = {"metric": TINY_STD_METRIC, "test": "mean_at_least", "bound": TINY_STD_SHARE,
                "means": "the share of groups whose rewards differ by a std below 1e-3"}  # fmt: skip
        line = confirmed(test, run.series(TINY_STD_METRIC))
        if line is None:
            return []
        key = "algo.norm_adv_by_std_in_grpo"
        fix = Fix(
            f"{key}: false",
            V.algo_override("norm_adv_by_std_in_grpo", False),
            "Dr.GRPO's unnormalised advantages keep a tiny reward difference tiny; or make the reward's "
            "tie-break a tie (equal rewards: no std to divide by)",
        )
        return [_adv_cause(key, fix, line, "each group's std")]
    if est in BATCH_WHITENED:
        stds = [v for _, v in run.series("reward/std") if v == v]
        tiny = [v for v in stds if 0.0 < v < TINY_BATCH_STD]
        if not stds or len(tiny) < MAJORITY * len(stds):
            return []
        line = (
            f"reward/std between 0 and {TINY_BATCH_STD:g} at {len(tiny)} of {len(stds)} steps "
            f"(largest {fmt(max(tiny))}): the batch whitening divides by it"
        )
        fix = Fix(
            "algo.adv_estimator: rloo",
            V.algo_override("adv_estimator", "rloo"),
            f"{est} whitens the advantages over the batch; RLOO's leave-one-out baseline does not divide by "
            "the std, so a tiny reward difference stays tiny (or make the reward's tie-break a tie)",
        )
        return [_adv_cause("algo.adv_estimator", fix, line, "the batch's std")]
    return []


# ---------------------------------------------------------------- resolution at a 16-bit boundary

MANTISSA = {"bf16": 7, "fp16": 10}
"""Explicit mantissa bits: the spacing at x is 2^(floor(log2 |x|) - bits)."""
RESOLUTION_UNITS = 2.0
"""A spread below this many units of the spacing at the tensor's magnitude is rounded to a handful of
values: at 2 units a normal spread's values fall on ~4-8 grid points, at 0.5 on one or two. Clean runs'
tensors sit near 0 (values, scores of order 1 with spreads of 0.1-1): their spread is hundreds of units."""


@dataclasses.dataclass(frozen=True)
class Tensor:
    """A tensor a role computes: its magnitude metric (the mean of its values), its own std metric, the
    metrics of the spread of the signal it carries (the largest recorded is used: the generous reading),
    what one value is (``tokens``: one per response token, ``rows``: one per response), and the suite key
    whose being set means the role really computes it."""

    name: str
    role: str
    magnitude: str
    own: str
    spreads: tuple[str, ...]
    per: str = "rows"
    needs: tuple[str, ...] = ()


TENSORS: tuple[Tensor, ...] = (
    Tensor(
        "the critic's values",
        "critic",
        "critic/values/mean",
        "critic/values/std",
        ("critic/returns/std", "critic/values/std"),
        per="tokens",
    ),
    Tensor(
        "the reward model's scores",
        "reward",
        "critic/score/mean",
        "critic/score/std",
        ("critic/score/std", "reward/std"),
        needs=("model", "reward_model"),
    ),
)
"""Every tensor checked (class docstring); extend by a row, not by a check."""


def grid_min_std(unit: float, n: int) -> float:
    """The smallest nonzero std of ``n`` values on a grid of spacing ``unit`` (all equal but one, one step
    off): unit x sqrt(n - 1) / n. A tensor whose std is nonzero and below it is not on that grid: its
    role kept it finer than the dtype (an fp32 head, an upcast before the output)."""
    return unit * math.sqrt(max(n - 1, 1)) / max(n, 1)


def _count(run: RunDir, per: str) -> int | None:
    algo = cfg(run, "algo") or {}
    try:
        rows = int(algo.get("batch_size") or 0) * (
            int(algo.get("group_size") or 1) if algo.get("name") == "grpo" else 1
        )
        length = int(cfg(run, "data", "response_length") or 0)
    except (TypeError, ValueError):
        return None
    n = rows * length if per == "tokens" else rows
    return n if n >= 2 else None


def spacing(dtype: str, x: float) -> float | None:
    """The distance between adjacent ``dtype`` values at magnitude ``|x|``; None for a dtype not 16-bit."""
    bits = MANTISSA.get(dtype)
    if bits is None or not x or not math.isfinite(x):
        return None
    return 2.0 ** (math.floor(math.log2(abs(x))) - bits)


def _dtype(run: RunDir, role: str) -> str | None:
    p = role_policy(run, role)
    found = [str(p.get(k)) for k in ("compute_dtype", "param_dtype") if str(p.get(k)) in MANTISSA]
    return "bf16" if "bf16" in found else found[0] if found else None


def _lost(run: RunDir, t: Tensor, dtype: str) -> tuple[list[tuple[int, float, float, float]], int] | None:
    mags, own = dict(run.series(t.magnitude)), dict(run.series(t.own))
    spreads = [dict(run.series(m)) for m in t.spreads]
    n = _count(run, t.per)
    if n is None:
        return None
    steps = sorted(mags)
    rows = []
    for s in steps:
        mag = mags[s]
        sp = [d[s] for d in spreads if s in d and d[s] == d[s]]
        if not sp or mag != mag:
            continue
        spread, unit = max(sp), spacing(dtype, mag)
        mine = own.get(s)
        if unit is None or spread <= 0 or mine is None or mine != mine:
            continue
        if 0 < mine < grid_min_std(unit, n):  # finer than the grid: not rounded to this dtype at all
            continue
        rows.append((s, mag, spread, unit))
    if not rows:
        return None
    hit = [r for r in rows if r[2] < RESOLUTION_UNITS * r[3]]
    return (hit, len(rows)) if hit and len(hit) >= MAJORITY * len(rows) else None


def resolution_causes(run: RunDir) -> list[Cause]:
    """A ``precision/resolution`` cause per tensor of `TENSORS` whose spread is within
    `RESOLUTION_UNITS` of its dtype's spacing at most recorded steps (module docstring)."""
    out: list[Cause] = []
    for t in TENSORS:
        if t.needs and not cfg(run, *t.needs):
            continue
        dtype = _dtype(run, t.role)
        if dtype is None:
            continue
        found = _lost(run, t, dtype)
        if found is None:
            continue
        hit, n = found
        s, mag, spread, unit = max(hit, key=lambda r: r[3] / r[2])
        key = f"precision.overrides.{t.role}"
        what = (
            f"{t.name} are computed in {dtype} (the {t.role} role's precision) at a magnitude of ~{fmt(abs(mag))}, "
            f"where {dtype}'s spacing is {fmt(unit)}, while the signal they carry spreads by only {fmt(spread)} "
            f"(std): {spread / unit:.2g} units of the spacing, so they are rounded to a few steps of their own "
            f"spread and the differences that matter (advantages, rankings) are lost to the rounding"
        )
        out.append(
            Cause(
                "warning",
                K.RESOLUTION_LOST,
                f"{K.RESOLUTION_LOST}: {t.name} lose their resolution in {dtype} ({key}): spacing "
                f"{fmt(unit)} at magnitude {fmt(abs(mag))} vs a spread of {fmt(spread)}",
                what,
                evidence=[
                    f"{len(hit)} of {n} recorded steps: spread under {RESOLUTION_UNITS:g} x the {dtype} spacing at "
                    f"{t.magnitude} (step {s}: {t.magnitude} {fmt(mag)}, spacing {fmt(unit)}, spread {fmt(spread)} "
                    f"from {', '.join(t.spreads)})",
                ],
                fixes=[
                    Fix(
                        f"{key}: {{param_dtype: fp32, compute_dtype: fp32}}",
                        None,
                        f"keep the {t.role}'s output in fp32 (float32: spacing {fmt(2.0 ** (math.floor(math.log2(abs(mag))) - 23))} at "
                        f"{fmt(abs(mag))}); or centre the values (subtract the mean return / score offset) so "
                        f"{dtype}'s spacing shrinks with their magnitude",
                    )
                ],
                step=s,
                where=key,
                phase=None,
                role=t.role,
                cls=K.cause_class(K.RESOLUTION_LOST),
                seq=-1.0,
            )
        )
    return out


def combo_causes(run: RunDir) -> Sequence[Cause]:
    """Both analyses of this module, for `verlaudit.analysis.diagnose.diagnosis.ANALYSES`."""
    return [*pair_causes(run), *adv_norm_causes(run), *resolution_causes(run)]
