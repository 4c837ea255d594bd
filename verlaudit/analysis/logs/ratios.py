"""Importance-sampling ratios a log prints as values rather than as a logged metric (logs13 branch): a debug
print of a batch's ratios (``[DEBUG] first-token IS ratio: tensor([2., 2.])``, ``importance_sampling_ratio =
[0.98, 1.02]``), read with the vocabulary's `vocab.PRINTED_IS_RATIO`: for a token's ratio r = pi_train /
pi_rollout, exp(|d logp|) = max(r, 1/r), so NeMo-RL's bound on mean exp(|d logp|) (1.05) applies to the mean of
max(r, 1/r) over the printed values. A logged metric (TRL's ``sampling/importance_sampling_ratio/mean``) is the
metric table's (`trends.mismatch`). Exercised by ``pytest tests/test_log_families13.py``.
"""

from __future__ import annotations

import math
import re

from verlaudit.analysis.causes import Cause
from verlaudit.analysis.logs import vocab
from verlaudit.analysis.logs.frameworks import LogContext, advice
from verlaudit.analysis.logs.lines import LogLine, hints
from verlaudit.analysis.logs.scan import Hit, LogFacts, place, quote

_NUM = r"[-+]?(?:\d+\.?\d*|\.\d+)(?:e[-+]?\d+)?"
# a label naming IS ratios (one word before it, a few after), then `:` or `=`, then a tensor / list of numbers or
# one number; a metric key (`sampling/importance_sampling_ratio/mean`) does not match: it is the metric table's
_PRINTED = re.compile(
    r"(?P<label>(?:\b[\w-]+[ _-])?\b(?:IS|[Ii]mportance[ _-]?(?:[Ss]ampling[ _-]?)?)[ _-]?(?:[Rr]atios?|[Ww]eights?)\b"
    rf"[^:=\n/]{{0,30}}?)\s*[:=]\s*(?:tensor\()?\s*(?P<vals>\[[^\]]*\]|{_NUM})"
)
# and a statistic of the ratios that is not a ratio (their spread, a clipped fraction, a count, their log)
_SETTING = re.compile(
    r"clip|cap\b|threshold|trunc|level|mode|type|max|min|bound|limit|coef|eps|std|var|frac|pct|percent|count|num|"
    r"\bn_|ess\b|sample_size|entropy|log|kl\b|diff",
    re.I,
)
_HAS = hints("ratio", "Ratio", "weight", "Weight")
MAX_VALUES = 4096
"""Values of one printed line read (a batch's worth)."""


def detect(line: LogLine) -> list[Hit]:
    text = line.text
    if not _HAS(text):
        return []
    m = _PRINTED.search(text)
    if m is None or _SETTING.search(m["label"]):
        return []
    vals = [float(v) for v in re.findall(_NUM, m["vals"])[:MAX_VALUES]]
    vals = [v for v in vals if math.isfinite(v) and v > 0]
    label = m["label"].strip()
    return [Hit("printed_is_ratio", line, {"label": label, "values": vals})] if vals else []


def explain(facts: LogFacts, ctx: LogContext) -> list[Cause]:
    entry = vocab.PRINTED_IS_RATIO
    crossed = []
    for h in facts.of("printed_is_ratio"):
        vals = h.fields["values"]
        err = sum(max(v, 1 / v) for v in vals) / len(vals)
        if entry.crosses(err):
            crossed.append((h, err))
    if not crossed:
        return []
    h, err = crossed[0]
    vals = h.fields["values"]
    one_side = all(v > 1 for v in vals) or all(v < 1 for v in vals)
    pl = place(facts, h.line)
    ev = [
        quote(h.line),
        f"mean max(r, 1/r) over {len(vals)} printed ratio(s) = {err:.4g} (= mean exp(|d logp|), "
        f"token_mult_prob_error); bound {entry.bound()}: {entry.source}",
    ]
    if one_side:
        ev.append(
            f"every printed ratio is {'above' if vals[0] > 1 else 'below'} 1: a systematic gap, the two sides "
            "score another distribution, not noise"
        )
    ev += [f"also line {x.no}: {x.fields['label']} (mean max(r, 1/r) {e:.4g})" for x, e in crossed[1:3]]
    return [
        Cause(
            "warning",
            "mismatch",
            f"Rollout-vs-trainer mismatch: {h.fields['label']} {err:.4g} (mean max(r, 1/r)) over {entry.bound()}",
            "The importance-sampling ratios the log prints, trainer over rollout probability of the sampled "
            "tokens, are far from 1: the rollout engine and the trainer do not score the same distribution, so "
            "the update is off-policy by that much."
            + (
                " All of them sit on one side of 1, which noise does not do: the two sides compute the "
                "log-probs differently (a sampling temperature or top-k / top-p applied on one side only, other "
                "weights, another dtype)."
                if one_side
                else ""
            ),
            evidence=ev,
            where=h.fields["label"],
            phase="logprob",
            rank=pl.rank,
            line=h.no,
            score=15.0,
            fixes=[
                advice(
                    "with a sampling temperature other than 1 (or top-k / top-p), have the engine return the "
                    "log-probs of the distribution it sampled from: vLLM's `logprobs_mode=processed_logprobs` "
                    "(`--logprobs-mode processed_logprobs` for a server), and divide the trainer's logits by the "
                    "same temperature"
                ),
                advice(
                    "compute the rollout's and the trainer's log-probs in the same dtype with the same weights "
                    "(weights synced before every rollout)"
                ),
            ],
            unknown=["which side is off: rerun under `verlaudit run` for the mismatch audit"],
            data={"values": len(vals), "token_mult_prob_error": err},
        )
    ]
