"""PPO, GRPO and DPO losses as pure functions over tensors: the fp32 "loss" island, with verl's and TRL's math.

Every function upcasts fp16/bf16 (and integer/bool masks) to float32 before arithmetic, so a low-precision
caller gets the same numbers as an fp32 one up to the rounding of its inputs; fp64 inputs stay fp64 (the
tests check the math in fp64). Shapes: ``B`` sequences, ``R`` response tokens (right-padded; the mask
marks valid tokens). The policy and value losses follow verl's ``verl/trainer/ppo/core_algos.py``
(names: ``loss_mode``, ``loss_agg_mode``, ``kl_penalty``); the DPO losses follow TRL's
``DPOTrainer`` (``loss_type``). Advantage estimators live in `trainer.advantages`.
Exercised by `pytest tests/test_losses.py tests/test_policy_losses.py tests/test_dpo_losses.py`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F

from trainer.registry import Registry
from trainer.update_stats import ratio_metrics

KL_ESTIMATOR: Registry = Registry("kl estimator")
"""verl's ``kl_penalty`` / ``kl_loss_type`` names -> per-token estimate from d = logp - ref."""
LOSS_AGG: Registry = Registry("loss_agg_mode")
"""verl's ``loss_agg_mode`` values -> (loss_mat, mask, norm) -> scalar."""
POLICY_LOSS: Registry = Registry("loss_mode")
"""verl's ``policy_loss.loss_mode`` values we implement -> the loss function. Metadata ``reads``: the groups
of `PolicyLossParams` knobs it reads (``clip``, ``dual_clip``, ``clip_cov``, ``kl_cov``, ``sapo``), so a knob
set for another loss is refused (`trainer.algo_config.unread_algo_keys`); ``token_weights=False``: the loss is
not per token in the advantage, so IS weights cannot enter as scaled advantages
(`trainer.mismatch.weighted_advantages`)."""
DPO_LOSS: Registry = Registry("dpo_loss", unknown="{key}: unknown loss {name!r}; expected one of {names}")
"""TRL's ``DPOConfig.loss_type`` values we implement -> per-pair loss of (c, r, h, beta, `DPOTerms`)."""


def _up(x: torch.Tensor) -> torch.Tensor:
    """fp16/bf16 and integer/bool tensors as float32; fp32 and fp64 unchanged."""
    if x.is_floating_point() and x.dtype in (torch.float32, torch.float64):
        return x
    return x.float()


def masked_sum(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sum of ``values`` where ``mask`` is set (over all elements, or along ``dim``)."""
    v, m = _up(values), _up(mask)
    return (v * m).sum() if dim is None else (v * m).sum(dim)


def _acc(values: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.dtype]:
    """``values`` and ``mask`` as float64 (the accumulation dtype of the statistics below) and the dtype
    the result is rounded to once: what ``values * mask`` would have been."""
    v, m = _up(values), _up(mask)
    return v.double(), m.double(), torch.promote_types(v.dtype, m.dtype)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of ``values`` over the set positions of ``mask``; 0 where the mask is empty. Accumulated in
    float64 and rounded once, so it is the correctly rounded mean for any count up to 2**29 fp32 values
    (a constant input gives exactly its value)."""
    v, m, out = _acc(values, mask)
    count = m.sum() if dim is None else m.sum(dim)
    total = (v * m).sum() if dim is None else (v * m).sum(dim)
    return (total / count.clamp(min=1.0)).to(out)


def _moments(v: torch.Tensor, m: torch.Tensor, unbiased: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 mean and variance (two passes: the deviations from the mean, then their mean)."""
    n = m.sum()
    mean = (v * m).sum() / n.clamp(min=1.0)
    var = ((v - mean) ** 2 * m).sum() / n.clamp(min=1.0)
    if unbiased:
        var = var * n / (n - 1).clamp(min=1.0)
    return mean, var


def masked_var(values: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance over the set positions of ``mask`` (Bessel-corrected unless ``unbiased=False``), accumulated
    in float64 and rounded once."""
    v, m, out = _acc(values, mask)
    return _moments(v, m, unbiased)[1].to(out)


def masked_whiten(
    values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, eps: float = 1e-8
) -> torch.Tensor:
    """(values - mean) / std over the masked positions; masked-out positions come back as 0. Computed in
    float64 and rounded once: a constant input whitens to exactly 0."""
    v, m, out = _acc(values, mask)
    mean, var = _moments(v, m, unbiased=True)
    white = (v - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        white = white + mean
    return (white * m).to(out)


# ---------------------------------------------------------------- KL estimators


@KL_ESTIMATOR.register("kl", aliases=("k1",))
def _kl_k1(diff: torch.Tensor) -> torch.Tensor:
    return diff


@KL_ESTIMATOR.register("abs")
def _kl_abs(diff: torch.Tensor) -> torch.Tensor:
    return diff.abs()


@KL_ESTIMATOR.register("mse", aliases=("k2",))
def _kl_k2(diff: torch.Tensor) -> torch.Tensor:
    return 0.5 * diff.square()


@KL_ESTIMATOR.register("low_var_kl", aliases=("k3",))
def _kl_k3(diff: torch.Tensor) -> torch.Tensor:
    x = (-diff).clamp(-20.0, 20.0)
    # expm1 keeps precision near 0 (e^x - 1 - x is the same value in exact arithmetic)
    return (torch.expm1(x) - x).clamp(0.0, 10.0)


def _straight_through_k2(base):
    """verl's ``+`` estimators: the value of ``base``, the gradient of k2 (0.5 d^2), whose expected gradient
    is the KL's (k1's and k3's are not)."""

    def estimator(diff: torch.Tensor) -> torch.Tensor:
        k2 = 0.5 * diff.square()
        return k2 - k2.detach() + base(diff).detach()

    return estimator


KL_ESTIMATOR.add("k1+", _straight_through_k2(_kl_k1))
KL_ESTIMATOR.add("k3+", _straight_through_k2(_kl_k3))


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str = "kl") -> torch.Tensor:
    """Per-token estimate of KL(actor || reference) from sampled-token log-probs, verl's ``kl_penalty``.

    ``kl``/``k1``: logp - ref (unbiased, can be negative). ``abs``: |logp - ref|. ``mse``/``k2``:
    0.5 (logp - ref)^2. ``low_var_kl``/``k3``: with x = ref - logp clamped to [-20, 20],
    e^x - x - 1 clamped to [0, 10]: where a value is clamped its gradient is zero (verl clamps to
    [-10, 10]; the value is never negative, so the lower bound only removes rounding below 0).
    ``k1+`` / ``k3+``: the value of k1 / k3 with the gradient of k2 (straight-through), as verl.
    """
    fn = KL_ESTIMATOR.get(estimator)
    return fn(_up(logprobs) - _up(ref_logprobs))


def token_level_rewards(
    scores: torch.Tensor, response_mask: torch.Tensor, kl: torch.Tensor | None, kl_coef: float
) -> torch.Tensor:
    """[B, R] rewards: each sequence's score placed on its last valid token, minus ``kl_coef * kl``
    on every valid token (verl's ``apply_kl_penalty``). A sequence with an empty mask gets its score
    on token 0."""
    m = _up(response_mask)
    s = _up(scores)
    rewards = torch.zeros_like(m, dtype=torch.promote_types(m.dtype, s.dtype))
    last = (m.sum(-1).long() - 1).clamp(min=0)
    rewards[torch.arange(m.shape[0], device=m.device), last] = s.to(rewards.dtype)
    if kl is not None and kl_coef != 0:
        rewards = rewards - kl_coef * _up(kl) * m
    return rewards


def compute_gae(
    token_rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over right-padded responses -> (advantages, returns), [B, R].

    Positions after the last valid token contribute no reward and no bootstrap value, so a
    sequence's advantage never leaks from the padding. Returns = advantages + values. Not whitened
    (`trainer.advantages.gae` whitens, as verl does).
    """
    r, v, m = _up(token_rewards), _up(values), _up(mask)
    v = v * m
    last_gae = torch.zeros_like(r[:, 0])
    next_value = torch.zeros_like(r[:, 0])
    adv = torch.zeros_like(r)
    for t in reversed(range(r.shape[1])):
        delta = r[:, t] + gamma * next_value - v[:, t]
        gae = delta + gamma * lam * last_gae
        # Padding keeps the carried state of the token after it (which is zero: padding is on the right).
        last_gae = torch.where(m[:, t] > 0, gae, last_gae)
        next_value = torch.where(m[:, t] > 0, v[:, t], next_value)
        adv[:, t] = gae * m[:, t]
    return adv, (adv + v) * m


# ---------------------------------------------------------------- aggregation


@dataclasses.dataclass(frozen=True)
class AggNorm:
    """Denominators of one mini-batch (verl's ``global_batch_info``).

    A micro-batch's aggregated loss is its share of the mini-batch's loss: the shares of all
    micro-batches (on all ranks) add up to the loss verl computes over the whole mini-batch, so no
    further division by the gradient-accumulation count is needed. ``world`` multiplies the share
    because FSDP averages gradients over ranks.
    """

    tokens: float
    """Valid tokens in the mini-batch, all ranks (``token-mean``'s denominator)."""
    sequences: float
    """Sequences with at least one valid token in the mini-batch, all ranks (the seq-mean modes')."""
    world: int = 1
    """Data-parallel ranks (verl's ``dp_size``)."""
    horizon: float | None = None
    """``seq-mean-token-sum-norm``'s constant divisor (verl's ``loss_scale_factor``); None: the
    padded response length (``mask.shape[-1]``)."""
    per_sequence: bool = True
    """``seq-mean-token-sum-norm`` averages over ``sequences`` before dividing by ``horizon`` (verl 0.9 on);
    False: verl before 0.9, the token sums summed over sequences (`trainer.verl_versions`)."""

    @classmethod
    def of(
        cls, mask: torch.Tensor, *, world: int = 1, horizon: float | None = None, per_sequence: bool = True
    ) -> AggNorm:
        """The denominators when ``mask`` is the whole mini-batch (one process, no accumulation)."""
        m = _up(mask)
        return cls(float(m.sum()), float((m.sum(-1) > 0).sum()), world, horizon, per_sequence)


@LOSS_AGG.register("token-mean")
def _agg_token_mean(v: torch.Tensor, m: torch.Tensor, norm: AggNorm) -> torch.Tensor:
    return (v * m).sum() / max(norm.tokens, 1.0) * norm.world


@LOSS_AGG.register("token-sum")
def _agg_token_sum(v: torch.Tensor, m: torch.Tensor, norm: AggNorm) -> torch.Tensor:
    # no normaliser: the mini-batch's loss is the sum over its valid tokens (times the ranks FSDP averages over)
    return (v * m).sum() * norm.world


@LOSS_AGG.register("seq-mean-token-sum")
def _agg_seq_sum(v: torch.Tensor, m: torch.Tensor, norm: AggNorm) -> torch.Tensor:
    return (v * m).sum(-1).sum() / max(norm.sequences, 1.0) * norm.world


@LOSS_AGG.register("seq-mean-token-mean")
def _agg_seq_mean(v: torch.Tensor, m: torch.Tensor, norm: AggNorm) -> torch.Tensor:
    # an empty sequence contributes 0 (verl divides by count + 1e-8: the same value in fp32)
    return ((v * m).sum(-1) / m.sum(-1).clamp(min=1.0)).sum() / max(norm.sequences, 1.0) * norm.world


@LOSS_AGG.register("seq-mean-token-sum-norm")
def _agg_seq_sum_norm(v: torch.Tensor, m: torch.Tensor, norm: AggNorm) -> torch.Tensor:
    horizon = norm.horizon if norm.horizon is not None else m.shape[-1]
    if not norm.per_sequence:
        return (v * m).sum(-1).sum() * norm.world / horizon
    return (v * m).sum(-1).sum() / max(norm.sequences, 1.0) * norm.world / horizon


def agg_loss(
    loss_mat: torch.Tensor, mask: torch.Tensor, mode: str = "token-mean", norm: AggNorm | None = None
) -> torch.Tensor:
    """A [B, R] per-token loss as a scalar, verl's ``agg_loss`` in its global-batch form.

    ``token-mean``: sum over valid tokens / mini-batch tokens. ``token-sum``: the sum over valid tokens,
    not normalised. ``seq-mean-token-sum``: each sequence's
    token sum, averaged over the mini-batch's sequences. ``seq-mean-token-mean``: each sequence's token
    mean, averaged over sequences. ``seq-mean-token-sum-norm`` (Dr.GRPO): ``seq-mean-token-sum`` divided
    by ``norm.horizon`` (default: R). ``norm`` None means this batch is the whole mini-batch.
    """
    fn = LOSS_AGG.get(mode)
    v, m = _up(loss_mat), _up(mask)
    return fn(v, m, norm or AggNorm.of(m))


# ---------------------------------------------------------------- policy losses


@dataclasses.dataclass(frozen=True)
class PolicyLossParams:
    """The knobs of verl's policy losses (``actor_rollout_ref.actor.*``); `trainer.config.AlgoConfig`
    documents each."""

    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2
    clip_ratio_c: float = 3.0
    loss_agg_mode: str = "token-mean"
    clip_cov_ratio: float = 0.0002
    clip_cov_lb: float = 1.0
    clip_cov_ub: float = 5.0
    kl_cov_ratio: float = 0.0002
    ppo_kl_coef: float = 0.1
    tau_pos: float = 1.0
    tau_neg: float = 1.05
    dro_beta: float | None = None
    bypass: Bypass | None = None


@dataclasses.dataclass(frozen=True)
class Bypass:
    """What verl's ``bypass_mode`` loss reads besides `PolicyLossParams`: the rollout correction
    (`trainer.config.RolloutCorrectionConfig`), applied in the loss between the current and the rollout
    log-probs, and which loss follows it."""

    correction: Any
    loss_type: str = "ppo_clip"
    truncated_metrics: bool = True
    """The ``rollout_corr/rollout_is_*`` metrics of the truncated weights (`trainer.mismatch.is_weights`)."""
    raw_seq_fractions: bool = True
    """The per-sequence fractions of the raw weights (`trainer.mismatch.is_weights`)."""


@dataclasses.dataclass(frozen=True)
class PolicyLoss:
    """A policy loss and verl's metrics of it (``actor/pg_clipfrac``, ``actor/ppo_kl``,
    ``actor/pg_clipfrac_lower``); the metrics are token means over this micro-batch, detached.
    ``metrics``: any others under their own verl names (``bypass_mode``'s ``rollout_corr/*``)."""

    loss: torch.Tensor
    clipfrac: torch.Tensor
    ppo_kl: torch.Tensor
    clipfrac_lower: torch.Tensor
    metrics: Mapping[str, float] = dataclasses.field(default_factory=dict)


def _zero(like: torch.Tensor) -> torch.Tensor:
    return torch.zeros((), dtype=like.dtype, device=like.device)


@POLICY_LOSS.register("vanilla", reads=("clip", "dual_clip"))
def ppo_policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    p: PolicyLossParams = PolicyLossParams(),
    norm: AggNorm | None = None,
) -> PolicyLoss:
    """verl's ``vanilla`` loss: the clipped surrogate with clip-higher and dual-clip.

    Per token, ratio r = exp(clamp(logp - old, -20, 20)): L1 = max(-A r, -A clip(r, 1 - low, 1 + high));
    for A < 0 the loss is min(L1, -A c) with c = ``clip_ratio_c`` (dual-clip: a negative-advantage
    token whose ratio exceeds c contributes the constant -A c, with zero gradient). ``clipfrac``:
    tokens where the clipped term won; ``clipfrac_lower``: A < 0 tokens bounded by the dual clip.
    """
    if not p.clip_ratio_c > 1.0:
        raise ValueError(f"clip_ratio_c: must be > 1 (dual-clip's lower bound), got {p.clip_ratio_c}")
    lp, old, adv = _up(logprobs), _up(old_logprobs), _up(advantages)
    log_ratio = (lp - old).clamp(-20.0, 20.0)
    ratio = torch.exp(log_ratio)
    loss1 = -adv * ratio
    loss2 = -adv * ratio.clamp(1.0 - p.clip_ratio_low, 1.0 + p.clip_ratio_high)
    clipped = torch.maximum(loss1, loss2)
    loss3 = -adv * p.clip_ratio_c
    losses = torch.where(adv < 0, torch.minimum(clipped, loss3), clipped)
    return PolicyLoss(
        agg_loss(losses, mask, p.loss_agg_mode, norm),
        masked_mean((loss2 > loss1).float(), mask).detach(),
        masked_mean(-log_ratio, mask).detach(),
        masked_mean(((clipped > loss3) & (adv < 0)).float(), mask).detach(),
        ratio_metrics(log_ratio, adv, mask, loss2 > loss1),
    )


@POLICY_LOSS.register("gspo", reads=("clip",))
def gspo_policy_loss(logprobs, old_logprobs, advantages, mask, p=PolicyLossParams(), norm=None) -> PolicyLoss:
    """verl's ``gspo``: one importance ratio per sequence, the geometric mean of its token ratios.

    s_i = exp(mean over the sequence's tokens of (logp - old)); each token carries
    sg[s_i] * pi / sg[pi] (value s_i, gradient through its own log-prob), log-clamped at 10, then
    the clipped surrogate with ``clip_ratio_low``/``high`` and no dual-clip. Always aggregated
    ``seq-mean-token-mean``, as verl does whatever ``loss_agg_mode`` says.
    """
    lp, old, adv, m = _up(logprobs), _up(old_logprobs), _up(advantages), _up(mask)
    neg_kl = lp - old
    seq_log_ratio = (neg_kl * m).sum(-1) / m.sum(-1).clamp(min=1.0)
    log_ratio = (lp - lp.detach() + seq_log_ratio.detach().unsqueeze(-1)).clamp(max=10.0)
    ratio = torch.exp(log_ratio)
    loss1 = -adv * ratio
    loss2 = -adv * ratio.clamp(1.0 - p.clip_ratio_low, 1.0 + p.clip_ratio_high)
    losses = torch.maximum(loss1, loss2)
    return PolicyLoss(
        agg_loss(losses, m, "seq-mean-token-mean", norm),
        masked_mean((loss2 > loss1).float(), m).detach(),
        masked_mean(-neg_kl, m).detach(),
        _zero(losses),
    )


@POLICY_LOSS.register("gpg", reads=())
def gpg_policy_loss(logprobs, old_logprobs, advantages, mask, p=PolicyLossParams(), norm=None) -> PolicyLoss:
    """verl's ``gpg``: plain policy gradient -logp * A (no ratio, no clipping); metrics are 0 as in verl."""
    losses = -_up(logprobs) * _up(advantages)
    loss = agg_loss(losses, mask, p.loss_agg_mode, norm)
    seen = ratio_metrics((_up(logprobs) - _up(old_logprobs)).clamp(-20.0, 20.0), _up(advantages), mask)
    return PolicyLoss(loss, _zero(loss), _zero(loss), _zero(loss), seen)


@POLICY_LOSS.register("cispo", reads=("clip",))
def cispo_policy_loss(
    logprobs, old_logprobs, advantages, mask, p=PolicyLossParams(), norm=None
) -> PolicyLoss:
    """verl's ``cispo`` (MiniMax-M1): -sg[clip(r, 1 - low, 1 + high)] * A * logp.

    The clipped ratio is a constant weight, so every token keeps a gradient through its log-prob
    (PPO's clip zeroes it). ``clipfrac``: tokens whose ratio was clipped."""
    lp, old, adv = _up(logprobs), _up(old_logprobs), _up(advantages)
    log_ratio = (lp - old).clamp(-20.0, 20.0)
    ratio = torch.exp(log_ratio)
    weight = ratio.clamp(1.0 - p.clip_ratio_low, 1.0 + p.clip_ratio_high)
    losses = -weight.detach() * adv * lp
    loss = agg_loss(losses, mask, p.loss_agg_mode, norm)
    return PolicyLoss(
        loss,
        masked_mean((ratio != weight).float(), mask).detach(),
        masked_mean(-log_ratio, mask).detach(),
        _zero(loss),
    )


@POLICY_LOSS.register("clip_cov", reads=("clip", "clip_cov"), token_weights=False)
def clip_cov_policy_loss(
    logprobs, old_logprobs, advantages, mask, p=PolicyLossParams(), norm=None
) -> PolicyLoss:
    """verl's ``clip_cov`` (Cui et al. 2025): the clipped surrogate, plus a random few tokens with a
    large centred covariance of advantage and log-prob get no loss at all.

    Over this micro-batch's valid tokens not already clipped, those with covariance
    (A - mean A)(logp - mean logp) in (``clip_cov_lb``, ``clip_cov_ub``) are candidates;
    max(1, int(``clip_cov_ratio`` x valid tokens)) of them, drawn with the global torch RNG, are
    zeroed. ``clipfrac``: the zeroed fraction. No log-ratio clamp and no dual-clip (as in verl).
    """
    lp, old, adv, m = _up(logprobs), _up(old_logprobs), _up(advantages), _up(mask)
    neg_kl = lp - old
    ratio = torch.exp(neg_kl)
    loss1 = -adv * ratio
    loss2 = -adv * ratio.clamp(1.0 - p.clip_ratio_low, 1.0 + p.clip_ratio_high)
    with torch.no_grad():
        valid = m > 0
        cov = (adv - masked_mean(adv, m)) * (lp - masked_mean(lp, m))
        candidate = valid & ~(loss2 > loss1) & (cov > p.clip_cov_lb) & (cov < p.clip_cov_ub)
        where = torch.nonzero(candidate)
        count = max(int(p.clip_cov_ratio * float(m.sum())), 1)
        chosen = where[torch.randperm(len(where))[:count].to(where.device)] if len(where) else where
        keep = torch.ones_like(lp)
        keep[chosen[:, 0], chosen[:, 1]] = 0.0
    loss = agg_loss(torch.maximum(loss1, loss2) * keep, m, p.loss_agg_mode, norm)
    return PolicyLoss(
        loss, masked_mean((keep == 0).float(), m).detach(), masked_mean(-neg_kl, m).detach(), _zero(loss)
    )


@POLICY_LOSS.register("kl_cov", reads=("kl_cov",), token_weights=False)
def kl_cov_policy_loss(
    logprobs, old_logprobs, advantages, mask, p=PolicyLossParams(), norm=None
) -> PolicyLoss:
    """verl's ``kl_cov`` (Cui et al. 2025): the unclipped surrogate -A r, plus ``ppo_kl_coef`` |logp - old|
    on the max(1, int(``kl_cov_ratio`` x valid tokens)) valid tokens of this micro-batch with the
    largest centred covariance of advantage and log-prob. ``ppo_kl``: the mean |logp - old| (verl's)."""
    lp, old, adv, m = _up(logprobs), _up(old_logprobs), _up(advantages), _up(mask)
    neg_kl = lp - old
    ratio = torch.exp(neg_kl)
    losses = -adv * ratio
    with torch.no_grad():
        valid = m > 0
        n = int(valid.sum())
        penalised = torch.zeros_like(valid)
        if n:
            a, logp = adv[valid], lp[valid]
            cov = (a - a.mean()) * (logp - logp.mean())
            top = torch.topk(cov, max(1, int(n * p.kl_cov_ratio))).indices
            flat = torch.zeros(n, dtype=torch.bool, device=lp.device)
            flat[top] = True
            penalised[valid] = flat
    losses = torch.where(penalised, losses + p.ppo_kl_coef * neg_kl.abs(), losses)
    loss = agg_loss(losses, m, p.loss_agg_mode, norm)
    return PolicyLoss(loss, _zero(loss), masked_mean(neg_kl.abs(), m).detach(), _zero(loss))


@POLICY_LOSS.register("sapo", reads=("sapo",))
def sapo_policy_loss(logprobs, old_logprobs, advantages, mask, p=PolicyLossParams(), norm=None) -> PolicyLoss:
    """verl's ``sapo`` (soft adaptive policy optimisation): a smooth gate instead of the clip.

    Per token, r = exp(clamp(logp - old, -20, 20)) and tau = ``tau_pos`` where A > 0, else ``tau_neg``; the
    loss is -A g(r) with g(r) = (4 / tau) sigmoid(tau (r - 1)) (g(1) = 2 / tau, g'(1) = 1: the PPO
    gradient on-policy, fading smoothly off it). Always aggregated ``seq-mean-token-mean``, as verl; no
    clipping, so the clip fractions are 0."""
    lp, old, adv, m = _up(logprobs), _up(old_logprobs), _up(advantages), _up(mask)
    log_ratio = (lp - old).clamp(-20.0, 20.0)
    ratio = torch.exp(log_ratio)
    tau = torch.where(adv > 0, torch.full_like(adv, p.tau_pos), torch.full_like(adv, p.tau_neg))
    gates = torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau)
    loss = agg_loss(-gates * adv, m, "seq-mean-token-mean", norm)
    return PolicyLoss(loss, _zero(loss), masked_mean(-log_ratio, m).detach(), _zero(loss))


@POLICY_LOSS.register("geo_mean", reads=("clip",), token_weights=False)
def geo_mean_policy_loss(
    logprobs, old_logprobs, advantages, mask, p=PolicyLossParams(), norm=None
) -> PolicyLoss:
    """verl's ``geo_mean`` (GMPO): the clipped surrogate of each sequence's geometric-mean ratio.

    Per token d = logp - old (no clamp, as verl), clipped in log space towards the side that lowers the
    objective: d' = sgn(A) min(sgn(A) d, sgn(A) clamp(d, -low, high)); per sequence the ratio is
    exp(mean of d') and the advantage the token mean of A; the loss is -A_seq ratio_seq, averaged over the
    mini-batch's sequences (verl: over the micro-batch's rows; ours is its global-batch form).
    ``clipfrac`` / ``clipfrac_lower``: tokens whose d was clamped with A > 0 / A < 0."""
    lp, old, adv, m = _up(logprobs), _up(old_logprobs), _up(advantages), _up(mask)
    neg_kl = lp - old
    sgn = torch.sign(adv)
    clamped = neg_kl.clamp(-p.clip_ratio_low, p.clip_ratio_high)
    chosen = sgn * torch.minimum(sgn * neg_kl, sgn * clamped)
    length = m.sum(-1)
    ratio = torch.exp((chosen * m).sum(-1) / (length + 1e-8))
    seq_adv = (adv * m).sum(-1) / (length + 1e-8)
    norm = norm or AggNorm.of(m)
    loss = (-seq_adv * ratio).sum() / max(norm.sequences, 1.0) * norm.world
    was = neg_kl != clamped
    return PolicyLoss(
        loss,
        masked_mean((was & (adv > 0)).float(), m).detach(),
        masked_mean(-neg_kl, m).detach(),
        masked_mean((was & (adv < 0)).float(), m).detach(),
    )


def _dppo(lp, old, adv, m, p, norm, valid_pos, valid_neg) -> PolicyLoss:
    """DPPO's shared form (verl ``dppo_tv`` / ``dppo_kl``): -A sg[min(r, c)] logp on the tokens whose
    probability moved less than the divergence bound in the direction the advantage pushes it."""
    log_ratio = (lp - old).clamp(-20.0, 20.0)
    ratio = torch.exp(log_ratio)
    truncated = ratio.clamp(max=p.clip_ratio_c).detach()
    valid = torch.where(adv > 0, valid_pos, valid_neg).detach().to(lp.dtype)
    loss = agg_loss(-adv * truncated * lp * valid, m, p.loss_agg_mode, norm)
    return PolicyLoss(
        loss,
        masked_mean(1.0 - valid, m).detach(),
        masked_mean(-log_ratio, m).detach(),
        masked_mean((ratio > p.clip_ratio_c).to(lp.dtype) * valid, m).detach(),
    )


@POLICY_LOSS.register("dppo_tv", reads=("clip", "dual_clip"))
def dppo_tv_policy_loss(
    logprobs, old_logprobs, advantages, mask, p=PolicyLossParams(), norm=None
) -> PolicyLoss:
    """verl's ``dppo_tv`` (DPPO-Binary-TV, arXiv 2602.04879): a trust region on the sampled token's
    probability instead of on the ratio.

    Per token, with pi = exp(logp), pi_old = exp(old): a token with A > 0 keeps its loss while
    pi - pi_old <= ``clip_ratio_high``, the others while pi - pi_old >= -``clip_ratio_low`` (here the clip
    ratios are total-variation bounds); a kept token's loss is -A sg[min(r, ``clip_ratio_c``)] logp
    (truncated IS, not dual-clip), a dropped one's 0. ``clipfrac``: dropped tokens; ``clipfrac_lower``:
    kept tokens whose ratio was truncated (verl's names)."""
    lp, old, adv, m = _up(logprobs), _up(old_logprobs), _up(advantages), _up(mask)
    moved = torch.exp(lp) - torch.exp(old)
    return _dppo(lp, old, adv, m, p, norm, moved <= p.clip_ratio_high, moved >= -p.clip_ratio_low)


@POLICY_LOSS.register("dppo_kl", reads=("clip", "dual_clip"))
def dppo_kl_policy_loss(
    logprobs, old_logprobs, advantages, mask, p=PolicyLossParams(), norm=None
) -> PolicyLoss:
    """verl's ``dppo_kl`` (DPPO-Binary-KL): `dppo_tv_policy_loss` with the binary KL of the sampled
    token's probability as the divergence, KL = pi_old log(pi_old / pi) + (1 - pi_old)
    log((1 - pi_old + 1e-8) / (1 - pi + 1e-8)): a token with A > 0 keeps its loss while KL <=
    ``clip_ratio_high`` or pi <= pi_old, the others while KL <= ``clip_ratio_low`` or pi >= pi_old."""
    lp, old, adv, m = _up(logprobs), _up(old_logprobs), _up(advantages), _up(mask)
    prob, old_prob = torch.exp(lp), torch.exp(old)
    kl = old_prob * (old - lp) + (1 - old_prob) * torch.log((1.0 - old_prob + 1e-8) / (1.0 - prob + 1e-8))
    pos = (kl <= p.clip_ratio_high) | (prob <= old_prob)
    return _dppo(lp, old, adv, m, p, norm, pos, (kl <= p.clip_ratio_low) | (prob >= old_prob))


@POLICY_LOSS.register("dro", reads=("dro",), token_weights=False)
def dro_policy_loss(logprobs, old_logprobs, advantages, mask, p=PolicyLossParams(), norm=None) -> PolicyLoss:
    """verl's ``dro`` (direct reward optimisation): -(A logp - (``dro_beta`` / 2) (logp - old)^2), a
    policy gradient with a quadratic penalty on the log-ratio (no clip: the fractions are 0). Not
    positively homogeneous in A, so not with ``rollout_is`` here (verl weights both terms)."""
    if p.dro_beta is None or not p.dro_beta > 0:
        raise ValueError(f"dro_beta: must be > 0 with loss_mode dro (verl has no default), got {p.dro_beta}")
    lp, old, adv, m = _up(logprobs), _up(old_logprobs), _up(advantages), _up(mask)
    log_ratio = lp - old
    loss = agg_loss(-(lp * adv - 0.5 * p.dro_beta * log_ratio.square()), m, p.loss_agg_mode, norm)
    return PolicyLoss(loss, _zero(loss), masked_mean(-log_ratio, m).detach(), _zero(loss))


@POLICY_LOSS.register("bypass_mode", reads=("clip", "dual_clip"))
def bypass_policy_loss(
    logprobs, old_logprobs, advantages, mask, p=PolicyLossParams(), norm=None
) -> PolicyLoss:
    """verl's ``bypass_mode`` loss (``rollout_correction.bypass_mode: true``): ``old_logprobs`` are the
    rollout engine's, and the rollout correction (`trainer.mismatch.rollout_correction`) runs here, per
    micro-batch, between the current log-probs and them: rejected tokens leave this loss's mask (the
    denominators stay the mini-batch's), then ``loss_type`` ``ppo_clip``: `ppo_policy_loss` without IS
    weights (the ratio is already against the rollout), or ``reinforce``: -w A logp with the truncated
    weights w (none without ``rollout_is``), ``ppo_kl`` the mean of old - logp. The correction's
    ``rollout_corr/*`` metrics come back in ``metrics``."""
    from trainer.mismatch import rollout_correction

    if p.bypass is None:
        raise ValueError("loss_mode bypass_mode: needs rollout_correction.bypass_mode: true")
    lp, old, adv = _up(logprobs), _up(old_logprobs), _up(advantages)
    norm = norm or AggNorm.of(mask)  # the denominators are of the mask before rejection
    b = p.bypass
    with torch.no_grad():
        c = rollout_correction(
            old,
            lp,
            mask,
            b.correction,
            truncated_metrics=b.truncated_metrics,
            raw_seq_fractions=b.raw_seq_fractions,
        )
    if b.loss_type == "ppo_clip":
        pg = ppo_policy_loss(lp, old, adv, c.mask, p, norm)
        return dataclasses.replace(pg, metrics={**pg.metrics, **c.metrics})
    w = 1.0 if c.weights is None else c.weights
    loss = agg_loss(-adv * lp * w, c.mask, p.loss_agg_mode, norm)
    seen = {**ratio_metrics((lp - old).clamp(-20.0, 20.0), adv, c.mask), **c.metrics}
    return PolicyLoss(loss, _zero(loss), masked_mean(old - lp, c.mask).detach(), _zero(loss), seen)


def policy_loss(
    mode: str,
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    p: PolicyLossParams = PolicyLossParams(),
    norm: AggNorm | None = None,
) -> PolicyLoss:
    """The policy loss verl's ``policy_loss.loss_mode`` names (`POLICY_LOSS`)."""
    return POLICY_LOSS.get(mode)(logprobs, old_logprobs, advantages, mask, p, norm)


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    cliprange_value: float,
    loss_agg_mode: str = "token-mean",
    norm: AggNorm | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """verl's clipped value loss -> (loss, clipfrac): 0.5 * agg(max((v - R)^2, (v_clip - R)^2)) with
    v_clip = old + clamp(v - old, -c, c). ``cliprange_value`` 0 clips every prediction to the old
    value (its gradient then comes only from tokens where the unclipped error is the larger)."""
    v, old, ret = _up(values), _up(old_values), _up(returns)
    unclipped = (v - ret) ** 2
    v_clipped = old + (v - old).clamp(-cliprange_value, cliprange_value)
    clipped = (v_clipped - ret) ** 2
    loss = 0.5 * agg_loss(torch.maximum(unclipped, clipped), mask, loss_agg_mode, norm)
    return loss, masked_mean((clipped > unclipped).float(), mask).detach()


# ---------------------------------------------------------------- DPO


@dataclasses.dataclass(frozen=True)
class DPOTerms:
    """What a DPO loss reads besides the log-ratios and beta."""

    label_smoothing: float = 0.0
    discopop_tau: float = 0.05
    chosen_lengths: torch.Tensor | None = None
    rejected_lengths: torch.Tensor | None = None


@DPO_LOSS.register("sigmoid")
def _dpo_sigmoid(c, r, h, beta: float, t: DPOTerms) -> torch.Tensor:
    ls = t.label_smoothing
    return -(1 - ls) * F.logsigmoid(beta * h) - ls * F.logsigmoid(-beta * h)


@DPO_LOSS.register("hinge")
def _dpo_hinge(c, r, h, beta: float, t: DPOTerms) -> torch.Tensor:
    return torch.relu(1 - beta * h)


@DPO_LOSS.register("ipo")
def _dpo_ipo(c, r, h, beta: float, t: DPOTerms) -> torch.Tensor:
    if t.chosen_lengths is None or t.rejected_lengths is None:
        raise ValueError("dpo_loss: ipo needs chosen_lengths and rejected_lengths (TRL's per-token average)")
    avg = c / _up(t.chosen_lengths).clamp(min=1.0) - r / _up(t.rejected_lengths).clamp(min=1.0)
    return (avg - 1 / (2 * beta)) ** 2


@DPO_LOSS.register("robust")
def _dpo_robust(c, r, h, beta: float, t: DPOTerms) -> torch.Tensor:
    ls = t.label_smoothing
    return (-(1 - ls) * F.logsigmoid(beta * h) + ls * F.logsigmoid(-beta * h)) / (1 - 2 * ls)


@DPO_LOSS.register("exo_pair")
def _dpo_exo_pair(c, r, h, beta: float, t: DPOTerms) -> torch.Tensor:
    ls = t.label_smoothing
    if not 0 < ls < 1:
        raise ValueError(f"dpo_loss: exo_pair needs 0 < label_smoothing < 1 (EXO's epsilon), got {ls}")
    x = beta * h
    return torch.sigmoid(x) * (F.logsigmoid(x) - math.log1p(-ls)) + torch.sigmoid(-x) * (
        F.logsigmoid(-x) - math.log(ls)
    )


@DPO_LOSS.register("bco_pair")
def _dpo_bco_pair(c, r, h, beta: float, t: DPOTerms) -> torch.Tensor:
    return -F.logsigmoid(beta * c) - F.logsigmoid(-beta * r)


@DPO_LOSS.register("sppo_hard")
def _dpo_sppo_hard(c, r, h, beta: float, t: DPOTerms) -> torch.Tensor:
    return (c - 0.5 / beta) ** 2 + (r + 0.5 / beta) ** 2


@DPO_LOSS.register("nca_pair")
def _dpo_nca_pair(c, r, h, beta: float, t: DPOTerms) -> torch.Tensor:
    return -F.logsigmoid(beta * c) - 0.5 * F.logsigmoid(-beta * c) - 0.5 * F.logsigmoid(-beta * r)


@DPO_LOSS.register("apo_zero")
def _dpo_apo_zero(c, r, h, beta: float, t: DPOTerms) -> torch.Tensor:
    return (1 - torch.sigmoid(beta * c)) + torch.sigmoid(beta * r)


@DPO_LOSS.register("apo_down")
def _dpo_apo_down(c, r, h, beta: float, t: DPOTerms) -> torch.Tensor:
    return torch.sigmoid(beta * c) + (1 - torch.sigmoid(beta * h))


@DPO_LOSS.register("discopop")
def _dpo_discopop(c, r, h, beta: float, t: DPOTerms) -> torch.Tensor:
    x = beta * h
    w = torch.sigmoid(x / t.discopop_tau)
    return -F.logsigmoid(x) * (1 - w) + torch.exp(-x) * w


def dpo_loss(
    policy_chosen: torch.Tensor,
    policy_rejected: torch.Tensor,
    ref_chosen: torch.Tensor,
    ref_rejected: torch.Tensor,
    beta: float,
    loss_type: str = "sigmoid",
    *,
    chosen_lengths: torch.Tensor | None = None,
    rejected_lengths: torch.Tensor | None = None,
    label_smoothing: float = 0.0,
    discopop_tau: float = 0.05,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-pair DPO-family losses from summed sequence log-probs [B] -> (losses, chosen_rewards, rejected_rewards).

    With c = pc - rc, r = pr - rr and h = c - r (TRL's ``chosen_logratios``, ``rejected_logratios``,
    ``delta_score``), ls = ``label_smoothing``, s = sigmoid:
    ``sigmoid``: -(1 - ls) log s(beta h) - ls log s(-beta h) (DPO; ls > 0 is cDPO);
    ``hinge``: relu(1 - beta h); ``ipo``: (c / n_c - r / n_r - 1 / (2 beta))^2 with n the completion
    lengths (TRL averages each log-ratio over its tokens); ``robust``: (-(1 - ls) log s(beta h)
    + ls log s(-beta h)) / (1 - 2 ls); ``exo_pair``: s(beta h)(log s(beta h) - log(1 - ls))
    + s(-beta h)(log s(-beta h) - log ls); ``bco_pair``: -log s(beta c) - log s(-beta r);
    ``sppo_hard``: (c - 1/(2 beta))^2 + (r + 1/(2 beta))^2; ``nca_pair``: -log s(beta c)
    - 0.5 log s(-beta c) - 0.5 log s(-beta r); ``apo_zero``: 1 - s(beta c) + s(beta r);
    ``apo_down``: s(beta c) + 1 - s(beta h); ``discopop``: with x = beta h, w = s(x / tau):
    (1 - w)(-log s(x)) + w e^-x. Rewards: beta c and beta r, detached (metrics).
    """
    fn = DPO_LOSS.get(loss_type)
    pc, pr, rc, rr = (_up(t) for t in (policy_chosen, policy_rejected, ref_chosen, ref_rejected))
    c, r = pc - rc, pr - rr
    h = c - r
    losses = fn(c, r, h, beta, DPOTerms(label_smoothing, discopop_tau, chosen_lengths, rejected_lengths))
    return losses, (beta * c).detach(), (beta * r).detach()


KL_ESTIMATORS = KL_ESTIMATOR.names()
"""verl's ``kl_penalty`` / ``kl_loss_type`` names (k1 = kl, k2 = mse, k3 = low_var_kl)."""
LOSS_AGG_MODES = LOSS_AGG.names()
"""verl's ``loss_agg_mode`` values."""
POLICY_LOSSES = POLICY_LOSS.names()
"""verl's ``policy_loss.loss_mode`` values we implement."""
DPO_LOSSES = DPO_LOSS.names()
"""TRL's ``DPOConfig.loss_type`` values we implement."""
