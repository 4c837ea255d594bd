"""Collators (``data.collator: collators.py:<fn>``): ``fn(examples, tokenizer)`` -> a dict of tensors."""

from __future__ import annotations

import torch

PROMPT_LENGTH = 16
"""The runs' ``data.prompt_length``."""


def _left_pad(rows: list[list[int]], width: int, pad: int) -> torch.Tensor:
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    for i, r in enumerate(rows):
        r = r[-width:]
        ids[i, width - len(r) :] = torch.tensor(r, dtype=torch.long)
    return ids


def compact_mask_prompts(examples, tokenizer):
    """Left-padded prompts; the masks are kept as uint8 (a quarter of the memory of int64)."""
    ids = _left_pad(
        [tokenizer(e["prompt"])["input_ids"] for e in examples], PROMPT_LENGTH, tokenizer.pad_token_id
    )
    is_pad = (ids == tokenizer.pad_token_id).to(torch.uint8)
    return {"input_ids": ids, "attention_mask": ~is_pad}


def formatted_prompts(examples, tokenizer):
    """Left-padded prompts rendered with the formatting function our SFT stage used."""
    rows = [tokenizer(e["prompt"] + e["answer"])["input_ids"] for e in examples]
    ids = _left_pad(rows, PROMPT_LENGTH, tokenizer.pad_token_id)
    return {"input_ids": ids, "attention_mask": (ids != tokenizer.pad_token_id).long()}


def plain_prompts(examples, tokenizer):
    """Left-padded prompts in the examples' order, mask 1 on every real token (a correct collator)."""
    ids = _left_pad(
        [tokenizer(e["prompt"])["input_ids"] for e in examples], PROMPT_LENGTH, tokenizer.pad_token_id
    )
    return {"input_ids": ids, "attention_mask": (ids != tokenizer.pad_token_id).long()}
