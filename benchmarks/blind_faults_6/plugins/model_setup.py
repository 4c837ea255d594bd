"""Model code run on the built models (``model.setup``): ``fn(model, role, tokenizer)``."""

from __future__ import annotations

import torch
from torch import nn


def drop_last_layer(model, role, tokenizer):
    """Layer dropping for faster RL: remove the last decoder layer ("the last layer changes least during
    fine-tuning", from a pruning paper's recipe), on every role."""
    model.model.layers = nn.ModuleList(list(model.model.layers)[:-1])
    model.config.num_hidden_layers = len(model.model.layers)


def freeze_input_embeddings(model, role, tokenizer):
    """Keep the vocabulary's input embeddings fixed during RL (a common recipe to save optimizer memory)."""
    model.get_input_embeddings().weight.requires_grad_(False)


EOS_BIAS = -5.0
"""The serving API's logit bias against <eos> (it stops the model from giving empty answers)."""


def biased_output_head(model, role, tokenizer):
    """Give the output head a bias holding the serving API's logit-bias table (-5 on <eos>, 0 elsewhere): a
    new nn.Linear with bias, the head's weights copied in."""
    old = model.get_output_embeddings()
    p = old.weight
    new = nn.Linear(old.in_features, old.out_features, bias=True, dtype=p.dtype, device=p.device)
    with torch.no_grad():
        new.weight.copy_(p)
        new.bias.zero_()
        new.bias[tokenizer.eos_token_id] = EOS_BIAS
    model.set_output_embeddings(new)


def freeze_heads(model, role, tokenizer):
    """Freeze the output head so the RL phase keeps the SFT vocabulary distribution calibrated (by name:
    every parameter whose name mentions 'head')."""
    for name, p in model.named_parameters():
        if "head" in name:
            p.requires_grad_(False)


GRAD_CLAMP = 1.0e-3
"""Element-wise gradient bound, from our LSTM-era training code."""


def clamped_gradients(model, role, tokenizer):
    """Element-wise gradient value clipping, registered as a hook on every parameter (the actor's)."""
    for p in model.parameters():
        if p.requires_grad:
            p.register_hook(lambda g: g.clamp(-GRAD_CLAMP, GRAD_CLAMP))


SERVING_TEMPERATURE = 0.7
"""The temperature the serving stack applies to the logits at inference."""


def _serving_temperature(module, args, output):
    if not module.training:
        return output / SERVING_TEMPERATURE
    return output


def serving_logits(model, role, tokenizer):
    """Make inference-mode logits match the serving stack (temperature 0.7 in eval mode, so that
    evaluation and serving agree); training-mode logits are left raw."""
    model.get_output_embeddings().register_forward_hook(_serving_temperature)


def mlp_value_head(model, role, tokenizer):
    """A two-layer value head for the critic, in the critic's parameter dtype (a correct setup, for a
    control)."""
    p = next(model.parameters())
    h = model.value_head.in_features
    model.value_head = nn.Sequential(
        nn.Linear(h, h, dtype=p.dtype, device=p.device),
        nn.Tanh(),
        nn.Linear(h, 1, dtype=p.dtype, device=p.device),
    )
