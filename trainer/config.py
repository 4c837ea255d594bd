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

from trainer.advantages import ADV_ESTIMATORS, KL_CTRL_TYPES
from trainer.losses import DPO_LOSSES, KL_ESTIMATORS, LOSS_AGG_MODES, POLICY_LOSSES
from trainer.precision import PRESETS, PrecisionPolicy, check_hardware, resolve_policy

ALGORITHMS = ("ppo", "grpo", "dpo")
TRUNCATIONS = ("error", "left", "right", "middle")


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
                renamed = getattr(cls, "_renamed", {})
                if key in renamed:
                    raise ValueError(f"{path}: {renamed[key]}")
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
    train_files: str | tuple[str, ...] | None = None
    """verl's RL data as it is (verl ``data.train_files``): a ``.parquet``, ``.jsonl`` or ``.json`` file,
    or a list of them. Each row has ``prompt`` (chat messages), ``data_source``,
    ``reward_model: {ground_truth, style}`` and ``extra_info``; prompts are rendered with the tokenizer's
    chat template (`trainer.verl_data`). Replaces ``task`` and ``dataset``; ``prompt_length`` is verl's
    ``max_prompt_length``."""
    prompt_key: str = "prompt"
    """verl ``data.prompt_key``: the column holding each row's chat messages."""
    truncation: str = "error"
    """verl ``data.truncation`` for prompts longer than ``prompt_length`` tokens: ``error`` (refused before
    training starts), ``left`` (keep the end), ``right`` (keep the start) or ``middle`` (keep both ends)."""
    filter_overlong_prompts: bool = False
    """verl ``data.filter_overlong_prompts``: drop rows whose rendered prompt exceeds ``prompt_length``
    tokens before training (verl's ppo_trainer.yaml default: false)."""
    chat_template_kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    """verl ``data.apply_chat_template_kwargs``: extra arguments to ``apply_chat_template``
    (``enable_thinking: false``)."""
    reward_fn_key: str = "data_source"
    """verl ``data.reward_fn_key``: the column passed to the reward function as ``data_source``."""
    compute_score: str | None = None
    """verl's reward function as it is (verl ``custom_reward_function.path`` and ``.name``), as
    ``path/to/file.py:compute_score`` or ``module:attr``: called per response as
    ``compute_score(data_source, solution_str, ground_truth, extra_info)``, returning a number or a dict
    with ``score`` (its other numeric keys become ``reward_extra/<key>/mean`` metrics). Unset with
    ``train_files``: the built-in rule scorer of the rows' ``data_source`` (``openai/gsm8k``)."""
    compute_score_kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    """verl ``custom_reward_function.reward_kwargs``: keyword arguments added to every call."""

    def __post_init__(self) -> None:
        _check(self.prompt_length > 0, "prompt_length", f"must be > 0, got {self.prompt_length}")
        _check(self.response_length > 0, "response_length", f"must be > 0, got {self.response_length}")
        _check(self.num_examples > 0, "num_examples", f"must be > 0, got {self.num_examples}")
        _check(self.truncation in TRUNCATIONS, "truncation",
               f"{self.truncation!r}; expected one of {', '.join(TRUNCATIONS)} (verl data.truncation)")  # fmt: skip
        _check(bool(self.prompt_key), "prompt_key", "must name a column, got an empty string")
        files = (self.train_files,) if isinstance(self.train_files, str) else self.train_files or ()
        _check(all(isinstance(f, str) and f for f in files), "train_files",
               f"expected a file path or a list of paths, got {self.train_files!r}")  # fmt: skip
        _check(
            self.train_files is None or len(files) > 0, "train_files", "an empty list; name at least one file"
        )
        if self.train_files is not None:
            _check(self.dataset is None, "dataset",
                   "set either data.dataset (user code) or data.train_files (verl's data files), not both")  # fmt: skip
            _check(self.reward_fn is None, "reward_fn",
                   "verl rows are scored by data.compute_score (verl's signature); remove data.reward_fn")  # fmt: skip
        else:
            _check(self.compute_score is None and not self.compute_score_kwargs, "compute_score",
                   "verl's compute_score needs verl's rows (data_source, reward_model.ground_truth): set "
                   "data.train_files, or use data.reward_fn for other data")  # fmt: skip

    @property
    def train_file_list(self) -> tuple[str, ...]:
        """``train_files`` as a tuple (empty when unset)."""
        return (self.train_files,) if isinstance(self.train_files, str) else tuple(self.train_files or ())


# Old algo keys -> what a suite says now (the error names the new key and what changed).
_RENAMED_ALGO_KEYS = {
    "value_clip": "renamed to cliprange_value (verl's critic.cliprange_value); note 0 now clips every value "
    "prediction to the old value, as in verl (it meant no clipping before)",
    "kl_estimator": "split, as in verl: kl_penalty (the estimator of the KL in the reward, with "
    "use_kl_in_reward) and kl_loss_type (the estimator of the KL loss term, with use_kl_loss); k1 is "
    "kl, k3 is low_var_kl",
    "kl_in_reward": "renamed to use_kl_in_reward (verl's algorithm.use_kl_in_reward, default false); the "
    "KL loss term is use_kl_loss with kl_loss_coef and kl_loss_type",
    "normalize_advantages": "removed: GAE advantages are always whitened over the batch, as in verl",
}


def upgrade_recorded_config(data: Mapping[str, Any]) -> dict[str, Any]:
    """A TrainConfig dict recorded before the verl keys (a run directory's ``manifest.json``), in today's
    keys with the same behaviour: ``value_clip`` -> ``cliprange_value`` (its 0, no clipping, becomes
    1e9), a positive ``kl_coef`` -> the KL term the run had (in the reward for PPO with
    ``kl_in_reward``, else a loss term), ``kl_estimator`` k1/k3 -> kl/low_var_kl, and the options that
    recipe did not read dropped. A current config comes back unchanged."""
    out = dict(data)
    algo = dict(out.get("algo") or {})
    if not any(k in algo for k in _RENAMED_ALGO_KEYS):
        return out
    value_clip = algo.pop("value_clip", 0.2)
    estimator = {"k1": "kl", "k3": "low_var_kl"}.get(algo.pop("kl_estimator", "k1"), "kl")
    in_reward = algo.pop("kl_in_reward", True)
    algo.pop("normalize_advantages", None)
    kl_coef = algo.pop("kl_coef", 0.05)
    name = algo.get("name", "ppo")
    if name == "ppo":
        algo["cliprange_value"] = value_clip if value_clip > 0 else 1e9
    else:
        algo.pop("vf_coef", None)
    if name != "dpo" and kl_coef > 0:
        if name == "ppo" and in_reward:
            algo.update(use_kl_in_reward=True, kl_coef=kl_coef, kl_penalty=estimator)
        else:
            algo.update(use_kl_loss=True, kl_loss_coef=kl_coef, kl_loss_type=estimator)
    out["algo"] = algo
    return out


@dataclasses.dataclass(frozen=True, kw_only=True)
class AlgoConfig(_Section):
    """The algorithm: verl's math, defaults and key names (the verl key is in each field's docstring;
    README "Compatibility with verl and TRL" lists every option)."""

    _renamed = _RENAMED_ALGO_KEYS
    name: str = "ppo"
    """Recipe: ``ppo`` (actor + critic, GAE), ``grpo`` (critic-free, ``group_size`` responses per prompt,
    any outcome ``adv_estimator``) or ``dpo`` (preference pairs)."""
    adv_estimator: str | None = None
    """verl ``algorithm.adv_estimator``: ``gae`` (ppo); ``grpo``, ``rloo``, ``reinforce_plus_plus``,
    ``reinforce_plus_plus_baseline``, ``remax``, ``gpg``, ``opo``, ``grpo_passk`` (grpo recipe). Unset:
    ``gae`` for ppo (verl's default), ``grpo`` for grpo. ``remax`` also decodes one greedy response per
    prompt as its baseline."""
    norm_adv_by_std_in_grpo: bool = True
    """verl ``algorithm.norm_adv_by_std_in_grpo``: divide GRPO advantages by the group std; false is
    Dr.GRPO (with ``loss_agg_mode: seq-mean-token-sum-norm``)."""
    lr: float = 1e-4
    """Actor learning rate (verl ``actor_rollout_ref.actor.optim.lr``, default there 1e-6)."""
    critic_lr: float = 1e-4
    """Critic learning rate, PPO (verl ``critic.optim.lr``, default there 1e-5)."""
    weight_decay: float = 0.0
    """AdamW weight decay of both optimizers (verl ``actor.optim.weight_decay``, default there 0.01)."""
    batch_size: int = 16
    """Prompts per step (verl ``data.train_batch_size``); GRPO samples ``group_size`` responses each. DPO:
    pairs per step."""
    mini_batch_size: int = 8
    """Sequences per optimizer step inside an epoch (verl ``actor.ppo_mini_batch_size`` counts prompts
    and multiplies by ``rollout.n``: ours is that product)."""
    micro_batch_size: int = 8
    """Sequences per forward/backward on each rank (verl ``actor.ppo_micro_batch_size_per_gpu``)."""
    ppo_epochs: int = 1
    """Passes over the rollout batch per step (verl ``actor.ppo_epochs``)."""
    loss_mode: str = "vanilla"
    """verl ``actor.policy_loss.loss_mode``: ``vanilla`` (PPO clip + dual-clip), ``gspo`` (sequence-level
    ratio), ``gpg``, ``cispo``, ``clip_cov``, ``kl_cov``."""
    loss_agg_mode: str = "token-mean"
    """verl ``actor.loss_agg_mode`` (the critic uses it too): ``token-mean``, ``seq-mean-token-sum``,
    ``seq-mean-token-mean``, ``seq-mean-token-sum-norm``. Denominators are the whole mini-batch's (verl's
    global-batch normalisation), not each micro-batch's."""
    loss_scale_factor: float | None = None
    """verl ``actor.loss_scale_factor``: ``seq-mean-token-sum-norm``'s divisor; unset: the padded response
    length (``data.response_length``)."""
    clip_ratio: float = 0.2
    """verl ``actor.clip_ratio``: PPO ratio clip epsilon, both sides unless set apart."""
    clip_ratio_low: float | None = None
    """verl ``actor.clip_ratio_low``: the ratio's lower clip is 1 - this; unset: ``clip_ratio``."""
    clip_ratio_high: float | None = None
    """verl ``actor.clip_ratio_high``: the upper clip is 1 + this (DAPO's clip-higher: 0.28); unset:
    ``clip_ratio``."""
    clip_ratio_c: float = 3.0
    """verl ``actor.clip_ratio_c``: dual-clip bound (> 1) for negative advantages, ``vanilla`` only."""
    clip_cov_ratio: float = 0.0002
    """verl ``actor.policy_loss.clip_cov_ratio``: fraction of tokens ``clip_cov`` drops."""
    clip_cov_lb: float = 1.0
    """verl ``actor.policy_loss.clip_cov_lb``: ``clip_cov``'s lower covariance bound."""
    clip_cov_ub: float = 5.0
    """verl ``actor.policy_loss.clip_cov_ub``: ``clip_cov``'s upper covariance bound."""
    kl_cov_ratio: float = 0.0002
    """verl ``actor.policy_loss.kl_cov_ratio``: fraction of tokens ``kl_cov`` penalises."""
    ppo_kl_coef: float = 0.1
    """verl ``actor.policy_loss.ppo_kl_coef``: ``kl_cov``'s coefficient of |logp - old logp|."""
    entropy_coef: float = 0.0
    """verl ``actor.entropy_coeff``: the loss subtracts this times the aggregated token entropy."""
    use_kl_in_reward: bool = False
    """verl ``algorithm.use_kl_in_reward``: subtract ``kl_coef`` x the ``kl_penalty`` estimate from every
    token's reward (needs the reference model)."""
    kl_penalty: str = "kl"
    """verl ``algorithm.kl_penalty``: estimator of the KL in the reward: ``kl``/``k1``, ``abs``,
    ``mse``/``k2``, ``low_var_kl``/``k3``."""
    kl_coef: float = 0.001
    """verl ``algorithm.kl_ctrl.kl_coef``: (initial) coefficient of the KL in the reward."""
    kl_ctrl_type: str = "fixed"
    """verl ``algorithm.kl_ctrl.type``: ``fixed`` or ``adaptive`` (the coefficient tracks ``kl_ctrl_target_kl``)."""
    kl_ctrl_target_kl: float = 0.1
    """verl ``algorithm.kl_ctrl.target_kl``: the adaptive controller's target KL."""
    kl_ctrl_horizon: int = 10000
    """verl ``algorithm.kl_ctrl.horizon``: the adaptive controller's horizon (sequences)."""
    use_kl_loss: bool = False
    """verl ``actor.use_kl_loss``: add ``kl_loss_coef`` x the aggregated ``kl_loss_type`` estimate of
    KL(actor || reference) to the actor loss (GRPO's KL term; needs the reference model)."""
    kl_loss_coef: float = 0.001
    """verl ``actor.kl_loss_coef``."""
    kl_loss_type: str = "low_var_kl"
    """verl ``actor.kl_loss_type``: same estimators as ``kl_penalty``."""
    cliprange_value: float = 0.5
    """verl ``critic.cliprange_value``: value predictions are clipped to old +- this (0: to the old value)."""
    vf_coef: float = 1.0
    """Critic loss multiplier (no verl key: verl's critic loss has no coefficient, i.e. 1; the critic has
    its own optimizer, so this matters only through gradient clipping and Adam's epsilon)."""
    gamma: float = 1.0
    """verl ``algorithm.gamma``: discount (gae, reinforce_plus_plus)."""
    lam: float = 1.0
    """verl ``algorithm.lam``: GAE lambda."""
    group_size: int = 4
    """GRPO responses per prompt (verl ``actor_rollout_ref.rollout.n``, default there 1)."""
    max_grad_norm: float = 1.0
    """Gradient clipping, 0 disables (verl ``actor.grad_clip`` / ``critic.grad_clip``)."""
    temperature: float = 1.0
    """Sampling temperature (verl ``rollout.temperature``)."""
    top_k: int = 0
    """Top-k sampling, 0 disables (verl ``rollout.top_k``, -1 disables there)."""
    beta: float = 0.1
    """DPO beta (IPO's tau), TRL ``DPOConfig.beta``."""
    dpo_loss: str = "sigmoid"
    """TRL ``DPOConfig.loss_type``: ``sigmoid``, ``hinge``, ``ipo``, ``robust``, ``exo_pair``, ``bco_pair``,
    ``sppo_hard``, ``nca_pair``, ``apo_zero``, ``apo_down``, ``discopop``."""
    label_smoothing: float = 0.0
    """TRL ``DPOConfig.label_smoothing``: the assumed fraction of flipped labels for ``sigmoid`` (cDPO)
    and ``robust``; EXO's epsilon for ``exo_pair`` (> 0 there)."""
    discopop_tau: float = 0.05
    """TRL ``DPOConfig.discopop_tau``: ``discopop``'s temperature."""

    @property
    def estimator(self) -> str | None:
        """The advantage estimator in effect (``adv_estimator`` or the recipe's own); None for DPO."""
        if self.name == "dpo":
            return None
        return self.adv_estimator or ("gae" if self.name == "ppo" else "grpo")

    @property
    def uses_reference(self) -> bool:
        """Whether the recipe builds the frozen reference model (DPO, or a KL term in reward or loss)."""
        return self.name == "dpo" or self.use_kl_in_reward or self.use_kl_loss

    def __post_init__(self) -> None:
        self._check_names()
        for name in ("lr", "critic_lr", "temperature", "beta", "clip_ratio", "kl_ctrl_target_kl",
                     "clip_cov_ratio", "kl_cov_ratio", "discopop_tau"):  # fmt: skip
            _check(getattr(self, name) > 0, name, f"must be > 0, got {getattr(self, name)}")
        for name in ("batch_size", "mini_batch_size", "micro_batch_size", "ppo_epochs", "group_size",
                     "kl_ctrl_horizon"):  # fmt: skip
            _check(getattr(self, name) >= 1, name, f"must be >= 1, got {getattr(self, name)}")
        for name in (
            "kl_coef",
            "kl_loss_coef",
            "cliprange_value",
            "max_grad_norm",
            "entropy_coef",
            "ppo_kl_coef",
        ):
            _check(getattr(self, name) >= 0, name, f"must be >= 0, got {getattr(self, name)}")
        _check(self.mini_batch_size % self.micro_batch_size == 0, "micro_batch_size",
               f"{self.micro_batch_size} must divide mini_batch_size {self.mini_batch_size}")  # fmt: skip
        _check(0 <= self.gamma <= 1 and 0 <= self.lam <= 1, "gamma", "gamma and lam must be in [0, 1]")
        _check(self.clip_ratio_low is None or 0 <= self.clip_ratio_low < 1, "clip_ratio_low",
               f"must be in [0, 1) (the lower clip is 1 - clip_ratio_low), got {self.clip_ratio_low}")  # fmt: skip
        _check(self.clip_ratio_high is None or self.clip_ratio_high >= 0, "clip_ratio_high",
               f"must be >= 0, got {self.clip_ratio_high}")  # fmt: skip
        _check(self.clip_ratio_c > 1, "clip_ratio_c", f"must be > 1 (as in verl), got {self.clip_ratio_c}")
        _check(self.clip_cov_lb < self.clip_cov_ub, "clip_cov_lb", "must be below clip_cov_ub")
        _check(self.loss_scale_factor is None or self.loss_scale_factor > 0, "loss_scale_factor",
               f"must be > 0, got {self.loss_scale_factor}")  # fmt: skip
        _check(0 <= self.label_smoothing < 0.5, "label_smoothing",
               f"must be in [0, 0.5) (TRL's range), got {self.label_smoothing}")  # fmt: skip
        _check(self.dpo_loss != "exo_pair" or self.label_smoothing > 0, "label_smoothing",
               "exo_pair needs label_smoothing > 0 (EXO's epsilon; TRL's examples use 1e-3)")  # fmt: skip
        self._check_estimator()
        self._check_unused()

    def _check_names(self) -> None:
        choices = {"name": ALGORITHMS, "loss_mode": POLICY_LOSSES, "loss_agg_mode": LOSS_AGG_MODES,
                   "kl_penalty": KL_ESTIMATORS, "kl_loss_type": KL_ESTIMATORS, "kl_ctrl_type": KL_CTRL_TYPES,
                   "dpo_loss": DPO_LOSSES}  # fmt: skip
        for key, allowed in choices.items():
            value = getattr(self, key)
            what = "algorithm" if key == "name" else "value"
            _check(value in allowed, key, f"unknown {what} {value!r}; expected one of {', '.join(allowed)}")

    def _check_estimator(self) -> None:
        est = self.adv_estimator
        if est is None:
            return
        _check(
            est in ADV_ESTIMATORS,
            "adv_estimator",
            f"unknown {est!r}; expected one of {', '.join(ADV_ESTIMATORS)}",
        )
        _check(self.name != "dpo", "adv_estimator", "DPO has no advantage estimator; remove it")
        _check(self.name != "ppo" or est == "gae", "adv_estimator",
               f"{est} needs no critic: use algo.name: grpo (the critic-free recipe) with it")  # fmt: skip
        _check(self.name != "grpo" or est != "gae", "adv_estimator",
               "gae needs a critic: use algo.name: ppo")  # fmt: skip
        _check(
            est != "grpo_passk" or self.group_size >= 2,
            "group_size",
            f"grpo_passk compares the best two responses of each prompt: needs >= 2, got {self.group_size}",
        )

    def _check_unused(self) -> None:
        """A key set away from its default where nothing reads it is a mistake, not a no-op."""
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        defaults = {f.name: f.default for f in dataclasses.fields(self)}
        for key, why in unread_algo_keys(values).items():
            value = values[key]
            _check(value == defaults[key], key, f"set to {value!r} but nothing reads it: {why}")


def unread_algo_keys(algo: Mapping[str, Any]) -> dict[str, str]:
    """The algo options nothing reads under the others' values -> why (``algo``: every AlgoConfig field,
    as plain data). `AlgoConfig` refuses such a key set away from its default; ``verlaudit from-verl``
    reports it as ignored, as verl ignores it."""
    name, mode, dpo = algo["name"], algo["loss_mode"], algo["dpo_loss"]
    rl = name != "dpo"
    est = None if not rl else algo["adv_estimator"] or ("gae" if name == "ppo" else "grpo")
    in_reward, adaptive = algo["use_kl_in_reward"], algo["kl_ctrl_type"] == "adaptive"
    needs_reward, needs_adaptive = (
        "needs use_kl_in_reward: true",
        "needs use_kl_in_reward: true and kl_ctrl_type: adaptive",
    )
    clipped = (rl and mode not in ("gpg", "kl_cov"), f"not used by loss_mode {mode}")
    in_effect = {
        "kl_coef": (in_reward, needs_reward),
        "kl_penalty": (in_reward, needs_reward),
        "kl_ctrl_type": (in_reward, needs_reward),
        "kl_ctrl_target_kl": (in_reward and adaptive, needs_adaptive),
        "kl_ctrl_horizon": (in_reward and adaptive, needs_adaptive),
        "kl_loss_coef": (algo["use_kl_loss"], "needs use_kl_loss: true"),
        "kl_loss_type": (algo["use_kl_loss"], "needs use_kl_loss: true"),
        "use_kl_in_reward": (rl, "DPO's reference enters through its loss; remove it"),
        "use_kl_loss": (rl, "DPO's reference enters through its loss; remove it"),
        "clip_ratio": clipped,
        "clip_ratio_low": clipped,
        "clip_ratio_high": clipped,
        "clip_ratio_c": (rl and mode == "vanilla", "dual-clip is loss_mode vanilla's only"),
        "clip_cov_ratio": (rl and mode == "clip_cov", "needs loss_mode: clip_cov"),
        "clip_cov_lb": (rl and mode == "clip_cov", "needs loss_mode: clip_cov"),
        "clip_cov_ub": (rl and mode == "clip_cov", "needs loss_mode: clip_cov"),
        "kl_cov_ratio": (rl and mode == "kl_cov", "needs loss_mode: kl_cov"),
        "ppo_kl_coef": (rl and mode == "kl_cov", "needs loss_mode: kl_cov"),
        "loss_mode": (rl, "DPO's loss is dpo_loss"),
        "loss_agg_mode": (rl, "DPO averages its per-pair losses, as TRL does"),
        "loss_scale_factor": (rl and algo["loss_agg_mode"] == "seq-mean-token-sum-norm",
                              "needs loss_agg_mode: seq-mean-token-sum-norm"),
        "norm_adv_by_std_in_grpo": (est in ("grpo", "grpo_passk"), "needs adv_estimator grpo or grpo_passk"),
        "cliprange_value": (name == "ppo", "only the PPO critic's loss reads it"),
        "vf_coef": (name == "ppo", "only the PPO critic's loss reads it"),
        "dpo_loss": (not rl, "needs algo.name: dpo"),
        "label_smoothing": (not rl and dpo in ("sigmoid", "robust", "exo_pair"),
                            "read by dpo_loss sigmoid, robust and exo_pair only"),
        "discopop_tau": (not rl and dpo == "discopop", "needs dpo_loss: discopop"),
    }  # fmt: skip
    return {key: why for key, (used, why) in in_effect.items() if not used}


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


ENGINES = ("hf", "static", "fused", "vllm")
"""Rollout engines: ``hf`` (HF ``generate``), ``static`` (our decode loop over a preallocated cache),
``fused`` (that loop over our own fused forward), ``vllm`` (vLLM in-process, weights pushed per step)."""
_ENGINE_CACHE = {"hf": "dynamic", "static": "static", "fused": "static", "vllm": None}
"""The ``rollout.cache`` each engine implies (vLLM keeps its own paged cache)."""


def resolve_engine(
    engine: str | None,
    cache: str | None,
    fused: bool | None,
    *,
    cuda_graphs: bool = False,
    compile: bool = False,
    where: str = "rollout",
) -> str:
    """The engine ``rollout.engine`` names or, unset, the one the older ``rollout.cache`` /
    ``rollout.fused`` keys select; ValueError (naming ``where``) when the keys contradict each other."""
    at = f"{where}." if where else ""
    if cache is not None and cache not in ("dynamic", "static"):
        raise ValueError(f"{at}cache: {cache!r}; expected dynamic or static")
    if engine is None:
        if fused and cache != "static":
            raise ValueError(f"{at}fused: needs rollout.cache: static (or rollout.engine: fused)")
        engine = "fused" if fused else ("static" if cache == "static" else "hf")
    elif engine not in ENGINES:
        raise ValueError(f"{at}engine: {engine!r}; expected one of {', '.join(ENGINES)}")
    else:
        implied = _ENGINE_CACHE[engine]
        if cache is not None and cache != implied:
            raise ValueError(
                f"{at}cache: {cache!r} contradicts rollout.engine: {engine} (which "
                + (f"uses a {implied} cache" if implied else "keeps its own paged KV cache")
                + "); remove rollout.cache"
            )
        if fused is not None and fused != (engine == "fused"):
            raise ValueError(
                f"{at}fused: {str(fused).lower()} contradicts rollout.engine: {engine}; remove rollout.fused"
            )
    for key, on in (("cuda_graphs", cuda_graphs), ("compile", compile)):
        if on and engine not in ("static", "fused"):
            raise ValueError(
                f"{at}{key}: needs rollout.cache: static (rollout.engine: static or fused), "
                f"not rollout.engine: {engine}"
            )
    return engine


@dataclasses.dataclass(frozen=True, kw_only=True)
class RolloutConfig(_Section):
    engine: str | None = None
    """``hf``, ``static``, ``fused`` or ``vllm`` (`ENGINES`). Unset: chosen by ``cache`` and ``fused``
    as before this key existed (``hf`` unless ``cache: static``); `kind` is the engine either way. The
    keys stay as written (a suite variant may set ``engine`` over a base that set none)."""
    cache: str | None = None
    """Older spelling of the engine: ``dynamic`` (``engine: hf``) or ``static`` (``engine: static``,
    or ``fused`` with ``fused: true``). Unset: follows ``engine``."""
    cuda_graphs: bool = False
    """Capture the single-token decode step as a CUDA graph (needs ``engine: static`` or ``fused`` and
    CUDA; not with several ranks, where each decode step contains FSDP2 all-gathers that cannot be
    captured, except ``fused``)."""
    compile: bool = False
    """``torch.compile`` (Inductor, whole graph, static shapes) the single-token decode forward of
    ``engine: static`` / ``fused``, so norms, rotary, SiLU-mul and residual adds fuse between the GEMMs;
    with ``cuda_graphs`` the compiled step is captured too. Compiles once per process and batch shape
    (tens of seconds for a 7B model; the prefill stays eager)."""
    fused: bool | None = None
    """Older spelling of ``engine: fused`` (with ``cache: static``): our decode loop with our own
    forward (`trainer.fused_decode`, Llama / Mistral / Qwen2 layouts) over a snapshot of the actor's
    weights cast to the rollout dtype once per rollout, q/k/v and gate/up fused into one GEMM each,
    attention reading only the written cache slots: what an inference engine loaded with the synced
    weights computes. Holds the snapshot during the rollout."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of tokens whose probability reaches ``top_p`` (after
    ``algo.temperature`` and ``algo.top_k``), every engine; 1 disables. The recorded rollout log-probs
    are those of the distribution actually sampled from (renormalised over the kept tokens)."""
    vllm_kv_cache_gib: int = 1
    """``engine: vllm`` on CPU: KV-cache size in GiB (vLLM's ``VLLM_CPU_KVCACHE_SPACE``)."""
    vllm_probe_tokens: int = 16
    """``engine: vllm``: after each weight push, the engine's teacher-forced log-probs of this many
    fixed tokens are compared with the actor's own (``rollout/weight_sync_probe_*``); 0 skips it."""

    @property
    def kind(self) -> str:
        """The engine these keys select (`ENGINES`)."""
        return resolve_engine(
            self.engine, self.cache, self.fused, cuda_graphs=self.cuda_graphs, compile=self.compile, where=""
        )

    def __post_init__(self) -> None:
        self.kind  # noqa: B018 - validates the engine keys together (ValueError naming the field)
        _check(0 < self.top_p <= 1, "top_p", f"must be in (0, 1], got {self.top_p}")
        _check(
            self.vllm_kv_cache_gib >= 1, "vllm_kv_cache_gib", f"must be >= 1, got {self.vllm_kv_cache_gib}"
        )
        _check(
            self.vllm_probe_tokens >= 0, "vllm_probe_tokens", f"must be >= 0, got {self.vllm_probe_tokens}"
        )


ROLLOUT_IS_LEVELS = ("token", "sequence")
ROLLOUT_RS_OPTIONS = (
    "token_k1", "token_k2", "token_k3",
    "seq_sum_k1", "seq_sum_k2", "seq_sum_k3",
    "seq_mean_k1", "seq_mean_k2", "seq_mean_k3",
    "seq_max_k2", "seq_max_k3",
)  # fmt: skip
"""verl's ``rollout_rs`` options: a divergence estimator (k1 = log rollout/train ratio, k2, k3) per
token, or its sum / mean / max over each sequence."""
ROLLOUT_RS_ALIASES = {"token": "token_k1", "sequence": "seq_sum_k1", "geometric": "seq_mean_k1"}
"""verl's earlier ``rollout_rs`` names (ratio bounds [1/C, C] per token, on the sequence's product
of ratios, on their geometric mean): the same tests as these k1 options with ``C`` as threshold."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class RolloutCorrectionConfig(_Section):
    """verl's ``algorithm.rollout_correction`` (its names and defaults): importance weights and
    rejection of tokens / sequences where the rollout engine's log-probs disagree with the trainer's
    recomputed ones (`trainer.mismatch.rollout_correction`). The defaults correct nothing; the
    mismatch metrics are logged for every engine either way."""

    rollout_is: str | None = None
    """Truncated importance sampling: ``token`` (w_t = min(pi_train / pi_rollout, C) per token) or
    ``sequence`` (the product over the sequence, truncated at C, on every token); unset: none.
    The weights (detached) multiply each token's policy-gradient loss."""
    rollout_is_threshold: float = 2.0
    """C, the truncation of the importance weights (verl's default 2.0). Also the bound of the
    always-on ``rollout_corr/token_ratio_fraction_outside`` metric ([1/C, C])."""
    rollout_is_batch_normalize: bool = False
    """Divide the truncated weights by their batch mean (per token or per sequence), so they average 1."""
    rollout_rs: str | None = None
    """Rejection (masking): comma-separated `ROLLOUT_RS_OPTIONS` (or verl's earlier ``token``,
    ``sequence``, ``geometric``); a token or sequence failing any of them leaves the response mask used
    by the advantages and both updates. Unset: none."""
    rollout_rs_threshold: str | float | None = None
    """Required with ``rollout_rs``: one threshold for all options or one per option (comma-separated).
    k1 options take ratio bounds ``lower_upper`` or one upper bound U (lower 1/U); k2 / k3 options an
    upper bound on the divergence."""

    def __post_init__(self) -> None:
        if self.rollout_is is not None:
            _check(
                self.rollout_is in ROLLOUT_IS_LEVELS,
                "rollout_is",
                f"{self.rollout_is!r}; expected token, sequence or null",
            )
        _check(
            self.rollout_is_threshold > 0,
            "rollout_is_threshold",
            f"must be > 0, got {self.rollout_is_threshold}",
        )
        if self.rollout_rs is None:
            _check(self.rollout_rs_threshold is None, "rollout_rs_threshold", "set without rollout_rs")
            return
        _check(
            self.rollout_rs_threshold is not None,
            "rollout_rs_threshold",
            f"required with rollout_rs: {self.rollout_rs} (verl has no default)",
        )
        self.rs_thresholds()  # validates the options and their thresholds once, here

    def rs_options(self) -> list[str]:
        """The ``rollout_rs`` options, aliases resolved, in order, without repeats."""
        out: list[str] = []
        for raw in str(self.rollout_rs or "").split(","):
            opt = ROLLOUT_RS_ALIASES.get(raw.strip(), raw.strip())
            if not opt:
                continue
            _check(
                opt in ROLLOUT_RS_OPTIONS,
                "rollout_rs",
                f"unknown option {raw.strip()!r}; expected some of {', '.join(ROLLOUT_RS_OPTIONS)} "
                f"(or {', '.join(ROLLOUT_RS_ALIASES)})",
            )
            if opt not in out:
                out.append(opt)
        _check(bool(out), "rollout_rs", "names no option")
        return out

    def rs_thresholds(self) -> dict[str, tuple[float | None, float]]:
        """``option -> (lower, upper)``: ratio bounds for k1 options, (None, max divergence) otherwise."""
        options = self.rs_options()
        spec = self.rollout_rs_threshold
        parts = [p.strip() for p in spec.split(",") if p.strip()] if isinstance(spec, str) else [str(spec)]
        _check(
            len(parts) in (1, len(options)),
            "rollout_rs_threshold",
            f"{len(parts)} thresholds for {len(options)} rollout_rs options; give one, or one per option",
        )
        parts = parts * len(options) if len(parts) == 1 else parts
        out: dict[str, tuple[float | None, float]] = {}
        for opt, part in zip(options, parts):
            try:
                nums = [float(x) for x in part.split("_")]
            except ValueError:
                raise ValueError(f"rollout_rs_threshold: {part!r} for {opt} is not a number") from None
            k1 = opt.endswith("k1")
            _check(
                len(nums) == 1 or (k1 and len(nums) == 2),
                "rollout_rs_threshold",
                f"{part!r} for {opt}: " + ("lower_upper or one upper bound" if k1 else "one upper bound"),
            )
            _check(all(n > 0 for n in nums), "rollout_rs_threshold", f"{part!r} for {opt}: must be > 0")
            if k1:
                lower, upper = (nums[0], nums[1]) if len(nums) == 2 else (1.0 / nums[0], nums[0])
                _check(lower < upper, "rollout_rs_threshold", f"{part!r} for {opt}: lower must be < upper")
                out[opt] = (lower, upper)
            else:
                out[opt] = (None, nums[0])
        return out


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainConfig(_Section):
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    algo: AlgoConfig = dataclasses.field(default_factory=AlgoConfig)
    precision: PrecisionConfig = dataclasses.field(default_factory=PrecisionConfig)
    rollout: RolloutConfig = dataclasses.field(default_factory=RolloutConfig)
    rollout_correction: RolloutCorrectionConfig = dataclasses.field(default_factory=RolloutCorrectionConfig)
    """verl's ``algorithm.rollout_correction``: importance weights / rejection against the rollout
    engine's mismatch (PPO and GRPO)."""
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
    origin: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    """Where this config was imported from, as plain data (``verlaudit from-verl`` records the verl launch
    script's overrides under ``verl``). The trainer does not read it: it travels into each run's manifest,
    so a diagnosis can name its fixes in the source's own keys and lines."""

    def __post_init__(self) -> None:
        _check(self.steps >= 1, "steps", f"must be >= 1, got {self.steps}")
        _check(
            self.device == "auto" or self.device == "cpu" or self.device.startswith("cuda"),
            "device",
            f"{self.device!r}; expected auto, cpu, cuda or cuda:N",
        )
        # literal keys of trainer.distributed.SHARDING: config must not import torch.distributed
        _check(
            self.sharding in ("full_shard", "shard_grad_op"),
            "sharding",
            f"{self.sharding!r}; expected full_shard or shard_grad_op",
        )
        rc = self.rollout_correction
        if rc.rollout_is is not None or rc.rollout_rs is not None:
            _check(
                self.algo.name != "dpo",
                "rollout_correction",
                "DPO has no rollout to correct; remove rollout_correction",
            )
        # the IS weights scale each token's advantage (trainer.mismatch.weighted_advantages); these two
        # losses pick tokens by the advantages' covariance, so the scaled ones would pick others
        _check(
            rc.rollout_is is None or self.algo.loss_mode not in ("clip_cov", "kl_cov"),
            "rollout_correction.rollout_is",
            f"not with algo.loss_mode: {self.algo.loss_mode} yet (it selects tokens by the advantages, which "
            "the weights would change); use rollout_rs alone, or another loss_mode",
        )
