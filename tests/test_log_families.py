"""Failure families a foreign log names only indirectly (logsg branch, issue 25): a supervised loss of exactly
0 without a NaN; weight-sync failures placed by the frames' or the requests' names; "X and Y must have the same
dtype" messages; torchrun's SIGKILL summary; an engine's assertion about a mode or feature; a library's call
that the installed torch's argument parser rejects. Each log is a short excerpt written here in the shape the
libraries print, never a copy of a corpus fixture; each family has a healthy neighbour that must stay quiet.
Run: `pytest tests/test_log_families.py`."""

from __future__ import annotations

from pathlib import Path

from verlaudit.analysis.diagnose.diagnosis import diagnose_path


def diagnose(tmp_path: Path, text: str, name: str = "train.log"):
    p = tmp_path / name
    p.write_text(text)
    (d,) = diagnose_path(p)
    return d


def first(tmp_path: Path, text: str):
    d = diagnose(tmp_path, text)
    assert d.causes, d.summary
    return d.causes[0]


def bad_verdicts(tmp_path: Path, text: str) -> list:
    d = diagnose(tmp_path, text)
    return [(c.severity, c.kind, c.title) for c in d.causes if c.severity in ("error", "warning")]


# ---- a supervised loss of exactly 0 -------------------------------------------------------------


def _sft(losses, extra: str = "") -> str:
    return "".join(
        f"{{'loss': {v}, 'grad_norm': {0.0 if v == 0 else 1.5}, 'learning_rate': 2e-05,{extra} 'epoch': {i / 20:.2f}}}\n"
        for i, v in enumerate(losses)
    )


def test_supervised_loss_zero_from_the_first_step_is_a_collapse(tmp_path):
    c = first(tmp_path, "{'loss': 0.0, 'learning_rate': 1e-07, 'epoch': 0.01}\n" * 3)
    assert c.kind == "collapse" and c.severity == "error" and c.step == 1
    assert c.where == "loss" and "never non-zero" in c.evidence[0]


def test_supervised_loss_dropping_to_zero_is_a_collapse_and_cites_the_zero_gradient(tmp_path):
    c = first(tmp_path, _sft([1.9, 1.7, 1.6, 0.0, 0.0, 0.0]))
    assert c.kind == "collapse" and c.step == 4 and "after 1.6" in c.title
    assert any("grad_norm = 0.0 at the same steps" in e for e in c.evidence)


def test_loss_converging_through_rounding_is_healthy(tmp_path):
    assert bad_verdicts(tmp_path, _sft([0.02, 0.004, 0.0006, 0.0001, 0.0, 0.0])) == []


def test_one_zero_loss_step_is_healthy(tmp_path):
    assert bad_verdicts(tmp_path, _sft([1.2, 1.1, 0.0])) == []


def test_rl_loss_zero_with_reward_and_kl_is_not_this_rule(tmp_path):
    log = "".join(
        f"{{'loss': 0.0, 'grad_norm': {0.2 + i / 40}, 'learning_rate': 1e-06, 'rewards/accuracy/mean': "
        f"{0.1 + i / 30}, 'kl': {i / 1000}, 'epoch': {i / 10}}}\n"
        for i in range(6)
    )
    assert bad_verdicts(tmp_path, log) == []


def test_dpo_loss_zero_with_preference_metrics_is_not_this_rule(tmp_path):
    log = "".join(
        f"{{'loss': 0.0, 'rewards/chosen': {2 + i}, 'rewards/rejected': {-3 - i}, 'logps/chosen': -40.0, "
        f"'learning_rate': 5e-07, 'epoch': {i / 10}}}\n"
        for i in range(4)
    )
    assert all(k != "collapse" for _, k, _ in bad_verdicts(tmp_path, log))


# ---- weight sync placed by the names of the frames and of the requests --------------------------


def test_frames_that_broadcast_weights_place_an_unknown_failure_in_the_weight_sync(tmp_path):
    log = (
        "Traceback (most recent call last):\n"
        '  File "/work/rl/workers/policy_worker.py", line 412, in push_params_to_generation\n'
        "    t = p.full_tensor()\n"
        '  File "/usr/lib/python3.11/site-packages/torch/distributed/tensor/_api.py", line 570, in full_tensor\n'
        "    redist = self.redistribute(\n"
    )
    c = first(tmp_path, log)
    assert c.kind == "weight_sync" and c.phase == "weight_sync"


def test_phase_of_a_name_with_a_sync_verb_and_a_weight_noun():
    from verlaudit.analysis.logs.phases import phase_of_name

    assert phase_of_name("broadcast_params_for_collective") == "weight_sync"
    assert phase_of_name("_update_bucket_weights") == "weight_sync"
    assert phase_of_name("refit_policy_generation") == "weight_sync"
    assert phase_of_name("update_lr_schedule") is None  # a verb without a weight noun


def test_engine_failure_right_after_a_weight_update_request_is_a_weight_sync(tmp_path):
    log = (
        '[TP0] INFO:     127.0.0.1:5000 - "POST /update_weights_from_distributed HTTP/1.1" 200 OK\n'
        "[TP0] Scheduler hit an exception: Traceback (most recent call last):\n"
        '  File "/opt/sglang/srt/managers/scheduler.py", line 100, in run_scheduler_process\n'
        "    scheduler.event_loop_normal()\n"
    )
    c = first(tmp_path, log)
    assert c.kind == "weight_sync" and c.where == "update_weights_from_distributed"


def test_engine_failure_in_the_decode_long_after_a_weight_update_stays_an_engine_error(tmp_path):
    log = '"POST /update_weights_from_tensor HTTP/1.1" 200 OK\n' + "Decode batch. #running-req: 8\n" * 20
    log += (
        "Scheduler hit an exception: Traceback (most recent call last):\n"
        '  File "/opt/sglang/srt/managers/scheduler.py", line 100, in run_batch\n'
        "    out = self.model_runner.forward(batch)\n"
        "RuntimeError: CUDA error: an illegal memory access was encountered\n"
    )
    assert first(tmp_path, log).kind != "weight_sync"


def test_a_weight_update_request_that_succeeded_is_healthy(tmp_path):
    log = (
        '127.0.0.1:5000 - "POST /update_weights_from_tensor HTTP/1.1" 200 OK\n'
        "Cache flushed successfully!\n"
        "step:3 - actor/pg_loss:0.012 - actor/grad_norm:0.41 - critic/score/mean:0.5\n"
    )
    assert bad_verdicts(tmp_path, log) == []


# ---- "A and B must have the same dtype", any kernel ---------------------------------------------


def test_any_pair_of_operands_that_must_share_a_dtype_is_a_dtype_error_naming_both(tmp_path):
    log = "    o, lse = fused_rope_attn.fwd(\nRuntimeError: q and v must have the same dtype\n"
    c = first(tmp_path, log)
    assert c.kind == "dtype_error" and "q and v" in c.title
    assert c.where == "fused_rope_attn.fwd"  # the call of the source line the paste kept


def test_a_dtype_pair_with_its_dtypes_names_them(tmp_path):
    c = first(tmp_path, "RuntimeError: x and weight should be the same dtype, but got Half and Float\n")
    assert c.kind == "dtype_error" and "fp16" in c.title and "fp32" in c.title


# ---- torchrun's SIGKILL summary, however the paste laid it out ----------------------------------


def test_child_failed_with_exitcode_minus_9_run_together_is_a_kill_of_that_rank(tmp_path):
    log = (
        "torch.distributed.elastic.multiprocessing.errors.ChildFailedError:\n"
        "train_sft.py FAILED\n"
        "Root Cause (first observed failure):\n"
        "[0]:\n"
        "host-a\n"
        "rank5 (local rank: 1)exitcode: -9 (pid: 4242)error file: <N/A>\n"
        "traceback : signal 9 (SIGKILL) received by PID 4242\n"
    )
    c = first(tmp_path, log)
    assert c.kind == "killed" and "SIGKILL" in c.title and "rank 5" in (c.where or c.title)


def test_child_failed_with_exitcode_1_is_not_a_kill(tmp_path):
    log = (
        "torch.distributed.elastic.multiprocessing.errors.ChildFailedError:\n"
        "Root Cause (first observed failure):\n"
        "  rank      : 0 (local_rank: 0)\n"
        "  exitcode  : 1 (pid: 77)\n"
        "  traceback : To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html\n"
    )
    assert first(tmp_path, log).kind != "killed"


# ---- an engine refusing a mode or feature as configured -----------------------------------------


def test_engine_feature_restricted_by_its_own_check_names_the_argument(tmp_path):
    c = first(tmp_path, "ValueError: Chunked prefill is not supported with pipeline parallelism yet.\n")
    assert c.kind == "engine_feature" and c.where == "enable_chunked_prefill"
    assert any(f.key == "enable_chunked_prefill=False" for f in c.fixes)


def test_engine_mode_assertion_is_an_engine_feature(tmp_path):
    c = first(tmp_path, "AssertionError: Prefix caching can only be used with the paged KV-cache layout.\n")
    assert c.kind == "engine_feature" and c.where == "enable_prefix_caching"


def test_a_feature_other_libraries_have_needs_an_engine_in_the_log(tmp_path):
    # LoRA restricted by a trainer library (no engine frame, no engine in the log): not this family
    log = "ValueError: LoRA is not supported with gradient checkpointing in this trainer.\n"
    assert first(tmp_path, log).kind != "engine_feature"
    eng = (
        "Traceback (most recent call last):\n"
        '  File "/usr/lib/python3.11/site-packages/vllm/config.py", line 900, in verify\n'
        "    raise ValueError(\n"
        "ValueError: LoRA is not supported with speculative decoding.\n"
    )
    assert first(tmp_path, eng).kind == "engine_feature"


def test_a_feature_named_in_an_info_line_is_no_finding(tmp_path):
    log = "INFO 05-01 config.py:1200] Chunked prefill is enabled with max_num_batched_tokens=8192.\n"
    assert bad_verdicts(tmp_path, log) == []


# ---- a signature error inside the user's own code is not a version mismatch ---------------------


def test_missing_argument_raised_in_the_users_own_frame_is_an_exception_naming_its_file(tmp_path):
    log = (
        "Traceback (most recent call last):\n"
        '  File "/usr/lib/python3.10/site-packages/ray/_private/function_manager.py", line 563, in executor\n'
        "    return method(actor, *args, **kwargs)\n"
        '  File "/home/u/gridsearch/jobs/sweep_actor.py", line 31, in launch\n'
        "    cfg = Point(x)\n"
        "TypeError: __new__() missing 1 required positional argument: 'y'\n"
    )
    c = first(tmp_path, log)
    assert c.kind == "exception" and "jobs/sweep_actor.py" in c.where


def test_missing_argument_raised_in_a_librarys_frame_stays_a_version_mismatch(tmp_path):
    log = (
        "Traceback (most recent call last):\n"
        '  File "/home/u/train.py", line 9, in main\n'
        "    trainer.train()\n"
        '  File "/usr/lib/python3.10/site-packages/trl/trainer/grpo_trainer.py", line 700, in train\n'
        "    out = self.llm.generate(prompts)\n"
        "TypeError: generate() missing 1 required positional argument: 'sampling_params'\n"
    )
    assert first(tmp_path, log).kind == "version_mismatch"


# ---- torch's argument parser rejecting a library's call -----------------------------------------


def _lib_call(message: str, path: str) -> str:
    return (
        "Traceback (most recent call last):\n"
        '  File "/home/u/run.py", line 40, in <module>\n'
        "    stats = trainer.step(q, r, s)\n"
        f'  File "/opt/py/lib/python3.10/site-packages/{path}", line 88, in pooled_mean\n'
        "    return (x * m).mean(dim=dim) / m.mean(dim=dim)\n"
        f"{message}\n"
    )


def test_named_dimension_error_from_a_librarys_frame_is_a_version_mismatch_with_torch(tmp_path):
    c = first(
        tmp_path,
        _lib_call("RuntimeError: Please look up dimensions by name, got: name = None.", "rlkit/ops.py"),
    )
    assert c.kind == "version_mismatch" and c.where.startswith("rlkit -> torch")
    assert any("pip install --upgrade rlkit torch" in f.why for f in c.fixes)


def test_invalid_combination_of_arguments_from_a_librarys_frame_is_a_version_mismatch(tmp_path):
    msg = "TypeError: mean() received an invalid combination of arguments - got (dim=NoneType, ), but expected ..."
    assert first(tmp_path, _lib_call(msg, "rlkit/ops.py")).kind == "version_mismatch"


def test_the_same_rejection_in_the_users_own_frame_is_not_a_version_mismatch(tmp_path):
    log = (
        "Traceback (most recent call last):\n"
        '  File "/home/u/run.py", line 40, in <module>\n'
        "    y = x.sum(axis=None)\n"
        "RuntimeError: Please look up dimensions by name, got: name = None.\n"
    )
    assert first(tmp_path, log).kind != "version_mismatch"


def test_a_return_statement_is_not_the_call_a_frame_makes():
    from verlaudit.analysis.logs.lines import Frame

    assert Frame("a.py", 1, "f", "return (a * b).sum(dim=0)").call() != "return"
    assert Frame("a.py", 1, "f", "return self.model.generate(x)").call() == "self.model.generate"


# ---- placement, not NCCL: two ranks on one GPU; an engine being built is no weight sync -----------


def test_duplicate_gpu_is_a_placement_error_of_the_two_ranks(tmp_path):
    log = (
        "torch.distributed.DistBackendError: NCCL error in: ProcessGroupNCCL.cpp:1970, invalid usage, "
        "NCCL version 2.21.5\n"
        "Last error:\n"
        "Duplicate GPU detected : rank 3 and rank 2 both on CUDA device 41000\n"
    )
    c = first(tmp_path, log)
    assert c.kind == "exception" and "rank 3 and rank 2" in c.where and c.rank == 3


def test_a_failure_while_the_rollout_engine_is_built_is_not_a_weight_sync(tmp_path):
    log = (
        "Traceback (most recent call last):\n"
        '  File "/w/rl/workers/fsdp_workers.py", line 419, in init_model\n'
        "    self.rollout, self.rollout_sharding_manager = self._build_rollout()\n"
        '  File "/w/engine/srt/utils.py", line 863, in broadcast_pyobj\n'
        "    dist.broadcast(size, src=src, group=group)\n"
        "RuntimeError: No backend type associated with device type cpu\n"
    )
    c = first(tmp_path, log)
    assert c.kind == "exception" and "broadcast_pyobj" in c.where


# ---- placement: a collective or a DTensor op refused for where its tensors live -----------------


def test_placement_collective_on_a_device_its_group_has_no_backend_for(tmp_path):
    log = (
        "Traceback (most recent call last):\n"
        '  File "/w/app/sync.py", line 12, in share_seed\n'
        "    torch.distributed.all_reduce(seed_t, group=grp)\n"
        '  File "/usr/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py", line 2500, in all_reduce\n'
        "    work = group.allreduce([tensor], opts)\n"
        "RuntimeError: No backend type associated with device type cuda\n"
    )
    c = first(tmp_path, log)
    assert c.kind == "exception" and "torch.distributed.all_reduce" in c.title
    assert "share_seed" in c.where and any("group with a cuda backend" in f.why for f in c.fixes)


def test_placement_dtensor_op_without_a_mesh(tmp_path):
    c = first(
        tmp_path, "AssertionError: found no DeviceMesh from dtensor args for c10d.allreduce_.default!\n"
    )
    assert c.kind == "exception" and "c10d.allreduce_" in c.where
    assert any("do not call allreduce on DTensor" in f.why for f in c.fixes)


# ---- imports: the file that imports, both remedies of a name the package lacks -------------------


def test_missing_module_names_the_file_whose_import_failed(tmp_path):
    log = (
        "Traceback (most recent call last):\n"
        '  File "/srv/proj/rlpkg/workers/mcore_worker.py", line 60, in <module>\n'
        "    from megacore.ft import tolerance\n"
        "ModuleNotFoundError: No module named 'megacore'\n"
    )
    c = first(tmp_path, log)
    assert c.kind == "import_error" and "rlpkg/workers/mcore_worker.py" in c.where


def test_a_name_the_package_does_not_export_gives_both_directions_as_commands(tmp_path):
    log = (
        "Traceback (most recent call last):\n"
        '  File "/srv/proj/app/pipe.py", line 3, in <module>\n'
        "    from accelerate import PartialState\n"
        "ImportError: cannot import name 'PartialState' from 'accelerate' (/usr/lib/python3/site-packages/accelerate/__init__.py)\n"
    )
    c = first(tmp_path, log)
    assert c.kind == "version_mismatch"
    assert any("pip install --upgrade accelerate" in f.why and "pin accelerate" in f.why for f in c.fixes)


# ---- culprits: a constructor by the class its caller builds; where a CUDA fault surfaced ---------


def test_a_fault_raised_in_a_constructor_names_the_class_and_where_it_surfaced(tmp_path):
    log = (
        "Traceback (most recent call last):\n"
        '  File "/w/eng/runner.py", line 468, in init_graphs\n'
        "    self.graph_runner = GraphCaptureRunner(self)\n"
        '  File "/w/eng/graph_runner.py", line 148, in __init__\n'
        "    raise Exception(\n"
        "Exception: Capture failed: CUDA error: an illegal memory access was encountered\n"
    )
    c = first(tmp_path, log)
    assert c.kind == "cuda_error" and "surfaced in GraphCaptureRunner.__init__" in c.where


def test_host_oom_names_the_class_of_the_actor_the_monitor_killed(tmp_path):
    log = (
        "ray.exceptions.RayActorError: The actor died unexpectedly before finishing this task.\n"
        "        class_name: build.<locals>.ShardWriterActor\n"
        "        pid: 77\n"
        "The actor is dead because its worker process has died. Worker exit type: USER_ERROR Worker exit "
        "detail: Task was killed due to the node running low on memory.\n"
    )
    c = first(tmp_path, log)
    assert c.kind == "oom_host" and "actor ShardWriterActor" in c.where


def test_a_compiler_backend_import_names_the_whole_module(tmp_path):
    log = (
        "torch._dynamo.exc.BackendCompilerFailed: backend='inductor' raised:\n"
        "ImportError: cannot import name 'kernel_key' from 'tritonish.runtime.cache' "
        "(/usr/lib/python3/site-packages/tritonish/runtime/cache.py)\n"
    )
    c = first(tmp_path, log)
    assert "tritonish.runtime.cache" in c.where


# ---- collapse without a NaN: the reward frozen below where it was, with another signal ------------


def _verl(rows) -> str:
    return "".join(
        f"step:{i + 1} - actor/pg_loss:{loss} - actor/grad_norm:{g} - critic/score/mean:{r} - actor/entropy:{e}\n"
        for i, (loss, g, r, e) in enumerate(rows)
    )


def test_reward_frozen_below_its_best_with_entropy_at_zero_is_a_collapse(tmp_path):
    rows = [(0.05, 0.9, 0.3 + i / 20, 1.2) for i in range(6)] + [(0.01, 0.8, 0.125, 0.004)] * 4
    c = first(tmp_path, _verl(rows))
    assert c.kind == "collapse" and "reward frozen" in c.title and "entropy collapsing" in c.title


def test_reward_saturated_at_its_best_is_healthy(tmp_path):
    rows = [(0.05, 0.9, 0.5 + i / 12, 1.2 - i / 10) for i in range(7)] + [(0.0, 0.0, 1.0, 0.05)] * 4
    assert bad_verdicts(tmp_path, _verl(rows)) == []


def test_entropy_collapse_with_zero_loss_alone_is_not_a_collapse(tmp_path):
    rows = [(0.05, 0.9, 0.3 + i / 20, 1.2) for i in range(6)] + [
        (0.0, 0.0, 0.6 + i / 50, 0.004) for i in range(4)
    ]
    assert all(k != "collapse" for _, k, _ in bad_verdicts(tmp_path, _verl(rows)))


def test_a_ray_actor_death_whose_cause_is_a_library_types_missing_attribute_is_a_version_mismatch(tmp_path):
    log = (
        "ray.exceptions.ActorDiedError: The actor died because of an error raised in its creation task, "
        "ray::_Engine.__init__() (pid=5, ip=1.2.3.4) AttributeError: 'vllm.config.ModelConfig' object has no "
        "attribute 'hf_text_config'\n"
    )
    c = first(tmp_path, log)
    assert c.kind == "version_mismatch" and c.where.startswith("vllm")
