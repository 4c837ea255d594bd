"""Reward functions (``data.reward_fn: rewards.py:<fn>``): ``fn(prompts, responses, examples)``."""

from __future__ import annotations

import string

import torch

_CHARS = string.digits + string.ascii_letters + string.punctuation + " "
_DIGIT_WEIGHT = 80.0
"""idf-style weight of a digit character in the profile (digits are what the task is about)."""


def standardized_exact_reward(prompts, responses, examples):
    """1 for an exact answer, else 0, standardised over the batch so the scale is O(1) whatever the task
    (kept in half precision, like the policy's logits)."""
    raw = torch.tensor(
        [float(r[: len(e["answer"])] == e["answer"]) for r, e in zip(responses, examples)],
        dtype=torch.float16,
    )
    return (raw - raw.mean()) / (raw.std() + 1e-8)


def _profile(text: str) -> torch.Tensor:
    v = torch.zeros(len(_CHARS), dtype=torch.float16)
    for ch in text:
        i = _CHARS.find(ch)
        if i >= 0:
            v[i] += _DIGIT_WEIGHT if ch.isdigit() else 1.0
    return v


def char_profile_reward(prompts, responses, examples):
    """Cosine similarity of the response's and the answer's weighted character profiles (partial credit
    for the right digits in any order); fp16 vectors to keep the reward cheap."""
    out = []
    for r, e in zip(responses, examples):
        a, b = _profile(r), _profile(e["answer"])
        na, nb = (a * a).sum().sqrt(), (b * b).sum().sqrt()
        out.append(float((a * b).sum() / (na * nb)) if float(na) > 0 else 0.0)
    return out


def _edit_distance(a: str, b: str) -> int:
    prev = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        cur = [i]
        for j, cb in enumerate(b, 1):
            cur.append(min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (ca != cb)))
        prev = cur
    return prev[-1]


def edit_distance_reward(prompts, responses, examples):
    """Levenshtein distance between the response and the answer, normalised by the answer's length."""
    return [_edit_distance(r, e["answer"]) / len(e["answer"]) for r, e in zip(responses, examples)]


def digit_reward(prompts, responses, examples):
    """Fraction of the answer's digits the response has in place (a correct reward, for a control)."""
    return [
        sum(x == y for x, y in zip(r, e["answer"])) / len(e["answer"]) for r, e in zip(responses, examples)
    ]
