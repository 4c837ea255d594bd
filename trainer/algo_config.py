"""The algorithm section of a training config (`AlgoConfig`: PPO, GRPO and DPO with verl's and TRL's
keys and defaults), in sections along verl's lines (the recipe and its advantages, optimizers, batches,
the policy loss, the KL in the reward, the KL loss, the critic, sampling, DPO), and which keys an algorithm
does not read. A suite writes the keys flat (``algo.clip_ratio``): the sections are the code's structure
(`trainer.config_base.FlatSections`). Every list of names comes from a registry (`trainer.registry`).
`trainer.config` re-exports it. Exercised by `pytest tests/test_config.py tests/test_algo_keys.py`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from trainer.advantages import ADV_ESTIMATOR, KL_CTRL_TYPES
from trainer.config_base import FlatSections as _FlatSections
from trainer.config_base import Section as _Section
from trainer.config_base import check as _check
from trainer.losses import DPO_LOSS, KL_ESTIMATOR, LOSS_AGG, POLICY_LOSS
from trainer.recipes import ALGORITHMS, RECIPE
from trainer.verl_versions import LATEST_RELEASE
from trainer.verl_versions import check as _check_verl_version
from trainer.verl_versions import follows as _follows

__all__ = ["ALGORITHMS", "AlgoConfig", "unread_algo_keys"]

# Keys of the project's earlier formats: refused with the key that replaced them (no upgrade here).
_RENAMED_ALGO_KEYS = {
    "value_clip": "renamed to cliprange_value (verl's critic.cliprange_value; 0 clips every value to the old one)",
    "kl_estimator": "split, as in verl: kl_penalty (the KL in the reward) and kl_loss_type (the KL loss term)",
    "kl_in_reward": "renamed to use_kl_in_reward (verl's algorithm.use_kl_in_reward)",
    "normalize_advantages": "removed: GAE advantages are always whitened over the batch, as in verl",
}


def _choice(registry: Any, key: str, value: Any, what: str = "value") -> None:
    names = registry.names()
    _check(value in names, key, f"unknown {what} {value!r}; expected one of {', '.join(names)}")


def _positive(section: Any, *keys: str) -> None:
    for key in keys:
        _check(getattr(section, key) > 0, key, f"must be > 0, got {getattr(section, key)}")


def _at_least_one(section: Any, *keys: str) -> None:
    for key in keys:
        _check(getattr(section, key) >= 1, key, f"must be >= 1, got {getattr(section, key)}")


def _non_negative(section: Any, *keys: str) -> None:
    for key in keys:
        _check(getattr(section, key) >= 0, key, f"must be >= 0, got {getattr(section, key)}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class RecipeConfig(_Section):
    """The recipe and its advantages (verl ``algorithm.*``)."""

    name: str = "ppo"
    """Recipe: ``ppo`` (actor + critic, GAE), ``grpo`` (critic-free, ``group_size`` responses per prompt,
    any outcome ``adv_estimator``) or ``dpo`` (preference pairs)."""
    adv_estimator: str | None = None
    """verl ``algorithm.adv_estimator``: ``gae`` (ppo); ``grpo``, ``rloo``, ``reinforce_plus_plus``,
    ``reinforce_plus_plus_baseline``, ``remax``, ``gpg``, ``opo``, ``grpo_passk``, ``grpo_vectorized``,
    ``rloo_vectorized``, ``gdpo``, ``optimal_token_baseline``, ``tir_optimal_token_baseline`` (grpo recipe). Unset:
    ``gae`` for ppo (verl's default), ``grpo`` for grpo. ``remax`` also decodes one greedy response per
    prompt as its baseline."""
    norm_adv_by_std_in_grpo: bool = True
    """verl ``algorithm.norm_adv_by_std_in_grpo``: divide GRPO advantages by the group std; false is
    Dr.GRPO (with ``loss_agg_mode: seq-mean-token-sum-norm``)."""
    gamma: float = 1.0
    """verl ``algorithm.gamma``: discount (gae, reinforce_plus_plus)."""
    lam: float = 1.0
    """verl ``algorithm.lam``: GAE lambda."""
    gdpo_reward_keys: tuple[str, ...] | None = None
    """verl ``algorithm.gdpo_reward_keys`` (``gdpo``, which needs it): the reward components GDPO
    normalises one by one, keys of the dict the reward returns per response (verl's ``compute_score``
    dict; `trainer.common.split_reward_parts`)."""
    gdpo_reward_weights: tuple[float, ...] | None = None
    """verl ``algorithm.gdpo_reward_weights``: one weight per ``gdpo_reward_keys`` entry in GDPO's sum of
    the components' advantages; unset: all 1."""

    def __post_init__(self) -> None:
        _choice(RECIPE, "name", self.name, "algorithm")
        _check(0 <= self.gamma <= 1 and 0 <= self.lam <= 1, "gamma", "gamma and lam must be in [0, 1]")
        keys, weights = self.gdpo_reward_keys, self.gdpo_reward_weights
        _check(keys is None or (len(keys) > 0 and all(isinstance(k, str) and k for k in keys)),
               "gdpo_reward_keys", f"expected a list of key names, got {keys!r}")  # fmt: skip
        _check(weights is None or (keys is not None and len(weights) == len(keys)), "gdpo_reward_weights",
               f"{len(weights or ())} weights for {len(keys or ())} gdpo_reward_keys: give one per key")  # fmt: skip
        _check(weights is None or all(isinstance(w, (int, float)) and not isinstance(w, bool) for w in weights),
               "gdpo_reward_weights", f"expected a list of numbers, got {weights!r}")  # fmt: skip
        est = self.adv_estimator
        if est is None:
            return
        _check(est != "gdpo" or keys is not None, "gdpo_reward_keys",
               "adv_estimator gdpo needs the reward components: list the keys of the dict the reward returns "
               "per response (as verl, which asserts on it)")  # fmt: skip
        _choice(ADV_ESTIMATOR, "adv_estimator", est, "estimator")
        _check(RECIPE.entry(self.name).info["estimator"] is not None, "adv_estimator",
               f"{self.name.upper()} has no advantage estimator; remove it")  # fmt: skip
        critic, needs = (
            RECIPE.entry(self.name).info["critic"],
            ADV_ESTIMATOR.entry(est).info.get("critic", False),
        )
        _check(not needs or critic, "adv_estimator", f"{est} needs a critic: use algo.name: ppo")
        _check(needs or not critic, "adv_estimator",
               f"{est} needs no critic: use algo.name: grpo (the critic-free recipe) with it")  # fmt: skip

    @property
    def estimator(self) -> str | None:
        """The advantage estimator in effect (``adv_estimator`` or the recipe's own); None for DPO."""
        own = RECIPE.entry(self.name).info["estimator"]
        return None if own is None else self.adv_estimator or own


@dataclasses.dataclass(frozen=True, kw_only=True)
class OptimConfig(_Section):
    """The optimizers (verl ``actor.optim``, ``critic.optim``, ``grad_clip``)."""

    lr: float = 1e-4
    """Actor learning rate (verl ``actor_rollout_ref.actor.optim.lr``, default there 1e-6)."""
    critic_lr: float = 1e-4
    """Critic learning rate, PPO (verl ``critic.optim.lr``, default there 1e-5)."""
    weight_decay: float = 0.0
    """AdamW weight decay of both optimizers (verl ``actor.optim.weight_decay``, default there 0.01)."""
    max_grad_norm: float = 1.0
    """Gradient clipping, 0 disables (verl ``actor.grad_clip`` / ``critic.grad_clip``)."""

    def __post_init__(self) -> None:
        _positive(self, "lr", "critic_lr")
        _non_negative(self, "max_grad_norm")


@dataclasses.dataclass(frozen=True, kw_only=True)
class BatchConfig(_Section):
    """Batch, mini-batch and micro-batch sizes and epochs (verl ``data.train_batch_size``, ``actor.ppo_*``)."""

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

    def __post_init__(self) -> None:
        _at_least_one(self, "batch_size", "mini_batch_size", "micro_batch_size", "ppo_epochs")
        _check(
            self.mini_batch_size % self.micro_batch_size == 0,
            "micro_batch_size",
            f"{self.micro_batch_size} must divide mini_batch_size {self.mini_batch_size}",
        )


@dataclasses.dataclass(frozen=True, kw_only=True)
class PolicyLossConfig(_Section):
    """The actor's loss (verl ``actor.policy_loss.*``, ``actor.clip_ratio*``, ``loss_agg_mode``,
    ``entropy_coeff``); `trainer.rl_steps.policy_loss_params` hands it to `trainer.losses`."""

    loss_mode: str = "vanilla"
    """verl ``actor.policy_loss.loss_mode``: ``vanilla`` (PPO clip + dual-clip), ``gspo`` (sequence-level
    ratio), ``gpg``, ``cispo``, ``clip_cov``, ``kl_cov``, ``sapo`` (smooth gate), ``geo_mean`` (GMPO),
    ``dppo_tv`` / ``dppo_kl`` (DPPO: the clip ratios bound the token probability's move), ``dro`` (needs
    ``dro_beta``), ``bypass_mode`` (with ``rollout_correction.bypass_mode``) (`trainer.losses.POLICY_LOSS`)."""
    loss_agg_mode: str = "token-mean"
    """verl ``actor.loss_agg_mode`` (the critic uses it too): ``token-mean``, ``token-sum``,
    ``seq-mean-token-sum``, ``seq-mean-token-mean``, ``seq-mean-token-sum-norm``. Denominators are the whole mini-batch's (verl's
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
    """verl ``actor.clip_ratio_c``: dual-clip bound (> 1) for negative advantages (``vanilla``), the truncation
    of the ratio weight in ``dppo_tv`` / ``dppo_kl``."""
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
    tau_pos: float = 1.0
    """verl ``actor.tau_pos``: ``sapo``'s gate temperature for tokens with a positive advantage."""
    tau_neg: float = 1.05
    """verl ``actor.tau_neg``: ``sapo``'s gate temperature for the others."""
    dro_beta: float | None = None
    """verl ``actor.policy_loss.dro_beta``: ``dro``'s coefficient of the quadratic log-ratio penalty; required
    (> 0) with ``loss_mode: dro``, as verl (no default)."""
    entropy_coef: float = 0.0
    """verl ``actor.entropy_coeff``: the loss subtracts this times the aggregated token entropy."""

    def __post_init__(self) -> None:
        _choice(POLICY_LOSS, "loss_mode", self.loss_mode)
        _choice(LOSS_AGG, "loss_agg_mode", self.loss_agg_mode)
        _positive(self, "clip_ratio", "clip_cov_ratio", "kl_cov_ratio", "tau_pos", "tau_neg")
        _non_negative(self, "entropy_coef", "ppo_kl_coef")
        _check(
            self.clip_ratio_low is None or 0 <= self.clip_ratio_low < 1,
            "clip_ratio_low",
            f"must be in [0, 1) (the lower clip is 1 - clip_ratio_low), got {self.clip_ratio_low}",
        )
        _check(
            self.clip_ratio_high is None or self.clip_ratio_high >= 0,
            "clip_ratio_high",
            f"must be >= 0, got {self.clip_ratio_high}",
        )
        _check(self.clip_ratio_c > 1, "clip_ratio_c", f"must be > 1 (as in verl), got {self.clip_ratio_c}")
        _check(self.clip_cov_lb < self.clip_cov_ub, "clip_cov_lb", "must be below clip_cov_ub")
        _check(
            self.loss_mode != "dro" or (self.dro_beta is not None and self.dro_beta > 0),
            "dro_beta",
            f"must be set > 0 with loss_mode: dro (verl has no default), got {self.dro_beta}",
        )
        _check(
            self.loss_scale_factor is None or self.loss_scale_factor > 0,
            "loss_scale_factor",
            f"must be > 0, got {self.loss_scale_factor}",
        )


@dataclasses.dataclass(frozen=True, kw_only=True)
class KLRewardConfig(_Section):
    """The KL in the reward and its controller (verl ``algorithm.use_kl_in_reward``, ``kl_penalty``,
    ``kl_ctrl.*``)."""

    use_kl_in_reward: bool = False
    """verl ``algorithm.use_kl_in_reward``: subtract ``kl_coef`` x the ``kl_penalty`` estimate from every
    token's reward (needs the reference model)."""
    kl_penalty: str = "kl"
    """verl ``algorithm.kl_penalty``: estimator of the KL in the reward: ``kl``/``k1``, ``abs``,
    ``mse``/``k2``, ``low_var_kl``/``k3``, and ``k1+`` / ``k3+`` (the value of k1 / k3, k2's gradient)."""
    kl_coef: float = 0.001
    """verl ``algorithm.kl_ctrl.kl_coef``: (initial) coefficient of the KL in the reward."""
    kl_ctrl_type: str = "fixed"
    """verl ``algorithm.kl_ctrl.type``: ``fixed`` or ``adaptive`` (the coefficient tracks ``kl_ctrl_target_kl``)."""
    kl_ctrl_target_kl: float = 0.1
    """verl ``algorithm.kl_ctrl.target_kl``: the adaptive controller's target KL."""
    kl_ctrl_horizon: int = 10000
    """verl ``algorithm.kl_ctrl.horizon``: the adaptive controller's horizon (sequences)."""

    def __post_init__(self) -> None:
        _choice(KL_ESTIMATOR, "kl_penalty", self.kl_penalty)
        _check(
            self.kl_ctrl_type in KL_CTRL_TYPES,
            "kl_ctrl_type",
            f"unknown value {self.kl_ctrl_type!r}; expected one of {', '.join(KL_CTRL_TYPES)}",
        )
        _positive(self, "kl_ctrl_target_kl")
        _at_least_one(self, "kl_ctrl_horizon")
        _non_negative(self, "kl_coef")


@dataclasses.dataclass(frozen=True, kw_only=True)
class KLLossConfig(_Section):
    """The KL loss term of the actor (verl ``actor.use_kl_loss``, ``kl_loss_coef``, ``kl_loss_type``)."""

    use_kl_loss: bool = False
    """verl ``actor.use_kl_loss``: add ``kl_loss_coef`` x the aggregated ``kl_loss_type`` estimate of
    KL(actor || reference) to the actor loss (GRPO's KL term; needs the reference model)."""
    kl_loss_coef: float = 0.001
    """verl ``actor.kl_loss_coef``."""
    kl_loss_type: str = "low_var_kl"
    """verl ``actor.kl_loss_type``: same estimators as ``kl_penalty``."""

    def __post_init__(self) -> None:
        _choice(KL_ESTIMATOR, "kl_loss_type", self.kl_loss_type)
        _non_negative(self, "kl_loss_coef")


@dataclasses.dataclass(frozen=True, kw_only=True)
class CriticConfig(_Section):
    """The PPO critic's loss (verl ``critic.*``)."""

    cliprange_value: float = 0.5
    """verl ``critic.cliprange_value``: value predictions are clipped to old +- this (0: to the old value)."""
    vf_coef: float = 1.0
    """Critic loss multiplier (no verl key: verl's critic loss has no coefficient, i.e. 1; the critic has
    its own optimizer, so this matters only through gradient clipping and Adam's epsilon)."""

    def __post_init__(self) -> None:
        _non_negative(self, "cliprange_value")


@dataclasses.dataclass(frozen=True, kw_only=True)
class SamplingConfig(_Section):
    """How the rollout samples (verl ``rollout.n``, ``temperature``, ``top_k``)."""

    group_size: int = 4
    """GRPO responses per prompt (verl ``actor_rollout_ref.rollout.n``, default there 1)."""
    temperature: float = 1.0
    """Sampling temperature (verl ``rollout.temperature``)."""
    top_k: int = 0
    """Top-k sampling, 0 disables (verl ``rollout.top_k``, -1 disables there)."""

    def __post_init__(self) -> None:
        _positive(self, "temperature")
        _at_least_one(self, "group_size")


@dataclasses.dataclass(frozen=True, kw_only=True)
class DPOConfig(_Section):
    """The DPO family's loss (TRL ``DPOConfig``)."""

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

    def __post_init__(self) -> None:
        _choice(DPO_LOSS, "dpo_loss", self.dpo_loss)
        _positive(self, "beta", "discopop_tau")
        _check(
            0 <= self.label_smoothing < 0.5,
            "label_smoothing",
            f"must be in [0, 0.5) (TRL's range), got {self.label_smoothing}",
        )
        _check(
            self.dpo_loss != "exo_pair" or self.label_smoothing > 0,
            "label_smoothing",
            "exo_pair needs label_smoothing > 0 (EXO's epsilon; TRL's examples use 1e-3)",
        )


@dataclasses.dataclass(frozen=True, kw_only=True)
class CompatConfig(_Section):
    """Which verl the job reproduces (`trainer.verl_versions`)."""

    verl_version: str = LATEST_RELEASE
    """The verl release line the job targets (``0.7`` ... ``0.10``; default the latest release line, 0.9):
    every key whose semantics changed between verl's lines follows it (`trainer.verl_versions.CHANGES`:
    ``seq-mean-token-sum-norm``'s divisor, the IS metrics, REINFORCE++ through masked tokens).
    ``verlaudit from-verl --verl-version`` writes it."""

    def __post_init__(self) -> None:
        try:
            _check_verl_version(self.verl_version)
        except ValueError as e:
            raise ValueError(f"verl_version: {e}") from None


@dataclasses.dataclass(frozen=True, init=False)
class AlgoConfig(_FlatSections):
    """The algorithm: verl's math, defaults and key names (the verl key is in each field's docstring;
    README "Compatibility with verl and TRL" lists every option). Built and written with flat keys
    (``AlgoConfig(name="grpo", clip_ratio=0.1)``, ``algo.clip_ratio``); each key lives in one section."""

    _renamed = _RENAMED_ALGO_KEYS
    recipe: RecipeConfig
    optim: OptimConfig
    batch: BatchConfig
    policy_loss: PolicyLossConfig
    kl_reward: KLRewardConfig
    kl_loss: KLLossConfig
    critic: CriticConfig
    sampling: SamplingConfig
    dpo: DPOConfig
    compat: CompatConfig

    def follows(self, change: str) -> bool:
        """Whether the targeted verl line has the newer semantics of ``change`` (`trainer.verl_versions`)."""
        return _follows(self.verl_version, change)

    @property
    def estimator(self) -> str | None:
        """The advantage estimator in effect (``adv_estimator`` or the recipe's own); None for DPO."""
        return self.recipe.estimator

    @property
    def uses_reference(self) -> bool:
        """Whether the recipe builds the frozen reference model (DPO, or a KL term in reward or loss)."""
        return self.name == "dpo" or self.use_kl_in_reward or self.use_kl_loss

    def __post_init__(self) -> None:
        """The checks that span sections: an estimator's group size, and keys nothing reads."""
        est = self.estimator
        info = ADV_ESTIMATOR.entry(est).info if est is not None else {}
        need = info.get("min_group", 1)
        _check(
            self.group_size >= need,
            "group_size",
            f"{est} {info.get('why_group')}: needs >= {need}, got {self.group_size}",
        )
        values, defaults = self.to_dict(), self.defaults()
        for key, why in unread_algo_keys(values).items():
            value = values[key]
            _check(value == defaults[key], key, f"set to {value!r} but nothing reads it: {why}")


_LOSS_KNOBS = {
    "clip": ("clip_ratio", "clip_ratio_low", "clip_ratio_high"),
    "dual_clip": ("clip_ratio_c",),
    "clip_cov": ("clip_cov_ratio", "clip_cov_lb", "clip_cov_ub"),
    "kl_cov": ("kl_cov_ratio", "ppo_kl_coef"),
    "sapo": ("tau_pos", "tau_neg"),
    "dro": ("dro_beta",),
}
"""Groups of policy-loss keys; each loss registers the groups it reads (``reads=`` in `trainer.losses`)."""


def _loss_knobs(rl: bool, mode: str) -> dict[str, tuple[bool, str]]:
    """Each policy-loss knob -> (read under ``mode``, why not), from the losses' ``reads`` metadata."""
    reads = POLICY_LOSS.entry(mode).info.get("reads", ()) if rl else ()
    out = {}
    for group, keys in _LOSS_KNOBS.items():
        names = [
            n for n in POLICY_LOSS.names(aliases=False) if group in POLICY_LOSS.entry(n).info.get("reads", ())
        ]
        users = " or ".join(names) if len(names) < 3 else f"{', '.join(names[:-1])} or {names[-1]}"
        why = {
            "clip": f"not used by loss_mode {mode}",
            "dual_clip": f"read by loss_mode {users} only",
        }.get(group, f"needs loss_mode: {users}")
        out.update({key: (group in reads, why) for key in keys})
    return out


def unread_algo_keys(algo: Mapping[str, Any]) -> dict[str, str]:
    """The algo options nothing reads under the others' values -> why (``algo``: every AlgoConfig key,
    as plain data). `AlgoConfig` refuses such a key set away from its default; ``verlaudit from-verl``
    reports it as ignored, as verl ignores it."""
    name, dpo = algo["name"], algo["dpo_loss"]
    own = RECIPE.entry(name).info["estimator"]
    rl = own is not None
    est = None if not rl else algo["adv_estimator"] or own
    in_reward, adaptive = algo["use_kl_in_reward"], algo["kl_ctrl_type"] == "adaptive"
    needs_reward, needs_adaptive = (
        "needs use_kl_in_reward: true",
        "needs use_kl_in_reward: true and kl_ctrl_type: adaptive",
    )
    std = ADV_ESTIMATOR.where(std=True)
    critic = RECIPE.entry(name).info["critic"]
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
        **_loss_knobs(rl, algo["loss_mode"]),
        "loss_mode": (rl, "DPO's loss is dpo_loss"),
        "loss_agg_mode": (rl, "DPO averages its per-pair losses, as TRL does"),
        "loss_scale_factor": (rl and algo["loss_agg_mode"] == "seq-mean-token-sum-norm",
                              "needs loss_agg_mode: seq-mean-token-sum-norm"),
        "norm_adv_by_std_in_grpo": (est in std, f"needs adv_estimator {', '.join(std[:-1])} or {std[-1]}"),
        "gdpo_reward_keys": (est == "gdpo", "needs adv_estimator: gdpo"),
        "gdpo_reward_weights": (est == "gdpo", "needs adv_estimator: gdpo"),
        "cliprange_value": (critic, "only the PPO critic's loss reads it"),
        "vf_coef": (critic, "only the PPO critic's loss reads it"),
        "dpo_loss": (not rl, "needs algo.name: dpo"),
        "label_smoothing": (not rl and dpo in ("sigmoid", "robust", "exo_pair"),
                            "read by dpo_loss sigmoid, robust and exo_pair only"),
        "discopop_tau": (not rl and dpo == "discopop", "needs dpo_loss: discopop"),
    }  # fmt: skip
    return {key: why for key, (used, why) in in_effect.items() if not used}
