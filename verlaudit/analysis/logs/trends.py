"""Rules over a log's per-step metric table (`verlaudit.analysis.logs.table`), whatever format fed it:

- ``collapse``: the signature users report most, a gradient norm that turns NaN or spikes (above
  `SPIKE` times the median of the steps before it), then a change that lasts to the last logged step:
  the reward falls to 0, the loss becomes exactly 0, or the entropy falls below `ENTROPY_FALL` of its
  early level, for three logged steps at least (one after a NaN step, itself broken; with no gradient
  trigger, a reward at 0 together with one of the other two). A spike
  the run recovers from is no finding, nor is a loss that was 0 from the start (TRL's GRPO loss is
  0 on its first steps by construction).
- ``collapse`` too, with no trigger: a gradient norm of exactly 0 at every logged step while the
  reward varies within the batch (a logged reward std above 0, or none logged) and the learning rate is
  not 0: no gradient reaches the weights, so the policy never moves (`no_update`); an error from three
  logged steps, a warning below.
- ``collapse`` too, with no trigger: a supervised loss (no reward, KL, advantage or preference metric logged
  beside it) of exactly 0.0 at the last two logged steps or more, from the first logged step or after a
  loss of at least `ABRUPT` (not one that converged through the printer's rounding): no token counted, or
  the loss was lost in its reduction (`zero_loss`, from the logsg branch).
- ``mismatch``: a rollout-vs-trainer mismatch or importance-sampling metric of any framework
  (`vocab.MISMATCH`) outside its published bound at two logged steps or more (at the only one, for a
  log of one step): a warning, with the fix spelled for the log's framework.

Pure functions of the table and the log's context. Exercised by
``pytest tests/test_log_formats.py -k "collapse or mismatch"``.
"""

from __future__ import annotations

import math
import re
import statistics
from collections.abc import Sequence

from verlaudit import verl_keys as V
from verlaudit.analysis.causes import Cause, Fix
from verlaudit.analysis.logs import vocab
from verlaudit.analysis.logs.frameworks import LogContext, advice, fixes
from verlaudit.analysis.logs.table import MetricTable

SPIKE = 10.0
"""A gradient norm this many times the median of the steps before it is a spike."""
ENTROPY_FALL = 0.1
"""An entropy below this share of its early median has collapsed."""
ZERO = 1e-9

Point = tuple[int, int, float]


def _by_step(points: Sequence[Point]) -> list[Point]:
    """The last value of each step, in log order (a framework may log a step twice)."""
    seen: dict[int, Point] = {}
    for p in points:
        seen.pop(p[0], None)
        seen[p[0]] = p
    return list(seen.values())


def _series(t: MetricTable, name: str) -> list[Point]:
    s = t.series.get(name)
    return _by_step(s.points()) if s else []


def _trigger(grad: list[Point]) -> tuple[int, str] | None:
    """(index, evidence) of the first non-finite or spiking gradient norm."""
    for i, (step, line, v) in enumerate(grad):
        if not math.isfinite(v):
            return i, f"line {line}: step {step}: gradient norm {v}"
        before = [x for _, _, x in grad[max(0, i - 50) : i] if math.isfinite(x)]
        if len(before) >= 3:
            med = statistics.median(before)
            if med > 0 and v > SPIKE * med:
                return (
                    i,
                    f"line {line}: step {step}: gradient norm {v:.4g}, {v / med:.0f}x the median {med:.3g} before it",
                )
    return None


def _tail(points: list[Point], pred, after_step: int | None) -> list[Point]:
    """The run of points at the end of ``points`` for which ``pred`` holds (from ``after_step`` on)."""
    run: list[Point] = []
    for p in reversed(points):
        if not pred(p[2]) or (after_step is not None and p[0] < after_step):
            break
        run.append(p)
    return run[::-1]


def _flat_tail(points: list[Point], after_step: int | None) -> list[Point]:
    """The run of identical finite values at the end of ``points`` (from ``after_step`` on), when the values
    before it varied and reached higher (logsg branch): a reward that stopped moving below where it was."""
    if len(points) < 2 or not math.isfinite(points[-1][2]):
        return []
    last = points[-1][2]
    run = _tail(points, lambda v: v == last, after_step)
    before = [v for s, _, v in points if s < (run[0][0] if run else 0) and math.isfinite(v)]
    # varied before, and frozen below its best: a reward stuck at its maximum is a saturated run, not a collapse
    return run if len(set(before)) >= 2 and last < max(before) else []


def _changed(points: list[Point], run: list[Point], pred) -> bool:
    """Whether the values before the run were not already in the run's state."""
    before = [v for s, _, v in points if s < run[0][0] and math.isfinite(v)]
    return bool(before) and not all(pred(v) for v in before)


# long: the four signals of the signature each read their series the same way but say different things
def collapse(t: MetricTable, ctx: LogContext) -> Cause | None:
    grad, reward = _series(t, "grad_norm"), _series(t, "reward")
    loss, ent = _series(t, "loss"), _series(t, "entropy")
    trig = _trigger(grad)
    if trig is not None and trig[0] == 0:  # NaN from the first logged step: a broken setup, not a collapse
        trig = None  # (the non-finite rule's backward-only cause says what it is)
    t_step = grad[trig[0]][0] if trig else None
    nan_trigger = trig is not None and not math.isfinite(grad[trig[0]][2])
    need = 1 if nan_trigger else 3  # a NaN step is itself broken; a spike or no trigger needs a run
    found: list[tuple[str, str, Point]] = []

    def zero(v: float) -> bool:
        return math.isfinite(v) and abs(v) <= ZERO

    run = _tail(reward, zero, t_step)
    if len(run) >= need and _changed(reward, run, zero):
        early = [v for s, _, v in reward if s < run[0][0] and math.isfinite(v)]
        mean = sum(early) / len(early)
        found.append(("reward", f"reward 0 from step {run[0][0]} to step {run[-1][0]} ({len(run)} logged "
                                f"step(s); {mean:.3g} on average before)", run[0]))  # fmt: skip
    run = _tail(loss, lambda v: v == 0.0, t_step)
    if len(run) >= need and _changed(loss, run, lambda v: v == 0.0):
        found.append(("loss", f"loss exactly 0 from step {run[0][0]} to step {run[-1][0]} ({len(run)} logged "
                              "step(s))", run[0]))  # fmt: skip
    early_e = [v for _, _, v in ent[: max(3, len(ent) // 5)] if math.isfinite(v)]
    if early_e and statistics.median(early_e) > 0:
        e0 = statistics.median(early_e)
        run = _tail(ent, lambda v: math.isfinite(v) and v < ENTROPY_FALL * e0, t_step)
        if len(run) >= max(need, 2) and _changed(ent, run, lambda v: v < ENTROPY_FALL * e0):
            found.append(("entropy", f"entropy {run[-1][2]:.3g} at step {run[-1][0]}, below "
                                     f"{ENTROPY_FALL:g}x its early {e0:.3g} from step {run[0][0]}", run[0]))  # fmt: skip
    if "reward" not in {k for k, _, _ in found}:  # a reward frozen at one value (not 0) to the end
        run = _flat_tail(reward, t_step)
        if len(run) >= max(need, 3):
            found.append(("flat", f"reward {run[0][2]:.4g} at every logged step from step {run[0][0]} to step "
                                  f"{run[-1][0]} ({len(run)} logged step(s)) after varying before", run[0]))  # fmt: skip
    kinds = {k for k, _, _ in found}
    # no gradient trigger: the reward's fall (to 0, or frozen below where it was: logsg branch) with another signal;
    # an entropy at 0 with a loss of 0 alone is also a run that solved everything (GRPO: no advantage left)
    if not (trig and found) and not (kinds & {"reward", "flat"} and len(kinds) >= 2):
        return None
    start = grad[trig[0]] if trig else min((p for _, _, p in found), key=lambda p: p[1])
    ev = ([trig[1]] if trig else []) + [f"line {p[1]}: step {p[0]}: {text}" for _, text, p in found]
    what = "gradient norm " + ("NaN" if nan_trigger else "spike") if trig else "no gradient trigger logged"
    keys = [t.keys.get(k, k) for k in ("grad_norm", *sorted(kinds))]
    role = {k.split("/", 1)[0] for k in keys if "/" in k}
    return Cause(
        "error",
        "collapse",
        f"Training collapsed from step {start[0]}: {what}, then " + vocab_names(sorted(kinds)),
        "The run diverged and did not recover: the update blew up (a NaN or spiking gradient norm) and "
        "what it trains on stopped carrying signal (no reward, a loss of exactly 0: no advantage left, "
        "or an entropy at 0: the policy emits one answer). In RL post-training this often follows a "
        "rollout-vs-trainer mismatch that grew (check the mismatch metrics), a learning rate too high "
        "for the batch, or fp16 overflow.",
        evidence=ev,
        step=start[0],
        where=role.pop() if len(role) == 1 else None,
        phase="update",
        line=start[1],
        score=32.0,
        fixes=fixes(
            ctx,
            ("lr", "lower the learning rate (the update diverged)", "algo.lr: <lower>"),
            ("grad_clip", "clip gradients so one bad batch cannot blow up the weights", "algo.max_grad_norm: 1.0"),
            ("bf16_instead_of_fp16", "if the run is fp16: bf16 does not overflow", "precision.preset: bf16"),
            _correction_fix(ctx, "correct for the rollout-vs-trainer mismatch that often precedes a collapse"),
        ),
        unknown=["which step's batch or module started it: a log has the metrics, not the tensors; rerun "
                 "under `verlaudit run` with audit level full around that step"],
        data={"signals": sorted(kinds), "trigger_step": t_step},
    )  # fmt: skip


def no_update(t: MetricTable, ctx: LogContext) -> Cause | None:
    """A gradient norm of exactly 0 at every logged step, with a reward that had spread to learn from
    and a non-zero learning rate (module docstring)."""
    grad = _series(t, "grad_norm")
    if not grad or not all(v == 0.0 for _, _, v in grad):
        return None
    spread, lr = _series(t, "reward_std"), _series(t, "lr")
    if spread and not any(math.isfinite(v) and v > ZERO for _, _, v in spread):
        return None  # every group scored alike: no advantage, a zero gradient is the right answer
    if lr and not any(math.isfinite(v) and v > 0 for _, _, v in lr):
        return None  # a warm-up at lr 0 (or a frozen run)
    key = t.keys.get("grad_norm", "grad_norm")
    ev = [
        f"line {grad[0][1]}: step {grad[0][0]}: {key} = 0.0"
        + (f" (and at all {len(grad)} logged steps)" if len(grad) > 1 else "")
    ]
    if spread:
        best = max(spread, key=lambda p: p[2])
        ev.append(
            f"line {best[1]}: step {best[0]}: {t.keys.get('reward_std')} = {best[2]:.4g}: the rewards differed, so the advantages were not all 0"
        )
    if lr:
        ev.append(f"line {lr[0][1]}: step {lr[0][0]}: {t.keys.get('lr')} = {lr[0][2]:.3g}")
    return Cause(
        "error" if len(grad) >= 3 else "warning",
        "collapse",
        f"No update reaches the model: {key} is exactly 0 at " + (f"all {len(grad)} logged steps" if len(grad) > 1 else f"step {grad[0][0]}"),
        "A gradient norm of exactly 0 while the rewards differ and the learning rate is not 0 means no "
        "gradient reached the trainable weights: the optimizer steps with nothing and the policy never "
        "moves (the KL to the reference stays 0). A true zero is rare in floating point; the usual sources "
        "are the distributed wrapper (a DeepSpeed / FSDP release or setting that drops or fails to reduce "
        "the gradients, or reports the norm of an empty shard), gradients detached by the loss code, or "
        "no parameter left trainable.",
        evidence=ev,
        step=grad[0][0],
        where=key,
        phase="update",
        line=grad[0][1],
        score=31.0,
        fixes=fixes(
            ctx,
            advice("if the run uses DeepSpeed (ZeRO-2/3): upgrade deepspeed (releases have reported or produced "
                   "zero gradients with ZeRO and overlap_comm), or try overlap_comm: false / another ZeRO stage"),
            advice("check that some parameters are trainable (requires_grad, the LoRA / freeze settings) and that "
                   "the loss is not computed from detached tensors"),
        ),
        unknown=["whether the gradients are 0 or only reported as 0: print a parameter's .grad norm after "
                 "backward on one rank"],
        data={"signals": ["grad_norm_zero"], "trigger_step": None},
    )  # fmt: skip


def no_signal(t: MetricTable, ctx: LogContext) -> Cause | None:
    """Every prompt group's rewards alike at every logged step (the share of zero-std groups at 1): GRPO's
    group-normalised advantages are all 0, so the loss and the gradient carry nothing. Not a fault of the
    trainer; a run that cannot learn."""
    frac = _series(t, "zero_std_groups")
    if not frac or not all(math.isfinite(v) and v >= 1.0 - ZERO for _, _, v in frac):
        return None
    key = t.keys.get("zero_std_groups", "frac_reward_zero_std")
    ev = [
        f"line {frac[0][1]}: step {frac[0][0]}: {key} = {frac[0][2]:g}"
        + (f" (and at all {len(frac)} logged steps)" if len(frac) > 1 else "")
    ]
    for name in ("reward_std", "grad_norm", "loss"):
        s = _series(t, name)
        if s and all(v == 0.0 for _, _, v in s):
            ev.append(f"{t.keys.get(name, name)} = 0 at every logged step")
    return Cause(
        "error" if len(frac) >= 3 else "warning",
        "collapse",
        f"No learning signal: every prompt group's rewards are identical ({key} = 1) at "
        + (f"all {len(frac)} logged steps" if len(frac) > 1 else f"step {frac[0][0]}"),
        "GRPO normalises each reward within its prompt group; when every completion of every group scores "
        "the same (all right, all wrong, or a reward that cannot tell them apart), every advantage is 0, so "
        "the policy loss and its gradient are 0 and the model does not move. The per-function reward std a "
        "log prints is across the batch, not within groups, and can be non-zero meanwhile.",
        evidence=ev,
        step=frac[0][0],
        where=key,
        phase="update",
        line=frac[0][1],
        score=30.0,
        fixes=fixes(
            ctx,
            advice("make the completions of one prompt score differently: a higher sampling temperature, more "
                   "generations per prompt (num_generations), a finer-grained reward, or prompts neither "
                   "always solved nor never solved"),
        ),
        data={"signals": ["zero_std_groups"], "trigger_step": None},
    )  # fmt: skip


# an RL objective's metrics beside its loss: a reward, a KL, an advantage, a value, DPO's chosen / rejected
# log-probs, PPO's ratio / clip fraction; a log without any of them trains a supervised (cross-entropy) loss
_RL_NAMES = re.compile(
    r"reward|(?:^|[/_])kl(?:$|[/_])|advantage|logps|chosen|rejected|score|returns?(?:$|[/_])|vf_|value|critic"
    r"|ratio|clipfrac|clip_frac|pg_|policy_loss|num_generations|completion",
    re.I,
)
ABRUPT = 1e-3
"""The loss before a run of exact zeros at or above this is a drop, not a convergence hidden by rounding (the HF
Trainer prints the loss to 4 decimals)."""


def zero_loss(t: MetricTable, ctx: LogContext) -> Cause | None:
    """A supervised loss of exactly 0.0 to the last logged step (module docstring)."""
    loss = _series(t, "loss")
    run = _tail(loss, lambda v: v == 0.0, None)
    if len(run) < 2 or any(_RL_NAMES.search(k) for k in t.names):
        return None
    before = [v for s, _, v in loss if s < run[0][0]]
    if before and not (math.isfinite(before[-1]) and before[-1] >= ABRUPT):
        return None  # a NaN before it (the non-finite rule's), or a loss that converged through rounding
    key = t.keys.get("loss", "loss")
    since = "from the first logged step" if not before else f"from step {run[0][0]} (after {before[-1]:.4g})"
    ev = [f"line {run[0][1]}: step {run[0][0]}: {key} = 0.0, and at every logged step to step {run[-1][0]} "
          f"({len(run)} logged step(s))" + ("" if before else ": it was never non-zero")]  # fmt: skip
    grad = [p for p in _series(t, "grad_norm") if p[0] >= run[0][0]]
    if grad and all(v == 0.0 for _, _, v in grad):
        ev.append(
            f"{t.keys.get('grad_norm', 'grad_norm')} = 0.0 at the same steps: nothing reaches the weights"
        )
    elif grad and all(math.isfinite(v) and v > 0 for _, _, v in grad):
        ev.append(f"{t.keys.get('grad_norm', 'grad_norm')} > 0 at the same steps: the loss reported is not the "
                  "one differentiated (its reduction across accumulation steps or ranks lost it)")  # fmt: skip
    ev.append("no reward, KL, advantage or preference metric is logged: a supervised (cross-entropy) loss, which is "
              "exactly 0 only when no token counts")  # fmt: skip
    return Cause(
        "error",
        "collapse",
        f"Loss exactly 0 {since}: the objective carries no signal",
        "A cross-entropy loss is strictly positive on any token it counts; printed as exactly 0.0 at every step "
        "it means no token counted (every label masked: the prompt mask or the completion-only collator covers "
        "the whole sequence, or truncation cut the answer off), or the loss was lost on its way to the log "
        "(its reduction across gradient-accumulation steps or sharded ranks, a mixed-precision overflow flushed "
        "to 0). The model does not learn either way.",
        evidence=ev,
        step=run[0][0],
        where=key,
        phase="update",
        line=run[0][1],
        score=31.0,
        fixes=fixes(
            ctx,
            advice("print one batch's labels: if every label is -100 (the ignore index) the mask or the truncation "
                   "(max_length / max_seq_length) removes the answer; fix the collator's response template or raise "
                   "the length"),
        ),
        unknown=["whether no token counted or the loss was lost in its reduction: print the count of labels "
                 "!= -100 of one batch and the loss before the trainer reduces it"],
        data={"signals": ["loss_zero"], "trigger_step": None},
    )  # fmt: skip


def vocab_names(kinds: list[str]) -> str:
    words = {"reward": "reward to 0", "loss": "loss exactly 0", "entropy": "entropy collapsing",
             "flat": "reward frozen"}  # fmt: skip
    items = [words[k] for k in kinds]
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


_CORRECTION = {
    "trl": ("GRPOConfig.vllm_importance_sampling_correction=True", "trl"),
    "nemo-rl": ("loss_fn.use_importance_sampling_correction=true", "nemo-rl"),
    "openrlhf": ("--enable_vllm_is_correction", "openrlhf"),
    "skyrl": (V.SKYRL_USE_TIS, "skyrl"),
    "slime": ("--use-tis", "slime"),
}


def _correction_fix(ctx: LogContext, why: str) -> Fix:
    """Truncated importance sampling on the rollout's log-probs, in the log's framework."""
    suite = "rollout_correction.rollout_is: token"
    if ctx.framework in (None, "verl"):
        return Fix(suite, f"{V.correction_key('rollout_is')}=token", why)
    if ctx.framework in _CORRECTION:
        key, fw = _CORRECTION[ctx.framework]
        return Fix(suite, None, why, key=key, framework=fw)
    return Fix(suite, None, why)


def mismatch(t: MetricTable, ctx: LogContext) -> Cause | None:
    crossed = []
    for ours in t.series:
        key = t.keys.get(ours, ours)
        entry = vocab.mismatch_with_bound(key)
        if entry is None:
            continue
        pts = [p for p in _series(t, ours) if math.isfinite(p[2])]
        bad = [p for p in pts if entry.crosses(p[2])]
        if pts and len(bad) >= min(2, len(pts)):
            crossed.append((bad[0][1], key, entry, bad, len(pts)))
    if not crossed:
        return None
    crossed.sort(key=lambda c: c[0])
    ev = []
    for _, key, entry, bad, n in crossed:
        worst = max(bad, key=lambda p: abs(math.log(p[2])) if p[2] > 0 else math.inf)
        ev.append(
            f"line {bad[0][1]}: step {bad[0][0]}: {key} = {bad[0][2]:.4g} outside {entry.bound()} at {len(bad)} "
            f"of {n} logged step(s) (worst {worst[2]:.4g} at step {worst[0]}); {entry.framework}'s {entry.quantity}, "
            f"{entry.level}, {entry.masked} (ours: {entry.ours}); bound: {entry.source}"
        )
    _, key, entry, bad, _n = crossed[0]
    fx = [
        _correction_fix(
            ctx,
            "importance-sample (truncated) on the rollout's log-probs so the update sees the "
            "policy that sampled",
        ),  # fmt: skip
        advice(
            "compute the rollout and the trainer's log-probs in the same dtype with the same weights: bf16 on "
            "both sides (or fp32 logits / lm_head on both), and the weights synced every step"
        ),  # fmt: skip
    ]
    return Cause(
        "warning",
        "mismatch",
        f"Rollout-vs-trainer mismatch: {key} {bad[0][2]:.4g} outside {entry.bound()} from step {bad[0][0]}",
        "The rollout engine and the trainer disagree on the sampled tokens' probabilities beyond what the "
        "framework's guidance accepts: the update is off-policy without knowing it, the usual precursor of "
        "a collapse.",
        evidence=ev,
        step=bad[0][0],
        where=key,
        phase="logprob",
        line=bad[0][1],
        score=15.0,
        fixes=fx,
        unknown=[
            "why they disagree (dtype, kernels, stale weights, sampling settings): rerun under "
            "`verlaudit run` for the mismatch audit"
        ],  # fmt: skip
        data={"metrics": [c[1] for c in crossed]},
    )


def causes(t: MetricTable, ctx: LogContext) -> list[Cause]:
    """The table's causes: a collapse, a mismatch (named in the collapse's evidence when it came first:
    the usual precursor)."""
    fell = collapse(t, ctx) or no_update(t, ctx) or no_signal(t, ctx) or zero_loss(t, ctx)
    off = mismatch(t, ctx)
    if fell and off and off.line is not None and fell.line is not None and off.line <= fell.line:
        fell.evidence.append(f"preceded by: {off.title} (line {off.line})")
    return [c for c in (fell, off) if c]
