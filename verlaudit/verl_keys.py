"""verl's configuration keys, as `diagnose` and the log parser print them beside our suite keys.

One place for the spelling (they change between verl releases; ours follow verl 0.5's
``ppo_trainer.yaml``), so a run diagnosis and a diagnosis of a plain verl log name a fix the same
way. Exercised by `pytest tests/test_diagnose.py tests/test_logparse.py`.
"""

from __future__ import annotations

ACTOR = "actor_rollout_ref.actor"
MODEL = "actor_rollout_ref.model"
ROLLOUT = "actor_rollout_ref.rollout"
REF = "actor_rollout_ref.ref"

PARAM_DTYPE_BF16 = f"{ACTOR}.fsdp_config.mixed_precision.param_dtype=bf16"
PARAM_DTYPE_FP16 = f"{ACTOR}.fsdp_config.mixed_precision.param_dtype=fp16"
MODEL_DTYPE_BF16 = f"{ACTOR}.fsdp_config.model_dtype=bfloat16"
MODEL_DTYPE_FP32 = f"{ACTOR}.fsdp_config.model_dtype=fp32"
GRAD_CKPT = f"{MODEL}.enable_gradient_checkpointing=True"
LR = f"{ACTOR}.optim.lr"
GRAD_CLIP = f"{ACTOR}.grad_clip=1.0"
MICRO_BATCH = f"{ACTOR}.ppo_micro_batch_size_per_gpu"
ROLLOUT_DTYPE = f"{ROLLOUT}.dtype"
GPU_MEMORY_UTILIZATION = f"{ROLLOUT}.gpu_memory_utilization"
ALLOC_CONF = "env PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"
