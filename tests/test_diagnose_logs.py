"""`verlaudit diagnose` on foreign logs written inline (verl, HF Trainer, TRL, DeepSpeed, apex, PyTorch
wordings); the real-log corpus is scored by tests/test_log_corpus.py and the rule families by
tests/test_log_rules.py. Run: `pytest tests/test_diagnose_logs.py`."""

import math

import pytest

from verlaudit.analysis.diagnose.diagnosis import diagnose_path


def run_cli(argv):
    """`verlaudit diagnose ...` through the real command line (ValueError -> one-line error, exit 2)."""
    from verlaudit import cli

    return cli.main(["diagnose", *argv])


def causes(path):
    (d,) = diagnose_path(path)
    return d


VERL_OOM = """\
(WorkerDict pid=1234) Traceback (most recent call last):
  File "/opt/verl/verl/workers/fsdp_workers.py", line 612, in update_actor
    metrics = self.actor.update_policy(data=data)
  File "/opt/verl/verl/workers/actor/dp_actor.py", line 380, in update_policy
    loss.backward()
  File "/usr/lib/python3/site-packages/torch/_tensor.py", line 626, in backward
torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 7.81 GiB. GPU 0 has a total capacity of 79.15 GiB of \
which 1.23 GiB is free. Including non-PyTorch memory, this process has 77.91 GiB memory in use. Of the allocated \
memory 60.12 GiB is allocated by PyTorch, and 16.96 GiB is reserved by PyTorch but unallocated. If reserved but \
unallocated memory is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.
"""


def test_log_verl_oom(tmp_path):
    p = tmp_path / "verl.log"
    p.write_text(VERL_OOM)
    (d,) = diagnose_path(p)
    c = d.causes[0]
    # the phase from the frames (update_policy -> backward); the culprit is the innermost user frame's call, with
    # its file, and the key that bounds the update's memory (`verlaudit.analysis.logs.culprit`)
    assert d.source_kind == "log" and c.kind == "oom" and c.phase == "update"
    assert (
        c.where.startswith("update_policy: loss.backward (verl/workers/actor/dp_actor.py:380)")
        and c.framework == "verl"
    )
    assert "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu" in c.where
    assert c.data["tried_gib"] == 7.81 and c.data["reserved_unallocated_gib"] == 16.96
    assert "fragmentation" in c.what  # 16.96 reserved-unallocated vs 60.12 allocated
    assert any("memory classes" in u for u in c.unknown)
    assert any(f.verl and "enable_gradient_checkpointing" in f.verl for f in c.fixes)


def test_log_old_oom_format(tmp_path):
    p = tmp_path / "old.log"
    p.write_text(
        "RuntimeError: CUDA out of memory. Tried to allocate 20.00 MiB (GPU 0; 15.78 GiB total capacity; "
        "14.56 GiB already allocated; 3.06 MiB free; 14.75 GiB reserved in total by PyTorch)\n"
    )
    c = diagnose_path(p)[0].causes[0]
    assert c.kind == "oom" and c.data["total_gib"] == 15.78
    assert math.isclose(c.data["reserved_unallocated_gib"], 0.19)  # 14.75 - 14.56


@pytest.mark.parametrize(
    "line, observed, expected",
    [
        ("RuntimeError: expected scalar type BFloat16 but found Float", "fp32", "bf16"),
        ("RuntimeError: mat1 and mat2 must have the same dtype, but got Float and BFloat16", "fp32", "bf16"),
        (
            "RuntimeError: expected m1 and m2 to have the same dtype, but got: float != c10::Half",
            "fp32",
            "fp16",
        ),
        (
            "RuntimeError: Input type (torch.cuda.FloatTensor) and weight type (torch.cuda.HalfTensor) should be the same",
            "fp32",
            "fp16",
        ),
        ("TypeError: Got unsupported ScalarType BFloat16", "bf16", "fp32"),
    ],
)
def test_log_dtype_errors(tmp_path, line, observed, expected):
    p = tmp_path / "trl.log"
    p.write_text(f'Traceback (most recent call last):\n  File "train_grpo.py", line 40, in main\n{line}\n')
    (d,) = diagnose_path(p)
    c = d.causes[0]
    assert c.kind == "dtype_error" and c.data["observed"] == observed and c.data["expected"] == expected
    assert any("train_grpo.py" in e for e in c.evidence)
    assert c.unknown  # a log cannot name the module


def test_log_device_mismatch(tmp_path):
    p = tmp_path / "x.log"
    p.write_text(
        "RuntimeError: Expected all tensors to be on the same device, but found at least two devices, "
        "cuda:0 and cpu!\n"
    )
    assert diagnose_path(p)[0].causes[0].kind == "device_mismatch"


def test_log_compile_error_names_the_code_dynamo_was_tracing(tmp_path):
    p = tmp_path / "x.log"
    p.write_text(
        "torch._dynamo.exc.Unsupported: Unsupported Tensor.requires_grad_() call\n\nfrom user code:\n"
        '   File "/app/model.py", line 381, in forward\n    inputs_embeds = self.embed_tokens(input_ids)\n'
    )
    c = diagnose_path(p)[0].causes[0]
    assert c.kind == "compile_error"
    assert 'while tracing File "/app/model.py", line 381, in forward' in c.evidence


def test_log_verl_nan_metrics_first_step(tmp_path):
    p = tmp_path / "verl.log"
    p.write_text(
        "step:1 - actor/pg_loss:-0.013 - critic/vf_loss:0.52 - critic/score/mean:0.594\n"
        "step:2 - actor/pg_loss:0.010 - critic/vf_loss:nan - critic/score/mean:0.601\n"
        "step:3 - actor/pg_loss:nan - critic/vf_loss:nan\n"
    )
    (d,) = diagnose_path(p)
    c = d.causes[0]
    assert c.kind == "nonfinite" and c.step == 2 and "critic/vf_loss" in c.evidence[0]
    assert any("first module" in u for u in c.unknown)


def test_log_hf_trainer_nan(tmp_path):
    p = tmp_path / "trl.log"
    p.write_text(
        "{'loss': 0.6931, 'grad_norm': 1.2, 'learning_rate': 5e-07, 'epoch': 0.01}\n"
        "{'loss': nan, 'grad_norm': nan, 'learning_rate': 1e-06, 'epoch': 0.02}\n"
    )
    assert diagnose_path(p)[0].causes[0].kind == "nonfinite"


def test_log_deepspeed_overflow_collapse(tmp_path):
    lines = [
        f"[INFO] [loss_scaler.py:183:update_scale] [deepspeed] OVERFLOW! Rank 0 Skipping step. "
        f"Attempted loss scale: {2 ** (16 - i)}, reducing to {2 ** (15 - i)}"
        for i in range(16)
    ]
    lines.append(
        "Exception: Current loss scale already at minimum - cannot decrease scale anymore. Exiting run."
    )
    p = tmp_path / "ds.log"
    p.write_text("\n".join(lines))
    c = diagnose_path(p)[0].causes[0]
    assert c.kind == "loss_scale_collapse" and "65536 -> 1" in c.evidence[0]


def test_log_apex_few_overflows_are_info(tmp_path):
    p = tmp_path / "apex.log"
    p.write_text(
        "Gradient overflow.  Skipping step, loss scaler 0 reducing loss scale to 32768.0\n"
        "Gradient overflow.  Skipping step, loss scaler 0 reducing loss scale to 16384.0\n"
    )
    (d,) = diagnose_path(p)
    assert d.verdict == "clean" and d.causes[0].kind == "overflow_skips"
    assert run_cli([str(p)]) == 0


def test_log_with_nothing_recognised(tmp_path):
    p = tmp_path / "ok.log"
    p.write_text("epoch 1 done\n")
    (d,) = diagnose_path(p)
    assert d.verdict == "clean" and d.causes == []


def test_trl_log_with_nan_grad_norm_from_the_first_record(tmp_path):
    # TRL 1.16 / transformers 5 print their log dicts with quoted values
    log = tmp_path / "grpo.log"
    log.write_text(
        "[INFO] Starting GRPO training\n"
        "{'loss': '0.0021', 'grad_norm': 'nan', 'learning_rate': '1e-06', 'reward': '0.5', 'epoch': '0.2'}\n"
        "{'loss': '0.0018', 'grad_norm': 'nan', 'learning_rate': '1e-06', 'reward': '0.49', 'epoch': '0.4'}\n"
    )
    (d,) = diagnose_path(log)
    top = d.causes[0]
    assert d.state == "failed" and top.kind == "nonfinite" and "with a finite loss" in top.title
    assert "left padding" in top.what and "line 2" in top.evidence[0]
    # a NaN loss later in the log is divergence-shaped: the generic cause
    log.write_text(
        "{'loss': '0.69', 'grad_norm': '1.2', 'epoch': '0.2'}\n{'loss': 'nan', 'grad_norm': 'nan', 'epoch': '0.4'}\n"
    )
    top = diagnose_path(log)[0].causes[0]
    assert top.kind == "nonfinite" and "with a finite loss" not in top.title and top.step == 2
