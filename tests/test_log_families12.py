"""Session 12's log families, each with members other than the corpus item that showed it (synthetic logs,
written here in each tool's own words): the kernel's OOM killer in its releases' and containers' words, a
non-finite metric named in a sentence or in a column no rule names, torch.compile failures told only by where
they were raised, an engine's context limit in vLLM's, SGLang's and TGI's words, a weight sync / refit that
failed in a trainer's own words, an exception pasted in a code span; and healthy lines that must stay clean.
Run: `pytest tests/test_log_families12.py`."""

from __future__ import annotations

from pathlib import Path

import pytest

from verlaudit.analysis.diagnose.diagnosis import diagnose_path


def diagnose(tmp_path: Path, text: str, name: str = "train.log"):
    p = tmp_path / name
    p.write_text(text)
    (d,) = diagnose_path(p)
    return d


def first(tmp_path: Path, text: str):
    d = diagnose(tmp_path, text)
    assert d.verdict != "clean" and d.causes, d.summary
    return d.causes[0]


def assert_healthy(tmp_path: Path, text: str) -> None:
    d = diagnose(tmp_path, text)
    bad = [(c.severity, c.kind, c.title) for c in d.causes if c.severity in ("error", "warning")]
    assert bad == [], bad


# ---- host OOM: the kernel's OOM killer and its reporters ------------------------------------------------


@pytest.mark.parametrize(
    "text, killed",
    [
        # dmesg of a recent kernel
        (
            "[1234567.890123] python invoked oom-killer: gfp_mask=0x100cca(GFP_HIGHUSER_MOVABLE), order=0\n"
            "[1234567.890456] Out of memory: Killed process 4242 (python) total-vm:98765432kB, anon-rss:87654321kB\n",
            "python",
        ),
        # an older kernel's two lines in /var/log/messages
        (
            "Jan  3 01:02:03 node7 kernel: Out of memory: Kill process 777 (torchrun) score 901 or sacrifice child\n"
            "Jan  3 01:02:03 node7 kernel: Killed process 778 (torchrun) total-vm:1234kB, anon-rss:1000kB\n",
            "torchrun",
        ),
        # the reaper line alone, as journalctl shows it
        (
            "kernel: oom_reaper: reaped process 31337 (pt_main_thread), now anon-rss:0kB, file-rss:0kB\n",
            "pt_main_thread",
        ),
        # Slurm's report of the kill, after the job's own last line
        (
            "step 40 loss 1.23\nslurmstepd: error: Detected 1 oom-kill event(s) in StepId=12345.0. Some of your "
            "processes may have been killed by the cgroup out-of-memory handler.\n",
            None,
        ),
        # Kubernetes' pod status
        ("    Last State:     Terminated\n      Reason:       OOMKilled\n      Exit Code:    137\n", None),
    ],
)
def test_kernel_oom_killer_is_host_oom(tmp_path, text, killed):
    c = first(tmp_path, text)
    assert c.kind == "oom_host" and c.severity == "error"
    if killed:
        assert killed in c.title


# ---- non-finite metrics named in sentences, and in columns no rule names ----------------------------------


@pytest.mark.parametrize(
    "line, metric",
    [
        ("(WorkerDict pid=1) WARN: grad_norm is not finite: nan\n", "grad_norm"),
        ("2025-01-01 12:00:00 WARNING loss is nan, skipping logging\n", "loss"),
        ("[rank0]: NaN detected in policy_loss at step 17\n", "policy_loss"),
        ("found inf in gradient norm\n", "gradient norm"),
        ("Warning: reward became -inf for 3 samples\n", "reward"),
    ],
)
def test_nonfinite_metric_in_a_sentence_names_it(tmp_path, line, metric):
    c = first(tmp_path, "step 1 ok\n" + line)
    assert c.kind == "nonfinite" and c.line == 2
    assert metric in (c.where or "") and metric in c.title


@pytest.mark.parametrize(
    "table",
    [
        # a reporter's markdown table, one run per column
        "| Step | run_a |\n|---|---|\n| 10 | 1.61 |\n| 11 | 1.51 |\n| 12 | NaN |\n",
        # a rich / box table
        "┃ step ┃ value_head ┃\n│ 1 │ 0.50 │\n│ 2 │ 0.40 │\n│ 3 │ nan │\n",
        # tabulate's plain grid
        "+------+--------+\n| step | critic |\n+======+========+\n| 1 | 3.2 |\n| 2 | inf |\n",
    ],
)
def test_column_that_turns_nonfinite_is_named(tmp_path, table):
    c = first(tmp_path, table)
    assert c.kind == "nonfinite"
    col = [w for w in ("run_a", "value_head", "critic") if w in table][0]
    assert c.where == col and col in c.title


def test_nonfinite_timing_columns_and_a_first_nan_stay_clean(tmp_path):
    # a throughput that is inf on the first step (no time elapsed) and a running average shown as (nan): no failure
    assert_healthy(
        tmp_path,
        "| step | tokens_per_sec | loss |\n|---|---|---|\n| 1 | inf | 2.1 |\n| 2 | 1200.5 | 2.0 |\n"
        "| 3 | inf | 1.9 |\n",
    )
    assert_healthy(tmp_path, "INFO Train: [0/300][4050/5004] loss 3.2572 (3.3279) grad_norm 1.0323 (nan)\n")


# ---- torch.compile failures told by where they were raised -------------------------------------------------

_SITE = "/usr/lib/python3.11/site-packages"


@pytest.mark.parametrize(
    "text",
    [
        # an AssertionError in Dynamo's variable tracker
        "Traceback (most recent call last):\n"
        f'  File "{_SITE}/torch/_dynamo/variables/builder.py", line 400, in wrap\n'
        "    assert isinstance(value, Foo)\nAssertionError: weird_type\n",
        # a KeyError inside an FX pass
        "Traceback (most recent call last):\n"
        f'  File "{_SITE}/torch/fx/passes/shape_prop.py", line 12, in run_node\n'
        "    return self.env[n]\nKeyError: 'add_3'\n",
        # a Triton compiler error
        "triton.compiler.errors.CompilationError: at 12:4: def kernel(x_ptr):\n",
        # Inductor's generated guard on a tensor's layout
        "AssertionError: expected size 64==64, stride 1==128 at dim=0\n",
        # an unfamiliar exception with Dynamo's trailer under it
        'ValueError: something odd happened\n\nSet TORCH_LOGS="+dynamo" and TORCHDYNAMO_VERBOSE=1 for more information\n',
    ],
)
def test_compile_failure_by_frames_and_trailers(tmp_path, text):
    c = first(tmp_path, text)
    assert c.kind == "compile_error"


def test_compile_culprit_is_the_traced_user_frame(tmp_path):
    text = (
        "Traceback (most recent call last):\n"
        f'  File "{_SITE}/torch/_dynamo/symbolic_convert.py", line 10, in step\n'
        "    self.dispatch(inst)\nAssertionError: builtin_function_or_method\n\nfrom user code:\n"
        '   File "/home/u/proj/mypkg/model.py", line 85, in forward\n'
        "    out = combine_parts(\n\nSet torch._dynamo.config.verbose=True for more information\n"
    )
    c = first(tmp_path, text)
    assert c.kind == "compile_error" and "mypkg/model.py:85" in c.where and "combine_parts" in c.where


def test_oom_inside_a_compiled_graph_stays_an_oom(tmp_path):
    text = (
        "Traceback (most recent call last):\n"
        f'  File "{_SITE}/torch/_inductor/output_code.py", line 10, in __call__\n'
        "    return self.current_callable(inputs)\n"
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of "
        "79.15 GiB of which 1.00 GiB is free.\n"
    )
    assert first(tmp_path, text).kind == "oom"


# ---- engine context limits -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "line, shown, flag",
    [
        (
            '{"object":"error","message":"The input (9000 tokens) is longer than the model\\\'s context length '
            '(8192 tokens).","type":"BadRequestError","param":null,"code":400}\n',
            "context_length",
            "--context-length",
        ),
        (
            "openai.BadRequestError: Error code: 400 - Requested token count exceeds the model's maximum context "
            "length of 4096 tokens. You requested a total of 5000 tokens\n",
            "context_length",
            "--context-length",
        ),
        (
            '{"error":"Input validation error: `inputs` tokens + `max_new_tokens` must be <= 4096. Given: 4000 '
            '`inputs` tokens and 200 `max_new_tokens`","error_type":"validation"}\n',
            "max_total_tokens",
            "--max-total-tokens",
        ),
        (
            "huggingface_hub.errors.ValidationError: Input validation error: `inputs` must have less than 1024 "
            "tokens. Given: 2000\n",
            "max_input_tokens",
            "--max-input-tokens",
        ),
    ],
)
def test_engine_context_limits_in_each_engines_words(tmp_path, line, shown, flag):
    c = first(tmp_path, line)
    assert c.kind == "engine_limit" and c.severity == "error"
    assert shown in c.where and any(flag in f.why for f in c.fixes)


def test_server_error_body_is_a_failure(tmp_path):
    c = first(
        tmp_path, '{"object":"error","message":"Something broke","type":"InternalServerError","code":500}\n'
    )
    assert c.severity == "error"


# ---- weight sync / refit failures in a trainer's words --------------------------------------------------


@pytest.mark.parametrize(
    "line",
    [
        "Updating weights for the generation policy failed during refit\n",
        "ERROR: Failed to update weights in the rollout engine: connection reset\n",
        "RuntimeError: weight sync failed on 3 of 8 workers\n",
        "Refit failed: timeout waiting for workers\n",
    ],
)
def test_weight_sync_failed_in_words(tmp_path, line):
    c = first(tmp_path, line)
    assert c.kind == "weight_sync" and c.phase == "weight_sync"


def test_vllm_config_not_set_names_its_fix(tmp_path):
    c = first(
        tmp_path,
        "Current vLLM config is not set.\nUpdating weights for the generation policy failed during refit\n",
    )
    assert c.kind == "weight_sync" and "set_current_vllm_config" in c.where
    assert any("set_current_vllm_config" in f.why for f in c.fixes)


def test_vllm_config_warning_alone_is_not_a_failure(tmp_path):
    assert_healthy(
        tmp_path, "WARNING 01-01 00:00:00 [config.py:10] Current vLLM config is not set.\nINFO ok\n"
    )


# ---- an exception pasted in a code span ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "line",
    [
        "`RuntimeError: Tensors of the same index must be on the same device and the same dtype`\n",
        "``ValueError: bad value``\n",
        "`KeyError: 'input_ids'`\n",
    ],
)
def test_exception_in_backticks_is_a_failure(tmp_path, line):
    c = first(tmp_path, line)
    assert c.severity == "error" and not c.title.endswith("`")


@pytest.mark.parametrize(
    "text",
    [
        "INFO 0 errors, 0 warnings\n",
        "WARNING weight update retried after a transient failure; weights updated\n",
        "```\nINFO step 1 loss 0.5\n```\n",
        '{"step": 3, "loss": 0.5, "error_rate": 0.0}\n',
    ],
)
def test_healthy_lines_stay_clean(tmp_path, text):
    assert_healthy(tmp_path, text)


# ---- failure lines without a traceback: never clean -----------------------------------------------------


@pytest.mark.parametrize(
    "line",
    [
        "Exception: the reward server returned nothing\n",
        "Error: CUDA driver version is insufficient for CUDA runtime version\n",
        "error: unrecognized arguments: --foo\n",
        "srun: error: node12: task 3: Exited with exit code 1\n",
        "CUDA error: device-side assert triggered\n",
        "train.sh: line 12:  4242 Bus error               (core dumped) python train.py\n",
        "Illegal instruction (core dumped)\n",
        "2024-01-01 12:00:00,123 - __main__ - ERROR - Training failed: boom\n",
        "2024-01-01 12:00:00.123 | ERROR    | trainer:step:42 - the rollout returned no samples\n",
        "2024-01-01 12:00:00 ERROR could not reach the reward model\n",
    ],
)
def test_failure_lines_without_a_traceback_are_never_clean(tmp_path, line):
    d = diagnose(tmp_path, "step 1 loss 0.5\n" + line)
    assert d.verdict != "clean" and any(c.severity == "error" and c.line == 2 for c in d.causes), d.causes


@pytest.mark.parametrize(
    "line",
    [
        "2024-01-01 12:00:00,123 - __main__ - INFO - 0 errors in 10 batches\n",
        "2024-01-01 12:00:00.123 | WARNING  | trainer:step:42 - error rate 0.0\n",
        "fatal: not a git repository (or any of the parent directories): .git\n",
        "error_count: 0\n",
        "Errors: none\n",
    ],
)
def test_benign_lines_naming_errors_stay_clean(tmp_path, line):
    assert_healthy(tmp_path, "step 1 loss 0.5\n" + line)


# ---- an engine's configuration check, told by its frames -------------------------------------------------

_VLLM = "/usr/lib/python3.10/site-packages/vllm"


@pytest.mark.parametrize(
    "text",
    [
        # the paste cut at the call into the check
        "Traceback (most recent call last):\n"
        f'  File "{_VLLM}/entrypoints/llm.py", line 242, in __init__\n'
        "    self.llm_engine = self.engine_class.from_engine_args(\n"
        f'  File "{_VLLM}/engine/llm_engine.py", line 481, in from_engine_args\n'
        "    engine_config = engine_args.create_engine_config(usage_context)\n",
        # a message no rule knows, raised in a config class's __post_init__
        "Traceback (most recent call last):\n"
        f'  File "{_VLLM}/config.py", line 900, in __post_init__\n'
        "    raise ValueError(msg)\nValueError: frobnication level 3 is out of range on this platform\n",
        # SGLang's server-argument check
        "Traceback (most recent call last):\n"
        '  File "/usr/lib/python3.10/site-packages/sglang/srt/server_args.py", line 300, in check_server_args\n'
        "    assert self.foo\nAssertionError: the bar option needs the baz backend\n",
    ],
)
def test_engine_configuration_check_is_an_engine_feature(tmp_path, text):
    c = first(tmp_path, text)
    assert c.kind == "engine_feature" and c.title.startswith("Engine refused its configuration")


# ---- culprits the lines name --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, named",
    [
        (
            "torch.matmul(feats, self.proj_weight)\nRuntimeError: expected mat1 and mat2 to have the same dtype, but "
            "got: float != c10::Half\n",
            "self.proj_weight",
        ),
        (
            "---> 12     out = self.head.linear(hidden, bias)\nRuntimeError: expected mat1 and mat2 to have the same "
            "dtype, but got: float != c10::BFloat16\n",
            "hidden, bias",
        ),
        (
            "    y = F.linear(x_in, w_q)\nRuntimeError: expected scalar type BFloat16 but found Float\n",
            "x_in, w_q",
        ),
    ],
)
def test_dtype_error_names_the_pasted_calls_operands(tmp_path, text, named):
    c = first(tmp_path, text)
    assert c.kind == "dtype_error" and named in c.where


@pytest.mark.parametrize("cls", ["CriticModelRayActor", "RewardWorker", "VllmGenerationWorker"])
def test_dead_ray_actor_is_named_by_its_class(tmp_path, cls):
    text = (
        "ray.exceptions.ActorDiedError: The actor died unexpectedly before finishing this task.\n"
        f"        class_name: {cls}\n        actor_id: 66075e4f\n        pid: 1234\n"
    )
    c = first(tmp_path, text)
    assert c.kind == "ray_actor_died" and cls in c.where and cls in c.title


@pytest.mark.parametrize(
    "line, how",
    [
        (
            "RuntimeError: unscale_() has already been called on this optimizer since the last update().\n",
            "once per",
        ),
        ("RuntimeError: step() has already been called since the last update().\n", "once per"),
        ("AssertionError: No inf checks were recorded for this optimizer.\n", "reaches the optimizer"),
    ],
)
def test_gradscaler_call_order(tmp_path, line, how):
    c = first(tmp_path, line)
    assert c.kind == "exception" and "GradScaler" in c.where and "scaler.update()" in c.fixes[0].why
    assert how in c.fixes[0].why


@pytest.mark.parametrize(
    "fn, forward, singular",
    [
        ("LogBackward0", "torch.log", True),
        ("SqrtBackward0", "torch.sqrt", True),
        ("LogSigmoidBackward0", "torch.nn.functional.logsigmoid", False),
        ("DivBackward0", "torch.div", True),
        ("SoftplusBackward0", "torch.softplus", False),
    ],
)
def test_anomaly_backward_is_named_with_its_forward_op(tmp_path, fn, forward, singular):
    c = first(tmp_path, f"RuntimeError: Function '{fn}' returned nan values in its 0th output.\n")
    assert c.kind == "nonfinite" and fn in c.where and forward in c.where
    assert ("derivative is infinite" in c.where) == singular


# ---- metrics in every shape: a non-finite loss / grad-norm / reward / KL names the metric and its role ------------


@pytest.mark.parametrize(
    "text, named",
    [
        # rich's two-column table
        (
            "┏━━━━━━━━━━━━━━┳━━━━━━━┓\n┃ metric       ┃ value ┃\n┡━━━━━━━━━━━━━━╇━━━━━━━┩\n│ train/loss   │ nan  │\n"
            "│ train/grad_norm │ 0.5 │\n└──────────────┴───────┘\n",
            "train/loss",
        ),
        # DeepSpeed-style progress lines
        ("steps: 10 loss: 2.3010 iter time (s): 0.512\nsteps: 20 loss: nan iter time (s): 0.511\n", "loss"),
        # per-rank prefixed key=value pairs with a role
        (
            "[rank3]: Epoch 1 | Iter 20 | critic/value_loss=nan | actor/pg_loss=0.12\n",
            "critic",
        ),
        # tabulate's grid with a role column
        (
            "+------+-------------+----------+\n| step | actor/loss  | reward   |\n+------+-------------+----------+\n"
            "| 1    | 0.51        | 0.10     |\n| 2    | nan         | 0.12     |\n",
            "actor",
        ),
        # two Ray processes interleaved, verl's step lines in one of them
        (
            "(TaskRunner pid=1) step:1 - actor/pg_loss:0.1 - critic/vf_loss:0.3\n(WorkerDict pid=2, ip=10.0.0.2) hi\n"
            "(TaskRunner pid=1) step:2 - actor/pg_loss:0.1 - critic/vf_loss:inf\n",
            "critic",
        ),
        # a KL in TRL's PPO dict
        ("Step 5: {'policy/approxkl': nan, 'objective/kl': 0.1}\n", "policy"),
        # JSON lines with a float step
        ('{"step": 1, "train/reward": 0.5}\n{"step": 2, "train/reward": NaN}\n', "train/reward"),
    ],
)
def test_nonfinite_metric_in_every_shape_names_it(tmp_path, text, named):
    c = first(tmp_path, text)
    assert c.kind in ("nonfinite", "collapse") and named in c.where
    assert ".0" not in c.title  # steps are integers


# ---- host OOM told by the process's own allocation ----------------------------------------------------------


@pytest.mark.parametrize(
    "line",
    [
        "RuntimeError: [enforce fail at alloc_cpu.cpp:83] data. DefaultCPUAllocator: not enough memory: you tried to "
        "allocate 34359738368 bytes.\n",
        "RuntimeError: DefaultCPUAllocator: can't allocate memory: you tried to allocate 8589934592 bytes. Error code "
        "12 (Cannot allocate memory)\n",
        "OSError: [Errno 12] Cannot allocate memory\n",
        "numpy.core._exceptions._ArrayMemoryError: Unable to allocate 12.0 GiB for an array with shape (3, 1073741824)\n",
        "MemoryError\n",
        "terminate called after throwing an instance of 'std::bad_alloc'\n  what():  std::bad_alloc\n",
    ],
)
def test_host_allocation_failure_is_host_oom(tmp_path, line):
    c = first(tmp_path, line)
    assert c.kind == "oom_host" and c.title.startswith("Host RAM exhausted")


def test_gpu_oom_in_other_words_stays_a_gpu_oom(tmp_path):
    assert first(tmp_path, "RuntimeError: CUDA error: out of memory\n").kind == "oom"
    text = "torch.OutOfMemoryError: HIP out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 191.98 GiB\n"
    assert first(tmp_path, text).kind == "oom"


# ---- a dataset too small for one batch / one optimizer step -------------------------------------------------

_TRAINER = (
    '  File "/usr/lib/python3/site-packages/transformers/trainer.py", line 2100, in _inner_training_loop\n'
)


@pytest.mark.parametrize(
    "text",
    [
        "ValueError: num_samples should be a positive integer value, but got num_samples=0\n",
        "Traceback (most recent call last):\n"
        + _TRAINER
        + "    num_update_steps_per_epoch = len_dataloader // args.gradient_accumulation_steps\n"
        "ZeroDivisionError: integer division or modulo by zero\n",
        "Traceback (most recent call last):\n"
        '  File "/usr/lib/python3/site-packages/transformers/optimization.py", line 90, in lr_lambda\n'
        "    return max(0.0, float(num_training_steps - current_step) / float(max(1, num_training_steps - w)))\n"
        "ZeroDivisionError: float division by zero\n",
        "ValueError: The training dataset is empty after filtering\n",
        "RuntimeError: batch_size (64) is larger than the number of samples (10)\n",
    ],
)
def test_dataset_too_small_for_a_step(tmp_path, text):
    c = first(tmp_path, text)
    assert c.kind == "exception" and c.title.startswith("The dataset is too small")
    assert any("gradient_accumulation_steps" in f.why for f in c.fixes)


def test_zero_division_in_user_code_is_not_a_dataset_size(tmp_path):
    text = (
        "Traceback (most recent call last):\n"
        '  File "/home/u/reward.py", line 10, in accuracy\n    return hits / total\n'
        "ZeroDivisionError: division by zero\n"
    )
    c = first(tmp_path, text)
    assert not c.title.startswith("The dataset is too small")


@pytest.mark.parametrize(
    "line, flag",
    [
        (
            "Not enough memory to handle 4096 prefill tokens. You need to decrease `--max-batch-prefill-tokens`\n",
            "--max-batch-prefill-tokens",
        ),
        (
            "RuntimeError: Not enough memory to handle 16000 total tokens with 4096 prefill tokens\n",
            "--max-batch-total-tokens",
        ),
    ],
)
def test_tgi_warmup_memory_is_a_kv_cache_budget(tmp_path, line, flag):
    c = first(tmp_path, line)
    assert c.kind == "oom_kv_cache" and c.where == flag


# ---- the model part a message names is the culprit --------------------------------------------------------


@pytest.mark.parametrize(
    "text, part",
    [
        (
            "RuntimeError: Error(s) in loading state_dict for Gemma3ForConditionalGeneration:\n\tsize mismatch for "
            "model.vision_tower.post_layernorm.weight: copying a param with shape torch.Size([1152]) from checkpoint, the "
            "shape in current model is torch.Size([1024]).\n",
            "model.vision_tower.post_layernorm.weight",
        ),
        (
            "RuntimeError: expected scalar type Float but found BFloat16\nThe above error occurred in module "
            "model.vision_tower.encoder.layers.0.mlp.fc1\n",
            "model.vision_tower.encoder.layers.0.mlp.fc1",
        ),
        (
            "ValueError: parameter language_model.layers.12.self_attn.q_proj.weight has no gradient\n",
            "language_model.layers.12.self_attn.q_proj.weight",
        ),
    ],
)
def test_model_part_named_by_the_message_is_the_culprit(tmp_path, text, part):
    c = first(tmp_path, text)
    assert part in c.where


def test_library_paths_are_not_model_parts(tmp_path):
    text = "ValueError: Unrecognized configuration class transformers.models.qwen3.configuration_qwen3.Qwen3Config\n"
    c = first(tmp_path, text)
    assert "configuration_qwen3" not in (c.where or "")


@pytest.mark.parametrize(
    "text",
    [
        "INFO 01-01 00:00:00 [async_llm.py:300] Aborted request cmpl-1234.\n",
        "WARNING Validation dataset is empty, skipping evaluation\n",
        "WARNING weight sync failed on attempt 1/3, retrying\nINFO weights synced\n",
        "Aborted request 17 by the client\n",
    ],
)
def test_benign_lines_near_new_families_stay_clean(tmp_path, text):
    assert_healthy(tmp_path, "step 1 loss 0.5\n" + text)


# ---- recovered errors: a traceback Python ignored, or one a retry loop logged before the run went on ---------

_TB = (
    "Traceback (most recent call last):\n"
    '  File "/usr/lib/python3/site-packages/requests/adapters.py", line 10, in send\n'
    "    raise ConnectionError(e)\n"
    "requests.exceptions.ConnectionError: Read timed out.\n"
)


@pytest.mark.parametrize(
    "text",
    [
        "step 1 loss 0.5\nWARNING:root:Request failed, retrying in 2s (attempt 1/5)\n"
        + _TB
        + "INFO:root:Request succeeded on attempt 2\nstep 2 loss 0.4\n",
        "step 1 loss 0.5\n" + _TB + "WARNING: will retry the reward call\nstep 2 loss 0.4\n",
        "step 1 loss 0.5\nException ignored in: <function _MultiProcessingDataLoaderIter.__del__ at 0x7f>\n"
        "Traceback (most recent call last):\n"
        '  File "/usr/lib/python3/site-packages/torch/utils/data/dataloader.py", line 1479, in __del__\n'
        "    self._shutdown_workers()\nAssertionError: can only test a child process\nstep 2 loss 0.4\n",
        "epoch 1 done\nfalling back to the slow tokenizer\n" + _TB + "epoch 2 done\n",
    ],
)
def test_recovered_tracebacks_stay_clean(tmp_path, text):
    assert_healthy(tmp_path, text)


@pytest.mark.parametrize(
    "text",
    [
        # the retries ran out: the log ends on the traceback
        "step 1 loss 0.5\nWARNING retrying (1/3)\n" + _TB + "WARNING retrying (2/3)\n" + _TB,
        # a retry note, but nothing went on after the failure
        "step 1 loss 0.5\nWARNING retrying (3/3)\n" + _TB + "Shutting down\n",
        # no retry note at all
        "step 1 loss 0.5\n" + _TB + "step 2 loss 0.4\n",
    ],
)
def test_unrecovered_tracebacks_still_fail(tmp_path, text):
    d = diagnose(tmp_path, text)
    assert d.verdict == "error", d.causes


@pytest.mark.parametrize(
    "line",
    [
        "make: *** [Makefile:12: train] Error 2\n",
        "*** Error in `python': double free or corruption (out): 0x00007f00deadbeef ***\n",
        "free(): invalid pointer\n",
        "!!!!!!! Segfault encountered !!!!!!!\n",
        "[launcher] FAILED: train.py (rank 0) exited with a non-zero code\n",
    ],
)
def test_native_crashes_and_failed_recipes_are_never_clean(tmp_path, line):
    d = diagnose(tmp_path, "step 1 loss 0.5\n" + line)
    assert d.verdict == "error", d.causes


def test_make_progress_and_plain_pointers_stay_clean(tmp_path):
    assert_healthy(
        tmp_path, "make[1]: Entering directory '/src'\nmake: Nothing to be done for 'all'.\nfreed 3 GiB\n"
    )
