"""The verl worker module on verl's own classes, on CPU, without Ray or a rollout engine: verl 0.9.1's
FSDP2 `TrainingWorker` computes old log-probs and runs a PPO update on a tiny model, and a
`NaiveRewardManager` scores with a user function; the module audits them in place and writes a run
directory per role. Needs verl (its own environment: it pins an older transformers), so it skips
where verl is not installed; `tests/verl_cpu.py` holds the CPU scaffolding.
Run: `.venv-verl/bin/python -m pytest tests/test_integrations_verl.py`."""

from __future__ import annotations

import os
import socket
from functools import partial

import pytest
import torch

verl = pytest.importorskip("verl")

import numpy as np  # noqa: E402
import torch.distributed as dist  # noqa: E402
import verl_cpu  # noqa: E402  (tests/ is on sys.path: pytest puts a test file's folder there)
from transformers import AutoModelForCausalLM  # noqa: E402

from trainer.config import ModelConfig  # noqa: E402
from trainer.models import preset_config  # noqa: E402
from trainer.tokenizer import build_tokenizer  # noqa: E402
from verlaudit.analysis.diagnose.diagnosis import diagnose_path  # noqa: E402
from verlaudit.rundir import read_run  # noqa: E402


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    out = tmp_path_factory.mktemp("verl_runs")
    saved = dict(os.environ)
    os.environ.update(verl_cpu.ENGINE_ENV, MASTER_PORT=str(_port()), VERLAUDIT_OUT=str(out))
    verl_cpu.use_cpu()
    dist.init_process_group("gloo", rank=0, world_size=1)
    from verlaudit.integrations import verl as adapter

    adapter.install()
    tok = build_tokenizer()
    path = tmp_path_factory.mktemp("tiny")
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(preset_config(ModelConfig(preset="tiny-llama"), tok)).save_pretrained(
        path
    )
    tok.save_pretrained(path)
    yield {"out": out, "model": str(path), "tok": tok, "adapter": adapter}
    adapter.close_all()
    dist.destroy_process_group()
    os.environ.clear()
    os.environ.update(saved)


def worker(model_path, *, param_dtype):
    from verl.workers.config import FSDPEngineConfig, FSDPOptimizerConfig, HFModelConfig
    from verl.workers.engine_workers import TrainingWorker, TrainingWorkerConfig

    engine = FSDPEngineConfig(
        forward_only=False,
        fsdp_size=1,
        strategy="fsdp2",
        use_dynamic_bsz=True,
        max_token_len_per_gpu=512,
        infer_max_token_len_per_gpu=512,
        mixed_precision={"param_dtype": param_dtype, "reduce_dtype": "fp32", "buffer_dtype": "fp32"},
    )
    model = HFModelConfig(path=model_path, override_config={"attn_implementation": "sdpa"})
    w = TrainingWorker(
        TrainingWorkerConfig(
            model_type="language_model",
            model_config=model,
            engine_config=engine,
            optimizer_config=FSDPOptimizerConfig(lr=1e-3),
            checkpoint_config=None,
        )
    )
    w.reset()
    return w


def ppo_steps(w, tok, steps):
    from verl import DataProto
    from verl.utils import tensordict_utils as tu
    from verl.utils.model import compute_position_id_with_mask
    from verl.workers.config import ActorConfig
    from verl.workers.utils.losses import ppo_loss
    from verl.workers.utils.padding import left_right_2_no_padding, no_padding_2_padding

    w.set_loss_fn(
        partial(ppo_loss, config=ActorConfig(strategy="fsdp2", rollout_n=1, ppo_micro_batch_size_per_gpu=-1))
    )
    g = torch.Generator().manual_seed(0)
    for _ in range(steps):
        ids = torch.randint(4, len(tok), (4, 16), generator=g)
        mask = torch.ones_like(ids)
        data = DataProto.from_single_dict(
            {
                "input_ids": ids,
                "prompts": ids[:, :8],
                "attention_mask": mask,
                "position_ids": compute_position_id_with_mask(mask),
                "responses": ids[:, 8:],
                "response_mask": mask[:, 8:],
            },
            meta_info={"temperature": 1.0, "global_token_num": mask.sum(-1).tolist(), "compute_loss": False},
        )
        td = left_right_2_no_padding(data.to_tensordict())
        lp = no_padding_2_padding(tu.get(w.infer_batch(td), "log_probs"), td)
        data = data.union(DataProto.from_single_dict({"old_log_probs": lp.float()}))
        data.batch["advantages"] = torch.randn(4, 8, generator=g)
        data.batch["ref_log_prob"] = lp.float()
        td = left_right_2_no_padding(data.to_tensordict())
        tu.assign_non_tensor(td, global_batch_size=td.shape[0])
        w.train_batch(td)


def test_fp32_actor_is_audited_in_place_and_clean(env, tmp_path):
    os.environ["VERLAUDIT_OUT"] = str(tmp_path)
    w = worker(env["model"], param_dtype="fp32")
    ppo_steps(w, env["tok"], steps=2)
    env["adapter"].close_all()
    run = read_run(tmp_path / "actor")
    assert run.state == "completed" and [m["step"] for m in run.metrics] == [0, 1]
    assert "actor/pg_loss" in run.metrics[-1] and "actor/grad_norm" in run.metrics[-1]
    assert run.manifest["policy"]["roles"]["actor"]["compute_dtype"] == "fp32"
    assert [(f.severity, f.kind) for f in run.findings if f.severity != "info"] == []
    assert {e["phase"] for e in run.events if e["kind"] == "phase_start"} == {"actor_update"}
    (d,) = diagnose_path(tmp_path / "actor")
    assert d.verdict == "clean", [c.title for c in d.causes]


def test_bf16_engine_on_cpu_hands_back_bf16_old_logprobs(env, tmp_path):
    # verl's default mixed precision computes in bf16; on a CPU its log-probs come from the naive
    # log-softmax of the bf16 logits and cross into the algorithm in bf16: the audit says so
    os.environ["VERLAUDIT_OUT"] = str(tmp_path)
    w = worker(env["model"], param_dtype="bf16")
    ppo_steps(w, env["tok"], steps=1)
    env["adapter"].close_all()
    run = read_run(tmp_path / "actor")
    assert run.manifest["policy"]["preset"] == "bf16"
    (f,) = [f for f in run.findings if f.kind == "dtype/island"]
    assert f.where == "old_logprobs" and f.observed == "bf16" and f.severity == "error"


def test_reward_manager_score_function_is_the_reward_boundary(env, tmp_path):
    from verl import DataProto
    from verl.workers.reward_manager.naive import NaiveRewardManager

    os.environ["VERLAUDIT_OUT"] = str(tmp_path)

    def my_score(data_source, solution_str, ground_truth, extra_info=None):
        return np.float64(len(solution_str) % 3)

    tok = env["tok"]
    ids = torch.randint(4, len(tok), (2, 8))
    data = DataProto.from_dict(
        tensors={"prompts": ids[:, :4], "responses": ids[:, 4:], "attention_mask": torch.ones_like(ids)},
        non_tensors={
            "reward_model": np.array([{"ground_truth": "1"}] * 2, dtype=object),
            "data_source": np.array(["t"] * 2, dtype=object),
        },
    )
    NaiveRewardManager(tokenizer=tok, num_examine=0, compute_score=my_score)(data)
    env["adapter"].close_all()
    run = read_run(tmp_path / "reward")
    (f,) = [f for f in run.findings if f.kind == "boundary/reward_dtype"]
    assert f.where == "reward:function:verl:my_score" and f.observed == "fp64 (numpy)"
    (d,) = diagnose_path(tmp_path / "reward")
    cause = next(c for c in d.causes if c.kind == "finding:boundary/reward_dtype")
    assert cause.fixes[0].suite == "data.compute_score (my_score)"
