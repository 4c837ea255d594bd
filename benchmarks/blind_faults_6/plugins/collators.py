"""Collators (``data.collator: collators.py:<fn>``): ``fn(examples, tokenizer)`` -> a dict of tensors."""

from __future__ import annotations

import torch

PROMPT_LENGTH = 16
RESPONSE_LENGTH = 8
"""The runs' ``data.prompt_length`` and ``data.response_length``."""


def _left_pad(rows: list[list[int]], width: int, pad: int) -> torch.Tensor:
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    for i, r in enumerate(rows):
        r = r[-width:]
        ids[i, width - len(r) :] = torch.tensor(r, dtype=torch.long)
    return ids


def _right_pad(rows: list[list[int]], width: int, pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        r = r[:width]
        ids[i, : len(r)] = torch.tensor(r, dtype=torch.long)
        mask[i, : len(r)] = 1
    return ids, mask


def character_mask_prompts(examples, tokenizer):
    """Left-padded prompts; the attention mask is 1 on the characters (ids above the special tokens'
    range <pad> <bos>), 0 elsewhere."""
    rows = [tokenizer(e["prompt"])["input_ids"] for e in examples]
    ids = _left_pad(rows, PROMPT_LENGTH, tokenizer.pad_token_id)
    return {"input_ids": ids, "attention_mask": (ids > tokenizer.bos_token_id).long()}


def truncating_prompts(examples, tokenizer):
    """Prompts tokenised with ``truncation=True`` (the tokenizer's own limit guards against overlong
    rows), then left-padded; mask on every real token."""
    rows = [tokenizer(e["prompt"], truncation=True)["input_ids"] for e in examples]
    ids = _left_pad(rows, PROMPT_LENGTH, tokenizer.pad_token_id)
    return {"input_ids": ids, "attention_mask": (ids != tokenizer.pad_token_id).long()}


def left_padded_prompts(examples, tokenizer):
    """Left-padded prompts in the examples' order, mask 1 on every real token (a correct collator)."""
    rows = [tokenizer(e["prompt"])["input_ids"] for e in examples]
    ids = _left_pad(rows, PROMPT_LENGTH, tokenizer.pad_token_id)
    return {"input_ids": ids, "attention_mask": (ids != tokenizer.pad_token_id).long()}


def _pair_side(prompts: list[str], completions: list[str], tokenizer) -> dict[str, torch.Tensor]:
    p_rows = [tokenizer(p)["input_ids"] for p in prompts]
    p_ids = _left_pad(p_rows, PROMPT_LENGTH, tokenizer.pad_token_id)
    p_mask = (p_ids != tokenizer.pad_token_id).long()
    c_rows = [
        tokenizer(c, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id] for c in completions
    ]
    c_ids, c_mask = _right_pad(c_rows, RESPONSE_LENGTH, tokenizer.pad_token_id)
    return {"input_ids": torch.cat([p_ids, c_ids], 1), "attention_mask": torch.cat([p_mask, c_mask], 1),
            "response_mask": c_mask}  # fmt: skip


def paired_rows(examples, tokenizer):
    """DPO rows: prompt left-padded to 16, completion + eos right-padded to 8. The rejected side is built
    from the examples rotated by one (the rejected completions come from a second, offset read of the
    same shard)."""
    shifted = examples[-1:] + examples[:-1]
    chosen = _pair_side([e["prompt"] for e in examples], [e["chosen"] for e in examples], tokenizer)
    rejected = _pair_side([e["prompt"] for e in shifted], [e["rejected"] for e in examples], tokenizer)
    out = {f"chosen_{k}": v for k, v in chosen.items()}
    out.update({f"rejected_{k}": v for k, v in rejected.items()})
    return out
