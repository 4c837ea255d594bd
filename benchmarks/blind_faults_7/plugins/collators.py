"""Collators (``data.collator: collators.py:<fn>``), called as ``fn(examples, tokenizer)``; prompts are
left-padded to `PROMPT_LEN` (the suites' ``data.prompt_length``)."""

from __future__ import annotations

import torch

PROMPT_LEN = 16
RESPONSE_LEN = 8


def _encode(tokenizer, texts, special=True):
    return [tokenizer(t, add_special_tokens=special)["input_ids"] for t in texts]


def left_pad(rows, tokenizer, length=PROMPT_LEN):
    ids = torch.full((len(rows), length), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(rows), length), dtype=torch.long)
    for i, r in enumerate(rows):
        r = r[-length:]
        ids[i, length - len(r) :] = torch.tensor(r, dtype=torch.long)
        mask[i, length - len(r) :] = 1
    return ids, mask


def padded_prompts(examples, tokenizer):
    """Left-padded prompts with their mask (a correct collator, for a control)."""
    ids, mask = left_pad(_encode(tokenizer, [e["prompt"] for e in examples]), tokenizer)
    return {"input_ids": ids, "attention_mask": mask}


def span_masked_prompts(examples, tokenizer):
    """Left-padded prompts; the mask is written from each prompt's span [start, end) with end = P - 1 (the
    index of the last column, taken as the exclusive end)."""
    rows = _encode(tokenizer, [e["prompt"] for e in examples])
    ids, _ = left_pad(rows, tokenizer)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        start, end = PROMPT_LEN - len(r), PROMPT_LEN - 1
        mask[i, start:end] = 1
    return {"input_ids": ids, "attention_mask": mask}


def budgeted_prompts(examples, tokenizer, budget: int = 7):
    """Left-padded prompts within the rollout's token budget: prompts longer than `budget` tokens are left
    out of the batch ("too long for the serving profile")."""
    rows = [r for r in _encode(tokenizer, [e["prompt"] for e in examples]) if len(r) <= budget]
    ids, mask = left_pad(rows, tokenizer)
    return {"input_ids": ids, "attention_mask": mask}


def _right_pad(rows, tokenizer, length=RESPONSE_LEN):
    ids = torch.full((len(rows), length), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(rows), length), dtype=torch.long)
    for i, r in enumerate(rows):
        r = r[:length]
        ids[i, : len(r)] = torch.tensor(r, dtype=torch.long)
        mask[i, : len(r)] = 1
    return ids, mask


def mirrored_pairs(examples, tokenizer):
    """DPO pairs; every second pair is presented mirrored (rejected in the chosen slot and the reverse), the
    augmentation the team uses for its symmetric reward-model loss."""
    p_ids, p_mask = left_pad(_encode(tokenizer, [e["prompt"] for e in examples]), tokenizer)
    sides = {"chosen": [], "rejected": []}
    for i, e in enumerate(examples):
        c, r = e["chosen"], e["rejected"]
        if i % 2 == 1:
            c, r = r, c
        sides["chosen"].append(c)
        sides["rejected"].append(r)
    out = {}
    for side, texts in sides.items():
        rows = [x + [tokenizer.eos_token_id] for x in _encode(tokenizer, texts, special=False)]
        r_ids, r_mask = _right_pad(rows, tokenizer)
        out[f"{side}_input_ids"] = torch.cat([p_ids, r_ids], dim=1)
        out[f"{side}_attention_mask"] = torch.cat([p_mask, r_mask], dim=1)
        out[f"{side}_response_mask"] = r_mask
    return out
