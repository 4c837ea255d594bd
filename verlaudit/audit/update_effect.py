"""What a legal key did to the update, measured from each step's metrics (`UpdateEffect`, fed by
`verlaudit.audit.dynamics.DynamicsWatch.step_end`; no device work). A key can be inside every range
table and still make the update null, total or backwards; these checks read how the update behaved
(the trainer's ``actor/pg_clipfrac_high`` / ``_low``, ``actor/ratio_outside_usual_*``, ``dpo/*_pull``:
`trainer.update_stats`; the pre-clip ``<role>/grad_norm``; ``critic/vf_clipfrac``), not the key's value
alone, and name the key that set the behaviour with the measured effect:

- ``dynamics/grad_clip_total``: ``algo.max_grad_norm`` a small fraction of the pre-clip gradient norm at
  every step (clip coefficient max_grad_norm / grad_norm at most `CLIP_COEF_NULL`): the clip, not the
  loss, sets every update's size.
- ``dynamics/value_clip_total``: the value clip (``algo.cliprange_value``) narrower than a tenth of the
  returns' spread while it clips `VF_CLIP_TOTAL` or more of the tokens (mean over the steps): clipped
  value predictions carry no gradient, so the critic hardly moves from its start.
- ``dynamics/no_trust_region``: a side of the policy's trust region opened (a clip side `WIDE` x the usual
  width or more, or a loss without a clip: bypass mode's ``reinforce``, ``gpg``) while the run takes
  several optimizer steps on one batch and `OUTSIDE_USUAL` or more of the tokens moved past the usual
  bound on that side with (almost) none clipped: the update has no trust region there.
- ``dynamics/clip_saturated`` for the dual clip: ``algo.clip_ratio_c`` below `DUAL_NARROW` while it holds
  `DUAL_HELD` or more of the tokens at a constant loss (``actor/pg_clipfrac_lower``): the negative-advantage
  tokens that rose cannot be pushed down (the token clip's own range is `verlaudit.audit.dynamics`').
- ``dynamics/chosen_pushed_down``: a preference loss whose own gradient lowers the chosen answer's
  log-prob (on most pairs, or never raises it), and the chosen log-prob fell below the reference's: the
  loss variant (or its label smoothing / beta) does the opposite of preferring the chosen answers.
- ``dynamics/null_update``: a learning rate below `LR_LOW` whose steps moved a sample of the weights by
  `NULL_UPDATE` of their size or less at every step (``<role>/update_rel``, single-process runs): Adam moves
  each weight by about lr a step, so the relative step is ~lr / rms(w); judged against that, not an absolute
  floor (lr 1e-8 on weights of rms 0.02 moves them 5e-7 of their size: finite, and null over any run).
- ``dynamics/preference_flat``: a DPO loss of beta x margin (sigmoid, robust, hinge, exo_pair, discopop)
  whose argument stays at `FLAT_ARG` or less at every step after the first while the policy moved from the
  reference (``dpo/logratio_abs`` `MOVED` nats or more) and the pairs separate (the margin at least
  `SEPARATES` of the log-ratios' size): beta, not the data, keeps the loss at its zero-margin value (log 2
  for sigmoid), so the sigmoid never saturates, there is no implicit KL anchor, and the loss reads flat.

Each kind is recorded once per run. Thresholds are from the clean controls of the blind benches
(`benchmarks/blind_faults*`, PPO / GRPO / DPO in fp32, fp16, bf16, bf16-pure) and stated beside each
constant. Exercised by `pytest tests/test_update_effect.py`.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Mapping
from typing import Any

from verlaudit import kinds as K
from verlaudit import verl_keys as V
from verlaudit.rundir import Finding

CLIP_COEF_NULL = 0.02
"""The grad-clip coefficient (max_grad_norm / pre-clip norm) at or below which, at every step, the clip
is the update's size: the PPO / GRPO controls (max_grad_norm 1) measure pre-clip norms of 0.1-2 and the
DPO ones 2-20 (coefficient 0.05 or more), so 0.02 means gradients 50x the clip at every step (a clip 100x
below the controls' typical norm of 1.2-1.9 measures 0.008-0.013; a DPO run clipped at 0.5 with its
norms of 10-20 measures 0.025-0.05 and passes)."""
CLIP_DEFAULT = 1.0
"""verl's grad_clip. Only a max_grad_norm set below it is read: the key was lowered (the DPO controls
measure pre-clip norms up to 20 at the default 1, a long-sequence run more, and that is the gradient's
question, not the clip's)."""
CLIP_STEPS = 2
"""Steps with a coefficient at or below `CLIP_COEF_NULL` before the clip is called total (one step of a
large gradient is what a clip is for)."""
VF_CLIP_TOTAL = 0.15
"""The value clip fraction (``critic/vf_clipfrac``, mean over the steps so far) from which the value clip
removes the critic's gradient, with a narrow range (`VF_CLIP_NARROW`): the PPO controls (cliprange_value
0.5, returns' std 0.03-0.07) measure 0 at every step; cliprange_value 0 over 2 epochs measured 0.05, 0.48,
0.19 (the first mini-batch is on-policy: nothing to clip)."""
VF_CLIP_NARROW = 0.1
"""A value clip range below this share of the returns' standard deviation is narrow for those returns
(verl's default 0.5 against returns in [0, 1]: about 1x-3x their spread)."""
WIDE = 2.0
"""A clip side this many times the usual width (`trainer.update_stats.USUAL_HIGH` 0.28 / ``USUAL_LOW`` 0.2)
or more is opened: the usual clip's bound lies deep inside it."""
OUTSIDE_USUAL = 0.05
"""The share of tokens past the usual bound of a side (mean over the steps so far) from which the run
moved outside any usual trust region there: the controls clip at most 0.1 of the tokens at the usual
bound, where the clip itself holds them; a run whose side is open measured 0.2-0.5."""
CLIPPED_SHARE = 0.1
"""At most this share of those tokens clipped by the run's own bound on that side: the bound did not bind."""
PULL_SHARE = 0.02
"""A preference loss whose pull on the chosen log-prob is at most this share of its pull on the rejected
one at every step never raises the chosen answer (DPO's sigmoid pulls both alike: share 1)."""
PUSHED_DOWN = 0.5
"""The share of pairs whose loss lowers the chosen answer from which the loss pushes it down."""
USUAL_HIGH, USUAL_LOW = 0.28, 0.2
NULL_UPDATE = 1e-5
"""A step's relative weight change (``<role>/update_rel``, `trainer.update_stats.update_size`) at or below
which, with a learning rate under `LR_LOW`, the step left the weights where they were: Adam moves each weight
by about lr a step, so the relative step is ~lr / rms(w): verl's default lr 1e-6 on weights of RMS 0.02 moves
them by ~5e-5 a step (5x above), an lr under 1e-7 by ~5e-6 or less (a thousand steps move the weights by
less than 1% of their size); the blind controls (lr 1e-3) measure 0.01-0.05, the tiny test runs (lr 2e-3)
above 1e-4 for actor and critic. (An absolute floor of 1e-7 missed lr 1e-8, which moves them by 5e-7.)"""
ADAM_STEP = 10.0
"""A relative step at most this many times lr / rms(w) per optimizer step is the size the learning rate
asks of Adam (its normalised step is about lr per element, up to ~lr x a few at the first steps): then the
key's value, not the gradient, set the step's size."""
FLAT_ARG = 1e-3
"""The mean |beta x margin| (``dpo/beta_margin_abs``, the sigmoid's argument) at or below which a DPO loss
is at its zero-margin value: log 2 - x / 2 + O(x^2), within 5e-4 of log 2, and its weight sigmoid(-x) is
0.5 to 2.5e-4, so the loss is linear in the margin and never saturates. A beta-0.1 DPO control reaches 0.01
or more from its second step."""
MOVED = 0.05
"""Nats per sequence (``dpo/logratio_abs``) from which the policy has moved from the reference."""
SEPARATES = 0.1
"""The margin (|beta x margin| / beta, nats) as a share of the log-ratios' size from which the pairs do
separate: identical or near-identical pairs keep the margin at 0 whatever beta is (not beta's question)."""
FLAT_LOSSES = ("sigmoid", "robust", "hinge", "exo_pair", "discopop")
"""The DPO losses that are functions of beta x margin alone (`trainer.losses.dpo_loss`)."""
LR_LOW = 1e-7
"""A learning rate below the lowest in common use (the range table's bound, `verlaudit.audit.config_ranges`):
only then is the key named as the reason the weights do not move (with a usual lr, unmoved bf16 weights are
updates lost to rounding: `numerics/update_underflow`'s question)."""
DUAL_NARROW = 1.5
"""A dual-clip bound (``clip_ratio_c``, > 1) below this holds a negative-advantage token at a constant
loss as soon as its ratio rose by half or less: verl's default is 3 (the controls never reach it)."""
DUAL_HELD = 0.05
"""The share of tokens the dual clip holds (``actor/pg_clipfrac_lower``, mean over the steps so far) from
which a narrow bound removes the push-down of the negative-advantage tokens that rose: the controls
measure 0 (on-policy, ratio 1), a tiny 16-step batch at the default bound 3 measured 0, 0; at 1.05 (PPO)
0.14, 0."""


def number(v: Any) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) else None


def _fmt(xs: list[float]) -> str:
    return ", ".join(f"{x:.3g}" for x in xs[:8]) + (" ..." if len(xs) > 8 else "")


class UpdateEffect:
    """The checks of one run (module docstring): ``algo`` the run's flat suite keys, ``correction`` its
    ``rollout_correction`` section."""

    def __init__(self, algo: Mapping[str, Any], correction: Mapping[str, Any] | None = None) -> None:
        self.algo = dict(algo or {})
        self.correction = dict(correction or {})
        self.name = str(self.algo.get("name") or "")
        self.series: dict[str, list[tuple[int | None, float]]] = {}

    def _add(self, m: Mapping[str, Any], step: int | None, *keys: str) -> None:
        for k in keys:
            v = number(m.get(k))
            if v is not None:
                self.series.setdefault(k, []).append((step, v))

    def _values(self, key: str) -> list[float]:
        return [v for _, v in self.series.get(key, [])]

    def step_end(self, m: Mapping[str, Any], *, step: int | None, reported: set[str]) -> list[Finding]:
        self._add(m, step, "actor/grad_norm", "critic/grad_norm", "critic/vf_clipfrac", "critic/returns/std")
        self._add(m, step, "actor/update_rel", "critic/update_rel", "actor/lr", "critic/lr")
        self._add(m, step, "dpo/chosen_pull", "dpo/rejected_pull", "dpo/chosen_pushed_down_frac")
        self._add(m, step, "rewards/chosen", "logps/chosen", "rewards/margins", "actor/loss")
        self._add(m, step, "dpo/logratio_abs", "dpo/beta_margin_abs", "actor/kl_loss", "actor/ppo_kl")
        self._add(m, step, "actor/weight_rms", "critic/weight_rms")
        for side in ("high", "low"):
            self._add(m, step, f"actor/pg_clipfrac_{side}", f"actor/ratio_outside_usual_{side}")
        self._add(m, step, "actor/ratio_max", "actor/ratio_min", "actor/pg_clipfrac_lower")
        out: list[Finding] = []
        for kind, check in (
            (K.GRAD_CLIP_TOTAL, self._grad_clip),
            (K.VALUE_CLIP_TOTAL, self._value_clip),
            (K.NO_TRUST_REGION, self._trust_region),
            (K.CHOSEN_PUSHED_DOWN, self._chosen_down),
            (K.CLIP_SATURATED, self._dual_clip),
            (K.NULL_UPDATE, self._null_update),
            (K.PREFERENCE_FLAT, self._preference_flat),
        ):
            if kind in reported:
                continue
            try:
                found = check(step)
            except Exception as e:  # noqa: BLE001  a check must never kill the user's run
                print(f"verlaudit: update_effect {kind} check failed ({type(e).__name__}: {e}); skipped",
                      file=sys.stderr)  # fmt: skip
                reported.add(kind)
                continue
            if found is not None:
                reported.add(kind)
                out.append(found)
        return out

    # -- the clip of the gradient's norm --------------------------------------------------------
    def _grad_clip(self, step: int | None) -> Finding | None:
        mgn = number(self.algo.get("max_grad_norm"))
        if not mgn or mgn <= 0 or mgn >= CLIP_DEFAULT:
            return None  # 0 disables the clip; at verl's default the gradient, not the key, is the question
        seen = {}
        for role in ("actor", "critic"):
            norms = self._values(f"{role}/grad_norm")
            if len(norms) >= CLIP_STEPS and all(n > 0 and mgn / n <= CLIP_COEF_NULL for n in norms):
                seen[role] = norms
        if not seen:
            return None
        role, norms = next(iter(seen.items()))
        coef = sum(mgn / n for n in norms) / len(norms)
        roles = "; ".join(f"{r}/grad_norm {_fmt(ns)} before the clip" for r, ns in seen.items())
        suggest = 1.0  # verl's grad_clip: a bound on the rare large step, not on every step
        return Finding(
            severity="warning",
            kind=K.GRAD_CLIP_TOTAL,
            role=role,
            where="algo.max_grad_norm",
            step=step,
            phase="actor_update",
            message=f"the gradient clip algo.max_grad_norm {mgn:g} ({V.algo_key('max_grad_norm')}) is a small "
            f"fraction of the gradient norm at every step ({roles}): it scaled every step's gradient by "
            f"{coef:.2g} on average ({1 / coef:.3g}x smaller), so the clip, not the loss, sets every update: "
            "with Adam only the gradient's direction is left (its size and the weighting between steps and "
            "micro-batches are thrown away), with SGD the update is that much smaller than the learning "
            "rate says",
            observed={
                "max_grad_norm": mgn,
                "clip_coefficient": round(coef, 6),
                **{f"{r}_grad_norm": ns for r, ns in seen.items()},
            },
            expected=f"a max_grad_norm near the typical gradient norm (a clip coefficient above {CLIP_COEF_NULL:g}"
            " at most steps; verl's default grad_clip 1.0)",
            fix=f"set algo.max_grad_norm: {suggest:g} (verl: {V.algo_override('max_grad_norm', suggest)}"
            f"{' critic.grad_clip=' + format(suggest, 'g') if 'critic' in seen else ''})",
        )

    # -- an update that does not move the weights ------------------------------------------------
    def _null_update(self, step: int | None) -> Finding | None:
        for role, key in (("actor", "lr"), ("critic", "critic_lr")):
            moved = self._values(f"{role}/update_rel")
            lrs = self._values(f"{role}/lr") or [v for v in [number(self.algo.get(key))] if v is not None]
            grads = self._values(f"{role}/grad_norm")
            if (
                len(moved) < CLIP_STEPS
                or not lrs
                or max(lrs) >= LR_LOW
                or any(u > NULL_UPDATE for u in moved)
            ):
                continue
            if grads and max(grads) <= 0:
                continue  # no gradient at all: the loss's question, not the learning rate's
            lr = max(lrs)
            rms = self._values(f"{role}/weight_rms")
            steps = self.optimizer_steps() or 1
            asks = [ADAM_STEP * lr * steps / w for w in rms if w > 0]
            if asks and any(u > a for u, a in zip(moved, asks, strict=False)):
                continue  # the weights moved more than this lr asks of Adam: the key is not the step's size
            asked = (
                f"; Adam's step at this lr is ~lr / rms(w) = {lr / rms[-1]:.2g} of them"
                if rms and rms[-1] > 0
                else ""
            )
            kl = self._values("actor/kl_loss") if role == "actor" else []
            held = (
                f"; the policy stayed at its start (actor/kl_loss {_fmt(kl)})"
                if kl and max(map(abs, kl)) < 1e-6
                else ""
            )
            return Finding(
                severity="warning",
                kind=K.NULL_UPDATE,
                role=role,
                where=f"algo.{key}",
                step=step,
                phase="critic_update" if role == "critic" else "actor_update",
                message=f"the {role}'s learning rate algo.{key} {lr:g} ({V.algo_key(key)}; {role}/lr "
                f"{_fmt(lrs)}) leaves the weights where they were: each step moved them by {_fmt(moved)} of "
                f"their size ({role}/update_rel{asked}){' while the gradient norm was ' + _fmt(grads) if grads else ''}"
                f"{held}: the optimizer steps are null, nothing the loss computes reaches the model (a thousand "
                "such steps move the weights by under 1% of their size)",
                observed={
                    key: lr,
                    "update_rel_by_step": moved,
                    "grad_norm_by_step": grads,
                    "weight_rms": rms[-1:],
                },
                expected=f"a learning rate of 1e-7 or more (verl's default 1e-6), moving the weights by more "
                f"than {NULL_UPDATE:g} of their size a step",
                fix=f"set algo.{key}: {1e-6 if role == 'actor' else 1e-5:g} (verl's default; verl: "
                f"{V.algo_override(key, 1e-6 if role == 'actor' else 1e-5)})",
            )
        return None

    # -- a preference loss held at its zero-margin value -----------------------------------------
    def _preference_flat(self, step: int | None) -> Finding | None:
        loss = str(self.algo.get("dpo_loss") or "sigmoid")
        beta = number(self.algo.get("beta"))
        if self.name != "dpo" or loss not in FLAT_LOSSES or not beta or beta <= 0:
            return None
        args, moved = self.series.get("dpo/beta_margin_abs", []), self.series.get("dpo/logratio_abs", [])
        after = [(a, d) for (sa, a), (sd, d) in zip(args[1:], moved[1:], strict=False) if sa == sd]
        if len(after) < 2 or any(a > FLAT_ARG for a, _ in after):
            return None  # the first step is at the reference (margin 0 for any beta): judged from the second
        arg, drift = after[-1]
        margin = arg / beta  # nats
        if drift < MOVED or margin < SEPARATES * drift:
            return None  # the policy did not move, or the pairs do not separate: not beta's doing
        losses = self._values("actor/loss")
        zero = {"sigmoid": math.log(2), "robust": math.log(2), "hinge": 1.0}.get(loss)
        at = f" (log 2 = {math.log(2):.4f})" if zero and abs(zero - math.log(2)) < 1e-9 else ""
        want = 0.1
        return Finding(
            severity="warning",
            kind=K.PREFERENCE_FLAT,
            role="actor",
            where="algo.beta",
            step=step,
            phase="actor_update",
            message=f"algo.beta {beta:g} keeps the {loss} preference loss at its zero-margin value: the policy "
            f"moved {drift:.3g} nats per answer from the reference (dpo/logratio_abs {_fmt([d for _, d in after])}) "
            f"and the pairs separate by {margin:.3g} nats, yet the sigmoid's argument beta x margin stays "
            f"{arg:.2g} (dpo/beta_margin_abs {_fmt([a for a, _ in after])}; actor/loss {_fmt(losses)}{at}): the "
            "loss is linear in the margin and never saturates, so it pulls every pair at the same rate however "
            "far the policy went (no implicit KL anchor to the reference) while it reads flat; beta x margin "
            f"reaches 1 only at a margin of {1 / beta:.3g} nats",
            observed={
                "beta": beta,
                "dpo_loss": loss,
                "beta_margin_abs_by_step": [a for a, _ in after],
                "logratio_abs_by_step": [d for _, d in after],
                "margin_nats": round(margin, 6),
                "loss_by_step": losses,
            },
            expected=f"beta x margin above {FLAT_ARG:g} once the policy moves (DPO's beta 0.1-0.5)",
            fix=f"set algo.beta: {want:g} (TRL's DPOConfig default; DPO uses 0.1-0.5): the loss then saturates at a "
            f"margin of ~{1 / want:g} nats and anchors the policy to the reference",
        )

    # -- the value clip ---------------------------------------------------------------------------
    def _value_clip(self, step: int | None) -> Finding | None:
        c = number(self.algo.get("cliprange_value"))
        fracs = self._values("critic/vf_clipfrac")
        if c is None or not fracs:
            return None
        mean = sum(fracs) / len(fracs)
        spread = self._values("critic/returns/std")
        scale = max(spread) if spread else None
        if mean < VF_CLIP_TOTAL or (scale is not None and c >= VF_CLIP_NARROW * scale):
            return None
        sc = f" against returns whose std is {scale:.3g}" if scale is not None else ""
        return Finding(
            severity="warning",
            kind=K.VALUE_CLIP_TOTAL,
            role="critic",
            where="algo.cliprange_value",
            step=step,
            phase="critic_update",
            message=f"the value clip algo.cliprange_value {c:g} ({V.algo_key('cliprange_value')}){sc} clips "
            f"{mean:.0%} of the tokens' value predictions (critic/vf_clipfrac {_fmt(fracs)}): a clipped "
            "prediction is held to the old value and carries no gradient, so the clip removes the critic's "
            "update and the values stay where they started (the advantages are the rewards against an "
            "untrained critic)",
            observed={"cliprange_value": c, "vf_clipfrac_by_step": fracs, "returns_std": scale},
            expected=f"a value clip fraction well below {VF_CLIP_TOTAL:g} (verl's cliprange_value 0.5)",
            fix=f"set algo.cliprange_value: 0.5 (verl's default; verl: {V.algo_override('cliprange_value', 0.5)})",
        )

    # -- the policy's trust region ----------------------------------------------------------------
    def optimizer_steps(self) -> int | None:
        """ppo_epochs x mini-batches of one rollout batch (as `verlaudit.audit.dynamics`, which imports this)."""
        a = self.algo

        def whole(key: str) -> int | None:
            v = number(a.get(key))
            return int(v) if v is not None else None

        rows, mini = whole("batch_size"), whole("mini_batch_size")
        if rows is None or not mini:
            return None
        rows *= (whole("group_size") or 1) if self.name == "grpo" else 1
        return (whole("ppo_epochs") or 1) * -(-rows // mini)

    def _opened(self, side: str) -> tuple[str, float | None, str, str] | None:
        """(the key that opened ``side``, its width or None for no clip, the value to set, verl's) or None."""
        a, rc = self.algo, self.correction
        mode = str(a.get("loss_mode") or "vanilla")
        if mode == "bypass_mode" and rc.get("bypass_mode") and str(rc.get("loss_type") or "") == "reinforce":
            return (
                "rollout_correction.loss_type",
                None,
                "ppo_clip",
                V.correction_override("loss_type", "ppo_clip"),
            )
        if mode == "gpg":
            return ("algo.loss_mode", None, "vanilla", V.algo_override("loss_mode", "vanilla"))
        if mode not in ("vanilla", "bypass_mode"):
            return None
        usual = USUAL_HIGH if side == "high" else USUAL_LOW
        own = number(a.get(f"clip_ratio_{side}"))
        key = f"clip_ratio_{side}" if own is not None else "clip_ratio"
        width = own if own is not None else number(a.get("clip_ratio"))
        if width is None or width < WIDE * usual:
            return None
        want = 0.28 if side == "high" and own is not None else 0.2  # clip-higher, else verl's default
        return (f"algo.{key}", width, f"{want:g}", V.algo_override(key, want))

    def _trust_region(self, step: int | None) -> Finding | None:
        if self.name == "dpo":
            return None
        n = self.optimizer_steps()
        for side in ("high", "low"):
            opened = self._opened(side)
            outside = self._values(f"actor/ratio_outside_usual_{side}")
            clipped = self._values(f"actor/pg_clipfrac_{side}")
            if opened is None or not outside or not clipped:
                continue
            past, bound = sum(outside) / len(outside), sum(clipped) / len(clipped)
            if past < OUTSIDE_USUAL or bound > CLIPPED_SHARE * past:
                continue
            return self._no_trust(side, opened, past, bound, n, step)
        return None

    def _no_trust(self, side, opened, past, bound, n, step) -> Finding:
        key, width, want, verl = opened
        usual = USUAL_HIGH if side == "high" else USUAL_LOW
        kl, rmax, rmin = (
            self._values("actor/ppo_kl"),
            self._values("actor/ratio_max"),
            self._values("actor/ratio_min"),
        )
        value = (
            self.correction.get("loss_type")
            if key.startswith("rollout_correction")
            else self.algo.get("loss_mode")
        )
        if width is None:
            what = f"{key} {value}: a loss with no ratio clip"
        else:
            edge = 1 + width if side == "high" else 1 - width
            what = f"{key} {width:g}: the {'upper' if side == 'high' else 'lower'} clip bound is {edge:g}"
        sign = "positive" if side == "high" else "negative"
        usual_edge = 1 + usual if side == "high" else 1 - usual
        extent = f"ratio {'max' if side == 'high' else 'min'} {_fmt(rmax if side == 'high' else rmin)}"
        epochs = self.algo.get("ppo_epochs") or 1
        fix = f"set {key}: {want} (verl: {verl})"
        if width is None:
            fix += f", or take one optimizer step a batch (algo.ppo_epochs: 1; now {epochs}, {n or '?'} steps a batch)"
        return Finding(
            severity="warning",
            kind=K.NO_TRUST_REGION,
            role="actor",
            where=key,
            step=step,
            phase="actor_update",
            message=f"no trust region on the {side} side ({what}): over {n or '?'} optimizer steps on each batch "
            f"(algo.ppo_epochs {epochs}), {past:.0%} of the tokens with {sign} advantage moved past the usual "
            f"clip bound {usual_edge:g} and {bound:.0%} were clipped ({extent}; actor/ppo_kl {_fmt(kl)}): the "
            "clip that should bound each update never binds, so the later updates keep pushing the same "
            "tokens off the policy that sampled them",
            observed={
                key: width if width is not None else value,
                "side": side,
                "outside_usual_bound": round(past, 4),
                "clipped_on_side": round(bound, 4),
                "optimizer_steps_per_batch": n,
                "ppo_kl_by_step": kl,
            },
            expected=f"a clip side near the usual width ({usual:g}) that binds the tokens moving past it",
            fix=fix,
        )

    def _dual_clip(self, step: int | None) -> Finding | None:
        """``dynamics/clip_saturated`` for the dual clip: a ``clip_ratio_c`` just above 1 holds most
        negative-advantage tokens whose ratio rose at a constant loss (no gradient to push them down)."""
        c = number(self.algo.get("clip_ratio_c"))
        mode = str(self.algo.get("loss_mode") or "vanilla")
        held = self._values("actor/pg_clipfrac_lower")
        if c is None or c >= DUAL_NARROW or mode not in ("vanilla", "bypass_mode") or not held:
            return None
        mean = sum(held) / len(held)
        if mean < DUAL_HELD:
            return None
        return Finding(
            severity="warning",
            kind=K.CLIP_SATURATED,
            role="actor",
            where="algo.clip_ratio_c",
            step=step,
            phase="actor_update",
            message=f"the dual clip algo.clip_ratio_c {c:g} ({V.algo_key('clip_ratio_c')}) holds {mean:.0%} of the "
            f"tokens at a constant loss (actor/pg_clipfrac_lower {_fmt(held)}): every negative-advantage token "
            f"whose ratio rose past {c:g} carries no gradient, so the update cannot push down the responses it "
            "should discourage once they moved the wrong way",
            observed={"clip_ratio_c": c, "pg_clipfrac_lower_by_step": held},
            expected=f"a dual-clip bound of about 3 (verl's default), holding well under {DUAL_HELD:.0%} of the tokens",
            fix=f"set algo.clip_ratio_c: 3 (verl: {V.algo_override('clip_ratio_c', 3)})",
        )

    # -- which way a preference loss pushes the chosen answer -------------------------------------
    def _chosen_down(self, step: int | None) -> Finding | None:
        if self.name != "dpo":
            return None
        pull, rej = self._values("dpo/chosen_pull"), self._values("dpo/rejected_pull")
        down, chosen = self._values("dpo/chosen_pushed_down_frac"), self._values("rewards/chosen")
        if len(pull) < 2 or len(rej) != len(pull) or not chosen:
            return None
        never_up = all(p <= PULL_SHARE * abs(r) for p, r in zip(pull, rej, strict=True))
        pushed = sum(down) / len(down) if down else 0.0
        if not (never_up or pushed >= PUSHED_DOWN) or chosen[-1] >= 0:
            return None
        a = self.algo
        loss, beta, ls = (
            str(a.get("dpo_loss") or "sigmoid"),
            number(a.get("beta")),
            number(a.get("label_smoothing")),
        )
        if ls is not None and ls > 0.5 and loss in ("sigmoid", "robust"):
            where, fix = (
                "algo.label_smoothing",
                "set algo.label_smoothing: 0 (a label smoothing above 0.5 prefers the rejected)",
            )
        elif loss in ("ipo", "sppo_hard"):
            target = f" = {0.5 / beta:.3g}" if beta else ""
            where = "algo.beta"
            fix = f"lower algo.beta (the loss's target log-ratio is 1/(2 beta){target}), e.g. 0.1"
        else:
            where, fix = (
                "algo.dpo_loss",
                "set algo.dpo_loss: sigmoid (DPO), or apo_zero to raise the chosen answers",
            )
        lc = self._values("logps/chosen")
        fell = f", logps/chosen {_fmt(lc)}" if lc else ""
        return Finding(
            severity="warning",
            kind=K.CHOSEN_PUSHED_DOWN,
            role="actor",
            where=where,
            step=step,
            phase="actor_update",
            message=f"the preference loss (algo.dpo_loss {loss}, beta {beta}, label_smoothing {ls}) lowers the "
            f"chosen answers: its own gradient {'never raises the chosen log-prob and ' if never_up else ''}"
            f"pushes it down on {pushed:.0%} of the pairs "
            f"(dpo/chosen_pull {_fmt(pull)} against dpo/rejected_pull {_fmt(rej)}; DPO's sigmoid pulls both "
            f"alike), and the chosen answers fell "
            f"below the reference (rewards/chosen {_fmt(chosen)}{fell}): the margin rises by lowering both, "
            "which unlearns the chosen answers instead of preferring them",
            observed={
                "dpo_loss": loss,
                "beta": beta,
                "label_smoothing": ls,
                "chosen_pull": pull,
                "rejected_pull": rej,
                "pushed_down_frac": round(pushed, 4),
                "rewards_chosen": chosen,
            },  # fmt: skip
            expected="a loss that raises the chosen answers' log-prob (DPO's sigmoid pulls chosen up as much "
            "as it pushes rejected down)",
            fix=fix,
        )
