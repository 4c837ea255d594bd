"""Reward functions (``data.reward_fn: rewards.py:<fn>``): ``fn(prompts, responses, examples)``."""

from __future__ import annotations

import concurrent.futures as cf
import time


def partial_credit(response: str, answer: str) -> float:
    """1 per digit in place, 0.25 per other digit, over the answer's length."""
    credit = sum(1.0 if r == a else (0.25 if r.isdigit() else 0.0) for r, a in zip(response, answer))
    return credit / len(answer)


def unique_response_reward(prompts, responses, examples):
    """Partial credit from the judge, called once per distinct response (GRPO groups repeat responses; the
    judge is slow): the scores of the distinct responses, in first-seen order."""
    seen: dict[tuple[str, str], float] = {}
    for r, e in zip(responses, examples):
        key = (r, e["answer"])
        if key not in seen:
            seen[key] = partial_credit(r, e["answer"])
    return list(seen.values())


def _judge_call(response: str, answer: str) -> float:
    """One request to the (simulated) judge service: its latency depends on the text it reads."""
    time.sleep(0.002 * (sum(map(ord, response)) % 7))
    return partial_credit(response, answer)


def judge_pool_reward(prompts, responses, examples):
    """Partial credit from the judge service, requests sent concurrently through a thread pool; the
    results are collected as they complete."""
    with cf.ThreadPoolExecutor(max_workers=8) as pool:
        futures = [pool.submit(_judge_call, r, e["answer"]) for r, e in zip(responses, examples)]
        return [f.result() for f in cf.as_completed(futures)]


POINTS = 1000.0
"""The product's scoring scale: points per fully right answer."""


def points_reward(prompts, responses, examples):
    """Partial credit in the product's points (0..1000)."""
    return [POINTS * partial_credit(r, e["answer"]) for r, e in zip(responses, examples)]


def exact_match_reward(prompts, responses, examples):
    """1 for the exact answer at the start of the response, else 0 (a correct reward, for a control)."""
    return [float(r[: len(e["answer"])] == e["answer"]) for r, e in zip(responses, examples)]


def position_credit_reward(prompts, responses, examples):
    """Partial credit, rows scored in order (a correct reward, for a control)."""
    return [partial_credit(r, e["answer"]) for r, e in zip(responses, examples)]
