"""Log rules that read what a message says when the log around it is thin (issue 25): a user's
retyped one-line error, a kill on a progress bar, an engine's refused request, a gradient-dtype check,
NCCL's own lines. Each rule with a planted line it catches and a healthy near-miss it passes.
Run: `pytest tests/test_log_messages.py`."""

from __future__ import annotations

from pathlib import Path

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


def test_a_shell_kill_on_a_progress_bar_is_a_kill(tmp_path):
    bar = "Loading checkpoint shards:   0%|          | 0/2 [00:00<?, ?it/s]"
    c = first(tmp_path, bar + "Killed\n")
    assert c.kind == "killed" and c.severity == "error" and c.phase == "init"
    # a progress bar that names "killed" in its description is not a kill
    assert problems(tmp_path, "Killed processes:  50%|#####     | 1/2 [00:01<00:01, 1.00it/s]\n") == []


def test_an_unexpected_keyword_retyped_without_its_type_is_a_version_mismatch(tmp_path):
    c = first(tmp_path, "Accelerator.__init__() got an unexpected keyword argument use_seedable_sampler\n")
    assert c.kind == "version_mismatch" and c.where.startswith("accelerate")
    assert "use_seedable_sampler" in c.title
    # the same words inside a sentence that quotes no call are not a failure
    assert problems(tmp_path, "INFO: passing an unexpected keyword argument is deprecated\n") == []


def test_sglang_dropping_a_weight_update_request_is_a_missing_engine_feature(tmp_path):
    c = first(
        tmp_path,
        "[14:26:31] Invalid object: UpdateWeightReqInput(model_path='/m/llama', load_format='auto')\n",
    )
    assert c.kind == "engine_feature" and c.severity == "error" and c.phase == "weight_sync"
    assert "sglang" in c.where and any("--dp-size 1" in f.why for f in c.fixes)
    # a request the controller dispatched (logged, not refused) is no finding
    assert problems(tmp_path, "[14:26:31] Receive: obj=UpdateWeightReqInput(model_path='/m/llama')\n") == []


def test_a_gradient_in_another_dtype_than_grad_dtype_is_a_dtype_error(tmp_path):
    c = first(
        tmp_path,
        "RuntimeError: attempting to assign a gradient with dtype 'c10::BFloat16' to a tensor with grad_dtype 'Float'.\n",
    )
    assert c.kind == "dtype_error" and "bf16" in c.title and "fp32" in c.title
    assert "torch.no_grad()" in c.fixes[0].why  # the gradient dtype is fixed at FSDP2's lazy init
    c = first(
        tmp_path, "RuntimeError: expected scalar type BFloat16 but found Float\n"
    )  # operands: not that fix
    assert not any("_lazy_init" in f.why for f in c.fixes)
    assert (
        problems(tmp_path, "INFO: set the tensor's grad_dtype attribute to None to allow any dtype\n") == []
    )


def test_nccl_failing_to_load_libcuda_is_an_nccl_error_and_its_plugin_probe_is_not(tmp_path):
    probe = (
        "host:41:41 [0] NCCL INFO NET/Plugin : Plugin load (libnccl-net.so) returned 2 : libnccl-net.so: cannot "
        "open shared object file: No such file or directory\n"
        "host:41:41 [0] NCCL INFO NET/Plugin : No plugin found, using internal implementation\n"
    )
    assert problems(tmp_path, probe) == []  # NCCL falls back to its own transport: healthy
    c = first(
        tmp_path,
        probe + "host:41:41 [0] misc/cudawrap.cc:179 NCCL WARN Failed to find CUDA library libcuda.so "
        "(NCCL_CUDA_PATH='') : libcuda.so: cannot open shared object file: No such file or directory\n"
        "NCCL version 2.18.5+cuda12.1\n",
    )
    assert c.kind == "nccl_error" and "libcuda.so" in c.title and c.where == "NCCL 2.18.5 (libcuda.so)"


def test_a_library_object_without_the_attribute_its_caller_reads_is_a_version_mismatch(tmp_path):
    c = first(tmp_path, "AttributeError: 'LoRAConfig' object has no attribute 'lora_extra_vocab_size'\n")
    assert (
        c.kind == "version_mismatch"
        and c.where.startswith("vllm")
        and any("getattr" in f.why for f in c.fixes)
    )
    # vLLM's weight_loader, which vLLM attaches to every parameter of its model classes
    c = first(tmp_path, "AttributeError: 'Parameter' object has no attribute 'weight_loader'\n")
    assert c.kind == "version_mismatch" and c.where.startswith("vllm")
    # the user's own class (no library defines it) stays an exception of its own code
    c = first(tmp_path, "AttributeError: 'UpdateWeightDelta' object has no attribute 'metrics'\n")
    assert c.kind == "exception"


VLLM_TB = (
    "(EngineCore_DP0 pid=9) ERROR 03-10 17:16:32 [core.py:1229] Traceback (most recent call last):\n"
    '(EngineCore_DP0 pid=9) ERROR 03-10 17:16:32 [core.py:1229]   File "/usr/lib/python3.11/dist-packages/'
    'trl/scripts/vllm_serve.py", line 147, in {func}\n'
    "(EngineCore_DP0 pid=9) ERROR 03-10 17:16:32 [core.py:1229]     self.model_runner.model.{call}(weights)\n"
    '(EngineCore_DP0 pid=9) ERROR 03-10 17:16:32 [core.py:1229]   File "/usr/lib/python3.11/dist-packages/'
    'vllm/model_executor/models/qwen3.py", line 752, in {call}\n'
)


def test_vllm_logger_prefixes_are_read_as_a_traceback_and_a_cut_weight_load_is_a_weight_sync(tmp_path):
    c = first(tmp_path, VLLM_TB.format(func="update_named_param", call="load_weights"))
    assert c.kind == "weight_sync" and c.phase == "weight_sync" and "load_weights" in c.title
    assert c.where == "load_weights / vllm"
    # the same cut traceback outside a weight update stays an unrecognised failure, with its frame and library
    c = first(tmp_path, VLLM_TB.format(func="generate_batch", call="sample"))
    assert c.kind == "exception" and c.title.startswith("Unrecognised failure: a traceback cut after sample")


def test_the_vllm_logger_prefix_keeps_its_level_and_the_indentation_after_it():
    from verlaudit.analysis.logs.lines import parse_line

    line = parse_line(1, "(EngineCore_DP0 pid=9) ERROR 03-10 17:16:32 [core.py:1229]     return func(x)")
    assert (line.text, line.level, line.source) == ("    return func(x)", "ERROR", "EngineCore_DP0")
    info = parse_line(2, "INFO 03-10 17:16:32 [gpu_worker.py:298] Available KV cache memory: 50.1 GiB")
    assert (info.text, info.level) == ("Available KV cache memory: 50.1 GiB", "INFO")


def test_an_unknown_message_that_says_its_own_remedy_gets_it_as_the_fix(tmp_path):
    c = first(
        tmp_path,
        "ValueError: The configured object store size exceeds the capacity of /dev/shm. This will harm "
        "performance. To proceed regardless of this warning, you can set RAY_OBJECT_STORE_ALLOW_SLOW_STORAGE=1. "
        "Consider deleting files in /dev/shm or increasing its size with --shm-size in Docker.\n",
    )
    assert c.kind == "exception" and "--shm-size" in c.where
    assert [f.why.split(": ", 1)[1][:20] for f in c.fixes] == ["To proceed regardles", "Consider deleting fi"]
    # a message that advises nothing gets no invented fix
    c = first(tmp_path, "ValueError: The configured store size is 12 GB. This will be slow.\n")
    assert c.kind == "exception" and c.fixes == [] and c.where is None


def test_a_compile_failure_on_a_backend_import_names_the_library_pair(tmp_path):
    log = (
        "[rank7]: torch._dynamo.exc.BackendCompilerFailed: backend='inductor' raised:\n"
        "[rank7]: ImportError: cannot import name 'triton_key' from 'triton.compiler.compiler' "
        "(/usr/lib/python3.10/dist-packages/triton/compiler/compiler.py)\n"
    )
    c = first(tmp_path, log)
    assert (
        c.kind == "compile_error"
        and c.where == "triton.compiler.compiler (triton_key)"
        and "triton==" in c.fixes[0].why
    )
    # a compile failure of the traced code itself names no library
    c = first(
        tmp_path,
        "[rank7]: torch._dynamo.exc.Unsupported: data dependent operator: aten._local_scalar_dense\n",
    )
    assert c.kind == "compile_error" and "triton" not in (c.where or "") and "import" not in c.title


def test_gradscaler_raising_is_not_named_as_its_own_caller(tmp_path):
    log = (
        'File "/usr/lib/python3.8/site-packages/torch/cuda/amp/grad_scaler.py", line 212, in _unscale_grads_\n'
        '    raise ValueError("Attempting to unscale FP16 gradients.")\n'
        "ValueError: Attempting to unscale FP16 gradients.\n"
    )
    c = first(tmp_path, log)
    assert c.kind == "unscale_fp16" and "called from" not in c.title


def test_a_version_mismatch_offers_the_upgrade_of_the_older_side(tmp_path):
    c = first(tmp_path, "TypeError: DPOTrainer.__init__() got an unexpected keyword argument 'loss_type'\n")
    assert c.kind == "version_mismatch" and any("pip install -U trl" in f.why for f in c.fixes)
    c = first(tmp_path, "TypeError: helper() got an unexpected keyword argument 'x'\n")  # no library known
    assert not any("pip install -U" in f.why for f in c.fixes)


def test_a_dtype_error_names_the_operands_its_frame_passes(tmp_path):
    log = (
        "Traceback (most recent call last):\n"
        '  File "/env/lib/python3.8/site-packages/transformers/models/bert/modeling_bert.py", line 363, in forward\n'
        "    context_layer = torch.matmul(attention_probs, value_layer)\n"
        "RuntimeError: expected scalar type BFloat16 but found Float\n"
    )
    c = first(tmp_path, log)
    assert c.kind == "dtype_error"
    assert c.where == (
        "forward: torch.matmul (torch.matmul(attention_probs, value_layer), in transformers/models/bert/modeling_bert.py)"
    )
    # no frame: the message alone, no invented place
    c = first(tmp_path, "RuntimeError: expected scalar type BFloat16 but found Float\n")
    assert c.kind == "dtype_error" and c.where is None


def _watchdog(rank: int, seq: int = 15037) -> str:
    return (
        f"[rank{rank}]:[E ProcessGroupNCCL.cpp:563] [Rank {rank}] Watchdog caught collective operation timeout: "
        f"WorkNCCL(SeqNum={seq}, OpType=_ALLGATHER_BASE, NumelIn=131072512, NumelOut=524290048, Timeout(ms)=600000) "
        "ran for 600055 milliseconds before timing out.\n"
    )


def test_the_one_rank_that_printed_no_timeout_is_named_as_the_one_waited_for(tmp_path):
    c = first(tmp_path, "".join(_watchdog(r) for r in (3, 1, 2)))
    assert (
        c.kind == "nccl_timeout" and c.where.startswith("rank 0") and "rank 0 printed no timeout" in c.title
    )
    # two ranks silent: no one is singled out (the first rank that timed out stays the place)
    c = first(tmp_path, "".join(_watchdog(r) for r in (4, 1, 2)))
    assert c.kind == "nccl_timeout" and "printed no timeout" not in c.title


def test_settings_and_checks_name_the_call_site_they_failed_at(tmp_path):
    log = (
        "Traceback (most recent call last):\n"
        '  File "/v/lib/python3.12/site-packages/trl/trainer/grpo_trainer.py", line 1228, in _generate_single_turn\n'
        "    all_outputs = self.llm.chat(all_prompts, sampling_params=sampling_params)\n"
        "ValueError: The decoder prompt (length 299) is longer than the maximum model length of 20.\n"
    )
    c = first(tmp_path, log)
    assert c.kind == "engine_limit" and c.where == "max_model_len (at _generate_single_turn: self.llm.chat)"
    log = (
        '  File "/v/lib/python3.10/site-packages/torch/distributed/fsdp/_flat_param.py", line 770, in '
        "_validate_tensors_to_flatten\n"
        "    raise ValueError(\n"
        "ValueError: Must flatten tensors with uniform dtype but got torch.bfloat16 and torch.float32\n"
    )
    c = first(tmp_path, log)
    assert c.kind == "dtype_error" and c.where.endswith("raised in _validate_tensors_to_flatten")
    # a `raise` line calls nothing: the frame is named by its function alone
    c = first(tmp_path, log.replace("Must flatten tensors with uniform dtype but got", "Something else:"))
    assert "ValueError" not in (c.where or "").split(":")[-1]
