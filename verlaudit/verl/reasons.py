"""Why a verl key that from-verl leaves out is not mapped: a regex over the key -> the reason, the first
match winning. `verlaudit.verl.mapping` reports every leftover key with one (or "not in from-verl's
table"). Exercised by `pytest tests/test_from_verl.py`.
"""

from __future__ import annotations

import re

REASONS: tuple[tuple[str, str], ...] = (
    (r"^data\.(val_files|val_batch_size|val_max_samples|validation_shuffle)$|\.val_kwargs\.|^trainer\.(test_freq|val_before_train|val_only|log_val_generations|validation_data_dir)$",
     "validation: this trainer has no validation pass; the comparison reads the training metrics"),
    (r"^trainer\.(logger|project_name|experiment_name|save_freq|default_local_dir|default_hdfs_dir|resume_mode|resume_from_path|rollout_data_dir|max_actor_ckpt_to_keep|max_critic_ckpt_to_keep|del_local_ckpt_after_load|ray_wait_register_center_timeout|profile_steps|esi_redundant_time|use_legacy_worker_impl|device|total_epochs)$|^(ray_init|ray_kwargs|global_profiler|hydra)\.|\.profiler\.|\.checkpoint\.|\.(seed|data_loader_seed|shuffle)$|^data\.(dataloader_num_workers|use_shm|return_raw_chat|return_raw_input_ids|return_full_prompt|return_multi_modal_inputs|filter_overlong_prompts_workers|cache_dir|image_key|video_key|trust_remote_code|tokenizer)$|\.(trust_remote_code|external_lib|use_shm)$",
     "bookkeeping (logging, checkpoints, seeds, loaders): not a precision or algorithm matter"),
    (r"\.fsdp_config\.(param_offload|optimizer_offload|offload_policy|reshard_after_forward|fsdp_size|wrap_policy\..*|forward_prefetch|use_orig_params|strategy)$|\.strategy$|^actor_rollout_ref\.hybrid_engine$|^trainer\.balance_batch$|\.enable_activation_offload$",
     "memory layout (FSDP sharding, offload, strategy): where tensors live, not their dtypes or the math; "
     "hardware.gpus shards with FSDP2 here"),
    (r"\.(use_remove_padding|use_dynamic_bsz|ppo_max_token_len_per_gpu|forward_max_token_len_per_gpu|log_prob_micro_batch_size|log_prob_micro_batch_size_per_gpu|log_prob_use_dynamic_bsz|log_prob_max_token_len_per_gpu|ulysses_sequence_parallel_size|use_torch_compile|use_fused_kernels|use_liger|entropy_from_logits_with_chunking|entropy_checkpointing|forward_micro_batch_size|forward_micro_batch_size_per_gpu|calculate_entropy)$|\.fused_kernel_options\.",
     "performance (packing, fusion, sequence parallelism, no-grad batch splits): does not change what is computed"),
    (r"^actor_rollout_ref\.rollout\.(mode|gpu_memory_utilization|tensor_model_parallel_size|data_parallel_size|expert_parallel_size|pipeline_model_parallel_size|enforce_eager|free_cache_engine|max_num_batched_tokens|max_num_seqs|max_model_len|enable_chunked_prefill|enable_prefix_caching|load_format|layered_summon|disable_log_stats|cudagraph_capture_sizes|calculate_log_probs|skip_tokenizer_init|ignore_eos|do_sample|prompt_length|response_length|over_sample_rate|scheduling_policy|logprobs_mode|seed|nnodes|n_gpus_per_node)$|^actor_rollout_ref\.rollout\.(engine_kwargs|agent|trace|prometheus|checkpoint_engine)\.",
     "rollout engine setting (vLLM / SGLang scheduling, parallelism, memory): our engines (rollout.engine: hf, "
     "static, fused, vllm) take their own; what sets the engine's probabilities (rollout.dtype, sampling) is mapped"),
    (r"^reward_model\.overlong_buffer\.|^reward\.overlong_buffer\.",
     "DAPO's overlong reward shaping: not supported; the reward is compute_score's"),
    (r"^algorithm\.filter_groups\.", "dynamic sampling (filter_groups): not supported here"),
    (r"^algorithm\.rollout_correction\.|^algorithm\.rollout_is|\.tis_imp_ratio_cap$",
     "rollout correction option this version does not have (verl's earlier algorithm.rollout_is* spelling, "
     "tis_imp_ratio_cap); rollout_is, rollout_is_threshold, rollout_is_batch_normalize, rollout_rs, "
     "rollout_rs_threshold, bypass_mode and loss_type are mapped to rollout_correction.*"),
    (r"^algorithm\.(use_pf_ppo|pf_ppo\..*)$", "PF-PPO (reward-weighted resampling of the batch): not supported"),
    (r"\.model\.override_config\.|\.model\.(lora_alpha|target_modules|exclude_modules|lora_adapter_path|custom_chat_template|hf_config_path)$",
     "model loading option (config overrides, LoRA targets, chat template files): not reproduced; the model is "
     "built from model.path or its known architecture"),
)  # fmt: skip
"""Regex over a leftover verl key -> why it is not mapped (the first match wins)."""


def unmapped_reason(key: str) -> str | None:
    """The reason of the first `REASONS` pattern ``key`` matches, or None."""
    return next((why for pattern, why in REASONS if re.search(pattern, key)), None)
