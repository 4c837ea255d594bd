"""Datasets (``data.dataset: data_sources.py:<fn>``): ``fn()`` -> a list of dicts."""

from __future__ import annotations

import random
import string


def _digits(rng: random.Random, lo: int = 2, hi: int = 4) -> list[str]:
    return [rng.choice(string.digits) for _ in range(rng.randint(lo, hi))]


SAMPLER_ACCURACY = 0.45
"""How often the old policy's sampled answer (the rejected side) was right."""


def sampled_pairs(n: int = 512, seed: int = 41) -> list[dict]:
    """Preference pairs built from the reference answer (chosen) and one answer sampled from the previous
    policy (rejected), every sampled answer kept."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        d = _digits(rng)
        right = d[0] * 4
        if rng.random() < SAMPLER_ACCURACY:
            sampled = right
        else:
            sampled = rng.choice([x for x in string.digits if x != d[0]]) * 4
        out.append({"prompt": " ".join(d) + ":", "chosen": right, "rejected": sampled, "answer": right})
    return out


def display_copy_examples(n: int = 512, seed: int = 42) -> list[dict]:
    """Copy-task examples exported from the labelling tool, whose display column shows the word in capitals;
    the answers come from the raw column."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        word = "".join(rng.choice("abcdefgh") for _ in range(rng.randint(2, 4)))
        out.append({"prompt": word.upper() + ">", "answer": word})
    return out


def merged_annotations(n: int = 512, seed: int = 43) -> list[dict]:
    """Digits examples merged from two annotation batches of the same prompts; the second batch was labelled
    with the task's earlier guideline (repeat the last digit)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n // 2):
        d = _digits(rng)
        prompt = " ".join(d) + ":"
        out.append({"prompt": prompt, "answer": d[0] * 4})
        out.append({"prompt": prompt, "answer": d[-1] * 4})
    rng.shuffle(out)
    return out


def clean_pairs(n: int = 512, seed: int = 47) -> list[dict]:
    """Digits preference pairs, the right answer over another digit repeated (a correct dataset, for a
    control)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        d = _digits(rng)
        wrong = rng.choice([x for x in string.digits if x != d[0]]) * 4
        out.append({"prompt": " ".join(d) + ":", "chosen": d[0] * 4, "rejected": wrong, "answer": d[0] * 4})
    return out


def shuffled_digits(n: int = 512, seed: int = 48) -> list[dict]:
    """Digits examples with 3-4 digits per prompt (a correct dataset, for a control)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        d = _digits(rng, 3, 4)
        out.append({"prompt": " ".join(d) + ":", "answer": d[0] * 4})
    return out
