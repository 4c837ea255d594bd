"""Datasets (``data.dataset: data_sources.py:<fn>``): ``fn()`` -> a list of dicts."""

from __future__ import annotations

import random
import string


def _digits(rng: random.Random, lo: int = 2, hi: int = 4) -> list[str]:
    return [rng.choice(string.digits) for _ in range(rng.randint(lo, hi))]


def few_shot_prompts(n: int = 512, seed: int = 5) -> list[dict]:
    """Digits prompts with one solved example in front, the two joined by the end-of-text marker."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        shot = _digits(rng, 2, 2)
        q = _digits(rng, 2, 2)
        prompt = " ".join(shot) + ":" + shot[0] * 4 + "<eos>" + " ".join(q) + ":"
        out.append({"prompt": prompt, "answer": q[0] * 4})
    return out


def ranked_pairs(n: int = 512, seed: int = 6) -> list[dict]:
    """Preference pairs from a ranking dump: two responses and which one the rater preferred."""
    rng = random.Random(seed)
    records = []
    for _ in range(n):
        d = _digits(rng)
        good, bad = d[0] * 4, rng.choice([x for x in string.digits if x != d[0]]) * 4
        rec = {"prompt": " ".join(d) + ":", "answer": good}
        if rng.random() < 0.5:
            records.append({**rec, "response_a": good, "response_b": bad, "preferred": "a"})
        else:
            records.append({**rec, "response_a": bad, "response_b": good, "preferred": "b"})
    pairs = []
    for r in records:
        first = r["preferred"] == "b"
        chosen, rejected = (r["response_a"], r["response_b"]) if first else (r["response_b"], r["response_a"])
        pairs.append({"prompt": r["prompt"], "chosen": chosen, "rejected": rejected, "answer": r["answer"]})
    return pairs


def chat_prompts(n: int = 512, seed: int = 8) -> list[dict]:
    """Digits prompts in chat form, the way the verl files hold them."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        d = _digits(rng)
        out.append({"prompt": [{"role": "user", "content": " ".join(d) + ":"}], "answer": d[0] * 4})
    return out
