"""Causes read from a run's metric trajectory: fp16 loss-scale collapse and overflow skips, reward
collapse and exploding reward variance, and steps without a learning signal (GRPO groups whose
responses all got the same reward). Pure functions RunDir -> list[Cause], each stamped with the step,
phase and role it concerns for the root-cause rules (`verlaudit.analysis.diagnose.rules`).
Exercised by `pytest tests/test_diagnose.py tests/test_rules.py`.
"""

from __future__ import annotations

import math

from verlaudit import kinds as K
from verlaudit import verl_keys as V
from verlaudit.analysis.causes import Cause, Fix
from verlaudit.analysis.diagnose import answer_probe
from verlaudit.analysis.diagnose.rules import LAST
from verlaudit.analysis.diagnose.runview import cfg, fmt, role_policy, user_hook_fix
from verlaudit.rundir import RunDir


# long: the four verdicts on one series (static overflow, collapse, frequent skips, calibration) share their evidence
def loss_scale_causes(run: RunDir) -> list[Cause]:
    out = []
    for role in ("actor", "critic"):
        skipped = run.series(f"{role}/skipped")
        scale = run.series(f"{role}/loss_scale")
        n_skipped = sum(1 for _, v in skipped if v > 0)
        if not skipped or n_skipped == 0:
            continue
        longest = cur = 0
        for _, v in skipped:
            cur = cur + 1 if v >= 0.999 else 0
            longest = max(longest, cur)
        tail_all_skipped = len(skipped) >= 3 and all(v >= 0.999 for _, v in skipped[-3:])
        final_scale = scale[-1][1] if scale else None
        at_floor = final_scale is not None and final_scale <= 1.0 and n_skipped >= 3
        # each step's value is the skipped share of its optimizer steps: their mean is the share of all
        # optimizer steps (n_skipped / steps only when a step takes one optimizer step)
        frac = sum(min(max(v, 0.0), 1.0) for _, v in skipped) / len(skipped)
        first = next(s for s, v in skipped if v > 0)
        ev = [
            f"{n_skipped} of {len(skipped)} steps had skipped optimizer steps ({frac:.1%} of the optimizer steps), "
            f"longest run {longest}, first at step {first}"
        ]
        if scale:
            ev.append("loss scale: " + ", ".join(f"{s}:{fmt(v)}" for s, v in scale[-8:]))
        overflow = [f for f in run.findings if K.class_of(f.kind) == "overflow"]
        where = overflow[0].where if overflow else None
        for f in overflow[:3]:
            ev.append(f"{f.kind} at {f.where} (step {f.step}): {f.message}")
        if role_policy(run, role).get("loss_scaling", "none") == "none":
            out.append(
                Cause(
                    "warning",
                    "nonfinite_skips",
                    f"{role}: {n_skipped} optimizer step(s) skipped for non-finite gradients",
                    "This policy has no loss scaling, so a skip is not calibration: "
                    "gradients were NaN/Inf (see the non-finite cause for the producer).",
                    evidence=ev,
                    step=first,
                    where=where,
                    phase=f"{role}_update",
                    role=role,
                    seq=LAST,
                )
            )
            continue
        fixes = [
            Fix(
                "precision.preset: bf16",
                V.param_dtype(role, "bf16"),
                "bf16 has fp32's exponent range: no overflow, no loss scaling",
            )
        ]
        if where:
            fixes.append(
                Fix(None, None, f"{where} exceeds fp16's range: keep it in fp32 or rescale its output")
            )
        hook = user_hook_fix(run, overflow[0].role if overflow else None, where)
        if hook is not None:  # user code on the overflowing module comes before any precision change
            fixes.insert(0, hook)
        pol = role_policy(run, role)
        if pol.get("loss_scaling") == "static" and (longest >= 3 or tail_all_skipped):
            # a static scale never backs off: the scale itself is the overflow, and lowering it (or
            # letting a dynamic scaler find it) is the fix -- never a larger scale
            init = pol.get("init_scale")
            key = f"precision.overrides.{role}"
            out.append(
                Cause(
                    "error",
                    "loss_scale_collapse",
                    f"{role}: static loss scale {fmt(init) if init is not None else '?'} ({key}.loss_scaling: "
                    f"static, init_scale) overflows: {n_skipped} of {len(skipped)} steps skipped",
                    "A static loss scale never backs off: when it makes the fp16 gradients overflow, every step "
                    "that overflows is skipped and the weights stop updating. The scale is too large for these "
                    "gradients.",
                    evidence=ev,
                    fixes=[
                        Fix(f"{key}.loss_scaling: dynamic", None, "a dynamic scaler backs off on overflow"),
                        Fix(
                            f"{key}.init_scale: {fmt(init / 2**10) if isinstance(init, (int, float)) else '<lower>'}",
                            None,
                            "or keep the static scale, far lower",
                        ),
                    ],
                    step=first,
                    where=f"{key}.init_scale",
                    phase=f"{role}_update",
                    role=role,
                    seq=LAST,
                    score=30.0,
                    data={"skipped": n_skipped, "longest_run": longest, "final_scale": final_scale},
                )
            )
            continue
        if at_floor or longest >= 5 or tail_all_skipped:
            out.append(
                Cause(
                    "error",
                    "loss_scale_collapse",
                    f"{role} loss-scale collapse: scale driven to "
                    f"{fmt(final_scale) if final_scale is not None else '?'} with repeated skipped steps",
                    (
                        "Gradients overflow even at a loss scale of 1 or below, so the overflow is in the "
                        "forward/backward values themselves (fp16 range), not a too-large scale; the "
                        "optimizer has stopped updating."
                        if at_floor
                        else f"{longest} optimizer steps in a row were skipped for non-finite gradients while "
                        "the scale kept halving: the scaler is not recovering and the weights are not updating."
                    ),
                    evidence=ev,
                    fixes=fixes,
                    step=first,
                    where=where,
                    phase=f"{role}_update",
                    role=role,
                    seq=LAST,
                    score=30.0,
                    data={"skipped": n_skipped, "longest_run": longest, "final_scale": final_scale},
                )
            )
        elif frac > 0.1:
            out.append(
                Cause(
                    "warning",
                    "overflow_skips",
                    f"{role}: {n_skipped} optimizer steps skipped on overflow",
                    "More than 10% of steps were skipped for non-finite gradients; the scaler recovers but "
                    "training is slowed and noisier.",
                    evidence=ev,
                    fixes=fixes,
                    step=first,
                    where=where,
                    phase=f"{role}_update",
                    role=role,
                    seq=LAST,
                )
            )
        else:
            out.append(
                Cause(
                    "info",
                    "overflow_skips",
                    f"{role}: {n_skipped} skipped step(s) while the loss scale calibrated",
                    "A few overflow skips early in fp16 are the dynamic scaler finding its "
                    "level; no action needed.",
                    evidence=ev,
                    step=first,
                    phase=f"{role}_update",
                    role=role,
                    seq=LAST,
                )
            )
    return out


# long: the reward verdicts share one windowing of the series
def reward_trend_causes(run: RunDir) -> list[Cause]:
    algo = cfg(run, "algo", "name", default="ppo")
    mean_key, std_key = (
        ("rewards/margins", None) if algo == "dpo" else ("critic/score/mean", "critic/score/std")
    )
    means = [v for _, v in run.series(mean_key)]
    out = []
    if len(means) < 6 or any(not math.isfinite(v) for v in means):
        return out  # too short to judge; non-finite rewards are reported by _nonfinite_causes
    w = max(3, len(means) // 5)
    early, late = means[:w], means[-w:]
    e_mean, l_mean = sum(early) / w, sum(late) / w
    best = max(sum(means[i : i + w]) / w for i in range(len(means) - w + 1))
    span = max(means) - min(means)
    if span > 1e-9 and best - l_mean > 0.5 * span and l_mean < e_mean:
        kl_loss_coef = max(cfg(run, "algo", "kl_loss_coef", default=0.001) * 2, 0.01)
        out.append(
            Cause(
                "warning",
                "reward_collapse",
                f"Reward collapse: {mean_key} fell from {fmt(best)} (best {w}-step window) to {fmt(l_mean)}",
                "The policy got worse than where it started: typical of a too-large step size, KL "
                "drift from the reference, or reward hacking that the reward later punishes.",
                evidence=[f"first {w} steps mean {fmt(e_mean)}, last {w} steps mean {fmt(l_mean)}"],
                fixes=[
                    Fix(
                        f"algo.use_kl_loss: true, algo.kl_loss_coef: {kl_loss_coef:g}",
                        f"{V.algo_override('use_kl_loss', True)} {V.KL_LOSS_COEF}={kl_loss_coef:g} "
                        f"(or {V.algo_key('use_kl_in_reward')} with {V.KL_COEF})",
                        "a stronger KL anchor to the reference",
                    ),
                    Fix("algo.lr: <half>", V.LR, "smaller policy steps"),
                ],
                step=len(means) - w,
            )
        )
    if std_key:
        stds = [v for _, v in run.series(std_key)]
        if len(stds) >= 6 and all(math.isfinite(v) for v in stds):
            e_std, l_std = sum(stds[:w]) / w, sum(stds[-w:]) / w
            if max(stds[:-w] or [0]) > 1e-3 and all(v < 1e-6 for v in stds[-3:]):
                out.append(
                    Cause(
                        "warning",
                        "reward_collapse",
                        "Reward variance collapsed to zero",
                        "Every response in the batch gets the same score, so GRPO/PPO advantages are zero "
                        "and the policy stops learning (entropy collapse or a saturated reward).",
                        evidence=[
                            f"{std_key}: early mean {fmt(e_std)}, last 3 steps "
                            + ", ".join(fmt(v) for v in stds[-3:])
                        ],
                        fixes=[
                            Fix("algo.temperature: 1.0", V.TEMPERATURE, "sample with more diversity"),
                            Fix(
                                "algo.entropy_coef: 0.001",
                                V.ENTROPY_COEFF,
                                "keep the policy's entropy from collapsing",
                            ),
                        ],
                    )
                )
            elif e_std > 0 and l_std > 10 * e_std:
                out.append(
                    Cause(
                        "warning",
                        "reward_variance",
                        f"Exploding reward variance: {std_key} grew "
                        f"{l_std / e_std:.0f}x ({fmt(e_std)} -> {fmt(l_std)})",
                        "The spread of rewards grows without bound: the reward model or function is being "
                        "exploited, or values are blowing up.",
                        evidence=[f"first {w} steps mean {fmt(e_std)}, last {w} steps mean {fmt(l_std)}"],
                        fixes=[
                            Fix(
                                "data.reward_fn: <clip or normalise the reward>",
                                V.REWARD_MANAGER,
                                "bound the reward",
                            ),
                            Fix("algo.lr: <half>", V.LR, "smaller steps"),
                        ],
                    )
                )
    return out


NO_SIGNAL_METRIC = "reward/identical_group_frac"
"""Per step, the fraction of GRPO groups whose responses all got the same reward (the audit writes it)."""


def _reward_fn_key_fix(run: RunDir) -> tuple[str, Fix] | None:
    """(the column, its fix) when verl data hand compute_score another column than data_source: a dispatch
    on data_source that matches none of its values scores every response alike."""
    fn_key = cfg(run, "data", "reward_fn_key") or "data_source"
    if not cfg(run, "data", "train_files") or fn_key == "data_source":
        return None
    return fn_key, Fix(
        "data.reward_fn_key: data_source",
        None,  # the suite key is verl's own (data.reward_fn_key)
        f"verl passes each row's '{fn_key}' column to compute_score as data_source; a compute_score that "
        "dispatches on data_source finds no scorer for those values and returns one default for all",
    )


def no_signal_causes(run: RunDir) -> list[Cause]:
    """Steps without a learning signal: every group's responses scored alike, so group-relative
    advantages are zero and only the KL and entropy terms move the policy. An error when no step
    of the run had a signal (it learned nothing), a warning when at least a quarter of them, and at least two
    steps, had none: one silent step of a short run is what a sparse reward gives by chance (a clean 3-step
    GRPO run on the digits task can draw one)."""
    findings = [f for f in run.findings if f.kind == K.NO_SIGNAL]
    series = run.series(NO_SIGNAL_METRIC)
    silent = [s for s, v in series if v >= 1.0]
    if not findings and not silent:
        return []
    recorded = len(series) or len({m.get("step") for m in run.metrics})
    if recorded and (len(silent) < 0.25 * recorded or (len(silent) < 2 and recorded > 1)):
        return []
    first = findings[0] if findings else None
    every = bool(silent) and len(silent) == recorded and recorded >= 2
    step = first.step if first else silent[0]
    ev = [
        f"{len(silent)} of {recorded} steps had no group with differing rewards"
        + (f" (first at step {silent[0]})" if silent else "")
    ]
    if first is not None:
        ev.append(f"step {first.step}: {first.message}")
    zero = [s for s, v in run.series("actor/pg_loss") if v == 0.0]
    if zero:
        ev.append(f"actor/pg_loss exactly 0 at {len(zero)} step(s): the advantages are zero")
    source = (
        cfg(run, "model", "reward_model")
        or cfg(run, "data", "reward_fn")
        or cfg(run, "data", "compute_score")
    )
    key = (
        "model.reward_model"
        if cfg(run, "model", "reward_model")
        else "data.reward_fn"
        if cfg(run, "data", "reward_fn")
        else "data.compute_score"
    )
    fixes = []
    fixed = _reward_fn_key_fix(run)
    if fixed is not None:  # verl data whose compute_score is handed another column as data_source
        key, source = "data.reward_fn_key", fixed[0]
        fixes.append(fixed[1])
    if source and not fixes:
        fixes.append(
            Fix(
                f"{key} ({source})",
                V.REWARD_MANAGER,
                "the reward gives every response of a prompt the same score: check that it reads the "
                "response (and returns one score per response)",
            )
        )
    fixes += [
        Fix(
            f"algo.group_size: {max(8, 2 * int(cfg(run, 'algo', 'group_size', default=4)))}",
            None,
            "more responses per prompt make a differing reward more likely (a sparse, binary reward)",
        ),
        Fix("algo.temperature: 1.0", V.TEMPERATURE, "more diverse responses within a group"),
    ]
    return [
        answer_probe.settle(
            run, _no_signal_cause(run, every, silent, recorded, ev, fixes, step, key, source, first), silent
        )
    ]


def _no_signal_cause(run, every, silent, recorded, ev, fixes, step, key, source, first) -> Cause:
    return Cause(
        "error" if every else "warning",
        "no_signal",
        f"No learning signal: rewards identical within every group at {len(silent)} of {recorded} steps",
        "GRPO's advantages are each reward minus its group's mean: when every response of a group gets "
        "the same reward they are all zero, the policy loss is zero and the policy does not learn.",
        evidence=ev,
        fixes=fixes,
        step=step,
        where=(f"{key} ({source})" if key == "data.reward_fn_key" else first.where if first else source),
        phase="reward",
        role="reward",
        cls="no_signal",
        data={"silent_steps": silent, "recorded_steps": recorded},
    )
