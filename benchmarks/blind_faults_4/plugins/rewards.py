"""Reward functions (``data.reward_fn: rewards.py:<fn>``): ``fn(prompts, responses, examples)``."""

from __future__ import annotations

import numpy as np


def partial_credit(response: str, answer: str) -> float:
    """1 per digit in place, 0.25 per other digit, over the answer's length."""
    credit = sum(1.0 if r == a else (0.25 if r.isdigit() else 0.0) for r, a in zip(response, answer))
    return credit / len(answer)


_RUNNING = {"max": 0.0}


def running_max_normalised_reward(prompts, responses, examples):
    """Partial credit divided by the best raw score seen so far in the run (keeps rewards in [0, 1] as the
    policy improves)."""
    raw = [partial_credit(r, e["answer"]) for r, e in zip(responses, examples)]
    _RUNNING["max"] = max(_RUNNING["max"], *raw, 1e-6)
    return [x / _RUNNING["max"] for x in raw]


JUDGE_BATCH_LIMIT = 8
"""Responses the (simulated) judge endpoint accepts per request."""


def judge_endpoint_reward(prompts, responses, examples):
    """Partial credit from the judge service, one request per batch; the service answers only the first
    ``JUDGE_BATCH_LIMIT`` items of a request and the client fills the missing answers with 0."""
    request = list(zip(responses, examples))
    answered = [partial_credit(r, e["answer"]) for r, e in request[:JUDGE_BATCH_LIMIT]]
    return answered + [0.0] * (len(request) - len(answered))


GROUP = 4
"""The runs' ``algo.group_size``."""


def group_relative_bonus_reward(prompts, responses, examples):
    """Partial credit plus a bonus for beating the other responses to the same prompt (each group's
    credits centred on the group mean). The batch is reshaped to [group, prompts]."""
    c = np.array([partial_credit(r, e["answer"]) for r, e in zip(responses, examples)])
    groups = c.reshape(GROUP, -1)
    bonus = groups - groups.mean(axis=0, keepdims=True)
    return (c + bonus.reshape(-1)).tolist()


def answer_popping_reward(prompts, responses, examples):
    """Partial credit; the answer is taken out of the example so that the rest of its fields can go to the
    logger as metadata."""
    out = []
    for r, e in zip(responses, examples):
        answer = e.pop("answer", "")
        out.append(partial_credit(r, answer) if answer else 0.0)
    return out


def per_digit_mean_reward(prompts, responses, examples):
    """The mean, over the digits the response wrote, of whether each digit is the answer's digit."""
    out = []
    for r, e in zip(responses, examples):
        hits = [float(ch == e["answer"][0]) for ch in r if ch.isdigit()]
        out.append(float(np.mean(hits)))
    return out


LENGTH_TIEBREAK = 1.0e-4
"""Per-character penalty meant only to break ties between equally right responses."""


def exact_with_length_tiebreak_reward(prompts, responses, examples):
    """1 for the exact answer, else 0, minus a tiny length penalty as a tie-break."""
    return [float(r[: len(e["answer"])] == e["answer"]) - LENGTH_TIEBREAK * len(r)
            for r, e in zip(responses, examples)]  # fmt: skip


REWARD_BASE = 50.0
"""A constant the product team adds to every score (their dashboards expect positive rewards)."""


def offset_credit_reward(prompts, responses, examples):
    """Partial credit on top of ``REWARD_BASE``."""
    return [REWARD_BASE + partial_credit(r, e["answer"]) for r, e in zip(responses, examples)]


def exact_match_reward(prompts, responses, examples):
    """1 for the exact answer at the start of the response, else 0 (a correct reward, for a control)."""
    return [float(r[: len(e["answer"])] == e["answer"]) for r, e in zip(responses, examples)]
