"""Small learned reward models (``model.reward_model: reward_models.py:<loader>``), each loaded in the
dtype of the run it serves."""

from __future__ import annotations

import torch
from torch import nn


class AttentionPoolScorer(nn.Module):
    """Token embeddings, pooled with a learned attention weight per token, then a linear score."""

    def __init__(self, vocab_size: int, dim: int = 64, temperature: float = 0.1) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, dim)
        self.query = nn.Linear(dim, 1)
        self.head = nn.Linear(dim, 1)
        self.temperature = temperature

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        h = self.embed(input_ids)
        w = torch.exp(self.query(h).squeeze(-1) / self.temperature) * attention_mask
        pooled = (w.unsqueeze(-1) * h).sum(1) / w.sum(1, keepdim=True)
        return self.head(pooled).squeeze(-1)


def load_attention_pool_rm(tokenizer, device):
    """The attention-pooled scorer in half precision (the run is fp16)."""
    torch.manual_seed(1234)  # stands in for the trained checkpoint
    model = AttentionPoolScorer(len(tokenizer))
    return model.to(device=device, dtype=torch.float16).eval()


class OnePassLayerNorm(nn.Module):
    """LayerNorm with mean and variance from one pass over the features (E[x^2] - E[x]^2)."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mean = x.mean(-1, keepdim=True)
        var = (x * x).mean(-1, keepdim=True) - mean * mean
        return (x - mean) * torch.rsqrt(var + self.eps) * self.weight + self.bias


class MeanPoolScorer(nn.Module):
    """Normalised token embeddings, mean-pooled over the valid tokens, then a linear score."""

    def __init__(self, vocab_size: int, dim: int = 64) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, dim)
        self.norm = OnePassLayerNorm(dim)
        self.head = nn.Linear(dim, 1)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.embed(input_ids))
        m = attention_mask.unsqueeze(-1).to(h.dtype)
        pooled = (h * m).sum(1) / m.sum(1).clamp(min=1)
        return self.head(pooled).squeeze(-1)


def load_mean_pool_rm(tokenizer, device):
    """The mean-pool scorer in bf16, as the run's frozen models are stored."""
    g = torch.Generator().manual_seed(4321)  # stands in for the trained checkpoint
    model = MeanPoolScorer(len(tokenizer))
    with torch.no_grad():
        shared = torch.randn(64, generator=g) * 0.5 + 40.0
        model.embed.weight.copy_(shared + torch.randn(len(tokenizer), 64, generator=g))
        model.head.weight.normal_(0.0, 0.2, generator=g)
    return model.to(device=device, dtype=torch.bfloat16).eval()
