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
- ``dynamics/entropy_dominates``: the entropy bonus per token (``entropy_coef`` x ``actor/entropy``, the
  term the loss subtracts) against the advantages' scale (1 when they are whitened or divided by the
  group std): from `ENTROPY_SHARE` on, raising every token's entropy pays as much as following the
  advantages, and the policy drifts toward uniform over the vocabulary.
- ``dynamics/kl_controller``: the KL-in-reward coefficient the run reports (``actor/reward_kl_penalty_coeff``)
  turned negative or grew `KL_COEF_GROWTH` times its start: an adaptive controller running away (the
  controller's step size is also checked before the run, `verlaudit.audit.config_checks`).
- ``dynamics/rejection_saturated``: rollout rejection (``rollout_correction.rollout_rs``) masked
  `REJECT_FRAC` or more of the response tokens (``rollout_corr/rollout_rs_masked_fraction``): a threshold
  tighter than the rollout/trainer log-prob difference, so the tokens left are a biased few.
- ``dynamics/sampling_collapse`` (`DynamicsWatch.rollout`, on the rollout's ids): the responses of most
  groups are token-identical while a sampling key narrows the distribution (``algo.temperature`` below
  `LOW_TEMPERATURE`, ``algo.top_k`` 1-2, ``rollout.top_p`` below `LOW_TOP_P`): the sampling setting, not
  the reward, is why the group-relative advantages are zero. ``dynamics/sampling_noise``: the
  opposite, a temperature of `HIGH_TEMPERATURE` or more whose sampled tokens' mean -log p reaches
  `NOISE_SHARE` of log(vocab): the responses are near-uniform noise.

Beside these, `verlaudit.audit.update_effect` (called from `DynamicsWatch.step_end`) reads what a legal key did
to the update from the trainer's measurements of it: a gradient clip that sets every update, a value clip
that removes the critic's, a policy update with no trust region on a side, a preference loss that lowers
the chosen answers.

Thresholds come from healthy tiny runs (the clean controls of ``benchmarks/blind_faults``: on-policy,
clip fraction 0; the shipped ``suites/tiny_cpu.yaml``, 4 optimizer steps a batch at lr 2e-3 for 40 steps:
clip fraction at most 0.30, KL penalty at most 1.3x the score's std after the std fell to 0.02) and are
stated with their margins beside each constant.
Exercised by `pytest tests/test_dynamics.py tests/test_dynamics_config.py`.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Mapping
from typing import Any

import torch

from trainer.advantages import ADV_ESTIMATOR
from trainer.recipes import RECIPE
from verlaudit import kinds as K
from verlaudit import verl_keys as V
from verlaudit.audit.update_effect import UpdateEffect
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
ENTROPY_SHARE = 0.5
"""The entropy bonus per token (coefficient x entropy) over the advantages' scale from which it competes
with the policy gradient: verl's former default 0.001 (now 0) at the entropy of a uniform 150k vocabulary
(11.9 nats) gives 0.012, a coefficient of 0.01 at that entropy 0.12: 4x below at the largest usual setting."""
KL_COEF_GROWTH = 10.0
"""The KL coefficient over its starting value from which the controller ran away: verl's adaptive
controller at its default horizon moves it by at most 2% a step (10x takes over 100 steps)."""
REJECT_FRAC = 0.25
"""The share of response tokens rollout rejection masks from which it is not outlier removal: rejection is
meant for the few tokens whose rollout/trainer ratio is far out (the clean bf16 runs differ by a few
1e-3 in log-prob; verl's suggested ratio bounds [0.5, 2] mask well under 1% of their tokens)."""
IDENTICAL_GROUPS = 0.5
"""The share of a step's groups whose responses are token-identical from which sampling is the cause to
check (at temperature 1 the tiny SFT'd policy repeats itself in some groups, never in most, with a key
set to narrow it)."""
LOW_TEMPERATURE = 0.3
"""A sampling temperature below which the distribution is near-greedy (verl's GRPO recipes use 0.6-1.2)."""
HIGH_TEMPERATURE = 1.5
"""A sampling temperature from which the rollout distribution may be flattened to noise (verl's recipes
stay at or below 1.2); checked against the sampled tokens' log-probs (`NOISE_SHARE`)."""
NOISE_SHARE = 0.7
"""The sampled tokens' mean -log p over log(vocab) from which the sampling is near-uniform: a trained
policy at temperature 1 samples far below it (the tiny SFT'd model: under 0.05); only read at a
temperature of `HIGH_TEMPERATURE` or more, since a random-init model at temperature 1 is near 1 too."""
LOW_TOP_P = 0.3
"""A top_p below which nucleus sampling keeps the argmax token alone at a peaked position."""


def number(v: Any) -> float | None:
    """A setting or metric as a finite float, else None (a bool, a string, NaN are no number here)."""
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) else None


def estimator(algo: Mapping[str, Any]) -> str | None:
    """The advantage estimator a run uses: ``algo.adv_estimator``, else its recipe's."""
    est = algo.get("adv_estimator")
    if est:
        return str(est)
    try:
        return RECIPE.entry(str(algo.get("name") or "")).info.get("estimator")
    except ValueError:
        return None


def estimator_params(name: str | None) -> set[str]:
    """The parameters of an advantage estimator's function (``index``: it takes a group baseline)."""
    if not name:
        return set()
    try:
        return set(inspect.signature(ADV_ESTIMATOR.get(name)).parameters)
    except ValueError:
        return set()


def batch_rows(algo: Mapping[str, Any]) -> int | None:
    """Rows of one rollout batch: batch_size prompts, times group_size under GRPO."""
    b = a_int(algo, "batch_size")
    if b is None:
        return None
    return b * (a_int(algo, "group_size") or 1) if algo.get("name") == "grpo" else b


class DynamicsWatch:
    """The dynamics checks of one run (module docstring): built from the run's ``algo`` settings (the
    flat suite keys), fed each step's metrics by the `Auditor`."""

    def __init__(
        self,
        algo: Mapping[str, Any] | None,
        *,
        rollout: Mapping[str, Any] | None = None,
        correction: Mapping[str, Any] | None = None,
        reported: set[str] | None = None,
    ) -> None:
        self.algo = dict(algo or {})
        self.rollout_cfg = dict(rollout or {})
        """The run's ``rollout`` section (``top_p``)."""
        self.correction = dict(correction or {})
        """The run's ``rollout_correction`` section (the rejection option and threshold a finding names)."""
        self.entropies: list[tuple[int | None, float]] = []
        self.kl_coefs: list[tuple[int | None, float]] = []
        a = self.algo
        self.name = str(a.get("name") or "")
        self.estimator = estimator(a)
        self.reported: set[str] = set(reported or ())
        """Kinds already recorded (at setup, `verlaudit.audit.config_checks`, or by an earlier step)."""
        self.effect = UpdateEffect(self.algo, self.correction)
        """The measured effect of the clip, trust-region and preference keys (`verlaudit.audit.update_effect`)."""

    # -- derived settings ---------------------------------------------------------------------
    def rows(self) -> int | None:
        return batch_rows(self.algo)

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
        eps = number(a.get("clip_ratio"))
        sides = [(number(a.get(k)), k) for k in ("clip_ratio_low", "clip_ratio_high")]
        sides = [(v if v is not None else eps, k if v is not None else "clip_ratio") for v, k in sides]
        sides = [(v, k) for v, k in sides if v is not None]
        return min(sides) if sides else None

    # -- the checks ---------------------------------------------------------------------------
    def step_end(self, metrics: Mapping[str, Any], *, step: int | None) -> list[Finding]:
        out: list[Finding] = []
        for kind, check in (
            (K.KL_CONTROLLER, self._kl_controller),
            (K.CLIP_SATURATED, self._clip),
            (K.KL_DOMINATES, self._kl),
            (K.NO_GROUP_BASELINE, self._group),
            (K.ENTROPY_DOMINATES, self._entropy),
            (K.REJECTION_SATURATED, self._rejection),
        ):
            if kind in self.reported:
                continue
            found = check(metrics, step)
            if found is not None:
                self.reported.add(found.kind)
                self.reported.add(kind)
                out.append(found)
        # dyn12: what a legal key did to the update (the clips' share, the trust region, the direction)
        out.extend(self.effect.step_end(metrics, step=step, reported=self.reported))
        return out

    def _clip(self, m: Mapping[str, Any], step: int | None) -> Finding | None:
        frac, clip = number(m.get("actor/pg_clipfrac")), self.clip_range()
        if frac is None or clip is None or frac < CLIP_SATURATED:
            return None
        eps, key = clip
        n = self.optimizer_steps()
        kl = number(m.get("actor/ppo_kl"))
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
                number(m.get(k)) for k in ("critic/score/mean", "critic/rewards/mean", "critic/score/std")
            )
            beta = number(m.get("actor/reward_kl_penalty_coeff")) or number(a.get("kl_coef"))
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
            kl, coef = (
                number(m.get("actor/kl_loss")),
                number(m.get("actor/kl_coef")) or number(a.get("kl_loss_coef")),
            )
            if kl is None or not coef:
                return None
            kind = str(a.get("kl_loss_type") or "low_var_kl")
            per_token = coef if kind in ("kl", "k1", "abs", "k1+") else coef * math.sqrt(2 * abs(kl))
            scale = 1.0 if a.get("norm_adv_by_std_in_grpo", True) else number(m.get("critic/score/std"))
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

    def _advantage_scale(self, m: Mapping[str, Any]) -> float | None:
        """The advantages' scale per token: 1 when the estimator whitens them or divides by the group
        std (gae, reinforce++, grpo by default), else the score's spread."""
        est = str(self.estimator or "")
        if est in ("gae", "reinforce_plus_plus", "reinforce_plus_plus_baseline") or (
            est == "grpo" and self.algo.get("norm_adv_by_std_in_grpo", True)
        ):
            return 1.0
        std = number(m.get("critic/score/std"))
        return std if std and std > 0 else None

    def _entropy(self, m: Mapping[str, Any], step: int | None) -> Finding | None:
        coef, ent = number(self.algo.get("entropy_coef")), number(m.get("actor/entropy"))
        if not coef or coef <= 0 or ent is None or self.name == "dpo":
            return None
        self.entropies.append((step, ent))
        scale = self._advantage_scale(m)
        if not scale:
            return None
        share = coef * ent / scale
        if share < ENTROPY_SHARE:
            return None
        first_step, first = self.entropies[0]
        trend = (
            f"; actor/entropy rose from {first:.3g} at step {first_step} to {ent:.3g} ({ent / first:.3g}x): the "
            "bonus is raising it"
            if first > 0 and ent > 1.5 * first
            else ""
        )
        suggest = _round_down(coef * 0.1 * ENTROPY_SHARE / share)
        return Finding(
            severity="warning",
            kind=K.ENTROPY_DOMINATES,
            role="actor",
            where="algo.entropy_coef",
            step=step,
            phase="actor_update",
            message=f"the entropy bonus (algo.entropy_coef {coef:g} x actor/entropy {ent:.3g} = {coef * ent:.3g} per "
            f"token; verl: {V.algo_key('entropy_coef')}) is {share:.3g}x the advantages' scale ({scale:.3g}): raising "
            f"every token's entropy pays as much as following the reward, so the policy is pushed toward uniform "
            f"over the vocabulary{trend}",
            observed={
                "entropy_coef": coef,
                "entropy": ent,
                "share": round(share, 4),
                "entropy_by_step": dict(self.entropies),
            },
            expected=f"entropy_coef x entropy below {ENTROPY_SHARE:g}x the advantages' scale (verl's default 0)",
            fix=f"set algo.entropy_coef: 0 (verl's default; verl: {V.algo_override('entropy_coef', 0)}), or at most "
            f"{suggest:g}",
        )

    def _kl_controller(self, m: Mapping[str, Any], step: int | None) -> Finding | None:
        coef = number(m.get("actor/reward_kl_penalty_coeff"))
        adaptive = str(self.algo.get("kl_ctrl_type") or "fixed") == "adaptive"
        if coef is None or not self.algo.get("use_kl_in_reward") or not adaptive:
            return None  # a fixed coefficient is the kl_coef set (`_kl` weighs it)
        self.kl_coefs.append((step, coef))
        start = self.kl_coefs[0][1]
        if start <= 0 or (coef > 0 and coef < KL_COEF_GROWTH * start):
            return None
        what = (
            "turned negative: a negative coefficient rewards drifting from the reference"
            if coef <= 0
            else (f"grew {coef / start:.3g}x: the KL term, not the task, soon decides the reward")
        )
        horizon = self.algo.get("kl_ctrl_horizon")
        return Finding(
            severity="warning",
            kind=K.KL_CONTROLLER,
            role="actor",
            where="algo.kl_ctrl_horizon",
            step=step,
            phase="reward",
            message=f"the KL-in-reward coefficient (actor/reward_kl_penalty_coeff) went from {start:g} to {coef:g} "
            f"by step {step} ({', '.join(f'{c:.3g}' for _, c in self.kl_coefs)}): it {what}"
            + f" (algo.kl_ctrl_type adaptive, algo.kl_ctrl_horizon {horizon}, kl_ctrl_target_kl "
            f"{self.algo.get('kl_ctrl_target_kl')})",
            observed={"kl_coef_by_step": dict(self.kl_coefs), "kl_ctrl_type": self.algo.get("kl_ctrl_type")},
            expected="a coefficient that stays positive and moves a few % per step",
            fix=f"set algo.kl_ctrl_horizon: 10000 (verl: {V.algo_override('kl_ctrl_horizon', 10000)}), or a fixed "
            f"coefficient (algo.kl_ctrl_type: fixed; verl: {V.algo_override('kl_ctrl_type', 'fixed')})",
        )

    def _rejection(self, m: Mapping[str, Any], step: int | None) -> Finding | None:
        frac = number(m.get("rollout_corr/rollout_rs_masked_fraction"))
        if frac is None or frac < REJECT_FRAC:
            return None
        seq = number(m.get("rollout_corr/rollout_rs_seq_masked_fraction"))
        rc = self.correction
        option, threshold = rc.get("rollout_rs"), rc.get("rollout_rs_threshold")
        diff = number(m.get("rollout_corr/abs_diff_mean")) or number(
            m.get("training/rollout_log_probs_abs_diff_mean")
        )
        seen = (
            f" (the mean |log-prob difference| rollout vs trainer is {diff:.3g})" if diff is not None else ""
        )
        return Finding(
            severity="warning",
            kind=K.REJECTION_SATURATED,
            role="actor",
            where="rollout_correction.rollout_rs_threshold",
            step=step,
            phase="actor_update",
            message=f"rollout rejection (rollout_correction.rollout_rs {option}, rollout_rs_threshold {threshold}; "
            f"verl: {V.correction_key('rollout_rs_threshold')}) masked {frac:.0%} of the response tokens"
            + (f" and touched {seq:.0%} of the sequences" if seq is not None else "")
            + f" out of the policy gradient{seen}: the threshold is tighter than the rollout/trainer difference "
            "itself, so it removes the distribution, not its outliers, and the update learns from a biased few",
            observed={
                "masked_fraction": frac,
                "seq_masked_fraction": seq,
                "rollout_rs": option,
                "rollout_rs_threshold": threshold,
            },
            expected=f"rejection of under {REJECT_FRAC:.0%} of the tokens (outliers only)",
            fix="widen rollout_correction.rollout_rs_threshold (a k1 ratio bound such as 2.0, i.e. [0.5, 2]; verl: "
            f"{V.correction_override('rollout_rs_threshold', 2.0)}), or drop rollout_rs and correct with "
            f"rollout_correction.rollout_is: token ({V.correction_override('rollout_is', 'token')})",
        )

    def rollout(
        self, payload: Mapping[str, Any], *, step: int | None, phase: str | None, vocab: int | None = None
    ) -> list[Finding]:
        """``dynamics/sampling_collapse`` from a rollout's ids and ``dynamics/sampling_noise`` from its
        log-probs (`Auditor.on_rollout`; ``vocab``: the actor's output rows): each once per run."""
        if (payload.get("trainer_facts") or {}).get("used") is False:
            return []  # ReMax's greedy baseline: no loss reads it
        return [
            *self._noise(payload, vocab, step=step, phase=phase),
            *self._collapse(payload, step=step, phase=phase),
        ]

    def _noise(self, payload: Mapping[str, Any], vocab: int | None, *, step, phase) -> list[Finding]:
        """Sampling so hot that the responses are drawn from a near-uniform distribution."""
        if K.SAMPLING_NOISE in self.reported or not vocab or vocab < 2:
            return []
        facts = payload.get("engine_facts") or {}
        temp = number(facts.get("temperature"))
        temp = temp if temp is not None else number(self.algo.get("temperature"))
        lp, mask = payload.get("logprobs"), payload.get("response_mask")
        if temp is None or temp < HIGH_TEMPERATURE or not isinstance(lp, torch.Tensor) or not lp.numel():
            return []
        m = mask.float() if isinstance(mask, torch.Tensor) and mask.shape == lp.shape else torch.ones_like(lp)
        if not float(m.sum()):
            return []
        nats = float(-(lp.float() * m).sum() / m.sum())
        share = nats / math.log(vocab)
        if not math.isfinite(share) or share < NOISE_SHARE:
            return []
        self.reported.add(K.SAMPLING_NOISE)
        return [
            Finding(
                severity="warning",
                kind=K.SAMPLING_NOISE,
                role="actor",
                where="algo.temperature",
                step=step,
                phase=phase,
                message=f"the rollout samples at algo.temperature {temp:g} ({V.TEMPERATURE}): the sampled tokens' "
                f"mean -log p is {nats:.3g} nats, {share:.0%} of a uniform choice over the {vocab} tokens "
                f"(log {vocab} = {math.log(vocab):.3g}): the responses are noise, whatever the policy learned, so "
                "the rewards and the advantages carry no signal about it",
                observed={
                    "temperature": temp,
                    "mean_nll": round(nats, 4),
                    "uniform_nll": round(math.log(vocab), 4),
                },
                expected=f"temperature about 1 (sampled tokens well below {NOISE_SHARE:.0%} of log(vocab))",
                fix=f"set algo.temperature: 1.0 (verl: {V.TEMPERATURE}=1.0)",
            )
        ]

    def _collapse(self, payload: Mapping[str, Any], *, step, phase) -> list[Finding]:
        """A group's responses token-identical under a narrowing sampler."""
        if K.SAMPLING_COLLAPSE in self.reported or self.name != "grpo":
            return []
        g = a_int(self.algo, "group_size") or 0
        if g < 2:
            return []
        narrow = self._narrow_sampling(payload.get("engine_facts") or {})
        if not narrow:
            return []
        ids, mask = payload.get("response_ids"), payload.get("response_mask")
        if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.shape[0] % g or not ids.shape[0]:
            return []
        resp = (
            ids.masked_fill(mask == 0, -1)
            if isinstance(mask, torch.Tensor) and mask.shape == ids.shape
            else ids
        )
        groups = resp.reshape(-1, g, resp.shape[-1])
        same = int((groups == groups[:, :1]).all(-1).all(-1).sum())
        n = groups.shape[0]
        if same < IDENTICAL_GROUPS * n:
            return []
        self.reported.add(K.SAMPLING_COLLAPSE)
        keys = "; ".join(f"{k} {v:g} ({why})" for k, v, why, _, _ in narrow)
        fixes = " and ".join(f"{k}: {default}" for k, _, _, default, _ in narrow)
        verl = " ".join(f"{V.ROLLOUT}.{k.rsplit('.', 1)[-1]}={d}" for k, _, _, _, d in narrow)
        return [
            Finding(
                severity="warning",
                kind=K.SAMPLING_COLLAPSE,
                role="actor",
                where=narrow[0][0],
                step=step,
                phase=phase,
                message=f"{same} of {n} groups' {g} responses are token-identical under {keys}: the sampling is "
                "near-greedy, so every response of a prompt is the same, gets the same reward, and the "
                "group-relative advantages are zero: no learning signal, whatever the reward",
                observed={
                    "identical_groups": same,
                    "groups": n,
                    "group_size": g,
                    **{k: v for k, v, _, _, _ in narrow},
                },
                expected="diverse responses within a group (temperature about 1, no top_k / top_p narrowing)",
                fix=f"set {fixes} (verl: {verl}) so a group's responses differ",
            )
        ]

    def _narrow_sampling(self, facts: Mapping[str, Any]) -> list[tuple[str, float, str, str, str]]:
        """(suite key, value, why, the value to set, verl's) of each sampling setting that removes diversity."""
        a = self.algo

        def seen(key: str, configured: Any) -> float | None:  # what the engine reports, else the config
            v = number(facts.get(key))
            return v if v is not None else number(configured)

        temp = seen("temperature", a.get("temperature"))
        top_k = seen("top_k", a.get("top_k"))
        top_p = seen("top_p", self.rollout_cfg.get("top_p"))
        out = []
        if temp is not None and temp < LOW_TEMPERATURE:
            out.append(("algo.temperature", temp, f"below {LOW_TEMPERATURE:g}: near-greedy", "1.0", "1.0"))
        if top_k is not None and 0 < top_k <= 2:
            out.append(("algo.top_k", top_k, "one or two candidate tokens", "0", "-1"))
        if top_p is not None and top_p < LOW_TOP_P:
            out.append(("rollout.top_p", top_p, f"below {LOW_TOP_P:g}: the argmax token alone", "1.0", "1.0"))
        return out

    def _group(self, m: Mapping[str, Any], step: int | None) -> Finding | None:
        if self.name != "grpo" or a_int(self.algo, "group_size") != 1 or not self.estimator:
            return None
        if "index" not in estimator_params(str(self.estimator)):
            return None  # no group baseline (REINFORCE++, ReMax): a group of one is how it runs
        adv, score = number(m.get("critic/advantages/mean")), number(m.get("critic/score/mean"))
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
