"""One vocabulary for the metrics the log rules read, whatever framework logged them: the training
series (``loss``, ``grad_norm``, ``reward``, ``entropy``: `canonical`), the metrics whose non-finite
value is a finding (`is_finding_key`), and the rollout-vs-trainer mismatch and importance-sampling
metrics of verl, TRL, NeMo-RL, OpenRLHF, SkyRL and slime mapped to our names (`MISMATCH`, the names
`trainer.mismatch` writes), each with what it measures (probability or log-probability, token or
sequence, masked or not) and the published threshold applied to it, with its source. The README's
mismatch-vocabulary table is this table. Exercised by ``pytest tests/test_log_formats.py -k vocab``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from collections.abc import Mapping

_TRAINING = [
    ("grad_norm", re.compile(r"^(?:(?:train|training|actor|policy)[/_])?(?:actor_|policy_)?grad_?norm$")),
    ("loss", re.compile(r"^(?:(?:train|training|actor|policy)[/_])?(?:pg_|policy_|actor_|training_)?loss$")),
    ("reward", re.compile(
        r"^(?:(?:train|training|critic|rollout|loss)[/_])?(?:(?:avg_|mean_|raw_|avg_final_)?rewards?"
        r"(?:/mean|_mean)?|score/mean|rewards/mean|reward/mean)$")),
    ("entropy", re.compile(r"^(?:(?:train|training|actor|policy)[/_])?(?:entropy|entropy_loss|entropy/mean)$")),
    # the spread of the reward within a batch / group, and the learning rate: what tells a gradient norm
    # of 0 that had nothing to learn from (no spread, no step size) from one that lost its gradient
    ("reward_std", re.compile(r"^(?:(?:train|training|critic|rollout)[/_])?(?:rewards?_std|rewards?/std|score/std)$")),
    # the share of prompt groups whose rewards were all alike (TRL's GRPO): at 1 no group has an advantage
    ("zero_std_groups", re.compile(r"^(?:(?:train|training)[/_])?frac_reward_zero_std$")),
    ("lr", re.compile(r"^(?:(?:train|training|actor|policy|optim)[/_])?(?:actor_)?(?:learning_rate|lr)$")),
]  # fmt: skip
# (a KL or an entropy that is NaN is as broken as the loss it feeds: TRL's `objective/kl`, `policy/approxkl`)
_FINDING = re.compile(r"loss|grad_?norm|reward|score|log_?probs?|logp|\bkl\b|_kl|kl_|approxkl|entropy", re.I)
_METRICISH = re.compile(r"loss|grad_?norm|reward|entropy|log_?probs?|logp|\bkl\b|_kl|kl_|prob_error|"
                        r"probs_diff|abs_diff|rollout_is|importance_sampling|learning_rate", re.I)  # fmt: skip
_NOT_METRIC = re.compile(r"coef|coeff|clip|threshold|_len|length|size|weight_decay|warmup|max_|min_", re.I)


def norm(key: str) -> str:
    """A log's metric name as compared: lower case, spaces as ``_``, no ``train/`` W&B section for
    TRL's ``train/loss``."""
    return re.sub(r"\s+", "_", key.strip().lower())


@functools.lru_cache(maxsize=4096)
def canonical(key: str) -> str | None:
    """Our name for a training series or a mismatch metric (None: a metric no rule reads)."""
    k = norm(key)
    for ours, pat in _TRAINING:
        if pat.match(k):
            return ours
    m = mismatch_entry(key)
    return m.ours if m else None


@functools.lru_cache(maxsize=4096)
def is_finding_key(key: str) -> bool:
    """A loss, gradient-norm, reward or log-prob metric: its non-finite value is a finding."""
    return bool(_FINDING.search(key)) and not _NOT_METRIC.search(key)


_HINT_WORDS = ("loss", "grad", "reward", "entropy", "logp", "log_prob", "logprob", "kl", "prob_error",
               "probs_diff", "abs_diff", "rollout_is", "importance_sampling", "learning_rate")  # fmt: skip


def metric_hint(text: str) -> bool:
    """Whether a line may name a training metric at all: a cheap test (substrings of its lower-cased
    text) before its pairs are read; `has_metric` decides."""
    low = text.lower()
    return any(w in low for w in _HINT_WORDS)


def has_metric(values: Mapping[str, object]) -> bool:
    """Whether a set of pairs holds a training metric (not a config dump or a throughput line)."""
    return any(_METRICISH.search(k) and not _NOT_METRIC.search(k) for k in values)


@dataclasses.dataclass(frozen=True)
class Mismatch:
    """One framework's rollout-vs-trainer metric: its pattern, ours, what it measures, its bound."""

    framework: str
    name: str
    """The framework's metric name (``*``: one of the suffixes the pattern allows)."""
    pattern: re.Pattern[str]
    ours: str
    quantity: str
    """``probability``, ``log-probability``, ``IS ratio``, ``ESS`` or ``KL``."""
    level: str
    """``token`` or ``sequence`` (and how tokens are averaged)."""
    masked: str
    low: float | None = None
    high: float | None = None
    """The published range: a value outside [low, high] crosses it (None: no bound that side)."""
    source: str = ""
    """Where the bound comes from (an address), or why there is none."""

    def crosses(self, value: float) -> bool:
        if not math.isfinite(value):
            return False  # a non-finite value is the non-finite rule's finding
        return (self.low is not None and value < self.low) or (self.high is not None and value > self.high)

    def bound(self) -> str:
        if self.low is not None and self.high is not None:
            return f"[{self.low:g}, {self.high:g}]"
        if self.high is not None:
            return f"<= {self.high:g}"
        return f">= {self.low:g}" if self.low is not None else "none published"


VERL_GUIDE = "https://github.com/volcengine/verl/blob/main/docs/algo/rollout_corr.md"
NEMO_GUIDE = "https://github.com/NVIDIA-NeMo/RL/blob/main/docs/guides/grpo.md#metrics"
LN_105 = math.log(1.05)
"""NeMo-RL's 1.05 on mean exp(|d logp|), read on mean |d logp|: exp(mean |d|) <= mean exp(|d|) (Jensen),
so a mean |d logp| above ln 1.05 ~ 0.0488 nats puts token_mult_prob_error above 1.05 too."""
_DERIVED = f"derived from NeMo-RL's 1.05 ({NEMO_GUIDE}): mean |d logp| > ln 1.05 implies token_mult_prob_error > 1.05"

_PROB_DERIVED = (
    f"derived from NeMo-RL's 1.05 ({NEMO_GUIDE}): |p - q| <= |log p - log q| for probabilities (exp is "
    "1-Lipschitz below 0), so a mean |d p| above ln 1.05 puts the mean |d logp|, and token_mult_prob_error, "
    "above the bound too"
)

MISMATCH: tuple[Mismatch, ...] = (
    Mismatch("verl", "training/rollout_probs_diff_{mean,max,std}",
             re.compile(r"^(?:\w+/)?training/rollout_probs_diff_(mean|max|std)$|^training/rollout_probs_diff_(mean|max|std)$"),
             "training/rollout_probs_diff_{}", "probability: |p_rollout - p_train| (not log-probs)",
             "token", "response mask", None, LN_105, _PROB_DERIVED),
    Mismatch("verl", "rollout_corr/rollout_is_mean", re.compile(r"^rollout_corr/rollout_is_mean$"),
             "rollout_corr/token_ratio_mean", "IS ratio pi_train / pi_rollout (before truncation)",
             "token or sequence (rollout_is setting)", "response mask", 0.5, 2.0, VERL_GUIDE),
    Mismatch("verl", "rollout_corr/rollout_is_eff_sample_size", re.compile(r"^rollout_corr/rollout_is_eff_sample_size$"),
             "rollout_corr/token_ratio_eff_sample_size", "ESS (sum w)^2 / (n sum w^2) of the IS weights",
             "token or sequence (rollout_is setting)", "response mask", 0.3, None, VERL_GUIDE),
    Mismatch("verl", "rollout_corr/kl", re.compile(r"^rollout_corr/kl$"), "rollout_corr/kl",
             "KL(rollout || train), k1 estimate: mean(logp_rollout - logp_train), can be negative", "token",
             "response mask", -0.1, 0.1, VERL_GUIDE + " (|kl| > 0.1: a significant off-policy gap)"),
    Mismatch("verl", "rollout_corr/chi2_token", re.compile(r"^rollout_corr/chi2_token$"), "rollout_corr/chi2_token",
             "chi^2 divergence of the token IS ratio: mean(ratio^2) - 1", "token", "response mask", None, 1.0,
             VERL_GUIDE),
    Mismatch("trl", "sampling/sampling_logp_difference/{mean,max}",
             re.compile(r"^(?:train/|eval/)?sampling/sampling_logp_difference/(mean|max)$"),
             "training/rollout_log_probs_abs_diff_{}", "log-probability: |logp_vllm - logp_train|",
             "token (gathered over processes)", "completion mask", None, LN_105, _DERIVED),
    Mismatch("trl", "sampling/importance_sampling_ratio/{min,mean,max}",
             re.compile(r"^(?:train/|eval/)?sampling/importance_sampling_ratio/(min|mean|max)$"),
             "rollout_corr/token_ratio_{}", "IS ratio pi_train / pi_vllm (before truncation)",
             "token (sequence with sequence-level IS)", "completion mask", 0.5, 2.0,
             f"verl's [0.5, 2] for the mean IS weight ({VERL_GUIDE}), the same quantity"),
    Mismatch("nemo-rl", "token_mult_prob_error", re.compile(r"^(?:train/)?token_mult_prob_error$"),
             "rollout_corr/token_mult_prob_error", "mean exp(|logp_generation - logp_train|) (1 = equal)",
             "token", "token mask x sample mask", None, 1.05, NEMO_GUIDE),
    Mismatch("openrlhf", "vllm_kl", re.compile(r"^(?:train/|policy/)?vllm_kl$"), "rollout_corr/kl",
             "KL(vllm || actor) estimate from the two log-probs", "token", "action mask", -0.1, 0.1,
             f"verl's |kl| <= 0.1 for the same estimate ({VERL_GUIDE})"),
    Mismatch("skyrl", "policy/rollout_train_logprobs_abs_diff_{mean,max,std}",
             re.compile(r"^policy/rollout_train_logprobs_abs_diff_(mean|max|std)$"),
             "training/rollout_log_probs_abs_diff_{}", "log-probability: |logp_rollout - logp_train|",
             "token", "loss mask", None, LN_105, _DERIVED),
    Mismatch("slime", "train_rollout_logprob_abs_diff",
             re.compile(r"^(?:train/)?train_rollout_logprob_abs_diff$"),
             "training/rollout_log_probs_abs_diff_mean", "log-probability: |logp_old - logp_rollout|",
             "per-sequence token mean, then mean over sequences", "loss mask", None, LN_105,
             _DERIVED + " (slime weighs sequences equally: an approximation)"),
)  # fmt: skip


PRINTED_IS_RATIO = Mismatch(
    "any", "a printed IS ratio: `IS ratio: tensor([...])`, `importance_sampling_ratio = [...]`",
    re.compile(r"(?i)\b(?:is|importance[ _-]?(?:sampling[ _-]?)?)[ _-]?(?:ratios?|weights?)\b"),
    "rollout_corr/token_mult_prob_error", "per-token (or per-sequence) IS ratios pi_train / pi_rollout, read as "
    "mean max(r, 1/r) = mean exp(|logp_train - logp_rollout|)", "the printed values", "as printed", None, 1.05,
    f"NeMo-RL's 1.05 ({NEMO_GUIDE}) on the same quantity: for a token's ratio r, exp(|d logp|) = max(r, 1/r)",
)  # fmt: skip
"""A debug print of IS ratios (logs13 branch): the values themselves, not a batch statistic, so NeMo-RL's bound
on mean exp(|d logp|) applies to them exactly (`verlaudit.analysis.logs.ratios`)."""


@functools.lru_cache(maxsize=4096)
def mismatch_entry(key: str) -> Mismatch | None:
    """The vocabulary entry for one of a log's metric names, or None."""
    k = norm(key)
    if (
        "diff" not in k
        and "_is_" not in k
        and "ratio" not in k
        and "kl" not in k
        and "error" not in k
        and "chi2" not in k
    ):
        return None
    for m in MISMATCH:
        mm = m.pattern.match(k)
        if mm:
            suffix = next((g for g in mm.groups() if g), None)
            return dataclasses.replace(m, ours=m.ours.format(suffix) if "{}" in m.ours else m.ours)
    return None


def mismatch_with_bound(key: str) -> Mismatch | None:
    """The entry for ``key`` when it has a published bound that applies to this statistic (a mean
    ratio, an ESS, a mean log-prob difference; not a batch's min / max / std)."""
    m = mismatch_entry(key)
    if m is None or (m.low is None and m.high is None):
        return None
    if re.search(r"(?:/|_)(?:min|max|std)$", norm(key)):
        return None
    return m
