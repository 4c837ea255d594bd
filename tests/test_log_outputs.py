"""Session-10 foreign-log checks (branch logs25d): outputs compared with a reference (`logs.outputs`), vLLM's
memory budget leaving no room outside it (`logs.memory._headroom`), the rank that signalled an NCCL dump
(`logs.distributed`). Each excerpt is synthetic, written for the mechanism (not a corpus file)."""

from __future__ import annotations

from pathlib import Path

from verlaudit.analysis.diagnose.diagnosis import diagnose_path


def diagnose_text(tmp_path: Path, text: str):
    p = tmp_path / "run.log"
    p.write_text(text)
    (d,) = diagnose_path(p)
    return d


def fix_text(cause) -> str:
    return " | ".join(f"{f.suite} {f.verl} {f.key} {f.why}" for f in cause.fixes)


# ---- outputs against a reference
def test_a_failed_tolerance_assertion_is_a_mismatch_naming_the_model_and_the_compared_values(
    tmp_path: Path,
) -> None:
    text = "\n".join(
        [
            "tests/models/test_embed.py::test_cosine[org/tiny-embedder] FAILED",
            "    def test_cosine(model):",
            ">       assert abs(engine_sim - torch_sim) <= rtol * abs(torch_sim)",
            "E       AssertionError",
            "Model: org/tiny-embedder",
            "  engine: dtype=torch.bfloat16 0.8120",
            "  torch: 0.8391",
        ]
    )
    d = diagnose_text(tmp_path, text)
    c = d.causes[0]
    assert d.verdict == "error" and c.kind == "mismatch"
    assert "org/tiny-embedder" in c.where and "engine_sim" in c.where
    assert "0.8120" in c.title and "0.8391" in c.title
    assert any("half precision" in e for e in c.evidence)
    assert "fp32" in fix_text(c)


def test_an_assertion_without_a_tolerance_is_not_read_as_a_mismatch(tmp_path: Path) -> None:
    text = "\n".join(["    assert len(batch) == expected_len", "AssertionError"])
    c = diagnose_text(tmp_path, text).causes[0]
    assert c.kind != "mismatch"


def test_a_testing_librarys_closeness_report_is_a_mismatch(tmp_path: Path) -> None:
    text = "\n".join(
        [
            'File "/ws/tests/test_kernel.py", line 40, in test_fused_rmsnorm',
            "    torch.testing.assert_close(out, ref)",
            "AssertionError: Tensor-likes are not close!",
            "Mismatched elements: 37 / 8192 (0.5%)",
            "Greatest absolute difference: 0.0625 at index (3, 17) (up to 1e-05 allowed)",
        ]
    )
    c = diagnose_text(tmp_path, text).causes[0]
    assert c.kind == "mismatch" and c.severity == "error"
    assert "37 of 8192" in (c.where or "")


def test_labelled_continuations_that_fork_from_the_reference_are_a_mismatch_warning(tmp_path: Path) -> None:
    text = "\n".join(
        [
            "baseline_text: The capital of France is Paris, a city known for its museums and cafes",
            "draft_text: The capital of France is Paris, a city with a long history of revolutions",
            "baseline_text: One plus one equals two because counting starts at one",
            "draft_text: One plus one equals two because counting starts at one",
        ]
    )
    d = diagnose_text(tmp_path, text)
    c = d.causes[0]
    assert d.verdict == "warning" and c.kind == "mismatch"
    assert c.where.startswith("draft_text vs baseline_text")
    assert "after 8 words" in c.title


def test_prompts_and_their_answers_are_not_a_divergence(tmp_path: Path) -> None:
    # labelled lines without a reference side, or a reference whose text shares no opening: healthy prints
    text = "\n".join(
        [
            "Prompt: What is two plus two? Answer with a number",
            "Generated text: The answer is 4",
            "reference: 4",
            "completion: The answer is four, since two and two make four",
            "hf_output: The weather today is sunny",
            "vllm_output: The weather today is sunny",
        ]
    )
    assert diagnose_text(tmp_path, text).verdict == "clean"


# ---- vLLM's memory budget
BUDGET = (
    "INFO 05-02 11:00:01 [worker.py:267] the current vLLM instance can use total_gpu_memory ({total}GiB) x "
    "gpu_memory_utilization ({util}) = {want}GiB"
)
CAPTURE = (
    "INFO 05-02 11:00:05 [model_runner.py:1442] Capturing cudagraphs for decoding. This may lead to unexpected "
    "consequences if the model is not static. To run the model in eager mode, set 'enforce_eager=True' or use "
    "'--enforce-eager' in the CLI."
)


def test_a_budget_that_leaves_no_room_for_graph_capture_is_an_oom_warning(tmp_path: Path) -> None:
    d = diagnose_text(tmp_path, "\n".join([BUDGET.format(total=23.65, util=0.97, want=22.94), CAPTURE]))
    c = d.causes[0]
    assert d.verdict == "warning" and c.kind == "oom" and "gpu_memory_utilization" in c.where
    assert "0.71 GiB" in c.title
    assert "enforce_eager" in fix_text(c) and "gpu_memory_utilization" in fix_text(c)


def test_a_budget_with_room_or_without_graphs_is_quiet(tmp_path: Path) -> None:
    assert diagnose_text(
        tmp_path, "\n".join([BUDGET.format(total=79.1, util=0.9, want=71.19), CAPTURE])
    ).verdict == ("clean")
    eager = "Initializing an LLM engine with config: model='m', enforce_eager=True, dtype=bfloat16"
    tight = BUDGET.format(total=23.65, util=0.97, want=22.94)
    assert diagnose_text(tmp_path, "\n".join([eager, tight])).verdict == "clean"


# ---- NCCL: the rank that signalled the dump
NCCL = (
    "[rank{r}]:[E0301 10:00:00.1 ProcessGroupNCCL.cpp:632] [Rank {r}] Watchdog caught collective operation "
    "timeout: WorkNCCL(SeqNum=9001, OpType=ALLREDUCE, NumelIn=4, NumelOut=4, Timeout(ms)=600000) ran for "
    "600011 milliseconds before timing out."
)
DUMP = (
    "[rank{r}]:[E0301 10:00:00.0 ProcessGroupNCCL.cpp:1746] [PG ID 0 PG GUID 0(default_pg) Rank {r}] Received a "
    "dump signal due to a collective timeout from  rank {src} and we will try our best to dump the debug info."
)


def test_the_rank_that_signalled_the_dump_timed_out_first(tmp_path: Path) -> None:
    text = "\n".join([DUMP.format(r=0, src=2), NCCL.format(r=3), NCCL.format(r=2)])
    c = diagnose_text(tmp_path, text).causes[0]
    assert c.kind == "nccl_timeout" and c.where == "rank 2" and "first to time out" in c.title
    # without the dump line the first rank in the log is named
    c = diagnose_text(tmp_path, "\n".join([NCCL.format(r=3), NCCL.format(r=2)])).causes[0]
    assert c.where == "rank 3"


# ---- the message's own advice, attached to the cause it sits next to
NCCL_ERR = (
    "torch.distributed.DistBackendError: NCCL error in: /opt/pytorch/ProcessGroupNCCL.cpp:1970, unhandled "
    "system error (run with NCCL_DEBUG=INFO for details), NCCL version 2.21.5"
)


def test_the_advice_printed_next_to_a_failure_comes_first_among_its_fixes(tmp_path: Path) -> None:
    text = "\n".join(
        [
            NCCL_ERR,
            "ncclSystemError: System call (e.g. socket, malloc) or external library call failed.",
            "To work around this, set the environment variable `NCCL_CUMEM_ENABLE=0` before starting the job. "
            "For debugging consider passing NCCL_DEBUG_SUBSYS=ALL.",
        ]
    )
    c = diagnose_text(tmp_path, text).causes[0]
    assert c.kind == "nccl_error"
    assert "NCCL_CUMEM_ENABLE=0" in c.fixes[0].why and c.fixes[0].why.startswith("the message's own advice")
    assert "NCCL_DEBUG_SUBSYS=ALL" in c.fixes[-1].why  # how to see more: last, after the remedies


def test_advice_far_from_the_failure_or_a_source_line_is_not_attached(tmp_path: Path) -> None:
    far = [
        NCCL_ERR,
        *(f"step {i}: loss 0.5" for i in range(30)),
        "Set the environment variable `FOO_LIMIT=3`.",
    ]
    c = diagnose_text(tmp_path, "\n".join(far)).causes[0]
    assert "FOO_LIMIT" not in fix_text(c)
    code = [NCCL_ERR, "    raise DistBackendError(msg, case_name=case_name)"]
    assert "case_name" not in fix_text(diagnose_text(tmp_path, "\n".join(code)).causes[0])


# ---- a bf16 setting on a GPU without bf16: the fix in the log's own syntax
def test_bf16_refused_gets_the_logs_own_assignment_rewritten_with_fp16(tmp_path: Path) -> None:
    text = "\n".join(
        [
            "[training]",
            "log_precision = 'bf16'",
            "amp_mixed_precision: bf16",
            "ValueError: Your setup doesn't support bf16/gpu. You need to assign use_cpu if you want to train the "
            "model on CPU.",
        ]
    )
    c = diagnose_text(tmp_path, text).causes[0]
    assert c.kind == "dtype_unsupported"
    assert c.fixes[0].why.startswith("amp_mixed_precision: fp16 where the log sets amp_mixed_precision: bf16")
    assert "log_precision = 'fp16'" in c.fixes[1].why  # the other bf16 setting, after the causing key
    engine = "Initializing an LLM engine with config: model='org/m', dtype=torch.bfloat16, seed=0"
    c = diagnose_text(tmp_path, "\n".join([engine, text.splitlines()[-1]])).causes[0]
    assert "dtype=torch.float16" in c.fixes[0].why


# ---- version pairs: the framework's install extra, the release the environment's paths name
def test_a_framework_engine_mismatch_gets_the_frameworks_pinned_extra(tmp_path: Path) -> None:
    text = "\n".join(
        [
            "Traceback (most recent call last):",
            '  File "/opt/venv/lib/python3.11/site-packages/openrlhf/trainer/ray/vllm_engine.py", line 90, in __init__',
            "    self.llm = vllm.LLM(*args, **kwargs)",
            '  File "/opt/venv/lib/python3.11/site-packages/vllm/entrypoints/llm.py", line 200, in __init__',
            "    engine_args = EngineArgs(",
            "TypeError: EngineArgs.__init__() got an unexpected keyword argument 'enable_sleep_mode'",
        ]
    )
    c = diagnose_text(tmp_path, text).causes[0]
    assert c.kind == "version_mismatch" and c.fixes[0].why.startswith("pip install openrlhf[vllm]")


def test_the_release_an_environments_path_names_is_the_one_to_reinstall(tmp_path: Path) -> None:
    text = "\n".join(
        [
            '  File "/home/u/miniconda3/envs/rl_sglang-0.4.6/lib/python3.10/site-packages/sglang/srt/server_args.py", '
            "line 31, in __init__",
            "    self.check()",
            "TypeError: ServerArgs.__init__() got an unexpected keyword argument 'enable_memory_saver'",
        ]
    )
    c = diagnose_text(tmp_path, text).causes[0]
    assert c.kind == "version_mismatch" and "pip install 'sglang==0.4.6'" in fix_text(c)
    # no version in the paths: no such fix
    plain = text.replace("rl_sglang-0.4.6", "rl")
    assert "reinstall it cleanly" not in fix_text(diagnose_text(tmp_path, plain).causes[0])


def test_a_module_a_framework_installs_through_an_extra_names_the_extra(tmp_path: Path) -> None:
    text = "\n".join(
        [
            '  File "/workspace/nemo_rl/models/policy/megatron_policy_worker.py", line 40, in <module>',
            "    from megatron.core import parallel_state",
            "ModuleNotFoundError: No module named 'megatron'",
        ]
    )
    c = diagnose_text(tmp_path, text).causes[0]
    assert c.kind == "import_error" and "uv run --extra mcore" in c.where
    assert c.fixes[0].why.startswith("uv run --extra mcore")


# ---- an OOM in a whole-vocabulary log-prob / entropy computation
def test_an_oom_in_a_log_softmax_over_the_vocab_names_the_function_and_the_chunking_key(
    tmp_path: Path,
) -> None:
    text = "\n".join(
        [
            "(DTensorPolicyWorker pid=77) nemo_rl.algorithms.grpo: training step 1",
            "Traceback (most recent call last):",
            '  File "/opt/nemo_rl/models/dtensor/policy_worker.py", line 610, in get_logprobs',
            "    token_logprobs = compute_token_logprobs(logits, input_ids)",
            '  File "/opt/nemo_rl/distributed/model_utils.py", line 88, in compute_token_logprobs',
            "    log_probs = torch.nn.functional.log_softmax(logits.float(), dim=-1)",
            "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 3.10 GiB. GPU 0 has a total capacity of "
            "79.10 GiB of which 1.20 GiB is free.",
        ]
    )
    c = diagnose_text(tmp_path, text).causes[0]
    assert c.kind == "oom" and "compute_token_logprobs" in c.where and "full-vocab logits" in c.where
    assert c.fixes[0].why.startswith("log-probs / entropy over chunks")


def test_one_allocation_of_a_large_share_of_the_gpu_is_read_as_a_vocab_tensor_and_a_small_one_is_not(
    tmp_path: Path,
) -> None:
    line = ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate {t} GiB. GPU 0 has a total capacity of "
            "79.10 GiB of which 2.00 GiB is free.")  # fmt: skip
    big = diagnose_text(tmp_path, line.format(t="11.50")).causes[0]
    assert "whole-vocabulary" in (big.where or "") and "chunks of the sequence" in fix_text(big)
    small = diagnose_text(tmp_path, line.format(t="0.50")).causes[0]
    assert "vocab" not in (small.where or "") and "chunks of the sequence" not in fix_text(small)


def test_a_ray_task_error_names_the_module_of_the_actor_that_failed(tmp_path: Path) -> None:
    text = (
        "ray.exceptions.RayTaskError(OutOfMemoryError): ray::PolicyActor.update() (pid=9, ip=10.0.0.2, "
        "repr=<myrl.workers.policy.PolicyActor object at 0x7f00>)\n"
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 0.25 GiB. GPU 0 has a total capacity of "
        "79.10 GiB of which 0.10 GiB is free."
    )
    c = diagnose_text(tmp_path, text).causes[0]
    assert c.kind == "oom" and "PolicyActor.update (myrl.workers.policy)" in c.where


def test_a_timeout_without_a_stack_names_what_the_job_logged_last(tmp_path: Path) -> None:
    text = "\n".join(
        [
            "03/04/2025 10:00:01 - INFO - mytrainer.checkpointing - Writing sharded optimizer state",
            NCCL.format(r=1),
        ]
    )
    c = diagnose_text(tmp_path, text).causes[0]
    assert c.kind == "nccl_timeout"
    assert c.where == "rank 1 (last logged by mytrainer.checkpointing: Writing sharded optimizer state)"
    # a log line long before the hang says nothing about it
    far = "\n".join([text.splitlines()[0], *(f"step {i}" for i in range(80)), NCCL.format(r=1)])
    assert diagnose_text(tmp_path, far).causes[0].where == "rank 1"


# ---- the GPU's generation lacks a kernel; a model architecture the installed library predates
def test_flash_attention_on_a_pre_ampere_gpu_is_unsupported_with_the_attention_fix(tmp_path: Path) -> None:
    text = "GPU 0: Tesla T4\nRuntimeError: FlashAttention only supports Ampere GPUs or newer."
    c = diagnose_text(tmp_path, text).causes[0]
    assert c.kind == "dtype_unsupported" and "attn_implementation" in c.where and "T4" in c.title
    assert "attn_implementation='sdpa'" in fix_text(c)


def test_a_bf16_gemm_cublas_refuses_is_unsupported_and_a_missing_arch_build_is_a_cuda_error(
    tmp_path: Path,
) -> None:
    gemm = ("RuntimeError: CUDA error: CUBLAS_STATUS_NOT_SUPPORTED when calling `cublasGemmEx(handle, opa, opb, m, n, "
            "k, &falpha, a, CUDA_R_16BF, lda, b, CUDA_R_16BF, ldb, &fbeta, c, CUDA_R_16BF, ldc, CUDA_R_32F, "
            "CUBLAS_GEMM_DEFAULT_TENSOR_OP)`")  # fmt: skip
    c = diagnose_text(tmp_path, gemm).causes[0]
    assert c.kind == "dtype_unsupported" and "fp16" in fix_text(c)
    arch = ("UserWarning: NVIDIA GeForce RTX 5090 with CUDA capability sm_120 is not compatible with the current "
            "PyTorch installation.")  # fmt: skip
    c = diagnose_text(tmp_path, arch + "\nRuntimeError: CUDA error: no kernel image is available for execution on the "
                      "device").causes[0]  # fmt: skip
    assert c.kind == "cuda_error" and c.where == "sm_120" and "TORCH_CUDA_ARCH_LIST" in fix_text(c)


def test_an_architecture_the_library_predates_is_a_version_mismatch_naming_it(tmp_path: Path) -> None:
    text = "ValueError: Model architectures ['Gemma9ForCausalLM'] are not supported for now. Supported architectures: ..."
    c = diagnose_text(tmp_path, text).causes[0]
    assert c.kind == "version_mismatch" and c.where == "vllm (Gemma9ForCausalLM)"
    assert fix_text(c).startswith("None None None pip install -U vllm")
    text = ("ValueError: The checkpoint you are trying to load has model type `gemma9` but Transformers does not "
            "recognize this architecture.")  # fmt: skip
    assert diagnose_text(tmp_path, text).causes[0].where == "transformers (gemma9)"


def test_an_oom_in_the_engines_own_process_is_a_generation_oom_with_the_engines_keys(tmp_path: Path) -> None:
    text = ("[2025-03-01 09:00:00 TP1] Scheduler hit an exception: torch.OutOfMemoryError: CUDA out of memory. Tried to "
            "allocate 1.50 GiB. GPU 1 has a total capacity of 79.10 GiB of which 0.90 GiB is free.")  # fmt: skip
    c = diagnose_text(tmp_path, text).causes[0]
    assert c.kind == "oom" and c.phase == "generate" and "SGLang scheduler TP1" in c.where
    assert c.fixes[0].key == "--mem-fraction-static"


def test_a_check_that_names_its_settings_in_prose_is_a_configuration_check(tmp_path: Path) -> None:
    text = "ValueError: Number of key value heads (6) must be divisible by pipeline parallel size (4)."
    c = diagnose_text(tmp_path, text).causes[0]
    assert c.title.startswith("Configuration check failed") and "pipeline_parallel_size" in c.where
    assert "key_value_heads=6" in c.where and "change pipeline_parallel_size so the check holds" in fix_text(
        c
    )
