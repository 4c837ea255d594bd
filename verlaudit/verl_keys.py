"""verl's configuration keys, as `diagnose` and the log parser print them beside our suite keys.

One place for the spelling (they change between verl releases; ours follow verl 0.5's
``ppo_trainer.yaml``), so a run diagnosis and a diagnosis of a plain verl log name a fix the same
way, and every algorithm option of our suite maps to its verl key (`ALGO_KEYS`). Neither
the modules of verlaudit/analysis/diagnose/ nor the log rules in verlaudit/analysis/logs/
spell a verl key themselves (`pytest tests/test_verl_keys.py` checks it). Exercised by
`pytest tests/test_diagnose.py tests/test_logparse.py tests/test_log_rules.py tests/test_verl_keys.py
tests/test_algo_keys.py`.
"""

from __future__ import annotations

ACTOR_ROLLOUT_REF = "actor_rollout_ref"  # also how a verl log is told from others
ACTOR = f"{ACTOR_ROLLOUT_REF}.actor"
MODEL = f"{ACTOR_ROLLOUT_REF}.model"
ROLLOUT = f"{ACTOR_ROLLOUT_REF}.rollout"
REF = f"{ACTOR_ROLLOUT_REF}.ref"
CRITIC = "critic"
CRITIC_MODEL = "critic.model"


def worker(role: str | None) -> str:
    """The verl worker section that trains ``role``: the critic's, else the actor's."""
    return CRITIC if role == "critic" else ACTOR


def fsdp_config(role: str | None) -> str:
    # the actor's FSDP settings sit beside its optimizer; the critic's under its model section
    return f"{CRITIC_MODEL}.fsdp_config" if role == "critic" else f"{ACTOR}.fsdp_config"


def param_dtype(role: str | None, dtype: str) -> str:
    return f"{fsdp_config(role)}.mixed_precision.param_dtype={dtype}"


def grad_ckpt(role: str | None = None) -> str:
    return f"{CRITIC_MODEL if role == 'critic' else MODEL}.enable_gradient_checkpointing=True"


def micro_batch(role: str | None = None) -> str:
    return f"{worker(role)}.ppo_micro_batch_size_per_gpu"


def lr(role: str | None = None) -> str:
    return f"{worker(role)}.optim.lr"


def grad_clip(role: str | None = None) -> str:
    return f"{worker(role)}.grad_clip=1.0"


PARAM_DTYPE_BF16 = param_dtype("actor", "bf16")
PARAM_DTYPE_FP16 = param_dtype("actor", "fp16")
MODEL_DTYPE = f"{fsdp_config('actor')}.model_dtype"
MODEL_DTYPE_BF16 = f"{MODEL_DTYPE}=bfloat16"
MODEL_DTYPE_FP32 = f"{MODEL_DTYPE}=fp32"
PARAM_OFFLOAD = f"{fsdp_config('actor')}.param_offload=True"
OPTIMIZER_OFFLOAD = f"{fsdp_config('actor')}.optimizer_offload=True"
REF_PARAM_OFFLOAD = f"{REF}.fsdp_config.param_offload=True"
GRAD_CKPT = grad_ckpt("actor")
MICRO_BATCH = micro_batch("actor")
REF_LOG_PROB_MICRO_BATCH = f"{REF}.log_prob_micro_batch_size_per_gpu"
ROLLOUT_LOG_PROB_MICRO_BATCH = f"{ROLLOUT}.log_prob_micro_batch_size_per_gpu"
ROLLOUT_LOG_PROB_MAX_TOKEN_LEN = f"{ROLLOUT}.log_prob_max_token_len_per_gpu"
REF_LOG_PROB_MAX_TOKEN_LEN = f"{REF}.log_prob_max_token_len_per_gpu"
PPO_MAX_TOKEN_LEN = f"{ACTOR}.ppo_max_token_len_per_gpu"
USE_DYNAMIC_BSZ = f"{ACTOR}.use_dynamic_bsz=True"
ENTROPY_CHUNKING = f"{ACTOR}.entropy_from_logits_with_chunking=True"
ENTROPY_CHECKPOINTING = f"{ACTOR}.entropy_checkpointing=True"
REMOVE_PADDING = f"{MODEL}.use_remove_padding=True"
TORCH_COMPILE_OFF = f"{ACTOR}.use_torch_compile=False"
LR = lr("actor")
GRAD_CLIP = grad_clip("actor")
ENTROPY_COEFF = f"{ACTOR}.entropy_coeff"
KL_LOSS_COEF = f"{ACTOR}.kl_loss_coef"
KL_COEF = "algorithm.kl_ctrl.kl_coef"
ROLLOUT_DTYPE = f"{ROLLOUT}.dtype"
TEMPERATURE = f"{ROLLOUT}.temperature"
ROLLOUT_TOP_K = f"{ROLLOUT}.top_k"
ROLLOUT_TOP_P = f"{ROLLOUT}.top_p"
LOGPROBS_MODE = f"{ROLLOUT}.logprobs_mode"  # verl sets processed_logprobs; vLLM's own default is raw_logprobs
GPU_MEMORY_UTILIZATION = f"{ROLLOUT}.gpu_memory_utilization"
ROLLOUT_MAX_MODEL_LEN = f"{ROLLOUT}.max_model_len"
ROLLOUT_MAX_NUM_SEQS = f"{ROLLOUT}.max_num_seqs"
ROLLOUT_MAX_NUM_BATCHED_TOKENS = f"{ROLLOUT}.max_num_batched_tokens"
ROLLOUT_FREE_CACHE_ENGINE = f"{ROLLOUT}.free_cache_engine=True"
ROLLOUT_DTYPE_FP16 = f"{ROLLOUT}.dtype=float16"
ROLLOUT_NAME = f"{ROLLOUT}.name"
ROLLOUT_ENFORCE_EAGER = f"{ROLLOUT}.enforce_eager=True"
NCCL_TIMEOUT = f"{ACTOR_ROLLOUT_REF}.nccl_timeout"
LORA_RANK = f"{MODEL}.lora_rank"
SAVE_FREQ = "trainer.save_freq"
RAY_NUM_CPUS = "ray_init.num_cpus"
MAX_RESPONSE_LENGTH = "data.max_response_length"
MAX_PROMPT_LENGTH = "data.max_prompt_length"
TRAIN_BATCH_SIZE = "data.train_batch_size"
PPO_MINI_BATCH = f"{ACTOR}.ppo_mini_batch_size"
REWARD_MANAGER = "reward_model.reward_manager"
CUSTOM_REWARD = "custom_reward_function.path"
REWARD_MODEL_PATH = "reward_model.model.path"
REWARD_MODEL_DTYPE_FP32 = "reward_model.model.fsdp_config.model_dtype=fp32"
N_GPUS = "trainer.n_gpus_per_node"
# the name a verl worker or utility gives a user key (the trainer copies the key into the worker's config
# under its own name: ppo_trainer.yaml's rollout.prompt_length is ${data.max_prompt_length}; dp_actor's
# max_token_len is ppo_max_token_len_per_gpu in the update, log_prob_max_token_len_per_gpu in the log-prob
# passes): a message or an assertion that names the worker's name blames these keys, in this order
WORKER_NAMES: dict[str, tuple[str, ...]] = {
    "max_token_len": (PPO_MAX_TOKEN_LEN, ROLLOUT_LOG_PROB_MAX_TOKEN_LEN, REF_LOG_PROB_MAX_TOKEN_LEN),
    "prompt_length": (MAX_PROMPT_LENGTH,),
    "response_length": (MAX_RESPONSE_LENGTH,),
    "max_prompt_length": (MAX_PROMPT_LENGTH,),
    "max_response_length": (MAX_RESPONSE_LENGTH,),
    "train_batch_size": (TRAIN_BATCH_SIZE,),
    "ppo_mini_batch_size": (PPO_MINI_BATCH,),
    "ppo_micro_batch_size_per_gpu": (MICRO_BATCH,),
    "log_prob_micro_batch_size_per_gpu": (ROLLOUT_LOG_PROB_MICRO_BATCH, REF_LOG_PROB_MICRO_BATCH),
    "ppo_max_token_len_per_gpu": (PPO_MAX_TOKEN_LEN,),
    "log_prob_max_token_len_per_gpu": (ROLLOUT_LOG_PROB_MAX_TOKEN_LEN, REF_LOG_PROB_MAX_TOKEN_LEN),
    "max_model_len": (ROLLOUT_MAX_MODEL_LEN,),
    "max_num_batched_tokens": (ROLLOUT_MAX_NUM_BATCHED_TOKENS,),
    "max_num_seqs": (ROLLOUT_MAX_NUM_SEQS,),
    "gpu_memory_utilization": (GPU_MEMORY_UTILIZATION,),
    "n_gpus_per_node": (N_GPUS,),
}
DEVICE_CUDA = "trainer.device=cuda"
ALLOC_CONF = "env PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"

# ---------------------------------------------------------------- algorithm keys
# verl's spelling of every algorithm option our AlgoConfig supports (trainer/config.py names the same
# verl key in each field's docstring; README "Compatibility with verl and TRL" is the table of both).
ALGORITHM = "algorithm"
POLICY_LOSS = f"{ACTOR}.policy_loss"
KL_CTRL = f"{ALGORITHM}.kl_ctrl"

ALGO_KEYS: dict[str, str] = {
    "adv_estimator": f"{ALGORITHM}.adv_estimator",
    "norm_adv_by_std_in_grpo": f"{ALGORITHM}.norm_adv_by_std_in_grpo",
    "gamma": f"{ALGORITHM}.gamma",
    "lam": f"{ALGORITHM}.lam",
    "use_kl_in_reward": f"{ALGORITHM}.use_kl_in_reward",
    "kl_penalty": f"{ALGORITHM}.kl_penalty",
    "kl_coef": KL_COEF,
    "kl_ctrl_type": f"{KL_CTRL}.type",
    "kl_ctrl_target_kl": f"{KL_CTRL}.target_kl",
    "kl_ctrl_horizon": f"{KL_CTRL}.horizon",
    "loss_mode": f"{POLICY_LOSS}.loss_mode",
    "clip_cov_ratio": f"{POLICY_LOSS}.clip_cov_ratio",
    "clip_cov_lb": f"{POLICY_LOSS}.clip_cov_lb",
    "clip_cov_ub": f"{POLICY_LOSS}.clip_cov_ub",
    "kl_cov_ratio": f"{POLICY_LOSS}.kl_cov_ratio",
    "ppo_kl_coef": f"{POLICY_LOSS}.ppo_kl_coef",
    "tau_pos": f"{ACTOR}.tau_pos",
    "tau_neg": f"{ACTOR}.tau_neg",
    "dro_beta": f"{POLICY_LOSS}.dro_beta",
    "loss_agg_mode": f"{ACTOR}.loss_agg_mode",
    "loss_scale_factor": f"{ACTOR}.loss_scale_factor",
    "clip_ratio": f"{ACTOR}.clip_ratio",
    "clip_ratio_low": f"{ACTOR}.clip_ratio_low",
    "clip_ratio_high": f"{ACTOR}.clip_ratio_high",
    "clip_ratio_c": f"{ACTOR}.clip_ratio_c",
    "entropy_coef": ENTROPY_COEFF,
    "use_kl_loss": f"{ACTOR}.use_kl_loss",
    "kl_loss_coef": KL_LOSS_COEF,
    "kl_loss_type": f"{ACTOR}.kl_loss_type",
    "ppo_epochs": f"{ACTOR}.ppo_epochs",
    "max_grad_norm": f"{ACTOR}.grad_clip",
    "micro_batch_size": MICRO_BATCH,
    "mini_batch_size": f"{ACTOR}.ppo_mini_batch_size",
    "lr": LR,
    "weight_decay": f"{ACTOR}.optim.weight_decay",
    "critic_lr": f"{CRITIC}.optim.lr",
    "cliprange_value": f"{CRITIC}.cliprange_value",
    "batch_size": "data.train_batch_size",
    "group_size": f"{ROLLOUT}.n",
    "temperature": TEMPERATURE,
    "top_k": ROLLOUT_TOP_K,
    "gdpo_reward_keys": f"{ALGORITHM}.gdpo_reward_keys",
    "gdpo_reward_weights": f"{ALGORITHM}.gdpo_reward_weights",
}
"""Our ``algo.<key>`` -> verl's key, for every algorithm option with a verl counterpart."""
CALCULATE_SUM_PI_SQUARED = f"{ACTOR}.calculate_sum_pi_squared"
"""verl's switch for the actor's sum_v pi_v^2 pass, which its optimal token baselines need; ours computes it
whenever the estimator reads it (no suite key)."""


def algo_key(key: str) -> str:
    """verl's key for our suite key ``algo.<key>`` (KeyError: no verl counterpart, e.g. DPO's keys)."""
    return ALGO_KEYS[key.removeprefix("algo.")]


def algo_override(key: str, value: object) -> str:
    """A verl command-line override for our ``algo.<key>: value`` (``algorithm.lam=0.95``; a list in
    Hydra's form, ``algorithm.gdpo_reward_keys=[acc,fmt]``)."""
    if isinstance(value, (list, tuple)):
        return f"{algo_key(key)}=[{','.join(str(v) for v in value)}]"
    text = str(value).lower() if isinstance(value, bool) else ("null" if value is None else str(value))
    return f"{algo_key(key)}={text}"


# ---------------------------------------------------------------- rollout correction keys
ROLLOUT_CORRECTION = f"{ALGORITHM}.rollout_correction"
SKYRL_USE_TIS = "trainer.algorithm.use_tis=true"
"""SkyRL's switch for truncated importance sampling: not a verl key, but spelled like one of verl's
sections, so it is kept here with them (the log rules name it for a SkyRL log)."""

ROLLOUT_CORRECTION_KEYS: dict[str, str] = {
    field: f"{ROLLOUT_CORRECTION}.{field}"
    for field in (
        "rollout_is",
        "rollout_is_threshold",
        "rollout_is_batch_normalize",
        "rollout_rs",
        "rollout_rs_threshold",
        "bypass_mode",
        "loss_type",
    )
}
"""Our ``rollout_correction.<key>`` (`trainer.config.RolloutCorrectionConfig`) -> verl's key: the same
field names under ``algorithm.rollout_correction``."""


def correction_key(key: str) -> str:
    """verl's key for our suite key ``rollout_correction.<key>`` (KeyError: no such option)."""
    return ROLLOUT_CORRECTION_KEYS[key.removeprefix("rollout_correction.")]


def correction_override(key: str, value: object) -> str:
    """A verl command-line override for our ``rollout_correction.<key>: value``
    (``algorithm.rollout_correction.rollout_is=token``)."""
    text = str(value).lower() if isinstance(value, bool) else ("null" if value is None else str(value))
    return f"{correction_key(key)}={text}"
