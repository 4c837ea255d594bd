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


@ADV_ESTIMATOR.register("reinforce_plus_plus")
def reinforce_plus_plus(
    token_rewards: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0, carry_holes: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++: discounted reward-to-go per token, whitened over the batch's valid tokens ->
    (advantages, returns).

    A masked token inside a response (a tool observation, a token rejected by ``rollout_rs``): with
    ``carry_holes`` (verl 0.10 on) it gets return 0 and passes the later return on unchanged, neither
    adding its reward nor discounting, so every valid token before it still sees the outcome; without
    (verl before 0.10) the return restarts from 0 there (trailing padding is the same either way: the
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
) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages, returns) of verl's ``adv_estimator`` (`ADV_ESTIMATOR`); ``index`` groups rows (outcome
    estimators), ``values`` are the critic's (gae), ``reward_baselines`` the greedy scores (remax). Each
    estimator is given the inputs its signature names."""
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
