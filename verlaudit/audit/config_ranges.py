"""One table of sane ranges for the numeric algorithm and precision keys the trainer accepts (`RANGES`),
read from the suite keys and the resolved precision policy before the first step (`setup_findings`).

Each row names the suite key, the published default and the range recipes use, where that comes from
(verl's ``ppo_trainer.yaml`` / rollout-correction docs, TRL's ``DPOConfig``, torch's ``GradScaler``), what a
value outside it does, and which metric of the run would show that it did. A key outside its range is
recorded at setup as an ``info`` finding whose ``observed`` holds the value, the range, and the
confirmation (``confirm``: metric, test, bound); `verlaudit.analysis.diagnose.config_cause` reads the
run's metrics and makes it a cause (warning or error, with the metric as evidence) only when the run shows
the consequence, so a range violation the run shows harmless stays information. The fix sets the key to
a value inside the range, never the value it has.

Rows whose key already has its own check (``checked_by``: the learning rate's weight growth, the discount,
the clip range, the KL and entropy terms, the sampling settings, ...) are in the table for the record of
their range and are not checked twice here. Exercised by `pytest tests/test_config_ranges.py`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

from verlaudit import kinds as K
from verlaudit import verl_keys as V
from verlaudit.audit.dynamics import estimator, number
from verlaudit.rundir import Finding

Cfg = Mapping[str, Any]


@dataclasses.dataclass(frozen=True)
class Range:
    """One numeric key: its sane range ``[lo, hi]`` (None: unbounded), default, source, and what a value
    outside does. ``kind`` is the finding kind written (None: ``checked_by`` names the check that owns
    the key). ``confirm_low`` / ``confirm_high``: the metric tests (`Confirm`) that show the consequence
    in the run, any one of which confirms it."""

    key: str
    default: float | None
    lo: float | None
    hi: float | None
    source: str
    low: str = ""
    high: str = ""
    kind: str | None = None
    severity: str = "warning"
    checked_by: str | None = None
    confirm_low: tuple[Confirm, ...] = ()
    confirm_high: tuple[Confirm, ...] = ()


@dataclasses.dataclass(frozen=True)
class Confirm:
    """A test of one metric series: ``all_at_most`` (every value <= bound: a gradient that is always 0),
    ``any_above`` (some value > bound: a skipped step), ``mean_at_least`` (the mean >= bound: a fraction
    of clipped weights), ``absmax_at_least`` (some |value| >= bound: a saturated margin). ``{role}`` in
    the metric is the row's role."""

    metric: str
    test: str
    bound: float
    means: str

    def as_dict(self, role: str) -> dict[str, Any]:
        return {
            "metric": self.metric.format(role=role),
            "test": self.test,
            "bound": self.bound,
            "means": self.means,
        }


_ZERO_GRAD = Confirm("critic/grad_norm", "all_at_most", 0.0, "the critic's gradient norm is 0 at every step")
_SKIPS = Confirm("{role}/skipped", "any_above", 0.0, "the loss scaler skipped optimizer steps on overflow")
_NONFINITE_GRADS = Confirm("numerics/{role}/nonfinite_grads", "any_above", 0.0, "gradients were NaN/Inf")
_UNDERFLOW = Confirm(
    "numerics/{role}/grad_underflow_frac",
    "mean_at_least",
    0.05,
    "gradients flushed below fp16's smallest normal",
)
_IS_HIGH = Confirm(
    "rollout_corr/rollout_is_ratio_fraction_high",
    "mean_at_least",
    0.5,
    "the share of tokens whose importance ratio exceeds the threshold (their weight truncated to it)",
)
_IS_OOB = Confirm(
    "rollout_corr/rollout_is_oob_ratio",
    "mean_at_least",
    0.5,
    "the share of tokens outside the IS bounds (weight 0)",
)
_MARGIN = Confirm(
    "rewards/margins",
    "absmax_at_least",
    5.0,
    "beta x the log-ratio margin, past which the sigmoid is saturated",
)
_DPO_LOSS = Confirm("actor/loss", "absmax_at_least", 2.0 * math.log(2.0), "the DPO loss, log 2 at the start")

_KL_DRIFT = Confirm(
    "rollout/kl_ref", "absmax_at_least", 1.0, "the policy's KL from the reference, a nat per token or more"
)

GROWTH_INTERVAL_LOW = 100
"""growth_interval below which the dynamic scale doubles often enough that the overflow it climbs into
skips 1 % of the steps or more (one skip per growth_interval steps at equilibrium): torch's GradScaler
uses 2000, DeepSpeed's loss_scale_window 1000."""
LOSS_SCALE_FACTOR_SPAN = 10.0
"""seq-mean-token-sum-norm's divisor within this factor of the response length (verl's default divisor)."""

RANGES: tuple[Range, ...] = (
    # ---- emitted here
    Range(
        "algo.vf_coef",
        1.0,
        0.01,
        None,
        "verl's critic loss has no coefficient (1); TRL PPOConfig.vf_coef 0.1",
        low="the critic's loss is multiplied by {value:g}: its gradient is 0, the critic never trains and the "
        "GAE advantages come from the value function's random initialisation",
        kind=K.CONFIG_COEF_ZERO,
        severity="error",
        confirm_low=(_ZERO_GRAD,),
    ),
    Range(
        "algo.beta",
        0.1,
        0.01,
        2.0,
        "TRL DPOConfig.beta 0.1; the DPO paper 0.1-0.5",
        high="beta {value:g} makes the DPO loss sigmoid(beta x margin) so sharp that the first steps' margins "
        "saturate it: its gradient vanishes on the right side and explodes the loss on the wrong one",
        low="beta {value:g} makes the implicit reward beta x log-ratio so small that the loss stays at log 2",
        kind=K.CONFIG_SATURATED,
        confirm_high=(_MARGIN, _DPO_LOSS),
    ),
    Range(
        "rollout_correction.rollout_is_threshold",
        2.0,
        1.0,
        None,
        "verl algorithm.rollout_correction.rollout_is_threshold 2.0 (TIS; IcePop lower_upper around 1)",
        low="the truncated importance weight min(ratio, C) with C = {value:g} below 1: an on-policy token "
        "(ratio ~1) is truncated to C, so every token's policy gradient is scaled by C (or zeroed, IcePop's "
        "bounds) against the terms it is not applied to (the KL loss, the entropy)",
        kind=K.CONFIG_IS_TRUNCATION,
        confirm_low=(_IS_HIGH, _IS_OOB),
    ),
    Range(
        "precision.{role}.growth_interval",
        2000,
        GROWTH_INTERVAL_LOW,
        None,
        "torch.amp.GradScaler(growth_interval=2000); DeepSpeed fp16.loss_scale_window 1000",
        low="the dynamic loss scale doubles after every {value:g} finite step(s): it climbs into overflow, "
        "backs off and climbs again, so a share ~1/{value:g} of the optimizer steps is skipped",
        kind=K.CONFIG_SCALER,
        confirm_low=(_SKIPS, _NONFINITE_GRADS),
    ),
    Range(
        "precision.{role}.init_scale",
        2.0**16,
        1.0,
        2.0**24,
        "torch.amp.GradScaler(init_scale=65536)",
        low="a loss scale of {value:g} below 1 multiplies the fp16 gradients down: small ones underflow to 0",
        high="a loss scale of {value:g} overflows the first fp16 backwards: the scaler skips steps until it "
        "has halved its way down",
        kind=K.CONFIG_SCALER,
        confirm_low=(_UNDERFLOW,),
        confirm_high=(_SKIPS,),
    ),
    Range(
        "algo.loss_scale_factor",
        None,
        None,
        None,
        "verl actor.loss_scale_factor (seq-mean-token-sum-norm's divisor; unset: the response length)",
        low="the summed token losses are divided by {value:g} instead of the response length {length:g}: the "
        "loss and its gradients are {ratio:.3g}x the intended size, beyond fp16's range once scaled",
        high="the summed token losses are divided by {value:g} instead of the response length {length:g}: the "
        "loss and its gradients are {ratio:.3g}x the intended size, below fp16's smallest normal once scaled",
        kind=K.CONFIG_LOSS_SCALE_FACTOR,
        confirm_low=(_SKIPS, _NONFINITE_GRADS),
        confirm_high=(_UNDERFLOW,),
    ),
    # a KL switched on with a coefficient of 0: the reference is built and scored, and holds nothing back
    # (the high side is `K.KL_DOMINATES`'s, read from the run)
    Range(
        "algo.kl_coef",
        0.001,
        1e-6,
        None,
        "verl algorithm.kl_ctrl.kl_coef 0.001",
        low="use_kl_in_reward with a KL coefficient of {value:g}: the reference is computed at every step but "
        "its penalty is 0, so nothing keeps the policy near it",
        kind=K.CONFIG_COEF_ZERO,
        checked_by=K.KL_DOMINATES,
        confirm_low=(_KL_DRIFT,),
    ),
    Range(
        "algo.kl_loss_coef",
        0.001,
        1e-6,
        None,
        "verl actor.kl_loss_coef 0.001",
        low="use_kl_loss with a KL loss coefficient of {value:g}: the reference is computed at every step but "
        "the KL term is multiplied by 0, so nothing keeps the policy near it",
        kind=K.CONFIG_COEF_ZERO,
        checked_by=K.KL_DOMINATES,
        confirm_low=(_KL_DRIFT,),
    ),
    # ---- the record of the range; each key has its own check (checked_by)
    Range("algo.lr", 1e-6, 1e-7, 1e-3, "verl actor.optim.lr 1e-6", checked_by=K.WEIGHT_GROWTH),
    Range("algo.critic_lr", 1e-5, 1e-7, 1e-3, "verl critic.optim.lr 1e-5", checked_by=K.WEIGHT_GROWTH),
    Range(
        "algo.weight_decay", 0.01, 0.0, 0.1, "verl actor.optim.weight_decay 0.01", checked_by=K.WEIGHT_DECAY
    ),
    Range("algo.gamma", 1.0, 0.99, 1.0, "verl algorithm.gamma 1.0", checked_by=K.DISCOUNT),
    Range("algo.lam", 1.0, 0.9, 1.0, "verl algorithm.lam 1.0", checked_by=K.DISCOUNT),
    Range("algo.clip_ratio", 0.2, 0.05, 0.5, "verl actor.clip_ratio 0.2", checked_by=K.CLIP_SATURATED),
    Range(
        "algo.kl_ctrl_horizon",
        10000,
        1000,
        None,
        "verl algorithm.kl_ctrl.horizon 10000",
        checked_by=K.KL_CONTROLLER,
    ),
    Range("algo.entropy_coef", 0.0, 0.0, 0.01, "verl actor.entropy_coeff 0", checked_by=K.ENTROPY_DOMINATES),
    Range(
        "algo.label_smoothing", 0.0, 0.0, 0.3, "TRL DPOConfig.label_smoothing 0", checked_by=K.LABEL_SMOOTHING
    ),
    Range("algo.ppo_epochs", 1, 1, 4, "verl actor.ppo_epochs 1", checked_by=K.STALE_UPDATES),
    Range(
        "algo.group_size",
        4,
        2,
        None,
        "verl actor_rollout_ref.rollout.n (GRPO 4-16)",
        checked_by=K.NO_GROUP_BASELINE,
    ),
)
"""Every numeric key with a range; a row with ``kind`` is checked by `setup_findings`."""


EMITTED = (
    K.CONFIG_COEF_ZERO,
    K.CONFIG_SATURATED,
    K.CONFIG_IS_TRUNCATION,
    K.CONFIG_SCALER,
    K.CONFIG_LOSS_SCALE_FACTOR,
)
"""The kinds the rows with a ``kind`` write (the others are ``checked_by`` their own check)."""


def _value(config: Cfg, key: str, role: str, policy: Mapping[str, Any]) -> Any:
    section, _, name = key.partition(".")
    if section == "precision":
        return (policy.get(role) or {}).get(name.rsplit(".", 1)[-1])
    return (config.get(section) or {}).get(name)


def _rows_for(config: Cfg, policy: Mapping[str, Any]) -> list[tuple[Range, str]]:
    """The emitted rows that the run reads, with the role each concerns."""
    algo = config.get("algo") or {}
    name = algo.get("name")
    out: list[tuple[Range, str]] = []
    for row in RANGES:
        if row.kind not in EMITTED:
            continue
        if row.key == "algo.vf_coef" and not (name == "ppo" and estimator(algo) == "gae"):
            continue
        if row.key == "algo.beta" and name != "dpo":
            continue
        if row.key == "algo.kl_coef" and not (name != "dpo" and algo.get("use_kl_in_reward")):
            continue
        if row.key == "algo.kl_loss_coef" and not (name != "dpo" and algo.get("use_kl_loss")):
            continue
        if row.key.startswith("rollout_correction.") and not (config.get("rollout_correction") or {}).get(
            "rollout_is"
        ):
            continue
        if row.key == "algo.loss_scale_factor" and (
            name == "dpo" or algo.get("loss_agg_mode") != "seq-mean-token-sum-norm"
        ):
            continue
        if row.key.startswith("precision."):
            for role, p in policy.items():
                scaling = (p or {}).get("loss_scaling", "none")
                if not (p or {}).get("trainable") or scaling == "none":
                    continue
                if row.key.endswith("growth_interval") and scaling != "dynamic":
                    continue
                out.append((row, role))
            continue
        out.append((row, "critic" if row.key == "algo.vf_coef" else "actor"))
    return out


def _is_bounds(spec: Any) -> tuple[float | None, float | None]:
    """rollout_is_threshold as (lower, upper): a number C is (None, C), ``"lo_hi"`` is (lo, hi)."""

    def num(x: str) -> float | None:
        try:
            return float(x)
        except ValueError:
            return None

    if isinstance(spec, str):
        if "_" in spec:
            lo, _, hi = spec.partition("_")
            return num(lo), num(hi)
        return None, num(spec)
    return None, number(spec)


def _finding(
    row: Range, role: str, side: str, value: float, text: str, fix_value: Any, where: str
) -> Finding:
    confirms = row.confirm_low if side == "low" else row.confirm_high
    bound = row.lo if side == "low" else row.hi
    inside = (
        f"at least {bound:g}"
        if side == "low" and bound is not None
        else (f"at most {bound:g}" if bound is not None else "inside its range")
    )
    suite = f"{where}: {fix_value:g}" if isinstance(fix_value, (int, float)) else f"{where}: {fix_value}"
    return Finding(
        severity="info",
        kind=row.kind or "",
        role=role,
        where=where,
        message=f"{where} {value:g} is outside its sane range ({_range_words(row, where)}; {row.source}): {text}",
        observed={
            "key": where,
            "value": value,
            "side": side,
            "bound": bound,
            "default": row.default,
            "source": row.source,
            "severity": row.severity,
            "fix_value": fix_value,
            "confirm": [c.as_dict(role) for c in confirms],
        },
        expected=f"{where} {inside} ({row.source})",
        fix=f"set {suite}" + _verl_words(where, fix_value),
    )


def _range_words(row: Range, where: str) -> str:
    if row.key == "algo.loss_scale_factor":
        return f"within {LOSS_SCALE_FACTOR_SPAN:g}x of data.response_length"
    if row.lo is not None and row.hi is not None:
        return f"{row.lo:g} to {row.hi:g}"
    return (
        f"at least {row.lo:g}"
        if row.lo is not None
        else f"at most {row.hi:g}"
        if row.hi is not None
        else "any"
    )


def _verl_words(where: str, value: Any) -> str:
    section, _, name = where.partition(".")
    if section == "algo" and name in ("vf_coef", "beta"):
        return "" if name == "vf_coef" else f" (TRL: DPOConfig(beta={value:g}))"
    try:
        if section == "algo":
            return f" (verl: {V.algo_override(name, value)})"
        if section == "rollout_correction":
            return f" (verl: {V.correction_override(name, value)})"
    except KeyError:  # a suite key verl does not have
        return ""
    return " (torch: GradScaler(" + where.rsplit(".", 1)[-1] + f"={value:g}))"


def _check(row: Range, role: str, config: Cfg, policy: Mapping[str, Any]) -> Finding | None:
    value = number(_value(config, row.key, role, policy))
    if row.key == "rollout_correction.rollout_is_threshold":
        lower, upper = _is_bounds((config.get("rollout_correction") or {}).get("rollout_is_threshold"))
        if upper is None:
            return None
        if lower is None and upper < 1.0:
            return _finding(row, role, "low", upper, row.low.format(value=upper), row.default, row.key)
        if lower is not None and (upper < 1.0 or lower > 1.0):
            text = (
                f"IcePop's bounds [{lower:g}, {upper:g}] exclude the on-policy ratio 1: every token whose "
                "rollout and trainer probabilities agree gets weight 0, so the policy gradient is (almost) gone"
            )
            return _finding(row, role, "low", upper if upper < 1.0 else lower, text, "0.5_2.0", row.key)
        return None
    if value is None:
        return None
    where = row.key.format(role=role)
    if row.key.startswith("precision."):
        where = f"precision.overrides.{role}.{row.key.rsplit('.', 1)[-1]}"
    if row.key == "algo.loss_scale_factor":
        length = number((config.get("data") or {}).get("response_length")) or 0.0
        if length <= 0 or value <= 0:
            return None
        ratio = length / value
        if 1.0 / LOSS_SCALE_FACTOR_SPAN <= ratio <= LOSS_SCALE_FACTOR_SPAN:
            return None
        side = "low" if ratio > 1 else "high"
        text = (row.low if side == "low" else row.high).format(value=value, length=length, ratio=ratio)
        f = _finding(row, role, side, value, text, int(length), where)
        f.observed["bound"] = (
            length / LOSS_SCALE_FACTOR_SPAN if side == "low" else length * LOSS_SCALE_FACTOR_SPAN
        )
        return dataclasses.replace(
            f,
            expected=f"{where} within {LOSS_SCALE_FACTOR_SPAN:g}x of data.response_length {length:g} (or unset)",
        )
    if row.lo is not None and value < row.lo and row.low:
        fix = row.default if row.default is not None and row.default != value else row.lo
        return _finding(row, role, "low", value, row.low.format(value=value), fix, where)
    if row.hi is not None and value > row.hi and row.high:
        fix = row.default if row.default is not None and row.default != value else row.hi
        return _finding(row, role, "high", value, row.high.format(value=value), fix, where)
    return None


def setup_findings(config: Cfg, policy: Mapping[str, Any] | None = None) -> list[Finding]:
    """An ``info`` finding for every emitted row (`RANGES`) whose key the run reads and sets outside its
    range; ``policy``: role -> the resolved precision policy's fields (the manifest's ``policy.roles``)."""
    pol = dict(policy or {})
    out = []
    for row, role in _rows_for(config, pol):
        f = _check(row, role, config, pol)
        if f is not None:
            out.append(f)
    return out
