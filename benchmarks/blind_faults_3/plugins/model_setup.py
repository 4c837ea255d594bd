"""Model code run on the built models (``model.setup``): ``fn(model, role, tokenizer)``."""

from __future__ import annotations

import os

import torch
from torch import nn

SFT_ENV = "BLIND3_SFT_CKPT"
"""Environment variable naming the SFT checkpoint directory (set by run_blind.py)."""

LORA_RANK = 4


class LoRALinear(nn.Module):
    """``base(x) + B(A(x))`` with the base frozen; only A and B train."""

    def __init__(self, base: nn.Linear, rank: int = LORA_RANK) -> None:
        super().__init__()
        self.base = base
        kw = {"device": base.weight.device, "dtype": base.weight.dtype}
        self.lora_a = nn.Parameter(torch.zeros(rank, base.in_features, **kw))
        self.lora_b = nn.Parameter(torch.zeros(base.out_features, rank, **kw))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + (x @ self.lora_a.t()) @ self.lora_b.t()


def lora_adapters(model, role, tokenizer):
    """LoRA on every attention and MLP projection of the policy; the base weights are frozen."""
    model.requires_grad_(False)
    for layer in model.model.layers:
        for parent, names in ((layer.self_attn, ("q_proj", "k_proj", "v_proj", "o_proj")),
                              (layer.mlp, ("gate_proj", "up_proj", "down_proj"))):  # fmt: skip
            for name in names:
                setattr(parent, name, LoRALinear(getattr(parent, name)))


REFERENCE_TEMPERATURE = 0.7
"""The rollout temperature of our production recipe, applied to the reference's logits."""


def _temperature_hook(module, args, output):
    output.logits = output.logits / REFERENCE_TEMPERATURE
    return output


def reference_at_rollout_temperature(model, role, tokenizer):
    """Score the reference at the rollout temperature, so the KL compares like with like."""
    model.register_forward_hook(_temperature_hook)


VALUE_BIAS = 25.0
"""The reward model's score-head bias (its scores are centred there), copied into the value head."""


def value_head_from_reward_head(model, role, tokenizer):
    """Warm-start the critic's value head from the reward model's score head: its scale and bias."""
    with torch.no_grad():
        model.value_head.weight.mul_(0.5)
        model.value_head.bias.fill_(VALUE_BIAS)


def _converted_name(key: str, n_layers: int) -> str:
    """Our converter's name map from the training framework's export, which numbers the blocks from the
    output end (``blocks.0`` is the last layer)."""
    parts = key.split(".")
    if len(parts) > 2 and parts[1] == "layers":
        parts[2] = str(n_layers - 1 - int(parts[2]))
    return ".".join(parts)


def load_converted_sft(model, role, tokenizer):
    """Load the SFT checkpoint through the converter our training framework's exports need."""
    from transformers import AutoModelForCausalLM

    sft = AutoModelForCausalLM.from_pretrained(os.environ[SFT_ENV])
    n = sft.config.num_hidden_layers
    model.load_state_dict({_converted_name(k, n): v for k, v in sft.state_dict().items()}, strict=True)


def _drop_mask(module, args, kwargs):
    kwargs.pop("attention_mask", None)
    return args, kwargs


def mask_free_attention(model, role, tokenizer):
    """Take the mask-free (causal-only) attention path, which is faster: the prompts fill the batch."""
    model.register_forward_pre_hook(_drop_mask, with_kwargs=True)


def fp32_value_head_small_init(model, role, tokenizer):
    """The value head re-initialised small (a correct setup, for a control)."""
    with torch.no_grad():
        model.value_head.weight.normal_(0.0, 0.01)
        model.value_head.bias.zero_()
