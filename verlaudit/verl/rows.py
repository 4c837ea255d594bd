"""The verl key table (`ROWS`): each verl key with a suite key of its own -> that key, how its value
converts (a converter raises `Unmapped` with the reason for a value ours cannot express), verl's
default and when the key is in effect; and `canonical`, the spelling the table uses for a key of any
verl release. `verlaudit.verl.mapping` applies it. Exercised by `pytest tests/test_from_verl.py`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from trainer.advantages import KL_CTRL_TYPES
from trainer.config import (
    BYPASS_LOSS_TYPES,
    ROLLOUT_IS_LEVELS,
    ROLLOUT_RS_ALIASES,
    ROLLOUT_RS_OPTIONS,
    TRUNCATIONS,
    RolloutCorrectionConfig,
)
from trainer.losses import KL_ESTIMATORS, LOSS_AGG_MODES, POLICY_LOSSES
from verlaudit import verl_keys as V

NO_DEFAULT = object()


class Unmapped(Exception):
    """Raised by a converter: this value cannot be reproduced; the message is the reason."""


# ---------------------------------------------------------------- values


def as_dtype(v: Any) -> str:
    key = str(v).lower().removeprefix("torch.")
    names = {
        "bf16": "bf16",
        "bfloat16": "bf16",
        "fp16": "fp16",
        "float16": "fp16",
        "half": "fp16",
        "fp32": "fp32",
        "float32": "fp32",
        "float": "fp32",
    }
    if key not in names:
        raise Unmapped(f"dtype {v!r}: expected one of bf16, bfloat16, fp16, float16, fp32, float32")
    return names[key]


def as_int(v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise Unmapped(f"expected an integer, got {v!r}")
    return v


def as_float(v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise Unmapped(f"expected a number, got {v!r}")
    return float(v)


def as_bool(v: Any) -> bool:
    if not isinstance(v, bool):
        raise Unmapped(f"expected true or false, got {v!r}")
    return v


def as_str(v: Any) -> str:
    if not isinstance(v, str) or not v:
        raise Unmapped(f"expected a name, got {v!r}")
    return v


def as_dict(v: Any) -> dict:
    if not isinstance(v, Mapping):
        raise Unmapped(f"expected a mapping {{k: v}}, got {v!r}")
    return dict(v)


def _truncation(v: Any) -> str:
    if v not in TRUNCATIONS:
        raise Unmapped(f"truncation {v!r}: verl's are {', '.join(TRUNCATIONS)}")
    return v


def _top_k(v: Any) -> int:
    return 0 if as_int(v) < 0 else v  # verl's -1 and our 0 both mean no top-k


def _optional_float(v: Any) -> float | None:
    return None if v is None else as_float(v)  # verl's null: the option's own fallback


def _names(v: Any) -> list[str]:
    if not isinstance(v, (list, tuple)) or not v or not all(isinstance(x, str) and x for x in v):
        raise Unmapped(f"expected a list of key names, got {v!r}")
    return list(v)


def _numbers(v: Any) -> list[float] | None:
    if v is None:
        return None
    if not isinstance(v, (list, tuple)) or not v:
        raise Unmapped(f"expected a list of numbers, got {v!r}")
    return [as_float(x) for x in v]


def choice(allowed: tuple[str, ...], what: str) -> Callable[[Any], str]:
    def convert(v: Any) -> str:
        if v not in allowed:
            raise Unmapped(f"{what} {v!r}: this version has {', '.join(allowed)}")
        return v

    return convert


def _rollout_is(v: Any) -> str | None:
    if v is not None and v not in ROLLOUT_IS_LEVELS:
        raise Unmapped(f"rollout_is {v!r}: verl's are token, sequence or null")
    return v


def _rollout_rs(v: Any) -> str | None:
    if v is None:
        return None
    names = [x.strip() for x in str(v).split(",") if x.strip()]
    bad = [x for x in names if x not in ROLLOUT_RS_OPTIONS and x not in ROLLOUT_RS_ALIASES]
    if bad or not names:
        raise Unmapped(
            f"rollout_rs {v!r}: expected some of {', '.join(ROLLOUT_RS_OPTIONS + tuple(ROLLOUT_RS_ALIASES))}"
        )
    return str(v)


def _is_threshold(v: Any) -> str | float:
    """A number (TIS) or a ``lower_upper`` string (IcePop), as verl parses it."""
    if isinstance(v, bool) or not isinstance(v, (int, float, str)):
        raise Unmapped(f"rollout_is_threshold {v!r}: expected a number or lower_upper")
    try:
        RolloutCorrectionConfig(rollout_is_threshold=v).is_bounds()
    except ValueError as e:
        raise Unmapped(str(e)) from None
    return v if isinstance(v, str) else float(v)


def _in_bypass(ctx: Any) -> str | None:
    on = ctx.get(V.correction_key("bypass_mode")) is True
    return None if on else "not used: needs bypass_mode: true (verl ignores it too)"


def _rs_threshold(v: Any) -> str | float | None:
    if v is None or isinstance(v, str):
        return v
    return as_float(v)


# ---------------------------------------------------------------- the table


@dataclasses.dataclass(frozen=True)
class Row:
    """One verl key with a suite key of its own."""

    verl: str
    suite: str | None
    """Dotted path under the suite's ``train:`` (``algo.lr``); None: checked by ``convert`` only."""
    convert: Callable[[Any], Any] = lambda v: v
    """verl value -> suite value; raises `Unmapped` (with the reason) for values it cannot express."""
    default: Any = NO_DEFAULT
    """verl's default, written when the script leaves the key out and ours differs."""
    when: Callable[[Any], str | None] = lambda ctx: None
    """None when the key is in effect for this job, else why it is not (then it is reported consistent)."""
    aliases: tuple[str, ...] = ()
    """The same key's spelling in other verl releases."""
    invertible: bool = True
    """The suite value is the verl value (diagnose writes a suite fix back as this verl key)."""


def _ppo_only(ctx: Any) -> str | None:
    return None if ctx.algo == "ppo" else "not used: a critic-free job has no critic (verl ignores it too)"


def _read(field: str) -> Callable[[Any], str | None]:
    """``when`` of ``algo.<field>``: AlgoConfig's own rule (`trainer.config.unread_algo_keys`) under the
    script's values; a key nothing reads is reported, not written (the suite would refuse it)."""

    def when(ctx: Any) -> str | None:
        why = ctx.unread.get(field)
        return None if why is None else f"not used: {why} (verl ignores it too)"

    return when


def _algo(field: str, convert: Callable[[Any], Any], default: Any = NO_DEFAULT, **kw: Any) -> Row:
    """The row of our ``algo.<field>`` under verl's spelling of it (`verlaudit.verl_keys.ALGO_KEYS`)."""
    return Row(V.algo_key(field), f"algo.{field}", convert, default, when=kw.pop("when", _read(field)), **kw)


def _consistent(expected: Any, reason: str) -> Callable[[Any], Any]:
    def check(v: Any) -> Any:
        if v != expected and not (
            isinstance(expected, float) and isinstance(v, (int, float)) and v == expected
        ):
            raise Unmapped(reason)
        return None

    return check


def _optim_rows(section: str) -> tuple[Row, ...]:
    """An optimizer's settings that ours has fixed (AdamW with torch's betas, a constant lr)."""
    return (
        Row(f"{section}.optim.betas", None, _consistent([0.9, 0.999], "AdamW betas: ours are torch's (0.9, 0.999)")),
        Row(f"{section}.optim.lr_warmup_steps_ratio", None, _consistent(0.0, "lr warm-up: the lr is constant here")),
        Row(f"{section}.optim.lr_warmup_steps", None, _consistent(-1, "lr warm-up: the lr is constant here")),
        Row(f"{section}.optim.warmup_style", None, _consistent("constant", "lr schedule: the lr is constant here")),
        Row(f"{section}.optim.lr_scheduler_type", None, _consistent("constant", "lr schedule: the lr is constant here")),
    )  # fmt: skip


_KL = choice(KL_ESTIMATORS, "KL estimator")

ROWS: tuple[Row, ...] = (
    Row("data.max_prompt_length", "data.prompt_length", as_int, 512),
    Row("data.max_response_length", "data.response_length", as_int, 512),
    Row("data.prompt_key", "data.prompt_key", as_str, "prompt"),
    Row("data.truncation", "data.truncation", _truncation, "error"),
    Row("data.filter_overlong_prompts", "data.filter_overlong_prompts", as_bool, False),
    Row("data.apply_chat_template_kwargs", "data.chat_template_kwargs", as_dict),
    Row("data.reward_fn_key", "data.reward_fn_key", as_str, "data_source"),
    _algo("batch_size", as_int, 1024),
    _algo("lr", as_float, 1e-6),
    _algo("weight_decay", as_float, 0.01),
    _algo("critic_lr", as_float, 1e-5, when=_ppo_only),
    _algo("ppo_epochs", as_int, 1),
    _algo("max_grad_norm", as_float, 1.0, aliases=(f"{V.ACTOR}.optim.clip_grad",)),
    _algo("gamma", as_float, 1.0),
    _algo("lam", as_float, 1.0),
    _algo("norm_adv_by_std_in_grpo", as_bool, True),
    _algo("entropy_coef", as_float, 0.0),
    # KL: in the reward (algorithm.*) and as a loss term (actor.*); each coefficient is read only when its
    # switch is on, as in verl (the `when` of each row reports it otherwise)
    _algo("use_kl_in_reward", as_bool, False),
    _algo("kl_penalty", _KL, "kl"),
    _algo("kl_coef", as_float, 0.001),
    _algo("kl_ctrl_type", choice(KL_CTRL_TYPES, "KL controller"), "fixed"),
    _algo("kl_ctrl_target_kl", as_float, 0.1),
    _algo("kl_ctrl_horizon", as_int, 10000),
    _algo("use_kl_loss", as_bool, False),
    _algo("kl_loss_coef", as_float, 0.001),
    _algo("kl_loss_type", _KL, "low_var_kl"),
    # the policy loss
    _algo("loss_mode", choice(POLICY_LOSSES, "policy loss"), "vanilla"),
    _algo("loss_agg_mode", choice(LOSS_AGG_MODES, "loss_agg_mode"), "token-mean"),
    _algo("loss_scale_factor", _optional_float),
    _algo("clip_ratio", as_float, 0.2),
    _algo("clip_ratio_low", _optional_float),  # verl's 0.2 defaults: `_map_clip_defaults`
    _algo("clip_ratio_high", _optional_float),
    _algo("clip_ratio_c", as_float, 3.0),
    _algo("clip_cov_ratio", as_float, 0.0002),
    _algo("clip_cov_lb", as_float, 1.0),
    _algo("clip_cov_ub", as_float, 5.0),
    _algo("kl_cov_ratio", as_float, 0.0002),
    _algo("ppo_kl_coef", as_float, 0.1),
    _algo("tau_pos", as_float, 1.0),
    _algo("tau_neg", as_float, 1.05),
    _algo("dro_beta", _optional_float),
    _algo("cliprange_value", as_float, 0.5),
    _algo("temperature", as_float, 1.0),
    _algo("top_k", _top_k, -1, invertible=False),
    _algo("gdpo_reward_keys", _names),
    _algo("gdpo_reward_weights", _numbers),
    # computed here whenever adv_estimator reads it (the optimal token baselines)
    Row(V.CALCULATE_SUM_PI_SQUARED, None, as_bool),
    Row(f"{V.ROLLOUT}.top_p", None, _consistent(1.0, "top-p sampling: our rollout samples from the full "
                                                "distribution (top_p 1)")),
    Row(f"{V.ACTOR}.shuffle", None, _consistent(True, "mini-batch order: ours reshuffles the rows every epoch "
                                                "(verl's false splits them in order)")),
    *_optim_rows(V.ACTOR),
    *_optim_rows(V.CRITIC),
    Row("algorithm.filter_groups.enable", None, _consistent(False, "dynamic sampling (filter_groups): every "
                                                            "sampled group is trained on here")),
    Row(f"{V.ROLLOUT}.multi_turn.enable", None, _consistent(False, "multi-turn / tool rollouts are not "
                                                            "supported: one response per prompt")),
    Row(f"{V.MODEL}.lora_rank", None, _consistent(0, "LoRA: this trainer updates every weight (full "
                                                  "fine-tuning), so memory and numerics differ from the job")),
    Row(V.REWARD_MANAGER, None, _consistent("naive", "reward manager: here verl's naive manager (one "
                                            "compute_score call per response)"), aliases=("reward.reward_manager.name",)),
    Row("reward_model.enable", None, _consistent(False, "a model-based reward: from-verl maps rule rewards; "
                                                 "set model.reward_model to a local directory by hand")),
    Row("trainer.critic_warmup", None, _consistent(0, "no critic warm-up here: the actor updates from step 0")),
    # verl's rollout correction (algorithm.rollout_correction): the same option names under rollout_correction
    Row(V.correction_key("rollout_is"), "rollout_correction.rollout_is", _rollout_is, None),
    Row(V.correction_key("rollout_is_threshold"), "rollout_correction.rollout_is_threshold", _is_threshold, 2.0),
    Row(V.correction_key("rollout_is_batch_normalize"), "rollout_correction.rollout_is_batch_normalize", as_bool, False),
    Row(V.correction_key("rollout_rs"), "rollout_correction.rollout_rs", _rollout_rs, None),
    Row(V.correction_key("rollout_rs_threshold"), "rollout_correction.rollout_rs_threshold", _rs_threshold, None),
    Row(V.correction_key("bypass_mode"), "rollout_correction.bypass_mode", as_bool, False),
    Row(V.correction_key("loss_type"), "rollout_correction.loss_type", choice(BYPASS_LOSS_TYPES, "bypass loss_type"),
        "ppo_clip", when=_in_bypass),
    Row(f"{V.ROLLOUT_CORRECTION}.rollout_rs_threshold_lower", None, _consistent(None, "a separate lower bound: "
                                                                                 "write rollout_rs_threshold as lower_upper")),
    Row(f"{V.ROLLOUT_CORRECTION}.rollout_token_veto_threshold", None, _consistent(None, "the per-token veto is "
                                                                                   "not in this version")),
    Row(V.LOGPROBS_MODE, None, _consistent("processed_logprobs", "the rollout log-probs here are always those of "
                                           "the distribution sampled from (processed: after temperature, top-k, top-p)")),
)  # fmt: skip
"""verl keys with one suite key each (or a value that must match what ours does). The algorithm's verl
spellings come from `verlaudit.verl_keys.ALGO_KEYS` (one table for diagnose, the log parser and this)."""


ALIASES = {
    f"{V.ACTOR}.fsdp_config.dtype": f"{V.ACTOR}.fsdp_config.mixed_precision.param_dtype",
    f"{V.REF}.fsdp_config.dtype": f"{V.REF}.fsdp_config.mixed_precision.param_dtype",
    "critic.fsdp.model_dtype": f"{V.CRITIC_MODEL}.fsdp_config.model_dtype",
    "critic.fsdp.dtype": f"{V.CRITIC_MODEL}.fsdp_config.mixed_precision.param_dtype",
    "reward.custom_reward_function.path": "custom_reward_function.path",
    "reward.custom_reward_function.name": "custom_reward_function.name",
    "reward.custom_reward_function.reward_kwargs": "custom_reward_function.reward_kwargs",
}
"""Newer verl spellings -> the verl 0.5 key the table uses (records keep the script's spelling)."""


def canonical(key: str) -> str:
    """The spelling the table uses for ``key`` (verl 0.5's), whatever release's spelling it is in."""
    return _ROW_ALIASES.get(key, ALIASES.get(key, key))


_ROW_ALIASES = {a: r.verl for r in ROWS for a in r.aliases}
