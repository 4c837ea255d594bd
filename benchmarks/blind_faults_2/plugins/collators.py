"""Collators (``data.collator: collators.py:<fn>``): ``fn(examples, tokenizer)`` -> a dict of tensors."""

from __future__ import annotations

import torch

PROMPT_LENGTH = 16
RESPONSE_LENGTH = 8
"""The runs' ``data.prompt_length`` / ``data.response_length``."""


def _left_pad(rows: list[list[int]], width: int, pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        r = r[-width:]
        ids[i, width - len(r) :] = torch.tensor(r, dtype=torch.long)
        mask[i, width - len(r) :] = 1
    return ids, mask


def length_bucketed_prompts(examples, tokenizer):
    """Left-padded prompts, longest first: rows of similar length sit together, so the batch can be cut
    into tighter micro-batches."""
    rows = [tokenizer(e["prompt"])["input_ids"] for e in examples]
    rows.sort(key=len, reverse=True)
    ids, mask = _left_pad(rows, PROMPT_LENGTH, tokenizer.pad_token_id)
    return {"input_ids": ids, "attention_mask": mask}


def per_example_prompts(examples, tokenizer):
    """Each prompt tokenised on its own (padded to the prompt length), then stacked into a batch."""
    encs = [
        tokenizer(e["prompt"], padding="max_length", max_length=PROMPT_LENGTH, return_tensors="pt")
        for e in examples
    ]
    return {
        "input_ids": torch.stack([x["input_ids"] for x in encs]),
        "attention_mask": torch.stack([x["attention_mask"] for x in encs]),
    }


def preference_batch(examples, tokenizer):
    """DPO batch: prompt left-padded, completion + eos right-padded; every mask is 'not padding'."""
    pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id
    prompts = [tokenizer(e["prompt"])["input_ids"] for e in examples]
    p_ids, _ = _left_pad(prompts, PROMPT_LENGTH, pad)
    out = {}
    for side in ("chosen", "rejected"):
        r_ids = torch.full((len(examples), RESPONSE_LENGTH), pad, dtype=torch.long)
        for i, e in enumerate(examples):
            row = (tokenizer(e[side], add_special_tokens=False)["input_ids"] + [eos])[:RESPONSE_LENGTH]
            r_ids[i, : len(row)] = torch.tensor(row, dtype=torch.long)
        ids = torch.cat([p_ids, r_ids], dim=1)
        out[f"{side}_input_ids"] = ids
        out[f"{side}_attention_mask"] = (ids != pad).long()
        out[f"{side}_response_mask"] = (r_ids != pad).long()
    return out


def prompts_left_padded(examples, tokenizer):
    """Left-padded prompts in the examples' order, mask 1 on every real token (a correct collator)."""
    rows = [tokenizer(e["prompt"])["input_ids"] for e in examples]
    ids, mask = _left_pad(rows, PROMPT_LENGTH, tokenizer.pad_token_id)
    return {"input_ids": ids, "attention_mask": mask}
