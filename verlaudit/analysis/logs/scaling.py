"""fp16 loss scaling: DeepSpeed's overflow skips (``OVERFLOW! Rank 0 Skipping step. Attempted loss
scale: X, reducing to Y``, the newer ``fp16 dynamic loss scale overflow!`` and ``Overflow detected``
wordings) and its minimum-scale abort, apex's ``Gradient overflow.  Skipping step``, Megatron's skipped
iterations, and PyTorch GradScaler's ``Attempting to unscale FP16 gradients.`` Occasional skips while
the scale searches down from a high initial value are normal (info); skips at a low scale mean the
gradients themselves are near fp16's range (warning); halving after halving down to a handful, or the
floor, is the collapse that ends the run (error). Exercised by ``pytest tests/test_log_rules.py -k scaling``.
"""

from __future__ import annotations

import dataclasses
import math
import re

from verlaudit.analysis.causes import Cause, Fix
from verlaudit.analysis.logs.frameworks import LogContext, advice, fixes
from verlaudit.analysis.logs.lines import LogLine, hints
from verlaudit.analysis.logs.scan import Hit, LogFacts, place, quote

_RULES = [
    ("overflow", re.compile(r"(?:OVERFLOW!|overflow!|Overflow detected\.)(?: Rank (\d+))? Skipping step\.?"
                            r"(?: Attempted loss scale: ([\d.e+]+)(?:, reducing to ([\d.e+]+))?)?")),
    ("overflow_apex", re.compile(r"Gradient overflow\.\s+Skipping step, loss scaler \d+ reducing loss scale "
                                 r"to "
                                 r"([\d.e+-]+)")),
    ("overflow_reducing", re.compile(r"Reducing dynamic loss scale from ([\d.e+]+) to ([\d.e+]+)")),
    ("loss_scale_min", re.compile(r"Current loss scale already at minimum - cannot decrease scale anymore")),
    ("megatron_skipped", re.compile(r"loss scale: ([\d.e+]+) \|.*number of skipped iterations:\s*(\d+)"
                                    r"|number of skipped iterations:\s*(\d+)")),
    ("unscale_fp16", re.compile(r"Attempting to unscale FP16 gradients\.")),
    # DeepSpeed's fused / unfused optimizers: the iteration of an overflow
    ("overflow_iteration", re.compile(r"Grad overflow on iteration (\d+)")),
    # GradScaler's own checks of the order of its calls (torch/amp/grad_scaler.py): unscale_ twice in one iteration,
    # step twice, a step whose optimizer had no gradient to check, a call on a scaler that is not enabled
    ("scaler_order", re.compile(r"(unscale_\(\) has already been called on this optimizer since the last update\(\)"
                                r"|step\(\) has already been called since the last update\(\)"
                                r"|No inf checks were recorded for this optimizer"
                                r"|No inf checks were recorded prior to update)")),
]  # fmt: skip
DEFAULT_INITIAL_SCALE = 2.0**16
"""DeepSpeed's and torch's GradScaler's initial loss scale (DeepSpeed's fp16.initial_scale_power 16)."""
LOW_SCALE = 256.0
"""An overflow at a loss scale this low means unscaled gradient elements above 65504 / 256 ~ 256: the
gradients themselves are near fp16's range, not the scaler searching down from its initial value."""
COLLAPSE_SCALE = 16.0
"""Three halvings in a row ending at or below this scale: even lightly scaled gradients overflow, and
the scaler is on its way to the minimum-scale abort."""


_HAS = hints(
    "verflow",
    "OVERFLOW",
    "loss scale",
    "unscale",
    "skipped iterations",
    "Grad overflow",
    "inf checks",
    "step() has",
)


def detect(line: LogLine) -> list[Hit]:
    """Loss-scaling messages in one line."""
    text = line.text
    if not _HAS(text):
        return []
    return [Hit(rule, line, {"groups": m.groups()}) for rule, pat in _RULES if (m := pat.search(text))]


def _f(x: str | None) -> float | None:
    try:
        return float(x) if x else None
    except ValueError:
        return None


def explain(facts: LogFacts, ctx: LogContext) -> list[Cause]:
    """The loss-scale cause (collapse, low-scale skips, normal skips) and the GradScaler unscale error."""
    return [c for c in (_skips(facts, ctx), _unscale(facts, ctx), _scaler_order(facts, ctx)) if c]


# what each GradScaler order check means, and the call order that holds it (the order the AMP recipe documents:
# https://pytorch.org/docs/stable/notes/amp_examples.html: scale(loss).backward(); unscale_ at most once per
# optimizer per iteration, after every micro-batch's backward; scaler.step(opt); scaler.update() once per iteration)
_SCALER = {
    "unscale_": ("scaler.unscale_(optimizer) ran twice without scaler.update() between (a gradient-accumulation loop or "
                 "a clip called per micro-batch, or an iteration whose update() was skipped)",
                 "call scaler.unscale_(optimizer) once per iteration, after the last micro-batch's backward, and "
                 "scaler.update() every iteration (after scaler.step), also when the step is skipped"),
    "step()": ("scaler.step(optimizer) ran twice without scaler.update() between",
               "call scaler.step(optimizer) once per iteration and scaler.update() right after it"),
    "No inf checks": ("scaler.step found no gradient to check in this optimizer: none of its parameters got a gradient "
                      "(frozen parameters, a loss that does not reach them, or step before backward)",
                      "make sure the loss reaches the optimizer's parameters (requires_grad, the backward ran through "
                      "scaler.scale(loss)) before scaler.step(), and call scaler.update() every iteration"),
}  # fmt: skip


def _scaler_order(facts: LogFacts, ctx: LogContext) -> Cause | None:
    h = facts.first("scaler_order")
    if h is None:
        return None
    msg = h.fields["groups"][0]
    what, how = next(v for k, v in _SCALER.items() if k in msg)
    pl = place(facts, h.line)
    at = pl.culprit()
    return Cause(
        "error",
        "exception",
        f"GradScaler call order: {msg}",
        f"torch.amp.GradScaler refused a call out of its order: {what}. Nothing numerical went wrong; the "
        "training loop calls the scaler in an order it does not allow.",
        evidence=[quote(h.line)] + pl.evidence(),
        fixes=fixes(
            ctx,
            advice(
                how + " (PyTorch's AMP recipe; with accelerate, accelerator.clip_grad_norm_ once "
                "per sync step: under accelerator.sync_gradients)"
            ),
        ),  # fmt: skip
        where="torch.amp.GradScaler call order (unscale_ / step / update)" + (f" / {at}" if at else ""),
        phase="update",
        rank=pl.rank,
        line=h.no,
        score=38.0,
    )


@dataclasses.dataclass
class _History:
    """The loss-scale history the skip lines show."""

    first: Hit
    count: int
    evidence: list[str]
    lowest: float
    """The lowest scale that overflowed (the attempted one; the new one where a line lacks it)."""
    last: float | None
    """The scale after the last skip."""
    chain: int
    """Skips at the end that halved the scale one after another, no successful step between."""
    floor: bool
    mega_skips: int


def _history(facts: LogFacts) -> _History | None:
    steps: list[tuple[Hit, float | None, float | None]] = []  # (hit, attempted, new)
    for h in facts.of("overflow", "overflow_apex"):
        g = h.fields["groups"]
        if h.rule == "overflow":
            a, n = _f(g[1]), _f(g[2])
            steps.append((h, a, n if n is not None else (a / 2 if a else None)))
        else:
            n = _f(g[0])
            steps.append((h, n * 2 if n else None, n))
    if not steps:  # only "Reducing dynamic loss scale from X to Y" lines (verbose DeepSpeed / apex)
        steps = [
            (h, _f(h.fields["groups"][0]), _f(h.fields["groups"][1])) for h in facts.of("overflow_reducing")
        ]
    floor = facts.first("loss_scale_min")
    mega = facts.of("megatron_skipped")
    mega_skips = [int(h.fields["groups"][1] or h.fields["groups"][2] or 0) for h in mega]
    mega_scale = [s for s in (_f(h.fields["groups"][0]) for h in mega) if s]
    if not steps and not floor and not any(mega_skips):
        return None
    scales = [s for s in (a if a is not None else n for _, a, n in steps) if s is not None] + mega_scale
    chain = 1 if steps else 0
    for (_, _, prev_new), (_, a, _) in zip(steps, steps[1:]):
        chain = chain + 1 if a is not None and a == prev_new else 1
    last = steps[-1][2] if steps else (mega_scale[-1] if mega_scale else None)
    count = facts.count("overflow", "overflow_apex") or facts.count("overflow_reducing")
    ev = []
    if steps:
        first_a = steps[0][1] or (steps[0][2] * 2 if steps[0][2] else None)
        ev.append(
            f"{count} overflow skips, first at line {steps[0][0].no}; loss scale went {_fmt(first_a)} -> "
            f"{_fmt(last)}"
        )
    if any(mega_skips):
        at = f" at loss scale {_fmt(min(mega_scale))}" if mega_scale else ""
        ev.append(f"Megatron: up to {max(mega_skips)} skipped iterations per logging interval{at}")
    if floor:
        ev.append(quote(floor.line))
    if chain >= 3:
        ev.append(f"the last {chain} skips halved the scale one after another (no successful step between)")
    first = steps[0][0] if steps else (floor or mega[0])
    lowest = min(scales) if scales else math.nan
    return _History(first, count or sum(mega_skips), ev, lowest, last, chain, bool(floor), sum(mega_skips))


def _skips(facts: LogFacts, ctx: LogContext) -> Cause | None:
    h = _history(facts)
    if h is None:
        return None
    collapse = (
        h.floor
        or h.lowest <= 1.0
        or (h.last is not None and h.last < 1.0)
        or (h.chain >= 3 and h.last is not None and h.last <= COLLAPSE_SCALE)
    )
    low = h.lowest <= LOW_SCALE
    fx = fixes(
        ctx,
        None
        if _old_gpu(facts)
        else (
            "bf16_instead_of_fp16",
            "bf16 has fp32's exponent range: no loss scaling, no overflow skips",
            "precision.preset: bf16",
        ),
        advice(
            "lower the learning rate or clip gradients harder: the overflow is in the gradients themselves"
        )
        if collapse or low
        else None,
        advice("skip or clip the samples that spike (the loss jumped before the overflows)")
        if collapse
        else None,
    )
    where = _scale_setting(facts, ctx, h)
    if where and where.startswith("fp16.initial_scale_power"):
        fx.append(
            Fix(None, None, "the run started from a low loss scale: DeepSpeed's default initial_scale_power is 16 "
                "(2**16); at a scale this low the overflows are in the gradients themselves",
                key="fp16.initial_scale_power", framework="deepspeed")
        )  # fmt: skip
    at = {"evidence": h.evidence, "phase": "update", "line": h.first.no, "where": where}
    if collapse:
        end = (
            min(x for x in (h.lowest, h.last) if x is not None and not math.isnan(x))
            if h.chain or h.last
            else None
        )
        return Cause(
            "error",
            "loss_scale_collapse",
            "fp16 loss-scale collapse" + (f" to {_fmt(end)}" if end else ""),
            "The loss scale was driven to its floor by repeated overflows: values overflow fp16 even "
            "unscaled, so the optimizer keeps skipping.",
            fixes=fx,
            score=30.0,
            unknown=["which module overflows (a log has no per-module absmax); rerun under verlaudit"],
            **at,
        )
    if low:
        return Cause(
            "warning",
            "overflow_skips",
            f"{h.count} fp16 overflow skips at loss scale {_fmt(h.lowest)}",
            f"Overflows at a loss scale of {_fmt(h.lowest)} mean unscaled gradient elements near "
            f"{65504 / max(h.lowest, 1):.0f}: the gradients themselves spiked (a loss spike, a bad batch), "
            "not the scaler searching down from its initial value.",
            fixes=fx,
            score=20.0,
            **at,
        )
    return Cause(
        "info",
        "overflow_skips",
        f"{h.count} fp16 overflow skips",
        "Dynamic loss scaling found its level by skipping steps; occasional skips are normal.",
        fixes=fx if h.count > 10 else [],
        **at,
    )


def _scale_setting(facts: LogFacts, ctx: LogContext, h: _History) -> str | None:
    """The DeepSpeed setting behind a low loss scale: ``fp16.initial_scale_power`` when the scale was low
    from the start (printed below 16, or an overflow at scale S on an iteration too early to have halved
    down from 2**16), ``fp16.min_loss_scale`` at the minimum-scale abort."""
    power = ctx.setting("initial_scale_power")
    if power and power.isdigit() and int(power) < 16:
        return f"fp16.initial_scale_power ({power})"
    it = facts.first("overflow_iteration")
    if it is not None and not math.isnan(h.lowest) and h.lowest > 0:
        halvings = math.log2(DEFAULT_INITIAL_SCALE / h.lowest)
        if int(it.fields["groups"][0]) < halvings:  # fewer iterations than halvings from the default
            return f"fp16.initial_scale_power (a scale of {_fmt(h.lowest)} by iteration {it.fields['groups'][0]})"
    if h.floor:
        return "fp16.min_loss_scale (the minimum-scale abort)"
    return None


def _old_gpu(facts: LogFacts) -> bool:
    """Whether the log shows a GPU without bf16 (so bf16 is no fix)."""
    return bool(facts.first("bf16_unsupported") or facts.first("gpu_name"))


def _fmt(v: float | None) -> str:
    return "?" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:g}"


def _unscale(facts: LogFacts, ctx: LogContext) -> Cause | None:
    h = facts.first("unscale_fp16")
    if h is None:
        return None
    pl = place(facts, h.line)
    via = pl.tb.culprit() if pl.tb else None
    call = via.split(": ", 1)[1] if via and ": " in via else None  # a frame that calls on: the caller
    title = "GradScaler.unscale_ refused FP16 gradients" + (f" (called from {call})" if call else "")
    what = (
        "fp16 mixed precision keeps fp32 master weights and unscales their gradients; here the trainable "
        "parameters themselves are fp16 (the model, or its LoRA adapters, was loaded in half precision), so "
        "their gradients are fp16 and GradScaler refuses to unscale them."
    )
    fx = fixes(
        ctx,
        advice(
            "load the model (or at least the trainable parameters: LoRA adapters, heads) in fp32 and let "
            "fp16 "
            "autocast do the compute (torch_dtype=torch.float32; peft keeps adapters fp32 by default)",
            suite="precision.preset: fp16",
        ),
        ("bf16_instead_of_fp16", "on a GPU with bf16: no GradScaler at all") if not _old_gpu(facts) else None,
        advice("or train without fp16 mixed precision (fp32), if memory allows"),
    )
    return Cause(
        "error",
        "unscale_fp16",
        title,
        what,
        evidence=[quote(h.line)] + pl.evidence(),
        fixes=fx,
        where=via or "GradScaler.unscale_",
        phase=pl.phase or "update",
        rank=pl.rank,
        line=h.no,
        score=45.0,
    )
