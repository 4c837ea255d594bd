"""Settings that make a loss or an update degenerate by construction, read from the suite keys before the
first step (`setup_findings`, called by the `Auditor` at setup; no device work, no metrics needed).

Each is one finding kind, named on the suite key (``where``: ``algo.<key>``) with verl's key (or TRL's,
for the DPO keys verl does not have) in the message and the fix, and the arithmetic that makes the
setting degenerate in ``observed``:

- ``config/label_smoothing``: DPO's ``label_smoothing`` eps assumes a fraction eps of the preference
  labels is flipped. cDPO (``sigmoid``) mixes the two directions: the loss is minimal at the
  implicit-reward margin log((1 - eps) / eps) and at a zero margin its gradient is (1 - 2 eps) of plain
  DPO's, so at eps near 0.5 there is almost no preference to learn (Adam normalises the gradient's
  scale, not the optimum's place). ``robust`` divides by (1 - 2 eps) and keeps pushing the margin up:
  a scaled loss under Adam, not a degenerate one, so it is not reported.
- ``config/discount``: the outcome score sits on the last response token, so with a discount gamma the
  first token's return holds gamma^(L - 1) of it (L = ``data.response_length``); gamma 0 gives the score
  to the last token only. With GAE, lambda 0 makes every advantage the one-step TD error: the score
  reaches earlier tokens only through the critic's values, one token per update.
- ``dynamics/kl_controller`` (here: by construction): verl's adaptive KL controller multiplies the
  coefficient after each step by 1 + clip(kl / target - 1, +-0.2) x batch / horizon; when 0.2 x batch /
  horizon reaches `KL_CTRL_STEP` the coefficient changes by half or more per step, and at 1 or more a
  KL below target drives it to zero or below (a negative coefficient rewards drifting from the
  reference). `verlaudit.audit.dynamics` reads the same kind from the coefficient the run reports.
- ``config/weight_decay``: decoupled AdamW decay multiplies every weight by 1 - lr x weight_decay at
  each optimizer step, whatever the loss; from `DECAY_PER_STEP` the weights shrink measurably every
  step (half-life under 70 optimizer steps), and a smaller decay is still one when the run's optimizer
  steps compound it to `DECAY_RUN_KEEP` or less.

The thresholds sit far outside what verl's recipes and the shipped suites use, each stated beside its
constant. Exercised by `pytest tests/test_dynamics_config.py`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from verlaudit import kinds as K
from verlaudit import verl_keys as V
from verlaudit.audit.dynamics import batch_rows, estimator, estimator_params, number
from verlaudit.rundir import Finding

LABEL_SMOOTHING_HIGH = 1.0 / 3.0
"""cDPO's eps from which the preference gradient at a zero margin is a third of plain DPO's or less
(1 - 2 eps) and the loss's optimum margin is log 2 or less: TRL's examples and the cDPO note use 0.1
(gradient 0.8x), so this is 3x past the common setting."""
CREDIT_MIN = 0.1
"""The share of the outcome score that reaches the first response token (gamma^(L - 1)) below which the
credit is cut: verl's recipes keep gamma 1 (share 1); gamma 0.99 over 200 tokens is 0.13."""
KL_CTRL_STEP = 0.5
"""0.2 x batch / horizon (the adaptive controller's largest change per step) from which the coefficient
moves by half or more in one step: verl's default horizon 10000 with a batch of 1024 gives 0.02."""
DECAY_PER_STEP = 0.01
"""lr x weight_decay from which decay alone shrinks every weight by 1% or more per optimizer step:
verl's defaults (lr 1e-6, weight_decay 0.01) give 1e-8, the tiny suites' lr 2e-3 x 0.01 give 2e-5."""
DECAY_RUN_KEEP = 0.5
"""The share of every weight that decay alone leaves after the run's optimizer steps, at or below which
the run decays the model by half whatever it learns: verl's defaults over 10^4 steps keep 0.9999."""


def label_smoothing(algo: Mapping[str, Any]) -> list[Finding]:
    """``config/label_smoothing`` for cDPO (``dpo_loss: sigmoid`` with eps)."""
    eps, loss = number(algo.get("label_smoothing")), str(algo.get("dpo_loss") or "sigmoid")
    if algo.get("name") != "dpo" or eps is None or eps < LABEL_SMOOTHING_HIGH or loss != "sigmoid":
        return []
    scale = 1.0 - 2.0 * eps
    margin = math.log((1.0 - eps) / eps) if eps < 0.5 else 0.0
    return [
        Finding(
            severity="warning",
            kind=K.LABEL_SMOOTHING,
            role="actor",
            where="algo.label_smoothing",
            message=f"algo.label_smoothing {eps:g} (TRL's DPOConfig.label_smoothing) with dpo_loss sigmoid (cDPO) "
            f"assumes {eps:.0%} of the preference labels are flipped, so its two terms nearly cancel: the loss is "
            f"lowest at an implicit-reward margin of only log((1 - eps) / eps) = {margin:.3g} (plain DPO keeps "
            "pushing the margin up), past which it pushes the margin back, and at a zero margin the preference "
            f"gradient is 1 - 2 x {eps:g} = {scale:.3g} of plain DPO's: the policy learns almost no preference",
            observed={
                "label_smoothing": eps,
                "dpo_loss": loss,
                "gradient_scale": round(scale, 4),
                "optimal_margin": round(margin, 4),
            },
            expected=f"label_smoothing below {LABEL_SMOOTHING_HIGH:.2g} (0 = plain DPO; 0.1 for noisy labels)",
            fix="set algo.label_smoothing to the fraction of labels you believe are flipped, 0.0-0.1 "
            "(algo.label_smoothing: 0.0 is plain DPO; TRL: DPOConfig(label_smoothing=0.0))",
        )
    ]


def discount(algo: Mapping[str, Any], data: Mapping[str, Any]) -> list[Finding]:
    """``config/discount`` for an estimator that discounts (its signature takes ``gamma``)."""
    est = estimator(algo)
    params = estimator_params(est)
    if algo.get("name") == "dpo" or "gamma" not in params:
        return []
    gamma, lam = number(algo.get("gamma")), number(algo.get("lam"))
    length = int(number(data.get("response_length")) or 0)
    if gamma is None or length < 2:
        return []
    share = gamma ** (length - 1)
    if share < CREDIT_MIN:
        suggest = 1.0
        return [
            Finding(
                severity="warning",
                kind=K.DISCOUNT,
                role="actor",
                where="algo.gamma",
                message=f"algo.gamma {gamma:g} ({V.algo_key('gamma')}) with the {est} estimator and an outcome "
                f"score on the last of up to {length} response tokens (data.response_length): the first token's "
                f"return holds gamma^{length - 1} = {share:.3g} of the score"
                + (
                    ", so the score reaches the last token only: every earlier token is credited with its own "
                    "KL penalty (or 0), the credit assignment is cut"
                    if gamma == 0
                    else ": the early tokens that decide the answer get almost none of the credit"
                ),
                observed={
                    "gamma": gamma,
                    "response_length": length,
                    "first_token_share": share,
                    "adv_estimator": est,
                },
                expected=f"gamma^(response_length - 1) of at least {CREDIT_MIN:g} (LLM RL uses gamma 1.0)",
                fix=f"set algo.gamma: {suggest:g} (verl: {V.algo_override('gamma', suggest)})",
            )
        ]
    if "lam" in params and lam == 0.0:
        return [
            Finding(
                severity="warning",
                kind=K.DISCOUNT,
                role="actor",
                where="algo.lam",
                message=f"algo.lam 0 ({V.algo_key('lam')}) with GAE: every token's advantage is its one-step TD "
                "error r + gamma V(next) - V(this), so the outcome score on the last token reaches earlier tokens "
                "only through the critic's values, one token further per update: the policy learns from the "
                "untrained critic, not from the score",
                observed={"lam": lam, "gamma": gamma, "adv_estimator": est},
                expected="lam 0.95-1.0 (verl's default 1.0)",
                fix=f"set algo.lam: 1.0 (verl: {V.algo_override('lam', 1.0)}) or 0.95",
            )
        ]
    return []


def kl_controller(algo: Mapping[str, Any]) -> list[Finding]:
    """``dynamics/kl_controller`` when the adaptive controller's step size is unstable by construction."""
    if not algo.get("use_kl_in_reward") or str(algo.get("kl_ctrl_type") or "fixed") != "adaptive":
        return []
    horizon, batch = number(algo.get("kl_ctrl_horizon")), number(algo.get("batch_size"))
    if not horizon or not batch:
        return []
    rows = batch_rows(algo)
    step = 0.2 * rows / horizon
    if step < KL_CTRL_STEP:
        return []
    target, coef = number(algo.get("kl_ctrl_target_kl")), number(algo.get("kl_coef"))
    sign = f"a KL below target multiplies it by {1 - step:.3g}: " + (
        "it reaches 0 or turns negative, and a negative coefficient rewards drifting from the reference"
        if step >= 1
        else "it collapses within a few steps"
    )
    want = int(math.ceil(rows * 0.2 / 0.02))
    return [
        Finding(
            severity="warning",
            kind=K.KL_CONTROLLER,
            role="actor",
            where="algo.kl_ctrl_horizon",
            message=f"the adaptive KL controller (algo.kl_ctrl_type adaptive, kl_ctrl_target_kl {target:g}, "
            f"algo.kl_ctrl_horizon {horizon:g}; verl: {V.algo_key('kl_ctrl_horizon')}) multiplies the KL "
            f"coefficient (algo.kl_coef {coef:g}) after each step by 1 + clip(kl / target - 1, +-0.2) x {rows:g} "
            f"sequences / {horizon:g} = 1 +- {step:.3g}: a KL above target multiplies it by {1 + step:.3g} per "
            f"step (geometric growth), {sign}",
            observed={
                "kl_ctrl_horizon": horizon,
                "batch_rows": rows,
                "max_change_per_step": step,
                "kl_ctrl_target_kl": target,
                "kl_coef": coef,
            },
            expected=f"0.2 x batch / horizon below {KL_CTRL_STEP:g} (verl's default horizon 10000)",
            fix=f"set algo.kl_ctrl_horizon: {max(want, 10000)} (verl: "
            f"{V.algo_override('kl_ctrl_horizon', max(want, 10000))}) so the coefficient moves a few % per step, "
            f"or use a fixed coefficient (algo.kl_ctrl_type: fixed; verl: {V.algo_override('kl_ctrl_type', 'fixed')})",
        )
    ]


def _updates(algo: Mapping[str, Any], steps: Any) -> int | None:
    """Optimizer steps of the whole run: steps x ceil(rows / mini-batch) x ppo_epochs (1 for DPO)."""
    n, batch = number(steps), number(algo.get("batch_size"))
    if not n or not batch:
        return None
    rows = batch_rows(algo)
    mini = number(algo.get("mini_batch_size")) or rows
    epochs = 1 if algo.get("name") == "dpo" else int(number(algo.get("ppo_epochs")) or 1)
    return int(n) * int(math.ceil(rows / mini)) * epochs


def weight_decay(algo: Mapping[str, Any], steps: Any = None) -> list[Finding]:
    """``config/weight_decay`` for each trainable role whose lr x weight_decay reaches `DECAY_PER_STEP`,
    or whose decay over the run's optimizer steps alone keeps `DECAY_RUN_KEEP` of the weights or less."""
    wd = number(algo.get("weight_decay"))
    if not wd or wd <= 0:
        return []
    lrs = [("actor", "algo.lr", number(algo.get("lr")))]
    if algo.get("name") == "ppo" and estimator(algo) == "gae":
        lrs.append(("critic", "algo.critic_lr", number(algo.get("critic_lr"))))
    updates = _updates(algo, steps)
    out: list[Finding] = []
    for role, key, lr in lrs:
        per = (lr or 0.0) * wd
        keep = max(0.0, 1.0 - per)
        run_keep = keep**updates if updates else None
        if per < DECAY_PER_STEP and (run_keep is None or run_keep > DECAY_RUN_KEEP):
            continue
        half = math.log(0.5) / math.log(keep) if 0 < keep < 1 else 0.0
        want = min(DECAY_PER_STEP / 10, (1 - DECAY_RUN_KEEP ** (1 / max(updates or 1, 1))) / 10) / (lr or 1.0)
        suggest = 0.01 if want >= 0.01 else float(f"{want:.0e}")  # 10x under either bar, at most verl's 0.01
        over = (
            f"; over the run's {updates} optimizer steps decay alone leaves {run_keep:.2g} of every weight"
            if run_keep is not None
            else ""
        )
        out.append(
            Finding(
                severity="warning",
                kind=K.WEIGHT_DECAY,
                role=role,
                where="algo.weight_decay",
                message=f"algo.weight_decay {wd:g} ({V.algo_key('weight_decay')}) at {key} {lr:g}: decoupled "
                f"AdamW decay multiplies every {role} weight by 1 - lr x weight_decay = {keep:.3g} at each "
                f"optimizer step, whatever the loss"
                + (f" (halved every {half:.1f} steps)" if half else " (zeroed at the first step)")
                + f"{over}: the trained weights decay toward 0 and the model's knowledge with them",
                observed={
                    "weight_decay": wd,
                    "lr": lr,
                    "decay_per_step": per,
                    "half_life_steps": round(half, 2),
                    "optimizer_steps": updates,
                    "kept_after_run": run_keep,
                },
                expected=f"lr x weight_decay below {DECAY_PER_STEP:g} and over {DECAY_RUN_KEEP:g} of each weight "
                "kept by the end (verl's default weight_decay 0.01)",
                fix=f"set algo.weight_decay: {suggest:g} (verl: {V.algo_override('weight_decay', suggest)}; "
                "0.0-0.1 is usual)",
            )
        )
    return out


def setup_findings(config: Mapping[str, Any]) -> list[Finding]:
    """Every by-construction check of the run's config (module docstring), once before the first step."""
    algo, data = dict(config.get("algo") or {}), dict(config.get("data") or {})
    return [
        *label_smoothing(algo),
        *discount(algo, data),
        *kl_controller(algo),
        *weight_decay(algo, config.get("steps")),
    ]
