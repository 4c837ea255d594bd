"""Datasets (``data.dataset: datasets.py:<fn>``), called with no arguments; a list of dicts with ``prompt``
(DPO: also ``chosen`` and ``rejected``)."""

from __future__ import annotations

import random

N = 512


def _digits(rng: random.Random) -> list[str]:
    return [rng.choice("0123456789") for _ in range(rng.randint(2, 4))]


TEMPLATE = "{digits}:"
"""The prompt template of the team's task card (the digits, then the cue)."""


def templated_prompts():
    """Digits examples whose prompt is the task card's template (to be rendered per example)."""
    rng = random.Random(7001)
    out = []
    for _ in range(N):
        d = _digits(rng)
        out.append({"prompt": TEMPLATE, "digits": " ".join(d), "answer": d[0] * 4})
    return out


def json_answers():
    """Digits examples loaded from the labelling tool's JSON export, where the answers are numbers."""
    rng = random.Random(7002)
    out = []
    for _ in range(N):
        d = _digits(rng)
        out.append({"prompt": " ".join(d) + ":", "answer": int(d[0] * 4)})
    return out


def near_miss_pairs():
    """Preference pairs mined from the previous policy's samples: chosen is its best sample (three digits
    right, the last one off), rejected its worst (another digit throughout)."""
    rng = random.Random(7003)
    out = []
    for _ in range(N):
        d = _digits(rng)
        first = d[0]
        others = [x for x in "0123456789" if x != first]
        out.append({"prompt": " ".join(d) + ":", "chosen": first * 3 + rng.choice(others),
                    "rejected": rng.choice(others) * 4, "answer": first * 4})  # fmt: skip
    return out


def answer_pairs():
    """Preference pairs of the right answer and a wrong one (a correct dataset, for a control)."""
    rng = random.Random(7004)
    out = []
    for _ in range(N):
        d = _digits(rng)
        first = d[0]
        wrong = rng.choice([x for x in "0123456789" if x != first])
        out.append(
            {"prompt": " ".join(d) + ":", "chosen": first * 4, "rejected": wrong * 4, "answer": first * 4}
        )
    return out
