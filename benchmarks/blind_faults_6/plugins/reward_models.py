"""Small reward models (``model.reward_model: reward_models.py:<loader>``), loaded as ``fn(tokenizer,
device)``; each stands in for a trained checkpoint (fixed seeds)."""

from __future__ import annotations

import torch
from torch import nn


class PooledScorer(nn.Module):
    """Mean-pooled token embeddings -> one score (the logit of "good")."""

    def __init__(self, vocab_size: int, dim: int = 32, classes: int = 1) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, dim)
        self.head = nn.Linear(dim, classes)

    def pool(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        m = attention_mask.to(self.embed.weight.dtype).unsqueeze(-1)
        return (self.embed(input_ids) * m).sum(1) / m.sum(1).clamp_min(1.0)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.head(self.pool(input_ids, attention_mask)).squeeze(-1)


class ServingScorer(PooledScorer):
    """The scorer with the forward of the RM team's inference server, which runs under bf16 autocast."""

    def forward(self, input_ids, attention_mask):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return super().forward(input_ids, attention_mask).float()


class LabelScorer(PooledScorer):
    """The two-class (bad / good) classifier; the reward is the predicted label."""

    def __init__(self, vocab_size: int) -> None:
        super().__init__(vocab_size, classes=2)

    def forward(self, input_ids, attention_mask):
        logits = self.head(self.pool(input_ids, attention_mask))
        return logits.argmax(-1).float()


class GoodProbabilityScorer(LabelScorer):
    """The same classifier returning P(good) (for the verification's comparison)."""

    def forward(self, input_ids, attention_mask):
        return self.head(self.pool(input_ids, attention_mask)).softmax(-1)[:, 1]


def _init(
    rm: PooledScorer, seed: int, *, offset: float = 0.0, spread: float = 0.05, bias=0.0
) -> PooledScorer:
    """The weights as trained: embedding features ``offset`` + N(0, spread), head N(0, 0.5), head bias."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        rm.embed.weight.copy_(offset + spread * torch.randn(rm.embed.weight.shape, generator=g))
        rm.head.weight.copy_(0.5 * torch.randn(rm.head.weight.shape, generator=g))
        rm.head.bias.copy_(torch.as_tensor(bias, dtype=rm.head.bias.dtype).expand_as(rm.head.bias))
    return rm


SERVING_BIAS = 24.0
"""The trained head's bias: this RM's logits sit around +24."""


def load_serving_scorer(tokenizer, device):
    """The RM checkpoint with its serving forward (bf16 autocast)."""
    return _init(ServingScorer(len(tokenizer)), 601, bias=SERVING_BIAS).to(device).eval()


def load_plain_scorer(tokenizer, device):
    """The same RM weights with a plain fp32 forward (for the verification's comparison)."""
    return _init(PooledScorer(len(tokenizer)), 601, bias=SERVING_BIAS).to(device).eval()


LABEL_BIAS = (0.0, 3.0)
"""The classifier's class biases (bad, good): it was trained on mostly good responses."""


def load_label_scorer(tokenizer, device):
    """The two-class RM checkpoint, returning the predicted label."""
    return _init(LabelScorer(len(tokenizer)), 602, bias=LABEL_BIAS).to(device).eval()


def load_good_probability(tokenizer, device):
    """The same classifier returning P(good)."""
    return _init(GoodProbabilityScorer(len(tokenizer)), 602, bias=LABEL_BIAS).to(device).eval()


FEATURE_OFFSET = 4.0
"""The trained embeddings' features sit around 4.0 with a small spread."""


def _offset_scorer(tokenizer):
    return _init(PooledScorer(len(tokenizer)), 603, offset=FEATURE_OFFSET, spread=0.02, bias=1.0)


def load_quantized_scorer(tokenizer, device):
    """The RM checkpoint with dynamic int8 quantisation of its linear layers (to fit the CPU scoring node),
    as torch.ao.quantization.quantize_dynamic does it."""
    from torch.ao.quantization import quantize_dynamic

    rm = _offset_scorer(tokenizer).eval()
    return quantize_dynamic(rm, {nn.Linear}, dtype=torch.qint8).to(device)


def load_offset_scorer(tokenizer, device):
    """The same RM without quantisation (for the verification's comparison)."""
    return _offset_scorer(tokenizer).to(device).eval()


def load_logit_scorer(tokenizer, device):
    """A plain fp32 RM returning its logit (a correct reward model, for a control)."""
    return _init(PooledScorer(len(tokenizer)), 604, bias=0.5, spread=0.3).to(device).eval()
