"""verl's configuration keys live in verlaudit/verl_keys.py only: the run diagnosis, the log parser and
every log rule module (verlaudit/analysis/logs/*.py) name the same fix the same way.
Run: `pytest tests/test_verl_keys.py`."""

import re
from pathlib import Path

import pytest

from verlaudit import verl_keys as V
from verlaudit.analysis.diagnose.diagnosis import diagnose_path

_ROOT = Path(__file__).resolve().parents[1] / "verlaudit" / "analysis"


_MODULES = sorted(f"{d}/{p.name}" for d in ("diagnose", "logs") for p in (_ROOT / d).glob("*.py"))


@pytest.mark.parametrize("module", _MODULES)
def test_no_verl_key_is_spelled_outside_verl_keys(module):
    # a string literal holding a verl section path, e.g. "actor_rollout_ref.actor.grad_clip=1.0"
    sections = r"(?:actor_rollout_ref|critic|reward_model|algorithm|trainer)\.\w+"
    literals = re.findall(r"[\"'][^\"'\n]*\b" + sections + r"[^\"'\n]*[\"']", (_ROOT / module).read_text())
    assert literals == []


def test_role_keys_follow_verls_sections():
    # verl 0.5 ppo_trainer.yaml: the actor's fsdp_config sits under actor_rollout_ref.actor, the
    # critic's under critic.model; micro-batches under the worker, checkpointing under the model
    assert (
        V.param_dtype("actor", "bf16")
        == "actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype=bf16"
    )
    assert V.param_dtype("critic", "bf16") == "critic.model.fsdp_config.mixed_precision.param_dtype=bf16"
    assert V.grad_ckpt("critic") == "critic.model.enable_gradient_checkpointing=True"
    assert V.GRAD_CKPT == "actor_rollout_ref.model.enable_gradient_checkpointing=True"
    assert V.micro_batch("critic") == "critic.ppo_micro_batch_size_per_gpu"
    assert V.MICRO_BATCH == "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu"


def test_dtype_error_fixes_are_the_same_for_a_log_and_a_run(tmp_path):
    from tests.diagnose_runs import make_run

    msg = "RuntimeError: expected scalar type BFloat16 but found Float"
    log = tmp_path / "x.log"
    log.write_text(msg + "\n")
    run = make_run(
        tmp_path / "run",
        preset="fp32",
        metrics=[],
        status=("failed", {"reason": "dtype_error", "error": msg}),
    )
    from_log = diagnose_path(log)[0].causes[0]
    from_run = next(c for c in diagnose_path(run)[0].causes if c.kind == "dtype_error")
    assert from_log.fixes == from_run.fixes
    assert from_run.fixes[1].suite == "precision.overrides.<role>.compute_dtype: fp32"  # the observed dtype
