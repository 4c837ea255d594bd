"""PPO, GRPO and DPO math as pure functions over tensors: the fp32 "loss" island.

Every function upcasts its floating inputs to float32 before arithmetic, so a bf16 or fp16 caller
gets the same numbers as an fp32 one up to the rounding of its inputs. Masks may be float or bool.
Shapes: ``B`` sequences, ``R`` response tokens (right-padded; the mask marks valid tokens).
Exercised by `pytest tests/test_losses.py`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _f32(x: torch.Tensor) -> torch.Tensor:
    return x.float()


def masked_sum(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sum of ``values`` where ``mask`` is set (over all elements, or along ``dim``)."""
    v, m = _f32(values), _f32(mask)
    return (v * m).sum() if dim is None else (v * m).sum(dim)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of ``values`` over the set positions of ``mask``; 0 where the mask is empty."""
    m = _f32(mask)
    count = m.sum() if dim is None else m.sum(dim)
    return masked_sum(values, m, dim) / count.clamp(min=1.0)


def masked_var(values: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance over the set positions of ``mask`` (Bessel-corrected unless ``unbiased=False``)."""
    m = _f32(mask)
    mean = masked_mean(values, m)
    var = masked_mean((_f32(values) - mean) ** 2, m)
    if unbiased:
        n = m.sum()
        var = var * n / (n - 1).clamp(min=1.0)
    return var


def masked_whiten(
    values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, eps: float = 1e-8
) -> torch.Tensor:
    """(values - mean) / std over the masked positions; masked-out positions come back as 0."""
    m = _f32(mask)
    mean, var = masked_mean(values, m), masked_var(values, m)
    white = (_f32(values) - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        white = white + mean
    return white * m


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str = "k1") -> torch.Tensor:
    """Per-token KL(actor || reference) estimate from sampled-token log-probs.

    ``k1``: logp - ref (unbiased, can be negative per token). ``k3``: exp(ref - logp) - (ref - logp) - 1
    (unbiased, never negative, lower variance; verl's ``low_var_kl``, clamped there to [-10, 10]: we
    clamp the log-ratio to the same range so one wild token cannot produce inf).
    """
    logr = _f32(ref_logprobs) - _f32(logprobs)
    if estimator == "k1":
        return -logr
    if estimator == "k3":
        logr = logr.clamp(-10.0, 10.0)
        # expm1 keeps precision near 0; the clamp removes rounding below the true minimum 0.
        return (torch.expm1(logr) - logr).clamp(min=0.0)
    raise ValueError(f"algo.kl_estimator: unknown estimator {estimator!r}; expected k1 or k3")


def token_level_rewards(
    scores: torch.Tensor, response_mask: torch.Tensor, kl: torch.Tensor | None, kl_coef: float
) -> torch.Tensor:
    """[B, R] rewards: each sequence's score placed on its last valid token, minus ``kl_coef * kl``
    on every valid token. A sequence with an empty mask gets its score on token 0."""
    m = _f32(response_mask)
    rewards = torch.zeros_like(m)
    last = (m.sum(-1).long() - 1).clamp(min=0)
    rewards[torch.arange(m.shape[0], device=m.device), last] = _f32(scores)
    if kl is not None and kl_coef != 0:
        rewards = rewards - kl_coef * _f32(kl) * m
    return rewards


def compute_gae(
    token_rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over right-padded responses -> (advantages, returns), [B, R].

    Positions after the last valid token contribute no reward and no bootstrap value, so a
    sequence's advantage never leaks from the padding. Returns = advantages + values.
    """
    r, v, m = _f32(token_rewards), _f32(values), _f32(mask)
    v = v * m
    last_gae = torch.zeros(r.shape[0], device=r.device)
    next_value = torch.zeros(r.shape[0], device=r.device)
    adv = torch.zeros_like(r)
    for t in reversed(range(r.shape[1])):
        delta = r[:, t] + gamma * next_value - v[:, t]
        gae = delta + gamma * lam * last_gae
        # Padding keeps the carried state of the token after it (which is zero: padding is on the right).
        last_gae = torch.where(m[:, t] > 0, gae, last_gae)
        next_value = torch.where(m[:, t] > 0, v[:, t], next_value)
        adv[:, t] = gae * m[:, t]
    return adv, (adv + v) * m


def grpo_advantages(scores: torch.Tensor, group_size: int, eps: float = 1e-6) -> torch.Tensor:
    """[B] group-normalised scores: (s - mean of its group) / (std of its group + eps).

    Consecutive ``group_size`` entries form a group (the rollout repeat-interleaves prompts). The std is
    Bessel-corrected like ``torch.std`` (verl's GRPO); a group of 1 has advantage 0.
    """
    s = _f32(scores)
    if s.numel() % group_size != 0:
        raise ValueError(f"algo.group_size: {s.numel()} scores do not split into groups of {group_size}")
    g = s.view(-1, group_size)
    mean = g.mean(-1, keepdim=True)
    std = g.std(-1, keepdim=True) if group_size > 1 else torch.zeros_like(mean)
    return ((g - mean) / (std + eps)).view(-1)


def ppo_policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_ratio: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Clipped surrogate -> (loss, clipfrac, approx_kl), token-mean over the mask.

    Per token: max(-A * ratio, -A * clip(ratio, 1-eps, 1+eps)). clipfrac: fraction of tokens where the
    clipped term was the larger (the gradient is cut); approx_kl: mean of (old - new) log-prob.
    """
    lp, old, adv = _f32(logprobs), _f32(old_logprobs), _f32(advantages)
    log_ratio = (lp - old).clamp(-20.0, 20.0)  # exp(20) is finite in fp32; a wild token cannot make inf
    ratio = torch.exp(log_ratio)
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - clip_ratio, 1.0 + clip_ratio)
    loss = masked_mean(torch.maximum(unclipped, clipped), mask)
    clipfrac = masked_mean((clipped > unclipped).float(), mask)
    approx_kl = masked_mean(-log_ratio, mask)
    return loss, clipfrac.detach(), approx_kl.detach()


def value_loss(
    values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor, clip: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """0.5 * max(unclipped, clipped) squared error, token-mean -> (loss, clipfrac).

    ``clip <= 0`` disables clipping (the loss is the plain squared error, clipfrac 0).
    """
    v, old, ret = _f32(values), _f32(old_values), _f32(returns)
    unclipped = (v - ret) ** 2
    if clip <= 0:
        return 0.5 * masked_mean(unclipped, mask), torch.zeros((), device=v.device)
    v_clipped = old + (v - old).clamp(-clip, clip)
    clipped = (v_clipped - ret) ** 2
    loss = 0.5 * masked_mean(torch.maximum(unclipped, clipped), mask)
    clipfrac = masked_mean((clipped > unclipped).float(), mask)
    return loss, clipfrac.detach()


def entropy_loss(entropy: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Token-mean entropy (the PPO bonus subtracts ``entropy_coef`` times this)."""
    return masked_mean(entropy, mask)


def dpo_loss(
    policy_chosen: torch.Tensor,
    policy_rejected: torch.Tensor,
    ref_chosen: torch.Tensor,
    ref_rejected: torch.Tensor,
    beta: float,
    loss_type: str = "sigmoid",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-pair DPO losses from sequence log-probs [B] -> (losses, chosen_rewards, rejected_rewards).

    With h = (pc - rc) - (pr - rr): ``sigmoid`` loss = -log sigmoid(beta * h);
    ``ipo`` loss = (h - 1 / (2 * beta))^2 (beta is IPO's tau). Implicit rewards are beta * (p - r),
    detached (they are metrics).
    """
    pc, pr, rc, rr = (_f32(t) for t in (policy_chosen, policy_rejected, ref_chosen, ref_rejected))
    h = (pc - rc) - (pr - rr)
    if loss_type == "sigmoid":
        losses = -F.logsigmoid(beta * h)
    elif loss_type == "ipo":
        losses = (h - 1.0 / (2.0 * beta)) ** 2
    else:
        raise ValueError(f"algo.dpo_loss: unknown loss {loss_type!r}; expected sigmoid or ipo")
    return losses, (beta * (pc - rc)).detach(), (beta * (pr - rr)).detach()
