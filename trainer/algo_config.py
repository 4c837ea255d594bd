"""The algorithm section of a training config (`AlgoConfig`: PPO, GRPO and DPO with verl's and TRL's
keys and defaults), the upgrade of configs recorded before those keys, and which keys an algorithm
does not read. `trainer.config` re-exports all three. Exercised by `pytest tests/test_config.py
tests/test_algo_keys.py`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from trainer.advantages import ADV_ESTIMATORS, KL_CTRL_TYPES
from trainer.config_base import Section as _Section
from trainer.config_base import check as _check
from trainer.losses import DPO_LOSSES, KL_ESTIMATORS, LOSS_AGG_MODES, POLICY_LOSSES

ALGORITHMS = ("ppo", "grpo", "dpo")


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
        for name in (
            "lr",
            "critic_lr",
            "temperature",
            "beta",
            "clip_ratio",
            "kl_ctrl_target_kl",
            "clip_cov_ratio",
            "kl_cov_ratio",
            "discopop_tau",
        ):
            _check(getattr(self, name) > 0, name, f"must be > 0, got {getattr(self, name)}")
        for name in (
            "batch_size",
            "mini_batch_size",
            "micro_batch_size",
            "ppo_epochs",
            "group_size",
            "kl_ctrl_horizon",
        ):
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
        _check(
            self.mini_batch_size % self.micro_batch_size == 0,
            "micro_batch_size",
            f"{self.micro_batch_size} must divide mini_batch_size {self.mini_batch_size}",
        )
        _check(0 <= self.gamma <= 1 and 0 <= self.lam <= 1, "gamma", "gamma and lam must be in [0, 1]")
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
            self.loss_scale_factor is None or self.loss_scale_factor > 0,
            "loss_scale_factor",
            f"must be > 0, got {self.loss_scale_factor}",
        )
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
        _check(
            self.name != "ppo" or est == "gae",
            "adv_estimator",
            f"{est} needs no critic: use algo.name: grpo (the critic-free recipe) with it",
        )
        _check(self.name != "grpo" or est != "gae", "adv_estimator", "gae needs a critic: use algo.name: ppo")
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
