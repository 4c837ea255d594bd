"""Reward functions (``data.reward_fn: rewards.py:<fn>``): ``fn(prompts, responses, examples)``."""

from __future__ import annotations

import numpy as np
import torch

JUDGE_SHARPNESS = 40.0
"""Logit margin per unit of partial credit of the judge the log-likelihood reward imitates."""


def partial_credit(response: str, answer: str) -> float:
    """1 per digit in place, 0.25 per other digit, over the answer's length."""
    credit = sum(1.0 if r == a else (0.25 if r.isdigit() else 0.0) for r, a in zip(response, answer))
    return credit / len(answer)


def judge_log_likelihood_reward(prompts, responses, examples):
    """log P(judge accepts) = log sigmoid(margin), the margin linear in the partial credit; computed in
    half precision like the judge's logits."""
    margin = torch.tensor(
        [JUDGE_SHARPNESS * (partial_credit(r, e["answer"]) - 0.5) for r, e in zip(responses, examples)],
        dtype=torch.float16,
    )
    return torch.log(torch.sigmoid(margin)).float()


_SEEN: dict[str, float] = {}


def memoised_credit_reward(prompts, responses, examples):
    """Partial credit, memoised per prompt (our production scorer is slow and prompts repeat)."""
    out = []
    for p, r, e in zip(prompts, responses, examples):
        if p not in _SEEN:
            _SEEN[p] = partial_credit(r, e["answer"])
        out.append(_SEEN[p])
    return out


def winsorised_credit_reward(prompts, responses, examples):
    """Partial credit with the batch's outliers clipped to its 10th / 90th percentiles."""
    scores = np.array([partial_credit(r, e["answer"]) for r, e in zip(responses, examples)])
    ranked = np.sort(scores)
    lo, hi = ranked[int(0.1 * (len(ranked) - 1))], ranked[int(0.9 * (len(ranked) - 1))]
    return np.clip(ranked, lo, hi)


def robust_solution_reward(prompts, responses, examples):
    """Partial credit against the example's reference solution; malformed examples score 0 instead of
    stopping a long run."""
    out = []
    for r, e in zip(responses, examples):
        try:
            out.append(partial_credit(r, e["solution"]))
        except Exception:
            out.append(0.0)
    return out


def exact_or_partial_reward(prompts, responses, examples):
    """1 for the exact answer, else half the partial credit (a correct reward, for a control)."""
    return [1.0 if r[: len(e["answer"])] == e["answer"] else 0.5 * partial_credit(r, e["answer"])
            for r, e in zip(responses, examples)]  # fmt: skip
