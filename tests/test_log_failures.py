"""Log rules of issue 25's second round, each a mechanism read from what a message says, with a planted
line of three frameworks' wording it catches and a healthy near-miss it passes: a launcher that kills
or reports a killed child is never clean; an engine's non-positive KV-cache capacity; a configuration
check's keys resolved to the framework's own; an engine object without what the trainer reads; the
parameter a weight sync names. Run: `pytest tests/test_log_failures.py`."""

from __future__ import annotations

from pathlib import Path

import pytest

from verlaudit.analysis.diagnose.diagnosis import diagnose_path


def diagnose(tmp_path: Path, text: str):
    p = tmp_path / "train.log"
    p.write_text(text)
    (d,) = diagnose_path(p)
    return d


def first(tmp_path: Path, text: str):
    d = diagnose(tmp_path, text)
    assert d.causes, d.summary
    return d.causes[0]


def problems(tmp_path: Path, text: str) -> list[tuple[str, str]]:
    return [
        (c.severity, c.kind) for c in diagnose(tmp_path, text).causes if c.severity in ("error", "warning")
    ]


# ---- a launcher that kills its children, or reports one killed, is never clean -----------------------
_DS_START = (
    "[2024-01-02 10:00:00,000] [INFO] [launch.py:148:main] nnodes=1, num_local_procs=1, node_rank=0\n"
    "[2024-01-02 10:00:00,000] [INFO] [launch.py:162:main] dist_world_size=1\n"
    "Loading checkpoint shards: 100%|##########| 4/4 [00:20<00:00,  5.00s/it]\n"
)


def test_deepspeed_tearing_down_a_silent_child_is_a_kill_of_the_only_rank(tmp_path):
    c = first(
        tmp_path,
        _DS_START
        + "[2024-01-02 10:03:00,000] [INFO] [launch.py:318:sigkill_handler] Killing subprocess 4242\n",
    )
    assert c.kind == "killed" and c.severity == "error" and c.where == "local_rank 0"
    assert any("dmesg" in f.why for f in c.fixes)
    # a child that raised first: the child's error is the root, the teardown is not re-labelled a kill
    d = diagnose(
        tmp_path,
        _DS_START + "ValueError: tokenizer has no pad token\n"
        "[2024-01-02 10:03:00,000] [INFO] [launch.py:318:sigkill_handler] Killing subprocess 4242\n",
    )
    assert d.causes[0].kind == "exception"
    # the launcher's own success line is healthy
    assert (
        problems(
            tmp_path,
            _DS_START
            + "[2024-01-02 11:00:00,000] [INFO] [launch.py:351:main] Process 4242 exits successfully.\n",
        )
        == []
    )


@pytest.mark.parametrize(
    "line, where",
    [
        (
            "mpirun noticed that process rank 1 with PID 21183 on node host01 exited on signal 9 (Killed).",
            "rank 1",
        ),
        ("srun: error: gpu-node-3: task 2: Killed", "rank 2"),
        (
            "mpiexec noticed that process rank 0 with PID 10313 on node proton exited on signal 6 (Aborted).",
            "rank 0",
        ),
    ],
)
def test_a_launcher_reporting_a_child_ended_on_a_signal_is_a_kill(tmp_path, line, where):
    c = first(tmp_path, "step 10 loss 1.2\n" + line + "\n")
    assert c.kind == "killed" and c.severity == "error" and c.where == where


def test_a_launcher_line_without_a_signal_is_healthy(tmp_path):
    assert (
        problems(
            tmp_path,
            "mpirun: launching 4 processes on 1 node\nsrun: job 123 queued and waiting for resources\n",
        )
        == []
    )


# ---- an engine's KV-cache capacity at zero or below -----------------------------------------------
@pytest.mark.parametrize(
    "line, where",
    [
        ("[2025-07-02 07:41:59 TP0] max_total_tokens=131072 is larger than the profiled value -561981. Use the "
         "profiled value instead.", "--mem-fraction-static"),
        ("(EngineCore_DP0 pid=1) INFO 02-12 08:34:25 [gpu_worker.py:360] Available KV cache memory: -2.31 GiB",
         "vllm gpu_memory_utilization"),
        ("[2025-01-01 00:00:00 TP0] KV Cache is allocated. #tokens: 0, K size: 0.00 GB, V size: 0.00 GB",
         "--mem-fraction-static"),
    ],
)  # fmt: skip
def test_a_non_positive_kv_cache_capacity_is_a_kv_cache_failure(tmp_path, line, where):
    c = first(tmp_path, line + "\n")
    assert c.kind == "oom_kv_cache" and c.severity == "error" and c.where == where


def test_a_positive_kv_cache_capacity_is_healthy(tmp_path):
    log = (
        "[2025-07-02 07:41:59 TP0] max_total_tokens=131072 is larger than the profiled value 95000. Use the "
        "profiled value instead.\n"
        "INFO 02-12 08:34:25 [gpu_worker.py:360] Available KV cache memory: 12.57 GiB\n"
        "INFO 02-12 08:34:25 [kv_cache_utils.py:1307] GPU KV cache size: 53,136 tokens\n"
        "[2025-01-01 00:00:00 TP0] KV Cache is allocated. #tokens: 367404, K size: 8.23 GB, V size: 8.23 GB\n"
    )
    assert problems(tmp_path, log) == []


# ---- a failed configuration check names the keys the user sets -------------------------------------
_VERL = "(TaskRunner pid=1) actor_rollout_ref.actor.strategy=fsdp\n"


@pytest.mark.parametrize(
    "text, key, advice",
    [
        # verl's dynamic batching: the worker's max_token_len is the actor's (and the log-prob passes') budget
        (_VERL + "AssertionError: max_token_len must be greater than the sequence length. Got max_token_len=16384 "
         "and max_seq_len=40960\n", "actor_rollout_ref.actor.ppo_max_token_len_per_gpu", "at least 40960"),
        (_VERL + "AssertionError: ppo_mini_batch_size 0 should be larger than 0 after normalization\n",
         "actor_rollout_ref.actor.ppo_mini_batch_size", None),
        # a divisibility check: both keys named, no direction invented
        (_VERL + "AssertionError: normalized ppo_mini_batch_size 8 should be divisible by "
         "ppo_micro_batch_size_per_gpu 3\n", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu", "so the check holds"),
        # the message's own remedy comes first
        ("ValueError: prompt_batch_size (5) * group_size (8) = 40 must be divisible by the number of agent workers "
         "(32 = n_gpus * 4). Try prompt_batch_size=8.\n", "prompt_batch_size", "Try prompt_batch_size=8"),
    ],
)  # fmt: skip
def test_a_failed_configuration_check_names_its_keys_and_the_way_they_must_move(tmp_path, text, key, advice):
    c = first(tmp_path, text)
    assert c.kind == "exception" and c.title.startswith("Configuration check failed")
    assert key in c.where
    if advice:
        assert any(advice in f.why for f in c.fixes), [f.why for f in c.fixes]


def test_a_pasted_assert_line_gives_the_check_its_keys(tmp_path):
    log = (
        "assert model_hf_config.max_position_embeddings >= config.prompt_length + config.response_length, \\\n"
        "AssertionError: model context length should be greater than total sequence length\n"
    )
    c = first(tmp_path, log)
    assert c.where.startswith("data.max_prompt_length, data.max_response_length")
    assert any("max_position_embeddings >=" in f.why for f in c.fixes)


def test_an_error_naming_no_setting_is_not_a_configuration_check(tmp_path):
    c = first(tmp_path, "ValueError: could not convert string to float: 'abc'\n")
    assert c.kind == "exception" and c.title.startswith("Unrecognised failure")
    # the same names printed by a healthy run are no check
    assert problems(tmp_path, "INFO: max_token_len=16384 max_seq_len=40960 ppo_mini_batch_size 8\n") == []


# ---- an inference engine's object without what the trainer reaches for -----------------------------
@pytest.mark.parametrize(
    "text, where",
    [
        # inside vLLM's own frames: LLM.collective_rpc reads the V0 engine's model_executor
        ('  File "/venv/lib/python3.12/site-packages/openrlhf/trainer/ray/vllm_engine.py", line 58, in init_process_group\n'
         "    return self.llm.collective_rpc(\n"
         '  File "/venv/lib/python3.12/site-packages/vllm/entrypoints/llm.py", line 495, in collective_rpc\n'
         "    executor = self.llm_engine.model_executor\n"
         "AttributeError: 'LLMEngine' object has no attribute 'model_executor'\n",
         "vllm/entrypoints/llm.py collective_rpc"),
        # the message retyped without its type, the user's frame reaching into the engine
        ("'LLMEngine' object has no attribute 'driver_worker'\n"
         '  File "/work/activation.py", line 60, in <module>\n'
         "    obj = model.llm_engine.driver_worker.model_runner.model.model.layers[i].mlp\n",
         "llm_engine.driver_worker"),
        # a worker class the engine defines, reached through the engine's handle
        ("Traceback (most recent call last):\n"
         '  File "/data/indexer/index_baichuan.py", line 116, in build_model\n'
         "    model = self.llm.llm_engine.workers[0].model\n"
         "AttributeError: 'Worker' object has no attribute 'model'\n",
         "Worker.model"),
    ],
)  # fmt: skip
def test_an_engine_object_without_the_attribute_the_trainer_reads_is_a_missing_engine_feature(
    tmp_path, text, where
):
    c = first(tmp_path, text)
    assert c.kind == "engine_feature" and where in c.where, (c.kind, c.where)


def test_a_config_object_without_an_attribute_stays_a_version_mismatch(tmp_path):
    c = first(tmp_path, "AttributeError: 'LoRAConfig' object has no attribute 'lora_extra_vocab_size'\n")
    assert c.kind == "version_mismatch"
    # a warning that quotes the words is no failure
    assert (
        problems(tmp_path, "WARNING: 'LLMEngine' object has no attribute 'stats'; falling back to none\n")
        == []
    )


# ---- a weight sync names the parameter that did not fit -------------------------------------------
@pytest.mark.parametrize(
    "text, where",
    [
        ("(RayWorkerWrapper pid=3) Size of the original param: torch.Size([32, 192, 6144]) and size of the weights: "
         "torch.Size([32, 2880, 2880]). Weight name layers.0.mlp.experts.w13_weight, shard id: None\n"
         "(RayWorkerWrapper pid=3) ERROR 09-25 17:50:00 [worker_base.py:275] Error executing method 'update_weight'. "
         "This might cause deadlock in distributed execution.\n", "layers.0.mlp.experts.w13_weight"),
        ("ERROR 01-02 10:00:00 [worker_base.py:620] Error executing method 'update_weights_from_ipc_handles'. This "
         "might cause deadlock in distributed execution.\n"
         "RuntimeError: Error(s) in loading state_dict: size mismatch for model.layers.3.mlp.gate_proj.weight: copying "
         "a param with shape torch.Size([11008, 4096]) from checkpoint, the shape in current model is "
         "torch.Size([5504, 4096]).\n", "model.layers.3.mlp.gate_proj.weight"),
        # the engine's parameter lacks what its loader reads, under the trainer's update call
        ("(WorkerDict pid=9) Traceback (most recent call last):\n"
         '(WorkerDict pid=9)   File "/opt/verl/verl/workers/sharding_manager/fsdp_vllm.py", line 180, in update_params\n'
         "(WorkerDict pid=9)     model.load_weights(updated_params)\n"
         '(WorkerDict pid=9)   File "/venv/lib/python3.10/site-packages/vllm/model_executor/models/qwen3_moe.py", '
         "line 512, in load_weights\n"
         "(WorkerDict pid=9)     weight_loader = param.weight_loader\n"
         "(WorkerDict pid=9) AttributeError: 'Parameter' object has no attribute 'weight_loader'\n", "update_params"),
    ],
)  # fmt: skip
def test_a_failed_weight_update_is_a_weight_sync_naming_its_parameter(tmp_path, text, where):
    c = first(tmp_path, text)
    assert c.kind == "weight_sync" and where in (c.where or ""), (c.kind, c.where)


def test_a_failed_engine_method_that_updates_no_weights_is_not_a_weight_sync(tmp_path):
    log = (
        "Weight name layers.0.weight loaded\n"
        "ERROR 01-02 10:00:00 [worker_base.py:620] Error executing method 'determine_num_available_blocks'. This "
        "might cause deadlock in distributed execution.\n"
    )
    assert first(tmp_path, log).kind == "engine_error"
    # the same attribute error with no update call above it is the engine's version, not a sync
    assert (
        first(tmp_path, "AttributeError: 'Parameter' object has no attribute 'weight_loader'\n").kind
        == "version_mismatch"
    )
    assert (
        problems(tmp_path, "INFO update_weights_from_tensor done; Weight name layers.0.weight, 2 shards\n")
        == []
    )


# ---- a compile failure: the op it names, and the advice the message gives -----------------------
def test_a_compile_failure_takes_the_dynamo_settings_its_message_advises(tmp_path):
    log = (
        "torch._dynamo.exc.Unsupported: Logger not supported for non-export cases. To avoid graph breaks caused by "
        "logger in compile-mode, it is recommended to disable logging by adding logging methods to "
        "config.ignore_logger_methods\n"
        "You can suppress this exception and fall back to eager by setting:\n"
        "    import torch._dynamo\n"
        "    torch._dynamo.config.suppress_errors = True\n"
    )
    c = first(tmp_path, log)
    whys = [f.why for f in c.fixes]
    assert c.kind == "compile_error" and "torch._dynamo.config.ignore_logger_methods" in whys[0]
    assert "torch._dynamo.config.suppress_errors = True" in whys[1]
    # a graph break on .item(): Dynamo names the config that captures it
    c = first(
        tmp_path,
        "torch._dynamo.exc.Unsupported: Tensor.item. Set torch._dynamo.config.capture_scalar_outputs = True or "
        "TORCHDYNAMO_CAPTURE_SCALAR_OUTPUTS=1 to include these operations in the captured graph.\n",
    )
    assert "torch._dynamo.config.capture_scalar_outputs" in c.fixes[0].why
    # a config line printed by a healthy run is no failure
    assert problems(tmp_path, "    torch._dynamo.config.cache_size_limit = 64\nstep 1 loss 0.5\n") == []


def test_a_backend_failure_names_the_op_of_the_message_under_it(tmp_path):
    log = (
        "torch._dynamo.exc.BackendCompilerFailed: backend='inductor' raised:\n"
        "AssertionError: Please convert all Tensors to FakeTensors first or instantiate FakeTensorMode with "
        "'allow_non_fake_inputs'. Found in aten.embedding.default(tensor([...], size=(50368, 768)), FakeTensor(...))\n"
    )
    c = first(tmp_path, log)
    assert c.kind == "compile_error" and c.where == "aten.embedding.default"


# ---- a CUDA OOM names its device and the processes the message lists on it ------------------------
@pytest.mark.parametrize(
    "line, title",
    [
        ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.11 GiB. GPU 0 has a total capacity of "
         "14.74 GiB of which 1.65 GiB is free. Process 19066 has 6.79 GiB memory in use. Process 19069 has 514.00 MiB "
         "memory in use. Process 19060 has 4.93 GiB memory in use.", "CUDA out of memory on GPU 0, shared by 3 processes"),
        ("torch.cuda.OutOfMemoryError: CUDA out of memory. Tried to allocate 1.00 GiB (GPU 1; 23.69 GiB total "
         "capacity; 21.50 GiB already allocated; 512.00 MiB free; 22.00 GiB reserved in total by PyTorch)",
         "CUDA out of memory on GPU 1"),
        ("torch.OutOfMemoryError: HIP out of memory. Tried to allocate 2.00 GiB. GPU 5 has a total capacity of "
         "191.98 GiB of which 1.20 GiB is free. Of the allocated memory 180.00 GiB is allocated by PyTorch, and "
         "2.00 GiB is reserved by PyTorch but unallocated.", "CUDA out of memory on GPU 5"),
    ],
)  # fmt: skip
def test_a_cuda_oom_names_its_gpu_and_the_processes_sharing_it(tmp_path, line, title):
    c = first(tmp_path, line + "\n")
    assert c.kind == "oom" and c.title.startswith(title), c.title


def test_a_line_that_states_a_gpus_capacity_is_no_oom(tmp_path):
    assert (
        problems(
            tmp_path, "INFO GPU 0 has a total capacity of 79.15 GiB; Process 12 has 2.00 GiB memory in use\n"
        )
        == []
    )


# ---- a version mismatch names the caller's line ----------------------------------------------------
def _tb(pkg_path: str, func: str, call: str, error: str) -> str:
    return (
        "Traceback (most recent call last):\n"
        '  File "/work/train.py", line 10, in <module>\n'
        "    main()\n"
        f'  File "/venv/lib/python3.10/site-packages/{pkg_path}", line 401, in {func}\n'
        f"    {call}\n"
        f"{error}\n"
    )


@pytest.mark.parametrize(
    "text, at",
    [
        (_tb("trl/trainer/sft_trainer.py", "__init__", "super().__init__(",
             "TypeError: Trainer.__init__() got an unexpected keyword argument 'tokenizer'"),
         "trl/trainer/sft_trainer.py __init__"),
        (_tb("transformers/trainer.py", "create_accelerator_and_postprocess", "self.accelerator = Accelerator(",
             "TypeError: Accelerator.__init__() got an unexpected keyword argument 'use_seedable_sampler'"),
         "transformers/trainer.py create_accelerator_and_postprocess"),
        (_tb("trl/trainer/grpo_trainer.py", "__init__", "self.llm = LLM(",
             "TypeError: LLM.__init__() got an unexpected keyword argument 'enable_sleep_mode'"),
         "trl/trainer/grpo_trainer.py __init__"),
    ],
)  # fmt: skip
def test_a_version_mismatch_names_the_callers_line(tmp_path, text, at):
    c = first(tmp_path, text)
    assert c.kind == "version_mismatch" and c.where.endswith(f"called from {at}"), c.where


def test_a_mismatch_called_from_the_users_own_code_names_no_library_line(tmp_path):
    text = (
        'Traceback (most recent call last):\n  File "/work/train.py", line 10, in <module>\n'
        "    acc = Accelerator(use_seedable_sampler=True)\n"
        "TypeError: Accelerator.__init__() got an unexpected keyword argument 'use_seedable_sampler'\n"
    )
    c = first(tmp_path, text)
    assert c.kind == "version_mismatch" and "called from" not in c.where


# ---- an engine limit names the engine's own key -----------------------------------------------------
@pytest.mark.parametrize(
    "line, key",
    [
        ("ValueError: The input (85050 tokens) is longer than the model's context length (32768 tokens).",
         "context_length"),
        ("ValueError: Input length (40000 tokens) exceeds the maximum allowed length (32768 tokens). Use a shorter "
         "input or enable --allow-auto-truncate.", "context_length"),
        ("openai.BadRequestError: This model's maximum context length is 4096 tokens. However, you requested 5000 "
         "tokens (4000 in the messages, 1000 in the completion).", "max_model_len"),
    ],
)  # fmt: skip
def test_an_engine_limit_names_the_engines_own_key(tmp_path, line, key):
    c = first(tmp_path, line + "\n")
    assert c.kind == "engine_limit" and c.where.startswith(key), c.where


def test_an_engines_printed_context_length_is_no_limit(tmp_path):
    assert (
        problems(tmp_path, "server_args=ServerArgs(context_length=32768, mem_fraction_static=0.88)\n") == []
    )


# ---- a Ray worker that crashed in native code is named with its signal -----------------------------
_RAY_DIED = (
    "(raylet) A worker died or was killed while executing a task by an unexpected system error. To troubleshoot "
    "the problem, check the logs for the dead worker.\n"
)


@pytest.mark.parametrize(
    "text, where",
    [
        ("(AsyncActor pid=46603) finished at 2024-06-20 18:19:49.999099.\n" + _RAY_DIED
         + "(AsyncActor pid=46603) *** SIGSEGV received at time=1718907589 on cpu 3 ***\n", "AsyncActor (SIGSEGV)"),
        ("(RolloutWorker pid=7) Fatal Python error: Segmentation fault\n"
         "ray.exceptions.ActorDiedError: The actor died unexpectedly before finishing this task.\n",
         "RolloutWorker (Segmentation fault)"),
    ],
)  # fmt: skip
def test_a_ray_worker_that_crashed_natively_is_named_with_its_signal(tmp_path, text, where):
    c = first(tmp_path, text)
    assert c.kind == "ray_actor_died" and c.where == where, (c.kind, c.where)
    assert "native" in c.what


def test_a_native_crash_alone_is_never_clean_and_a_handler_notice_is(tmp_path):
    d = diagnose(tmp_path, "step 3 loss 0.5\n*** SIGABRT received at time=1718907589 on cpu 0 ***\n")
    assert d.verdict == "error"
    assert problems(tmp_path, "(raylet) installed the failure signal handler for SIGSEGV and SIGABRT\n") == []


# ---- a NaN gradient norm under a finite loss from the first step: the gradient reduction ------------
@pytest.mark.parametrize(
    "log",
    [
        "{'loss': 1.0446, 'grad_norm': nan, 'learning_rate': 1.49e-08, 'epoch': 0.0}\n"
        "{'loss': 0.0, 'grad_norm': nan, 'learning_rate': 2.98e-08, 'epoch': 0.01}\n",
        '[2024-04-02 14:16:49,000] [INFO] [config.py:984:print] zero_optimization ........ {"stage": 2}\n'
        '{"loss": 1.62, "grad_norm": NaN, "learning_rate": 5e-06, "epoch": 0.16}\n',
    ],
)
def test_a_nan_grad_norm_with_a_finite_loss_names_deepspeeds_overlapped_reduction(tmp_path, log):
    c = first(tmp_path, log)
    assert c.kind in ("nonfinite", "collapse") and "overlap_comm" in (c.where or "")
    assert any("overlap_comm=false" in (f.key or "") for f in c.fixes)


def test_a_verl_nan_grad_norm_does_not_blame_deepspeed(tmp_path):
    c = first(tmp_path, "step:1 - actor/pg_loss:0.12 - actor/grad_norm:nan - critic/score/mean:0.1\n")
    assert c.kind == "nonfinite" and "overlap_comm" not in (c.where or "")
    assert not any("overlap_comm" in f.why for f in c.fixes)


def test_no_kv_cache_blocks_offers_eager_mode_in_the_frameworks_spelling(tmp_path):
    line = (
        "ValueError: No available memory for the cache blocks. Try increasing `gpu_memory_utilization` when "
        "initializing the engine.\n"
    )
    c = first(tmp_path, "INFO 01-02 10:00:00 [llm_engine.py:75] Initializing an LLM engine\n" + line)
    assert c.where == "vllm gpu_memory_utilization"
    assert any("enforce_eager=True" in (f.key or "") for f in c.fixes)
    c = first(tmp_path, "GRPOTrainer: starting vLLM\n" + line)
    assert any(f.key == "GRPOConfig.vllm_enforce_eager=True" for f in c.fixes)


@pytest.mark.parametrize(
    "bar, where",
    [
        ("Loading checkpoint shards:  50%|#####     | 1/2 [00:30<00:30, 30.0s/it]Killed", "from_pretrained: Loading checkpoint shards"),
        ("Map:  30%|###       | 300/1000 [00:03<00:07, 99.0 examples/s]Killed", "while: Map"),
        ("Generating train split:  40%|####      | 4000/10000 [00:05<00:07, 800 examples/s]Killed", "while: Generating train split"),
    ],
)  # fmt: skip
def test_a_kill_on_a_progress_bar_names_what_was_running(tmp_path, bar, where):
    c = first(tmp_path, bar + "\n")
    assert c.kind == "killed" and c.where == where, c.where
    assert problems(tmp_path, bar.removesuffix("Killed") + "\n") == []


# ---- a loss scale that was low from the start names DeepSpeed's initial_scale_power -----------------
_DS_INFO = "[2021-01-26 22:04:09,190] [INFO] "


@pytest.mark.parametrize(
    "log, where",
    [
        (_DS_INFO + "[fused_optimizer.py:314:_update_scale] \nGrad overflow on iteration 3\n"
         + _DS_INFO + "[fused_optimizer.py:316:_update_scale] Reducing dynamic loss scale from 8.0 to 4.0\n",
         "fp16.initial_scale_power (a scale of 8 by iteration 3)"),
        ("  initial_scale_power .......... 6\n"
         + _DS_INFO + "[logging.py:60:log_dist] [Rank 0] Overflow detected. Skipping step. Attempted loss scale: "
         "64, reducing to 32\n", "fp16.initial_scale_power (6)"),
        (_DS_INFO + "[stage_1_and_2.py:1800:step] [deepspeed] OVERFLOW! Rank 0 Skipping step. Attempted loss scale: "
         "2, reducing to 1\nException: Current loss scale already at minimum - cannot decrease scale anymore. "
         "Exiting run.\n", "fp16.min_loss_scale (the minimum-scale abort)"),
    ],
)  # fmt: skip
def test_a_low_loss_scale_names_the_deepspeed_setting_behind_it(tmp_path, log, where):
    c = first(tmp_path, log)
    assert c.kind in ("overflow_skips", "loss_scale_collapse") and c.where == where, c.where


def test_a_scale_that_halved_down_from_the_default_names_no_setting(tmp_path):
    log = (
        _DS_INFO
        + "Grad overflow on iteration 40\n"
        + _DS_INFO
        + "Reducing dynamic loss scale from 65536.0 to 32768.0\n"
    )
    d = diagnose(tmp_path, log)
    assert all(c.where is None for c in d.causes if c.kind == "overflow_skips")
    assert problems(tmp_path, log) == []


# ---- bf16 refused names the setting that asked for it ------------------------------------------------
@pytest.mark.parametrize(
    "log, asked",
    [
        ('  File "/usr/local/lib/python3.10/dist-packages/accelerate/accelerator.py", line 474, in __init__\n'
         'ValueError: bf16 mixed precision requires PyTorch >= 1.10 and a supported device.\n', "mixed_precision=bf16"),
        ("TrainingArguments(bf16=True, output_dir=out)\n"
         "ValueError: Your setup doesn't support bf16/gpu. You need torch>=1.10, using Ampere GPU with cuda>=11.0\n",
         "bf16=True"),
        ("args: model=Qwen2-7B dtype=bfloat16\nValueError: Bfloat16 is only supported on GPUs with compute capability "
         "of at least 8.0. Your Tesla V100-SXM2-32GB GPU has compute capability 7.0.\n", "dtype=bfloat16"),
    ],
)  # fmt: skip
def test_bf16_refused_names_the_setting_that_asked_for_it(tmp_path, log, asked):
    c = first(tmp_path, log)
    assert c.kind == "dtype_unsupported" and c.where.endswith(f"asked by {asked}"), c.where


def test_a_printed_bf16_setting_alone_is_healthy(tmp_path):
    assert problems(tmp_path, "TrainingArguments(bf16=True, output_dir=out)\nmixed_precision=bf16\n") == []


# ---- a collective timeout after start-up: ranks that took different paths ---------------------------
def test_a_timeout_after_start_up_offers_a_rank_consistent_decision(tmp_path):
    late = (
        "[E ProcessGroupNCCL.cpp:737] [Rank 3] Watchdog caught collective operation timeout: "
        "WorkNCCL(SeqNum=3738254, OpType=_ALLGATHER_BASE, Timeout(ms)=1800000) ran for 1809440 milliseconds\n"
    )
    c = first(tmp_path, late)
    assert c.kind == "nccl_timeout" and any("dist.all_reduce" in f.why for f in c.fixes)
    # a timeout in the first collectives of a process group is the network at start-up, not a rank's decision
    early = late.replace("SeqNum=3738254", "SeqNum=1").replace("_ALLGATHER_BASE", "ALLREDUCE")
    c = first(tmp_path, early)
    assert not any("dist.all_reduce" in f.why for f in c.fixes)
