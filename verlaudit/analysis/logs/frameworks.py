"""Which framework wrote a log (from its own lines: verl's worker names, TRL's trainer classes,
DeepSpeed's ``[deepspeed]`` tag, vLLM's logger format, ...), the settings the log prints (hydra
overrides, CLI flags, ``TrainingArguments(...)`` / engine-config reprs, DeepSpeed's config dump), and
the fix vocabulary: one remedy spelled as each framework spells it (a verl key from
``verlaudit.verl_keys``, a TrainingArguments / GRPOConfig field, a DeepSpeed config key, an OpenRLHF
flag, a vLLM or SGLang engine argument), dropped when the log shows it is already set.
Exercised by ``pytest tests/test_log_rules.py -k framework``.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Mapping

from verlaudit import verl_keys as V
from verlaudit.analysis.causes import Fix
from verlaudit.analysis.logs.lines import hints

# ---- which framework: markers in the log's own lines
_MARKERS = {
    "verl": re.compile(
        rf"{V.ACTOR_ROLLOUT_REF}|/verl/|\bverl/(?:workers|trainer|utils|single_controller)/"
        r"|\bverl\.(?:trainer|workers|utils|single_controller)|WorkerDict|\bTaskRunner\b"
        r"|\bmain_ppo\b|\(main_task pid=|ray_trainer\.py|^(?:\(\w+ pid=\d+\) )?step:\d+ - "),
    "openrlhf": re.compile(
        r"openrlhf|\b(?:Actor|Critic|Reference|Reward)ModelRayActor|\bLLMRayActor\b|train_ppo_ray"),
    "nemo-rl": re.compile(r"nemo_rl|\b\w*PolicyWorker\w*\b|\bVllmGenerationWorker\b"),
    "trl": re.compile(
        r"/trl/|\btrl\.|\b(?:GRPO|DPO|PPO|RLOO|KTO|ORPO|GKD|Online DPO)(?:Trainer|Config)\b"
        r"|'rewards/(?:chosen|margins)'|'reward_std'|'completion_length'"),
    "hf-trainer": re.compile(
        r"transformers/trainer\.py|transformers/training_args\.py|\bTrainingArguments\b"
        r"|_inner_training_loop|\{'(?:loss|train_runtime)':|\{\"loss\":"
        r"|\bllmtuner\b|llamafactory|LLaMA-(?:Factory|Efficient-Tuning)|\bswift/(?:llm|trainers)\b"),
    "accelerate": re.compile(r"/accelerate/|accelerate launch|bin/accelerate\b|\baccelerator\.\w+\("),
    "deepspeed": re.compile(
        r"\[deepspeed\]|\[deepscale\]|deepspeed/|\bDeepSpeedEngine\b|stage_1_and_2\.py|stage3\.py"
        r"|loss_scaler\.py|zero_optimization"),
    # vLLM's own logger format and its own messages
    "vllm": re.compile(
        r"vllm/|\bvllm\.|\bLLMEngine\b|\bEngineCore\w*"
        r"|(?:^|\) )(?:INFO|WARNING|ERROR|DEBUG) \d\d-\d\d \d\d:\d\d:\d\d \[?[\w.]+\.py:\d+\]"
        r"|can be stored in KV cache|No available memory for the cache blocks"
        r"|To serve at least one request with the models?'s max seq len|desired GPU memory utilization"
        r"|Bfloat16 is only supported on GPUs with compute capability|There is no module or parameter named"),
    "sglang": re.compile(r"sglang|--mem-fraction-static|--max-running-requests|alloc_req_slots|TP\d+\] Scheduler hit an exception"),
    "ray": re.compile(r"\bray\.exceptions\b|\(raylet\)|\bray::|ray/_private"),
    "pytorch": re.compile(r"torch[./]distributed[./]elastic|\btorchrun\b|ProcessGroupNCCL|\bcolossalai\b"),
}  # fmt: skip
# the training framework wins over the engine, the engine over the launcher
PRIORITY = (
    "verl",
    "openrlhf",
    "nemo-rl",
    "trl",
    "hf-trainer",
    "accelerate",
    "deepspeed",
    "vllm",
    "sglang",
    "ray",
    "pytorch",
)


# a substring every match of the framework's marker contains: the regex runs only on lines that have one
_HINTS = {
    "verl": hints("verl", "actor_rollout_ref", "WorkerDict", "TaskRunner", "main_ppo", "main_task", "step:"),
    "openrlhf": hints("openrlhf", "RayActor", "train_ppo_ray"),
    "nemo-rl": hints("nemo_rl", "PolicyWorker", "VllmGenerationWorker"),
    "trl": hints("trl", "Trainer", "Config", "'reward", "'completion_length'"),
    "hf-trainer": hints("transformers/", "TrainingArguments", "_inner_training_loop", "{'", '{"', "llmtuner",
                   "llamafactory", "LLaMA-", "swift/"),
    "accelerate": hints("accelerate", "accelerator."),
    "deepspeed": hints("deepspeed", "deepscale", "DeepSpeed", "stage", "loss_scaler", "zero_optimization"),
    "vllm": hints("vllm", "LLMEngine", "EngineCore", "INFO", "WARNING", "ERROR", "DEBUG", "KV cache",
                  "cache blocks", "max seq len", "GPU memory utilization", "Bfloat16", "module or parameter"),
    "sglang": hints("sglang", "--mem-fraction-static", "--max-running-requests", "alloc_req_slots", "Scheduler hit"),
    "ray": hints("ray",),
    "pytorch": hints("elastic", "torchrun", "ProcessGroupNCCL", "colossalai"),
}  # fmt: skip


def markers(text: str, skip: Iterable[str] = ()) -> list[str]:
    """The frameworks whose own messages ``text`` looks like (``skip``: those already settled)."""
    if len(text) < 4:
        return []
    return [
        name for name, pat in _MARKERS.items() if name not in skip and _HINTS[name](text) and pat.search(text)
    ]


# ---- the settings a log prints
_DOTTED = re.compile(r"(?<![\w.-])([a-z_][\w]*(?:\.[\w]+)+)=([^\s'\",\]\)]+)")
_FLAG = re.compile(r"(?<![\w-])--([a-z][\w-]*)(?:[= ](?!-)([^\s'\",]+))?")
_KWARG = re.compile(r"(?<![\w.-])([a-z_][a-z0-9_]*)=([\w.+-]+)(?=[,)\s]|$)")
_DS_DUMP = re.compile(r"^\s*([a-z_][\w]*) \.{3,} (\S+)")
_YAML = re.compile(r"^\s*([a-z_][a-z0-9_]*):\s+([\w.+-]+)\s*$")
# a TOML / Python config echoed as a line of its own, unindented (a traceback's source lines are indented):
# ``mixed_precision = "bf16"``, ``learning_rate = 1e-5``
_ASSIGN = re.compile(
    r"^([a-z_][a-z0-9_]*) = ((?:\"[\w.+-]+\")|(?:'[\w.+-]+')|[\d.]+(?:e-?\d+)?|true|false|True|False)\s*$"
)


def settings(text: str) -> list[tuple[str, str]]:
    """(key, value) pairs a line prints: ``a.b.c=v`` hydra overrides, ``--flag v`` / ``--flag``
    switches, ``key=value`` inside a repr, DeepSpeed's ``key ...... value`` dump, ``key: value`` YAML."""
    if "=" not in text and "--" not in text and ":" not in text and "..." not in text:
        return []
    out: list[tuple[str, str]] = []
    if "=" in text:
        out += _DOTTED.findall(text)
        out += _KWARG.findall(text)
    if "--" in text:
        out += [(k.replace("-", "_"), v or "true") for k, v in _FLAG.findall(text)]
    for pat in (_DS_DUMP, _YAML, _ASSIGN):
        m = pat.match(text)
        if m:
            out.append((m[1], m[2]))
    return [(k, v.strip("'\"")) for k, v in out if len(k) <= 80]


@dataclasses.dataclass(frozen=True)
class LogContext:
    """The framework a log came from, the other frameworks it shows, and the settings it prints."""

    framework: str | None
    components: frozenset[str] = frozenset()
    settings: Mapping[str, str] = dataclasses.field(default_factory=dict)

    def setting(self, *names: str) -> str | None:
        """The first printed value of a setting whose key is, or ends with, one of ``names``."""
        for name in names:
            for key, value in self.settings.items():
                if key == name or key.endswith("." + name):
                    return value
        return None

    def is_true(self, *names: str) -> bool:
        return (self.setting(*names) or "").lower() in ("true", "1", "yes")

    def shows(self, name: str) -> bool:
        return name == self.framework or name in self.components


def context(markers_seen: Mapping[str, int], printed: Mapping[str, str]) -> LogContext:
    """The log's context from its markers: the highest-priority framework seen is the log's own."""
    present = [f for f in PRIORITY if markers_seen.get(f)]
    return LogContext(present[0] if present else None, frozenset(present), dict(printed))


# ---- the fix vocabulary: remedy -> spelling per framework
_TA = "TrainingArguments"
_SPELLING: dict[str, dict[str, str]] = {
    "grad_checkpointing": {
        "verl": V.GRAD_CKPT,
        "trl": f"{_TA}.gradient_checkpointing=True",
        "hf-trainer": f"{_TA}.gradient_checkpointing=True",
        "accelerate": "model.gradient_checkpointing_enable()",
        "openrlhf": "--gradient_checkpointing",
        "nemo-rl": "policy.dtensor_cfg.activation_checkpointing=true",
    },
    "train_micro_batch": {
        "verl": f"{V.MICRO_BATCH} (or {V.PPO_MAX_TOKEN_LEN} with {V.USE_DYNAMIC_BSZ})",
        "trl": f"{_TA}.per_device_train_batch_size (raise gradient_accumulation_steps to keep the batch)",
        "hf-trainer": f"{_TA}.per_device_train_batch_size (raise gradient_accumulation_steps)",
        "deepspeed": "train_micro_batch_size_per_gpu",
        "openrlhf": "--micro_train_batch_size",
        "nemo-rl": "policy.train_micro_batch_size",
    },
    "logprob_micro_batch": {
        "verl": f"{V.ROLLOUT_LOG_PROB_MICRO_BATCH} (or "
        f"{V.ROLLOUT_LOG_PROB_MAX_TOKEN_LEN} with "
        "dynamic batch size)",
        "trl": f"{_TA}.per_device_train_batch_size (TRL computes old and reference "
        "log-probs in "
        "chunks of it)",
        "openrlhf": "--micro_rollout_batch_size",
        "nemo-rl": "policy.logprob_batch_size",
    },
    "ref_logprob_micro_batch": {
        "verl": f"{V.REF_LOG_PROB_MICRO_BATCH} (or {V.REF_LOG_PROB_MAX_TOKEN_LEN})",
        "openrlhf": "--micro_rollout_batch_size",
        "nemo-rl": "policy.logprob_batch_size",
    },
    "entropy_chunking": {
        "verl": f"{V.ENTROPY_CHUNKING} (and {V.ENTROPY_CHECKPOINTING} in the update)",
        "nemo-rl": "policy.logprob_chunk_size",
    },
    "param_offload": {
        "verl": V.PARAM_OFFLOAD,
        "deepspeed": "zero_optimization.offload_param.device=cpu",
        "nemo-rl": "policy.dtensor_cfg.cpu_offload=true",
    },
    "optimizer_offload": {
        "verl": V.OPTIMIZER_OFFLOAD,
        "deepspeed": "zero_optimization.offload_optimizer.device=cpu",
        "openrlhf": "--adam_offload",
    },
    "ref_offload": {"verl": V.REF_PARAM_OFFLOAD, "openrlhf": "--ref_reward_offload"},
    "zero3": {
        "deepspeed": "zero_optimization.stage=3",
        "openrlhf": "--zero_stage 3",
        "trl": "a DeepSpeed ZeRO-3 config (accelerate launch --config_file deepspeed_zero3.yaml)",
        "hf-trainer": f"{_TA}.deepspeed=<a ZeRO-3 config>",
    },
    "rollout_memory": {
        "verl": V.GPU_MEMORY_UTILIZATION,
        "trl": "GRPOConfig.vllm_gpu_memory_utilization",
        "openrlhf": "--vllm_gpu_memory_utilization",
        "nemo-rl": "policy.generation.vllm_cfg.gpu_memory_utilization",
        "vllm": "gpu_memory_utilization (--gpu-memory-utilization)",
        "sglang": "--mem-fraction-static",
    },
    "max_model_len": {
        "verl": f"{V.ROLLOUT_MAX_MODEL_LEN} (or {V.MAX_RESPONSE_LENGTH})",
        "trl": "GRPOConfig.vllm_max_model_length (or max_completion_length)",
        "openrlhf": "--prompt_max_len / --generate_max_len",
        "nemo-rl": "policy.max_total_sequence_length",
        "vllm": "max_model_len (--max-model-len)",
        "sglang": "--context-length",
    },
    "max_num_seqs": {
        "verl": f"{V.ROLLOUT_MAX_NUM_SEQS} / {V.ROLLOUT_MAX_NUM_BATCHED_TOKENS}",
        "vllm": "max_num_seqs (--max-num-seqs) / --max-num-batched-tokens",
        "sglang": "--max-running-requests / --chunked-prefill-size",
    },
    "response_length": {
        "verl": V.MAX_RESPONSE_LENGTH,
        "trl": "GRPOConfig.max_completion_length",
        "openrlhf": "--generate_max_len",
        "nemo-rl": "policy.max_total_sequence_length",
    },
    "enforce_eager": {
        "verl": V.ROLLOUT_ENFORCE_EAGER,
        "trl": "GRPOConfig.vllm_enforce_eager=True",
        "openrlhf": "--enforce_eager",
        "vllm": "enforce_eager=True (--enforce-eager)",
    },
    "sleep_mode": {
        "verl": V.ROLLOUT_FREE_CACHE_ENGINE,
        "trl": "GRPOConfig.vllm_enable_sleep_mode=True",
        "openrlhf": "--vllm_enable_sleep",
        "vllm": "enable_sleep_mode=True",
    },
    "fp16_instead_of_bf16": {
        "verl": f"{V.ROLLOUT_DTYPE_FP16} and {V.PARAM_DTYPE_FP16}",
        "trl": f"{_TA}.bf16=False, fp16=True",
        "hf-trainer": f"{_TA}.bf16=False, fp16=True",
        "accelerate": "accelerate launch --mixed_precision fp16",
        "deepspeed": "bf16.enabled=false, fp16.enabled=true",
        "openrlhf": "drop --bf16 (fp16 with loss scaling)",
        "vllm": 'dtype=half: LLM(dtype="float16") (--dtype half)',
        "sglang": "--dtype half",
    },
    "bf16_instead_of_fp16": {
        "verl": V.PARAM_DTYPE_BF16,
        "trl": f"{_TA}.bf16=True, fp16=False",
        "hf-trainer": f"{_TA}.bf16=True, fp16=False",
        "accelerate": "accelerate launch --mixed_precision bf16",
        "deepspeed": "bf16.enabled=true, fp16.enabled=false",
        "openrlhf": "--bf16",
    },
    "collective_timeout": {
        "verl": f"{V.NCCL_TIMEOUT} (seconds)",
        "trl": f"{_TA}.ddp_timeout (seconds)",
        "hf-trainer": f"{_TA}.ddp_timeout (seconds)",
        "accelerate": "Accelerator(kwargs_handlers=[InitProcessGroupKwargs(timeout=...)])",
        "deepspeed": "deepspeed.init_distributed(timeout=...)",
        "pytorch": "torch.distributed.init_process_group(timeout=...)",
    },
    "lr": {
        "verl": V.LR,
        "trl": f"{_TA}.learning_rate (lower)",
        "hf-trainer": f"{_TA}.learning_rate (lower)",
        "deepspeed": "optimizer.params.lr (lower)",
        "openrlhf": "--actor_learning_rate (lower)",
        "nemo-rl": "policy.optimizer.kwargs.lr (lower)",
    },
    "grad_clip": {
        "verl": V.GRAD_CLIP,
        "trl": f"{_TA}.max_grad_norm=1.0",
        "hf-trainer": f"{_TA}.max_grad_norm=1.0",
        "deepspeed": "gradient_clipping=1.0",
        "openrlhf": "--max_norm 1.0",
        "nemo-rl": "policy.max_grad_norm=1.0",
    },
    "host_memory_threshold": {"ray": "env RAY_memory_usage_threshold (Ray's kill threshold, default 0.95)"},
    "token_budget": {
        "verl": f"{V.PPO_MAX_TOKEN_LEN} / {V.ROLLOUT_LOG_PROB_MAX_TOKEN_LEN} (per-GPU token budgets)"
    },
}
# what a remedy is called when the log shows no framework that has a setting for it
_PLAIN = {
    "grad_checkpointing": "gradient checkpointing",
    "train_micro_batch": "the training micro-batch size",
    "logprob_micro_batch": "the log-prob micro-batch size",
    "ref_logprob_micro_batch": "the reference micro-batch size",
    "param_offload": "parameter offload to the CPU",
    "optimizer_offload": "optimizer-state offload to the CPU",
    "zero3": "ZeRO-3 / FSDP full sharding",
    "rollout_memory": "the engine's gpu_memory_utilization",
    "max_model_len": "the engine's max_model_len",
    "max_num_seqs": "the engine's max_num_seqs",
    "enforce_eager": "the engine's enforce_eager=True",
    "response_length": "the maximum response length",
    "entropy_chunking": "log-probs / entropy computed over chunks of the sequence (NeMo-RL policy.logprob_chunk_size, "
    "verl entropy_from_logits_with_chunking, slime --log-probs-chunk-size)",
    "fp16_instead_of_bf16": "fp16 (or fp32) instead of bf16",
    "bf16_instead_of_fp16": "bf16 mixed precision instead of fp16",
    "collective_timeout": "the process group's timeout",
    "lr": "the learning rate",
    "grad_clip": "gradient clipping at 1.0",
}
# remedy -> (setting names, values meaning "already applied")
_APPLIED: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "grad_checkpointing": (("enable_gradient_checkpointing", "gradient_checkpointing"), ("true",)),
    "param_offload": (
        ("actor.fsdp_config.param_offload", "offload_param.device", "cpu_offload"),
        ("true", "cpu"),
    ),
    "optimizer_offload": (
        ("actor.fsdp_config.optimizer_offload", "offload_optimizer.device", "adam_offload"),
        ("true", "cpu"),
    ),
    "ref_offload": (("ref.fsdp_config.param_offload", "ref_reward_offload"), ("true",)),
    "bf16_instead_of_fp16": (
        ("mixed_precision.param_dtype", "param_dtype", "bf16"),
        ("bf16", "bfloat16", "true"),
    ),
    "entropy_chunking": (("entropy_from_logits_with_chunking",), ("true",)),
    "sleep_mode": (
        ("free_cache_engine", "vllm_enable_sleep_mode", "vllm_enable_sleep", "enable_sleep_mode"),
        ("true",),
    ),
    "zero3": (("zero_stage", "zero_optimization_stage", "zero_optimization.stage"), ("3",)),
}
# where a remedy has no spelling in the log's framework, a component it shows may have one
_FALLBACK = ("deepspeed", "vllm", "sglang", "ray", "pytorch")


def applied(remedy: str, ctx: LogContext) -> bool:
    """Whether the log prints that ``remedy`` is already in place (so proposing it would be wrong)."""
    names, values = _APPLIED.get(remedy, ((), ()))
    value = ctx.setting(*names)
    return value is not None and value.lower().replace("torch.", "") in values


def fix(remedy: str, ctx: LogContext, why: str, *, suite: str | None = None) -> Fix | None:
    """``remedy`` spelled for the log's framework (verl keys in ``Fix.verl``, every other framework's
    in ``Fix.key``, falling back to a component the log shows: DeepSpeed, the engine, Ray); verlaudit's
    suite key alone when the framework has no such setting or the log shows no framework; None when
    there is nothing to say or the log shows the remedy already applied."""
    if applied(remedy, ctx):
        return None
    spelled = _SPELLING.get(remedy, {})
    fw = ctx.framework
    if fw == "verl":
        return (
            Fix(suite, spelled["verl"], why)
            if "verl" in spelled
            else (Fix(suite, None, why) if suite else None)
        )
    for name in (fw, *(c for c in _FALLBACK if c in ctx.components)):
        if name and name in spelled:
            return Fix(suite, None, why, key=spelled[name], framework=name)
    if remedy in _PLAIN and fw not in spelled:  # no setting of this framework: name the remedy itself
        return Fix(suite, None, f"{_PLAIN[remedy]}: {why}")
    return Fix(suite, None, why) if suite else None


def fixes(ctx: LogContext, *wanted: tuple[str, str] | tuple[str, str, str] | Fix | None) -> list[Fix]:
    """The fixes for ``(remedy, why[, suite])`` entries (plain Fix objects pass through), in order,
    without the ones already applied or without a spelling."""
    out: list[Fix] = []
    for w in wanted:
        if w is None:
            continue
        f = w if isinstance(w, Fix) else fix(w[0], ctx, w[1], suite=w[2] if len(w) > 2 else None)
        if f is not None and f not in out:
            out.append(f)
    return out


def advice(why: str, *, suite: str | None = None) -> Fix:
    """A fix that is advice rather than a setting (``Fix`` with no key)."""
    return Fix(suite, None, why)


def names(items: Iterable[str]) -> str:
    """``a, b and c``."""
    items = list(items)
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1] if items else ""


# a framework's install extra that pins the engine / library release it was written for (their install guides;
# a shell such as zsh wants the brackets quoted)
EXTRAS = {
    "trl": {"vllm": "pip install trl[vllm]", "deepspeed": "pip install trl[deepspeed]", "peft": "pip install trl[peft]"},
    "openrlhf": {"vllm": "pip install openrlhf[vllm]"},
    "verl": {"vllm": "pip install verl[vllm]", "sglang": "pip install verl[sglang]"},
    "nemo_rl": {"vllm": "uv run --extra vllm", "megatron": "uv run --extra mcore", "nemo": "uv run --extra mcore"},
    "llamafactory": {"vllm": "pip install -e .[vllm]", "deepspeed": "pip install -e .[deepspeed]"},
}  # fmt: skip


def pinned_pair(caller: str | None, callee: str | None) -> Fix | None:
    """The caller framework's install extra for the callee, where it publishes one."""
    cmd = EXTRAS.get(caller or "", {}).get(callee or "")
    return advice(f"{cmd}: installs the {callee} release {caller} pins with it") if cmd else None
