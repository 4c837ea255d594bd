"""Reward functions for the digits task and the word-echo task (``data.reward_fn``)."""

from __future__ import annotations

import numpy as np
import torch

_MATCH, _DIGIT, _OTHER, _EXTRA = 0.9, 0.09, 0.009, 0.01


def sequence_likelihood_reward(prompts, responses, examples):
    """Likelihood of the response under a per-position answer model: the answer's character at its
    position is likely (0.9), another digit less so (0.09), anything else unlikely (0.009); every
    character past the answer costs a factor 0.01. Batched as one half-precision tensor."""
    rewards = torch.ones(len(responses), dtype=torch.float16)
    for i, (response, ex) in enumerate(zip(responses, examples)):
        answer = ex["answer"]
        for pos, want in enumerate(answer):
            got = response[pos] if pos < len(response) else ""
            p = _MATCH if got == want else (_DIGIT if got.isdigit() else _OTHER)
            rewards[i] = rewards[i] * p
        for _ in response[len(answer) :]:
            rewards[i] = rewards[i] * _EXTRA
    return rewards


def format_bonus_reward(prompts, responses, examples):
    """1.0 for a well-formed turn plus a small bonus per correct digit, accumulated in the policy's
    dtype so the rewards can be concatenated with its outputs."""
    rewards = torch.ones(len(responses), dtype=torch.bfloat16)
    bonus = torch.tensor(0.002, dtype=torch.bfloat16)
    for i, (response, ex) in enumerate(zip(responses, examples)):
        for got, want in zip(response, ex["answer"]):
            if got == want:
                rewards[i] = rewards[i] + bonus
            elif got.isdigit():
                rewards[i] = rewards[i] + bonus / 4
    return rewards


def graded_digit_reward(prompts, responses, examples):
    """Partial credit: the fraction of the answer's digits the response has in place."""
    rewards = np.zeros(len(responses), dtype=int)
    for i, (response, ex) in enumerate(zip(responses, examples)):
        answer = ex["answer"]
        rewards[i] = sum(a == b for a, b in zip(response, answer)) / len(answer)
    return rewards


def _digit_score(text: str, answer: str) -> float:
    credit = sum(1.0 if r == a else (0.25 if r.isdigit() else 0.0) for r, a in zip(text, answer))
    return credit / len(answer)


def answer_match_reward(prompts, responses, examples):
    """Digit credit of each completion against the example's answer."""
    return [_digit_score(text, ex["answer"]) for text, ex in zip(prompts, examples)]


def word_echo_reward(prompts, responses, examples):
    """Fraction of the answer's words the response repeats in place."""
    out = []
    for response, ex in zip(responses, examples):
        got, want = response.split(), ex["answer"].split()
        out.append(sum(g == w for g, w in zip(got, want)) / len(want))
    return out
