"""Session 13's log families (logs13 branch): the category of a pasted log's failure follows from who raised it
and in which phase, and a failure is never called clean. Each family's members are the excerpts of
tests/fixtures/logs_dev13 (written in the libraries' own message formats, at least three a family, with healthy
neighbours), then neighbours inline that must not be taken for a member: the same words from the user's own
code, a signal after a worker's own error, a version name another library imports, a ratio at 1.
Run: `pytest tests/test_log_families13.py`."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.diagnose_corpus import ACCEPTED_KINDS, read_fixture
from verlaudit.analysis.diagnose.diagnosis import diagnose_path

DEV13 = Path(__file__).parent / "fixtures" / "logs_dev13"
FIXTURES = sorted(DEV13.glob("*.log"))


def diagnose_text(tmp_path: Path, text: str):
    p = tmp_path / "train.log"
    p.write_text(text)
    (d,) = diagnose_path(p)
    return d


def errors(d) -> list:
    return [c for c in d.causes if c.severity == "error"]


def test_every_family_has_three_members_and_there_are_controls() -> None:
    cats: dict[str, int] = {}
    for p in FIXTURES:
        cats[read_fixture(p).category] = cats.get(read_fixture(p).category, 0) + 1
    for cat in (
        "killed",
        "weight_sync",
        "mismatch",
        "oom_host",
        "engine_feature",
        "import_error",
        "nccl_timeout",
        "engine_error",
        "ray_actor_died",
        "version_mismatch",
    ):
        assert cats.get(cat, 0) >= 3, cat
    assert cats.get("clean", 0) >= 5


@pytest.mark.parametrize("path", FIXTURES, ids=lambda p: p.stem)
def test_dev13_fixture_category(tmp_path: Path, path: Path) -> None:
    fx = read_fixture(path)
    d = diagnose_text(tmp_path, fx.body)
    if fx.is_control:
        assert not [c for c in d.causes if c.severity in ("error", "warning")], [c.title for c in d.causes]
        return
    first = next(c for c in d.causes if c.severity in ("error", "warning"))
    assert first.kind in ACCEPTED_KINDS[fx.category], (first.kind, first.title)


def _first(tmp_path: Path, name: str):
    fx = read_fixture(DEV13 / f"{name}.log")
    return next(c for c in diagnose_text(tmp_path, fx.body).causes if c.severity in ("error", "warning"))


# ---- what each family's first cause says (where, phase)
def test_sigterm_kill_names_the_signal_and_the_phase(tmp_path: Path) -> None:
    c = _first(tmp_path, "accelerate_killed_sigterm_while_loading_shards_13b")
    assert c.kind == "killed" and c.data["signal"] == "SIGTERM" and c.phase == "init"
    assert any("no worker printed an error" in e for e in c.evidence)
    assert _first(tmp_path, "pytorch_killed_sigterm_agent_checkpoint_save").phase == "checkpoint"


def test_nccl_timeout_in_a_weight_update_keeps_the_weight_update_as_phase(tmp_path: Path) -> None:
    for name in (
        "verl_nccl_timeout_socket_connect_update_weights",
        "openrlhf_nccl_timeout_ib_connect_broadcast_to_vllm",
    ):
        c = _first(tmp_path, name)
        assert (c.kind, c.phase) == ("nccl_timeout", "weight_sync"), (name, c.title)
        assert "update_weight" in c.where


def test_engine_not_implemented_names_the_engine_and_its_call(tmp_path: Path) -> None:
    c = _first(tmp_path, "trl_engine_feature_vllm_v1_collective_rpc_not_implemented")
    assert c.kind == "engine_feature" and c.where.startswith("vllm collective_rpc")
    assert c.phase == "weight_sync"  # the route the trainer reached the server by: init_communicator
    c = _first(tmp_path, "sglang_engine_feature_update_weights_from_tensor_not_implemented")
    assert (
        c.kind == "engine_feature" and c.where.startswith("sglang load_weights") and c.phase == "weight_sync"
    )


def test_actor_dead_in_its_creation_task_names_its_init_frame(tmp_path: Path) -> None:
    c = _first(tmp_path, "verl_ray_actor_died_workerdict_init_creation_task")
    assert c.kind == "ray_actor_died" and c.phase == "init"
    assert c.where.startswith("WorkerDict.__init__") and "fsdp_workers.py:118" in c.where


def test_plain_value_in_a_library_frame_names_the_library(tmp_path: Path) -> None:
    c = _first(tmp_path, "trl_version_mismatch_str_model_id_old_trainer")
    assert c.kind == "version_mismatch" and c.where.startswith("trl (str.config)")


def test_own_version_import_is_a_broken_install_not_a_version_pair(tmp_path: Path) -> None:
    c = _first(tmp_path, "vllm_import_error_version_tuple_partial_upgrade")
    assert c.kind == "import_error" and "broken install" in c.title and c.where == "vllm"


def test_printed_is_ratios_read_as_mean_max_r_inverse_r(tmp_path: Path) -> None:
    c = _first(tmp_path, "openrlhf_mismatch_printed_importance_weights_below_one")
    assert c.kind == "mismatch" and c.where == "importance weights"
    vals = [0.412, 0.455, 0.391, 0.508, 0.47, 0.433]
    assert c.data["token_mult_prob_error"] == pytest.approx(sum(1 / v for v in vals) / len(vals))
    assert any("below 1" in e for e in c.evidence)


def test_old_ray_memory_monitor_is_host_ram_not_cuda(tmp_path: Path) -> None:
    d = diagnose_text(
        tmp_path,
        (DEV13 / "ray_oom_host_memory_monitor_old_wording_rollout_workers.log").read_text(),
    )
    assert [c.kind for c in errors(d)] == ["oom_host"]
    assert errors(d)[0].where.startswith("PPO.train()")


# ---- neighbours that are not members
def test_not_implemented_in_the_users_own_code_is_not_an_engine_feature(tmp_path: Path) -> None:
    d = diagnose_text(
        tmp_path,
        "Traceback (most recent call last):\n"
        '  File "/home/u/rl/train.py", line 40, in <module>\n'
        "    trainer.step()\n"
        '  File "/home/u/rl/my_trainer.py", line 12, in step\n'
        "    raise NotImplementedError\n"
        "NotImplementedError\n",
    )
    assert errors(d) and all(c.kind != "engine_feature" for c in errors(d))


def test_plain_value_error_in_the_users_own_frame_is_not_a_version_mismatch(tmp_path: Path) -> None:
    d = diagnose_text(
        tmp_path,
        "Traceback (most recent call last):\n"
        '  File "/home/u/rl/train.py", line 40, in <module>\n'
        "    print(cfg.name)\n"
        "AttributeError: 'str' object has no attribute 'name'\n",
    )
    assert errors(d) and all(c.kind != "version_mismatch" for c in errors(d))


def test_sigterm_after_a_workers_own_error_is_the_cascade(tmp_path: Path) -> None:
    d = diagnose_text(
        tmp_path,
        "Traceback (most recent call last):\n"
        '  File "/home/u/train.py", line 88, in <module>\n'
        "    loss.backward()\n"
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of "
        "79.15 GiB of which 1.02 GiB is free.\n"
        "W1202 10:14:07.121554 140211 torch/distributed/elastic/multiprocessing/api.py:897] Sending process "
        "140306 closing signal SIGTERM\n",
    )
    assert errors(d)[0].kind == "oom"
    assert not any(c.kind == "killed" and c.data.get("signal") == "SIGTERM" for c in errors(d))


def test_a_name_another_library_imports_stays_a_version_pair(tmp_path: Path) -> None:
    d = diagnose_text(
        tmp_path,
        "Traceback (most recent call last):\n"
        '  File "/opt/conda/lib/python3.10/site-packages/trl/extras/vllm_client.py", line 30, in <module>\n'
        "    from vllm.distributed.utils import StatelessProcessGroup\n"
        "ImportError: cannot import name 'StatelessProcessGroup' from 'vllm.distributed.utils' "
        "(/opt/conda/lib/python3.10/site-packages/vllm/distributed/utils.py)\n",
    )
    assert errors(d)[0].kind == "version_mismatch"


def test_a_warned_extension_load_alone_stays_a_warning(tmp_path: Path) -> None:
    d = diagnose_text(
        tmp_path,
        "WARNING 01-30 20:57:18 _custom_ops.py:14] Failed to import from vllm._C with ImportError('/x/vllm/_C.abi3.so: "
        "undefined symbol: _ZNK3c1011StorageImpl27throw_data_ptr_access_errorEv')\n"
        "INFO 01-30 20:57:20 llm_engine.py:100] Initializing an LLM engine\n",
    )
    assert not errors(d)
    assert [c.kind for c in d.causes if c.severity == "warning"] == ["import_error"]


def test_a_cuda_fault_under_sync_frames_is_a_kernel_fault_not_a_mismatch(tmp_path: Path) -> None:
    d = diagnose_text(
        tmp_path,
        "Traceback (most recent call last):\n"
        '  File "/opt/verl/verl/workers/sharding_manager/fsdp_vllm.py", line 210, in update_params\n'
        "    model.load_weights(updated_params)\n"
        '  File "/usr/local/lib/python3.10/dist-packages/vllm/model_executor/models/llama.py", line 500, in load_weights\n'
        "    param.copy_(loaded_weight)\n"
        "RuntimeError: CUDA error: an illegal memory access was encountered\n",
    )
    assert errors(d)[0].kind == "cuda_error"


@pytest.mark.parametrize(
    "line, warned",
    [
        ("[DEBUG] IS ratio: tensor([1.02, 0.98, 1.01])", False),  # mean max(r, 1/r) ~1.017
        ("importance_sampling_ratio = 1.03", False),
        ("is_ratio_clip: 2.0", False),  # a setting, not a value
        ("sampling/importance_sampling_ratio/max: 9.0", False),  # a metric key: the table's, a batch max
        ("IS ratio: tensor([1.3, 0.7, 1.2, 0.8])", True),  # both sides of 1: mean max(r, 1/r) ~1.28
        ("importance weights: [3.1]", True),
    ],
)
def test_printed_ratio_neighbours(tmp_path: Path, line: str, warned: bool) -> None:
    d = diagnose_text(tmp_path, f"step 1\n{line}\n")
    assert any(c.kind == "mismatch" for c in d.causes) is warned, [c.title for c in d.causes]


@pytest.mark.parametrize(
    "line",
    [
        "IS ratio std: 0.31",
        "log IS ratio: 0.5",
        "importance ratio clipped fraction: 0.2",
        "IS ratio ess: 0.4",
    ],
)
def test_a_statistic_of_the_ratios_is_not_a_ratio(tmp_path: Path, line: str) -> None:
    d = diagnose_text(tmp_path, f"step 3\n{line}\n")
    assert not any(c.kind == "mismatch" for c in d.causes), [c.title for c in d.causes]


def test_sigterm_after_a_worker_that_exited_on_its_own_is_not_a_kill(tmp_path: Path) -> None:
    d = diagnose_text(
        tmp_path,
        "W1202 10:14:07.121554 140211 torch/distributed/elastic/multiprocessing/api.py:897] Sending process "
        "140306 closing signal SIGTERM\n"
        "E1202 10:14:08.551203 140211 torch/distributed/elastic/multiprocessing/api.py:869] failed (exitcode: 1) "
        "local_rank: 0 (pid: 140305) of binary: /usr/bin/python\n",
    )
    assert errors(d) and not any(c.kind == "killed" for c in errors(d)), [c.title for c in d.causes]


def test_a_loggers_prefix_does_not_hide_a_printed_ratio(tmp_path: Path) -> None:
    d = diagnose_text(
        tmp_path,
        "[2026-12-02 10:00:00,001] [INFO] [logging.py:128:log_dist] [Rank 0] IS ratio: tensor([2.0, 1.9])\n",
    )
    assert [c.where for c in d.causes if c.kind == "mismatch"] == ["IS ratio"]


def test_a_cuda_fault_in_the_engines_forward_is_placed_in_generation(tmp_path: Path) -> None:
    for name in (
        "sglang_engine_error_illegal_memory_access_forward_decode",
        "vllm_engine_error_illegal_memory_access_execute_model_generate",
        "verl_engine_error_misaligned_address_sglang_sharding_exit",
    ):
        c = _first(tmp_path, name)
        assert (c.kind, c.phase) == ("cuda_error", "generate"), (name, c.title, c.phase)
