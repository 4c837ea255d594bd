"""Collators (``data.collator``): ``fn(examples, tokenizer) -> dict of tensors``."""

from __future__ import annotations

import torch
from torch.nn.utils.rnn import pad_sequence

PROMPT_LEN = 16
RESPONSE_LEN = 8
MODEL_DTYPE = torch.bfloat16


def collate_to_model_dtype(examples, tokenizer):
    """Tokenise and left-pad, then move the batch to the model's dtype in one go (ids and masks
    come back as integers)."""
    enc = tokenizer(
        [ex["prompt"] for ex in examples],
        padding="max_length",
        max_length=PROMPT_LEN,
        truncation=True,
        return_tensors="pt",
    )
    batch = {k: v.to(MODEL_DTYPE) for k, v in enc.items()}
    batch["input_ids"] = batch["input_ids"].long()
    batch["attention_mask"] = batch["attention_mask"].long()
    return batch


def pad_prompts(examples, tokenizer):
    """Left-padded prompt ids; every position of the fixed-size window is model input."""
    enc = tokenizer(
        [ex["prompt"] for ex in examples],
        padding="max_length",
        max_length=PROMPT_LEN,
        truncation=True,
        return_tensors="pt",
    )
    ids = enc["input_ids"]
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def fixed_width_prompts(examples, tokenizer):
    """Prompt ids padded to a fixed width, with the matching attention mask."""
    pad = tokenizer.pad_token_id
    ids, mask = [], []
    for ex in examples:
        row = tokenizer(ex["prompt"])["input_ids"][:PROMPT_LEN]
        ids.append(row + [pad] * (PROMPT_LEN - len(row)))
        mask.append([1] * len(row) + [0] * (PROMPT_LEN - len(row)))
    return {"input_ids": torch.tensor(ids), "attention_mask": torch.tensor(mask)}


def pack_pairs(examples, tokenizer):
    """DPO pairs: prompt and completion packed into one row of P + R tokens, and a response mask
    over the R completion tokens."""
    pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id
    width = PROMPT_LEN + RESPONSE_LEN
    out = {}
    for side in ("chosen", "rejected"):
        ids, attn, resp = [], [], []
        for ex in examples:
            prompt = tokenizer(ex["prompt"])["input_ids"][-PROMPT_LEN:]
            completion = (tokenizer(ex[side], add_special_tokens=False)["input_ids"] + [eos])[:RESPONSE_LEN]
            seq = prompt + completion
            ids.append(seq + [pad] * (width - len(seq)))
            attn.append([1] * len(seq) + [0] * (width - len(seq)))
            resp.append([1] * len(completion) + [0] * (RESPONSE_LEN - len(completion)))
        out[f"{side}_input_ids"] = torch.tensor(ids)
        out[f"{side}_attention_mask"] = torch.tensor(attn)
        out[f"{side}_response_mask"] = torch.tensor(resp)
    return out


def byte_collator(examples, tokenizer):
    """Byte-level prompt encoding (UTF-8 bytes after the tokenizer's bos), left-padded."""
    pad = tokenizer.pad_token_id
    ids = torch.full((len(examples), PROMPT_LEN), pad, dtype=torch.long)
    mask = torch.zeros((len(examples), PROMPT_LEN), dtype=torch.long)
    for i, ex in enumerate(examples):
        row = ([tokenizer.bos_token_id] + list(ex["prompt"].encode("utf-8")))[-PROMPT_LEN:]
        ids[i, PROMPT_LEN - len(row) :] = torch.tensor(row)
        mask[i, PROMPT_LEN - len(row) :] = 1
    return {"input_ids": ids, "attention_mask": mask}


def pair_collator(examples, tokenizer):
    """DPO pairs: the prompt left-padded to P, each completion (+ eos) right-padded to R."""
    pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id
    b, width = len(examples), PROMPT_LEN + RESPONSE_LEN
    out = {}
    for side in ("chosen", "rejected"):
        ids = torch.zeros(b, width)
        ids.fill_(pad)
        attn = torch.zeros(b, width, dtype=torch.long)
        resp = torch.zeros(b, RESPONSE_LEN, dtype=torch.long)
        for i, ex in enumerate(examples):
            p = tokenizer(ex["prompt"])["input_ids"][-PROMPT_LEN:]
            c = (tokenizer(ex[side], add_special_tokens=False)["input_ids"] + [eos])[:RESPONSE_LEN]
            ids[i, PROMPT_LEN - len(p) : PROMPT_LEN] = torch.tensor(p)
            ids[i, PROMPT_LEN : PROMPT_LEN + len(c)] = torch.tensor(c)
            attn[i, PROMPT_LEN - len(p) : PROMPT_LEN + len(c)] = 1
            resp[i, : len(c)] = 1
        out[f"{side}_input_ids"] = ids
        out[f"{side}_attention_mask"] = attn
        out[f"{side}_response_mask"] = resp
    return out


def pad_sequence_collator(examples, tokenizer):
    """Left-padded prompt ids and mask via torch's pad_sequence."""
    seqs = [torch.tensor(tokenizer(ex["prompt"])["input_ids"][-PROMPT_LEN:]) for ex in examples]
    ids = pad_sequence(seqs, padding_value=tokenizer.pad_token_id, padding_side="left")
    mask = pad_sequence([torch.ones_like(s) for s in seqs], padding_value=0, padding_side="left")
    return {"input_ids": ids, "attention_mask": mask}
