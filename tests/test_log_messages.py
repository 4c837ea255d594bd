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
    assert (
        problems(tmp_path, "INFO: set the tensor's grad_dtype attribute to None to allow any dtype\n") == []
    )
