"""Reading verl launch scripts and Hydra YAML (verlaudit/verl/launch.py): shell variables, continuations,
comments, quotes, Hydra override syntax and values, lines remembered for the round trip. Run:
`pytest tests/test_verl_launch.py`."""

from __future__ import annotations

import os

import pytest
from hypothesis import given
from hypothesis import strategies as st

from verlaudit.verl.launch import parse_value, read_launch

SCRIPT = r"""#!/usr/bin/env bash
set -x
export VLLM_ATTENTION_BACKEND=XFORMERS
MODEL=Qwen/Qwen2.5-0.5B-Instruct   # the policy
DATA=${DATA_DIR:-$HOME/data/gsm8k}
LR="1e-6"
unused=$(date +%s)

python3 -m verl.trainer.main_ppo \
    algorithm.adv_estimator=grpo \
    data.train_files=$DATA/train.parquet \
    data.val_files="${DATA}/test.parquet" \
    actor_rollout_ref.model.path=$MODEL \
    actor_rollout_ref.actor.optim.lr=$LR \
    'trainer.logger=["console","wandb"]' \
    trainer.logger2=['console','wandb'] \
    +actor_rollout_ref.actor.fsdp_config.model_dtype=bfloat16 \
    ~trainer.val_before_train \
    trainer.project_name="my project" \
    custom_reward_function.path=$(pwd)/reward.py \
    trainer.default_local_dir=$(git rev-parse --show-toplevel)/ckpt \
    trainer.experiment_name=$UNSET_NAME \
    actor_rollout_ref.rollout.gpu_memory_utilization=0.6 2>&1 | tee log.txt
# after the command
python3 other.py
"""


@pytest.fixture
def launch(tmp_path):
    p = tmp_path / "run.sh"
    p.write_text(SCRIPT)
    return read_launch(p, env={"HOME": "/home/u"})


def test_overrides_values_and_lines(launch):
    by = {o.key: o for o in launch.overrides}
    assert launch.entry == "verl.trainer.main_ppo" and launch.kind == "script"
    assert by["algorithm.adv_estimator"].value == "grpo" and by["algorithm.adv_estimator"].line == 10
    assert (
        by["data.train_files"].value == "/home/u/data/gsm8k/train.parquet"
    )  # ${DATA_DIR:-$HOME/...} default
    assert by["data.val_files"].value == "/home/u/data/gsm8k/test.parquet"
    assert by["actor_rollout_ref.actor.optim.lr"].value == 1e-6  # Hydra's float, not YAML 1.1's string
    assert by["trainer.logger"].value == ["console", "wandb"]
    assert by["trainer.logger2"].value == ["console", "wandb"]  # unquoted: bash removes the single quotes
    assert by["trainer.project_name"].value == "my project"
    assert (
        by["actor_rollout_ref.rollout.gpu_memory_utilization"].value == 0.6
    )  # `2>&1 | tee` is not an override
    assert by["custom_reward_function.path"].value == os.getcwd() + "/reward.py"  # $(pwd): where we run
    assert len(launch.overrides) == 14


def test_ops_and_variables_remembered(launch):
    by = {o.key: o for o in launch.overrides}
    fsdp = by["actor_rollout_ref.actor.fsdp_config.model_dtype"]
    assert fsdp.op == "add" and fsdp.value == "bfloat16"
    assert by["trainer.val_before_train"].op == "delete"
    lr = by["actor_rollout_ref.actor.optim.lr"]
    assert (lr.var, lr.var_line, lr.var_line_text) == ("LR", 6, 'LR="1e-6"')
    assert lr.line_text == "    actor_rollout_ref.actor.optim.lr=$LR \\"
    assert by["data.train_files"].var is None  # $DATA/train.parquet is not the variable alone


def test_unresolvable_values_say_why(launch):
    by = {o.key: o for o in launch.overrides}
    ckpt = by["trainer.default_local_dir"]
    assert ckpt.value is None and "command substitution" in ckpt.problems[0]
    name = by["trainer.experiment_name"]
    assert name.problems == ("$UNSET_NAME is set neither in the script nor in the environment",)


def test_comment_ends_the_command_as_bash_does(tmp_path):
    p = tmp_path / "r.sh"
    p.write_text(
        "python3 -m verl.trainer.main_ppo \\\n  data.train_batch_size=8 \\\n"
        "  # trainer.logger=wandb \\\n  trainer.n_gpus_per_node=2\n"
    )
    launch = read_launch(p, env={})
    assert [o.key for o in launch.overrides] == ["data.train_batch_size"]
    assert any("bash ended the verl command before this line" in n for n in launch.notes)


def test_recipe_entry_ray_submit_and_no_command(tmp_path):
    p = tmp_path / "r.sh"
    p.write_text(
        "ray job submit --address=http://x:8265 -- python3 -m recipe.dapo.main_dapo \\\n"
        "  actor_rollout_ref.actor.clip_ratio_high=0.28\n"
    )
    launch = read_launch(p, env={})
    assert launch.entry == "recipe.dapo.main_dapo" and launch.overrides[0].value == 0.28
    assert any("a recipe's own trainer" in n for n in launch.notes)
    p.write_text("echo hello\n")
    with pytest.raises(ValueError, match="no verl trainer command found"):
        read_launch(p, env={})


def test_yaml_config_flattened_with_lines(tmp_path):
    p = tmp_path / "ppo.yaml"
    p.write_text(
        "defaults:\n  - _self_\ndata:\n  train_batch_size: 16\n  train_files: [a.parquet, b.parquet]\n"
        "actor_rollout_ref:\n  actor:\n    optim:\n      lr: 1e-6\n    fsdp_config:\n"
        "      model_dtype: 'fp32'\n"
    )
    launch = read_launch(p)
    by = {o.key: o for o in launch.overrides}
    assert launch.kind == "yaml" and by["data.train_batch_size"].value == 16
    assert by["data.train_files"].value == ["a.parquet", "b.parquet"]
    assert (
        by["actor_rollout_ref.actor.optim.lr"].value == 1e-6
        and by["actor_rollout_ref.actor.optim.lr"].line == 9
    )
    assert by["actor_rollout_ref.actor.fsdp_config.model_dtype"].value == "fp32"
    assert any("defaults list is not expanded" in n for n in launch.notes)


def test_parse_value_by_hand():
    assert parse_value("null") is None and parse_value("True") is True and parse_value("false") is False
    assert parse_value("3") == 3 and parse_value(".5") == 0.5 and parse_value("1e-6") == 1e-6
    assert parse_value("'42'") == "42" and parse_value("bfloat16") == "bfloat16"
    assert parse_value("[a, 'b,c', [1,2]]") == ["a", "b,c", [1, 2]]
    assert parse_value("{k: 1, m: [x]}") == {"k": 1, "m": ["x"]}
    assert parse_value("") == ""


@given(st.one_of(st.integers(-(10**12), 10**12), st.floats(allow_nan=False, allow_infinity=False)))
def test_parse_value_reads_numbers_back(x):
    assert parse_value(repr(x)) == x and type(parse_value(repr(x))) is type(x)
