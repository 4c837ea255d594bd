"""Small reward models (``model.reward_model: reward_models.py:<loader>``), loaded as ``fn(tokenizer,
device)``; each stands in for a trained checkpoint (fixed seeds)."""

from __future__ import annotations

import torch
from torch import nn


class GoodBadClassifier(nn.Module):
    """Mean-pooled token embeddings -> two logits (bad, good); the reward is P(good)."""

    def __init__(self, vocab_size: int, dim: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, dim)
        self.head = nn.Linear(dim, 2)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        m = attention_mask.to(self.embed.weight.dtype).unsqueeze(-1)
        pooled = (self.embed(input_ids) * m).sum(1) / m.sum(1).clamp_min(1.0)
        logits = self.head(pooled)
        return logits.softmax(dim=0)[:, 1]


def load_good_bad_classifier(tokenizer, device):
    torch.manual_seed(2024)
    return GoodBadClassifier(len(tokenizer)).to(device).eval()


class FixedScorer(nn.Module):
    """Mean-pooled embeddings -> one score (a correct reward model, for a control)."""

    def __init__(self, vocab_size: int, dim: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, dim)
        self.head = nn.Linear(dim, 1)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        m = attention_mask.to(self.embed.weight.dtype).unsqueeze(-1)
        pooled = (self.embed(input_ids) * m).sum(1) / m.sum(1).clamp_min(1.0)
        return self.head(pooled).squeeze(-1)


def load_fixed_scorer(tokenizer, device):
    torch.manual_seed(77)
    return FixedScorer(len(tokenizer)).to(device).eval()
