"""Models of every role: the actor (causal LM), critic (backbone + value head), frozen reference, and
reward model, loaded from local Hugging Face directories or built from architecture presets.

Nothing is downloaded: a ``path`` is a local ``save_pretrained`` directory; otherwise a preset is
random-initialised (enough for precision, memory and speed work; the tiny preset also learns the
built-in tasks). Big presets are built directly on the target device in the target dtype, so a
7B init takes seconds on a GPU instead of minutes on a CPU. Under FSDP2 (`build_sharded_roles`) each
rank builds the presets on the meta device and materialises only its shards, with the values one
process draws. Exercised by `pytest tests/test_models.py` and `pytest tests/test_distributed.py`.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import logging
import math
import os
from typing import Any

import torch
from torch import nn
from transformers import (
    CONFIG_MAPPING,
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from trainer.config import ModelConfig
from trainer.logprobs import attention_inputs, position_ids_from_mask
from trainer.precision import TRAINABLE_ROLES, PrecisionPolicy, RolePolicy, cast_module, dtype_name
from trainer.tokenizer import build_tokenizer

log = logging.getLogger(__name__)

PRESETS: dict[str, dict[str, Any]] = {
    # vocab_size comes from the tokenizer (about 100 ids): the whole model is ~100k parameters.
    "tiny-llama": dict(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        max_position_embeddings=256,
    ),
    "llama-1b": dict(
        hidden_size=2048,
        num_hidden_layers=16,
        num_attention_heads=16,
        num_key_value_heads=16,
        intermediate_size=5504,
        max_position_embeddings=4096,
        vocab_size=32000,
    ),
    "llama2-7b": dict(
        hidden_size=4096,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=32,
        intermediate_size=11008,
        max_position_embeddings=4096,
        vocab_size=32000,
    ),
    "llama2-13b": dict(
        hidden_size=5120,
        num_hidden_layers=40,
        num_attention_heads=40,
        num_key_value_heads=40,
        intermediate_size=13824,
        max_position_embeddings=4096,
        vocab_size=32000,
    ),
    # Qwen2-7B-Instruct / Qwen2.5-7B-Instruct's config.json; Qwen2's attention has q/k/v biases (no o_proj
    # bias), which a LlamaConfig cannot express (its attention_bias adds all four)
    "qwen2-7b": dict(
        model_type="qwen2",
        hidden_size=3584,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
        intermediate_size=18944,
        max_position_embeddings=32768,
        vocab_size=152064,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
    ),
}
"""Architecture presets: config keyword arguments of the preset's ``model_type`` (``llama`` unless it says
otherwise: LlamaConfig). Presets without ``vocab_size`` take it from the tokenizer; the others keep their
model's (our tokenizer's ids are a subset)."""

_ROPE_KWARGS = frozenset({"rope_theta", "rope_scaling"})
"""Accepted by every supported transformers release's config constructors, though 5.x keeps them in
``rope_parameters`` (so they are not in ``to_dict()``)."""

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def enable_checkpointing(model: nn.Module) -> None:
    """Activation checkpointing, non-reentrant. transformers 5.2x renamed the API
    (``activation_checkpointing_enable``); the GPU machine's 5.17 may only have the old name."""
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    # transformers also hooks the embedding to make its output require grad, which only reentrant
    # checkpointing needs; the hook's requires_grad_() stops torch.compile's tracing of the rollout's
    # decode forward (rollout.compile), so it goes.
    if getattr(model, "_require_grads_hook", None) is not None or getattr(
        model, "_require_grads_hooks", None
    ):
        model.disable_input_require_grads()


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The model's checkpointable decoder layers, in order (transformers' ``GradientCheckpointingLayer``)."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    return [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]


def apply_checkpointing(
    model: nn.Module, policy: RolePolicy, *, where: str = "precision.checkpoint_layers"
) -> None:
    """The role's checkpointing: every decoder layer, or only the first ``policy.checkpoint_layers``.
    The unchecked layers are the last ones: their activations are the first the backward frees, and
    the backward starts on them without a recompute."""
    if not policy.grad_checkpointing:
        return
    enable_checkpointing(model)
    n = policy.checkpoint_layers
    if n is None:
        return
    layers = decoder_layers(model)
    if n > len(layers):
        raise ValueError(
            f"{where}: {n}, but the {policy.role} model has {len(layers)} decoder layers; "
            f"use at most {len(layers)} (or leave it unset to checkpoint all)"
        )
    for layer in layers[n:]:
        layer.gradient_checkpointing = False


_CACHE_KWARGS = ("past_key_values", "past_key_value", "cache", "layer_past")
_COMPILED: dict[type, Any] = {}


def _compiled_layer_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """A decoder layer's forward through ``torch.compile`` when it runs as a training or frozen
    forward; eagerly when it reads or writes a KV cache (rollout: the decode engines capture or loop
    themselves) or while hooks watch it (the full audit level's probes must see every module)."""
    cls = type(self)
    eager = any(kwargs.get(k) is not None for k in _CACHE_KWARGS) or any(
        m._forward_hooks or m._forward_pre_hooks for m in self.modules()
    )
    if eager:
        return cls.forward(self, *args, **kwargs)
    fn = _COMPILED.get(cls)
    if fn is None:
        # one compiled function per layer class: the layers share the traced code, parameters are
        # inputs. Static shapes: batches are padded to fixed lengths, so each step shape (rollout
        # scoring, micro-batch) compiles once instead of a second, dynamic-shape recompile (seen as
        # one slow GRPO step on the H200)
        fn = _COMPILED[cls] = torch.compile(cls.forward, dynamic=False)
    return fn(self, *args, **kwargs)


def compile_layers(model: nn.Module) -> int:
    """Routes every decoder layer's forward through `_compiled_layer_forward` (Inductor fuses the
    norms, rotary embedding, SiLU-mul and residual adds between the GEMMs). Returns the layer count."""
    import types

    layers = decoder_layers(model)
    for layer in layers:
        layer.forward = types.MethodType(_compiled_layer_forward, layer)
    return len(layers)


def disable_checkpointing(model: nn.Module) -> None:
    if hasattr(model, "activation_checkpointing_disable"):
        model.activation_checkpointing_disable()
    elif hasattr(model, "gradient_checkpointing_disable"):
        model.gradient_checkpointing_disable()


def is_checkpointing(model: nn.Module) -> bool:
    """Whether activation checkpointing is on (either transformers API name, or our ValueModel)."""
    for name in ("is_activation_checkpointing", "is_gradient_checkpointing"):
        if hasattr(type(model), name) or hasattr(model, name):
            return bool(getattr(model, name))
    return False


def load_tokenizer(model_cfg: ModelConfig) -> PreTrainedTokenizerBase:
    """``model.tokenizer`` dir, else ``model.path`` when it holds a tokenizer, else the project's own.

    Padding side is forced to left whatever the files say: decoder-only generation continues from the
    last position, so prompts must end flush right. ``tokenizer.load_notes`` lists what was decided;
    ``tokenizer.overridden_settings`` what of a user's tokenizer was replaced (`overridden`: the padding
    side, a pad token taken from eos), with both values.
    """
    notes: list[str] = []
    user = model_cfg.tokenizer is not None or model_cfg.path is not None  # else the project's own
    if model_cfg.tokenizer is not None:
        _require_dir(model_cfg.tokenizer, "model.tokenizer", "a tokenizer directory (save_pretrained layout)")
        tok = _auto_tokenizer(model_cfg.tokenizer, "model.tokenizer")
        notes.append(f"tokenizer from model.tokenizer={model_cfg.tokenizer}")
    elif model_cfg.path is not None and any(
        os.path.isfile(os.path.join(model_cfg.path, f)) for f in _TOKENIZER_FILES
    ):
        tok = _auto_tokenizer(model_cfg.path, "model.path")
        notes.append(f"tokenizer from model.path={model_cfg.path}")
    else:
        user = False
        tok = build_tokenizer()
        notes.append(
            "project character tokenizer (trainer.tokenizer.build_tokenizer): no tokenizer directory given"
        )
    key = "model.tokenizer" if model_cfg.tokenizer is not None else "model.path"
    recorded = [overridden(f"{key} tokenizer padding_side", tok.padding_side, "left")] if user else []
    if user and tok.pad_token_id is None and tok.eos_token_id is not None:
        recorded.append(overridden(f"{key} tokenizer pad_token", None, tok.eos_token))
    if tok.padding_side != "left":
        notes.append(
            f"padding_side forced left (was {tok.padding_side}): prompts must end flush right for generation"
        )
        tok.padding_side = "left"
    if tok.pad_token_id is None:
        if tok.eos_token_id is None:
            raise ValueError(
                "model.tokenizer: the tokenizer has neither a pad nor an eos token; add a pad token"
            )
        tok.pad_token = tok.eos_token
        notes.append("tokenizer has no pad token: using eos as pad")
    for n in notes:
        log.info(n)
    tok.load_notes = notes
    tok.overridden_settings = recorded
    return tok


def _auto_tokenizer(path: str, where: str) -> PreTrainedTokenizerBase:
    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise ValueError(
            f"{where}: could not load a tokenizer from {path!r}: {e}. Point it at a directory written by "
            "tokenizer.save_pretrained, or leave it unset to use the project's tokenizer"
        ) from e


def _require_dir(path: str, where: str, what: str) -> None:
    if not os.path.exists(path):
        raise ValueError(
            f"{where}: {path!r} does not exist; expected {what} (nothing is downloaded from a hub)"
        )
    if not os.path.isdir(path):
        raise ValueError(f"{where}: {path!r} is a file; expected {what}")


def _require_hf_dir(path: str, where: str) -> None:
    what = "a local Hugging Face model directory (save_pretrained layout: config.json + weights)"
    _require_dir(path, where, what)
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ValueError(f"{where}: {path!r} has no config.json; expected {what}")


def preset_config(
    model_cfg: ModelConfig, tokenizer: PreTrainedTokenizerBase, **extra: Any
) -> PretrainedConfig:
    """The config of ``model.preset`` (a LlamaConfig, or its ``model_type``'s) with ``model.overrides``
    applied and special ids set."""
    if model_cfg.preset not in PRESETS:
        raise ValueError(
            f"model.preset: unknown preset {model_cfg.preset!r}; expected one of {', '.join(PRESETS)} "
            "(or set model.path to a local model directory)"
        )
    preset = dict(PRESETS[model_cfg.preset])
    config_cls = CONFIG_MAPPING[preset.pop("model_type", "llama")]
    kwargs: dict[str, Any] = {"vocab_size": len(tokenizer), **preset}
    known = set(config_cls().to_dict()) | _ROPE_KWARGS
    for key, value in model_cfg.overrides.items():
        if key not in known:
            raise ValueError(
                f"model.overrides.{key}: not a {config_cls.__name__} field; e.g. num_hidden_layers, hidden_size"
            )
        kwargs[key] = value
    if kwargs["vocab_size"] < len(tokenizer):
        raise ValueError(
            f"model.overrides.vocab_size: {kwargs['vocab_size']} is smaller than the tokenizer ({len(tokenizer)} ids)"
        )
    kwargs.update(
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        **extra,
    )
    return config_cls(**kwargs)


def _finish(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, policy: RolePolicy, *, source: str | None
) -> PreTrainedModel:
    """The model as the trainer uses it. Its generation config takes the tokenizer's special ids (the
    rollout stops at the tokenizer's eos); for a checkpoint (``source``: the key that named it) the
    values it had are recorded in ``model.overridden_settings`` (`overridden`), never replaced silently."""
    # Training forwards never need the KV cache; rollout passes use_cache=True to generate itself.
    model.config.use_cache = False
    gen = getattr(model, "generation_config", None)
    recorded = []
    if gen is not None:
        for key in ("eos_token_id", "pad_token_id", "bos_token_id"):
            used = getattr(tokenizer, key)
            if source is not None:
                recorded.append(
                    overridden(f"{source} generation_config.{key}", getattr(gen, key, None), used)
                )
            setattr(gen, key, used)
    model.overridden_settings = recorded
    apply_checkpointing(model, policy)
    return model


def overridden(setting: str, yours: Any, used: Any) -> dict[str, Any]:
    """One setting of the user's (a checkpoint's, a tokenizer's) that the trainer replaces: both values,
    for the run's manifest (``overridden``); a warning in the log when they differ."""
    differs = yours != used and not (isinstance(yours, (list, tuple)) and list(yours) == [used])
    if differs:
        log.warning("%s: yours is %r, the trainer uses %r", setting, yours, used)
    return {"setting": setting, "yours": yours, "used": used, "differs": differs}


def build_causal_lm(
    model_cfg: ModelConfig,
    tokenizer: PreTrainedTokenizerBase,
    policy: RolePolicy,
    device: str | torch.device,
    *,
    seed: int,
) -> PreTrainedModel:
    """The actor: from ``model.path`` (weights loaded in ``policy.param_dtype``) or the preset, random
    init under ``torch.manual_seed(seed)``, built on ``device``."""
    device = torch.device(device)
    if model_cfg.path is not None:
        _require_hf_dir(model_cfg.path, "model.path")
        try:
            model, info = AutoModelForCausalLM.from_pretrained(
                model_cfg.path,
                dtype=policy.param_dtype,
                attn_implementation=model_cfg.attn_implementation,
                output_loading_info=True,
            )
            _keep_loading_report(model, info, "model.path", model_cfg.path)
        except (OSError, ValueError, KeyError) as e:
            raise ValueError(
                f"model.path: {model_cfg.path!r} is not a loadable causal LM directory: {e}"
            ) from e
        vocab = model.get_input_embeddings().num_embeddings
        if vocab < len(tokenizer):
            raise ValueError(
                f"model.tokenizer: tokenizer has {len(tokenizer)} ids but the model at {model_cfg.path!r} embeds "
                f"only {vocab}; use the tokenizer the model was trained with (model.tokenizer)"
            )
        model = model.to(device)
    else:
        config = preset_config(model_cfg, tokenizer)
        torch.manual_seed(seed)
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(
                config, dtype=policy.param_dtype, attn_implementation=model_cfg.attn_implementation
            )
    log.info(
        "actor %s: %s params in %s on %s",
        model_cfg.path or model_cfg.preset,
        sum(p.numel() for p in model.parameters()),
        dtype_name(policy.param_dtype),
        device,
    )
    return _finish(model, tokenizer, policy, source="model.path" if model_cfg.path is not None else None)


CRITIC_HEAD_SEED = 1
"""The critic's value head is drawn from ``seed + 1``: its init must not repeat the actor's first draws."""


class ValueModel(nn.Module):
    """Critic: a transformer backbone (no LM head) and a linear value head, hidden -> 1.

    Values come out in fp32 whatever the compute dtype (the head's output is upcast: part of the
    "loss" island), one per position: ``values[:, i]`` is the value of the state after token i.
    """

    def __init__(self, backbone: PreTrainedModel) -> None:
        super().__init__()
        self.backbone = backbone
        self.config = backbone.config
        p = next(backbone.parameters())
        self.value_head = nn.Linear(backbone.config.hidden_size, 1, device=p.device, dtype=p.dtype)
        # Small init: values start near 0 so early advantages come from rewards, not head noise.
        nn.init.normal_(self.value_head.weight, std=1.0 / (10.0 * math.sqrt(backbone.config.hidden_size)))
        nn.init.zeros_(self.value_head.bias)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        left_padded: bool | None = None,
    ) -> torch.Tensor:
        attn = attention_inputs(self.backbone, attention_mask, left_padded=left_padded)
        if position_ids is not None:
            attn["position_ids"] = position_ids
        out = self.backbone(input_ids=input_ids, use_cache=False, **attn)
        return self.value_head(out.last_hidden_state).squeeze(-1).float()

    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs: dict | None = None) -> None:
        """Non-reentrant activation checkpointing of the backbone's layers (kwargs ignored)."""
        enable_checkpointing(self.backbone)

    def gradient_checkpointing_disable(self) -> None:
        disable_checkpointing(self.backbone)

    @property
    def is_gradient_checkpointing(self) -> bool:
        return is_checkpointing(self.backbone)


def _backbone_prefix(lm: nn.Module) -> str:
    return getattr(lm, "base_model_prefix", "model")


def _backbone_of(lm: PreTrainedModel) -> PreTrainedModel:
    prefix = _backbone_prefix(lm)
    backbone = getattr(lm, prefix, None)
    if not isinstance(backbone, PreTrainedModel):
        raise ValueError(
            f"{type(lm).__name__} has no transformer backbone at .{prefix}; cannot build a critic"
        )
    return backbone


def _cast_copy(module: nn.Module, dtype: torch.dtype) -> nn.Module:
    """Deep copy with parameters created directly in ``dtype`` (no transient full-precision copy)."""
    memo: dict[int, Any] = {}
    for p in module.parameters():
        memo[id(p)] = nn.Parameter(p.detach().to(dtype=dtype, copy=True), requires_grad=p.requires_grad)
    out = copy.deepcopy(module, memo)
    return cast_module(out, dtype)  # buffers too, except the fp32 rotary ones


def build_critic(
    model_cfg: ModelConfig,
    tokenizer: PreTrainedTokenizerBase,
    policy: RolePolicy,
    device: str | torch.device,
    *,
    seed: int,
    actor: PreTrainedModel | None = None,
) -> ValueModel:
    """Critic backbone from ``model.critic_path``, else a copy of the actor's (initial) backbone: pass
    ``actor`` before its first update, or leave it None to rebuild the actor's init from ``seed``."""
    device = torch.device(device)
    if model_cfg.critic_path is not None:
        _require_hf_dir(model_cfg.critic_path, "model.critic_path")
        try:
            backbone, info = AutoModel.from_pretrained(
                model_cfg.critic_path,
                dtype=policy.param_dtype,
                attn_implementation=model_cfg.attn_implementation,
                output_loading_info=True,
            )
            backbone = backbone.to(device)
        except (OSError, ValueError, KeyError) as e:
            raise ValueError(
                f"model.critic_path: {model_cfg.critic_path!r} is not a loadable model: {e}"
            ) from e
        _keep_loading_report(backbone, info, "model.critic_path", model_cfg.critic_path)
        vocab = backbone.get_input_embeddings().num_embeddings
        if vocab < len(tokenizer):
            raise ValueError(
                f"model.critic_path: {model_cfg.critic_path!r} embeds {vocab} ids but the tokenizer has "
                f"{len(tokenizer)}; use a critic checkpoint with the tokenizer's vocabulary"
            )
    else:
        if actor is None:
            actor = build_causal_lm(
                model_cfg, tokenizer, dataclasses.replace(policy, grad_checkpointing=False), device, seed=seed
            )
        backbone = _cast_copy(_backbone_of(actor), policy.param_dtype)
        if is_checkpointing(backbone):
            disable_checkpointing(backbone)
    backbone.config.use_cache = False
    torch.manual_seed(seed + CRITIC_HEAD_SEED)
    critic = ValueModel(backbone).to(device)
    if hasattr(backbone, LOAD_REPORT_ATTR):
        setattr(critic, LOAD_REPORT_ATTR, getattr(backbone, LOAD_REPORT_ATTR))
    for p in critic.parameters():
        p.requires_grad_(True)
    apply_checkpointing(critic, policy)
    return critic


def build_reference(actor: nn.Module, policy: RolePolicy) -> nn.Module:
    """Frozen deep copy of ``actor`` in the reference role's parameter dtype, in eval mode."""
    ref = _cast_copy(actor, policy.param_dtype)
    if is_checkpointing(ref):
        disable_checkpointing(ref)
    ref.eval()
    ref.requires_grad_(False)
    return ref


def build_sharded_roles(
    model_cfg: ModelConfig,
    tokenizer: PreTrainedTokenizerBase,
    policy: PrecisionPolicy,
    info: Any,
    *,
    seed: int,
    critic_seed: int | None,
    reference: bool,
    reshard_after_forward: bool,
) -> dict[str, nn.Module]:
    """Actor, critic and reference of a sharded run (``info``: `trainer.distributed.DistInfo`), no rank
    ever holding a whole model: each is built on the meta device, sharded, and every rank materialises
    only its shards, filled with exactly the weights `build_causal_lm`, `build_critic` and
    `build_reference` give one process with the same seed (`trainer.meta_init` replays the actor's
    initialisation one parameter at a time; the reference and the critic's backbone take the same
    values in their own dtypes). ``critic_seed`` None: no critic. Random-init presets only: a
    ``model.path`` is loaded whole."""
    from trainer import distributed as D
    from trainer import meta_init

    meta = torch.device("meta")
    actor, actor_init = meta_init.record_init(
        lambda: build_causal_lm(model_cfg, tokenizer, policy["actor"], meta, seed=seed)
    )
    models: dict[str, nn.Module] = {"actor": actor}
    critic = critic_seed is not None
    if critic:
        models["critic"], head_init = meta_init.record_init(
            lambda: build_critic(model_cfg, tokenizer, policy["critic"], meta, seed=critic_seed, actor=actor)
        )
    if reference:
        models["reference"] = build_reference(actor, policy["reference"])
    for role, model in models.items():
        D.shard_model(model, policy[role], reshard_after_forward=reshard_after_forward)
        model.to_empty(device=info.device)
    filled: set[tuple[str, str]] = set()

    def fill(role: str, name: str, value: torch.Tensor) -> None:
        meta_init.copy_shard_(models[role].get_parameter(name), value)
        filled.add((role, name))

    prefix = f"{_backbone_prefix(actor)}."

    def actor_value(name: str, value: torch.Tensor) -> None:
        fill("actor", name, value)
        if reference:
            fill("reference", name, value)
        if critic and name.startswith(prefix):
            fill("critic", "backbone." + name.removeprefix(prefix), value)

    meta_init.replay_init(actor_init, info.device, seed, actor_value)
    if critic:
        meta_init.replay_init(
            head_init, info.device, critic_seed + CRITIC_HEAD_SEED, lambda n, v: fill("critic", n, v)
        )
    for role, model in models.items():
        meta_init.rebuild_buffers(model, info.device)
        missing = [n for n, _ in model.named_parameters() if (role, n) not in filled]
        if missing:
            raise ValueError(f"{role}: no initialisation recorded for {', '.join(missing[:3])} (meta init)")
    return models


def build_reward_model(
    model_cfg: ModelConfig,
    tokenizer: PreTrainedTokenizerBase,
    policy: RolePolicy,
    device: str | torch.device,
    *,
    seed: int = 0,
) -> nn.Module | None:
    """``model.reward_model``: None when unset; ``preset:<name>`` -> random-init
    LlamaForSequenceClassification; a local directory -> AutoModelForSequenceClassification
    (num_labels=1); ``module:attr`` / ``file.py:attr`` -> the user's loader called with
    (tokenizer, device). Built-ins are frozen, in eval mode, in the reward role's parameter dtype;
    a user loader's model is left exactly as returned (the audit checks it against the policy)."""
    spec = model_cfg.reward_model
    if spec is None:
        return None
    device = torch.device(device)
    where = "model.reward_model"
    if spec.startswith("preset:"):
        cfg = preset_config(ModelConfig(preset=spec.removeprefix("preset:")), tokenizer, num_labels=1)
        torch.manual_seed(seed + 2)
        with torch.device(device):
            rm = AutoModelForSequenceClassification.from_config(
                cfg, dtype=policy.param_dtype, attn_implementation=model_cfg.attn_implementation
            )
    elif os.path.isdir(spec):
        _require_hf_dir(spec, where)
        try:
            rm, info = AutoModelForSequenceClassification.from_pretrained(
                spec,
                num_labels=1,
                dtype=policy.param_dtype,
                attn_implementation=model_cfg.attn_implementation,
                output_loading_info=True,
            )
            rm = rm.to(device)
            _keep_loading_report(rm, info, where, spec)
        except (OSError, ValueError, KeyError) as e:
            raise ValueError(f"{where}: {spec!r} is not a loadable sequence-classification model: {e}") from e
        if rm.config.pad_token_id is None:
            rm.config.pad_token_id = tokenizer.pad_token_id
    elif ":" in spec:
        from trainer.plugins import resolve_callable
        from trainer.setup_probe import pretrained_into, recording_pretrained

        loader = resolve_callable(spec, where)
        with recording_pretrained() as pretrained:
            rm = loader(tokenizer, device)
        if not isinstance(rm, nn.Module):
            raise ValueError(
                f"{where}: loader {spec!r} returned {type(rm).__name__}; expected a torch.nn.Module"
            )
        reports = pretrained_into(rm, pretrained, f"{where} ({spec})")
        if reports:  # what the checkpoint the user's loader read lacked
            setattr(rm, LOAD_REPORT_ATTR, reports[0])
        return rm
    else:
        raise ValueError(
            f"{where}: {spec!r} is neither an existing directory, 'preset:<name>' "
            f"(presets: {', '.join(PRESETS)}) nor 'module:attr' / 'path/to/file.py:attr'"
        )
    rm.config.use_cache = False
    rm.eval()
    rm.requires_grad_(False)
    return rm


LOAD_REPORT_ATTR = "load_report"
"""The attribute of a model loaded from a directory that holds the weights its checkpoint lacked."""


def _keep_loading_report(model: nn.Module, info: Any, source: str, path: str) -> None:
    """Stores `trainer.setup_probe.loading_report` on ``model`` (the audit reads it) and logs it."""
    from trainer.setup_probe import loading_report

    report = loading_report(info, source, path)
    if report is not None:
        report["architectures"] = list(getattr(model.config, "architectures", None) or [])
        setattr(model, LOAD_REPORT_ATTR, report)
        log.warning("%s: %d weight(s) not in %s, newly initialised: %s", source, report["missing"], path,
                    ", ".join(report["missing_names"]))  # fmt: skip


def apply_setup(
    models: dict[str, nn.Module], model_cfg: ModelConfig, tokenizer: PreTrainedTokenizerBase
) -> dict[str, nn.Module]:
    """Runs the user's ``model.setup`` plug-ins on the built models, in role order: each is called as
    ``fn(model, role, tokenizer)`` and may change the model in place (returning None) or return the
    module that replaces it. Returns the (possibly replaced) models. An exception inside the user's
    function is re-raised with the plug-in and role named."""
    from trainer import setup_effect as E
    from trainer.plugins import resolve_callable
    from trainer.setup_diff import SETUP_CHANGES_ATTR, changes, snapshot, written
    from trainer.setup_probe import (
        loads_into,
        moved_or_none,
        pretrained_into,
        recording_loads,
        recording_pretrained,
    )

    plugins = model_cfg.setup_plugins()
    out = dict(models)
    loaded: dict[str, Any] = {}  # one import per plug-in: its module's state is shared by the roles
    wrote: dict[str, set[str]] = {}
    ptrs = _snapshot_or_none(models, E.pointers) or {}
    for role, model in models.items():
        spec = plugins.get(role, plugins.get("*"))
        if spec is None:
            continue
        where = "model.setup" if isinstance(model_cfg.setup, str) else f"model.setup.{role}"
        fn = loaded[spec] = loaded.get(spec) or resolve_callable(spec, where)
        before = _snapshot_or_none(model, snapshot)
        pre = _snapshot_or_none(model, lambda m: E.before(m, len(tokenizer)))
        try:
            with recording_loads() as loads, recording_pretrained() as pretrained:
                result = fn(model, role, tokenizer)
        except Exception as e:  # re-raised with the plug-in named: the traceback keeps the user's frames
            raise RuntimeError(f"{where}: {spec} raised for the {role} model: {type(e).__name__}: {e}") from e
        if result is not None and not isinstance(result, nn.Module):
            raise ValueError(
                f"{where}: {spec} returned {type(result).__name__} for the {role} model; return None (changed "
                "in place) or the torch.nn.Module that replaces it"
            )
        out[role] = model if result is None else result
        # what the user's code changed, for the audit to name it as the cause of what follows
        after = _snapshot_or_none(out[role], snapshot)
        if before is not None and after is not None:
            found = changes(before, after) + _probed(
                out[role], loads_into(out[role], loads), len(tokenizer), trains=role in TRAINABLE_ROLES
            )
            found += [{"aspect": "pretrained", **r} for r in pretrained_into(out[role], pretrained, where)]
            moved = moved_or_none(out[role], loads, pretrained)
            found += [{"aspect": "remapped", **moved}] if moved else []
            trains = role in TRAINABLE_ROLES
            found += (
                _snapshot_or_none(
                    out[role], lambda m, p=pre, t=trains: E.after(p, m, len(tokenizer), trains=t)
                )
                or []
            )
            record = {"key": where, "spec": spec, "role": role, "changes": found}
            setattr(out[role], SETUP_CHANGES_ATTR, record)
            wrote[role] = written(before, after)
    _compare_roles(out, wrote, SETUP_CHANGES_ATTR)
    _snapshot_or_none(out, lambda ms: E.add_shared(ptrs, ms, TRAINABLE_ROLES, SETUP_CHANGES_ATTR))
    return out


def _probed(
    model: nn.Module, loads: list[dict[str, Any]], vocab: int, *, trains: bool
) -> list[dict[str, Any]]:
    """`trainer.setup_probe`'s readings of a model after its setup, as aspects of its record: the
    state dicts loaded into it, and for a role that trains (a frozen one builds no graph by design)
    the autograd graph of one probe forward."""
    from trainer.setup_probe import graph_probe

    found: list[dict[str, Any]] = [{"aspect": "load", **c} for c in loads]
    try:
        graph = (graph_probe(model, vocab) if trains else None) or {}
    except Exception as e:  # the record is never the reason a run stops
        log.warning("model.setup: could not probe the graph of %s: %s", type(model).__name__, e)
        graph = {}
    return found + [{"aspect": k, **v} for k, v in graph.items()]


def _compare_roles(models: dict[str, nn.Module], wrote: dict[str, set[str]], attr: str) -> None:
    """Adds to each setup record the roles built from the same weights that disagree after setup."""
    from trainer.setup_probe import compare_roles

    try:
        pairs = compare_roles(models, wrote)
    except Exception as e:
        log.warning("model.setup: could not compare the roles after setup: %s", e)
        return
    for pair in pairs:
        for role in pair["setup"]:
            rec = getattr(models[role], attr, None)
            if isinstance(rec, dict):
                rec["changes"].append({"aspect": "roles", **pair})


def _snapshot_or_none(model: nn.Module, snapshot: Any) -> dict[str, Any] | None:
    """`trainer.setup_diff.snapshot`, or None for a model it cannot read: the record is never the
    reason a run stops."""
    try:
        return snapshot(model)
    except Exception as e:  # a user module with a property that raises, say
        log.warning("model.setup: could not record what the setup changed on %s: %s", type(model).__name__, e)
        return None


def score_with_reward_model(
    rm: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor
) -> torch.Tensor:
    """Raw scores [B] from a reward model, in whatever dtype it produced (not cast: the audit checks
    it). The caller owns autocast and no_grad. HF sequence classifiers score the last non-pad token."""
    kwargs = {"input_ids": input_ids, "attention_mask": attention_mask}
    try:
        if "position_ids" in inspect.signature(rm.forward).parameters:
            kwargs["position_ids"] = position_ids_from_mask(attention_mask)
    except (TypeError, ValueError):
        pass
    out = rm(**kwargs)
    scores = out.logits if hasattr(out, "logits") else out
    if not isinstance(scores, torch.Tensor):
        raise ValueError(
            f"model.reward_model: {type(rm).__name__} returned {type(out).__name__}; expected a tensor or .logits"
        )
    if scores.dim() == 2 and scores.shape[-1] == 1:
        scores = scores[:, 0]
    if scores.dim() != 1 or scores.shape[0] != input_ids.shape[0]:
        raise ValueError(
            f"model.reward_model: {type(rm).__name__} returned shape {tuple(scores.shape)}; expected one score per "
            f"sequence, [{input_ids.shape[0]}] or [{input_ids.shape[0]}, 1]"
        )
    return scores
