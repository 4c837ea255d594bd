"""The resolved run spec: decided once by the runner, read back unchanged by the worker, handed to the
trainer, which then decides nothing again.

Run: `pytest -q tests/test_spec.py` (a few seconds; one 1-step training run on the tiny model).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trainer.common import Resolved
from trainer.config import TrainConfig
from trainer.distributed import DistInfo
from trainer.events import Observer
from trainer.precision import PRESETS, ROLES, PrecisionPolicy, resolve_policy
from verlaudit.audit import AuditSettings
from verlaudit.run import runner, worker
from verlaudit.run.hardware import PresentDevice
from verlaudit.run.spec import Emulation, RunSpec
from verlaudit.run.suite import load_suite

ROOT = Path(__file__).resolve().parents[1]
CPU = DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), backend=None)
TINY_TRAIN = {
    "steps": 1,
    "device": "cpu",
    "threads": 1,
    "algo": {"name": "grpo", "batch_size": 2, "mini_batch_size": 4, "micro_batch_size": 2, "group_size": 2},
    "data": {"num_examples": 8, "prompt_length": 8, "response_length": 4},
}


def _spec(preset: str = "fp32", **kw) -> RunSpec:
    train = TrainConfig.from_dict({**TINY_TRAIN, "seed": kw.get("seed", 0), "precision": {"preset": preset}})
    base = {"variant": "v", "seed": 0, "run_dir": Path("/tmp/x"), "train": train, "device": "cpu"}
    return RunSpec(**{**base, "policy": train.precision.build_policy(), **kw})


OVERRIDES = st.dictionaries(
    st.sampled_from(ROLES),
    st.fixed_dictionaries(
        {},
        optional={
            "compute_dtype": st.sampled_from(["fp32", "bf16"]),
            "init_scale": st.sampled_from([1.0, 1024.0]),
        },
    ),
    max_size=2,
)


@settings(max_examples=40, deadline=None)
@given(preset=st.sampled_from(PRESETS), overrides=OVERRIDES)
def test_policy_round_trips_through_plain_data(preset, overrides):
    try:
        policy = resolve_policy(preset, overrides)
    except ValueError:
        return  # e.g. compute differs from params with autocast off: not a policy
    data = json.loads(json.dumps(policy.to_dict()))
    assert PrecisionPolicy.from_dict(data) == policy


@settings(max_examples=25, deadline=None)
@given(
    preset=st.sampled_from(PRESETS),
    seed=st.integers(0, 2**31),
    level=st.sampled_from(["off", "boundary", "full"]),
    cap=st.one_of(st.none(), st.floats(0.5, 200)),
    inject=st.one_of(st.none(), st.just({"raise_in_phase": {"phase": "rollout", "at_step": 0}})),
)
def test_run_spec_round_trips_through_json(preset, seed, level, cap, inject):
    emulation = Emulation(target="a100-80gb", memory_cap_gb=cap, reason="why")
    spec = _spec(preset, seed=seed, audit=AuditSettings(level=level), inject=inject, emulation=emulation)
    back = RunSpec.from_dict(json.loads(json.dumps(spec.to_dict())))
    assert back == spec and back.to_dict() == spec.to_dict()


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda d: d.pop("policy"), "policy: missing"),
        (lambda d: d.pop("device"), "device: missing"),
        (lambda d: d.update(device="tpu"), "device: 'tpu'; expected one of cpu, cuda"),
        (
            lambda d: d["train"].update(device="cuda:0"),
            "train.device: 'cuda:0' contradicts the run's device 'cpu'",
        ),
        (
            lambda d: d["policy"]["roles"]["actor"].update(param_dtype="fp8"),
            "policy.roles.actor.param_dtype: unknown dtype 'fp8'",
        ),
        (
            lambda d: d["policy"]["roles"]["actor"].update(colour=1),
            "policy.roles.actor.colour: unknown field",
        ),
        (lambda d: d["policy"]["roles"].update(critc={}), "policy.roles.critc: expected a role"),
        (lambda d: d["policy"].update(preset="bf16"), "policy.preset: 'bf16' is not train.precision.preset"),
        (lambda d: d["emulation"].update(memory_cap_gb=0), "emulation.memory_cap_gb: expected a number > 0"),
        (lambda d: d["audit"].update(every=-1), "audit.every: expected an integer >= 0"),
        (lambda d: d.update(seed="1"), "seed: expected an integer"),
    ],
)
def test_bad_spec_names_the_field(mutate, message):
    data = json.loads(json.dumps(_spec().to_dict()))
    mutate(data)
    with pytest.raises(ValueError, match="^" + message.replace("(", r"\(").replace(")", r"\)")):
        RunSpec.from_dict(data)


def test_the_planned_spec_is_what_the_worker_reads(tmp_path):
    suite = load_suite(ROOT / "suites" / "tiny_cpu.yaml", steps=1)
    plan = runner.plan_runs(suite, tmp_path, PresentDevice(cuda=False, gpu_count=0))
    for planned in plan.runs:
        path = tmp_path / f"{planned.run.run_name}.json"
        path.write_text(json.dumps(planned.spec.to_dict()))
        assert worker.load_spec(path) == planned.spec
        # the policy the runner took from the variant's config, once
        assert planned.spec.policy == planned.run.config.precision.build_policy()
        assert planned.spec.policy.preset == planned.run.variant


class _Setup(Observer):
    def on_setup(self, *, config, policy, models, tokenizer_info):
        self.policy, self.models = policy, dict(models)


def test_train_uses_the_handed_policy_instead_of_deciding_its_own():
    from trainer.train import train

    # a KL loss term, so the recipe builds a reference (verl builds none without one)
    algo = {**TINY_TRAIN["algo"], "use_kl_loss": True}
    cfg = TrainConfig.from_dict({**TINY_TRAIN, "algo": algo, "precision": {"preset": "fp32"}})
    # a policy the config would not give: the reference stored in bf16
    handed = resolve_policy("fp32", {"reference": {"param_dtype": "bf16", "compute_dtype": "bf16"}})
    seen = _Setup()
    train(cfg, seen, resolved=Resolved(dist=CPU, policy=handed))
    assert seen.policy is handed
    assert {p.dtype for p in seen.models["reference"].parameters()} == {torch.bfloat16}
    own = _Setup()
    train(cfg, own)  # the trainer alone decides from its config
    assert own.policy == cfg.precision.build_policy()
    assert {p.dtype for p in own.models["reference"].parameters()} == {torch.float32}


def test_worker_hands_the_spec_device_and_policy_to_train(tmp_path, monkeypatch):
    import trainer.train

    got = {}

    def fake_train(config, observer, *, resolved):
        got.update(config=config, resolved=resolved)

    monkeypatch.setattr(trainer.train, "train", fake_train)
    spec = _spec("bf16", run_dir=tmp_path / "run")
    assert worker.run(spec) == 0
    assert got["config"] == spec.train and got["resolved"].policy is spec.policy
    assert got["resolved"].device == torch.device("cpu") and not got["resolved"].dist.distributed
    manifest = json.loads((tmp_path / "run" / "manifest.json").read_text())
    assert manifest["policy"] == spec.policy.to_dict() and "memory_summary" in manifest


def test_refused_run_directory_is_written_by_the_worker_module(tmp_path):
    spec = _spec("bf16", run_dir=tmp_path / "r")
    worker.write_refused(spec, "target t4 has no native bf16")
    files = sorted(p.name for p in (tmp_path / "r").iterdir())
    assert files == ["manifest.json", "status.json"]
    status = json.loads((tmp_path / "r" / "status.json").read_text())
    assert (status["state"], status["reason"]) == ("failed", "refused")
    assert json.loads((tmp_path / "r" / "manifest.json").read_text())["policy"] == spec.policy.to_dict()


def test_the_policy_is_built_once_per_run_by_the_runner(tmp_path, monkeypatch):
    # a config checks its precision fields when it is built; only the runner's spec builds the policy
    import trainer.config

    built = []
    real = trainer.config.resolve_policy
    monkeypatch.setattr(trainer.config, "resolve_policy", lambda *a, **k: built.append(a) or real(*a, **k))
    suite = load_suite(ROOT / "suites" / "tiny_cpu.yaml", steps=1)
    for run in suite.expand():
        dataclasses.replace(run.config, seed=run.seed + 1)  # every construction re-checks, none builds
    assert built == []
    plan = runner.plan_runs(suite, tmp_path, PresentDevice(cuda=False, gpu_count=0))
    assert len(built) == len(plan.runs) == len(suite.expand())
