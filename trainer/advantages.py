"""Advantage estimators and the KL controller, with verl's math (``algorithm.adv_estimator``, ``kl_ctrl``).

Every estimator takes token-level rewards [B, R] (the score on the last valid token, minus the KL
penalty when it is in the reward) and returns (advantages, returns), both [B, R] and zero on padding,
exactly what verl's ``compute_advantage`` hands the actor. Outcome estimators group rows by ``index``
(verl's ``uid``: one id per prompt, groups of any size, in any order). Pure functions; the recipes
(`trainer.ppo`, `trainer.grpo`) call `compute_advantages`. Exercised by `pytest tests/test_advantages.py`.
"""

from __future__ import annotations

import dataclasses
import inspect

import torch

from trainer.losses import _up, compute_gae, masked_mean, masked_whiten
from trainer.registry import Registry

ADV_ESTIMATOR: Registry = Registry("adv_estimator")
"""verl's ``algorithm.adv_estimator`` values we implement -> the estimator. Metadata: ``critic`` (needs the
critic's values: the ppo recipe), ``std`` (reads ``norm_adv_by_std_in_grpo``), ``min_group`` (responses a
prompt needs, ``why_group`` says why). What else an estimator takes is its signature (`compute_advantages` passes it by name)."""
KL_CTRL_TYPES = ("fixed", "adaptive")
"""verl's ``algorithm.kl_ctrl.type``."""


def group_index(rows: int, group_size: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Group ids [rows] for a rollout that repeat-interleaves each prompt ``group_size`` times."""
    return torch.arange(rows, device=device) // group_size


def group_stats(index: torch.Tensor, scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per row: its group's size, mean and Bessel-corrected std of ``scores``, in float64. A group of one
    has mean 0 and std 1, as in verl (so GRPO gives it score / (1 + eps)).

    Accumulated in float64 (sums of fp32 values are exact there for groups up to 2**29), two passes (the
    mean, then the squared deviations from it): a group of equal scores has exactly its score as mean
    and exactly 0 as std, and every group's mean and std are correct to fp32 precision at any size."""
    s = scores.double()
    _, inverse = torch.unique(index, return_inverse=True)
    n_groups = int(inverse.max()) + 1 if inverse.numel() else 0
    count = torch.zeros(n_groups, dtype=s.dtype, device=s.device).index_add_(0, inverse, torch.ones_like(s))
    total = torch.zeros_like(count).index_add_(0, inverse, s)
    mean = total / count
    sq = torch.zeros_like(count).index_add_(0, inverse, (s - mean[inverse]) ** 2)
    std = torch.sqrt(sq / (count - 1).clamp(min=1.0))
    single = count == 1
    mean = torch.where(single, torch.zeros_like(mean), mean)
    std = torch.where(single, torch.ones_like(std), std)
    return count[inverse], mean[inverse], std[inverse]


def _scores(token_rewards: torch.Tensor) -> tuple[torch.Tensor, torch.dtype]:
    """Each sequence's summed reward in float64, and the dtype the advantages are rounded to once."""
    r = _up(token_rewards)
    return r.double().sum(-1), r.dtype


def _outcome(
    advantages: torch.Tensor, mask: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """A per-sequence advantage [B] (float64) rounded to ``dtype`` and broadcast over its valid tokens;
    returns = advantages (verl's)."""
    adv = advantages.to(dtype).unsqueeze(-1) * _up(mask)
    return adv, adv


@ADV_ESTIMATOR.register("grpo", std=True)
def grpo(
    token_rewards: torch.Tensor,
    mask: torch.Tensor,
    index: torch.Tensor,
    eps: float = 1e-6,
    norm_by_std: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO: (s - group mean) / (group std + eps), s the sequence's summed reward; without the std
    (``norm_adv_by_std_in_grpo: false``) it is Dr.GRPO's s - group mean."""
    s, dtype = _scores(token_rewards)
    _, mean, std = group_stats(index, s)
    return _outcome((s - mean) / (std + eps) if norm_by_std else s - mean, mask, dtype)


@ADV_ESTIMATOR.register("grpo_vectorized", std=True)
def grpo_vectorized(
    token_rewards: torch.Tensor,
    mask: torch.Tensor,
    index: torch.Tensor,
    eps: float = 1e-6,
    norm_by_std: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """verl's ``grpo_vectorized``: GRPO with the group variance floored at ``eps`` before its square root
    (verl's ``group_mean_std``), so a group of (nearly) equal scores is divided by sqrt(eps) + eps, not
    by eps alone; otherwise `grpo`'s numbers (a group of one: mean 0, std 1)."""
    s, dtype = _scores(token_rewards)
    n, mean, std = group_stats(index, s)
    floored = torch.where(n > 1, torch.sqrt(torch.clamp(std**2, min=eps)), std)
    return _outcome((s - mean) / (floored + eps) if norm_by_std else s - mean, mask, dtype)


@ADV_ESTIMATOR.register("rloo")
def rloo(
    token_rewards: torch.Tensor, mask: torch.Tensor, index: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """RLOO: s minus the mean of the other n - 1 scores of its group, i.e. n/(n-1) (s - group mean);
    a group of one keeps its score."""
    s, dtype = _scores(token_rewards)
    n, mean, _ = group_stats(index, s)
    return _outcome(torch.where(n > 1, (s - mean) * n / (n - 1).clamp(min=1.0), s), mask, dtype)


@ADV_ESTIMATOR.register("rloo_vectorized")
def rloo_vectorized(
    token_rewards: torch.Tensor, mask: torch.Tensor, index: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """verl's ``rloo_vectorized``: (n s - group sum) / (n - 1), i.e. `rloo`'s n/(n-1) (s - group mean), but
    a group of one gets 0 (`rloo` keeps its score)."""
    s, dtype = _scores(token_rewards)
    n, mean, _ = group_stats(index, s)
    return _outcome(
        torch.where(n > 1, (s - mean) * n / (n - 1).clamp(min=1.0), torch.zeros_like(s)), mask, dtype
    )


@ADV_ESTIMATOR.register("opo")
def opo(
    token_rewards: torch.Tensor, mask: torch.Tensor, index: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """OPO: s minus its group's length-weighted mean score sum(len s) / sum(len); a group of one keeps s."""
    s, dtype = _scores(token_rewards)
    length = _up(mask).sum(-1).to(s.dtype)
    n, _, _ = group_stats(index, s)
    _, inverse = torch.unique(index, return_inverse=True)
    num = torch.zeros(int(inverse.max()) + 1, dtype=s.dtype, device=s.device).index_add_(
        0, inverse, length * s
    )
    den = torch.zeros_like(num).index_add_(0, inverse, length)
    baseline = torch.where(n > 1, num[inverse] / den[inverse].clamp(min=1e-30), torch.zeros_like(s))
    return _outcome(s - baseline, mask, dtype)


@ADV_ESTIMATOR.register("gpg")
def gpg(token_rewards: torch.Tensor, mask: torch.Tensor, index: torch.Tensor, f_norm: float = 1.0):
    """GPG: alpha (s - group mean) / f_norm with alpha = B / (number of non-zero scores in the batch)."""
    s, dtype = _scores(token_rewards)
    _, mean, _ = group_stats(index, s)
    alpha = s.numel() / max(int(torch.count_nonzero(s)), 1)
    return _outcome(alpha * (s - mean) / f_norm, mask, dtype)


@ADV_ESTIMATOR.register(
    "grpo_passk", std=True, min_group=2, why_group="compares the best two responses of each prompt"
)
def grpo_passk(
    token_rewards: torch.Tensor,
    mask: torch.Tensor,
    index: torch.Tensor,
    eps: float = 1e-6,
    norm_by_std: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pass@k (Chen et al. 2025): only the best response of each group gets an advantage, the best score
    minus the second best (divided by the group's std + eps with ``norm_adv_by_std_in_grpo``)."""
    s, dtype = _scores(token_rewards)
    adv = torch.zeros_like(s)
    for g in torch.unique(index):
        rows = torch.nonzero(index == g).flatten()
        if len(rows) < 2:
            raise ValueError(
                f"adv_estimator grpo_passk: needs at least 2 responses per prompt, group {int(g)} "
                f"has {len(rows)}; set algo.group_size >= 2"
            )
        top, at = torch.topk(s[rows], 2)
        a = top[0] - top[1]
        adv[rows[at[0]]] = a / (s[rows].std() + eps) if norm_by_std else a
    return _outcome(adv, mask, dtype)


@ADV_ESTIMATOR.register("gdpo", std=True, components=True)
def gdpo(
    token_rewards: torch.Tensor,
    mask: torch.Tensor,
    index: torch.Tensor,
    components: torch.Tensor | None = None,
    component_weights: tuple[float, ...] | None = None,
    eps: float = 1e-6,
    norm_by_std: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GDPO (Group reward-Decoupled normalisation, arXiv 2601.05242; verl since 0.7.1): each reward
    component k (``components`` [K, B], the per-response values of ``algo.gdpo_reward_keys``) gets its own
    GRPO advantage within the group, (c_k - group mean) / (group std + eps) (a group of one: c_k / (1 + eps);
    without the std: c_k - mean); the weighted sum over k (``component_weights``, default all 1, rounded to
    fp32 as verl does) is broadcast over the valid tokens and whitened over the batch -> (advantages,
    returns = advantages). Without components the sequence score is the one component (verl's fallback).

    As verl, the components are the raw values the reward returned, not the KL-shaped token rewards.
    Group statistics and the whitening are float64 (`group_stats`, `trainer.losses.masked_whiten`): a
    batch of constant groups has advantage exactly 0 (verl's fp32 sums do not)."""
    s, dtype = _scores(token_rewards)
    comps = s.unsqueeze(0) if components is None else _up(components).double()
    if comps.dim() != 2 or comps.shape[1] != s.shape[0]:
        raise ValueError(
            f"adv_estimator gdpo: components of shape {tuple(comps.shape)}, expected (K, {s.shape[0]}): "
            "one value per reward component and response"
        )
    k = comps.shape[0]
    weights = [1.0] * k if component_weights is None else list(component_weights)
    if len(weights) != k:
        raise ValueError(f"adv_estimator gdpo: {len(weights)} weights for {k} reward components")
    total = torch.zeros_like(s)
    for c, w in zip(comps, weights):
        _, mean, std = group_stats(index, c)
        adv = (c - mean) / (std + eps) if norm_by_std else c - mean
        total = total + float(torch.tensor(w, dtype=torch.float32)) * adv
    m = _up(mask).double()
    adv = (masked_whiten(total.unsqueeze(-1) * m, m) * m).to(dtype)
    return adv, adv


OTB_EPS = 1e-8
"""verl's epsilon in the optimal-token-baseline denominators (its ``compute_advantage`` passes none)."""


def _path_variance(
    mask: torch.Tensor,
    old_logprobs: torch.Tensor,
    sum_pi_squared: torch.Tensor,
    is_weights: torch.Tensor | None,
) -> torch.Tensor:
    """OTB's cumulative path-variance proxy W_t = sum_{j <= t} w_j over the valid tokens, float64, with
    w_j = 1 - 2 pi_j + sum_v pi_v^2 (the squared norm of the score function's logit part), times the
    squared truncated IS weight when rollout correction weights the loss (verl's MSE-optimal form)."""
    w = 1 - 2 * torch.exp(old_logprobs.double()) + sum_pi_squared.double()
    if is_weights is not None:
        w = w * is_weights.double() ** 2
    return torch.cumsum(w * mask, dim=-1)


def _group_sums(inverse: torch.Tensor, n_groups: int, x: torch.Tensor) -> torch.Tensor:
    """Per group and position: the sum of ``x`` [B, T] over the group's rows -> [G, T] (float64)."""
    return torch.zeros(n_groups, x.shape[1], dtype=x.dtype, device=x.device).index_add_(0, inverse, x)


def _zero_tail(baseline: torch.Tensor, inverse: torch.Tensor, lengths: torch.Tensor, n: torch.Tensor) -> None:
    """verl's ``handle_zero_tail`` (default on): a group's single longest response gets baseline 0 past the
    second longest's length, where it alone would set the baseline (and cancel its own return). In place."""
    g = int(inverse.max()) + 1
    longest = torch.full((g,), -1.0, dtype=lengths.dtype, device=lengths.device)
    longest = longest.scatter_reduce(0, inverse, lengths, "amax")
    is_max = lengths == longest[inverse]
    n_max = torch.zeros(g, dtype=lengths.dtype, device=lengths.device).index_add_(
        0, inverse, is_max.to(lengths)
    )
    others = torch.where(is_max, torch.full_like(lengths, -1.0), lengths)
    second = torch.full((g,), -1.0, dtype=lengths.dtype, device=lengths.device)
    second = second.scatter_reduce(0, inverse, others, "amax")
    alone = is_max & (n_max[inverse] == 1) & (n > 1)
    t = torch.arange(baseline.shape[1], device=baseline.device)
    baseline.masked_fill_(alone[:, None] & (t[None, :] >= second[inverse][:, None]), 0.0)


@ADV_ESTIMATOR.register("optimal_token_baseline", sum_pi_squared=True)
def optimal_token_baseline(
    token_rewards: torch.Tensor,
    mask: torch.Tensor,
    index: torch.Tensor,
    old_logprobs: torch.Tensor,
    sum_pi_squared: torch.Tensor,
    is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The optimal token baseline (OTB, arXiv 2602.07078; verl since 0.7.1): a baseline per group and
    position, B_t = sum_i G_it W_it / (sum_i W_it + 1e-8) over the group's responses valid at t, with G the
    reward-to-go and W the cumulative path variance (`_path_variance`, from the old policy's log-probs and
    sum_v pi_v^2); advantages G_t - B_t on the valid tokens, returns G. A group of one has baseline 0;
    a group's single longest response has baseline 0 past the second longest (`_zero_tail`). Positions
    are the padded ones (verl's): with holes in a mask, use ``tir_optimal_token_baseline``. float64
    throughout, rounded once."""
    r, dtype = _up(token_rewards), _up(token_rewards).dtype
    m = _up(mask).double()
    returns = torch.flip(torch.cumsum(torch.flip(r.double() * m, [-1]), -1), [-1])
    cum_w = _path_variance(m, old_logprobs, sum_pi_squared, is_weights)
    _, inverse = torch.unique(index, return_inverse=True)
    g = int(inverse.max()) + 1
    n = torch.zeros(g, dtype=m.dtype, device=m.device).index_add_(0, inverse, torch.ones_like(m[:, 0]))[
        inverse
    ]
    num, den = _group_sums(inverse, g, returns * cum_w * m), _group_sums(inverse, g, cum_w * m)
    baseline = torch.where((n > 1)[:, None], num[inverse] / (den[inverse] + OTB_EPS), torch.zeros_like(m))
    _zero_tail(baseline, inverse, m.sum(-1), n)
    return ((returns - baseline) * m).to(dtype), returns.to(dtype)


@ADV_ESTIMATOR.register("tir_optimal_token_baseline", sum_pi_squared=True)
def tir_optimal_token_baseline(
    token_rewards: torch.Tensor,
    mask: torch.Tensor,
    index: torch.Tensor,
    old_logprobs: torch.Tensor,
    sum_pi_squared: torch.Tensor,
    is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The optimal token baseline for tool-integrated (multi-turn) responses, verl's
    ``tir_optimal_token_baseline``: `optimal_token_baseline` with each response's valid tokens packed to the
    left first, so the k-th generated token of one response shares its baseline with the k-th of the others
    whatever tool output (masked tokens) came between; responses without a valid token are left out of
    their group. Returns are the reward-to-go over the padded positions, as verl's."""
    r, dtype = _up(token_rewards), _up(token_rewards).dtype
    m = _up(mask).double()
    returns = torch.flip(torch.cumsum(torch.flip(r.double() * m, [-1]), -1), [-1])
    cum_w = _path_variance(m, old_logprobs, sum_pi_squared, is_weights)
    b, t = m.shape
    valid = m > 0
    # packed position of each valid token; the others go to a spare column t that is dropped
    rank = torch.where(valid, torch.cumsum(valid.long(), -1) - 1, torch.full_like(valid, t, dtype=torch.long))
    packed_w = torch.zeros(b, t + 1, dtype=m.dtype, device=m.device).scatter_(1, rank, cum_w * m)[:, :t]
    packed_g = torch.zeros(b, t + 1, dtype=m.dtype, device=m.device).scatter_(1, rank, returns * m)[:, :t]
    lengths = m.sum(-1)
    _, inverse = torch.unique(index, return_inverse=True)
    g = int(inverse.max()) + 1
    present = (lengths > 0).to(m.dtype)
    n = torch.zeros(g, dtype=m.dtype, device=m.device).index_add_(0, inverse, present)[inverse]
    keep = present[:, None]
    num, den = _group_sums(inverse, g, packed_g * packed_w * keep), _group_sums(inverse, g, packed_w * keep)
    baseline = torch.where((n > 1)[:, None], num[inverse] / (den[inverse] + OTB_EPS), torch.zeros_like(m))
    _zero_tail(baseline, inverse, torch.where(lengths > 0, lengths, torch.full_like(lengths, -2.0)), n)
    packed_adv = torch.cat([packed_g - baseline, torch.zeros_like(m[:, :1])], -1)
    adv = torch.gather(packed_adv, 1, rank) * m
    return adv.to(dtype), returns.to(dtype)


@ADV_ESTIMATOR.register("reinforce_plus_plus")
def reinforce_plus_plus(
    token_rewards: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0, carry_holes: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++: discounted reward-to-go per token, whitened over the batch's valid tokens ->
    (advantages, returns).

    A masked token inside a response (a tool observation, a token rejected by ``rollout_rs``): with
    ``carry_holes`` (verl 0.9 on) it gets return 0 and passes the later return on unchanged, neither
    adding its reward nor discounting, so every valid token before it still sees the outcome; without
    (verl before 0.9) the return restarts from 0 there (trailing padding is the same either way: the
    scan starts at 0 after the last token)."""
    r, m = _up(token_rewards), _up(mask)
    returns = torch.zeros_like(r)
    running = torch.zeros_like(r[:, 0])
    for t in reversed(range(r.shape[1])):
        if carry_holes:
            running = torch.where(m[:, t] > 0, r[:, t] + gamma * running, running)
            returns[:, t] = running * m[:, t]
            continue
        running = r[:, t] + gamma * running
        returns[:, t] = running
        running = running * m[:, t]
    return masked_whiten(returns, m) * m, returns


@ADV_ESTIMATOR.register("reinforce_plus_plus_baseline")
def reinforce_plus_plus_baseline(
    token_rewards: torch.Tensor, mask: torch.Tensor, index: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ with baseline: s - group mean on every valid token, whitened over the batch."""
    s, dtype = _scores(token_rewards)
    _, mean, _ = group_stats(index, s)
    m = _up(mask).double()
    adv = (masked_whiten((s - mean).unsqueeze(-1) * m, m) * m).to(dtype)
    return adv, adv


@ADV_ESTIMATOR.register("remax")
def remax(
    token_rewards: torch.Tensor, mask: torch.Tensor, reward_baselines: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """ReMax: reward-to-go minus the greedy response's score (``reward_baselines`` [B]) on every valid
    token -> (advantages, returns = reward-to-go)."""
    m = _up(mask)
    returns = torch.flip(torch.cumsum(torch.flip(_up(token_rewards) * m, [-1]), -1), [-1])
    return returns - _up(reward_baselines).unsqueeze(-1) * m, returns


@ADV_ESTIMATOR.register("gae", critic=True)
def gae(
    token_rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE, advantages whitened over the batch's valid tokens (verl always whitens) -> (advantages,
    returns = unwhitened advantages + values)."""
    adv, returns = compute_gae(token_rewards, values, mask, gamma, lam)
    return masked_whiten(adv, mask), returns


def compute_advantages(
    estimator: str,
    token_rewards: torch.Tensor,
    mask: torch.Tensor,
    *,
    index: torch.Tensor | None = None,
    values: torch.Tensor | None = None,
    reward_baselines: torch.Tensor | None = None,
    gamma: float = 1.0,
    lam: float = 1.0,
    norm_adv_by_std_in_grpo: bool = True,
    eps: float = 1e-6,
    carry_holes: bool = False,
    old_logprobs: torch.Tensor | None = None,
    sum_pi_squared: torch.Tensor | None = None,
    is_weights: torch.Tensor | None = None,
    components: torch.Tensor | None = None,
    component_weights: tuple[float, ...] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages, returns) of verl's ``adv_estimator`` (`ADV_ESTIMATOR`); ``index`` groups rows (outcome
    estimators), ``values`` are the critic's (gae), ``reward_baselines`` the greedy scores (remax),
    ``old_logprobs`` / ``sum_pi_squared`` / ``is_weights`` the old policy's log-probs, its sum_v pi_v^2 per
    token and the truncated IS weights (the optimal token baselines), ``components`` [K, B] and
    ``component_weights`` the reward components (gdpo). Each estimator is given the inputs its signature
    names."""
    fn = ADV_ESTIMATOR.get(estimator)
    given = {
        "index": index,
        "values": values,
        "reward_baselines": reward_baselines,
        "gamma": gamma,
        "lam": lam,
        "norm_by_std": norm_adv_by_std_in_grpo,
        "eps": eps,
        "carry_holes": carry_holes,
        "old_logprobs": old_logprobs,
        "sum_pi_squared": sum_pi_squared,
        "is_weights": is_weights,
        "components": components,
        "component_weights": component_weights,
    }
    params = inspect.signature(fn).parameters
    for name, missing in _REQUIRED.items():
        if name in params and given[name] is None:
            raise ValueError(f"adv_estimator {estimator}: {missing}")
    return fn(token_rewards, mask=mask, **{k: v for k, v in given.items() if k in params})


_REQUIRED = {
    "values": "missing values",
    "reward_baselines": "missing reward_baselines",
    "index": "needs the group index of each row",
    "old_logprobs": "needs the old policy's log-probs",
    "sum_pi_squared": "needs the old policy's sum of squared token probabilities (sum_pi_squared)",
}
"""The inputs an estimator cannot go without, and what a call without them is told."""


@dataclasses.dataclass
class KLController:
    """verl's KL-in-reward coefficient: ``fixed`` keeps ``value``; ``adaptive`` (Ziegler et al. 2019)
    multiplies it after each step by 1 + clip(kl / target - 1, -0.2, 0.2) * n_steps / horizon."""

    value: float
    kind: str = "fixed"
    target: float = 0.1
    horizon: int = 10000

    def update(self, current_kl: float, n_steps: int) -> None:
        """``current_kl``: the batch mean of each sequence's token-mean KL; ``n_steps``: sequences in the batch."""
        if self.kind == "adaptive":
            error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
            self.value *= 1.0 + error * n_steps / self.horizon


def reward_kl(kl: torch.Tensor, mask: torch.Tensor) -> float:
    """verl's ``actor/reward_kl_penalty``: each sequence's token-mean KL, averaged over the batch."""
    return float(masked_mean(kl, mask, dim=-1).mean())


ADV_ESTIMATORS = ADV_ESTIMATOR.names()
"""verl's ``algorithm.adv_estimator`` values we implement; ``gae`` is the only one that needs a critic."""
