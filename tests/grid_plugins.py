"""Reward functions for tests/test_reward_grid.py: three that round their score somewhere on its way out
(prec13's invariant 1) and correct neighbours. Each is called as ``fn(prompts, responses, examples)``."""

from __future__ import annotations

import json
import math


def _judge(response: str, answer: str) -> float:
    """A continuous score in (0.8, 0.95): a logistic of the digits in place."""
    hit = sum(r == a for r, a in zip(response, answer)) / max(1, len(answer))
    return 1.0 / (1.0 + math.exp(-(1.5 + 0.6 * hit + 0.01 * len(response))))


def _record(score: float) -> str:
    return "reward score=%.2f" % score  # noqa: UP031  (the client's logging style)


def score_from_log_record(prompts, responses, examples):
    """The score parsed back out of the client's log line ('%.2f')."""
    return [float(_record(_judge(r, e["answer"])).split("=")[1]) for r, e in zip(responses, examples)]


def rounded_for_dashboard(prompts, responses, examples):
    """round(x, 1) before returning it (the dashboard's column)."""
    return [round(_judge(r, e["answer"]), 1) for r, e in zip(responses, examples)]


def json_cached(prompts, responses, examples):
    """The score cached as a JSON string with one decimal, then read back."""
    return [
        float(json.loads(json.dumps({"s": f"{_judge(r, e['answer']):.1f}"}))["s"])
        for r, e in zip(responses, examples)
    ]


def designed_levels(prompts, responses, examples):
    """1 for the answer, 0.2 for a formatted attempt, else 0 (levels the module writes itself)."""
    out = []
    for r, e in zip(responses, examples):
        shown = f"{_judge(r, e['answer']):.1f}"  # display only
        del shown
        out.append(1.0 if r.strip() == e["answer"] else (0.2 if r.strip().isdigit() else 0.0))
    return out


def quarter_credit(prompts, responses, examples):
    """Digits in place over a four-digit answer: steps of 0.25 by construction, no rounding."""
    return [sum(a == b for a, b in zip(r, e["answer"])) / 4 for r, e in zip(responses, examples)]


def continuous_rounded_to_four(prompts, responses, examples):
    """round(x, 4): a grid far finer than the score's spread."""
    return [
        round(_judge(r, e["answer"]) + 0.001 * len(r) + 0.0007 * i, 4)
        for i, (r, e) in enumerate(zip(responses, examples))
    ]
