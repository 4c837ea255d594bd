"""Datasets (``data.dataset: data_sources.py:<fn>``): ``fn()`` -> a list of dicts."""

from __future__ import annotations

import random
import string


def _digits(rng: random.Random, lo: int = 2, hi: int = 4) -> list[str]:
    return [rng.choice(string.digits) for _ in range(rng.randint(lo, hi))]


def formatting_negative_pairs(n: int = 512, seed: int = 61) -> list[dict]:
    """Preference pairs whose rejected side is the reference answer with a formatting perturbation (the
    negative-mining script's 'format noise' mode: a trailing space)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        d = _digits(rng)
        right = d[0] * 4
        out.append({"prompt": " ".join(d) + ":", "chosen": right, "rejected": right + " ", "answer": right})
    return out


def spaced_prompts(n: int = 512, seed: int = 62) -> list[dict]:
    """Digits examples exported by the prompt builder, which joins the prompt and the answer slot with a
    space ('4 7 1 9: ' then the answer)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        d = _digits(rng)
        out.append({"prompt": " ".join(d) + ": ", "answer": d[0] * 4})
    return out


def relabelled_examples(n: int = 512, seed: int = 63) -> list[dict]:
    """Digits examples from the synthetic generator: it picks each example's target digit with a fresh
    ``random.Random(seed)`` ("so every example is reproducible from the seed"), puts it first in the prompt
    and draws the other digits from the shared generator; the answer repeats the target digit."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        d = _digits(rng)
        label = random.Random(seed).choice(string.digits)
        d[0] = label
        out.append({"prompt": " ".join(d) + ":", "answer": label * 4})
    return out


def long_digit_prompts(n: int = 512, seed: int = 64) -> list[dict]:
    """Digits examples from the harder split: 8 to 10 digits per prompt, the answer still the first digit
    repeated."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        d = _digits(rng, 8, 10)
        out.append({"prompt": " ".join(d) + ":", "answer": d[0] * 4})
    return out


def rationale_pairs(n: int = 512, seed: int = 65) -> list[dict]:
    """Preference pairs from the annotation tool: chosen is the right answer with the annotator's short
    justification appended, rejected a wrong answer as the model wrote it."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        d = _digits(rng)
        right = d[0] * 4
        wrong = rng.choice([x for x in string.digits if x != d[0]]) * 4
        out.append({"prompt": " ".join(d) + ":", "chosen": f"{right} as first is {d[0]}", "rejected": wrong,
                    "answer": right})  # fmt: skip
    return out


def clean_pairs(n: int = 512, seed: int = 66) -> list[dict]:
    """Digits preference pairs, the right answer over another digit repeated (a correct dataset, for a
    control)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        d = _digits(rng)
        wrong = rng.choice([x for x in string.digits if x != d[0]]) * 4
        out.append({"prompt": " ".join(d) + ":", "chosen": d[0] * 4, "rejected": wrong, "answer": d[0] * 4})
    return out
