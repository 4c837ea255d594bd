"""The culprit resolver of a pasted log's first cause (verlaudit/analysis/logs/culprit.py): the training-side
frame and its file, the Ray task, the setting that bounds an OOM's phase (with the value the log prints), the
other processes on an OOM's GPU, the failing pytest node, the DeepSpeed site of a loss-scale collapse; each
with a neighbour the resolver must leave alone."""

from __future__ import annotations

from pathlib import Path

from verlaudit.analysis.diagnose.diagnosis import diagnose_log
from verlaudit.analysis.logs.culprit import package_of

SP = "/usr/local/lib/python3.10/site-packages"


def first(tmp_path: Path, text: str):
    p = tmp_path / "paste.log"
    p.write_text(text, encoding="utf-8")
    d = diagnose_log(p)
    assert d.causes, d.summary
    return d.causes[0]


def tb(*frames: tuple[str, int, str, str], exc: str) -> str:
    out = ["Traceback (most recent call last):"]
    for path, ln, func, code in frames:
        out += [f'  File "{path}", line {ln}, in {func}', f"    {code}"]
    return "\n".join(out + [exc]) + "\n"


# ---- the training-side frame: the innermost frame of the user's code or of a training framework, with its file


def test_a_cuda_fault_under_torch_names_the_verl_module_that_called_it(tmp_path):
    log = tb(
        (
            "/opt/verl/verl/workers/fsdp_workers.py",
            520,
            "update_actor",
            "metrics = self.actor.update_policy(data)",
        ),
        (
            "/opt/verl/verl/workers/actor/dp_actor.py",
            310,
            "update_policy",
            "grad_norm = self._optimizer_step()",
        ),
        (f"{SP}/torch/nn/utils/clip_grad.py", 76, "clip_grad_norm_", "norms = [torch.linalg.vector_norm(g)]"),
        exc="RuntimeError: CUDA error: an illegal memory access was encountered",
    )
    c = first(tmp_path, log)
    assert "verl/workers/actor/dp_actor.py:310" in c.where and "update_policy" in c.where, c.where


def test_an_unknown_error_inside_torch_names_the_openrlhf_caller(tmp_path):
    log = tb(
        (f"{SP}/openrlhf/trainer/ppo_utils/experience_maker.py", 402, "make_experience",
         "action_log_probs = self.actor(sequences, num_actions)"),
        (f"{SP}/torch/nn/modules/module.py", 1736, "_call_impl", "return forward_call(*args, **kwargs)"),
        (f"{SP}/torch/nn/functional.py", 2551, "layer_norm", "return torch.layer_norm(input)"),
        exc="RuntimeError: Given normalized_shape=[4096], expected input with shape [*, 4096], but got input of size[2, 7, 2048]",
    )  # fmt: skip
    c = first(tmp_path, log)
    assert "openrlhf/trainer/ppo_utils/experience_maker.py:402" in c.where, c.where


def test_a_framework_shipped_in_a_ray_working_dir_is_that_framework_not_ray():
    path = (
        "/tmp/ray/session_2026/runtime_resources/working_dir_files/_ray_pkg_ab12/trl/trainer/grpo_trainer.py"
    )
    assert package_of(path) == "trl"
    assert package_of(f"{SP}/ray/_private/worker.py") == "ray"


def test_the_ray_task_header_names_the_worker_method(tmp_path):
    log = (
        "RuntimeError: Expected all tensors to be on the same device, but found at least two devices, cuda:0 and cpu!\n"
        "ray::MegatronPolicyWorker.train()\n"
        '  File "/workspace/nemo_rl/models/policy/megatron_policy_worker.py", line 901, in train\n'
    )
    c = first(tmp_path, log)
    assert "MegatronPolicyWorker.train" in c.where and "megatron_policy_worker.py:901" in c.where, c.where


def test_a_traceback_all_inside_torch_gets_no_invented_site(tmp_path):
    log = tb(
        (f"{SP}/torch/nn/modules/module.py", 1736, "_call_impl", "return forward_call(*args, **kwargs)"),
        (f"{SP}/torch/nn/functional.py", 2551, "layer_norm", "return torch.layer_norm(input)"),
        exc="RuntimeError: CUDA error: an illegal memory access was encountered",
    )
    c = first(tmp_path, log)
    assert " at " not in (c.where or "") and ".py:" not in (c.where or ""), c.where


# ---- the setting that bounds the memory of the phase an OOM happened in, with the value the log prints

_OOM = (
    "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.11 GiB "
    "of which 1.02 GiB is free. Including non-PyTorch memory, this process has 78.08 GiB memory in use."
)


def test_a_verl_update_oom_names_the_actor_micro_batch_and_its_value(tmp_path):
    log = "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8 trainer.n_gpus_per_node=8\n" + tb(
        (
            "/opt/verl/verl/workers/fsdp_workers.py",
            520,
            "update_actor",
            "metrics = self.actor.update_policy(data)",
        ),
        ("/opt/verl/verl/workers/actor/dp_actor.py", 320, "update_policy", "loss.backward()"),
        (f"{SP}/torch/_tensor.py", 581, "backward", "torch.autograd.backward("),
        exc=_OOM,
    )
    c = first(tmp_path, log)
    key = "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu"
    assert c.kind == "oom" and f"{key} = 8 in the log" in c.where, c.where
    assert any(f.verl and key in f.verl and "from 8 to 4" in f.why for f in c.fixes), c.fixes


def test_an_openrlhf_logprob_oom_names_the_rollout_micro_batch_flag(tmp_path):
    log = "train_ppo_ray --micro_rollout_batch_size 16 --micro_train_batch_size 4\n" + tb(
        (f"{SP}/openrlhf/trainer/ppo_utils/experience_maker.py", 402, "make_experience",
         "action_log_probs = self.actor(sequences, num_actions)"),
        (f"{SP}/openrlhf/models/actor.py", 210, "forward", "log_probs = log_probs_from_logits(logits, labels)"),
        exc=_OOM,
    )  # fmt: skip
    c = first(tmp_path, log)
    assert c.kind == "oom" and "--micro_rollout_batch_size = 16 in the log" in c.where, (c.phase, c.where)
    assert any(
        f.key and "--micro_rollout_batch_size" in f.key and "from 16 to 8" in f.why for f in c.fixes
    ), c.fixes


def test_a_nemo_rl_logprob_oom_names_the_logprob_batch_size(tmp_path):
    log = "ray::DTensorPolicyWorker.get_logprobs()\n" + tb(
        ("/opt/nemo-rl/nemo_rl/models/policy/dtensor_policy_worker.py", 760, "get_logprobs",
         "outputs = self.model(input_ids=input_ids)"),
        (f"{SP}/torch/nn/modules/module.py", 1736, "_call_impl", "return forward_call(*args, **kwargs)"),
        exc=_OOM,
    )  # fmt: skip
    c = first(tmp_path, log)
    assert c.kind == "oom" and "policy.logprob_batch_size" in c.where, (c.phase, c.where)
    assert any(f.key and "policy.logprob_batch_size" in f.key for f in c.fixes), c.fixes


def test_a_verl_oom_without_a_phase_names_both_micro_batches_to_check(tmp_path):
    log = (
        "(WorkerDict pid=9) actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=16\n(WorkerDict pid=9) "
        + _OOM
    )
    c = first(tmp_path, log + "\n")
    assert c.phase is None and "phase not shown" in c.where, (c.phase, c.where)
    assert "ppo_micro_batch_size_per_gpu" in c.where and "log_prob_micro_batch_size_per_gpu = 16" in c.where


def test_a_trl_oom_without_a_phase_names_the_per_device_batch(tmp_path):
    log = "{'loss': 0.61, 'grad_norm': 1.2, 'learning_rate': 1e-06, 'rewards/chosen': 0.1, 'epoch': 0.1}\n"
    c = first(tmp_path, "trl.trainer.dpo_trainer: DPOTrainer starting\n" + log + _OOM + "\n")
    assert c.framework == "trl" and "per_device_train_batch_size bounds a step's memory" in c.where, c.where


def test_an_oom_with_no_framework_shown_names_no_key(tmp_path):
    c = first(tmp_path, _OOM + "\n")
    assert c.kind == "oom" and "micro_batch" not in (c.where or "") and "bounds" not in (c.where or "")


# ---- the other processes on the GPU, and the failing test


def test_an_oom_on_a_shared_gpu_names_the_largest_other_process(tmp_path):
    log = (
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 MiB. GPU 0 has a total capacity of "
        "23.57 GiB of which 6.19 MiB is free. Process 3101 has 1.20 GiB memory in use. Process 3377 has 11.9 GiB "
        "memory in use. Including non-PyTorch memory, this process has 10.4 GiB memory in use.\n"
    )
    c = first(tmp_path, log)
    assert c.where.startswith("GPU shared with process 3377 (11.9 GiB), process 3101 (1.2 GiB)"), c.where
    assert any("process 3377" in f.why for f in c.fixes)


def test_one_other_process_beside_this_one_is_named(tmp_path):
    log = _OOM.replace(
        "Including non-PyTorch", "Process 2247613 has 23.35 GiB memory in use. Including non-PyTorch"
    )
    c = first(tmp_path, log + "\n")
    assert "GPU shared with process 2247613 (23.4 GiB)" in c.where, c.where


def test_processes_the_message_does_not_tell_apart_are_not_called_other_jobs(tmp_path):
    log = (
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 148.00 MiB. GPU 0 has a total capacity of "
        "31.60 GiB of which 87.44 MiB is free. Process 41 has 30.51 GiB memory in use. Process 49 has 1022.00 MiB "
        "memory in use.\n"
    )
    c = first(tmp_path, log)
    assert "GPU held by process 41 (30.5 GiB)" in c.where and "shared with" not in c.where, c.where


def test_the_failing_pytest_node_is_named(tmp_path):
    log = (
        "FAILED ci/tests/test_ppo_trainer.py::TestPPOTrainer::test_peft_training - torch.OutOfMemoryError: CUDA out of "
        "memory. Tried to allocate 64.00 MiB. GPU 0 has a total capacity of 14.74 GiB of which 12.19 MiB is free.\n"
    )
    c = first(tmp_path, log)
    assert "ci/tests/test_ppo_trainer.py::TestPPOTrainer::test_peft_training" in c.where, c.where


def test_one_process_on_the_gpu_is_not_called_shared(tmp_path):
    c = first(tmp_path, _OOM.replace("this process has", "Process 12 has") + "\n")
    assert "shared" not in (c.where or "") and "shared" not in c.title


# ---- the DeepSpeed site and settings of a loss-scale collapse

_DS = "[2026-01-02 10:00:{:02d},000] [INFO] [{}:{}:{}] [deepspeed] OVERFLOW! Rank 0 Skipping step. Attempted loss scale: {}, reducing to {}\n"


def _collapse(file: str, ln: int, func: str) -> str:
    scales = [2.0**k for k in range(6, -1, -1)]
    return "".join(_DS.format(i, file, ln, func, s, max(s / 2, 1.0)) for i, s in enumerate(scales))


def test_a_zero2_collapse_names_the_stage2_site_and_the_fp16_block(tmp_path):
    c = first(tmp_path, _collapse("stage2.py", 1357, "step"))
    assert c.kind == "loss_scale_collapse" and "ZeRO stage 2" in c.where and "stage2.py:1357" in c.where, (
        c.where
    )
    assert "fp16.loss_scale_window" in c.where and any("learning_rate" in f.why for f in c.fixes)


def test_a_zero3_collapse_names_stage3(tmp_path):
    c = first(tmp_path, _collapse("stage3.py", 2130, "_overflow_clean_up"))
    assert "ZeRO stage 3" in c.where and "stage3.py:2130" in c.where, c.where


def test_a_fused_optimizer_collapse_is_not_called_zero(tmp_path):
    c = first(tmp_path, _collapse("fused_optimizer.py", 290, "step"))
    assert "fp16 optimizer (fused_optimizer.py:290" in c.where and "ZeRO" not in c.where, c.where


def test_a_few_overflows_while_the_scale_settles_are_left_alone(tmp_path):
    log = "".join(
        _DS.format(i, "stage_1_and_2.py", 1800, "step", 2.0 ** (16 - i), 2.0 ** (15 - i)) for i in range(3)
    )
    log += "".join(f"{{'loss': 1.{i}, 'learning_rate': 1e-05, 'epoch': 0.{i}}}\n" for i in range(1, 9))
    p = tmp_path / "ok.log"
    p.write_text(log, encoding="utf-8")
    d = diagnose_log(p)
    assert d.verdict != "error" and all("stage_1_and_2.py" not in (c.where or "") for c in d.causes)


# ---- an offload the log turns on, where cpu and cuda tensors meet

_DEVICES = "RuntimeError: Expected all tensors to be on the same device, but found at least two devices, cuda:0 and cpu!"


def test_a_verl_optimizer_offload_is_named_where_cpu_meets_cuda(tmp_path):
    log = "actor_rollout_ref.actor.fsdp_config.optimizer_offload=True actor_rollout_ref.actor.fsdp_config.param_offload=False\n"
    log += tb(
        ("/opt/verl/verl/workers/actor/dp_actor.py", 330, "_optimizer_step", "self.actor_optimizer.step()"),
        (f"{SP}/torch/optim/adamw.py", 480, "_single_tensor_adamw", "exp_avg.lerp_(grad, 1 - beta1)"),
        exc=_DEVICES,
    )
    c = first(tmp_path, log)
    assert "actor_rollout_ref.actor.fsdp_config.optimizer_offload = True in the log" in c.where, c.where
    assert any(f.verl == "actor_rollout_ref.actor.fsdp_config.optimizer_offload" for f in c.fixes)


def test_a_nemo_rl_cpu_offload_in_a_yaml_dump_is_named(tmp_path):
    log = "policy:\n  dtensor_cfg:\n    cpu_offload: true\n" + tb(
        ("/opt/nemo-rl/nemo_rl/models/policy/dtensor_policy_worker.py", 858, "train", "loss.backward()"),
        (f"{SP}/torch/_tensor.py", 581, "backward", "torch.autograd.backward("),
        exc=_DEVICES,
    )
    c = first(tmp_path, log)
    assert "cpu_offload = true in the log" in c.where, c.where


def test_an_optimizer_step_mixing_devices_without_a_printed_offload_says_what_to_check(tmp_path):
    log = "[INFO] [config.py:1000:print] zero_optimization ............. {'stage': 2}\n" + tb(
        ("/home/me/train.py", 88, "main", "optimizer.step()"),
        (f"{SP}/torch/optim/adam.py", 410, "_single_tensor_adam", "exp_avg.lerp_(grad, 1 - beta1)"),
        exc=_DEVICES,
    )
    c = first(tmp_path, log)
    assert "optimizer step (torch/optim/adam.py:410" in c.where and "= True" not in c.where, c.where
    assert any(f.why.startswith("check the optimizer-offload option") for f in c.fixes)


def test_a_device_mix_outside_the_optimizer_with_no_offload_names_no_offload(tmp_path):
    log = tb(
        ("/home/me/train.py", 40, "main", "out = model(batch)"),
        (f"{SP}/torch/nn/functional.py", 2551, "embedding", "return torch.embedding(weight, input)"),
        exc=_DEVICES,
    )
    c = first(tmp_path, log)
    assert "offload" not in (c.where or "") and not any("offload" in f.why for f in c.fixes), c.where


def test_a_cause_without_a_line_is_resolved_without_error():
    from verlaudit.analysis.causes import Cause
    from verlaudit.analysis.logs import culprit
    from verlaudit.analysis.logs.frameworks import LogContext
    from verlaudit.analysis.logs.scan import LogScan

    c = Cause("error", "exception", "Unrecognised failure: x", "x", where="w")
    culprit.resolve(c, LogScan([culprit.detect]).facts(), LogContext(None))
    assert c.where == "w"
