"""Log rules for lines that state a failure without an exception the rules knew (issue 25): zero KV-cache
blocks at start, an engine worker's death its parent reports, vLLM's bf16 refusal over several lines, a
hard-wrapped NCCL watchdog line, torch.compile's own refusals, identical rewards in every GRPO group, a Ray
worker's native-crash report, Ray's OOM-kill trailer, an HTTP 404 from the trainer's server, a loader's layout
refusal, a Megatron iteration line without its loss, a WARNING-level import failure, an item over the token
budget, pytest's failure lines, a config echoed as assignments. Each rule with a planted line it catches and a
healthy near-miss it passes. Run: `pytest tests/test_log_statements.py`."""

from __future__ import annotations

from pathlib import Path

from verlaudit.analysis.diagnose.diagnosis import diagnose_path


def diagnose(tmp_path: Path, text: str):
    p = tmp_path / "train.log"
    p.write_text(text)
    (d,) = diagnose_path(p)
    return d


def problems(tmp_path: Path, text: str) -> list[tuple[str, str]]:
    return [
        (c.severity, c.kind) for c in diagnose(tmp_path, text).causes if c.severity in ("error", "warning")
    ]


def first(tmp_path: Path, text: str):
    d = diagnose(tmp_path, text)
    assert d.causes, d.summary
    return d.causes[0]


def test_zero_gpu_kv_blocks_at_start_is_a_kv_cache_failure_without_the_exception(tmp_path):
    for line in (
        "INFO 04-27 10:13:05 llm_engine.py:275] # GPU blocks: 0, # CPU blocks: 256\n",
        "INFO 02-26 09:54:05 executor_base.py:111] # cuda blocks: 0, # CPU blocks: 4681\n",
    ):
        c = first(tmp_path, line + "Traceback (most recent call last):\n")
        assert (c.severity, c.kind) == ("error", "oom_kv_cache"), c.title
        assert c.where and "gpu_memory_utilization" in c.where
    # a healthy start prints a positive block count (and zero CPU blocks is no failure)
    healthy = "INFO 04-27 10:13:05 llm_engine.py:275] # GPU blocks: 2427, # CPU blocks: 0\n"
    assert problems(tmp_path, healthy) == []


def test_an_engine_worker_death_its_parent_reports_is_an_engine_error(tmp_path):
    cases = {
        "ERROR 07-04 17:35:16 [multiproc_executor.py:140] Worker proc VllmWorker-1 died unexpectedly, "
        "shutting down executor.\n": "VllmWorker-1",
        "ERROR 03-21 10:00:00 multiproc_worker_utils.py:124] Worker VllmWorkerProcess pid 77 died, exit "
        "code: -15\n": "VllmWorkerProcess",
        "Message: 'Received sigquit from a child proces. It usually means the child failed.'\n": None,
    }
    for line, worker in cases.items():
        c = first(tmp_path, line)
        assert (c.severity, c.kind) == ("error", "engine_error"), c.title
        if worker:
            assert c.where == worker and worker in c.title
    # the children told to stop after a normal shutdown are not a death
    healthy = "(VllmWorker TP0 pid=405) INFO 08-25 12:24:19 [multiproc_executor.py:520] Parent process exited, terminating worker\n"
    assert problems(tmp_path, healthy) == []


def test_vllms_bf16_refusal_split_over_lines_names_the_gpu_and_its_capability(tmp_path):
    text = (
        "ValueError: Bfloat16 is only supported on GPUs with compute capability of at least 8.0.\n"
        "Your Tesla V100-SXM2-32GB GPU has compute capability 7.0. You can use float16 instead\n"
        "by explicitly setting the `dtype` flag in CLI, for example: --dtype=half.\n"
    )
    c = first(tmp_path, text)
    assert (c.severity, c.kind) == ("error", "dtype_unsupported")
    assert "Tesla V100-SXM2-32GB" in c.title and "7.0" in c.title
    # a bf16 run on a card that has it prints no refusal
    assert (
        problems(tmp_path, "INFO 04-27 10:11:03 llm_engine.py:70] dtype=torch.bfloat16, on NVIDIA A100\n")
        == []
    )


def test_torch_compiles_own_refusal_raised_as_a_plain_error_is_a_compile_error(tmp_path):
    text = (
        "RuntimeError: torch.compile with fullgraph=True found no compiled frames.\n"
        "Skipped frames: ... Dynamo tracing is disabled\n"
    )
    c = first(tmp_path, text)
    assert (c.severity, c.kind) == ("error", "compile_error"), c.title
    assert "TORCH_COMPILE_DISABLE" in c.where and any("TORCHDYNAMO_DISABLE=1" in f.why for f in c.fixes)
    # a compile failure of the traced code is not blamed on a disabled compiler
    other = first(
        tmp_path, "RuntimeError: torch.compile with fullgraph=True found a graph break in forward\n"
    )
    assert other.kind == "compile_error" and "DISABLE" not in (other.where or "")
    # a log line that only mentions torch.compile is not a failure
    assert problems(tmp_path, "INFO: using torch.compile with fullgraph=True for the actor\n") == []


def test_a_watchdog_timeout_hard_wrapped_by_the_paste_is_rejoined(tmp_path):
    text = (
        "[rank0]:[E1202 16:33:31.475880828 ProcessGroupNCCL.cpp:616] [Rank 0] Watchdog caught collective "
        "operation timeout: Wor\n"
        "kNCCL(SeqNum=140, OpType=ALLREDUCE, NumelIn=1, NumelOut=1, Timeout(ms)=1800000) ran for 1800093 "
        "milliseconds before ti\n"
        "ming out.\n"
    )
    c = first(tmp_path, text)
    assert (c.severity, c.kind) == ("error", "nccl_timeout"), c.title
    assert "ALLREDUCE" in c.title and "SeqNum 140" in c.title
    # the same wrap of a healthy NCCL line is no timeout
    healthy = (
        "[rank0]:[I1202 16:03:31.47 ProcessGroupNCCL.cpp:900] [Rank 0] ProcessGroupNCCL initialization opt\n"
        "ions: size: 8, global rank: 0, TIMEOUT(ms): 1800000\n"
    )
    assert problems(tmp_path, healthy) == []


def test_every_group_with_identical_rewards_is_no_learning_signal(tmp_path):
    rec = (
        "{'loss': 0.0, 'grad_norm': 0.0, 'learning_rate': 1.7e-06, 'rewards/format/std': 0.0, "
        "'rewards/accuracy/std': 5.08, 'reward': 3.0, 'reward_std': 0.0, 'frac_reward_zero_std': %s, "
        "'epoch': 0.33}\n"
    )
    c = first(tmp_path, rec % "1.0")
    assert c.kind == "collapse" and c.severity in ("warning", "error"), c.title
    assert c.where == "frac_reward_zero_std"
    three = "".join((rec % "1.0").replace("0.33", str(e)) for e in ("0.1", "0.2", "0.3"))
    assert first(tmp_path, three).severity == "error"
    # some groups with a spread: the advantages are not all 0
    healthy = (
        "{'loss': 0.012, 'grad_norm': 0.31, 'learning_rate': 1.7e-06, 'reward': 1.2, 'reward_std': 0.4, "
        "'frac_reward_zero_std': 0.39, 'epoch': 0.33}\n"
    )
    assert problems(tmp_path, healthy) == []


def test_a_native_crash_a_ray_worker_reports_is_its_death_with_the_faulting_function(tmp_path):
    w = "(RayWorkerWrapper pid=24036) "
    text = (
        w + "[2024-07-25 10:46:00,050 E 24036 24036] logging.cc:440: *** SIGSEGV received at time=1721904360 "
        "on cpu 140 ***\n"
        + w + "[2024-07-25 10:46:00,050 E 24036 24036] logging.cc:440: PC: @     0x7f17f832d44a  (unknown)  "
        "addProxyOpIfNeeded()\n"
        + w + "Fatal Python error: Segmentation fault\n"
        + w + "\n"
        + w + "Stack (most recent call first):\n"
        + w + '  File "/usr/lib/python3/dist-packages/vllm/distributed/pynccl_wrapper.py", line 257 in '
        "ncclAllReduce\n"
    )  # fmt: skip
    c = first(tmp_path, text)
    assert (c.severity, c.kind) == ("error", "ray_actor_died"), c.title
    assert (
        "SIGSEGV" in c.title and "pynccl_wrapper.ncclAllReduce" in c.where and "addProxyOpIfNeeded" in c.where
    )
    # a Ray worker that mentions segfaults in a healthy line is no crash
    healthy = w + "INFO worker.py:12 -- faulthandler enabled; SIGSEGV handler installed\n"
    assert problems(tmp_path, healthy) == []


def test_the_ray_oom_kill_trailer_and_its_table_alone_are_a_host_oom(tmp_path):
    a = "(ActorModelRayActor pid=8249) "
    text = (
        a + "8800\t1.18\tray::ReferenceModelRayActor\n"
        + a + "8798\t1.17\tray::ReferenceModelRayActor\n"
        + a + "Refer to the documentation on how to address the out of memory issue: "
        "https://docs.ray.io/en/latest/ray-core/scheduling/ray-oom-prevention.html. Consider provisioning more "
        "memory on this node or reducing task parallelism by requesting more CPUs per task.\n"
    )  # fmt: skip
    c = first(tmp_path, text)
    assert (c.severity, c.kind) == ("error", "oom_host"), c.title
    assert c.where == "ReferenceModelRayActor"
    # a process table printed by a healthy status command is no kill
    healthy = a + "8800\t1.18\tray::ReferenceModelRayActor\n" + a + "INFO: memory usage is fine\n"
    assert problems(tmp_path, healthy) == []


def test_an_http_404_from_the_trainers_call_into_its_server_is_a_missing_engine_feature(tmp_path):
    tb = (
        "Traceback (most recent call last):\n"
        '  File "/env/lib/python3.11/site-packages/trl/extras/vllm_client.py", line 233, in init_communicator\n'
        '    raise Exception(f"Request failed: {response.status_code}, {response.text}")\n'
    )
    for exc, path in (
        (
            'Exception: Request failed: 404, {"detail":"Not Found"}\n',
            None,
        ),
        (
            "requests.exceptions.HTTPError: 404 Client Error: Not Found for url: http://10.0.0.2:8000/update_named_param/\n",
            "/update_named_param/",
        ),
    ):
        c = first(tmp_path, tb + exc)
        assert (c.severity, c.kind) == ("error", "engine_feature"), c.title
        assert "init_communicator" in c.where and c.phase == "weight_sync"
        if path:
            assert path in c.where
    # a server's own access log of a 404 (a browser asking for an icon) is no failure of the run
    healthy = 'INFO:     127.0.0.1:48802 - "GET /favicon.ico HTTP/1.1" 404 Not Found\n'
    assert problems(tmp_path, healthy) == []


def test_an_engine_loaders_layout_refusal_is_a_weight_sync_failure_unless_it_is_the_first_load(tmp_path):
    line = "ValueError: shard_dim=0 is not a valid data dimension for a 3D tensor (expected 1 or 2)\n"
    c = first(tmp_path, line)
    assert (c.severity, c.kind) == ("error", "weight_sync"), c.title
    assert c.phase == "weight_sync"
    # the same refusal while the engine loads its checkpoint at start is the model's layout, not the sync's
    at_load = (
        "Traceback (most recent call last):\n"
        '  File "/env/lib/python3.12/site-packages/vllm/v1/worker/gpu_model_runner.py", line 1, in load_model\n'
        "    self.model = get_model(vllm_config=self.vllm_config)\n"
        '  File "/env/lib/python3.12/site-packages/vllm/model_executor/layers/fused_moe/layer.py", line 9, in '
        "_load_w13\n"
        "    raise ValueError(msg)\n" + line
    )
    assert ("error", "weight_sync") not in problems(tmp_path, at_load)


def _megatron(loss: str, skipped: int) -> str:
    return (
        f" iteration        9/      10 | consumed samples:          108 | elapsed time per iteration (ms): 1979.2 "
        f"| learning rate: 4.219E-07 | global batch size:    12 |{loss} loss scale: 1.0 | number of skipped "
        f"iterations:   {skipped} | number of nan iterations:   0 | samples per second: 6.063 |\n"
    )


def test_a_megatron_iteration_line_without_its_loss_is_a_nan_loss(tmp_path):
    c = first(tmp_path, _megatron("", 0))
    assert (c.severity, c.kind) == ("error", "nonfinite"), c.title
    assert any("prints no loss" in e for e in c.evidence)
    # the same line with its loss is healthy; an iteration fp16 skipped adds nothing to the average either
    assert problems(tmp_path, _megatron(" lm loss: 2.104E+00 |", 0)) == []
    assert ("error", "nonfinite") not in problems(tmp_path, _megatron("", 1))


def test_an_import_failure_a_library_logs_as_a_warning_does_not_outrank_the_error_that_ended_the_run(
    tmp_path,
):
    warn = (
        "WARNING 08-27 13:59:59 _custom_ops.py:15] Failed to import from vllm._C with ImportError('libcudart.so.12: "
        "cannot open shared object file: No such file or directory')\n"
    )
    alone = diagnose(tmp_path, warn).causes
    assert [(c.severity, c.kind) for c in alone] == [("warning", "import_error")]
    fatal = "ValueError: Bfloat16 is only supported on GPUs with compute capability of at least 8.0. Your Tesla V100 GPU has compute capability 7.0.\n"
    assert first(tmp_path, warn + fatal).kind == "dtype_unsupported"
    # the same failure raised (in a traceback) is the run's error
    raised = (
        "Traceback (most recent call last):\n"
        '  File "/env/lib/python3.10/site-packages/vllm/_custom_ops.py", line 15, in <module>\n'
        "    import vllm._C\n"
        "ImportError: libcudart.so.12: cannot open shared object file: No such file or directory\n"
    )
    assert (first(tmp_path, raised).severity, first(tmp_path, raised).kind) == ("error", "import_error")


def test_an_item_larger_than_the_per_step_token_budget_is_an_engine_limit(tmp_path):
    line = (
        "ValueError: Chunked MM input disabled but max_tokens_per_mm_item (2496) is larger than "
        "max_num_batched_tokens (2048). Please increase max_num_batched_tokens.\n"
    )
    c = first(tmp_path, line)
    assert (c.severity, c.kind) == ("error", "engine_limit"), c.title
    assert "2496-token multimodal item" in c.title and "max_num_batched_tokens" in c.where
    # the budget printed in the engine's config line is no limit hit
    assert (
        problems(
            tmp_path, "INFO 04-27 10:11:03 config.py:1] max_num_batched_tokens=2048, max_model_len=2048\n"
        )
        == []
    )


def test_a_pytest_failure_line_is_a_failure_not_a_clean_log(tmp_path):
    text = "  assert st_main_score - vllm_main_score < atol\n  E       AssertionError\n"
    # (a tolerance in the asserted expression makes it a comparison with a reference: logs.outputs)
    assert ("error", "mismatch") in problems(tmp_path, text)
    assert ("error", "exception") in problems(
        tmp_path, "  assert len(rows) == n_rows\n  E       AssertionError\n"
    )
    # a line that only starts with the letter E is no pytest failure
    assert problems(tmp_path, "Epoch 3: loss 0.41\nE stands for epoch in this table\n") == []


def test_a_config_echoed_as_assignments_names_the_setting_that_asked_for_bf16(tmp_path):
    text = 'save_precision = "bf16"\nmixed_precision = "bf16"\nbf16 mixed precision requires PyTorch >= 1.10 and a supported device.\n'
    c = first(tmp_path, text)
    assert c.kind == "dtype_unsupported" and "mixed_precision=bf16" in c.where
    # an indented source line of a traceback is code, not a setting
    code = '    mixed_precision = "bf16"\nbf16 mixed precision requires PyTorch >= 1.10 and a supported device.\n'
    assert "mixed_precision" not in (first(tmp_path, code).where or "")
