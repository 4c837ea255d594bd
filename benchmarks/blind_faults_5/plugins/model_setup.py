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


HEAD_SCALE = 0.1
"""The calibration factor fitted on the RM team's held-out set (a temperature of 10, baked into the head)."""


def calibrated_head(model, role, tokenizer):
    """Bake the calibration temperature into the output head (its weights x 0.1), so that every consumer of
    the logits gets calibrated probabilities."""
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(HEAD_SCALE)


def unscaled_attention(model, role, tokenizer):
    """Attention scaling 1.0, as in the reference implementation we ported (which folds 1/sqrt(d) into the
    query projection at export time)."""
    for layer in model.model.layers:
        layer.self_attn.scaling = 1.0


def fresh_linear_layers(model, role, tokenizer):
    """Re-initialise the linear layers before training ("so every head starts from PyTorch's default init";
    written for the value head, it walks every module)."""
    for m in model.modules():
        if isinstance(m, nn.Linear):
            m.reset_parameters()


class _Checkpointed(nn.Module):
    """A decoder layer run under ``torch.utils.checkpoint`` (reentrant), keyword arguments bound."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, hidden_states, *args, **kwargs):
        import functools

        from torch.utils.checkpoint import checkpoint

        return checkpoint(functools.partial(self.layer, **kwargs), hidden_states, *args, use_reentrant=True)


def checkpointed_frozen_embeddings(model, role, tokenizer):
    """Save memory: freeze the embeddings and checkpoint every decoder layer (our own wrapper, reentrant
    checkpointing)."""
    import warnings

    warnings.filterwarnings("ignore", message="None of the inputs have requires_grad")
    model.get_input_embeddings().requires_grad_(False)
    layers = model.model.layers
    for i in range(len(layers)):
        layers[i] = _Checkpointed(layers[i])


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
