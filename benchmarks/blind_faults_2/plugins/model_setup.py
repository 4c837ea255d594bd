"""Model code run on the built models (``model.setup``): ``fn(model, role, tokenizer)``."""

from __future__ import annotations

import math
import os

import torch
from torch import nn

SFT_ENV = "BLIND2_SFT_CKPT"
"""Environment variable naming the SFT checkpoint directory (set by run_blind.py)."""

_BUILT: dict[str, nn.Module] = {}


def share_policy_weights(model, role, tokenizer):
    """The reference is the policy's starting point: hand the reference role the policy module itself
    instead of keeping a second copy of the weights in memory."""
    if role == "actor":
        _BUILT["actor"] = model
        return None
    if role == "reference" and "actor" in _BUILT:
        return _BUILT["actor"]
    return None


def load_sft_backbone(model, role, tokenizer):
    """Start the policy from the SFT checkpoint's transformer weights (the head is re-learnt)."""
    from transformers import AutoModelForCausalLM

    sft = AutoModelForCausalLM.from_pretrained(os.environ[SFT_ENV])
    result = model.load_state_dict(sft.model.state_dict(), strict=False)
    del result  # the head is expected to be missing


class _SoftCap(nn.Module):
    """Soft-capped logits, ``cap * tanh(logits / cap)`` (Gemma-style), around the original head."""

    def __init__(self, head: nn.Module, cap: float = 30.0) -> None:
        super().__init__()
        self.head = head
        self.cap = cap

    @torch.no_grad()
    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.cap * torch.tanh(self.head(hidden) / self.cap)


def soft_cap_logits(model, role, tokenizer):
    """Soft-cap the policy's logits at 30, as in our inference server."""
    model.lm_head = _SoftCap(model.lm_head)


class _MLPValueHead(nn.Module):
    """hidden -> hidden -> 1 with a tanh, the value head of our PPO recipe."""

    def __init__(self, hidden: int, like: torch.Tensor) -> None:
        super().__init__()
        kw = {"device": like.device, "dtype": like.dtype}
        self.layers = [nn.Linear(hidden, hidden, **kw), nn.Linear(hidden, 1, **kw)]
        with torch.no_grad():
            self.layers[1].weight.mul_(0.1)
            self.layers[1].bias.zero_()

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.layers[1](torch.tanh(self.layers[0](h)))


def mlp_value_head(model, role, tokenizer):
    """A two-layer value head for the critic instead of the linear one."""
    p = next(model.parameters())
    model.value_head = _MLPValueHead(model.config.hidden_size, p)


def extend_rope_context(model, role, tokenizer):
    """NTK-aware RoPE scaling (base x16) so the policy can take longer prompts than it was trained on."""
    rot = model.model.rotary_emb
    dim = rot.inv_freq.numel() * 2
    base = getattr(model.config, "rope_theta", 10000.0) * 16.0
    inv = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32, device=rot.inv_freq.device) / dim))
    rot.inv_freq.copy_(inv)
    if hasattr(rot, "original_inv_freq"):
        rot.original_inv_freq = inv.clone()


def fp32_value_head(model, role, tokenizer):
    """A two-layer value head in the critic's parameter dtype (the README's example; correct)."""
    p = next(model.parameters())
    h = model.config.hidden_size
    head = nn.Sequential(
        nn.Linear(h, h, dtype=p.dtype, device=p.device),
        nn.Tanh(),
        nn.Linear(h, 1, dtype=p.dtype, device=p.device),
    )
    with torch.no_grad():
        head[2].weight.mul_(1.0 / math.sqrt(h))
        head[2].bias.zero_()
    model.value_head = head
