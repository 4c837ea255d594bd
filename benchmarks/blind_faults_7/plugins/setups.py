"""Model setups (``model.setup: setups.py:<fn>``, or one per role), called as ``fn(model, role, tokenizer)``
after the models are built; each changes the model in place or returns its replacement."""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import nn

SFT_ENV = "BLIND7_SFT_CKPT"


def _sibling(name: str) -> str:
    return str(Path(os.environ[SFT_ENV]).parent / name)


def reference_from_checkpoint(model, role, tokenizer):
    """The reference role: load the team's 'reference' checkpoint, which the config points at the first
    saved SFT checkpoint (sft_early, after 12 steps) rather than the one the actor starts from."""
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(_sibling("sft_early"))
    model.load_state_dict(ref.state_dict())


_ACTOR: dict[str, nn.Module] = {}


def share_frozen_embeddings(model, role, tokenizer):
    """Every role: 'the embeddings are identical at the start, so the reference reuses the actor's' (to save
    memory); the actor's embedding module is kept and handed to the reference."""
    if role == "actor":
        _ACTOR["embed"] = model.get_input_embeddings()
    elif role == "reference" and "embed" in _ACTOR:
        model.set_input_embeddings(_ACTOR["embed"])


def round_vocab_to_32(model, role, tokenizer):
    """The actor: resize the embeddings to a multiple of 32 for the matmul kernels (rounding the vocabulary
    size 100 down to 96)."""
    model.resize_token_embeddings(len(tokenizer) // 32 * 32)


def tie_output_head(model, role, tokenizer):
    """The actor: tie the output head to the input embeddings to save its memory (the checkpoint was
    trained untied)."""
    model.lm_head.weight = model.get_input_embeddings().weight
    model.config.tie_word_embeddings = True


def serving_activation(model, role, tokenizer):
    """Every role: use the serving stack's fused GELU in the MLPs instead of the checkpoint's SiLU."""
    for module in model.modules():
        if hasattr(module, "act_fn") and hasattr(module, "gate_proj"):
            module.act_fn = nn.GELU()


class SoftCappedHead(nn.Module):
    """cap x tanh(logits / cap) on the output head (Gemma-2's final-logit soft-capping)."""

    def __init__(self, head: nn.Linear, cap: float) -> None:
        super().__init__()
        self.head = head
        self.cap = cap

    @property
    def weight(self):
        return self.head.weight

    def forward(self, x):
        return self.cap * torch.tanh(self.head(x) / self.cap)


def soft_cap_logits(model, role, tokenizer):
    """The actor: final-logit soft-capping from the serving config, whose value was taken from its
    `attn_logit_softcapping` line (1.0) instead of `final_logit_softcapping` (30.0)."""
    model.lm_head = SoftCappedHead(model.lm_head, cap=1.0)


def mlp_value_head(model, role, tokenizer):
    """The critic: a two-layer value head in the critic's dtype (a correct setup, for a control)."""
    p = next(model.parameters())
    h = model.config.hidden_size
    model.value_head = nn.Sequential(nn.Linear(h, h, dtype=p.dtype, device=p.device), nn.Tanh(),
                                     nn.Linear(h, 1, dtype=p.dtype, device=p.device))  # fmt: skip
    with torch.no_grad():
        model.value_head[2].weight.mul_(0.1)
        model.value_head[2].bias.zero_()


def _logit_noise(module, args, output):
    """Adds N(0, 0.5^2) exploration noise to the logits of every forward."""
    logits = output.logits if hasattr(output, "logits") else output
    noisy = logits + 0.5 * torch.randn_like(logits)
    if hasattr(output, "logits"):
        output.logits = noisy
        return output
    return noisy


def exploration_noise(model, role, tokenizer):
    """The actor: 'noisy-net' exploration from the team's bandit code, a forward hook adding Gaussian noise
    (std 0.5) to the logits of every forward, sampling and scoring alike."""
    model.register_forward_hook(_logit_noise)
