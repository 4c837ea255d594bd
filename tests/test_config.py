"""Tests for trainer/config.py: from_dict/to_dict round-trips (hypothesis) and field-path errors.

Run: PYTHONPATH=. pytest -q tests/test_config.py
"""

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trainer.config import ALGORITHMS, TrainConfig
from trainer.precision import PRESETS


@st.composite
def config_dicts(draw):
    micro = draw(st.integers(1, 8))
    mini = micro * draw(st.integers(1, 4))
    d = {
        "algo": {
            "name": draw(st.sampled_from(ALGORITHMS)),
            "lr": draw(st.floats(1e-7, 1.0)),
            "batch_size": draw(st.integers(1, 64)),
            "mini_batch_size": mini,
            "micro_batch_size": micro,
            "kl_coef": draw(st.floats(0.0, 1.0)),
            "kl_estimator": draw(st.sampled_from(["k1", "k3"])),
            "kl_in_reward": draw(st.booleans()),
            "gamma": draw(st.floats(0.0, 1.0)),
        },
        "precision": {
            "preset": draw(st.sampled_from(PRESETS)),
            "grad_checkpointing": draw(st.booleans()),
        },
        "data": {
            "prompt_length": draw(st.integers(1, 64)),
            "task": draw(st.sampled_from(["digits", "sort"])),
        },
        "model": {
            "overrides": draw(
                st.dictionaries(st.sampled_from(["num_hidden_layers", "hidden_size"]), st.integers(1, 8))
            )
        },  # fmt: skip
        "steps": draw(st.integers(1, 1000)),
        "seed": draw(st.integers(0, 2**31)),
        "device": draw(st.sampled_from(["auto", "cpu", "cuda", "cuda:1"])),
    }
    if draw(st.booleans()):
        d["precision"]["overrides"] = {"reference": {"param_dtype": "fp32"}}
    return d


@settings(max_examples=60, deadline=None)
@given(config_dicts())
def test_round_trip(d):
    cfg = TrainConfig.from_dict(d)
    again = TrainConfig.from_dict(cfg.to_dict())
    assert again == cfg
    # plain data all the way down: survives JSON (what manifests and worker specs carry)
    assert TrainConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg
    for section in ("algo", "data"):
        for key, value in d[section].items():
            assert cfg.to_dict()[section][key] == value


def test_defaults_are_valid_and_documented():
    cfg = TrainConfig()
    assert cfg.algo.name == "ppo" and cfg.precision.preset == "fp32"
    assert TrainConfig.from_dict({}) == cfg


@pytest.mark.parametrize(
    ("data", "where", "expected"),
    [
        ({"algo": {"lrr": 1}}, "", "algo.lrr: unknown key; expected one of"),
        ({"algo": {"lr": "x"}}, "variants.bf16", "variants.bf16.algo.lr: expected a number, got 'x'"),
        ({"algo": {"lr": -1.0}}, "", "algo.lr: must be > 0"),
        ({"algo": {"batch_size": 0}}, "", "algo.batch_size: must be >= 1, got 0"),
        ({"algo": {"name": "a2c"}}, "", "algo.name: unknown algorithm 'a2c'"),
        ({"algo": {"mini_batch_size": 8, "micro_batch_size": 3}}, "", "algo.micro_batch_size: 3 must divide"),
        ({"precision": {"preset": "bf61"}}, "v", "v.precision.preset: unknown preset 'bf61'"),
        ({"precision": {"overrides": {"critc": {}}}}, "", "precision.overrides: unknown role 'critc'"),
        (
            {"precision": {"overrides": {"critic": {"compute_dtype": "fp8"}}}},
            "",
            "precision.overrides.critic.compute_dtype: unknown dtype 'fp8'",
        ),
        ({"model": {"overrides": 3}}, "", "model.overrides: expected a mapping"),
        ({"steps": True}, "", "steps: expected an integer, got True"),
        ({"device": "tpu"}, "", "device: 'tpu'; expected auto, cpu, cuda"),
        ({"data": {"response_length": 0}}, "", "data.response_length: must be > 0"),
        ({"algo": []}, "", "algo: expected a mapping"),
    ],
)
def test_errors_name_the_field_path(data, where, expected):
    with pytest.raises(ValueError) as info:
        TrainConfig.from_dict(data, where=where)
    assert str(info.value).startswith(expected), str(info.value)


def test_yaml_strings_for_numbers_are_read():
    # PyYAML reads 1e-6 (no dot) as a string; the config accepts it as a number
    assert TrainConfig.from_dict({"algo": {"lr": "1e-6"}}).algo.lr == 1e-6
