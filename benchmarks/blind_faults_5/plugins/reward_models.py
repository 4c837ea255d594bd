"""Small reward models (``model.reward_model: reward_models.py:<loader>``), loaded as ``fn(tokenizer,
device)``; each stands in for a trained checkpoint (fixed seeds)."""

from __future__ import annotations

import torch
from torch import nn


class PooledScorer(nn.Module):
    """Mean-pooled token embeddings -> one score (the logit of "good")."""

    def __init__(self, vocab_size: int, dim: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, dim)
        self.head = nn.Linear(dim, 1)

    def pool(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        m = attention_mask.to(self.embed.weight.dtype).unsqueeze(-1)
        return (self.embed(input_ids) * m).sum(1) / m.sum(1).clamp_min(1.0)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.head(self.pool(input_ids, attention_mask)).squeeze(-1)


class ProbabilityScorer(PooledScorer):
    """The scorer's output as P(good) = sigmoid(logit), the form the RM team's dashboard shows."""

    def forward(self, input_ids, attention_mask):
        return torch.sigmoid(super().forward(input_ids, attention_mask))


class FloorPooledScorer(PooledScorer):
    """The scorer with its pooling rewritten for padded batches."""

    def pool(self, input_ids, attention_mask):
        m = attention_mask.to(self.embed.weight.dtype).unsqueeze(-1)
        return (self.embed(input_ids) * m).sum(1) // m.sum(1).clamp_min(1.0)


def _init(rm: PooledScorer, seed: int, *, offset: float = 0.0, bias: float = 0.0) -> PooledScorer:
    """The weights as trained: embedding features ``offset`` + N(0, 0.05), head N(0, 0.5), head bias."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        rm.embed.weight.copy_(offset + 0.05 * torch.randn(rm.embed.weight.shape, generator=g))
        rm.head.weight.copy_(0.5 * torch.randn(rm.head.weight.shape, generator=g))
        rm.head.bias.fill_(bias)
    return rm


SCORE_BIAS = 30.0
"""The trained head's bias: the RM's logits sit around +30 (it was trained with a margin loss)."""


def load_probability_scorer(tokenizer, device):
    """The RM checkpoint, returning P(good) per response."""
    return _init(ProbabilityScorer(len(tokenizer)), 505, bias=SCORE_BIAS).to(device).eval()


def load_logit_scorer(tokenizer, device):
    """The same RM returning its logit (a correct reward model, for a control)."""
    return _init(PooledScorer(len(tokenizer)), 505, bias=SCORE_BIAS).to(device).eval()


FEATURE_OFFSET = 0.3
"""The trained embeddings' features are positive, around 0.3."""


def load_floor_pooled_scorer(tokenizer, device):
    """The RM checkpoint with the padded-batch pooling."""
    return _init(FloorPooledScorer(len(tokenizer)), 506, offset=FEATURE_OFFSET).to(device).eval()


def load_mean_pooled_scorer(tokenizer, device):
    """The same RM with true-division pooling (for the verification's comparison)."""
    return _init(PooledScorer(len(tokenizer)), 506, offset=FEATURE_OFFSET).to(device).eval()


CALIBRATED_BIAS = 8.0
"""The calibrated RM's logits sit around +8: P(good) ~0.9997 for in-distribution responses."""


def load_calibrated_probability_scorer(tokenizer, device):
    """The calibrated RM checkpoint, returning P(good) per response."""
    return _init(ProbabilityScorer(len(tokenizer)), 507, bias=CALIBRATED_BIAS).to(device).eval()
