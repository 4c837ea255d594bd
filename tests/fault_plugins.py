"""Planted user code for the root-cause fault set: each function is something a user could plug into
a suite (``data.collator``, ``data.reward_fn``, ``model.reward_model``, ``model.setup``) and each is
wrong in one known way. `benchmarks/root_cause_faults.py` runs them through ``verlaudit run`` and
scores ``verlaudit diagnose``; `pytest tests/test_root_cause.py` runs a few of them.

The signatures are the plug-in points' (README "Plug-in points"): collators ``(examples, tokenizer)``,
reward functions ``(prompts, responses, examples)``, reward-model loaders ``(tokenizer, device)``,
model setup ``(model, role, tokenizer)``.
"""

from __future__ import annotations

import os
import signal

import torch
from torch import nn

from trainer.data import TASKS, PairCollator, PromptCollator

PROMPT_LENGTH = 8
"""The planted collators pad to this; the fault suites set data.prompt_length to the same."""
RESPONSE_LENGTH = 4

# ---------------------------------------------------------------- collators (examples, tokenizer)


def float_ids_collator(examples, tokenizer):
    """The builtin collator, then every tensor cast to float32 (ids and mask included)."""
    batch = PromptCollator(tokenizer, PROMPT_LENGTH)(examples)
    return {k: v.to(torch.float32) for k, v in batch.items()}


def out_of_vocab_collator(examples, tokenizer):
    """One id past the end of the vocabulary (a tokenizer from another model)."""
    batch = PromptCollator(tokenizer, PROMPT_LENGTH)(examples)
    batch["input_ids"][0, -1] = len(tokenizer) + 7
    return batch


def short_mask_collator(examples, tokenizer):
    """An attention mask one column shorter than the ids (an off-by-one in the padding code)."""
    batch = PromptCollator(tokenizer, PROMPT_LENGTH)(examples)
    batch["attention_mask"] = batch["attention_mask"][:, 1:]
    return batch


def right_padded_collator(examples, tokenizer):
    """Prompts padded on the right: generation continues from pad tokens."""
    batch = PromptCollator(tokenizer, PROMPT_LENGTH)(examples)
    ids, mask = batch["input_ids"], batch["attention_mask"]
    order = torch.argsort(mask, dim=1, descending=True, stable=True)
    return {"input_ids": ids.gather(1, order), "attention_mask": mask.gather(1, order)}


def list_collator(examples, tokenizer):
    """Python lists instead of tensors (a collator ported from a numpy pipeline)."""
    batch = PromptCollator(tokenizer, PROMPT_LENGTH)(examples)
    return {k: v.tolist() for k, v in batch.items()}


def float_pairs_collator(examples, tokenizer):
    """DPO pairs with the chosen ids cast to float32."""
    batch = PairCollator(tokenizer, PROMPT_LENGTH, RESPONSE_LENGTH)(examples)
    batch["chosen_input_ids"] = batch["chosen_input_ids"].float()
    return batch


# ---------------------------------------------------------------- rewards (prompts, responses, examples)


def _digits(prompts, responses, examples):
    return TASKS["digits"].reward(prompts, responses, examples)


def nan_reward(prompts, responses, examples):
    """The digits reward with one NaN (a log(0) in someone's scorer)."""
    r = torch.tensor(_digits(prompts, responses, examples), dtype=torch.float32)
    r[0] = float("nan")
    return r


def inf_reward(prompts, responses, examples):
    """The digits reward divided by a count that is zero for the first response: +inf."""
    r = _digits(prompts, responses, examples)
    return [float("inf")] + r[1:]


def constant_reward(prompts, responses, examples):
    """Every response scores 1.0 (a reward that ignores the response): no learning signal."""
    return [1.0] * len(responses)


def float64_reward(prompts, responses, examples):
    """The digits reward as a float64 tensor."""
    return torch.tensor(_digits(prompts, responses, examples), dtype=torch.float64)


def column_reward(prompts, responses, examples):
    """The digits reward as a [B, 1] column (a score head's output, not squeezed)."""
    return torch.tensor(_digits(prompts, responses, examples)).reshape(-1, 1)


def bf16_reward(prompts, responses, examples):
    """The digits reward in bf16 (a scorer that computes in the model's dtype)."""
    return torch.tensor(_digits(prompts, responses, examples), dtype=torch.bfloat16)


def short_reward(prompts, responses, examples):
    """One reward fewer than there are responses."""
    return _digits(prompts, responses, examples)[:-1]


_calls = {"raising": 0, "kill": 0}


def raising_reward(prompts, responses, examples):
    """Fails on its second call (step 1): a key the scorer expects is missing."""
    _calls["raising"] += 1
    if _calls["raising"] >= 2:
        return [ex["ground_truth"] for ex in examples]  # KeyError: the digits examples have 'answer'
    return _digits(prompts, responses, examples)


def sigkill_reward(prompts, responses, examples):
    """The process is killed (SIGKILL, as the kernel's OOM killer does) on the second call."""
    _calls["kill"] += 1
    if _calls["kill"] >= 2:
        os.kill(os.getpid(), signal.SIGKILL)
    return _digits(prompts, responses, examples)


# ---------------------------------------------------------------- reward models (tokenizer, device)


def _tiny_classifier(tokenizer, device, num_labels: int = 1, dtype=torch.float32):
    from transformers import LlamaConfig, LlamaForSequenceClassification

    cfg = LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=len(tokenizer),
        max_position_embeddings=128,
        num_labels=num_labels,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    return LlamaForSequenceClassification(cfg).to(device=device, dtype=dtype).eval()


def fp16_reward_model(tokenizer, device):
    """A reward model returned in fp16 whatever the policy says (a loader that hard-codes the dtype)."""
    return _tiny_classifier(tokenizer, device, dtype=torch.float16)


def nan_head_reward_model(tokenizer, device):
    """A reward model whose score head holds a NaN (a corrupted checkpoint)."""
    rm = _tiny_classifier(tokenizer, device)
    with torch.no_grad():
        rm.score.weight[0, 3] = float("nan")
    return rm


class _Normalised(nn.Module):
    """Scores divided by a per-sequence count that is zero: 0/0 and x/0 for every sequence."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, input_ids, attention_mask):
        scores = self.inner(input_ids=input_ids, attention_mask=attention_mask).logits
        return scores / (input_ids[:, -1:] * 0).float()


def dividing_reward_model(tokenizer, device):
    """A reward model wrapper whose normalisation divides by zero."""
    return _Normalised(_tiny_classifier(tokenizer, device))


def two_logit_reward_model(tokenizer, device):
    """A classifier with two labels where the trainer expects one score per sequence."""
    return _tiny_classifier(tokenizer, device, num_labels=2)


# ---------------------------------------------------------------- model setup (model, role, tokenizer)


def bf16_value_head(model, role, tokenizer):
    """A custom value head built in bf16 for an fp32 critic."""
    hidden = model.config.hidden_size
    model.value_head = nn.Linear(hidden, 1, dtype=torch.bfloat16, device=next(model.parameters()).device)


def bf16_output_hook(model, role, tokenizer):
    """A forward hook that casts the first decoder layer's hidden states to bf16 (silently: the next
    layer's fp32 weights promote them back, after the precision is gone)."""
    layer = model.get_decoder().layers[0]

    def hook(module, args, output):
        if isinstance(output, tuple):
            return (output[0].to(torch.bfloat16), *output[1:])
        return output.to(torch.bfloat16)

    layer.register_forward_hook(hook)


def bf16_value_hook(model, role, tokenizer):
    """A forward hook that casts one attention's value projection to bf16: attention then mixes dtypes."""
    proj = model.get_decoder().layers[1].self_attn.v_proj
    proj.register_forward_hook(lambda module, args, output: output.to(torch.bfloat16))


class LogActivation(nn.Module):
    """An activation rewritten as log(x): NaN for every negative pre-activation."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log(x)


def log_activation(model, role, tokenizer):
    """A modified module: the second layer's MLP activation replaced by log(x)."""
    model.get_decoder().layers[1].mlp.act_fn = LogActivation()


def late_inv_freq_cast(model, role, tokenizer):
    """Rotary ``inv_freq`` cast to bf16 by a hook that runs on the model's third forward (after setup)."""
    rotary = model.get_decoder().rotary_emb
    calls = {"n": 0}

    def pre_hook(module, args, kwargs):
        calls["n"] += 1
        if calls["n"] == 3:
            rotary.inv_freq = rotary.inv_freq.to(torch.bfloat16)

    model.register_forward_pre_hook(pre_hook, with_kwargs=True)


def bf16_mlp_cast(model, role, tokenizer):
    """One MLP cast to bf16 in an fp32 model (to save memory, say)."""
    model.get_decoder().layers[0].mlp.to(torch.bfloat16)


def scaled_down_proj(model, role, tokenizer):
    """One layer's down projection scaled by 3e4 (a checkpoint saved from a broken conversion)."""
    with torch.no_grad():
        model.get_decoder().layers[1].mlp.down_proj.weight.mul_(3e4)


def fp16_reference(model, role, tokenizer):
    """The reference returned in fp16 whatever the policy says."""
    return model.half()


def scaling_hook(model, role, tokenizer):
    """A forward hook that multiplies the first MLP's output by 1e6 (a leftover debugging scale)."""
    model.get_decoder().layers[0].mlp.register_forward_hook(lambda module, args, output: output * 1e6)


def nan_hook(model, role, tokenizer):
    """A forward hook that writes a NaN into one projection's output."""

    def hook(module, args, output):
        output = output.clone()
        output.view(-1)[0] = float("nan")
        return output

    model.get_decoder().layers[1].mlp.down_proj.register_forward_hook(hook)


def bf16_lm_head(model, role, tokenizer):
    """The LM head cast to bf16 in an fp32 model."""
    model.lm_head.to(torch.bfloat16)
