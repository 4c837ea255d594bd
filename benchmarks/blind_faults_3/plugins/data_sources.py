"""Datasets (``data.dataset: data_sources.py:<fn>``): ``fn()`` -> a list of dicts."""

from __future__ import annotations

import random
import re
import string

import numpy as np


def _digits(rng: random.Random, lo: int = 2, hi: int = 4) -> list[str]:
    return [rng.choice(string.digits) for _ in range(rng.randint(lo, hi))]


def numeric_answer_table(n: int = 512, seed: int = 12) -> list[dict]:
    """Digits prompts whose answers come from a numeric column (kept as float16 to halve the table)."""
    rng = random.Random(seed)
    prompts, answers = [], []
    for _ in range(n):
        d = _digits(rng)
        prompts.append(" ".join(d) + ":")
        answers.append(int(d[0] * 4))
    column = np.array(answers, dtype=np.float16)
    return [{"prompt": p, "answer": str(int(a))} for p, a in zip(prompts, column)]


def templated_rows(n: int = 512, seed: int = 13) -> list[dict]:
    """Digits preference pairs built from one row template per example."""
    rng = random.Random(seed)
    rows = [{}] * n
    for i in range(n):
        d = _digits(rng)
        rows[i]["prompt"] = " ".join(d) + ":"
        rows[i]["answer"] = rows[i]["chosen"] = d[0] * 4
        rows[i]["rejected"] = rng.choice([x for x in string.digits if x != d[0]]) * 4
    return rows


def conversation_pairs(n: int = 512, seed: int = 14) -> list[dict]:
    """Preference pairs exported from our chat logs: each side holds the whole conversation."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        d = _digits(rng)
        prompt = " ".join(d) + ":"
        wrong = rng.choice([x for x in string.digits if x != d[0]]) * 4
        out.append({"prompt": prompt, "chosen": prompt + d[0] * 4, "rejected": prompt + wrong,
                    "answer": d[0] * 4})  # fmt: skip
    return out


_QUESTION = re.compile(r"^Q: (.*)$")


def parsed_dump_prompts(n: int = 512, seed: int = 15) -> list[dict]:
    """Digits prompts parsed out of a text dump (``Q: <prompt>``; a later exporter wrote ``Q:<prompt>``)."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        d = _digits(rng)
        line = ("Q: " if i % 4 else "Q:") + " ".join(d) + ":"
        m = _QUESTION.match(line)
        out.append({"prompt": m.group(1) if m else "", "answer": d[0] * 4})
    return out


def digit_pairs(n: int = 512, seed: int = 16) -> list[dict]:
    """Digits preference pairs: the answer over another digit repeated (a correct dataset, for a control)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        d = _digits(rng)
        wrong = rng.choice([x for x in string.digits if x != d[0]]) * 4
        out.append({"prompt": " ".join(d) + ":", "chosen": d[0] * 4, "rejected": wrong, "answer": d[0] * 4})
    return out
