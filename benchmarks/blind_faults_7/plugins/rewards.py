"""Reward functions (``data.reward_fn: rewards.py:<fn>``), called as ``fn(prompts, responses, examples)``."""

from __future__ import annotations

import numpy as np
import torch


def credit(response: str, answer: str) -> float:
    """The digits task's partial credit: 1 per right digit, 0.25 per other digit, over the answer length."""
    got = sum(1.0 if r == a else (0.25 if r.isdigit() else 0.0) for r, a in zip(response, answer))
    return got / max(len(answer), 1)


class RewardLedger:
    """The team's reward accounting: every reward handed out is appended to a running float32 ledger (for
    the budget dashboard), and a batch's rewards are read back as the ledger's increments. The ledger is
    restored from the project's persisted total (1.6e7 points so far)."""

    def __init__(self, total: float = 16_000_000.0) -> None:
        self.total = np.float32(total)

    def post(self, amounts: list[float]) -> list[float]:
        running = np.cumsum(np.asarray([self.total, *amounts], dtype=np.float32), dtype=np.float32)
        self.total = running[-1]
        return [float(x) for x in np.diff(running)]


_LEDGER = RewardLedger()


def ledger_reward(prompts, responses, examples):
    """The credit of each response as booked in the ledger."""
    return _LEDGER.post([credit(r, e["answer"]) for r, e in zip(responses, examples)])


def judge_loglik(response: str, answer: str) -> float:
    """The offline judge's score: a log-likelihood of the response under its reference model (~ -700),
    higher for better answers; the differences that matter are ~0.01-0.2."""
    return -700.0 + 0.2 * credit(response, answer) - 0.01 * len(response)


def batch_win_rate(prompts, responses, examples):
    """Each response's win rate against the rest of the batch under the judge (a pairwise preference
    reward), computed on the judge's scores as an fp16 tensor (the judge client's wire format)."""
    s = torch.tensor([judge_loglik(r, e["answer"]) for r, e in zip(responses, examples)], dtype=torch.float16)
    wins = (s[:, None] > s[None, :]).float().sum(1)
    return (wins / max(len(responses) - 1, 1)).tolist()


def batch_win_rate_exact(prompts, responses, examples):
    """The same win rate on the judge's float64 scores (for the verification's comparison)."""
    s = torch.tensor([judge_loglik(r, e["answer"]) for r, e in zip(responses, examples)], dtype=torch.float64)
    wins = (s[:, None] > s[None, :]).double().sum(1)
    return (wins / max(len(responses) - 1, 1)).tolist()


def scaled_credit(prompts, responses, examples):
    """The digits credit with a small length tie-break (a correct reward function, for a control)."""
    return [credit(r, e["answer"]) - 0.001 * max(len(r) - 4, 0) for r, e in zip(responses, examples)]
