"""The log rule families (verlaudit/analysis/logs): each new rule on the real-log fixture that covers it,
then on lines written in the frameworks' own message formats (the wording each module's docstring
cites), the line reader (prefixes, frames, failure signals), phases from frames, the framework and its
settings, fixes spelled per framework and never one the log shows already applied, root before
cascade across ranks, "never clean on a failure", and the scan's bounded memory.
Run: `pytest tests/test_log_rules.py`."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from benchmarks.diagnose_corpus import FIXTURES, read_fixture
from trainer.events import PHASES as TRAINER_PHASES
from verlaudit.analysis.diagnose.diagnosis import diagnose_path
from verlaudit.analysis.logs import frameworks, new_scan
from verlaudit.analysis.logs.frameworks import LogContext, applied, fix
from verlaudit.analysis.logs.lines import Frame, failure_signal, parse_frame, parse_line
from verlaudit.analysis.logs.phases import (
    PHASES,
    TABLE,
    log_phase,
    phase_of_frames,
    phase_of_name,
    trainer_phase,
)
from verlaudit.analysis.logs.scan import KEEP, MAX_SETTINGS, MAX_TRACEBACKS
from verlaudit.commands.diagnose import main, render_text


def diagnose_text(tmp_path: Path, text: str):
    p = tmp_path / "train.log"
    p.write_text(text)
    (d,) = diagnose_path(p)
    return d


def fix_text(cause) -> str:
    return " | ".join(f"{f.suite} {f.verl} {f.key} {f.why}" for f in cause.fixes)


# ---- each new rule on the corpus fixture that covers it: (kind, culprit substring, phase)
RULE_FIXTURES = {
    # distributed: NCCL / Gloo / store timeouts, kills, Ray deaths, CUDA faults
    "hf-trainer_nccl_timeout_ranks_diverged_seqnum": ("nccl_timeout", "rank 0", None),
    "verl_nccl_timeout_init_slurm": ("nccl_timeout", "rank 1", "init"),
    "trl_nccl_timeout_grpo_broadcast_wrapped": ("nccl_timeout", "rank 1", None),
    "openrlhf_nccl_timeout_make_experience_allgather": ("nccl_timeout", "rank 1", "logprob"),
    "trl_gloo_timeout_monitored_barrier_rank0": ("nccl_timeout", "rank 0", None),
    "verl_nccl_timeout_megatron_sglang_second_rollout": ("nccl_timeout", "rank 3", None),
    "accelerate_sigkill_rank2_loading_33b": ("killed", "local_rank 2", "init"),
    "pytorch_sigkill_rank3_colossal_sft": ("killed", "local_rank 3", None),
    "verl_ray_actor_died_generate_sequences_loop": ("ray_actor_died", "WorkerDict_0:1", "generate"),
    "verl_ray_actor_died_sglang_wake_up": ("ray_actor_died", "AsyncSglangServer.wake_up", "weight_sync"),
    "openrlhf_ray_actor_died_watchdog_stuck": ("ray_actor_died", "ActorModelRayActor.fit", None),
    "hf-trainer_nccl_watchdog_cuda_error_grpo_llava": ("cuda_error", "rank 2", None),
    "hf-trainer_nccl_error_shm_no_space": ("nccl_error", "/dev/shm", None),
    "deepspeed_sigkill_launcher_return_code": ("killed", None, None),
    # memory: CUDA vs host OOM, KV cache
    "verl_oom_compute_log_prob_entropy": ("oom", "entropy_from_logits", "logprob"),
    "nemo-rl_oom_get_logprobs_ppo_default": ("oom", "DTensorPolicyWorkerV2.get_logprobs", "logprob"),
    "vllm_wake_up_oom_cumem": ("oom", "cumem_allocator", "weight_sync"),
    "openrlhf_raylet_oom_model_load": ("oom_host", "ActorModelRayActor", "init"),
    "verl_raylet_oom_after_checkpoint": ("oom_host", None, "checkpoint"),
    "verl_raylet_oom_compute_log_probs": ("oom_host", None, "logprob"),
    "vllm_kv_cache_no_blocks_qwen05b": ("oom_kv_cache", "gpu_memory_utilization", "init"),
    "vllm_kv_cache_max_model_len_qwen7b": ("oom_kv_cache", "max_model_len", "init"),
    "openrlhf_vllm_kv_cache_initialize_cache_70b": ("oom_kv_cache", "max_model_len", "init"),
    "vllm_kv_cache_free_memory_below_utilization": ("oom_kv_cache", "gpu_memory_utilization", "init"),
    "sglang_kv_cache_mem_fraction_static": ("oom_kv_cache", "--mem-fraction-static", "init"),
    # engines: bf16 on old GPUs, engine errors, weight sync
    "vllm_bf16_unsupported_v100": ("dtype_unsupported", "compute capability 7.0", "init"),
    "hf-trainer_bf16_unsupported_v100": ("dtype_unsupported", "bf16", "init"),
    "sglang_alloc_req_slots_out_of_memory": ("engine_error", "--max-running-requests", "generate"),
    "sglang_illegal_memory_access_multiturn": ("engine_error", None, "generate"),
    "verl_weight_sync_lora_keyerror_base_layer": ("weight_sync", "base_layer.weight", "weight_sync"),
    "verl_weight_sync_megatron_lora_embed_keyerror": ("weight_sync", "embed_tokens.weight", "weight_sync"),
    "nemo-rl_weight_sync_moe_refit_shard_dim": ("weight_sync", "update_weights_via_ipc_zmq", "weight_sync"),
    # scaling: GradScaler, DeepSpeed loss scale
    "accelerate_unscale_fp16_clip_grad_norm": ("unscale_fp16", "accelerator.clip_grad_norm_", "update"),
    "hf-trainer_unscale_fp16_llama13b_v100": ("unscale_fp16", None, "update"),
    "deepspeed_loss_scale_collapse_llama_pt": ("loss_scale_collapse", None, "update"),
    "deepspeed_overflow_trlx_ppo": ("overflow_skips", None, "update"),
    # exceptions: imports, JSON records (non-finite), dtype under a generate frame
    "trl_import_error_flash_attn_verifiers": ("import_error", "flash_attn", "init"),
    "trl_import_error_gkd_trainer_flash_attn": ("import_error", "flash_attn", "init"),
    "openrlhf_import_error_vllm_ray_runtime_env": ("import_error", "vllm", "init"),
    "hf-trainer_nonfinite_json_records_step8280": ("nonfinite", None, "update"),
    "verl_nonfinite_critic_vf_loss_step1": ("nonfinite", "critic", "update"),
    "pytorch_dtype_ppo_rollout_generate_lora": ("dtype_error", "base_model.generate", "generate"),
    "verl_exception_param_offload_device_assert": ("exception", "compute_log_prob", "logprob"),
    "trl_config_num_generations_divisible": ("exception", "num_generations", "init"),
    "deepspeed_config_batch_size_world_size": ("exception", "train_batch_size", "init"),
}


@pytest.mark.parametrize("name", sorted(RULE_FIXTURES))
def test_rule_on_its_fixture(tmp_path: Path, name: str) -> None:
    kind, culprit, phase = RULE_FIXTURES[name]
    d = diagnose_text(tmp_path, read_fixture(FIXTURES / f"{name}.log").body)
    c = d.causes[0]
    assert d.verdict in ("error", "warning") and c.kind == kind, (c.kind, c.title)
    if culprit:
        assert culprit in f"{c.where} {c.title}", (c.where, c.title)
    if phase:
        assert c.phase == phase, (c.phase, c.evidence)


# ---- the line reader
@pytest.mark.parametrize(
    "raw, text, rank, source",
    [
        (
            "(WorkerDict pid=7591) [rank0]:[E325 04:13:11.3 ProcessGroupNCCL.cpp:760] x",
            "[E325 04:13:11.3 Process",
            0,
            "WorkerDict",
        ),
        (
            "\x1b[36m(RayWorkerWrapper pid=2617116, ip=10.66.4.71)\x1b[0m Error: boom",
            "Error: boom",
            None,
            "RayWorkerWrapper",
        ),
        (
            "[36m(VllmGenerationWorker pid=1, ip=10.0.0.1)[0m Error: boom",
            "Error: boom",
            None,
            "VllmGenerationWorker",
        ),
        ("[rank-6]: Saving model to /ckpt", "Saving model to /ckpt", 6, None),
        (
            "2024-06-28T06:11:52.685Z (LLMRayActor pid=20770) INFO 06-28 x",
            "INFO 06-28 x",
            None,
            "LLMRayActor",
        ),
        # vLLM's own logger prefix goes too (its level is kept): the message is what the rules read
        ("vllm-1  | ERROR 11-18 18:07:28 engine.py:366] ValueError: x", "ValueError: x", None, None),
        ("[2024-08-21 03:38:02] [rank7]:[E ProcessGroupNCCL.cpp:563] x", "[E ProcessGroupNCCL", 7, None),
        ("> [default3]: RuntimeError: x", "RuntimeError: x", 3, None),
        (
            "  2%|▏   | 13/620 [01:07<50:20,  4.98s/it][rank0]:[E1123 00:52:57.6 P.cpp:607] x",
            "[E1123",
            0,
            None,
        ),
        (
            "(raylet) [2025-03-01 16:18:15,116 E 2687 2687] (raylet) node_manager.cc:3069: 2 Workers",
            "node_manager",
            None,
            "raylet",
        ),
    ],
)
def test_prefixes_are_stripped_and_remembered(
    raw: str, text: str, rank: int | None, source: str | None
) -> None:
    line = parse_line(1, raw)
    assert text in line.text and (line.rank, line.source) == (rank, source)


def test_frames_and_the_call_they_make() -> None:
    f = parse_frame('  File "/verl/verl/workers/fsdp_workers.py", line 782, in compute_log_prob')
    assert (f.path, f.lineno, f.func, f.library) == (
        "/verl/verl/workers/fsdp_workers.py",
        782,
        "compute_log_prob",
        False,
    )
    clipped = parse_frame(
        'LLaMA-Efficient-Tuning/src/llmtuner/tuner/ppo/trainer.py", line 173, in get_inputs'
    )
    assert clipped.func == "get_inputs"
    flight = parse_frame(
        "#0 all_reduce from /usr/lib/python3.12/site-packages/torch/distributed/distributed_c10d.py:3174"
    )
    assert flight.func == "all_reduce" and flight.library
    # the call of an assignment (annotated or not), of a return, of a bare call
    assert Frame(
        "x.py", 1, "get_inputs", "response: torch.Tensor = unwrapped_model.generate(**b)"
    ).call() == ("unwrapped_model.generate")
    assert (
        Frame("x.py", 1, "fit", "old = self.wg.compute_log_prob(batch)").call() == "self.wg.compute_log_prob"
    )
    assert Frame("x.py", 1, "f", "return executor(*args, **kwargs)").call() == "executor"
    assert (
        Frame("x.py", 1, "main", "accelerator.clip_grad_norm_(p, 1.0)").where()
        == "main: accelerator.clip_grad_norm_"
    )
    assert Frame("x.py", 1, "step", "x == y(z)").call() == "y"


@pytest.mark.parametrize(
    "raw, signal",
    [
        ("ValueError: Attempting to unscale FP16 gradients.", "exception"),
        ("ray.exceptions.RayTaskError(AssertionError): ray::main_task() (pid=1)", "exception"),
        ("torch.distributed.DistBackendError: [7] is setting up NCCL communicator", "exception"),
        ("Killed", "kill"),
        ("traceback : Signal 9 (SIGKILL) received by PID 812917", "kill"),
        ("Status message: Job entrypoint command failed with exit code 1, last available logs", "exit"),
        ("subprocess.CalledProcessError: Command '['python']' returned non-zero exit status 1.", "exception"),
        ("Process finished with exit code 2", "exit"),
        (
            "[Rank 0] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=1, OpType=ALLREDUCE)",
            "hang",
        ),
        ("ERROR 11-18 18:07:28 engine.py:366] something", "error"),
        ("[E1206 18:44:16.99 ProcessGroupNCCL.cpp:621] [Rank 0] Some NCCL operations have failed", "error"),
        # not failures: warnings, INFO advice that mentions errors, a retried download, exit code 0
        ("/x/checkpoint.py:1399: FutureWarning: `torch.cpu.amp.autocast(args...)` is deprecated.", None),
        ("UserWarning: torch.utils.checkpoint: please pass in use_reentrant=True", None),
        (
            "INFO 02-11 10:17:57 [model_runner.py:1513] If out-of-memory error occurs during cudagraph "
            "capture",
            None,
        ),
        (
            "Exception raised from checkTimeout at ../torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:525",
            None,
        ),
        ("Request to huggingface.co timed out, retrying in 1s (1/5)", None),
        ("Process finished with exit code 0", None),
        ("W1026 03:51:31.222000 2521679 api.py:908] Sending process 2521733 closing signal SIGTERM", None),
    ],
)
def test_failure_signals(raw: str, signal: str | None) -> None:
    assert failure_signal(parse_line(1, raw)) == signal


# ---- phases from frames
def _frames(*funcs: str) -> list[Frame]:
    return [Frame("/app/x.py", i, f) for i, f in enumerate(funcs)]


@pytest.mark.parametrize(
    "funcs, phase",
    [
        (("fit", "compute_log_prob", "_forward_micro_batch", "entropy_from_logits"), "logprob"),
        # the reference pass calls the actor's compute_log_prob: the outer reference wins
        (("fit", "compute_ref_log_prob", "compute_log_prob"), "reference"),
        # log-probs inside the loss are the update's forward, with gradients
        (("training_step", "compute_loss", "_compute_loss", "_get_per_token_logps"), "update"),
        # TRL's old log-probs under _prepare_inputs (no gradients) are the log-prob pass
        (
            ("training_step", "_prepare_inputs", "_generate_and_score_completions", "_get_per_token_logps"),
            "logprob",
        ),
        (("generate_sequences", "__enter__", "update_params", "load_weights"), "weight_sync"),
        (("fit", "generate_sequences_loop"), "generate"),
        (("train", "_save_checkpoint", "save_model"), "checkpoint"),
        (("init_workers", "init_model", "from_pretrained"), "init"),
        (("fit", "_forward_micro_batch"), None),
    ],
)
def test_phase_of_frames(funcs: tuple[str, ...], phase: str | None) -> None:
    found = phase_of_frames(_frames(*funcs))
    assert (found[0] if found else None) == phase


def test_one_table_maps_the_trainers_phases_and_the_logs_onto_each_other() -> None:
    # every phase of both vocabularies is in the table, and each trainer phase a log can show comes back
    assert {t for t, _ in TABLE} - {None} == set(TRAINER_PHASES)
    assert {lp for _, lp in TABLE} - {None} == set(PHASES)
    for t in TRAINER_PHASES:
        assert (
            log_phase(t) is None
            or trainer_phase(log_phase(t), ["run", "update_critic"] if "critic" in t else ()) == t
        )
    assert (trainer_phase("logprob"), trainer_phase("generate"), trainer_phase("init")) == (
        "actor_update",
        "rollout",
        None,
    )
    # our own trainer's frames (trainer/ppo.py) name the same phases as verl's
    assert phase_of_frames(_frames("run", "update_actor", "actor_logprobs")) == ("update", "update_actor")
    assert phase_of_frames(_frames("run", "actor_logprobs"))[0] == "logprob"
    assert phase_of_frames(_frames("run", "reference_logprobs", "actor_logprobs"))[0] == "reference"
    assert phase_of_frames(_frames("run", "critic_values"))[0] == "values"


def test_phase_of_name_reads_suffixed_and_dotted_names() -> None:
    assert phase_of_name("self.actor_rollout_wg.compute_log_prob") == "logprob"
    assert phase_of_name("update_weights_via_ipc_zmq") == "weight_sync"
    assert phase_of_name("init_model_from_pretrained") == "init"
    assert phase_of_name("__init__") is None and phase_of_name("_forward_micro_batch") is None


# ---- frameworks: markers, settings, the fix vocabulary
def test_framework_priority_and_settings() -> None:
    scan = new_scan()
    lines = [
        "python3 -m verl.trainer.main_ppo "
        "actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype=bf16 "
        "actor_rollout_ref.rollout.gpu_memory_utilization=0.6 --foo-bar 3",
        "(WorkerDict pid=1) INFO 01-30 03:18:12 gpu_model_runner.py:848] Loading model weights took 67.7 GB",
        "TrainingArguments(bf16=True, gradient_checkpointing=False, per_device_train_batch_size=4,",
        "  fp16_enabled ................. False",
    ]
    for i, line in enumerate(lines, 1):
        scan.feed(i, line)
    facts = scan.facts()
    ctx = frameworks.context(facts.markers, facts.settings)
    assert ctx.framework == "verl" and {"vllm", "hf-trainer"} <= ctx.components  # verl outranks the engine
    assert ctx.setting("param_dtype") == "bf16" and ctx.setting("gpu_memory_utilization") == "0.6"
    assert ctx.setting("foo_bar") == "3" and ctx.setting("fp16_enabled") == "False"
    assert ctx.is_true("bf16") and not ctx.is_true("gradient_checkpointing")


def test_fixes_are_spelled_in_the_log_framework_and_never_one_already_applied() -> None:
    verl = LogContext("verl")
    assert (
        fix("grad_checkpointing", verl, "w").verl
        == "actor_rollout_ref.model.enable_gradient_checkpointing=True"
    )
    trl = LogContext("trl", frozenset({"trl", "deepspeed"}))
    f = fix("grad_checkpointing", trl, "w")
    assert f.verl is None and (f.framework, f.key) == ("trl", "TrainingArguments.gradient_checkpointing=True")
    # OpenRLHF has no ZeRO-offload of parameters by flag, DeepSpeed does: the component's key
    ds = fix("param_offload", LogContext("openrlhf", frozenset({"openrlhf", "deepspeed"})), "w")
    assert (ds.framework, ds.key) == ("deepspeed", "zero_optimization.offload_param.device=cpu")
    # already set in the log: not proposed
    printed = {
        "actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype": "bf16",
        "actor_rollout_ref.model.enable_gradient_checkpointing": "True",
    }
    ctx = LogContext("verl", frozenset({"verl"}), printed)
    assert applied("bf16_instead_of_fp16", ctx) and fix("bf16_instead_of_fp16", ctx, "w") is None
    assert fix("grad_checkpointing", ctx, "w") is None
    # a framework with no such setting and no component that has one: the remedy named, no key
    plain = fix("grad_checkpointing", LogContext("ray"), "activation memory")
    assert plain.key is None and plain.verl is None and "gradient checkpointing" in plain.why


# ---- distributed: ranks, root before cascade
NCCL = ("[rank{r}]:[E1206 18:44:12.7 ProcessGroupNCCL.cpp:607] [Rank {r}] Watchdog caught collective "
        "operation timeout: "
        "WorkNCCL(SeqNum={s}, OpType=ALLREDUCE, NumelIn=1, NumelOut=1, Timeout(ms)=600000) ran for 600017 "
        "milliseconds before timing out.")  # fmt: skip
OOM_LINE = ("[rank3]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 3 has a "
            "total "
            "capacity of 79.15 GiB of which 1.23 GiB is free. Including non-PyTorch memory, this process "
            "has 77.91 "
            "GiB memory in use.")  # fmt: skip


def test_the_rank_that_died_first_is_the_root_and_the_timeouts_its_cascade(tmp_path: Path) -> None:
    text = "\n".join(
        [
            "[rank3]: Traceback (most recent call last):",
            '[rank3]:   File "/app/verl/workers/actor/dp_actor.py", line 380, in update_policy',
            "[rank3]:     loss.backward()",
            OOM_LINE,
            *(NCCL.format(r=r, s=812) for r in (0, 1, 2)),
        ]
    )
    d = diagnose_text(tmp_path, text)
    root, cascade = d.causes[0], d.causes[1]
    assert (root.kind, root.rank, root.phase) == ("oom", 3, "update")
    assert cascade.kind == "nccl_timeout" and "3 ranks timed out (0, 1, 2)" in " ".join(cascade.evidence)
    assert any("likely a consequence of: CUDA out of memory" in e and "rank 3" in e for e in cascade.evidence)


def test_ranks_in_different_collectives_name_the_one_behind(tmp_path: Path) -> None:
    text = "\n".join([NCCL.format(r=1, s=1517), NCCL.format(r=0, s=1516), NCCL.format(r=2, s=1517)])
    c = diagnose_text(tmp_path, text).causes[0]
    assert c.where == "rank 0" and c.rank == 0  # rank 0 is still in 1516; 1 and 2 moved on to 1517
    assert "make every rank issue the same collectives" in fix_text(c)


def test_phase_of_a_collective_from_its_place_in_the_sequence_and_its_kind(tmp_path: Path) -> None:
    early = diagnose_text(tmp_path, NCCL.format(r=1, s=4)).causes[0]
    assert early.phase == "init" and "at start-up" in early.title  # one of the group's first collectives
    rs = NCCL.format(r=0, s=7753).replace("OpType=ALLREDUCE", "OpType=_REDUCE_SCATTER_BASE")
    assert diagnose_text(tmp_path, rs).causes[0].phase == "update"  # FSDP / ZeRO reduce gradients that way
    assert diagnose_text(tmp_path, NCCL.format(r=0, s=812)).causes[0].phase is None  # an all-reduce: not said


def test_the_rank_a_barrier_or_the_store_waited_for(tmp_path: Path) -> None:
    barrier = "RuntimeError: [Rank 0]: Ranks 4, 5, 6, 7 failed to pass monitoredBarrier in 2000000 ms"
    assert diagnose_text(tmp_path, barrier).causes[0].where == "rank 4"
    store = (
        "torch.distributed.DistBackendError: [7] is setting up NCCL communicator and retrieving "
        "ncclUniqueId from "
        "[0] via c10d key-value store by key '0', but store->get('0') got error: wait timeout after "
        "600000ms, keys: "
        "//worker/attempt_0/default_pg/0//cuda//0"
    )
    c = diagnose_text(tmp_path, store).causes[0]
    assert (c.kind, c.where, c.phase) == ("nccl_timeout", "rank 0", "init")
    gloo = (
        "RuntimeError: [../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting "
        "1800000ms for recv operation to complete"
    )
    assert diagnose_text(tmp_path, gloo).causes[0].kind == "nccl_timeout"


def test_nccl_error_and_the_checkpoint_timeout_advice(tmp_path: Path) -> None:
    err = (
        "torch.distributed.DistBackendError: NCCL error in: "
        "../torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:1970, "
        "unhandled system error (run with NCCL_DEBUG=INFO for details), NCCL version 2.19.3"
    )
    c = diagnose_text(tmp_path, err).causes[0]
    assert c.kind == "nccl_error" and "unhandled system error" in c.title
    save = "\n".join(
        [
            "[rank0]: Traceback (most recent call last):",
            '[rank0]:   File "/x/transformers/trainer.py", line 2511, in _save_checkpoint',
            '[rank0]:   File "/x/transformers/trainer.py", line 3000, in save_model',
            NCCL.format(r=0, s=98947),
        ]
    )
    c = diagnose_text(tmp_path, save).causes[0]
    assert (
        c.phase == "checkpoint" and "ddp_timeout" in c.fixes[0].key
    )  # a checkpoint save is a legitimate long wait


def test_sigkill_from_the_elastic_root_cause_table(tmp_path: Path) -> None:
    text = "\n".join(
        [
            "Root Cause (first observed failure):",
            "[0]:",
            "  time      : 2024-08-25_17:31:27",
            "  host      : 4b1a9e8a140f",
            "  rank      : 5 (local_rank: 1)",
            "  exitcode  : -9 (pid: 8158)",
            "  error_file: <N/A>",
            "  traceback : Signal 9 (SIGKILL) received by PID 8158",
        ]
    )
    c = diagnose_text(tmp_path, text).causes[0]
    assert (c.kind, c.where, c.data["signal"]) == ("killed", "rank 5", "SIGKILL") and "OOM killer" in c.what


@pytest.mark.parametrize(
    "line",
    [
        "[ERROR] [launch.py:325:sigkill_handler] exits with return code = -9",  # DeepSpeed's launcher
        "Process finished with exit code 137 (interrupted by signal 9: SIGKILL)",  # an IDE
        "train.sh: line 12: 4242 Killed                  python train.py",  # bash
        "Killed",
    ],
)
def test_kills_by_signal_without_a_python_error(tmp_path: Path, line: str) -> None:
    c = diagnose_text(tmp_path, "step 3 loss 0.4\n" + line).causes[0]
    assert (c.kind, c.data["signal"]) == ("killed", "SIGKILL") and "dmesg" in fix_text(c)


def test_nccl_shared_memory_failure_points_at_dev_shm(tmp_path: Path) -> None:
    text = "\n".join(
        [
            "host:97:183 [0] include/shm.h:28 NCCL WARN Call to posix_fallocate failed : No space left on device",
            "RuntimeError: NCCL error in: /pytorch/torch/lib/c10d/ProcessGroupNCCL.cpp:784, unhandled system "
            "error, "
            "NCCL version 2.7.8",
        ]
    )
    c = diagnose_text(tmp_path, text).causes[0]
    assert (c.kind, c.where) == ("nccl_error", "/dev/shm") and "--shm-size" in fix_text(c)


def test_ray_actor_death_names_the_dead_actor_and_yields_to_a_memory_kill(tmp_path: Path) -> None:
    died = [
        "ray.exceptions.ActorDiedError: The actor died unexpectedly before finishing this task.",
        "\tclass_name: create_colocated_worker_cls.<locals>.WorkerDict",
        "\tpid: 4242",
        "\tname: Ab12CdWorkerDict_0:3",
        "The actor is dead because its worker process has died. Worker exit type: SYSTEM_ERROR Worker exit "
        "detail: "
        "Worker unexpectedly exits with a connection error code 2. End of file.",
    ]
    c = diagnose_text(tmp_path, "\n".join(died)).causes[0]
    assert c.kind == "ray_actor_died" and "WorkerDict_0:3" in c.where and "pid 4242" in c.where
    monitor = (
        "(raylet) [2025-04-02 15:02:00,117 E 1 1] (raylet) node_manager.cc:3069: 1 Workers (tasks / "
        "actors) "
        "killed due to memory pressure (OOM), 0 Workers crashed due to other reasons at node (ID: "
        "ab, IP: "
        "10.0.0.1) over the last time period."
    )
    d = diagnose_text(tmp_path, "\n".join([monitor, *died]))
    assert [c.kind for c in d.causes] == ["oom_host", "ray_actor_died"]


# ---- memory
def test_ray_memory_monitor_with_its_table_on_separate_lines(tmp_path: Path) -> None:
    text = "\n".join(
        [
            "ray.exceptions.OutOfMemoryError: Task was killed due to the node running low on memory.",
            "Memory on the node (IP: 10.0.62.231, ID: e5d9) where the task (task ID: 4353, "
            "name=allocate_memory, pid=11362, "
            "memory used=1.25GB) was running was 27.71GB / 28.80GB (0.962273), which exceeds the memory usage "
            "threshold "
            "of 0.95. Ray killed this worker (ID: 6f2e) because it was the most recently scheduled task; to "
            "see more.",
            "Top 10 memory users:",
            "PID\tMEM(GB)\tCOMMAND",
            "410728\t8.47\tray::WorkerDict.actor_rollout_compute_log_prob",
            "510953\t7.19\tray::allocate_memory",
        ]
    )
    c = diagnose_text(tmp_path, text).causes[0]
    assert c.kind == "oom_host" and c.where == "WorkerDict.actor_rollout_compute_log_prob"
    assert "27.71 of 28.8 GB" in c.title and "allocate_memory" in c.title and c.phase == "logprob"
    assert "not a CUDA OOM" in c.what


def test_kernel_oom_killer_is_host_memory(tmp_path: Path) -> None:
    text = "[ 1234.5] Out of memory: Killed process 4242 (python3) total-vm:123456kB, anon-rss:98765kB"
    c = diagnose_text(tmp_path, text).causes[0]
    assert c.kind == "oom_host" and "python3" in c.title


def test_logprob_oom_fixes_are_log_prob_micro_batches_not_checkpointing(tmp_path: Path) -> None:
    text = "\n".join(
        [
            "(WorkerDict pid=1) Traceback (most recent call last):",
            '(WorkerDict pid=1)   File "/opt/verl/verl/workers/fsdp_workers.py", line 782, in compute_log_prob',
            "(WorkerDict pid=1) torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 13.91 GiB. GPU 0 "
            "has a total "
            "capacity of 79.11 GiB of which 8.85 GiB is free.",
        ]
    )
    c = diagnose_text(tmp_path, text).causes[0]
    assert c.phase == "logprob" and c.fixes[0].verl.startswith(
        "actor_rollout_ref.rollout.log_prob_micro_batch_size"
    )
    assert "gradient_checkpointing" not in fix_text(c) and "does not help" in c.what
    # param offload printed as already on: not proposed again
    c = diagnose_text(tmp_path, "actor_rollout_ref.actor.fsdp_config.param_offload=True\n" + text).causes[0]
    assert "param_offload" not in fix_text(c)


def test_an_update_oom_in_a_trl_log_gets_training_arguments(tmp_path: Path) -> None:
    text = "\n".join(
        [
            "Traceback (most recent call last):",
            '  File "/usr/lib/python3/site-packages/trl/trainer/grpo_trainer.py", line 1400, in compute_loss',
            "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 4.00 GiB. GPU 0 has a total "
            "capacity of 79.15 "
            "GiB of which 1.23 GiB is free.",
        ]
    )
    c = diagnose_text(tmp_path, text).causes[0]
    assert c.framework == "trl" and c.phase == "update"
    assert c.fixes[0].key == "TrainingArguments.gradient_checkpointing=True"
    assert "actor_rollout_ref" not in fix_text(c)  # no verl key in a TRL log


def test_vllm_v1_kv_cache_message_hard_wrapped(tmp_path: Path) -> None:
    text = (
        "(EngineCore pid=316) ValueError: To serve at least one request with the model's max seq len "
        "(100000), "
        "(4.26 GiB KV cach\ne is needed, which is larger than the available KV cache memory (4.25 "
        "GiB). Based on "
        "the available memory, the estimated maximum model length is 99840. Try increasing"
    )
    c = diagnose_text(tmp_path, text).causes[0]
    assert c.kind == "oom_kv_cache" and c.where == "vllm max_model_len"
    assert "4.26 GiB" in c.title and "<= 99840" in c.title
    assert c.fixes[0].key.startswith("max_model_len")  # vLLM's own engine argument


def test_kv_cache_fixes_in_a_trl_log(tmp_path: Path) -> None:
    text = "\n".join(
        [
            "GRPOTrainer: starting",
            "ValueError: No available memory for the cache blocks. Try increasing `gpu_memory_utilization` when "
            "initializing the engine.",
        ]
    )
    c = diagnose_text(tmp_path, text).causes[0]
    assert c.kind == "oom_kv_cache" and c.fixes[0].key == "GRPOConfig.vllm_gpu_memory_utilization"


# ---- engines
def test_bf16_on_a_v100_never_proposes_bf16(tmp_path: Path) -> None:
    text = (
        "ValueError: Bfloat16 is only supported on GPUs with compute capability of at least 8.0. Your "
        "Tesla T4 GPU "
        "has compute capability 7.5. You can use float16 instead by explicitly setting the`dtype` flag "
        "in CLI, for "
        "example: --dtype=half."
    )
    c = diagnose_text(tmp_path, text).causes[0]
    assert (
        c.kind == "dtype_unsupported"
        and c.where.startswith("compute capability 7.5")
        and "Tesla T4" in c.title
    )
    assert c.where.endswith("asked by dtype (auto takes the model config's bfloat16)")
    assert any((f.key or "").startswith('dtype=half: LLM(dtype="float16")') for f in c.fixes)
    assert "bf16=true" not in fix_text(c).lower()


def test_weight_sync_name_mismatch(tmp_path: Path) -> None:
    c = diagnose_text(
        tmp_path, "ValueError: There is no module or parameter named '_orig_mod' in Qwen2ForCausalLM"
    )
    c = c.causes[0]
    assert (c.kind, c.where, c.phase) == ("weight_sync", "_orig_mod", "weight_sync")
    assert "_orig_mod wrapper" in fix_text(c)


def test_engine_core_death(tmp_path: Path) -> None:
    text = "ERROR 03-01 21:32:52 [core.py:708] EngineCore encountered a fatal error."
    assert diagnose_text(tmp_path, text).causes[0].kind == "engine_error"


# ---- scaling
DS = (
    "[INFO] [loss_scaler.py:183:update_scale] [deepspeed] OVERFLOW! Rank 0 Skipping step. "
    "Attempted loss scale: {}, reducing to {}"
)


@pytest.mark.parametrize(
    "scales, severity, kind",
    [
        # the warm-up search from 2^32: normal, info (the run is clean)
        ([2**32, 2**31, 2**30, 2**29], "info", "overflow_skips"),
        # an overflow at scale 128 mid-run: gradients near 65504 / 128 ~ 512, a warning
        ([128], "warning", "overflow_skips"),
        # halving after halving down to 4: the collapse
        ([64, 32, 16, 8], "error", "loss_scale_collapse"),
        # three halvings that stay high are not a collapse
        ([2**16, 2**15, 2**14], "info", "overflow_skips"),
    ],
)
def test_loss_scale_verdicts(tmp_path: Path, scales: list[int], severity: str, kind: str) -> None:
    text = "\n".join(DS.format(s, s // 2) for s in scales)
    c = diagnose_text(tmp_path, text).causes[0]
    assert (c.severity, c.kind) == (severity, kind)


def test_newer_deepspeed_and_apex_wordings(tmp_path: Path) -> None:
    new = (
        "[deepspeed] fp16 dynamic loss scale overflow! Skipping step. Attempted loss scale: 1.0, reducing to "
        "1.0"
    )
    assert diagnose_text(tmp_path, new).causes[0].kind == "loss_scale_collapse"
    detected = "[Rank 0] Overflow detected. Skipping step. Attempted loss scale: 64, reducing to 32.0"
    assert diagnose_text(tmp_path, detected).causes[0].severity == "warning"
    verbose = "Grad overflow on iteration 0\nReducing dynamic loss scale from 65536 to 32768.0"
    assert diagnose_text(tmp_path, verbose).causes[0].kind == "overflow_skips"


def test_unscale_fp16_with_deepspeed_settings_and_an_old_gpu(tmp_path: Path) -> None:
    text = "\n".join(
        [
            "Tesla V100-SXM2-32GB",
            "Traceback (most recent call last):",
            '  File "train.py", line 10, in main',
            "    scaler.unscale_(optimizer)",
            '  File "/usr/lib/python3/site-packages/torch/amp/grad_scaler.py", line 338, in unscale_',
            "ValueError: Attempting to unscale FP16 gradients.",
        ]
    )
    c = diagnose_text(tmp_path, text).causes[0]
    assert c.kind == "unscale_fp16" and c.where == "main: scaler.unscale_"
    assert "bf16" not in " ".join(str(f.key) for f in c.fixes)  # a V100 has no bf16


# ---- exceptions
def test_dtype_error_under_bf16_does_not_propose_bf16(tmp_path: Path) -> None:
    text = "\n".join(
        [
            "python3 -m verl.trainer.main_ppo "
            "actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype=bf16",
            "RuntimeError: expected mat1 and mat2 to have the same dtype, but got: float != c10::BFloat16",
        ]
    )
    c = diagnose_text(tmp_path, text).causes[0]
    assert (
        c.kind == "dtype_error"
        and "param_dtype=bf16" not in fix_text(c)
        and "already" in c.what + fix_text(c)
    )
    bare = diagnose_text(tmp_path, text.split("\n")[1]).causes[0]  # the setting not printed: proposed
    assert any(f.verl and "param_dtype=bf16" in f.verl for f in bare.fixes)


def test_import_errors(tmp_path: Path) -> None:
    so = (
        "ImportError: "
        "/venv/lib/python3.12/site-packages/flash_attn_2_cuda.cpython-312-x86_64-linux-gnu.so: "
        "undefined symbol: _ZN3c105ErrorC2ENS_14SourceLocationE"
    )
    c = diagnose_text(tmp_path, so).causes[0]
    assert (c.kind, c.where) == ("import_error", "flash_attn (flash_attn_2_cuda)") and "torch" in c.what
    c = diagnose_text(
        tmp_path, "ImportError: cannot import name 'is_torch_npu_available' from 'transformers'"
    ).causes[0]
    assert c.where == "transformers" and "version" in fix_text(c)
    ray = (
        "ray.exceptions.RayTaskError(ModuleNotFoundError): ray::Actor.fit() (pid=1)\n"
        "ModuleNotFoundError: No module named 'deepspeed'"
    )
    c = diagnose_text(tmp_path, ray).causes[0]
    assert c.where == "deepspeed" and "runtime-env-json" in fix_text(c)


def test_framework_configuration_checks(tmp_path: Path) -> None:
    trl = (
        "ValueError: The global train batch size (3 x 1) must be evenly divisible by the number of "
        "generations per "
        "prompt (4). Given the current train batch size, the valid values for the number of generations "
        "are: [3]."
    )
    c = diagnose_text(tmp_path, trl).causes[0]
    assert (c.kind, c.where) == ("exception", "num_generations") and "[3]" in fix_text(c)
    ds = (
        "AssertionError: Check batch related parameters. train_batch_size is not equal to "
        "micro_batch_per_gpu * "
        "gradient_acc_step * world_size 16 != 4 * 1 * 1"
    )
    c = diagnose_text(tmp_path, ds).causes[0]
    assert c.where == "train_batch_size" and c.fixes[0].framework == "deepspeed"


# ---- never clean on a failure
@pytest.mark.parametrize(
    "text",
    [
        "step 10 loss 0.5\nKilled",
        "epoch 1\nStatus message: Job entrypoint command failed with exit code 1",
        'Traceback (most recent call last):\n  File "train.py", line 3, in <module>\n    main()',
        "SomeLibraryError: the flux capacitor is misaligned",
        "ERROR:root:worker lost",
        "[E1206 18:44:16.9 ProcessGroupNCCL.cpp:1709] [PG 1 Rank 0] Timeout at NCCL work: 7753, last "
        "enqueued NCCL work: 7755",
    ],
)
def test_a_failure_is_never_clean(tmp_path: Path, text: str, capsys) -> None:
    d = diagnose_text(tmp_path, text)
    assert d.verdict == "error" and d.causes[0].severity == "error"
    # the CLI exits 1 and quotes a line of the log
    import argparse

    assert main(argparse.Namespace(path=str(tmp_path / "train.log"), json=False)) == 1
    out = capsys.readouterr().out
    assert "verdict: error" in out and render_text(d) in out


def test_unrecognised_failure_quotes_the_innermost_exception(tmp_path: Path) -> None:
    text = "\n".join(
        [
            "ray.exceptions.RayTaskError(AssertionError): ray::main_task() (pid=618270, ip=10.6.67.152)",
            '  File "tmp/ray_trainer.py", line 612, in fit',
            "    old_log_prob = self.actor_rollout_wg.compute_log_prob(batch)",
            "AssertionError: Expects tensor to be on the compute device cuda:0, was on cpu",
        ]
    )
    c = diagnose_text(tmp_path, text).causes[0]
    assert c.kind == "exception" and "Expects tensor to be on the compute device" in c.title
    assert c.phase == "logprob" and "compute_log_prob" in c.where


# ---- the scan keeps bounded facts whatever the log
@settings(max_examples=25, deadline=None)
@given(
    st.lists(
        st.sampled_from(
            [
                NCCL.format(r=1, s=5),
                OOM_LINE,
                DS.format(64, 32),
                "Traceback (most recent call last):",
                '  File "/a/b.py", line 3, in f',
                "ValueError: x",
                "key_{}=value",
                "--flag-{} 3",
                "plain line",
            ]
        ),
        min_size=0,
        max_size=400,
    )
)
def test_scan_facts_are_bounded(lines: list[str]) -> None:
    scan = new_scan()
    for i, line in enumerate(lines * 20, 1):
        scan.feed(i, line.replace("{}", str(i)))
    facts = scan.facts()
    assert all(len(h) <= 2 * KEEP for h in facts.hits.values())
    assert len(facts.tracebacks) <= 3 * MAX_TRACEBACKS  # stored (first and last) plus the ones still open
    assert len(facts.settings) <= MAX_SETTINGS + 8 and len(facts.signals) <= 2 * KEEP
    assert sum(facts.counts.values()) >= sum(len(h) for h in facts.hits.values())
