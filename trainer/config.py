"""Frozen, documented training configuration, built from plain data with field-path errors.

`TrainConfig.from_dict(data, where="variants.bf16")` validates every key: unknown keys, wrong
types and out-of-range values raise ValueError naming the path (``variants.bf16.algo.lr: ...``)
and what is accepted. `to_dict()` round-trips. Exercised by `pytest tests/test_config.py`.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Mapping
from typing import Any

from trainer.precision import PRESETS, PrecisionPolicy, check_hardware, resolve_policy

ALGORITHMS = ("ppo", "grpo", "dpo")
KL_ESTIMATORS = ("k1", "k3")
DPO_LOSSES = ("sigmoid", "ipo")


class _Section:
    """Mixin: recursive from_dict / to_dict for keyword-only frozen dataclasses."""

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None, where: str = "") -> Any:
        data = {} if data is None else data
        if not isinstance(data, Mapping):
            raise ValueError(f"{where or cls.__name__}: expected a mapping, got {type(data).__name__}")
        hints = typing.get_type_hints(cls)
        fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
        kwargs: dict[str, Any] = {}
        for key, value in data.items():
            path = f"{where}.{key}" if where else str(key)
            if key not in fields:
                raise ValueError(f"{path}: unknown key; expected one of {', '.join(sorted(fields))}")
            kwargs[key] = _coerce(value, hints[key], path)
        try:
            return cls(**kwargs)
        except ValueError as e:
            msg = str(e)
            raise ValueError(f"{where}.{msg}" if where and not msg.startswith(where) else msg) from None

    def to_dict(self) -> dict[str, Any]:
        out = {}
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            v = getattr(self, f.name)
            out[f.name] = (
                v.to_dict() if isinstance(v, _Section) else (dict(v) if isinstance(v, Mapping) else v)
            )
        return out


def _coerce(value: Any, hint: Any, path: str) -> Any:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(hint)
        if value is None and type(None) in args:
            return None
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return _coerce(value, a, path)
            except ValueError as e:
                errors.append(str(e))
        raise ValueError(errors[0] if len(errors) == 1 else f"{path}: {value!r} matches none of {hint}")
    if isinstance(hint, type) and issubclass(hint, _Section):
        return hint.from_dict(value, path)
    if origin in (dict, Mapping, typing.Mapping):
        if not isinstance(value, Mapping):
            raise ValueError(f"{path}: expected a mapping, got {value!r}")
        return dict(value)
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise ValueError(f"{path}: expected a list, got {value!r}")
        return tuple(value)
    if hint is bool:
        if not isinstance(value, bool):
            raise ValueError(f"{path}: expected true or false, got {value!r}")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{path}: expected an integer, got {value!r}")
        return value
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            if isinstance(value, str):
                try:
                    return float(value)  # YAML reads 1e-6 as a string
                except ValueError:
                    pass
            raise ValueError(f"{path}: expected a number, got {value!r}")
        return float(value)
    if hint is str:
        if not isinstance(value, str):
            raise ValueError(f"{path}: expected a string, got {value!r}")
        return value
    return value


def _check(cond: bool, path: str, msg: str) -> None:
    if not cond:
        raise ValueError(f"{path}: {msg}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig(_Section):
    preset: str | None = "tiny-llama"
    """Architecture preset with random init (`trainer.models.PRESETS`), used when ``path`` is unset."""
    path: str | None = None
    """Local Hugging Face directory of a causal LM (``save_pretrained`` layout); wins over ``preset``."""
    tokenizer: str | None = None
    """Local tokenizer directory; default: the model directory, else the project's own tokenizer."""
    overrides: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    """Config fields changed on top of the preset (``num_hidden_layers: 2``)."""
    attn_implementation: str = "sdpa"
    """``sdpa``, ``eager`` or ``flash_attention_2``."""
    critic_path: str | None = None
    """Local directory for the critic backbone; default: a copy of the actor's initial weights."""
    reward_model: str | None = None
    """Reward model: a local sequence-classification directory, a preset name, or ``module:attr``
    loader; unset means the task's rule reward (or ``data.reward_fn``)."""
    compile: bool = False
    """``torch.compile`` every decoder layer (Inductor fuses norms, rotary, SiLU-mul and residual adds
    between the GEMMs) for training and frozen forwards; forwards with a KV cache (rollout) and
    forwards watched by the full audit's hooks stay eager. One process only."""

    def __post_init__(self) -> None:
        _check(self.path is not None or self.preset is not None, "preset", "set model.preset or model.path")
        _check(self.attn_implementation in ("sdpa", "eager", "flash_attention_2"), "attn_implementation",
               f"{self.attn_implementation!r}; expected sdpa, eager or flash_attention_2")  # fmt: skip


@dataclasses.dataclass(frozen=True, kw_only=True)
class DataConfig(_Section):
    task: str = "digits"
    """Built-in verifiable task (`trainer.data.TASKS`), ignored when ``dataset`` is set."""
    dataset: str | None = None
    """User dataset as ``module:attr`` or ``path/to/file.py:attr`` (a callable returning a list of
    dicts with ``prompt`` and, for DPO, ``chosen`` / ``rejected``)."""
    collator: str | None = None
    """User collator ``module:attr``: called with (list of examples, tokenizer), returns a dict."""
    reward_fn: str | None = None
    """User reward function ``module:attr``: (prompts, responses, examples) -> rewards."""
    prompt_length: int = 16
    """Maximum prompt tokens (prompts are left-padded to this)."""
    response_length: int = 8
    """Maximum new tokens in rollout; for DPO, maximum completion tokens."""
    num_examples: int = 2048
    """Examples generated by a built-in task."""

    def __post_init__(self) -> None:
        _check(self.prompt_length > 0, "prompt_length", f"must be > 0, got {self.prompt_length}")
        _check(self.response_length > 0, "response_length", f"must be > 0, got {self.response_length}")
        _check(self.num_examples > 0, "num_examples", f"must be > 0, got {self.num_examples}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class AlgoConfig(_Section):
    name: str = "ppo"
    """``ppo``, ``grpo`` or ``dpo``."""
    lr: float = 1e-4
    """Actor (policy) learning rate."""
    critic_lr: float = 1e-4
    """Critic learning rate (PPO)."""
    weight_decay: float = 0.0
    batch_size: int = 16
    """Prompts per step (PPO/GRPO; GRPO samples ``group_size`` responses each) or pairs (DPO)."""
    mini_batch_size: int = 8
    """Sequences per optimizer step inside an update epoch."""
    micro_batch_size: int = 8
    """Sequences per forward/backward; mini_batch_size / micro_batch_size = gradient accumulation."""
    ppo_epochs: int = 1
    """Passes over the rollout batch per step."""
    clip_ratio: float = 0.2
    """PPO/GRPO policy ratio clip epsilon."""
    value_clip: float = 0.2
    """PPO value clip range (0 disables clipping)."""
    vf_coef: float = 0.5
    entropy_coef: float = 0.0
    kl_coef: float = 0.05
    """KL penalty coefficient against the reference (0 disables the reference model)."""
    kl_estimator: str = "k1"
    """``k1`` (log-ratio, verl's ``kl``) or ``k3`` (verl's ``low_var_kl``)."""
    kl_in_reward: bool = True
    """PPO: KL as a per-token reward penalty (True) or a loss term (False). GRPO: always a loss term."""
    gamma: float = 1.0
    lam: float = 0.95
    group_size: int = 4
    """GRPO: responses sampled per prompt."""
    max_grad_norm: float = 1.0
    """Gradient clipping (0 disables)."""
    temperature: float = 1.0
    top_k: int = 0
    beta: float = 0.1
    """DPO beta (IPO tau)."""
    dpo_loss: str = "sigmoid"
    """``sigmoid`` (DPO) or ``ipo``."""
    normalize_advantages: bool = True
    """PPO: whiten advantages over the batch."""

    def __post_init__(self) -> None:
        _check(
            self.name in ALGORITHMS,
            "name",
            f"unknown algorithm {self.name!r}; expected one of {', '.join(ALGORITHMS)}",
        )
        _check(
            self.kl_estimator in KL_ESTIMATORS, "kl_estimator", f"{self.kl_estimator!r}; expected k1 or k3"
        )
        _check(self.dpo_loss in DPO_LOSSES, "dpo_loss", f"{self.dpo_loss!r}; expected sigmoid or ipo")
        for name in ("lr", "critic_lr", "temperature", "beta"):
            _check(getattr(self, name) > 0, name, f"must be > 0, got {getattr(self, name)}")
        for name in ("batch_size", "mini_batch_size", "micro_batch_size", "ppo_epochs", "group_size"):
            _check(getattr(self, name) >= 1, name, f"must be >= 1, got {getattr(self, name)}")
        _check(self.mini_batch_size % self.micro_batch_size == 0, "micro_batch_size",
               f"{self.micro_batch_size} must divide mini_batch_size {self.mini_batch_size}")  # fmt: skip
        _check(0 <= self.gamma <= 1 and 0 <= self.lam <= 1, "gamma", "gamma and lam must be in [0, 1]")
        _check(self.clip_ratio > 0, "clip_ratio", f"must be > 0, got {self.clip_ratio}")
        _check(self.kl_coef >= 0, "kl_coef", f"must be >= 0, got {self.kl_coef}")
        _check(self.max_grad_norm >= 0, "max_grad_norm", f"must be >= 0, got {self.max_grad_norm}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class PrecisionConfig(_Section):
    preset: str = "fp32"
    """``fp32``, ``fp16``, ``bf16`` or ``bf16-pure`` (`trainer.precision`)."""
    overrides: Mapping[str, Mapping[str, Any]] = dataclasses.field(default_factory=dict)
    """Per-role fields on top of the preset: ``{critic: {compute_dtype: bf16}}``."""
    grad_checkpointing: bool | Mapping[str, bool] = False
    """On for all trainable roles, or per role: ``{actor: true, critic: false}``."""
    checkpoint_layers: int | str | None = None
    """Selective checkpointing: checkpoint only the first N decoder layers (unset: all of them).
    ``auto`` is resolved by ``verlaudit run`` from the memory planner (fewest checkpointed layers
    that fit the target GPU); the trainer itself needs a number."""

    def __post_init__(self) -> None:
        _check(
            self.preset in PRESETS,
            "preset",
            f"unknown preset {self.preset!r}; expected one of {', '.join(PRESETS)}",
        )
        if self.checkpoint_layers == "auto":
            _check(self.grad_checkpointing is not False, "checkpoint_layers",
                   "auto needs grad_checkpointing: true")  # fmt: skip
            return
        # validating the fields is building the policy: built once here, read through `policy`
        policy = resolve_policy(self.preset, self.overrides, grad_checkpointing=self.grad_checkpointing,
                                checkpoint_layers=self.checkpoint_layers, where="")  # fmt: skip
        object.__setattr__(self, "_policy", policy)

    @property
    def policy(self) -> PrecisionPolicy:
        """The `trainer.precision.PrecisionPolicy` these fields describe (built when the config was)."""
        if self.checkpoint_layers == "auto":
            raise ValueError(
                "precision.checkpoint_layers: auto is chosen by `verlaudit run` from the memory planner "
                "before the trainer starts; run the trainer directly with a number of layers"
            )
        return self._policy  # type: ignore[attr-defined]

    def resolve(self, device: Any, *, where: str = "precision") -> PrecisionPolicy:
        """`policy`, refused (ValueError naming ``where``) when ``device`` cannot run it: bf16 on a GPU
        without bf16. For the trainer run alone; `verlaudit run` decides this from the target instead."""
        policy = self.policy
        check_hardware(policy, device, where=where)
        return policy


@dataclasses.dataclass(frozen=True, kw_only=True)
class RolloutConfig(_Section):
    cache: str = "dynamic"
    """``dynamic``: HF ``generate``; ``static``: our decode loop over a preallocated KV cache
    (`trainer.rollout.StaticDecodeEngine`, same tokens for the same seed)."""
    cuda_graphs: bool = False
    """Capture the single-token decode step as a CUDA graph (needs ``cache: static`` and CUDA; not
    with several ranks, where each decode step contains FSDP2 all-gathers that cannot be captured)."""
    compile: bool = False
    """``torch.compile`` (Inductor, whole graph, static shapes) the single-token decode forward of
    ``cache: static``, so norms, rotary, SiLU-mul and residual adds fuse between the GEMMs; with
    ``cuda_graphs`` the compiled step is captured too. Compiles once per process and batch shape
    (tens of seconds for a 7B model; the prefill stays eager)."""
    fused: bool = False
    """``cache: static`` decodes with our own forward (`trainer.fused_decode`, Llama / Mistral / Qwen2
    layouts) over a snapshot of the actor's weights cast to the rollout dtype once per rollout, q/k/v
    and gate/up fused into one GEMM each, attention reading only the written cache slots: what an
    inference engine loaded with the synced weights computes. Holds the snapshot during the rollout
    (the fused projections, plus every weight whose dtype differs from the rollout's)."""

    def __post_init__(self) -> None:
        _check(self.cache in ("dynamic", "static"), "cache", f"{self.cache!r}; expected dynamic or static")
        _check(not self.cuda_graphs or self.cache == "static", "cuda_graphs", "needs rollout.cache: static")
        _check(not self.compile or self.cache == "static", "compile", "needs rollout.cache: static")
        _check(not self.fused or self.cache == "static", "fused", "needs rollout.cache: static")


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainConfig(_Section):
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    algo: AlgoConfig = dataclasses.field(default_factory=AlgoConfig)
    precision: PrecisionConfig = dataclasses.field(default_factory=PrecisionConfig)
    rollout: RolloutConfig = dataclasses.field(default_factory=RolloutConfig)
    steps: int = 20
    """Training steps (one rollout batch + its update epochs, or one DPO batch)."""
    seed: int = 0
    device: str = "auto"
    """``auto`` (cuda when available), ``cpu``, ``cuda`` or ``cuda:N``."""
    threads: int = 0
    """CPU threads for torch (0: leave torch's default)."""
    abort_on_nonfinite_loss: int = 0
    """Stop the run after this many consecutive non-finite losses (0: never)."""
    sharding: str = "full_shard"
    """Several processes (torchrun): ``full_shard`` (FSDP2 reshard_after_forward=True, least memory)
    or ``shard_grad_op`` (parameters stay gathered from forward to backward: fewer all-gathers, one
    full copy of the gathered parameters held per layer until its backward). Ignored by one process."""

    def __post_init__(self) -> None:
        _check(self.steps >= 1, "steps", f"must be >= 1, got {self.steps}")
        _check(self.device == "auto" or self.device == "cpu" or self.device.startswith("cuda"), "device",
               f"{self.device!r}; expected auto, cpu, cuda or cuda:N")  # fmt: skip
        # literal keys of trainer.distributed.SHARDING: config must not import torch.distributed
        _check(self.sharding in ("full_shard", "shard_grad_op"), "sharding",
               f"{self.sharding!r}; expected full_shard or shard_grad_op")  # fmt: skip
