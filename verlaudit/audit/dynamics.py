"""Training dynamics as causes: the settings that make an update do nothing, or too much, read from the
step's own metrics (`DynamicsWatch`, fed ``on_step_end``'s metrics; no device work).

Each check is one finding kind, recorded once per run at the first step that shows it, with the numbers
and the suite key (and verl's) that set it:

- ``dynamics/clip_saturated``: a token clip range (``algo.clip_ratio`` / ``clip_ratio_low`` / ``_high``)
  far narrower than one optimizer step moves the policy, while the run clips most tokens: clipped
  tokens carry no policy gradient, so every update after a step's first mini-batch does almost nothing.
- ``dynamics/stale_updates``: so many optimizer steps on one rollout batch (``ppo_epochs`` x mini-batches
  per batch) that the policy drifts far from the one that sampled it: the run clips most tokens with a
  clip range of the usual width. The ratio drift is the evidence (``actor/pg_clipfrac``, ``actor/ppo_kl``).
- ``dynamics/kl_dominates``: the KL term outweighs the task. In the reward (``use_kl_in_reward``), the
  penalty's share of the return (score mean - reward mean, i.e. beta x the KL summed over the response)
  against the score's spread across responses; in the loss (``use_kl_loss``), the KL term's gradient
  per token (``kl_loss_coef`` x its derivative in the log-prob: 1 for k1 / abs, |log pi/ref| ~
  sqrt(2 kl_loss) for k2 / k3) against the advantages' scale (1 when GRPO divides by the group std).
- ``dynamics/no_group_baseline``: a group-baseline estimator (GRPO, RLOO, ...: verl's ``uid`` groups)
  with one response per prompt: the baseline is the response's own score (GRPO: the advantage is the raw
  score; RLOO: 0), so there is no comparison between responses to learn from.

Thresholds come from healthy tiny runs (the clean controls of ``benchmarks/blind_faults``: on-policy,
clip fraction 0; the shipped ``suites/tiny_cpu.yaml``, 4 optimizer steps a batch at lr 2e-3 for 40 steps:
clip fraction at most 0.30, KL penalty at most 1.3x the score's std after the std fell to 0.02) and are
stated with their margins beside each constant. Exercised by `pytest tests/test_dynamics.py`.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Mapping
from typing import Any

from trainer.advantages import ADV_ESTIMATOR
from trainer.recipes import RECIPE
from verlaudit import kinds as K
from verlaudit import verl_keys as V
from verlaudit.rundir import Finding

TOKEN_CLIP_MODES = ("vanilla", "clip_cov", "kl_cov")
"""Loss modes whose ``clip_ratio`` bounds each token's ratio (GSPO's sequence ratio is clipped at 3e-4 by
design, GMPO clips the log-ratio, CISPO and SAPO are not PPO clips: their ranges are not compared)."""
CLIP_NARROW = 0.05
"""A token clip range below this is narrow: 4x under verl's default 0.2 and 2x under the narrowest
in common use (0.1); the runs that need it (GSPO) are not token clips."""
CLIP_SATURATED = 0.2
"""A clip fraction (``actor/pg_clipfrac``, the step's mean over mini-batches) from which a narrow clip
range (`CLIP_NARROW`) is the update: an on-policy step clips nothing (the controls: 0), and a clip range
of 0.001 measured 0.52-0.57 (the first mini-batch, on-policy, clips nothing, so 0.75 of the later ones).
A narrow range is abnormal by itself; this only asks that clipping is seen to act."""
STALE_CLIPFRAC = 0.4
"""The clip fraction at the usual clip width from which a batch is stale (with `STALE_STEPS`): the
tiny suite (4 optimizer steps a batch at lr 2e-3, clip 0.2) measures at most 0.30 in 40 steps, 64
steps a batch measured 0.48-0.59; only the side whose clip binds counts, so 0.5-0.75 is saturation."""
STALE_STEPS = 16
"""Optimizer steps on one rollout batch from which the batch is stale: verl's recipes take 1-16 (DAPO:
512 prompts in mini-batches of 32); the tiny suite 4. Taken together with a saturated clip fraction."""
KL_REWARD_SHARE = 10.0
"""The KL penalty's share of the return, over the score's standard deviation, from which the penalty
and not the task decides the advantages: the controls measure at most 0.05, the tiny suite's 40 steps
at most 1.3 (once the score's std fell to 0.02): a margin of 7x."""
KL_LOSS_SHARE = 1.0
"""The KL loss's gradient per token over the advantages' scale from which it outweighs the policy
gradient: at kl_loss_coef 0.01 the tiny GRPO runs measure below 0.01 (100x below)."""


def _f(v: Any) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) else None


class DynamicsWatch:
    """The dynamics checks of one run (module docstring): built from the run's ``algo`` settings (the
    flat suite keys), fed each step's metrics by the `Auditor`."""

    def __init__(self, algo: Mapping[str, Any] | None) -> None:
        self.algo = dict(algo or {})
        a = self.algo
        self.name = str(a.get("name") or "")
        self.estimator = a.get("adv_estimator") or self._recipe_estimator()
        self.reported: set[str] = set()

    def _recipe_estimator(self) -> str | None:
        try:
            return RECIPE.entry(self.name).info.get("estimator")
        except ValueError:
            return None

    # -- derived settings ---------------------------------------------------------------------
    def rows(self) -> int | None:
        b = a_int(self.algo, "batch_size")
        if b is None:
            return None
        return b * (a_int(self.algo, "group_size") or 1) if self.name == "grpo" else b

    def optimizer_steps(self) -> int | None:
        """Optimizer steps the actor takes on one rollout batch: ppo_epochs x ceil(rows / mini-batch)."""
        rows, mini = self.rows(), a_int(self.algo, "mini_batch_size")
        if rows is None or not mini:
            return None
        return (a_int(self.algo, "ppo_epochs") or 1) * -(-rows // mini)

    def clip_range(self) -> tuple[float, str] | None:
        """(the narrower side of the token clip, the suite key that sets it), None for other losses."""
        a = self.algo
        if self.name == "dpo" or str(a.get("loss_mode") or "vanilla") not in TOKEN_CLIP_MODES:
            return None
        eps = _f(a.get("clip_ratio"))
        sides = [(_f(a.get(k)), k) for k in ("clip_ratio_low", "clip_ratio_high")]
        sides = [(v if v is not None else eps, k if v is not None else "clip_ratio") for v, k in sides]
        sides = [(v, k) for v, k in sides if v is not None]
        return min(sides) if sides else None

    # -- the checks ---------------------------------------------------------------------------
    def step_end(self, metrics: Mapping[str, Any], *, step: int | None) -> list[Finding]:
        out: list[Finding] = []
        for kind, check in (
            (K.CLIP_SATURATED, self._clip),
            (K.KL_DOMINATES, self._kl),
            (K.NO_GROUP_BASELINE, self._group),
        ):
            if kind in self.reported:
                continue
            found = check(metrics, step)
            if found is not None:
                self.reported.add(found.kind)
                self.reported.add(kind)
                out.append(found)
        return out

    def _clip(self, m: Mapping[str, Any], step: int | None) -> Finding | None:
        frac, clip = _f(m.get("actor/pg_clipfrac")), self.clip_range()
        if frac is None or clip is None or frac < CLIP_SATURATED:
            return None
        eps, key = clip
        n = self.optimizer_steps()
        kl = _f(m.get("actor/ppo_kl"))
        drift = math.sqrt(2 * abs(kl)) if kl is not None else None
        moved = f" (actor/ppo_kl {kl:.3g}: a typical |log ratio| of {drift:.2g})" if drift is not None else ""
        observed = {"pg_clipfrac": round(frac, 4), key: eps, "optimizer_steps_per_batch": n, "ppo_kl": kl}
        if eps < CLIP_NARROW:
            return Finding(
                severity="warning",
                kind=K.CLIP_SATURATED,
                role="actor",
                where=f"algo.{key}",
                step=step,
                phase="actor_update",
                message=f"algo.{key} {eps:g} clips {frac:.0%} of the tokens (actor/pg_clipfrac) over the "
                f"step's {n or '?'} optimizer steps{moved}: the clip range is far narrower than one update "
                "moves the policy, so after a step's first mini-batch almost every token's ratio is clipped "
                "and carries no policy gradient: the updates do almost nothing",
                observed=observed,
                expected=f"{key} of 0.1-0.3 (verl's default 0.2), clip fraction well below {CLIP_SATURATED:g}",
                fix=f"set algo.{key}: 0.2 (verl: {V.algo_override(key, 0.2)})",
            )
        if n is not None and n >= STALE_STEPS and frac >= STALE_CLIPFRAC:
            mini, epochs = a_int(self.algo, "mini_batch_size"), a_int(self.algo, "ppo_epochs") or 1
            rows = self.rows()
            want = max(1, -(-(rows or 1) // 4))
            return Finding(
                severity="warning",
                kind=K.STALE_UPDATES,
                role="actor",
                where="algo.mini_batch_size",
                step=step,
                phase="actor_update",
                message=f"{n} optimizer steps on each rollout batch (algo.ppo_epochs {epochs} x {rows} rows / "
                f"algo.mini_batch_size {mini}): the policy drifts far from the one that sampled the batch "
                f"within the step{moved}, and the clip range {eps:g} clips {frac:.0%} of the tokens "
                "(actor/pg_clipfrac): the later updates are off-policy and mostly clipped",
                observed=observed,
                expected=f"fewer than {STALE_STEPS} optimizer steps a batch, clip fraction well below "
                f"{STALE_CLIPFRAC:g}",
                fix=f"take fewer optimizer steps a batch: algo.mini_batch_size: {want}, algo.ppo_epochs: 1 "
                f"(verl: {V.algo_override('mini_batch_size', want)} {V.algo_override('ppo_epochs', 1)}; "
                "verl's mini-batch counts prompts)",
            )
        return None

    def _kl(self, m: Mapping[str, Any], step: int | None) -> Finding | None:
        a = self.algo
        if a.get("use_kl_in_reward"):
            score, reward, std = (
                _f(m.get(k)) for k in ("critic/score/mean", "critic/rewards/mean", "critic/score/std")
            )
            beta = _f(m.get("actor/reward_kl_penalty_coeff")) or _f(a.get("kl_coef"))
            if score is not None and reward is not None and std and std > 0:
                penalty = abs(score - reward)
                share = penalty / std
                if share >= KL_REWARD_SHARE:
                    suggest = _round_down(beta * 0.1 / share) if beta else None
                    return Finding(
                        severity="warning",
                        kind=K.KL_DOMINATES,
                        role="actor",
                        where="algo.kl_coef",
                        step=step,
                        phase="reward",
                        message=f"the KL penalty in the reward (algo.kl_coef {beta:g} x the KL summed over "
                        f"the response: {penalty:.3g} per response) is {share:.3g}x the task score's spread "
                        f"(critic/score/std {std:.3g}): the penalty, not the task, decides the advantages, "
                        "so the policy learns to stay at the reference",
                        observed={"penalty": round(penalty, 6), "score_std": round(std, 6), "kl_coef": beta},
                        expected=f"a penalty below {KL_REWARD_SHARE:g}x the score's std",
                        fix=f"lower algo.kl_coef to {suggest:g} or less (verl: "
                        f"{V.algo_override('kl_coef', suggest)}), or let an adaptive controller set it "
                        f"(algo.kl_ctrl_type: adaptive; verl: {V.algo_override('kl_ctrl_type', 'adaptive')})"
                        if suggest
                        else "lower algo.kl_coef",
                    )
        if a.get("use_kl_loss"):
            kl, coef = _f(m.get("actor/kl_loss")), _f(m.get("actor/kl_coef")) or _f(a.get("kl_loss_coef"))
            if kl is None or not coef:
                return None
            kind = str(a.get("kl_loss_type") or "low_var_kl")
            per_token = coef if kind in ("kl", "k1", "abs", "k1+") else coef * math.sqrt(2 * abs(kl))
            scale = 1.0 if a.get("norm_adv_by_std_in_grpo", True) else _f(m.get("critic/score/std"))
            if not scale:
                return None
            share = per_token / scale
            if share < KL_LOSS_SHARE:
                return None
            suggest = _round_down(coef * 0.1 / share)
            return Finding(
                severity="warning",
                kind=K.KL_DOMINATES,
                role="actor",
                where="algo.kl_loss_coef",
                step=step,
                phase="actor_update",
                message=f"the KL loss (algo.kl_loss_coef {coef:g}, {kind}, actor/kl_loss {kl:.3g}) pulls each "
                f"token's log-prob {share:.3g}x as hard as the advantages push it (their scale "
                f"{scale:.3g}): the update follows the reference, not the reward",
                observed={"kl_loss": kl, "kl_loss_coef": coef, "grad_share": round(share, 4)},
                expected=f"a KL gradient below {KL_LOSS_SHARE:g}x the advantages' scale",
                fix=f"lower algo.kl_loss_coef to {suggest:g} or less (verl: {V.algo_override('kl_loss_coef', suggest)})",
            )
        return None

    def _group(self, m: Mapping[str, Any], step: int | None) -> Finding | None:
        if self.name != "grpo" or a_int(self.algo, "group_size") != 1 or not self.estimator:
            return None
        try:
            fn = ADV_ESTIMATOR.get(str(self.estimator))
        except ValueError:
            return None
        if "index" not in inspect.signature(fn).parameters:
            return None  # no group baseline (REINFORCE++, ReMax): a group of one is how it runs
        adv, score = _f(m.get("critic/advantages/mean")), _f(m.get("critic/score/mean"))
        seen = (
            f" (critic/advantages/mean {adv:.3g}, critic/score/mean {score:.3g})"
            if adv is not None and score is not None
            else ""
        )
        return Finding(
            severity="warning",
            kind=K.NO_GROUP_BASELINE,
            role="actor",
            where="algo.group_size",
            step=step,
            phase="reward",
            message=f"algo.group_size 1 with the {self.estimator} estimator: every group holds one response, "
            f"so its group baseline is its own score{seen}: there is no comparison between responses of a "
            "prompt, the advantage is the raw score (GRPO) or 0 (RLOO), and the policy pushes up whatever it sampled",
            observed={"group_size": 1, "advantages_mean": adv, "score_mean": score},
            expected="group_size >= 2 (verl's rollout.n defaults to 1: set it)",
            fix=f"sample several responses per prompt: algo.group_size: 4 (verl: {V.algo_override('group_size', 4)})",
        )


def a_int(algo: Mapping[str, Any], key: str) -> int | None:
    v = algo.get(key)
    return int(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def _round_down(x: float) -> float:
    """``x`` rounded down to one significant digit (0.0347 -> 0.03)."""
    if x <= 0 or not math.isfinite(x):
        return x
    e = math.floor(math.log10(x))
    return float(f"{math.floor(x / 10**e)}e{e}")
