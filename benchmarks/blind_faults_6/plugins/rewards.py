"""Reward functions (``data.reward_fn: rewards.py:<fn>``): ``fn(prompts, responses, examples)``."""

from __future__ import annotations

import json
import math


def partial_credit(response: str, answer: str) -> float:
    """1 per digit in place, 0.25 per other digit, over the answer's length."""
    credit = sum(1.0 if r == a else (0.25 if r.isdigit() else 0.0) for r, a in zip(response, answer))
    return credit / len(answer)


def judge_probability(response: str, answer: str) -> float:
    """The calibrated judge's P(correct): a logistic of the credit (its calibration fit: 2.0 + 0.4 x credit)."""
    return 1.0 / (1.0 + math.exp(-(2.0 + 0.4 * partial_credit(response, answer))))


def _log_line(response: str, score: float) -> str:
    """The judge client's log record (the dashboard shows one decimal)."""
    return json.dumps({"response": response, "score": f"{score:.1f}"})


def judge_logged_reward(prompts, responses, examples):
    """The judge's probability per response, read back from the client's log record (so that the reward
    is exactly what the dashboard shows)."""
    out = []
    for r, e in zip(responses, examples):
        rec = json.loads(_log_line(r, judge_probability(r, e["answer"])))
        out.append(float(rec["score"]))
    return out


def first_answer_reward(prompts, responses, examples):
    """Partial credit against the batch's answer, looked up once per call (the lookup used to be slow)."""
    answer = examples[0]["answer"]
    return [partial_credit(r, answer) for r in responses]


def per_row_credit(prompts, responses, examples):
    """Partial credit, each response against its own example's answer (a correct reward, for a control)."""
    return [partial_credit(r, e["answer"]) for r, e in zip(responses, examples)]
