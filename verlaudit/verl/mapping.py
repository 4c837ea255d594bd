"""From a parsed verl script to suite pieces: `map_launch` applies the key table
(`verlaudit.verl.rows`: each verl key -> the suite key it becomes, how its value converts, verl's
default, or the reason it is not mapped) and the handlers below, over a `verlaudit.verl.context.Context`.

One row per key in `ROWS` (a value conversion may refuse a value with `Unmapped`, whose reason is
reported); the algorithm's rows take verl's spelling from `verlaudit.verl_keys.ALGO_KEYS`, and a key
that nothing reads under the script's other settings (a KL coefficient with its switch off, a clip
bound of another loss) is reported as verl ignores it, by AlgoConfig's own rule
(`trainer.algo_config.unread_algo_keys`). Keys that only make sense together (the estimator and recipe,
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
from typing import Any

from trainer.advantages import ADV_ESTIMATORS
from trainer.config import (
    AlgoConfig,
    unread_algo_keys,
)
from trainer.verl_versions import check as check_verl_version
from verlaudit import verl_keys as V
from verlaudit.verl.architectures import KNOWN, lookup
from verlaudit.verl.context import Context, Record
from verlaudit.verl.engines import INFERENCE_ENGINES, rollout_engine
from verlaudit.verl.launch import Launch
from verlaudit.verl.reasons import unmapped_reason
from verlaudit.verl.rows import (
    NO_DEFAULT,
    ROWS,
    Row,
    Unmapped,
    as_bool,
    as_dict,
    as_dtype,
    as_int,
    as_str,
    choice,
)

PRESET_ROLLOUT = {"fp32": "fp32", "fp16": "fp16", "bf16": "bf16", "bf16-pure": "bf16"}
"""Each precision preset's rollout (and frozen-role) dtype."""


@dataclasses.dataclass
class Mapped:
    """A verl job as suite pieces."""

    train: dict[str, Any]
    precision: dict[str, Any]
    """The job's own precision (``preset`` and ``overrides``): the baseline variant."""
    hardware: dict[str, Any]
    records: list[Record]
    notes: list[str]


# ---------------------------------------------------------------- handlers: keys that go together


def _map_algorithm(ctx: Context) -> None:
    """verl's estimator picks our recipe: ``gae`` is PPO with a critic; every other estimator is critic-free
    and runs the grpo recipe (``algo.adv_estimator`` names it unless it is ``grpo`` itself)."""
    key = V.algo_key("adv_estimator")
    est, given = ctx.value(key, "gae", as_str)
    known = est in ADV_ESTIMATORS
    ctx.algo = "ppo" if est == "gae" else "grpo"
    ctx.set("algo.name", ctx.algo)
    if known and est not in ("gae", "grpo"):
        ctx.estimator = est
        ctx.record("mapped", key, suite="algo.adv_estimator", value=est, reason="critic-free: algo.name grpo")
    elif known and given:
        ctx.record("mapped", key, suite="algo.name", value=ctx.algo, apply=False)
    elif not known and key not in ctx.used:
        ctx.record(
            "unmapped",
            key,
            reason=f"advantage estimator {est}: this version has {', '.join(ADV_ESTIMATORS)}; "
            "the suite runs grpo, the closest critic-free recipe",
        )
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
    values: dict[str, Any] = AlgoConfig.defaults()
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
            ctx.record(
                "default",
                key,
                suite=f"algo.{side}",
                value=0.2,
                text="0.2",
                reason=f"verl's default, which wins over clip_ratio {clip}",
            )


def _map_bypass(ctx: Context) -> None:
    """verl's bypass mode replaces the actor's loss_mode by ``bypass_mode`` (``apply_bypass_mode``); a
    suite says it: ``algo.loss_mode: bypass_mode`` beside ``rollout_correction.bypass_mode: true``."""
    if not ctx.train.get("rollout_correction", {}).get("bypass_mode"):
        return
    was = ctx.train.get("algo", {}).get("loss_mode", "vanilla")
    if was != "bypass_mode":
        ctx.set("algo.loss_mode", "bypass_mode")
        ctx.notes.append(
            f"{V.correction_key('bypass_mode')}=true: verl replaces {V.algo_key('loss_mode')} ({was}) by "
            "bypass_mode, so the suite sets algo.loss_mode: bypass_mode"
        )


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
    n, n_given = ctx.value(n_key, 1, as_int)
    if ctx.algo == "grpo":
        (
            ctx.record("mapped", n_key, suite="algo.group_size", value=n)
            if n_given
            else ctx.default(n_key, "algo.group_size", 1, "1")
        )
        if n == 1:
            ctx.notes.append("rollout.n is 1: GRPO's group advantage is 0 for a group of one here")
    elif n_given:
        if n == 1:
            ctx.record("consistent", n_key, reason="one response per prompt, as here")
        else:
            ctx.record("unmapped", n_key, reason="PPO here samples one response per prompt")
        n = 1
    mini, mini_given = ctx.value(mini_key, 256, as_int)
    ctx.record(
        "mapped" if mini_given else "default",
        mini_key,
        suite="algo.mini_batch_size",
        value=mini * n,
        text=None if mini_given else "256",
    )
    micro, given = ctx.value(micro_key, None, as_int)
    if given:
        ctx.record("mapped", micro_key, suite="algo.micro_batch_size", value=micro)
        return
    total, given = ctx.value(f"{V.ACTOR}.ppo_micro_batch_size", None, as_int)
    if given:
        ctx.record(
            "mapped",
            f"{V.ACTOR}.ppo_micro_batch_size",
            suite="algo.micro_batch_size",
            value=max(1, total // gpus),
            reason=f"global {total} over {gpus} GPUs",
        )
    else:
        micro = max(1, mini * n // gpus)
        ctx.set("algo.micro_batch_size", micro)
        ctx.notes.append(
            f"no ppo_micro_batch_size_per_gpu in the script (verl needs one unless use_dynamic_bsz): "
            f"algo.micro_batch_size {micro}, one micro-batch per rank and mini-batch"
        )


def _map_hardware(ctx: Context, target: str) -> tuple[dict[str, Any], int]:
    per_node, g1 = ctx.value(V.N_GPUS, 8, as_int)
    nodes, g2 = ctx.value("trainer.nnodes", 1, as_int)
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
    model, _ = ctx.value(model_key, "fp32", as_dtype)
    param, _ = ctx.value(param_key, "bf16", as_dtype)
    if model == "fp32":
        kind = param
    else:
        kind = "bf16-pure" if model == "bf16" else "fp16-pure"
        if param != model and ctx.has(param_key):
            ctx.record(
                "unmapped",
                param_key,
                reason=f"compute in {param} over {model} weights: a low-precision "
                f"copy computes in its own dtype here ({model})",
            )
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
    rollout, _ = ctx.value(V.ROLLOUT_DTYPE, "bf16", as_dtype)
    if rollout != PRESET_ROLLOUT[preset]:
        overrides["rollout"] = {"param_dtype": rollout, "compute_dtype": rollout}
    for key, field in (
        (f"{V.REF}.fsdp_config.model_dtype", "param_dtype"),
        (f"{V.REF}.fsdp_config.mixed_precision.param_dtype", "compute_dtype"),
    ):
        value, given = ctx.value(key, None, as_dtype)
        if given and value != PRESET_ROLLOUT[preset]:  # the preset's frozen roles store and compute in this
            overrides.setdefault("reference", {})[field] = value
    reduce, given = ctx.value(f"{fsdp}.mixed_precision.reduce_dtype", None, as_dtype)
    if given and reduce != ("bf16" if preset == "bf16-pure" else "fp32"):
        overrides.setdefault("actor", {})["reduce_dtype"] = reduce
    for role in (fsdp, f"{V.CRITIC_MODEL}.fsdp_config"):
        buffer, given = ctx.value(f"{role}.mixed_precision.buffer_dtype", None, as_dtype)
        if given:
            kind, why = (
                ("consistent", "buffers keep their stored dtype here (fp32 rotary)")
                if buffer == "fp32"
                else (
                    "unmapped",
                    "FSDP buffer dtype: no per-buffer dtype in this policy (the audit flags buffers stored "
                    "in low precision)",
                )
            )
            ctx.record(kind, f"{role}.mixed_precision.buffer_dtype", reason=why)
    baseline = {"preset": preset, "overrides": overrides}
    shown = preset + "".join(
        f"; {role} " + ", ".join(f"{k} {v}" for k, v in fields.items()) for role, fields in overrides.items()
    )
    for key in (
        V.MODEL_DTYPE,
        f"{fsdp}.mixed_precision.param_dtype",
        V.ROLLOUT_DTYPE,
        f"{fsdp}.mixed_precision.reduce_dtype",
        f"{V.REF}.fsdp_config.model_dtype",
        f"{V.REF}.fsdp_config.mixed_precision.param_dtype",
        f"{V.CRITIC_MODEL}.fsdp_config.model_dtype",
        f"{V.CRITIC_MODEL}.fsdp_config.mixed_precision.param_dtype",
    ):
        if ctx.has(key) and key not in ctx.used:
            ctx.record("mapped", key, suite="variants.verl.precision", value=shown, apply=False)
    gc = {}
    for role, key in (
        ("actor", f"{V.MODEL}.enable_gradient_checkpointing"),
        ("critic", f"{V.CRITIC_MODEL}.enable_gradient_checkpointing"),
    ):
        if role == "critic" and ctx.algo != "ppo":
            if ctx.has(key):
                ctx.record("consistent", key, reason="not used: a critic-free job has no critic")
            continue
        gc[role], given = ctx.value(key, True, as_bool)
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
    attn, given = ctx.value(key, None, choice(_ATTENTION, "attention implementation"))
    if given:
        ctx.record("mapped", key, suite="model.attn_implementation", value=attn)
    elif key not in ctx.used:
        ctx.notes.append(
            "attention: verl loads the model with flash_attention_2 unless "
            "model.override_config.attn_implementation says otherwise; the suite keeps sdpa "
            "(set model.attn_implementation: flash_attention_2 where flash-attn is installed)"
        )
    critic_key = f"{V.CRITIC_MODEL}.override_config.attn_implementation"
    if ctx.has(critic_key):
        same = ctx.get(critic_key) == (attn if given else "flash_attention_2")
        ctx.record(
            "consistent" if same else "unmapped",
            critic_key,
            reason="equals the actor's"
            if same
            else "one attention implementation for every role here: the actor's",
        )
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
        ctx.record(
            "unmapped",
            key,
            reason=f"rollout engine {name!r}: verl's are {', '.join(INFERENCE_ENGINES)} "
            "and hf; the suite keeps its default engine (hf)",
        )


def _local_dir(path: str) -> str | None:
    p = os.path.expanduser(path)
    return p if os.path.isdir(p) else None


def _map_model(ctx: Context, model: str | None) -> None:
    key = f"{V.MODEL}.path"
    path, given = ctx.value(key, "~/models/deepseek-llm-7b-chat", as_str)
    chosen = model or path
    local = _local_dir(chosen)
    arch = lookup(chosen)
    from trainer.models import PRESETS

    if local is not None and os.path.isfile(os.path.join(local, "config.json")):
        suite = {"path": local}
    elif arch is not None:
        suite = {"preset": arch.preset, **({"overrides": dict(arch.overrides)} if arch.overrides else {})}
        ctx.notes.append(
            f"model {chosen}: not a local directory here; random-init {arch.name} architecture "
            "(model.overrides), the project's character tokenizer (no chat template)"
            + (f"; {arch.note}" if arch.note else "")
        )
    elif chosen in PRESETS:
        suite = {"preset": chosen}
    else:
        raise ValueError(
            f"{key}={chosen}: not a local model directory (with config.json) and not a known "
            f"architecture ({', '.join(sorted({a.name for a in KNOWN.values()}))}); pass --model "
            "with a local directory, a known name or a preset of trainer/models.py"
        )
    ctx.set("model", suite)
    why = f"replaced by --model {model}" if model else ""
    ctx.record(
        "mapped" if given else "default",
        key,
        suite="model",
        value=suite,
        reason=why,
        text=None if given else path,
        apply=False,
    )
    for tok_key in (f"{V.MODEL}.tokenizer_path", "data.tokenizer"):
        tok, tok_given = ctx.value(tok_key, None, lambda v: v)
        if tok_given and tok is not None:
            if _local_dir(tok):
                ctx.record("mapped", tok_key, suite="model.tokenizer", value=_local_dir(tok))
            else:
                ctx.record(
                    "unmapped",
                    tok_key,
                    reason=f"{tok} is not a local directory: the model's own tokenizer "
                    "(or the project's) is used",
                )
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
            ctx.record(
                "unmapped",
                critic_key,
                reason=f"{critic} is not a local directory: the critic starts from the actor's weights",
            )


def _map_data(ctx: Context) -> None:
    from trainer.verl_data import count_rows

    key = "data.train_files"
    files, given = ctx.value(key, "~/data/rlhf/gsm8k/train.parquet", lambda v: v)
    listed = [os.path.expanduser(str(f)) for f in (files if isinstance(files, list) else [files])]
    value = listed[0] if len(listed) == 1 else listed
    ctx.record(
        "mapped" if given else "default",
        key,
        suite="data.train_files",
        value=value,
        text=None if given else str(files),
    )
    missing = [f for f in listed if not os.path.isfile(f)]
    if missing:
        ctx.notes.append(
            f"data.train_files: {', '.join(missing)} not found here; put verl's data there before running"
        )
    path, given = ctx.value("custom_reward_function.path", None, lambda v: v)
    if given and path:
        name, _ = ctx.value("custom_reward_function.name", "compute_score", as_str)
        # as verl reads it, from where it runs; the writer makes it relative to the suite file
        spec = f"{os.path.expanduser(str(path))}:{name}"
        ctx.record("mapped", "custom_reward_function.path", suite="data.compute_score", value=spec)
        if ctx.has("custom_reward_function.name"):
            ctx.record(
                "mapped", "custom_reward_function.name", suite="data.compute_score", value=spec, apply=False
            )
        if not os.path.isfile(os.path.expanduser(str(path))):
            ctx.notes.append(f"custom_reward_function.path: {path} not found here")
    kwargs, given = ctx.value("custom_reward_function.reward_kwargs", {}, as_dict)
    if given:
        ctx.record(
            "mapped", "custom_reward_function.reward_kwargs", suite="data.compute_score_kwargs", value=kwargs
        )
    steps, given = ctx.value("trainer.total_training_steps", None, lambda v: v)
    if given and steps is not None:
        ctx.record("mapped", "trainer.total_training_steps", suite="steps", value=as_int(steps))
        return
    epochs, e_given = ctx.value("trainer.total_epochs", 30, as_int)
    rows = count_rows(listed) if not missing else None
    batch = ctx.train.get("algo", {}).get("batch_size", 1024)
    if rows is None:
        ctx.notes.append(
            "steps: total_epochs needs the data's row count (files not here); steps left at the "
            "suite default: pass --steps"
        )
        return
    steps = max(1, epochs * (rows // batch))
    ctx.record(
        "mapped" if e_given else "default",
        "trainer.total_epochs",
        suite="steps",
        value=steps,
        reason=f"{epochs} epochs x {rows // batch} batches of {batch} ({rows} rows, the last partial batch "
        "dropped as verl's loader does)",
        text=None if e_given else "30",
    )


def _map_leftovers(ctx: Context) -> None:
    for key, o in ctx.by_key.items():
        if key in ctx.used:
            continue
        if o.op == "delete":
            ctx.record("unmapped", key, reason="deletes a key of verl's config (~key): not reproduced")
            continue
        reason = unmapped_reason(key)
        ctx.record(
            "unmapped",
            key,
            reason=reason or "not in from-verl's table (a key of another verl release, or a misspelling?)",
        )


def map_launch(
    launch: Launch, *, target: str, model: str | None = None, verl_version: str | None = None
) -> Mapped:
    """The suite pieces of ``launch`` and what became of each key; ``verl_version`` (``--verl-version``)
    becomes ``algo.verl_version`` (unset: the suite's default, the latest verl release line)."""
    ctx = Context(launch)
    if verl_version is not None:
        try:
            check_verl_version(verl_version)
        except ValueError as e:
            raise ValueError(f"--verl-version: {e}") from None
        ctx.set("algo.verl_version", verl_version)
    _map_algorithm(ctx)
    hardware, gpus = _map_hardware(ctx, target)
    ctx.unread = _unread(ctx)
    _map_rows(ctx)
    _map_clip_defaults(ctx)
    _map_bypass(ctx)
    _map_batches(ctx, gpus)
    _map_twins(ctx)
    _map_model(ctx, model)
    _map_engines(ctx, target)
    precision = _map_precision(ctx)
    _map_data(ctx)
    _map_leftovers(ctx)
    records = sorted(ctx.records, key=lambda r: (r.line is None, r.line or 0))
    return Mapped(
        train=ctx.train,
        precision=precision,
        hardware=hardware,
        records=records,
        notes=list(launch.notes) + ctx.notes,
    )
