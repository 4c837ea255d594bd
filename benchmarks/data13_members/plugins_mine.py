"""data13's own members of the family (not bench items): datasets and collators."""

import random
import string

import numpy as np
import torch


def _digits(rng, lo=3, hi=4):
    return [rng.choice(string.digits) for _ in range(rng.randint(lo, hi))]


def numpy_reseeded(n=256):
    """Labels from np.random.default_rng(0) made anew for each example: every label is the same."""
    rng = random.Random(3)
    out = []
    for _ in range(n):
        d = _digits(rng)
        d[0] = str(np.random.default_rng(0).integers(0, 10))
        out.append({"prompt": " ".join(d) + ":", "answer": d[0] * 4})
    return out


def smoke_slice():
    """A dataset function that still returns its smoke-test slice: three examples."""
    rng = random.Random(4)
    out = []
    for _ in range(512):
        d = _digits(rng)
        out.append({"prompt": " ".join(d) + ":", "answer": d[0] * 4})
    return out[:3]


def dotted_pairs(n=256):
    """Pairs whose rejected side is the chosen answer with a full stop (format noise)."""
    rng = random.Random(5)
    out = []
    for _ in range(n):
        d = _digits(rng)
        out.append({"prompt": " ".join(d) + ":", "chosen": d[0] * 4, "rejected": d[0] * 4 + "."})
    return out


def newline_prompts(n=256):
    rng = random.Random(6)
    out = []
    for _ in range(n):
        d = _digits(rng)
        out.append({"prompt": " ".join(d) + ":\n", "answer": d[0] * 4})
    return out


def _side(prompts, texts, tok):
    p = [tok(x)["input_ids"][-16:] for x in prompts]
    c = [tok(x, add_special_tokens=False)["input_ids"][:7] + [tok.eos_token_id] for x in texts]
    b = len(p)
    pid = torch.full((b, 16), tok.pad_token_id)
    pm = torch.zeros((b, 16), dtype=torch.long)
    cid = torch.full((b, 8), tok.pad_token_id)
    cm = torch.zeros((b, 8), dtype=torch.long)
    for i in range(b):
        pid[i, 16 - len(p[i]) :] = torch.tensor(p[i])
        pm[i, 16 - len(p[i]) :] = 1
        cid[i, : len(c[i])] = torch.tensor(c[i])
        cm[i, : len(c[i])] = 1
    return {
        "input_ids": torch.cat([pid, cid], 1),
        "attention_mask": torch.cat([pm, cm], 1),
        "response_mask": cm,
    }


def sorted_rejected(examples, tokenizer):
    """A DPO collator that sorts the rejected side's examples by prompt length (a 'bucketing' step): the
    rejected rows no longer follow their chosen rows' prompts."""
    order = sorted(range(len(examples)), key=lambda i: (len(examples[i]["prompt"]), examples[i]["prompt"]))
    rej = [examples[i] for i in order]
    out = {
        f"chosen_{k}": v
        for k, v in _side([e["prompt"] for e in examples], [e["chosen"] for e in examples], tokenizer).items()
    }
    out.update(
        {
            f"rejected_{k}": v
            for k, v in _side([e["prompt"] for e in rej], [e["rejected"] for e in rej], tokenizer).items()
        }
    )
    return out
