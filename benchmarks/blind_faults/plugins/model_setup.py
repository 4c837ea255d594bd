"""Model code run on the built models (``model.setup``): ``fn(model, role, tokenizer)``."""

from __future__ import annotations

import torch
from torch import nn
from transformers import AutoModelForCausalLM


def load_reference(model, role, tokenizer):
    """The frozen reference: the policy's architecture, in eval mode, without gradients."""
    ref = AutoModelForCausalLM.from_config(model.config)
    ref.to(next(model.parameters()).device)
    ref.eval()
    ref.requires_grad_(False)
    return ref


def separate_output_head(model, role, tokenizer):
    """Give the output projection its own parameter, so it can be regularised on its own."""
    head = model.get_output_embeddings()
    head.weight = nn.Parameter(head.weight.detach().clone())


def mc_dropout_reward(model, role, tokenizer):
    """Score with attention dropout on (Monte-Carlo dropout), as the reward model was calibrated."""
    for module in model.modules():
        if hasattr(module, "attention_dropout"):
            module.attention_dropout = 0.3
    model.train()


def half_critic(model, role, tokenizer):
    """Keep the critic in half precision: it is only a value estimate."""
    model.half()


def bf16_policy(model, role, tokenizer):
    """The run is bf16: hold the policy in bf16 too."""
    model.to(torch.bfloat16)


def pad_vocab(model, role, tokenizer):
    """Round the embedding matrix up to a multiple of 64 rows (faster matmuls)."""
    model.resize_token_embeddings(len(tokenizer), pad_to_multiple_of=64)


def freeze_embeddings(model, role, tokenizer):
    """Keep the token embeddings fixed during RL; everything else trains."""
    for name, p in model.named_parameters():
        p.requires_grad_("embed_tokens" in name)


class FastRMSNorm(nn.Module):
    """RMSNorm computed in half precision end to end (no fp32 round trip)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, dtype: torch.dtype = torch.float16) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(self.weight.dtype)
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)


def use_fast_norm(model, role, tokenizer):
    """Swap the final norm for the half-precision RMSNorm, keeping its learned scale."""
    old = model.model.norm
    new = FastRMSNorm(old.weight.shape[0], old.variance_epsilon)
    with torch.no_grad():
        new.weight.copy_(old.weight)
    model.model.norm = new.to(old.weight.device)


def _to_bf16(module, args, output):
    return output.to(torch.bfloat16)


def compress_activations(model, role, tokenizer):
    """Keep decoder-layer outputs in bf16 to cut activation memory."""
    for layer in model.model.layers:
        layer.register_forward_hook(_to_bf16)
