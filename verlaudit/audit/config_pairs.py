"""Keys that are each inside their range and wrong together: one table of conditional invariants between
the run's suite keys and its precision policy (`PAIRS`), read before the first step (`setup_findings`).

`verlaudit.audit.config_ranges` checks each numeric key alone; a row here holds when another key gives
it its meaning: the loss type that reads the scale key, the dtype the sampled logits are rounded to, the
loss scaling that multiplies an unnormalised sum. Each row names its keys, where the rule comes from
(verl's ``ppo_trainer.yaml`` and docs, TRL's ``DPOConfig``, the paper), and the arithmetic of the
combination; its finding is ``info`` with the metric tests that would show the consequence
(``observed["confirm"]``, the tests of `config_ranges.Confirm`), or, for a combination that is wrong
whatever the run shows (``observed["by_construction"]``), the severity it should be reported at.
`verlaudit.analysis.diagnose.pair_cause` makes it a cause when the run's metrics confirm it (or by
construction), with the fix that changes one of the keys to a value it does not have.

Rows:
- ``config/penalty_twice``: the KL to the reference subtracted from the reward (``use_kl_in_reward``)
  and added to the actor loss (``use_kl_loss``): verl documents them as alternatives (PPO's in-reward
  penalty, GRPO's KL loss); together the policy is pulled back by both, at coefficients tuned for one.
- ``config/label_smoothing`` (robust DPO): ``dpo_loss: robust`` divides by 1 - 2 eps; from eps 1/3 the
  loss is 3x as steep as plain DPO's at a zero margin and its flipped-label term, weighted
  eps / (1 - 2 eps), makes it unbounded below in the margin (Chowdhury et al. 2024, TRL's ``robust``).
- ``config/loss_type_scale``: IPO reads ``beta`` as tau and regresses the per-token log-ratio margin onto
  1 / (2 tau) (Azar et al. 2023; TRL's ``ipo``): a tau set like a small DPO beta asks for a margin of tens
  of nats per token, and the squared loss starts at 1 / (4 tau^2).
- ``config/loss_agg_fp16``: ``loss_agg_mode`` token-sum / seq-mean-token-sum under fp16
  loss scaling: the loss is a sum over the mini-batch's tokens (or a sequence's), not a mean, so it and
  its gradients are that many times larger and overflow fp16 once multiplied by the loss scale.
- ``config/clip_zero_width``: ``clip_ratio_low`` / ``clip_ratio_high`` 0 makes that bound 1 - 0 = 1 (1 + 0):
  every token whose ratio moves to that side is clipped, so the update stops after the first step.
- ``config/temperature_dtype``: the sampled log-probs are log_softmax(logits / T); logits rounded to a
  16-bit float carry an error of half the dtype's spacing at their magnitude, and dividing by T multiplies
  it by 1 / T: at T 0.1 the rollout's and the trainer's log-probs differ 10x as much as at T 1.
- ``config/kl_loss_no_gradient``: ``use_kl_loss`` with ``kl_loss_type`` ``kl`` (k1, logp - ref_logp) and a
  non-zero ``kl_loss_coef``: on tokens sampled from the policy, k1's gradient is the score function
  grad log pi(y), whose expectation under pi is 0 (sum_y grad pi(y) = grad 1 = 0), so the KL *loss* adds
  zero-mean noise and no pull to the reference; k2 (``mse``, 0.5 (logp - ref)^2) and k3 (``low_var_kl``) have
  the KL's gradient in expectation (Schulman 2020, "Approximating KL divergence"; verl's kl_loss_type docs).
  The same estimator in the reward (``kl_penalty: kl``) is fine: there it is a value, not a gradient.

GRPO's std normalisation over groups whose rewards differ by a tie-break is not a key pair but a key and
the run's rewards: `verlaudit.analysis.diagnose.pair_cause.adv_norm_causes` reads it from the audit's
``reward/tiny_std_group_frac`` (`verlaudit.audit.reward_signal.tiny_std_groups`).

Exercised by `pytest tests/test_config_pairs.py`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from verlaudit import kinds as K
from verlaudit import verl_keys as V
from verlaudit.audit.config_ranges import Confirm
from verlaudit.audit.dynamics import batch_rows, number
from verlaudit.rundir import Finding

Cfg = Mapping[str, Any]

ROBUST_EPS_HIGH = 1.0 / 3.0
"""robust DPO's eps from which 1 / (1 - 2 eps) is 3 or more (cDPO's bar in `config_checks`)."""
IPO_TAU_LOW = 0.02
"""IPO's tau below which its target margin 1 / (2 tau) is over 25 nats per token: 5x what TRL's default
(beta 0.1: a margin of 5) asks for; the loss then starts at 1 / (4 tau^2) = 625 or more."""
TEMPERATURE_LOW = 0.3
"""A sampling temperature from which 1 / T multiplies the rounding of 16-bit logits by 3.3 or more (RL
rollouts sample at 0.6-1.0; verl's default 1.0)."""
SUM_TOKENS_HIGH = 32
"""Tokens summed into one loss (token-sum: the mini-batch's; seq-mean-token-sum: a sequence's) from
which the loss is 32x or more a token-mean's: 5 doublings of the loss scale lost to overflow."""
LOW_LOGITS = ("bf16", "fp16")

_SKIPS = Confirm("{role}/skipped", "any_above", 0.0, "the loss scaler skipped optimizer steps on overflow")
_NONFINITE = Confirm("numerics/{role}/nonfinite_grads", "any_above", 0.0, "gradients were NaN/Inf")
_IPO_LOSS = Confirm(
    "actor/loss",
    "absmax_at_least",
    1.0 / (4.0 * IPO_TAU_LOW**2),
    "the IPO loss, (margin - 1 / (2 tau))^2: 1 / (4 tau^2) at a zero margin",
)
_MISMATCH = Confirm(
    "rollout_corr/abs_diff_mean",
    "mean_at_least",
    1e-3,
    "the mean |rollout - trainer| log-prob per token: the two compute different logits, a rounding "
    "difference the 1 / T multiplies (a rollout sharing the trainer's dtype and kernels measures 0)",
)
_PPO_KL = Confirm(
    "actor/ppo_kl", "any_above", 0.0, "the policy moved from the rollout's (the clip applies to it)"
)


@dataclasses.dataclass(frozen=True)
class Pair:
    """One invariant between keys: the keys it reads, where it comes from, and its check (config,
    resolved policy roles -> a finding or None)."""

    name: str
    keys: tuple[str, ...]
    source: str
    check: Callable[[Cfg, Mapping[str, Any]], Finding | None]


def _verl(key: str, value: Any) -> str:
    try:
        return f" (verl: {V.algo_override(key.removeprefix('algo.'), value)})"
    except KeyError:
        return ""


def _finding(
    kind: str,
    where: str,
    message: str,
    *,
    role: str = "actor",
    values: Mapping[str, Any],
    fix_key: str,
    fix_value: Any,
    fix_why: str,
    source: str,
    severity: str = "warning",
    confirm: tuple[Confirm, ...] = (),
    expected: str,
    extra: Mapping[str, Any] | None = None,
) -> Finding:
    text = str(fix_value).lower() if isinstance(fix_value, bool) else f"{fix_value}"
    return Finding(
        severity="info",
        kind=kind,
        role=role,
        where=where,
        message=message,
        observed={
            "keys": dict(values),
            "key": where,
            "fix_key": fix_key,
            "fix_value": text,
            "source": source,
            "severity": severity,
            "by_construction": not confirm,
            "confirm": [c.as_dict(role) for c in confirm],
            **(extra or {}),
        },
        expected=expected,
        fix=f"set {fix_key}: {text}{_verl(fix_key, fix_value)}; {fix_why}",
    )


def kl_twice(config: Cfg, policy: Mapping[str, Any]) -> Finding | None:
    algo = config.get("algo") or {}
    if algo.get("name") == "dpo" or not (algo.get("use_kl_in_reward") and algo.get("use_kl_loss")):
        return None
    kc, lc = number(algo.get("kl_coef")), number(algo.get("kl_loss_coef"))
    if not kc or not lc:  # a coefficient of 0 is config_ranges' (coefficient_zero)
        return None
    grpo = algo.get("name") == "grpo"
    off = "algo.use_kl_in_reward" if grpo else "algo.use_kl_loss"
    keep = "the KL loss (GRPO's form)" if grpo else "the in-reward penalty (PPO's form)"
    return _finding(
        K.CONFIG_PENALTY_TWICE,
        off,
        f"the KL to the reference is penalised twice: subtracted from the reward (algo.use_kl_in_reward, "
        f"kl_coef {kc:g}; verl: {V.algo_key('use_kl_in_reward')}) and added to the actor loss "
        f"(algo.use_kl_loss, kl_loss_coef {lc:g}; verl: {V.algo_key('use_kl_loss')}): both the reward and "
        "the loss pull the policy back to the reference, at coefficients each tuned to be the only one, "
        "and the KL in the reward also enters the critic's returns",
        values={"use_kl_in_reward": True, "kl_coef": kc, "use_kl_loss": True, "kl_loss_coef": lc},
        fix_key=off,
        fix_value=False,
        fix_why=f"keep one KL term, {keep}",
        source="verl docs (algorithm.use_kl_in_reward / actor.use_kl_loss: PPO's in-reward KL or GRPO's KL "
        "loss, one of them)",
        expected="one of use_kl_in_reward / use_kl_loss",
    )


def robust_eps(config: Cfg, policy: Mapping[str, Any]) -> Finding | None:
    algo = config.get("algo") or {}
    eps = number(algo.get("label_smoothing"))
    if algo.get("name") != "dpo" or str(algo.get("dpo_loss") or "") != "robust" or eps is None:
        return None
    if not ROBUST_EPS_HIGH <= eps < 0.5:
        return None
    scale, flipped = 1.0 / (1.0 - 2.0 * eps), eps / (1.0 - 2.0 * eps)
    return _finding(
        K.LABEL_SMOOTHING,
        "algo.label_smoothing",
        f"algo.label_smoothing {eps:g} with dpo_loss robust (TRL's DPOConfig(loss_type='robust')): the robust "
        f"loss is divided by 1 - 2 x {eps:g} = {1 - 2 * eps:.3g}, so at a zero margin it is {scale:.3g}x as "
        f"steep as plain DPO's, and its flipped-label term, weighted {eps:g} / {1 - 2 * eps:.3g} = "
        f"{flipped:.3g}, is unbounded below in the margin: every margin change moves the loss {scale:.3g}x "
        "as much and the loss keeps falling as the margins grow",
        values={"dpo_loss": "robust", "label_smoothing": eps},
        fix_key="algo.label_smoothing",
        fix_value=0.1,
        fix_why="robust DPO's eps is the share of flipped labels you believe in, 0.0-0.1 (0 is plain DPO)",
        source="Chowdhury et al. 2024 (provably robust DPO); TRL DPOConfig.label_smoothing (0 default)",
        extra={"loss_scale": round(scale, 4), "flipped_weight": round(flipped, 4)},
        expected=f"label_smoothing below {ROBUST_EPS_HIGH:.2g} with dpo_loss robust",
    )


def ipo_tau(config: Cfg, policy: Mapping[str, Any]) -> Finding | None:
    algo = config.get("algo") or {}
    tau = number(algo.get("beta"))
    if algo.get("name") != "dpo" or str(algo.get("dpo_loss") or "") != "ipo" or not tau or tau <= 0:
        return None
    if tau >= IPO_TAU_LOW:
        return None
    target = 1.0 / (2.0 * tau)
    return _finding(
        K.CONFIG_LOSS_TYPE_SCALE,
        "algo.beta",
        f"algo.beta {tau:g} with dpo_loss ipo: IPO reads beta as its tau and regresses the per-token "
        f"log-ratio margin onto 1 / (2 tau) = {target:.3g} nats (a DPO-sized beta is not an IPO tau): the "
        f"loss starts at 1 / (4 tau^2) = {target**2:.3g} and pushes the margins {target:.3g} nats per token "
        "from the reference",
        values={"dpo_loss": "ipo", "beta": tau},
        fix_key="algo.beta",
        fix_value=0.1,
        fix_why="IPO's tau of 0.1-1 asks for a margin of 0.5-5 nats per token (TRL's default beta 0.1)",
        source="Azar et al. 2023 (IPO: margin target 1 / (2 tau)); TRL DPOConfig(loss_type='ipo', beta=tau)",
        confirm=(_IPO_LOSS,),
        extra={"target_margin": target},
        expected=f"IPO tau (algo.beta) of at least {IPO_TAU_LOW:g}",
    )


def sum_under_fp16(config: Cfg, policy: Mapping[str, Any]) -> Finding | None:
    algo, data = config.get("algo") or {}, config.get("data") or {}
    mode = str(algo.get("loss_agg_mode") or "token-mean")
    if algo.get("name") == "dpo" or mode not in ("token-sum", "seq-mean-token-sum"):
        return None
    actor = policy.get("actor") or {}
    if str(actor.get("loss_scaling") or "none") == "none":
        return None
    length = int(number(data.get("response_length")) or 0)
    rows = number(algo.get("mini_batch_size")) or batch_rows(algo) or 0
    tokens = int(length * rows) if mode == "token-sum" else length
    if tokens < SUM_TOKENS_HIGH:
        return None
    scale = number(actor.get("init_scale")) or 65536.0
    what = f"{int(rows)} rows x {length} tokens" if mode == "token-sum" else f"{length} tokens of a sequence"
    return _finding(
        K.CONFIG_LOSS_AGG_FP16,
        "algo.loss_agg_mode",
        f"algo.loss_agg_mode {mode} under fp16 loss scaling ({actor.get('loss_scaling')}, init scale "
        f"{scale:g}): the actor loss is summed over up to {what} = {tokens} instead of averaged, so the loss "
        f"and its gradients are ~{tokens}x a token-mean's; multiplied by the loss scale they overflow fp16 "
        "(inf) and the scaler skips steps while it halves the scale",
        values={"loss_agg_mode": mode, "tokens_summed": tokens, "loss_scaling": actor.get("loss_scaling")},
        fix_key="algo.loss_agg_mode",
        fix_value="token-mean",
        fix_why="a mean over the tokens keeps the loss the size of one token's (verl's default)",
        source="verl actor.loss_agg_mode (token-mean default); torch GradScaler overflow handling",
        confirm=(_SKIPS, _NONFINITE),
        extra={"loss_magnitude_factor": tokens},
        expected=f"loss_agg_mode token-mean (or a sum over fewer than {SUM_TOKENS_HIGH} tokens) under fp16",
    )


def clip_zero(config: Cfg, policy: Mapping[str, Any]) -> Finding | None:
    algo = config.get("algo") or {}
    if algo.get("name") == "dpo" or str(algo.get("loss_mode") or "vanilla") not in ("vanilla", "dual_clip"):
        return None
    for key, side in (("clip_ratio_low", "1 - 0 = 1"), ("clip_ratio_high", "1 + 0 = 1")):
        v = number(algo.get(key))
        if v is None or v != 0.0:
            continue
        fix = number(algo.get("clip_ratio")) or 0.2
        return _finding(
            K.CONFIG_CLIP_ZERO_WIDTH,
            f"algo.{key}",
            f"algo.{key} 0 sets that side's clip bound to {side}: the clip range has zero width on that side, "
            "so every token whose ratio moves past 1 that way (with an advantage pushing it further) is "
            "clipped and gets no gradient; after the first mini-batch the policy cannot move those tokens "
            f"(unset {key}, or 0.2, is the usual range; 0 does not mean 'no clip')",
            values={key: 0.0, "clip_ratio": number(algo.get("clip_ratio"))},
            fix_key=f"algo.{key}",
            fix_value=fix if fix > 0 else 0.2,
            fix_why="a clip width of 0.1-0.3 (verl's clip_ratio 0.2); leave it unset for clip_ratio's",
            source="verl actor.clip_ratio_low / clip_ratio_high (default clip_ratio 0.2; PPO, DAPO's 0.2/0.28)",
            confirm=(_PPO_KL,),
            expected=f"{key} above 0 (or unset)",
        )
    return None


def temperature_dtype(config: Cfg, policy: Mapping[str, Any]) -> Finding | None:
    algo = config.get("algo") or {}
    temp = number(algo.get("temperature"))
    if algo.get("name") == "dpo" or temp is None or temp <= 0 or temp > TEMPERATURE_LOW:
        return None
    rollout = policy.get("rollout") or {}
    dtype = str(rollout.get("compute_dtype") or "")
    if dtype not in LOW_LOGITS:
        return None
    rel = 2.0**-8 if dtype == "bf16" else 2.0**-11  # half a unit of the last place, relative
    return _finding(
        K.CONFIG_TEMPERATURE_DTYPE,
        "algo.temperature",
        f"algo.temperature {temp:g} with the rollout's logits in {dtype} (precision of the rollout role): the "
        f"log-probs are log_softmax(logits / {temp:g}), and the logits' rounding ({dtype}: a relative "
        f"{rel:.2g} of their magnitude) is multiplied by 1 / T = {1 / temp:.3g} in the logits the softmax sees, "
        f"so the rollout's and the trainer's logits disagree by up to {1 / temp:.3g}x what they would at "
        "temperature 1 (predicted from the dtype; the measured log-prob difference is the confirmation): a "
        "rollout/trainer mismatch (off-policy tokens) that the temperature amplifies",
        role="rollout",
        values={"temperature": temp, "rollout_compute_dtype": dtype},
        fix_key="precision.overrides.rollout.compute_dtype",
        fix_value="fp32",
        fix_why="keep the rollout's logits in fp32 at a low temperature, or sample at algo.temperature 1.0 "
        "(verl's actor_rollout_ref.rollout.temperature), or correct it with rollout_correction.rollout_is: token",
        source="verl rollout-correction docs (bf16 rollouts drift off-policy); the softmax's 1 / T amplification",
        confirm=(_MISMATCH,),
        extra={"amplification": 1.0 / temp, "relative_rounding": rel},
        expected=f"temperature above {TEMPERATURE_LOW:g} with 16-bit rollout logits, or fp32 logits",
    )


K1_NAMES = ("kl", "k1")
"""verl's names of the k1 estimator logp - ref_logp (`trainer.losses.KL_ESTIMATOR`); ``k1+`` takes k2's
gradient (straight-through) and ``abs`` has one, so neither is this row's."""


def k1_kl_loss(config: Cfg, policy: Mapping[str, Any]) -> Finding | None:
    algo = config.get("algo") or {}
    kind = str(algo.get("kl_loss_type") or "low_var_kl")
    coef = number(algo.get("kl_loss_coef"))
    if algo.get("name") == "dpo" or not algo.get("use_kl_loss") or kind not in K1_NAMES or not coef:
        return None
    return _finding(
        K.CONFIG_KL_LOSS_NO_GRADIENT,
        "algo.kl_loss_type",
        f"algo.kl_loss_type {kind} (the k1 estimator logp - ref_logp; verl: {V.algo_key('kl_loss_type')}) "
        f"as the actor's KL loss (use_kl_loss, kl_loss_coef {coef:g}): the loss is computed on tokens sampled "
        "from the policy itself, where k1's gradient is the score function grad log pi(y), and its "
        "expectation under pi is zero (sum_y pi(y) grad log pi(y) = grad sum_y pi(y) = 0): the 'KL "
        "regularisation' adds zero-mean noise to the update and no pull towards the reference, whatever "
        "the coefficient; the k2 (mse) and k3 (low_var_kl) estimators carry the KL's gradient",
        values={"use_kl_loss": True, "kl_loss_type": kind, "kl_loss_coef": coef},
        fix_key="algo.kl_loss_type",
        fix_value="low_var_kl",
        fix_why="k3 (low_var_kl, verl's GRPO recipes) or k2 (mse) as the KL loss: their gradient in "
        "expectation is the KL's; keep k1 (kl) for the in-reward penalty (kl_penalty), where it is a value",
        source="Schulman 2020, 'Approximating KL divergence' (k1 / k2 / k3); verl actor.kl_loss_type docs",
        expected="kl_loss_type low_var_kl (k3) or mse (k2) when the KL is a loss",
    )


PAIRS: tuple[Pair, ...] = (
    Pair("kl_twice", ("algo.use_kl_in_reward", "algo.use_kl_loss"), "verl docs", kl_twice),
    Pair("robust_eps", ("algo.dpo_loss", "algo.label_smoothing"), "robust DPO", robust_eps),
    Pair("ipo_tau", ("algo.dpo_loss", "algo.beta"), "IPO", ipo_tau),
    Pair("sum_under_fp16", ("algo.loss_agg_mode", "precision.actor.loss_scaling"), "verl", sum_under_fp16),
    Pair("clip_zero", ("algo.clip_ratio_low", "algo.clip_ratio_high"), "verl", clip_zero),
    Pair(
        "temperature_dtype",
        ("algo.temperature", "precision.rollout.compute_dtype"),
        "softmax",
        temperature_dtype,
    ),
    Pair("k1_kl_loss", ("algo.use_kl_loss", "algo.kl_loss_type", "algo.kl_loss_coef"), "k1", k1_kl_loss),
)
"""Every conditional invariant between keys (module docstring)."""

EMITTED = (
    K.CONFIG_PENALTY_TWICE,
    K.LABEL_SMOOTHING,
    K.CONFIG_LOSS_TYPE_SCALE,
    K.CONFIG_LOSS_AGG_FP16,
    K.CONFIG_CLIP_ZERO_WIDTH,
    K.CONFIG_TEMPERATURE_DTYPE,
    K.CONFIG_KL_LOSS_NO_GRADIENT,
)


def setup_findings(config: Cfg, policy: Mapping[str, Any] | None = None) -> list[Finding]:
    """An ``info`` finding for every row of `PAIRS` whose combination the run sets; ``policy``: role -> the
    resolved precision policy's fields (the manifest's ``policy.roles``)."""
    pol = dict(policy or {})
    out = []
    for pair in PAIRS:
        f = pair.check(config, pol)
        if f is not None:
            out.append(dataclasses.replace(f, observed={**f.observed, "pair": pair.name}))
    return out
