"""Model code run on the built models (``model.setup``): ``fn(model, role, tokenizer)``."""

from __future__ import annotations

import math

import torch
from torch import nn

NEFTUNE_ALPHA = 5.0
"""NEFTune's noise scale, as in the SFT recipe this setup was copied from."""


def _neftune_hook(module, args, output):
    if module.training:
        dims = output.shape[1] * output.shape[2]
        mag = NEFTUNE_ALPHA / math.sqrt(dims)
        output = output + torch.zeros_like(output).uniform_(-mag, mag)
    return output


def neftune_embeddings(model, role, tokenizer):
    """NEFTune: uniform noise on the input embeddings while the model is in training mode (it helped our
    SFT run)."""
    model.get_input_embeddings().register_forward_hook(_neftune_hook)


def relu_mlp(model, role, tokenizer):
    """Use ReLU in the MLPs (cheaper than SiLU on our inference hardware)."""
    for layer in model.model.layers:
        layer.mlp.act_fn = nn.ReLU()


def unscaled_attention(model, role, tokenizer):
    """Attention scaling 1.0, as in the reference implementation we ported (which folds 1/sqrt(d) into the
    query projection at export time)."""
    for layer in model.model.layers:
        layer.self_attn.scaling = 1.0


def init_value_friendly_weights(model, role, tokenizer):
    """Initialise the weights the library's way before training ("so every module starts from the same
    init scheme")."""
    model.apply(model._init_weights)


def checkpointed_frozen_embeddings(model, role, tokenizer):
    """Save memory: freeze the embeddings and turn on (reentrant) gradient checkpointing."""
    model.get_input_embeddings().requires_grad_(False)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})


def _scale_embeddings(module, args, output):
    return output * math.sqrt(output.shape[-1])


def normalised_embeddings(model, role, tokenizer):
    """Scale the input embeddings by sqrt(hidden_size), as the Gemma code we copied the block from does."""
    model.get_input_embeddings().register_forward_hook(_scale_embeddings)


def zero_bias_value_head(model, role, tokenizer):
    """The value head re-initialised with a zero bias and small weights (a correct setup, for a control)."""
    with torch.no_grad():
        model.value_head.weight.normal_(0.0, 0.02)
        model.value_head.bias.zero_()
