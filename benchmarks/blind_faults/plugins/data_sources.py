"""Datasets (``data.dataset``): ``fn() -> list of dicts``."""

from __future__ import annotations

import random

N = 256
WORDS = 600


def _digit_rows(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        digits = [rng.choice("0123456789") for _ in range(rng.randint(2, 4))]
        rows.append({"prompt": " ".join(digits) + ":", "answer": digits[0] * 4})
    return rows


def preference_pairs():
    """Digits prompts with the right answer as chosen and another prompt's answer as rejected."""
    rows = _digit_rows(N, seed=1)
    answers = [r["answer"] for r in rows]
    distractors = answers
    random.Random(2).shuffle(distractors)
    return [
        {"prompt": r["prompt"], "chosen": a, "rejected": d} for r, a, d in zip(rows, answers, distractors)
    ]


def reasoned_pairs():
    """Pairs with a short rationale before the answer; rejected has the wrong answer."""
    rng = random.Random(3)
    out = []
    for r in _digit_rows(N, seed=3):
        first = r["answer"][0]
        wrong = rng.choice([d for d in "0123456789" if d != first])
        lead = f"The first digit is {first}, so the answer is "
        out.append({"prompt": r["prompt"], "chosen": lead + r["answer"], "rejected": lead + wrong * 4})
    return out


def instructed_prompts():
    """Digits prompts with the instruction spelled out after the numbers."""
    out = []
    for r in _digit_rows(N, seed=4):
        numbers = r["prompt"].rstrip(":")
        out.append(
            {"prompt": f"{numbers} | repeat the first number four times. Answer:", "answer": r["answer"]}
        )
    return out


def pairs_from_records():
    """Preference pairs from graded records {question, target, bad}."""
    rng = random.Random(5)
    records = []
    for r in _digit_rows(N, seed=5):
        wrong = rng.choice([d for d in "0123456789" if d != r["answer"][0]]) * 4
        records.append({"question": r["prompt"], "target": r["answer"], "bad": wrong})
    return [
        {"prompt": rec["question"], "chosen": rec.get("good", ""), "rejected": rec["bad"]} for rec in records
    ]


def graded_prompts():
    """Digits prompts with their expected completion."""
    return [{"prompt": r["prompt"], "target": r["answer"]} for r in _digit_rows(N, seed=6)]


def word_echo_prompts():
    """Prompts of three vocabulary words; the answer repeats the first word twice."""
    rng = random.Random(7)
    out = []
    for _ in range(N):
        words = [f"w{rng.randrange(WORDS)}" for _ in range(3)]
        out.append({"prompt": " ".join(words) + " :", "answer": f"{words[0]} {words[0]}"})
    return out
