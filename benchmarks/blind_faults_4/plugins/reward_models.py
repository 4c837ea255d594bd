"""Small reward models (``model.reward_model: reward_models.py:<loader>``), loaded as ``fn(tokenizer,
device)``; each stands in for a trained checkpoint (fixed seeds)."""

from __future__ import annotations

import torch
from torch import nn


class PooledScorer(nn.Module):
    """Mean-pooled token embeddings -> one score."""

    def __init__(self, vocab_size: int, dim: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, dim)
        self.head = nn.Linear(dim, 1)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        m = attention_mask.to(self.embed.weight.dtype).unsqueeze(-1)
        pooled = (self.embed(input_ids) * m).sum(1) / m.sum(1).clamp_min(1.0)
        return self.head(pooled).squeeze(-1)


def _trained_scorer(tokenizer, seed: int) -> PooledScorer:
    """The scorer as it was trained: small embedding weights, and one feature (column 0) the training
    drove to a large value (an outlier, as trained heads often have)."""
    torch.manual_seed(seed)
    rm = PooledScorer(len(tokenizer))
    with torch.no_grad():
        rm.embed.weight.normal_(0.0, 0.05)
        rm.embed.weight[:, 0] = 1.0
        rm.head.weight.normal_(0.0, 0.05)
        rm.head.weight[0, 0] = OUTLIER
    return rm


OUTLIER = 40.0
"""The outlier weight of the trained scorer's head."""


def _fake_quant_int8(w: torch.Tensor) -> torch.Tensor:
    """Symmetric per-tensor int8 quantisation (scale = max |w| / 127), dequantised back to float."""
    scale = w.abs().max() / 127.0
    return (w / scale).round().clamp(-127, 127) * scale


def load_int8_scorer(tokenizer, device):
    """The scorer with its weights quantised to int8 (the serving format our RM team ships)."""
    rm = _trained_scorer(tokenizer, 404)
    with torch.no_grad():
        for p in rm.parameters():
            if p.dim() == 2:
                p.copy_(_fake_quant_int8(p))
    return rm.to(device).eval()


def load_float_scorer(tokenizer, device):
    """The same scorer unquantised (a correct reward model, for a control)."""
    return _trained_scorer(tokenizer, 404).to(device).eval()
