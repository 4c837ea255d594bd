"""Small reward models (``model.reward_model: reward_models.py:<loader>``), loaded as ``fn(tokenizer,
device)``; each stands in for a trained scorer (fixed seeds)."""

from __future__ import annotations

import torch
from torch import nn


class MeanPoolScorer(nn.Module):
    """Masked mean of token embeddings -> one raw score."""

    def __init__(self, vocab: int, dim: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.head = nn.Linear(dim, 1)

    def raw(self, input_ids, attention_mask):
        m = attention_mask.to(self.embed.weight.dtype).unsqueeze(-1)
        pooled = (self.embed(input_ids) * m).sum(1) / m.sum(1).clamp_min(1.0)
        return self.head(pooled).squeeze(-1)

    def forward(self, input_ids, attention_mask):
        return self.raw(input_ids, attention_mask)


def _weights(rm: nn.Module, seed: int, *, embed_std: float, head_std: float, bias: float) -> nn.Module:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in rm.named_parameters():
            std = embed_std if "embed" in name else head_std
            p.copy_(std * torch.randn(p.shape, generator=g))
            if name.endswith("head.bias"):
                p.fill_(bias)
    return rm.eval()


class PackedProbabilityScorer(MeanPoolScorer):
    """P(good) = sigmoid(raw), sent through the scoring service's compact wire format: one uint8 per score
    (x 255, back / 255 on our side)."""

    def forward(self, input_ids, attention_mask):
        p = torch.sigmoid(self.raw(input_ids, attention_mask))
        return (p * 255).to(torch.uint8).float() / 255


class ProbabilityScorer(MeanPoolScorer):
    """The same P(good) without the wire format (for the verification and a control)."""

    def forward(self, input_ids, attention_mask):
        return torch.sigmoid(self.raw(input_ids, attention_mask))


def load_packed_scorer(tokenizer, device):
    rm = _weights(PackedProbabilityScorer(len(tokenizer)), 701, embed_std=0.05, head_std=0.05, bias=0.42)
    return rm.to(device)


def load_probability_scorer(tokenizer, device):
    rm = _weights(ProbabilityScorer(len(tokenizer)), 701, embed_std=0.05, head_std=0.05, bias=0.42)
    return rm.to(device)


def load_wide_probability_scorer(tokenizer, device):
    """A correct scorer with a useful spread of P(good) (for a control)."""
    rm = _weights(ProbabilityScorer(len(tokenizer)), 702, embed_std=0.5, head_std=0.5, bias=0.0)
    return rm.to(device)


class AttentionPoolScorer(nn.Module):
    """Attention pooling (one learned query over the token embeddings), then a linear score. The padding is
    excluded with an additive bias of the float32 minimum on masked keys (the serving code's constant)."""

    def __init__(self, vocab: int, dim: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.query = nn.Parameter(torch.zeros(dim))
        self.head = nn.Linear(dim, 1)

    def forward(self, input_ids, attention_mask):
        x = self.embed(input_ids)
        m = attention_mask.to(x.dtype)
        big = torch.tensor(torch.finfo(torch.float32).min, dtype=x.dtype, device=x.device)
        bias = (1.0 - m) * big
        w = torch.softmax(x @ self.query / x.shape[-1] ** 0.5 + bias, dim=-1)
        pooled = (w.unsqueeze(-1) * x).sum(1)
        return self.head(pooled).squeeze(-1).float()


def load_half_attention_scorer(tokenizer, device):
    """The scorer as the serving team ships it: fp16 weights (to halve its memory)."""
    rm = _weights(AttentionPoolScorer(len(tokenizer)), 703, embed_std=0.5, head_std=0.5, bias=0.0)
    return rm.half().to(device)


def load_float_attention_scorer(tokenizer, device):
    """The same scorer in fp32 (for the verification's comparison)."""
    rm = _weights(AttentionPoolScorer(len(tokenizer)), 703, embed_std=0.5, head_std=0.5, bias=0.0)
    return rm.to(device)


ACTIVATION_STATS: dict[str, float] = {}
"""What the RM team's activation monitor collected (module class -> mean |output|)."""


def _monitor(module, args, output):
    """Records each module's mean |output| for the monitor's dashboard."""
    if isinstance(output, torch.Tensor) and output.is_floating_point():
        output = output.detach()
        ACTIVATION_STATS[type(module).__name__] = float(output.abs().mean())
    return output


def load_monitored_scorer(tokenizer, device):
    """The scorer loaded through the RM team's helper, which also turns on their activation monitor: a
    global module forward hook (every nn.Module of the process), so that the RM's activations are logged."""
    torch.nn.modules.module.register_module_forward_hook(_monitor)
    rm = _weights(ProbabilityScorer(len(tokenizer)), 704, embed_std=0.5, head_std=0.5, bias=0.0)
    return rm.to(device)
