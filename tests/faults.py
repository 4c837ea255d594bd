"""Planted faults for the audit tests: user code a suite can point at (``data.collator``,
``data.reward_fn``, ``model.reward_model``), each wrong in one known way. Used by
`pytest tests/test_audit_faults.py` and the runner's failure tests (``tests.faults:<name>``)."""

from __future__ import annotations

import numpy as np
import torch

from trainer.data import TASKS, PromptCollator

PROMPT_LENGTH = 8
"""The planted collator pads to this; tests that use it set data.prompt_length to the same."""


def float_ids_collator(examples, tokenizer):
    """The builtin prompt collator, then the classic mistake: cast the whole batch to a float dtype."""
    batch = PromptCollator(tokenizer, PROMPT_LENGTH)(examples)
    return {k: v.to(torch.float32) for k, v in batch.items()}


def right_padded_collator(examples, tokenizer):
    """Prompts padded on the right: generation would continue from pad tokens."""
    batch = PromptCollator(tokenizer, PROMPT_LENGTH)(examples)
    ids, mask = batch["input_ids"], batch["attention_mask"]
    order = torch.argsort(mask, dim=1, descending=True, stable=True)  # move the pads (0s) to the end
    return {"input_ids": ids.gather(1, order), "attention_mask": mask.gather(1, order)}


def _digits(prompts, responses, examples):
    return TASKS["digits"].reward(prompts, responses, examples)


def float64_reward(prompts, responses, examples):
    """The digits reward as a float64 tensor."""
    return torch.tensor(_digits(prompts, responses, examples), dtype=torch.float64)


def numpy_float64_reward(prompts, responses, examples):
    return np.asarray(_digits(prompts, responses, examples), dtype=np.float64)


def nan_reward(prompts, responses, examples):
    """The digits reward with the first value replaced by NaN (a log(0) in someone's scorer)."""
    r = torch.tensor(_digits(prompts, responses, examples), dtype=torch.float32)
    r[0] = float("nan")
    return r


def fp16_reward_model(tokenizer, device):
    """A tiny reward model returned in fp16 whatever the policy says (a loader that hard-codes dtype)."""
    from transformers import LlamaConfig, LlamaForSequenceClassification

    cfg = LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=len(tokenizer),
        max_position_embeddings=128,
        num_labels=1,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    return LlamaForSequenceClassification(cfg).to(device=device, dtype=torch.float16).eval()
