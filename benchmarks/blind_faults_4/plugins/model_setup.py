"""Model code run on the built models (``model.setup``): ``fn(model, role, tokenizer)``."""

from __future__ import annotations

import math

import torch
from torch import nn

_BUILT: dict[str, nn.Module] = {}


def shared_trunk(model, role, tokenizer):
    """Actor and critic share one transformer trunk (saves a copy of the weights): the critic's backbone
    is replaced by the actor's decoder."""
    if role == "actor":
        _BUILT["actor"] = model
    elif role == "critic" and "actor" in _BUILT:
        model.backbone = _BUILT["actor"].model


STABLE_NORM_EPS = 1.0
"""The RMSNorm epsilon of the recipe we copied "for bf16 stability"."""


def stable_norm_eps(model, role, tokenizer):
    """Raise every RMSNorm's epsilon (guards the rsqrt against tiny variances in bf16)."""
    for m in model.modules():
        if hasattr(m, "variance_epsilon"):
            m.variance_epsilon = STABLE_NORM_EPS


class PolicyWrapper(nn.Module):
    """Our wrapper adding a temperature buffer in front of the language model (forward only)."""

    def __init__(self, lm: nn.Module, temperature: float = 1.0) -> None:
        super().__init__()
        self.lm = lm
        self.register_buffer("temperature", torch.tensor(float(temperature)))

    def forward(self, *args, **kwargs):
        out = self.lm(*args, **kwargs)
        out.logits = out.logits / self.temperature
        return out


def wrapped_policy(model, role, tokenizer):
    """Return the policy inside our wrapper module."""
    return PolicyWrapper(model)


SCORE_RANGE = (-1.0, 1.0)
"""The score range our previous reward model was calibrated to."""


def _clamp_scores(module, args, output):
    output.logits = output.logits.clamp(*SCORE_RANGE)
    return output


def calibrated_reward_range(model, role, tokenizer):
    """Clamp the reward model's scores to the calibrated range (guards against outlier scores)."""
    model.register_forward_hook(_clamp_scores)


LORA_RANK, LORA_ALPHA = 4, 64


class LoRALinear(nn.Module):
    """``base(x) + (alpha / r) * B(A(x))`` with the base frozen; A and B both initialised like a linear
    layer's weight."""

    def __init__(self, base: nn.Linear) -> None:
        super().__init__()
        self.base = base
        kw = {"device": base.weight.device, "dtype": base.weight.dtype}
        self.lora_a = nn.Parameter(torch.empty(LORA_RANK, base.in_features, **kw))
        self.lora_b = nn.Parameter(torch.empty(base.out_features, LORA_RANK, **kw))
        nn.init.kaiming_uniform_(self.lora_a, a=math.sqrt(5))
        nn.init.kaiming_uniform_(self.lora_b, a=math.sqrt(5))
        self.scale = LORA_ALPHA / LORA_RANK

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.scale * ((x @ self.lora_a.t()) @ self.lora_b.t())


def lora_policy(model, role, tokenizer):
    """LoRA on the attention projections of the policy; the base weights are frozen."""
    model.requires_grad_(False)
    for layer in model.model.layers:
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            setattr(layer.self_attn, name, LoRALinear(getattr(layer.self_attn, name)))


MEAN_RETURN = 50.5
"""The mean return of the reward in use (50 + credit), measured on an earlier run."""


def value_bias_at_mean_return(model, role, tokenizer):
    """Warm-start the value head at the mean return: bias = the mean, small weights."""
    with torch.no_grad():
        model.value_head.weight.normal_(0.0, 0.02)
        model.value_head.bias.fill_(MEAN_RETURN)


def zero_bias_value_head(model, role, tokenizer):
    """The value head re-initialised with a zero bias and small weights (a correct setup, for a control)."""
    with torch.no_grad():
        model.value_head.weight.normal_(0.0, 0.02)
        model.value_head.bias.zero_()
