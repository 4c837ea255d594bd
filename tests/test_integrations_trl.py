"""`AuditCallback` in TRL's DPOTrainer, GRPOTrainer and SFTTrainer on a tiny model built from a config
(the project's own tokenizer, datasets in memory, no hub): clean runs have no warning or error, and
planted faults are found and diagnosed with the culprit named in TRL's terms (the reward function by
its name, the ``data_collator``, ``bf16=True`` for a collapsed fp16 scale, ``ref_model``). Two steps
each, CPU. Run: `pytest tests/test_integrations_trl.py`."""

from __future__ import annotations

import copy

import pytest
import torch

trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

from transformers import AutoModelForCausalLM  # noqa: E402

from trainer.config import ModelConfig  # noqa: E402
from trainer.models import preset_config  # noqa: E402
from trainer.tokenizer import build_tokenizer  # noqa: E402
from verlaudit.analysis.diagnose.diagnosis import diagnose_path  # noqa: E402
from verlaudit.integrations.trl import AuditCallback, map_metrics  # noqa: E402
from verlaudit.rundir import read_run  # noqa: E402


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def tiny(tok):
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(preset_config(ModelConfig(preset="tiny-llama"), tok))


def common(tmp_path, **kw):
    return dict(
        output_dir=str(tmp_path / "trl"),
        per_device_train_batch_size=2,
        max_steps=2,
        logging_steps=1,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        seed=0,
        **kw,
    )


def pairs():
    rows = [{"prompt": f"{i}+{i}=", "chosen": str(2 * i), "rejected": str(2 * i + 1)} for i in range(4)]
    return datasets.Dataset.from_list(rows)


def dpo(tok, tmp_path, *, ref=None, collator=None, **kw):
    model = tiny(tok)
    ref = ref if ref is not None else copy.deepcopy(model)
    args = trl.DPOConfig(**common(tmp_path, max_length=32, **kw))
    trainer = trl.DPOTrainer(
        model=model,
        ref_model=ref,
        args=args,
        train_dataset=pairs(),
        processing_class=tok,
        data_collator=collator,
    )
    AuditCallback.attach(trainer, tmp_path / "run")
    return trainer


def grpo(tok, tmp_path, reward_funcs, **kw):
    prompts = datasets.Dataset.from_list([{"prompt": f"{i}+1="} for i in range(4)])
    args = trl.GRPOConfig(
        **common(tmp_path, num_generations=2, max_completion_length=4, **kw), generation_batch_size=2
    )
    trainer = trl.GRPOTrainer(
        model=tiny(tok), reward_funcs=reward_funcs, args=args, train_dataset=prompts, processing_class=tok
    )
    AuditCallback.attach(trainer, tmp_path / "run")
    return trainer


def bad(run):
    return [(f.severity, f.kind, f.where) for f in run.findings if f.severity in ("warning", "error")]


def char_reward(completions, **kw):
    # alternates within each group of two generations: a learning signal whatever the tiny model says
    return [float(i % 2) for i in range(len(completions))]


def test_clean_dpo_run_is_clean_and_reads_like_ours(tok, tmp_path):
    dpo(tok, tmp_path, bf16=True).train()
    run = read_run(tmp_path / "run")
    assert run.state == "completed" and [m["step"] for m in run.metrics] == [0, 1]
    assert bad(run) == []
    assert run.manifest["contract"]["asked"]["bf16"] is True and run.manifest["policy"]["preset"] == "bf16"
    assert {"actor/loss", "rewards/margins", "logps/chosen", "actor/grad_norm"} <= set(run.metrics[-1])
    (d,) = diagnose_path(tmp_path / "run")
    assert d.verdict == "clean", [c.title for c in d.causes]


def test_clean_grpo_and_sft_runs_are_clean(tok, tmp_path):
    grpo(tok, tmp_path / "grpo", [char_reward]).train()
    run = read_run(tmp_path / "grpo" / "run")
    assert run.state == "completed" and bad(run) == []
    assert "critic/score/mean" in run.metrics[-1] and "reward/mean" in run.metrics[-1]
    assert any(e.get("phase") == "rollout" for e in run.events if e["kind"] == "phase_start")

    text = datasets.Dataset.from_list([{"text": f"{i}+{i}={2 * i}"} for i in range(4)])
    args = trl.SFTConfig(**common(tmp_path / "sft", max_length=16))
    trainer = trl.SFTTrainer(model=tiny(tok), args=args, train_dataset=text, processing_class=tok)
    AuditCallback.attach(trainer, tmp_path / "sft" / "run")
    trainer.train()
    run = read_run(tmp_path / "sft" / "run")
    assert run.state == "completed" and bad(run) == [] and run.manifest["config"]["algo"]["name"] == "sft"


def test_cast_lm_head_to_fp32_is_part_of_the_contract(tok, tmp_path):
    model = tiny(tok).to(torch.bfloat16)
    prompts = datasets.Dataset.from_list([{"prompt": f"{i}+1="} for i in range(4)])
    args = trl.GRPOConfig(
        **common(tmp_path, num_generations=2, max_completion_length=4, bf16=True, cast_lm_head_to_fp32=True),
        generation_batch_size=2,
    )
    trainer = trl.GRPOTrainer(
        model=model, reward_funcs=[char_reward], args=args, train_dataset=prompts, processing_class=tok
    )
    AuditCallback.attach(trainer, tmp_path / "run")
    trainer.train()
    run = read_run(tmp_path / "run")
    assert run.manifest["contract"]["asked"]["cast_lm_head_to_fp32"] is True
    assert run.manifest["policy"]["preset"] == "bf16-pure"
    heads = [f for f in run.findings if f.where == "lm_head"]
    assert {f.kind for f in heads} == {"dtype/param_storage", "dtype/grad"}
    assert all(f.severity == "info" and "cast_lm_head_to_fp32" in f.message for f in heads)
    # what is left is real: bf16 master weights round away most of an update at lr 1e-6
    assert {k for _, k, _ in bad(run)} == {"numerics/update_underflow"}


def test_reward_functions_returning_bf16_and_float64_are_named(tok, tmp_path):
    def bf16_reward(completions, **kw):
        return torch.ones(len(completions), dtype=torch.bfloat16)

    def fp64_reward(completions, **kw):
        return torch.ones(len(completions), dtype=torch.float64)

    trainer = grpo(tok, tmp_path, [bf16_reward, fp64_reward])
    trainer.train()
    assert trainer.reward_funcs[0] is bf16_reward  # unwrapped when training ends
    (d,) = diagnose_path(tmp_path / "run")
    (reward,) = [c for c in d.causes if c.kind == "finding:boundary/reward_dtype"]
    wheres = {e.split(" ")[1] for e in reward.evidence}
    assert wheres == {"reward:function:bf16_reward", "reward:function:fp64_reward"}
    assert reward.fixes[0].framework == "trl" and reward.fixes[0].key.startswith("reward_funcs (")


def test_collator_casting_ids_to_float_is_the_root_cause(tok, tmp_path):
    from trl.trainer.dpo_trainer import DataCollatorForPreference

    base = DataCollatorForPreference(pad_token_id=tok.pad_token_id)

    def float_ids(examples):
        batch = base(examples)
        batch["input_ids"] = batch["input_ids"].float()
        return batch

    with pytest.raises(RuntimeError):
        dpo(tok, tmp_path, collator=float_ids).train()
    run = read_run(tmp_path / "run")
    assert run.state == "failed"
    (d,) = diagnose_path(tmp_path / "run")
    root = d.causes[0]
    assert root.kind == "finding:boundary/collator_float_ids" and root.where == "collator:float_ids.input_ids"
    assert any(f.framework == "trl" and f.key.startswith("data_collator") for f in root.fixes)


def test_fp16_loss_scale_collapse_points_at_bf16(tok, tmp_path):
    trainer = dpo(tok, tmp_path, fp16=True, max_grad_norm=1.0)
    # accelerate has no fp16 scaler on a CPU; give it the one it makes on a GPU, at a scale that the
    # planted loss (x1e6, below) overflows until it reaches 1
    trainer.accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=8.0)
    trainer.accelerator.native_amp = True
    compute = trainer.compute_loss
    trainer.compute_loss = lambda *a, **k: compute(*a, **k) * 1e6
    trainer.args.max_steps = 4
    trainer.train()
    run = read_run(tmp_path / "run")
    assert [v for _, v in run.series("actor/loss_scale")][:3] == [4.0, 2.0, 1.0]
    assert [v for _, v in run.series("actor/skipped")][:3] == [1.0, 1.0, 1.0]
    (d,) = diagnose_path(tmp_path / "run")
    collapse = next(c for c in d.causes if c.kind == "loss_scale_collapse")
    assert collapse.fixes[0].framework == "trl" and collapse.fixes[0].key.startswith("bf16=True")


def test_reference_in_another_dtype_names_ref_model(tok, tmp_path):
    ref = tiny(tok).to(torch.float16)
    dpo(tok, tmp_path, ref=ref, bf16=True).train()
    (d,) = diagnose_path(tmp_path / "run")
    storage = next(c for c in d.causes if c.kind == "finding:dtype/param_storage")
    assert storage.role == "reference" and storage.severity == "error"
    assert storage.fixes[0].framework == "trl" and storage.fixes[0].key == "ref_model"


def test_trl_metric_names_map_to_ours():
    logs = {
        "loss": 0.5,
        "sampling/importance_sampling_ratio/max": 1.2,
        "clip_ratio/region_mean": 0.1,
        "rewards/char_reward/mean": 0.5,
        "frac_reward_zero_std": 0.25,
        "epoch": 1,
    }
    assert map_metrics(logs) == {
        "actor/loss": 0.5,
        "rollout_corr/token_ratio_max": 1.2,
        "actor/pg_clipfrac": 0.1,
        "rewards/char_reward/mean": 0.5,
        "reward/identical_group_frac": 0.25,
        "trl/epoch": 1.0,
    }
