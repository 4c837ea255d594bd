"""The verl key table: each verl key -> the suite key it becomes, how its value converts, verl's default,
or the reason it is not mapped. `map_launch` applies it to a parsed script.

One row per key in `ROWS` (a value conversion may refuse a value with `Unmapped`, whose reason is
reported); the algorithm's rows take verl's spelling from `verlaudit.verl_keys.ALGO_KEYS`, and a key
that nothing reads under the script's other settings (a KL coefficient with its switch off, a clip
bound of another loss) is reported as verl ignores it, by AlgoConfig's own rule
(`trainer.config.unread_algo_keys`). Keys that only make sense together (the estimator and recipe,
precision, batch sizes, the model, the engines, the reward function, the hardware) have one handler
each; every key left over gets the reason of `verlaudit.verl.reasons`, or "not in from-verl's table".
Nothing is dropped silently: every key of the script ends in `Mapped.records` as mapped, consistent
(nothing to set: ours already does that), or not mapped with its reason. Keys the script leaves out
take verl's default (verl 0.5's ppo_trainer.yaml) where ours differs, so the suite reproduces what verl
would run. Exercised by `pytest tests/test_from_verl.py`.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping
from typing import Any

from trainer.advantages import ADV_ESTIMATORS, KL_CTRL_TYPES
from trainer.config import (
    ROLLOUT_IS_LEVELS,
    ROLLOUT_RS_ALIASES,
    ROLLOUT_RS_OPTIONS,
    TRUNCATIONS,
    AlgoConfig,
    TrainConfig,
    unread_algo_keys,
)
from trainer.losses import KL_ESTIMATORS, LOSS_AGG_MODES, POLICY_LOSSES
from verlaudit import verl_keys as V
from verlaudit.verl.architectures import KNOWN, lookup
from verlaudit.verl.engines import INFERENCE_ENGINES, rollout_engine
from verlaudit.verl.launch import Launch, Override
from verlaudit.verl.reasons import unmapped_reason

NO_DEFAULT = object()
PRESET_ROLLOUT = {"fp32": "fp32", "fp16": "fp16", "bf16": "bf16", "bf16-pure": "bf16"}
"""Each precision preset's rollout (and frozen-role) dtype."""


class Unmapped(Exception):
    """Raised by a converter: this value cannot be reproduced; the message is the reason."""


@dataclasses.dataclass(frozen=True)
class Record:
    """What became of one verl key."""

    kind: str
    """``mapped``, ``default`` (left out of the script: verl's default written), ``consistent`` (nothing to
    set) or ``unmapped``."""
    verl: str
    text: str
    """The value as the script wrote it (or verl's default)."""
    suite: str | None = None
    value: Any = None
    reason: str = ""
    line: int | None = None


@dataclasses.dataclass
class Mapped:
    """A verl job as suite pieces."""

    train: dict[str, Any]
    precision: dict[str, Any]
    """The job's own precision (``preset`` and ``overrides``): the baseline variant."""
    hardware: dict[str, Any]
    records: list[Record]
    notes: list[str]


# ---------------------------------------------------------------- values


def _dtype(v: Any) -> str:
    key = str(v).lower().removeprefix("torch.")
    names = {"bf16": "bf16", "bfloat16": "bf16", "fp16": "fp16", "float16": "fp16", "half": "fp16",
             "fp32": "fp32", "float32": "fp32", "float": "fp32"}  # fmt: skip
    if key not in names:
        raise Unmapped(f"dtype {v!r}: expected one of bf16, bfloat16, fp16, float16, fp32, float32")
    return names[key]


def _int(v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise Unmapped(f"expected an integer, got {v!r}")
    return v


def _float(v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise Unmapped(f"expected a number, got {v!r}")
    return float(v)


def _bool(v: Any) -> bool:
    if not isinstance(v, bool):
        raise Unmapped(f"expected true or false, got {v!r}")
    return v


def _str(v: Any) -> str:
    if not isinstance(v, str) or not v:
        raise Unmapped(f"expected a name, got {v!r}")
    return v


def _dict(v: Any) -> dict:
    if not isinstance(v, Mapping):
        raise Unmapped(f"expected a mapping {{k: v}}, got {v!r}")
    return dict(v)


def _truncation(v: Any) -> str:
    if v not in TRUNCATIONS:
        raise Unmapped(f"truncation {v!r}: verl's are {', '.join(TRUNCATIONS)}")
    return v


def _top_k(v: Any) -> int:
    return 0 if _int(v) < 0 else v  # verl's -1 and our 0 both mean no top-k


def _optional_float(v: Any) -> float | None:
    return None if v is None else _float(v)  # verl's null: the option's own fallback


def _choice(allowed: tuple[str, ...], what: str) -> Callable[[Any], str]:
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


def _rs_threshold(v: Any) -> str | float | None:
    if v is None or isinstance(v, str):
        return v
    return _float(v)


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
    when: Callable[[Context], str | None] = lambda ctx: None
    """None when the key is in effect for this job, else why it is not (then it is reported consistent)."""
    aliases: tuple[str, ...] = ()
    """The same key's spelling in other verl releases."""
    invertible: bool = True
    """The suite value is the verl value (diagnose writes a suite fix back as this verl key)."""


def _ppo_only(ctx: Context) -> str | None:
    return None if ctx.algo == "ppo" else "not used: a critic-free job has no critic (verl ignores it too)"


def _read(field: str) -> Callable[[Context], str | None]:
    """``when`` of ``algo.<field>``: AlgoConfig's own rule (`trainer.config.unread_algo_keys`) under the
    script's values; a key nothing reads is reported, not written (the suite would refuse it)."""

    def when(ctx: Context) -> str | None:
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


_KL = _choice(KL_ESTIMATORS, "KL estimator")

ROWS: tuple[Row, ...] = (
    Row("data.max_prompt_length", "data.prompt_length", _int, 512),
    Row("data.max_response_length", "data.response_length", _int, 512),
    Row("data.prompt_key", "data.prompt_key", _str, "prompt"),
    Row("data.truncation", "data.truncation", _truncation, "error"),
    Row("data.filter_overlong_prompts", "data.filter_overlong_prompts", _bool, False),
    Row("data.apply_chat_template_kwargs", "data.chat_template_kwargs", _dict),
    Row("data.reward_fn_key", "data.reward_fn_key", _str, "data_source"),
    _algo("batch_size", _int, 1024),
    _algo("lr", _float, 1e-6),
    _algo("weight_decay", _float, 0.01),
    _algo("critic_lr", _float, 1e-5, when=_ppo_only),
    _algo("ppo_epochs", _int, 1),
    _algo("max_grad_norm", _float, 1.0, aliases=(f"{V.ACTOR}.optim.clip_grad",)),
    _algo("gamma", _float, 1.0),
    _algo("lam", _float, 1.0),
    _algo("norm_adv_by_std_in_grpo", _bool, True),
    _algo("entropy_coef", _float, 0.0),
    # KL: in the reward (algorithm.*) and as a loss term (actor.*); each coefficient is read only when its
    # switch is on, as in verl (the `when` of each row reports it otherwise)
    _algo("use_kl_in_reward", _bool, False),
    _algo("kl_penalty", _KL, "kl"),
    _algo("kl_coef", _float, 0.001),
    _algo("kl_ctrl_type", _choice(KL_CTRL_TYPES, "KL controller"), "fixed"),
    _algo("kl_ctrl_target_kl", _float, 0.1),
    _algo("kl_ctrl_horizon", _int, 10000),
    _algo("use_kl_loss", _bool, False),
    _algo("kl_loss_coef", _float, 0.001),
    _algo("kl_loss_type", _KL, "low_var_kl"),
    # the policy loss
    _algo("loss_mode", _choice(POLICY_LOSSES, "policy loss"), "vanilla"),
    _algo("loss_agg_mode", _choice(LOSS_AGG_MODES, "loss_agg_mode"), "token-mean"),
    _algo("loss_scale_factor", _optional_float),
    _algo("clip_ratio", _float, 0.2),
    _algo("clip_ratio_low", _optional_float),  # verl's 0.2 defaults: `_map_clip_defaults`
    _algo("clip_ratio_high", _optional_float),
    _algo("clip_ratio_c", _float, 3.0),
    _algo("clip_cov_ratio", _float, 0.0002),
    _algo("clip_cov_lb", _float, 1.0),
    _algo("clip_cov_ub", _float, 5.0),
    _algo("kl_cov_ratio", _float, 0.0002),
    _algo("ppo_kl_coef", _float, 0.1),
    _algo("cliprange_value", _float, 0.5),
    _algo("temperature", _float, 1.0),
    _algo("top_k", _top_k, -1, invertible=False),
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
    Row(V.correction_key("rollout_is_threshold"), "rollout_correction.rollout_is_threshold", _float, 2.0),
    Row(V.correction_key("rollout_is_batch_normalize"), "rollout_correction.rollout_is_batch_normalize", _bool, False),
    Row(V.correction_key("rollout_rs"), "rollout_correction.rollout_rs", _rollout_rs, None),
    Row(V.correction_key("rollout_rs_threshold"), "rollout_correction.rollout_rs_threshold", _rs_threshold, None),
    Row(f"{V.ROLLOUT_CORRECTION}.bypass_mode", None, _consistent(False, "bypass mode (the rollout's log-probs "
                                                                 "as the old ones): the actor always recomputes them here")),
    Row(f"{V.ROLLOUT_CORRECTION}.rollout_rs_threshold_lower", None, _consistent(None, "a separate lower bound: "
                                                                                 "write rollout_rs_threshold as lower_upper")),
    Row(f"{V.ROLLOUT_CORRECTION}.rollout_token_veto_threshold", None, _consistent(None, "the per-token veto is "
                                                                                   "not in this version")),
    Row(V.LOGPROBS_MODE, None, _consistent("processed_logprobs", "the rollout log-probs here are always those of "
                                           "the distribution sampled from (processed: after temperature, top-k, top-p)")),
)  # fmt: skip
"""verl keys with one suite key each (or a value that must match what ours does). The algorithm's verl
spellings come from `verlaudit.verl_keys.ALGO_KEYS` (one table for diagnose, the log parser and this)."""


# ---------------------------------------------------------------- the context


class Context:
    """The script's overrides by key, what has been consumed, and the records and suite values made."""

    def __init__(self, launch: Launch) -> None:
        self.by_key: dict[str, Override] = {}
        for o in launch.overrides:
            self.by_key[canonical(o.key)] = o  # Hydra: the last override of a key wins
        self.used: set[str] = set()
        self.records: list[Record] = []
        self.notes: list[str] = []
        self.train: dict[str, Any] = {}
        self.algo = "ppo"
        """Our recipe: ``ppo`` (verl's gae) or ``grpo`` (every critic-free estimator)."""
        self.estimator: str | None = None
        """``algo.adv_estimator`` when the recipe's own (gae, grpo) is not the script's."""
        self.unread: dict[str, str] = {}
        """Algo options nothing reads in this job -> why (`_unread`)."""
        self.ours = TrainConfig().to_dict()

    def has(self, key: str) -> bool:
        return key in self.by_key and self.by_key[key].op != "delete"

    def get(self, key: str, default: Any = None) -> Any:
        """The script's value of ``key`` (or ``default``), without consuming it."""
        return self.by_key[key].value if self.has(key) else default

    def set(self, path: str, value: Any) -> None:
        node = self.train
        *parents, last = path.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[last] = value

    def _ours(self, path: str) -> Any:
        node: Any = self.ours
        for p in path.split("."):
            node = node.get(p, NO_DEFAULT) if isinstance(node, Mapping) else NO_DEFAULT
        return node

    def record(self, kind: str, key: str, *, suite: str | None = None, value: Any = None, reason: str = "",
               text: str | None = None, apply: bool = True) -> None:  # fmt: skip
        """Records what became of ``key`` (consuming it) and, for mapped keys, sets the suite value under
        ``train:`` (``apply=False``: a value outside ``train:``, set by the caller)."""
        o = self.by_key.get(key)
        self.used.add(key)
        if o is not None and o.problems and kind != "unmapped":
            kind, reason = "unmapped", "; ".join(o.problems)
        if kind in ("mapped", "default") and suite is not None and apply:
            self.set(suite, value)
        verl_key = o.key if o is not None else key
        shown = text if text is not None else (o.text if o is not None else "")
        self.records.append(
            Record(kind, verl_key, shown, suite, value, reason, o.line if o is not None else None)
        )

    def value(self, key: str, default: Any, convert: Callable[[Any], Any] = lambda v: v) -> tuple[Any, bool]:
        """``(converted value, from the script)``; the script's value when it can be read, else ``default``.
        A value that does not convert is recorded unmapped and ``default`` comes back."""
        if not self.has(key):
            return default, False
        o = self.by_key[key]
        if o.problems:
            self.record("unmapped", key)
            return default, False
        try:
            return convert(o.value), True
        except Unmapped as e:
            self.record("unmapped", key, reason=str(e))
            return default, False

    def default(self, key: str, suite: str, value: Any, text: str) -> None:
        """verl's default for a key the script leaves out, written when ours differs."""
        if self._ours(suite) != value:
            self.record("default", key, suite=suite, value=value, text=text)


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


# ---------------------------------------------------------------- handlers: keys that go together


def _map_algorithm(ctx: Context) -> None:
    """verl's estimator picks our recipe: ``gae`` is PPO with a critic; every other estimator is critic-free
    and runs the grpo recipe (``algo.adv_estimator`` names it unless it is ``grpo`` itself)."""
    key = V.algo_key("adv_estimator")
    est, given = ctx.value(key, "gae", _str)
    known = est in ADV_ESTIMATORS
    ctx.algo = "ppo" if est == "gae" else "grpo"
    ctx.set("algo.name", ctx.algo)
    if known and est not in ("gae", "grpo"):
        ctx.estimator = est
        ctx.record("mapped", key, suite="algo.adv_estimator", value=est, reason="critic-free: algo.name grpo")
    elif known and given:
        ctx.record("mapped", key, suite="algo.name", value=ctx.algo, apply=False)
    elif not known and key not in ctx.used:
        ctx.record("unmapped", key, reason=f"advantage estimator {est}: this version has {', '.join(ADV_ESTIMATORS)}; "
                   "the suite runs grpo, the closest critic-free recipe")  # fmt: skip
    elif not given:
        ctx.default(key, "algo.name", ctx.algo, "gae")


def _peek(ctx: Context, row: Row) -> Any:
    """The script's value of ``row`` converted, or NO_DEFAULT (left out, or a value the row refuses)."""
    o = ctx.by_key.get(row.verl)
    if o is None or o.op == "delete" or o.problems:
        return NO_DEFAULT
    try:
        return row.convert(o.value)
    except Unmapped:
        return NO_DEFAULT


def _unread(ctx: Context) -> dict[str, str]:
    """The algo options nothing reads in this job (`trainer.config.unread_algo_keys` over the script's
    values, verl's defaults for the rest: ours equal verl's for every option the rule looks at)."""
    values: dict[str, Any] = {f.name: f.default for f in dataclasses.fields(AlgoConfig)}
    values.update(name=ctx.algo, adv_estimator=ctx.estimator)
    for row in ROWS:
        if (
            row.suite is not None
            and row.suite.startswith("algo.")
            and (v := _peek(ctx, row)) is not NO_DEFAULT
        ):
            values[row.suite.removeprefix("algo.")] = v
    return unread_algo_keys(values)


def _map_rows(ctx: Context) -> None:
    for row in ROWS:
        key = row.verl
        off = row.when(ctx)
        if off is not None:
            if ctx.has(key):
                ctx.record("consistent", key, reason=off)
            continue
        value, given = ctx.value(key, NO_DEFAULT, row.convert)
        if key in ctx.used:  # refused by the converter: already recorded
            continue
        if given:
            if row.suite is None:
                ctx.record("consistent", key, reason="as here")
            else:
                ctx.record("mapped", key, suite=row.suite, value=value)
        elif row.default is not NO_DEFAULT and row.suite is not None:
            ctx.default(key, row.suite, row.convert(row.default), repr(row.default))


def _map_clip_defaults(ctx: Context) -> None:
    """verl's actor.yaml sets clip_ratio_low and clip_ratio_high to 0.2, and they win over clip_ratio; ours
    fall back to clip_ratio when unset. So a script that changes clip_ratio alone clips at 0.2 in verl."""
    clip = ctx.train.get("algo", {}).get("clip_ratio", 0.2)
    for side in ("clip_ratio_low", "clip_ratio_high"):
        key = V.algo_key(side)
        if clip != 0.2 and not ctx.has(key) and side not in ctx.unread:
            ctx.record("default", key, suite=f"algo.{side}", value=0.2, text="0.2",
                       reason=f"verl's default, which wins over clip_ratio {clip}")  # fmt: skip


def _map_twins(ctx: Context) -> None:
    """Critic keys that ours shares with the actor: reported consistent when equal, else unmapped."""
    algo = ctx.train.get("algo", {})
    twins = (
        (f"{V.CRITIC}.ppo_micro_batch_size_per_gpu", algo.get("micro_batch_size")),
        (f"{V.CRITIC}.ppo_mini_batch_size", ctx.get(V.algo_key("mini_batch_size"), 256)),
        (f"{V.CRITIC}.ppo_epochs", algo.get("ppo_epochs", 1)),
        (f"{V.CRITIC}.loss_agg_mode", algo.get("loss_agg_mode", "token-mean")),
        (f"{V.CRITIC}.grad_clip", algo.get("max_grad_norm", 1.0)),
        (f"{V.CRITIC}.optim.weight_decay", algo.get("weight_decay", 0.01)),
    )
    for key, actor_value in twins:
        if not ctx.has(key) or key in ctx.used:
            continue
        if ctx.algo != "ppo":
            ctx.record(
                "consistent", key, reason="not used: a critic-free job has no critic (verl ignores it too)"
            )
        elif ctx.get(key) == actor_value:
            ctx.record("consistent", key, reason="equals the actor's")
        else:
            ctx.record(
                "unmapped", key, reason=f"one value for actor and critic here: the actor's ({actor_value})"
            )


def _map_batches(ctx: Context, gpus: int) -> None:
    """verl counts ppo_mini_batch_size in prompts and multiplies by rollout.n; ours counts sequences."""
    n_key, mini_key, micro_key = (
        V.algo_key(k) for k in ("group_size", "mini_batch_size", "micro_batch_size")
    )
    n, n_given = ctx.value(n_key, 1, _int)
    if ctx.algo == "grpo":
        (ctx.record("mapped", n_key, suite="algo.group_size", value=n) if n_given
         else ctx.default(n_key, "algo.group_size", 1, "1"))  # fmt: skip
        if n == 1:
            ctx.notes.append("rollout.n is 1: GRPO's group advantage is 0 for a group of one here")
    elif n_given:
        if n == 1:
            ctx.record("consistent", n_key, reason="one response per prompt, as here")
        else:
            ctx.record("unmapped", n_key, reason="PPO here samples one response per prompt")
        n = 1
    mini, mini_given = ctx.value(mini_key, 256, _int)
    ctx.record("mapped" if mini_given else "default", mini_key, suite="algo.mini_batch_size", value=mini * n,
               text=None if mini_given else "256")  # fmt: skip
    micro, given = ctx.value(micro_key, None, _int)
    if given:
        ctx.record("mapped", micro_key, suite="algo.micro_batch_size", value=micro)
        return
    total, given = ctx.value(f"{V.ACTOR}.ppo_micro_batch_size", None, _int)
    if given:
        ctx.record("mapped", f"{V.ACTOR}.ppo_micro_batch_size", suite="algo.micro_batch_size",
                   value=max(1, total // gpus), reason=f"global {total} over {gpus} GPUs")  # fmt: skip
    else:
        micro = max(1, mini * n // gpus)
        ctx.set("algo.micro_batch_size", micro)
        ctx.notes.append(f"no ppo_micro_batch_size_per_gpu in the script (verl needs one unless use_dynamic_bsz): "
                         f"algo.micro_batch_size {micro}, one micro-batch per rank and mini-batch")  # fmt: skip


def _map_hardware(ctx: Context, target: str) -> tuple[dict[str, Any], int]:
    per_node, g1 = ctx.value(V.N_GPUS, 8, _int)
    nodes, g2 = ctx.value("trainer.nnodes", 1, _int)
    gpus = max(1, per_node * nodes)
    for key, given in ((V.N_GPUS, g1), ("trainer.nnodes", g2)):
        if given:
            ctx.record("mapped", key, suite="hardware.gpus", value=gpus, apply=False)
    if not g1:
        ctx.record("default", V.N_GPUS, suite="hardware.gpus", value=gpus, text="8", apply=False)
    return {"target": target, "gpus": gpus}, gpus


_TRAINABLE = {"fp32": ("fp32", "fp32"), "fp16": ("fp32", "fp16"), "bf16": ("fp32", "bf16"),
              "bf16-pure": ("bf16", "bf16"), "fp16-pure": ("fp16", "fp16")}  # fmt: skip
"""A trainable role's (param_dtype, compute_dtype) under each of verl's dtype combinations."""


def _role_precision(ctx: Context, model_key: str, param_key: str) -> str:
    """``fp32`` / ``fp16`` / ``bf16`` / ``bf16-pure`` / ``fp16-pure`` from a role's FSDP dtypes (verl:
    ``model_dtype`` is the stored master copy, ``mixed_precision.param_dtype`` the compute dtype)."""
    model, _ = ctx.value(model_key, "fp32", _dtype)
    param, _ = ctx.value(param_key, "bf16", _dtype)
    if model == "fp32":
        kind = param
    else:
        kind = "bf16-pure" if model == "bf16" else "fp16-pure"
        if param != model and ctx.has(param_key):
            ctx.record("unmapped", param_key, reason=f"compute in {param} over {model} weights: a low-precision "
                       f"copy computes in its own dtype here ({model})")  # fmt: skip
    return kind


def _map_precision(ctx: Context) -> dict[str, Any]:
    """The job's own precision as a preset plus per-role overrides (the baseline variant)."""
    fsdp = f"{V.ACTOR}.fsdp_config"
    actor = _role_precision(ctx, V.MODEL_DTYPE, f"{fsdp}.mixed_precision.param_dtype")
    preset = "fp16" if actor == "fp16-pure" else actor
    overrides: dict[str, dict[str, str]] = {}
    if actor == "fp16-pure":
        overrides["actor"] = {"param_dtype": "fp16", "compute_dtype": "fp16"}
    if ctx.algo == "ppo":
        cfsdp = f"{V.CRITIC_MODEL}.fsdp_config"
        critic = _role_precision(ctx, f"{cfsdp}.model_dtype", f"{cfsdp}.mixed_precision.param_dtype")
        if _TRAINABLE[critic] != _TRAINABLE[preset]:
            pd, cd = _TRAINABLE[critic]
            overrides["critic"] = {"param_dtype": pd, "compute_dtype": cd}
    rollout, _ = ctx.value(V.ROLLOUT_DTYPE, "bf16", _dtype)
    if rollout != PRESET_ROLLOUT[preset]:
        overrides["rollout"] = {"param_dtype": rollout, "compute_dtype": rollout}
    for key, field in ((f"{V.REF}.fsdp_config.model_dtype", "param_dtype"),
                       (f"{V.REF}.fsdp_config.mixed_precision.param_dtype", "compute_dtype")):  # fmt: skip
        value, given = ctx.value(key, None, _dtype)
        if given and value != PRESET_ROLLOUT[preset]:  # the preset's frozen roles store and compute in this
            overrides.setdefault("reference", {})[field] = value
    reduce, given = ctx.value(f"{fsdp}.mixed_precision.reduce_dtype", None, _dtype)
    if given and reduce != ("bf16" if preset == "bf16-pure" else "fp32"):
        overrides.setdefault("actor", {})["reduce_dtype"] = reduce
    for role in (fsdp, f"{V.CRITIC_MODEL}.fsdp_config"):
        buffer, given = ctx.value(f"{role}.mixed_precision.buffer_dtype", None, _dtype)
        if given:
            kind, why = ("consistent", "buffers keep their stored dtype here (fp32 rotary)") if buffer == "fp32" else (
                "unmapped", "FSDP buffer dtype: no per-buffer dtype in this policy (the audit flags buffers stored "
                "in low precision)")  # fmt: skip
            ctx.record(kind, f"{role}.mixed_precision.buffer_dtype", reason=why)
    baseline = {"preset": preset, "overrides": overrides}
    shown = preset + "".join(
        f"; {role} " + ", ".join(f"{k} {v}" for k, v in fields.items()) for role, fields in overrides.items()
    )
    for key in (V.MODEL_DTYPE, f"{fsdp}.mixed_precision.param_dtype", V.ROLLOUT_DTYPE,
                f"{fsdp}.mixed_precision.reduce_dtype", f"{V.REF}.fsdp_config.model_dtype",
                f"{V.REF}.fsdp_config.mixed_precision.param_dtype", f"{V.CRITIC_MODEL}.fsdp_config.model_dtype",
                f"{V.CRITIC_MODEL}.fsdp_config.mixed_precision.param_dtype"):  # fmt: skip
        if ctx.has(key) and key not in ctx.used:
            ctx.record("mapped", key, suite="variants.verl.precision", value=shown, apply=False)
    gc = {}
    for role, key in (("actor", f"{V.MODEL}.enable_gradient_checkpointing"),
                      ("critic", f"{V.CRITIC_MODEL}.enable_gradient_checkpointing")):  # fmt: skip
        if role == "critic" and ctx.algo != "ppo":
            if ctx.has(key):
                ctx.record("consistent", key, reason="not used: a critic-free job has no critic")
            continue
        gc[role], given = ctx.value(key, True, _bool)
        if given:
            ctx.record("mapped", key, suite="precision.grad_checkpointing", value=gc[role], apply=False)
    value = gc["actor"] if len(set(gc.values())) == 1 else gc
    if value is not False:
        ctx.set("precision.grad_checkpointing", value)
    return baseline


_ATTENTION = ("sdpa", "eager", "flash_attention_2")


def _map_engines(ctx: Context, target: str) -> None:
    """The attention kernel (verl: ``model.override_config.attn_implementation``, flash_attention_2 unless
    set) and the rollout engine (verl: ``rollout.name``, `verlaudit.verl.engines`)."""
    key = f"{V.MODEL}.override_config.attn_implementation"
    attn, given = ctx.value(key, None, _choice(_ATTENTION, "attention implementation"))
    if given:
        ctx.record("mapped", key, suite="model.attn_implementation", value=attn)
    elif key not in ctx.used:
        ctx.notes.append("attention: verl loads the model with flash_attention_2 unless "
                         "model.override_config.attn_implementation says otherwise; the suite keeps sdpa "
                         "(set model.attn_implementation: flash_attention_2 where flash-attn is installed)")  # fmt: skip
    critic_key = f"{V.CRITIC_MODEL}.override_config.attn_implementation"
    if ctx.has(critic_key):
        same = ctx.get(critic_key) == (attn if given else "flash_attention_2")
        ctx.record("consistent" if same else "unmapped", critic_key,
                   reason="equals the actor's" if same else "one attention implementation for every role here: "
                   "the actor's")  # fmt: skip
    key = f"{V.ROLLOUT}.name"
    if not ctx.has(key):
        return
    name = str(ctx.get(key))
    if name == "hf":
        ctx.record("mapped", key, suite="rollout.engine", value="hf", reason="HF generate, as in verl")
    elif name in INFERENCE_ENGINES:  # after _map_model: the fused decode's support depends on the model
        engine, why = rollout_engine(name, target=target, model=ctx.train["model"])
        ctx.record("mapped", key, suite="rollout.engine", value=engine, reason=why)
        if engine != name:
            ctx.notes.append(f"rollout: {key}={name} -> rollout.engine: {engine}: {why}")
    else:
        ctx.record("unmapped", key, reason=f"rollout engine {name!r}: verl's are {', '.join(INFERENCE_ENGINES)} "
                   "and hf; the suite keeps its default engine (hf)")  # fmt: skip


def _local_dir(path: str) -> str | None:
    p = os.path.expanduser(path)
    return p if os.path.isdir(p) else None


def _map_model(ctx: Context, model: str | None) -> None:
    key = f"{V.MODEL}.path"
    path, given = ctx.value(key, "~/models/deepseek-llm-7b-chat", _str)
    chosen = model or path
    local = _local_dir(chosen)
    arch = lookup(chosen)
    from trainer.models import PRESETS

    if local is not None and os.path.isfile(os.path.join(local, "config.json")):
        suite = {"path": local}
    elif arch is not None:
        suite = {"preset": arch.preset, **({"overrides": dict(arch.overrides)} if arch.overrides else {})}
        ctx.notes.append(f"model {chosen}: not a local directory here; random-init {arch.name} architecture "
                         "(model.overrides), the project's character tokenizer (no chat template)"
                         + (f"; {arch.note}" if arch.note else ""))  # fmt: skip
    elif chosen in PRESETS:
        suite = {"preset": chosen}
    else:
        raise ValueError(f"{key}={chosen}: not a local model directory (with config.json) and not a known "
                         f"architecture ({', '.join(sorted({a.name for a in KNOWN.values()}))}); pass --model "
                         "with a local directory, a known name or a preset of trainer/models.py")  # fmt: skip
    ctx.set("model", suite)
    why = f"replaced by --model {model}" if model else ""
    ctx.record("mapped" if given else "default", key, suite="model", value=suite, reason=why,
               text=None if given else path, apply=False)  # fmt: skip
    for tok_key in (f"{V.MODEL}.tokenizer_path", "data.tokenizer"):
        tok, tok_given = ctx.value(tok_key, None, lambda v: v)
        if tok_given and tok is not None:
            if _local_dir(tok):
                ctx.record("mapped", tok_key, suite="model.tokenizer", value=_local_dir(tok))
            else:
                ctx.record("unmapped", tok_key, reason=f"{tok} is not a local directory: the model's own tokenizer "
                           "(or the project's) is used")  # fmt: skip
    critic_key = f"{V.CRITIC_MODEL}.path"
    if ctx.has(critic_key):
        critic = ctx.get(critic_key)
        if ctx.algo != "ppo":
            ctx.record("consistent", critic_key, reason="not used: a critic-free job has no critic")
        elif critic == path or os.path.expanduser(str(critic)) == os.path.expanduser(path):
            ctx.record("consistent", critic_key, reason="the critic starts from the actor's weights, as here")
        elif _local_dir(str(critic)):
            ctx.record("mapped", critic_key, suite="model.critic_path", value=_local_dir(str(critic)))
        else:
            ctx.record("unmapped", critic_key, reason=f"{critic} is not a local directory: the critic starts from "
                       "the actor's weights")  # fmt: skip


def _map_data(ctx: Context) -> None:
    from trainer.verl_data import count_rows

    key = "data.train_files"
    files, given = ctx.value(key, "~/data/rlhf/gsm8k/train.parquet", lambda v: v)
    listed = [os.path.expanduser(str(f)) for f in (files if isinstance(files, list) else [files])]
    value = listed[0] if len(listed) == 1 else listed
    ctx.record("mapped" if given else "default", key, suite="data.train_files", value=value,
               text=None if given else str(files))  # fmt: skip
    missing = [f for f in listed if not os.path.isfile(f)]
    if missing:
        ctx.notes.append(
            f"data.train_files: {', '.join(missing)} not found here; put verl's data there before running"
        )
    path, given = ctx.value("custom_reward_function.path", None, lambda v: v)
    if given and path:
        name, _ = ctx.value("custom_reward_function.name", "compute_score", _str)
        # absolute: the script's path is relative to where verl ran, a suite's to the suite file
        spec = f"{os.path.abspath(os.path.expanduser(str(path)))}:{name}"
        ctx.record("mapped", "custom_reward_function.path", suite="data.compute_score", value=spec)
        if ctx.has("custom_reward_function.name"):
            ctx.record(
                "mapped", "custom_reward_function.name", suite="data.compute_score", value=spec, apply=False
            )
        if not os.path.isfile(os.path.expanduser(str(path))):
            ctx.notes.append(f"custom_reward_function.path: {path} not found here")
    kwargs, given = ctx.value("custom_reward_function.reward_kwargs", {}, _dict)
    if given:
        ctx.record(
            "mapped", "custom_reward_function.reward_kwargs", suite="data.compute_score_kwargs", value=kwargs
        )
    steps, given = ctx.value("trainer.total_training_steps", None, lambda v: v)
    if given and steps is not None:
        ctx.record("mapped", "trainer.total_training_steps", suite="steps", value=_int(steps))
        return
    epochs, e_given = ctx.value("trainer.total_epochs", 30, _int)
    rows = count_rows(listed) if not missing else None
    batch = ctx.train.get("algo", {}).get("batch_size", 1024)
    if rows is None:
        ctx.notes.append("steps: total_epochs needs the data's row count (files not here); steps left at the "
                         "suite default: pass --steps")  # fmt: skip
        return
    steps = max(1, epochs * (rows // batch))
    ctx.record("mapped" if e_given else "default", "trainer.total_epochs", suite="steps", value=steps,
               reason=f"{epochs} epochs x {rows // batch} batches of {batch} ({rows} rows, the last partial batch "
               "dropped as verl's loader does)", text=None if e_given else "30")  # fmt: skip


def _map_leftovers(ctx: Context) -> None:
    for key, o in ctx.by_key.items():
        if key in ctx.used:
            continue
        if o.op == "delete":
            ctx.record("unmapped", key, reason="deletes a key of verl's config (~key): not reproduced")
            continue
        reason = unmapped_reason(key)
        ctx.record("unmapped", key, reason=reason or "not in from-verl's table (a key of another verl release, "
                   "or a misspelling?)")  # fmt: skip


def map_launch(launch: Launch, *, target: str, model: str | None = None) -> Mapped:
    """The suite pieces of ``launch`` and what became of each key."""
    ctx = Context(launch)
    _map_algorithm(ctx)
    hardware, gpus = _map_hardware(ctx, target)
    ctx.unread = _unread(ctx)
    _map_rows(ctx)
    _map_clip_defaults(ctx)
    _map_batches(ctx, gpus)
    _map_twins(ctx)
    _map_model(ctx, model)
    _map_engines(ctx, target)
    precision = _map_precision(ctx)
    _map_data(ctx)
    _map_leftovers(ctx)
    records = sorted(ctx.records, key=lambda r: (r.line is None, r.line or 0))
    return Mapped(train=ctx.train, precision=precision, hardware=hardware, records=records,
                  notes=list(launch.notes) + ctx.notes)  # fmt: skip


def canonical(key: str) -> str:
    """The spelling the table uses for ``key`` (verl 0.5's), whatever release's spelling it is in."""
    return _ROW_ALIASES.get(key, ALIASES.get(key, key))


_ROW_ALIASES = {a: r.verl for r in ROWS for a in r.aliases}
