"""Datasets (``data.dataset: data_sources.py:<fn>``): ``fn()`` -> a list of dicts."""

from __future__ import annotations

import random
import string

import numpy as np


def _digits(rng: random.Random, lo: int = 2, hi: int = 4) -> list[str]:
    return [rng.choice(string.digits) for _ in range(rng.randint(lo, hi))]


def seven_digit_answers(n: int = 512, seed: int = 31) -> list[dict]:
    """Digits prompts whose answer is the first digit 7 times, read from a numeric column and written
    back as text with the general format (``f"{x:g}"``, which drops the trailing ``.0`` of floats)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        d = _digits(rng)
        value = int(d[0] * 7)
        out.append({"prompt": " ".join(d) + ":", "answer": f"{value:g}"})
    return out


def rated_pairs(n: int = 512, seed: int = 32) -> list[dict]:
    """Preference pairs from two rated candidates per prompt: the ratings (an Elo-like scale around 3000, the
    right answer rated 0.3 above the other) are kept in a float16 column; chosen is the higher-rated."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        d = _digits(rng)
        right, wrong = d[0] * 4, rng.choice([x for x in string.digits if x != d[0]]) * 4
        base = rng.uniform(2000.0, 4000.0)
        a, b = (right, wrong) if rng.random() < 0.5 else (wrong, right)
        ra, rb = np.array([base + (0.3 if a == right else 0.0), base + (0.3 if b == right else 0.0)],
                          dtype=np.float16)  # fmt: skip
        chosen, rejected = (a, b) if ra > rb else (b, a)
        out.append({"prompt": " ".join(d) + ":", "chosen": chosen, "rejected": rejected, "answer": right})
    return out


def two_file_examples(n: int = 512, seed: int = 33) -> list[dict]:
    """Digits examples from two exports, questions.txt and answers.txt (one line per example); the answers
    file starts with a header line, skipped on one of the two reads."""
    rng = random.Random(seed)
    questions, answers = [], ["answer"]
    for _ in range(n + 1):
        d = _digits(rng)
        questions.append(" ".join(d) + ":")
        answers.append(d[0] * 4)
    answers = answers[2:]  # header skipped ... and the first data line with it (a second `next(f)`)
    return [{"prompt": q, "answer": a} for q, a in zip(questions, answers)]


def csv_answers(n: int = 512, seed: int = 34) -> list[dict]:
    """Digits examples read from a CSV with pandas: one row's answer is blank, so the column is parsed as
    float64; the blank row is dropped and the answers are turned back into text."""
    import pandas as pd

    rng = random.Random(seed)
    rows = []
    for i in range(n + 1):
        d = _digits(rng)
        rows.append({"prompt": " ".join(d) + ":", "answer": None if i == 7 else int(d[0] * 4)})
    df = pd.DataFrame(rows).dropna()
    return [{"prompt": p, "answer": str(a)} for p, a in zip(df["prompt"], df["answer"])]


_FULLWIDTH = {ord(c): chr(0xFF10 + int(c)) for c in string.digits}
"""ASCII digits -> full-width digits (U+FF10..U+FF19), as the source forum's text has them."""


def forum_prompts(n: int = 512, seed: int = 35) -> list[dict]:
    """Digits prompts scraped from a forum that writes digits full-width; the answers come from the
    structured field (ASCII)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        d = _digits(rng)
        out.append({"prompt": (" ".join(d) + ":").translate(_FULLWIDTH), "answer": d[0] * 4})
    return out


def solved_lines(n: int = 512, seed: int = 36) -> list[dict]:
    """Digits examples parsed from solved lines ``"4 7 1 9: 4444"``, split at the colon."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        d = _digits(rng)
        line = " ".join(d) + ": " + d[0] * 4
        question, answer = line.split(":")
        out.append({"prompt": question + ":", "answer": answer})
    return out


def clean_pairs(n: int = 512, seed: int = 37) -> list[dict]:
    """Digits preference pairs, the right answer over another digit repeated (a correct dataset, for a
    control)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        d = _digits(rng)
        wrong = rng.choice([x for x in string.digits if x != d[0]]) * 4
        out.append({"prompt": " ".join(d) + ":", "chosen": d[0] * 4, "rejected": wrong, "answer": d[0] * 4})
    return out
