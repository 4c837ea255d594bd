"""Tests for trainer/config.py: from_dict/to_dict round-trips (hypothesis), field-path errors, verl's
defaults for the algorithm keys, and the errors for renamed or unused keys.

Run: PYTHONPATH=. pytest -q tests/test_config.py
"""

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trainer.advantages import ADV_ESTIMATORS
from trainer.config import ALGORITHMS, AlgoConfig, TrainConfig
from trainer.losses import DPO_LOSSES, KL_ESTIMATORS, LOSS_AGG_MODES, POLICY_LOSSES
from trainer.precision import PRESETS


@st.composite
def config_dicts(draw):
    micro = draw(st.integers(1, 8))
    mini = micro * draw(st.integers(1, 4))
    name = draw(st.sampled_from(ALGORITHMS))
    algo = {
        "name": name,
        "lr": draw(st.floats(1e-7, 1.0)),
        "batch_size": draw(st.integers(1, 64)),
        "mini_batch_size": mini,
        "micro_batch_size": micro,
        "gamma": draw(st.floats(0.0, 1.0)),
    }
    if name == "dpo":
        algo["dpo_loss"] = draw(st.sampled_from([x for x in DPO_LOSSES if x != "exo_pair"]))
    else:
        algo["loss_agg_mode"] = draw(st.sampled_from(LOSS_AGG_MODES))
        algo["clip_ratio_high"] = draw(st.none() | st.floats(0.0, 1.0))
        if draw(st.booleans()):
            algo.update(
                use_kl_in_reward=True,
                kl_coef=draw(st.floats(0.0, 1.0)),
                kl_penalty=draw(st.sampled_from(KL_ESTIMATORS)),
            )
        if draw(st.booleans()):
            algo.update(use_kl_loss=True, kl_loss_type=draw(st.sampled_from(KL_ESTIMATORS)))
        if name == "grpo":
            algo["adv_estimator"] = draw(st.sampled_from([e for e in ADV_ESTIMATORS if e != "gae"]))
            if algo["adv_estimator"] == "gdpo":  # GDPO needs its reward components named, as verl
                algo["gdpo_reward_keys"] = ["correct", "digits"]
            algo["group_size"] = draw(st.integers(2, 8))
    d = {
        "algo": algo,
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
        },
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
        # renamed keys name their successor (and what changed)
        ({"algo": {"value_clip": 0.2}}, "v", "v.algo.value_clip: renamed to cliprange_value"),
        ({"algo": {"kl_estimator": "k3"}}, "", "algo.kl_estimator: split, as in verl: kl_penalty"),
        ({"algo": {"kl_in_reward": True}}, "", "algo.kl_in_reward: renamed to use_kl_in_reward"),
        ({"algo": {"normalize_advantages": False}}, "", "algo.normalize_advantages: removed"),
        # a key set where nothing reads it
        (
            {"algo": {"kl_coef": 0.01}},
            "",
            "algo.kl_coef: set to 0.01 but nothing reads it: needs use_kl_in_reward",
        ),
        (
            {"algo": {"kl_loss_type": "k1"}},
            "",
            "algo.kl_loss_type: set to 'k1' but nothing reads it: needs use_kl_loss",
        ),
        (
            {"algo": {"use_kl_in_reward": True, "kl_ctrl_horizon": 5}},
            "",
            "algo.kl_ctrl_horizon: set to 5 but",
        ),
        (
            {"algo": {"loss_mode": "gspo", "clip_ratio_c": 5.0}},
            "",
            "algo.clip_ratio_c: set to 5.0 but nothing",
        ),
        ({"algo": {"name": "grpo", "cliprange_value": 0.2}}, "", "algo.cliprange_value: set to 0.2 but"),
        ({"algo": {"name": "dpo", "use_kl_loss": True}}, "", "algo.use_kl_loss: set to True but"),
        (
            {"algo": {"name": "dpo", "dpo_loss": "ipo", "label_smoothing": 0.1}},
            "",
            "algo.label_smoothing: set to",
        ),
        ({"algo": {"loss_scale_factor": 512.0}}, "", "algo.loss_scale_factor: set to 512.0 but nothing"),
        # values out of verl's / TRL's domain
        ({"algo": {"clip_ratio_c": 1.0}}, "", "algo.clip_ratio_c: must be > 1"),
        ({"algo": {"loss_agg_mode": "token-max"}}, "", "algo.loss_agg_mode: unknown value 'token-max'"),
        ({"algo": {"name": "grpo", "adv_estimator": "gae"}}, "", "algo.adv_estimator: gae needs a critic"),
        (
            {"algo": {"adv_estimator": "rloo"}},
            "",
            "algo.adv_estimator: rloo needs no critic: use algo.name: grpo",
        ),
        (
            {"algo": {"name": "grpo", "adv_estimator": "grpo_passk", "group_size": 1}},
            "",
            "algo.group_size: grpo_passk",
        ),
        ({"algo": {"name": "dpo", "dpo_loss": "exo_pair"}}, "", "algo.label_smoothing: exo_pair needs"),
        ({"algo": {"name": "dpo", "label_smoothing": 0.5}}, "", "algo.label_smoothing: must be in [0, 0.5)"),
    ],
)
def test_errors_name_the_field_path(data, where, expected):
    with pytest.raises(ValueError) as info:
        TrainConfig.from_dict(data, where=where)
    assert str(info.value).startswith(expected), str(info.value)


def test_yaml_strings_for_numbers_are_read():
    # PyYAML reads 1e-6 (no dot) as a string; the config accepts it as a number
    assert TrainConfig.from_dict({"algo": {"lr": "1e-6"}}).algo.lr == 1e-6


# verl's defaults (verl/trainer/config/_generated_ppo_trainer.yaml) and TRL's (DPOConfig), key for key
VERL_DEFAULTS = {
    "gamma": 1.0, "lam": 1.0, "norm_adv_by_std_in_grpo": True, "use_kl_in_reward": False, "kl_penalty": "kl",
    "kl_coef": 0.001, "kl_ctrl_type": "fixed", "kl_ctrl_target_kl": 0.1, "kl_ctrl_horizon": 10000,
    "clip_ratio": 0.2, "clip_ratio_c": 3.0, "loss_mode": "vanilla", "loss_agg_mode": "token-mean",
    "clip_cov_ratio": 0.0002, "clip_cov_lb": 1.0, "clip_cov_ub": 5.0, "kl_cov_ratio": 0.0002, "ppo_kl_coef": 0.1,
    "entropy_coef": 0.0, "use_kl_loss": False, "kl_loss_coef": 0.001, "kl_loss_type": "low_var_kl",
    "ppo_epochs": 1, "max_grad_norm": 1.0, "cliprange_value": 0.5, "temperature": 1.0,
    "loss_scale_factor": None, "beta": 0.1, "dpo_loss": "sigmoid", "label_smoothing": 0.0, "discopop_tau": 0.05,
}  # fmt: skip


def test_algorithm_defaults_are_verls_and_trls():
    algo = AlgoConfig()
    assert {k: getattr(algo, k) for k in VERL_DEFAULTS} == VERL_DEFAULTS
    # unset clip sides are clip_ratio (verl's yaml spells 0.2 for both); unset estimator: gae for ppo
    assert algo.clip_ratio_low is None and algo.clip_ratio_high is None and algo.estimator == "gae"
    assert AlgoConfig(name="grpo").estimator == "grpo" and AlgoConfig(name="dpo").estimator is None
    # no KL term by default: no reference model for PPO or GRPO (verl builds it only for a KL term)
    assert not AlgoConfig().uses_reference and not AlgoConfig(name="grpo").uses_reference
    assert AlgoConfig(use_kl_loss=True).uses_reference and AlgoConfig(name="dpo").uses_reference


def test_every_choice_list_is_accepted():
    for mode in POLICY_LOSSES:
        AlgoConfig(name="grpo", loss_mode=mode, dro_beta=0.1 if mode == "dro" else None)
    for est in ADV_ESTIMATORS:
        keys = {"gdpo_reward_keys": ("acc",)} if est == "gdpo" else {}
        AlgoConfig(name="ppo" if est == "gae" else "grpo", adv_estimator=est, **keys)
    for kind in DPO_LOSSES:
        AlgoConfig(name="dpo", dpo_loss=kind, label_smoothing=0.01 if kind == "exo_pair" else 0.0)


OLD_ALGO = {"name": "ppo", "value_clip": 0.2, "vf_coef": 0.5, "kl_coef": 0.05, "kl_estimator": "k1",
            "kl_in_reward": True, "lam": 0.95, "normalize_advantages": True}  # fmt: skip


def test_run_directories_recorded_before_the_verl_keys_still_read():
    from pathlib import Path

    from verlaudit.analysis.diagnose.failure import recorded_config as upgrade_recorded_config

    # PPO with its KL in the reward: the same run in today's keys
    algo = TrainConfig.from_dict(upgrade_recorded_config({"algo": OLD_ALGO})).algo
    assert (algo.use_kl_in_reward, algo.kl_coef, algo.kl_penalty, algo.cliprange_value) == (
        True,
        0.05,
        "kl",
        0.2,
    )
    assert (algo.vf_coef, algo.lam, algo.use_kl_loss) == (0.5, 0.95, False)
    # GRPO's KL was always a loss term; k3 is low_var_kl; the critic's options go
    old = {**OLD_ALGO, "name": "grpo", "kl_estimator": "k3", "kl_coef": 0.01}
    algo = TrainConfig.from_dict(upgrade_recorded_config({"algo": old})).algo
    assert (algo.use_kl_loss, algo.kl_loss_coef, algo.kl_loss_type, algo.use_kl_in_reward) == (
        True,
        0.01,
        "low_var_kl",
        False,
    )
    # value_clip 0 meant no clipping; kl_coef 0 meant no reference
    algo = TrainConfig.from_dict(
        upgrade_recorded_config({"algo": {**OLD_ALGO, "value_clip": 0.0, "kl_coef": 0.0}})
    ).algo
    assert algo.cliprange_value == 1e9 and not algo.uses_reference
    # a real manifest from before (tests/fixtures: the H200 DPO suite), and a current config unchanged
    manifest = Path(__file__).parent / "fixtures" / "h200_dpo_suite" / "bf16" / "manifest.json"
    recorded = json.loads(manifest.read_text())["config"]
    assert TrainConfig.from_dict(upgrade_recorded_config(recorded)).algo.name == "dpo"
    now = TrainConfig().to_dict()
    assert upgrade_recorded_config(now) == now


def test_a_recorded_config_with_the_older_engine_keys_reads_as_the_engine_it_ran():
    # run directories written before rollout.engine (committed baselines and reports) keep reading
    from verlaudit.analysis.diagnose.failure import recorded_config as upgrade_recorded_config

    for rollout, engine in (
        ({"cache": "dynamic", "fused": False}, "hf"),
        ({"cache": "static", "fused": None}, "static"),
        ({"engine": None, "cache": "static", "fused": True}, "fused"),
        ({"engine": "vllm", "cache": None, "fused": None}, "vllm"),
    ):
        cfg = TrainConfig.from_dict(upgrade_recorded_config({"rollout": rollout}))
        assert cfg.rollout.engine == engine
    # a suite writing them is refused, naming the key that replaced them
    with pytest.raises(ValueError, match=r"^rollout\.cache: replaced by rollout\.engine"):
        TrainConfig.from_dict({"rollout": {"cache": "static"}})
