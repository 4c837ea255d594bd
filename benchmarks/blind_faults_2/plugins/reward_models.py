"""Small learned reward models (``model.reward_model: reward_models.py:<loader>``), loaded as ``fn(tokenizer,
device)``; each stands in for a trained checkpoint (fixed seeds)."""

from __future__ import annotations

import torch
from torch import nn

RESPONSE_TOKENS = 8
"""The run's ``data.response_length``: the scored sequences end with this many response columns."""


class ResponseSumScorer(nn.Module):
    """Per-token scores (offset so they are positive), summed over the response: the running total at
    the end minus the running total at the end of the prompt."""

    def __init__(self, vocab_size: int, dim: int = 32, offset: float = 64.0) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, dim)
        self.token_score = nn.Linear(dim, 1)
        self.offset = offset

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        per_token = self.token_score(self.embed(input_ids)).squeeze(-1) + self.offset
        running = torch.cumsum(per_token * attention_mask.to(per_token.dtype), dim=1)
        return (running[:, -1] - running[:, -RESPONSE_TOKENS - 1]) / RESPONSE_TOKENS - self.offset


def load_response_sum_rm(tokenizer, device):
    """The response-sum scorer, in bf16 like the rest of the (bf16) run."""
    torch.manual_seed(4321)
    return ResponseSumScorer(len(tokenizer)).to(device=device, dtype=torch.bfloat16).eval()


class LastTokenScorer(nn.Module):
    """A linear score of the final position's embedding (where an eos-terminated sequence's summary is)."""

    def __init__(self, vocab_size: int, dim: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, dim)
        self.head = nn.Linear(dim, 1)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(input_ids[:, -1])).squeeze(-1)


def load_last_token_rm(tokenizer, device):
    torch.manual_seed(99)
    return LastTokenScorer(len(tokenizer)).to(device).eval()
