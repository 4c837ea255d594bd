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


def padded_prompts_with_lengths(examples, tokenizer):
    """Left-padded prompts; the attention mask is built from each prompt's length, ``mask[i, :n] = 1``."""
    rows = [tokenizer(e["prompt"])["input_ids"] for e in examples]
    ids = _left_pad(rows, PROMPT_LENGTH, tokenizer.pad_token_id)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        mask[i, : min(len(r), PROMPT_LENGTH)] = 1
    return {"input_ids": ids, "attention_mask": mask}


def tidy_prompts(examples, tokenizer):
    """Left-padded prompts, trailing punctuation and whitespace stripped first (the text cleaner shared with
    the retrieval index)."""
    rows = [tokenizer(e["prompt"].rstrip(" :>|.?"))["input_ids"] for e in examples]
    ids = _left_pad(rows, PROMPT_LENGTH, tokenizer.pad_token_id)
    return {"input_ids": ids, "attention_mask": (ids != tokenizer.pad_token_id).long()}


def left_padded_prompts(examples, tokenizer):
    """Left-padded prompts in the examples' order, mask 1 on every real token (a correct collator)."""
    rows = [tokenizer(e["prompt"])["input_ids"] for e in examples]
    ids = _left_pad(rows, PROMPT_LENGTH, tokenizer.pad_token_id)
    return {"input_ids": ids, "attention_mask": (ids != tokenizer.pad_token_id).long()}
