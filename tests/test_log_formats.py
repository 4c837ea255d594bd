"""Every metric format a foreign log comes in, read into one per-step table (verlaudit/analysis/logs/table.py,
files.py), and the rules over it and over the libraries' messages: non-finite metrics in each format,
the collapse signature, the rollout-vs-trainer mismatch vocabulary and its published bounds, version
mismatches, missing engine features, engine limits, FSDP's dtype flattening, dtype titles from every
operand, an unknown exception's library and phase; and healthy logs that must get no warning or error
(fp16 back-offs, KV-cache and weight-update info lines, a grad-norm spike that recovers, mismatch
metrics inside their bounds, TRL's GRPO loss of 0 from the start). The logs are written here, in each
format's own shape. Run: `pytest tests/test_log_formats.py`."""

from __future__ import annotations

import builtins
import json
import math
from pathlib import Path

import pytest

from verlaudit.analysis.diagnose.diagnosis import diagnose_path
from verlaudit.analysis.logs import vocab
from verlaudit.analysis.logs.exceptions import dtype_title
from verlaudit.analysis.logs.records import parse_metric_lines
from verlaudit.analysis.logs.table import MetricTable


def diagnose(tmp_path: Path, text: str, name: str = "train.log"):
    p = tmp_path / name
    p.write_text(text)
    (d,) = diagnose_path(p)
    return d


def first(tmp_path: Path, text: str, name: str = "train.log"):
    d = diagnose(tmp_path, text, name)
    assert d.causes, d.summary
    return d.causes[0]


def assert_healthy(tmp_path: Path, text: str, name: str = "train.log") -> None:
    d = diagnose(tmp_path, text, name)
    bad = [(c.severity, c.kind, c.title) for c in d.causes if c.severity in ("error", "warning")]
    assert bad == [], bad


# ---- formats: one table -------------------------------------------------------------------------


def test_hf_single_line_dicts_with_nan_grad_norm(tmp_path):
    log = (
        "{'loss': 0.6931, 'grad_norm': 1.2, 'learning_rate': 1e-05, 'epoch': 0.25}\n"
        " 50%|#####     | 2/4 [00:02<00:02]{'loss': 0.0, 'grad_norm': nan, 'learning_rate': 1e-05, 'epoch': 0.5}\n"
    )
    c = first(tmp_path, log)
    # the NaN step logs a loss of exactly 0 after a healthy step: the collapse signature, not just a NaN
    assert c.kind == "collapse" and c.step == 2 and c.line == 2


def test_hf_dict_pretty_printed_over_lines_is_one_record():
    text = "{'loss': 0.0,\n 'grad_norm': nan,\n 'learning_rate': 1e-05,\n 'epoch': 0.5}\nnext line\n"
    (rec,) = parse_metric_lines(text)
    assert rec["_line"] == 1 and rec["loss"] == 0.0 and math.isnan(rec["grad_norm"]) and rec["epoch"] == 0.5


def test_hf_dict_hard_wrapped_by_the_terminal_keeps_its_numbers():
    text = "{'loss': 0.4512, 'grad_norm': 3.21, 'learning_rate': 1.5e-0\n5, 'epoch': 0.12}\n"
    (rec,) = parse_metric_lines(text)
    assert rec["learning_rate"] == 1.5e-05 and rec["epoch"] == 0.12 and rec["grad_norm"] == 3.21


def test_hf_multi_line_nan_is_found_by_diagnose(tmp_path):
    log = "{'loss': 1.02,\n 'grad_norm': 0.9,\n 'epoch': 0.1}\n{'loss': 0.98,\n 'grad_norm': nan,\n 'epoch': 0.2}\n"
    c = first(tmp_path, log)
    assert c.kind == "nonfinite" and c.step == 2 and c.line == 4


def test_trainer_state_json_log_history(tmp_path):
    state = {
        "global_step": 30,
        "log_history": [
            {"epoch": 0.1, "grad_norm": 1.1, "learning_rate": 1e-5, "loss": 0.9, "step": 10},
            {"epoch": 0.2, "grad_norm": float("nan"), "learning_rate": 1e-5, "loss": 0.8, "step": 20},
            {"eval_loss": 0.7, "epoch": 0.2, "step": 20},
        ],
    }
    c = first(tmp_path, json.dumps(state, indent=2), "trainer_state.json")
    assert c.kind == "nonfinite" and c.step == 20
    assert "grad_norm" in c.evidence[0]


def test_trainer_state_json_healthy(tmp_path):
    hist = [{"loss": 1.0 - i / 10, "grad_norm": 1.0, "learning_rate": 1e-5, "step": i} for i in range(1, 6)]
    assert_healthy(tmp_path, json.dumps({"log_history": hist}), "trainer_state.json")


def test_verl_console_and_file_logger_jsonl(tmp_path):
    console = "step:1 - actor/pg_loss:np.float64(0.01) - actor/grad_norm:0.5\nstep:2 - actor/grad_norm:nan\n"
    c = first(tmp_path, console)
    assert c.kind == "nonfinite" and c.step == 2 and c.where == "actor"
    jsonl = (
        json.dumps({"step": 1, "data": {"actor/pg_loss": 0.01, "actor/grad_norm": 0.5}})
        + "\n"
        + '{"step": 2, "data": {"actor/pg_loss": 0.02, "actor/grad_norm": NaN}}\n'
    )
    c = first(tmp_path, jsonl, "metrics.jsonl")
    assert c.kind == "nonfinite" and c.step == 2 and "actor/grad_norm" in c.evidence[0]
    (rec, _) = parse_metric_lines(jsonl)[:2]
    assert rec["_source"] == "verl_file" and rec["step"] == 1


def test_trl_dict_with_sections_and_json_lines(tmp_path):
    trl = (
        "{'loss': 0.0, 'grad_norm': 0.41, 'learning_rate': 1e-06, 'num_tokens': 2048.0, 'completions/mean_length': "
        "212.5, 'rewards/accuracy_reward/mean': 0.5, 'reward': 0.5, 'reward_std': 0.4, 'entropy': 0.61, 'epoch': 0.01}\n"
    )
    (rec,) = parse_metric_lines(trl)
    assert rec["rewards/accuracy_reward/mean"] == 0.5 and rec["entropy"] == 0.61
    line = json.dumps({"global_step": 7, "train/loss": float("inf"), "train/reward": 0.2})
    c = first(tmp_path, line + "\n")
    assert c.kind == "nonfinite" and c.step == 7


def test_key_value_and_bullet_blocks():
    recs = parse_metric_lines(
        "[iter 12] loss=0.31 grad_norm=1.25 reward=0.5 lr=1e-6\n"
        "Step 3 | policy_loss: 0.12 | reward: 0.40\n"
        "========================= Step 4/100 =========================\n"
        "📊 Training Results:\n"
        "  • Loss: 0.0123\n"
        "  • Avg Reward: 0.4500\n"
        "  • Mean Generation Length: 512.0000\n"
        "\n"
    )
    assert [(r["step"], r["_source"]) for r in recs] == [(12, "kv"), (3, "kv"), (4, "kv")]
    assert recs[2]["Avg Reward"] == 0.45 and recs[2]["Loss"] == 0.0123


def test_config_lines_are_not_records():
    assert parse_metric_lines("max_num_batched_tokens=8192, max_model_len=4096\nkl_coef: 0.001\n") == []


def test_printed_tables():
    recs = parse_metric_lines(
        "| step | loss | grad_norm | reward |\n|------|------|-----------|--------|\n| 1 | 0.9 | 1.1 | 0.2 |\n"
        "| 2 | 0.8 | nan | 0.3 |\n"
    )
    assert [r["step"] for r in recs] == [1, 2] and math.isnan(recs[1]["grad_norm"])
    two = parse_metric_lines("┃ Metric ┃ Value ┃\n│ train/loss │ 0.52 │\n│ train/reward │ 0.31 │\ndone\n")
    assert len(two) == 1 and two[0]["train/loss"] == 0.52 and two[0]["train/reward"] == 0.31


def test_tensorboard_event_file(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.compat.proto import event_pb2, summary_pb2
    from tensorboard.summary.writer.event_file_writer import EventFileWriter

    w = EventFileWriter(str(tmp_path))
    for step, gn in ((1, 1.0), (2, 1.1), (3, float("nan"))):
        for tag, v in (("train/loss", 0.5), ("train/grad_norm", gn)):
            val = summary_pb2.Summary.Value(tag=tag, simple_value=v)
            w.add_event(event_pb2.Event(step=step, wall_time=0.0, summary=summary_pb2.Summary(value=[val])))
    w.close()
    (path,) = tmp_path.glob("events.out.tfevents.*")
    c = diagnose_path(path)[0].causes[0]
    assert c.kind == "nonfinite" and c.step == 3


def test_tensorboard_missing_says_how_to_install(tmp_path, monkeypatch):
    real = builtins.__import__

    def no_tb(name, *a, **k):
        if name.startswith("tensorboard"):
            raise ImportError(name)
        return real(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_tb)
    p = tmp_path / "events.out.tfevents.1.host"
    p.write_bytes(b"\x00\x01binary")
    with pytest.raises(
        ValueError, match=r"needs the tensorboard package: pip install 'tensorboard>=2.21,<3'"
    ):
        diagnose_path(p)


def test_wandb_history_and_binary(tmp_path):
    rows = [{"_step": i, "_runtime": 1.0, "train/loss": 0.5, "train/grad_norm": 1.0} for i in range(3)]
    rows.append({"_step": 3, "_runtime": 2.0, "train/loss": float("nan"), "train/grad_norm": 1.0})
    c = first(tmp_path, "\n".join(json.dumps(r) for r in rows) + "\n", "wandb-history.jsonl")
    assert c.kind == "nonfinite" and c.step == 3
    p = tmp_path / "run-abc123.wandb"
    p.write_bytes(b":W&B\x00\x00binary")
    with pytest.raises(ValueError, match="W&B binary run file"):
        diagnose_path(p)


def test_non_finite_of_other_metrics_is_no_finding(tmp_path):
    # a throughput or a clip fraction that is NaN is not a loss, grad-norm, reward or log-prob metric
    assert_healthy(tmp_path, "step:1 - actor/pg_loss:0.1 - perf/throughput:inf - actor/pg_clipfrac:nan\n")


def test_table_series_are_bounded():
    t = MetricTable()
    for i in range(20000):
        t.feed(i + 1, f"step:{i} - actor/grad_norm:1.0 - actor/pg_loss:0.1")
    s = t.series["grad_norm"]
    assert s.count == 20000 and len(s.points()) <= 10000


# ---- vocabulary ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "key, ours",
    [
        ("actor/grad_norm", "grad_norm"), ("grad_norm", "grad_norm"), ("train/grad_norm", "grad_norm"),
        ("actor/pg_loss", "loss"), ("loss", "loss"), ("policy/policy_loss", "loss"), ("critic/vf_loss", None),
        ("critic/score/mean", "reward"), ("reward", "reward"), ("train/reward", "reward"), ("reward_std", "reward_std"), ("rewards/std", "reward_std"), ("learning_rate", "lr"),
        ("Avg Reward", "reward"), ("actor/entropy", "entropy"), ("entropy", "entropy"),
        ("training/rollout_probs_diff_mean", "training/rollout_probs_diff_mean"),
        ("sampling/sampling_logp_difference/mean", "training/rollout_log_probs_abs_diff_mean"),
        ("sampling/importance_sampling_ratio/min", "rollout_corr/token_ratio_min"),
        ("train/token_mult_prob_error", "rollout_corr/token_mult_prob_error"),
        ("vllm_kl", "rollout_corr/kl"),
        ("policy/rollout_train_logprobs_abs_diff_mean", "training/rollout_log_probs_abs_diff_mean"),
        ("train/train_rollout_logprob_abs_diff", "training/rollout_log_probs_abs_diff_mean"),
        ("rollout_corr/rollout_is_eff_sample_size", "rollout_corr/token_ratio_eff_sample_size"),
    ],
)  # fmt: skip
def test_vocab_canonical(key, ours):
    assert vocab.canonical(key) == ours


def test_vocab_probabilities_are_not_log_probs():
    e = vocab.mismatch_entry("training/rollout_probs_diff_mean")
    assert e.quantity.startswith("probability") and "not log-probs" in e.quantity
    assert vocab.mismatch_with_bound("training/rollout_probs_diff_max") is None  # a batch's max
    assert vocab.mismatch_with_bound("sampling/importance_sampling_ratio/max") is None  # a batch's max
    every = {m.framework for m in vocab.MISMATCH}
    assert every == {"verl", "trl", "nemo-rl", "openrlhf", "skyrl", "slime"}
    assert all(m.source for m in vocab.MISMATCH)


# ---- collapse -----------------------------------------------------------------------------------


def _verl_steps(values):
    return "".join(
        f"step:{i} - actor/pg_loss:{loss} - actor/grad_norm:{gn} - critic/score/mean:{r} - actor/entropy:{e}\n"
        for i, (loss, gn, r, e) in enumerate(values, 1)
    )


def test_collapse_signature_cites_the_steps(tmp_path):
    healthy = [(0.05, 1.0 + i / 10, 0.4 + i / 100, 0.9) for i in range(6)]
    broken = [
        (0.03, "nan", 0.4, 0.8),
        (0.0, "nan", 0.0, 0.01),
        (0.0, "nan", 0.0, 0.0),
        (0.0, "nan", 0.0, 0.0),
    ]
    c = first(tmp_path, _verl_steps(healthy + broken))
    assert c.kind == "collapse" and c.severity == "error" and c.step == 7 and c.line == 7
    assert "gradient norm NaN" in c.title and "reward to 0" in c.title and "loss exactly 0" in c.title
    assert c.evidence[0].startswith("line 7: step 7: gradient norm nan")
    assert any(e.startswith("line 8: step 8: reward 0 from step 8") for e in c.evidence)
    assert c.fixes


def test_collapse_after_a_spike(tmp_path):
    rows = [(0.05, 1.0, 0.5, 1.0)] * 5 + [(0.05, 80.0, 0.5, 1.0)] + [(0.0, 0.0, 0.0, 0.02)] * 3
    c = first(tmp_path, _verl_steps(rows))
    assert c.kind == "collapse" and c.step == 6 and "spike" in c.title


def test_hf_nan_then_zero_loss_is_a_collapse(tmp_path):
    log = (
        "{'loss': 1.21, 'grad_norm': 3.2, 'learning_rate': 1e-05, 'epoch': 0.25}\n"
        "{'loss': 1.05, 'grad_norm': 2.9, 'learning_rate': 1e-05, 'epoch': 0.5}\n"
        "{'loss': 0.0, 'grad_norm': nan, 'learning_rate': 1e-05,\n 'epoch': 0.75}\n"
    )
    c = first(tmp_path, log)
    assert c.kind == "collapse" and c.step == 3 and "loss exactly 0" in c.title


def test_transient_spike_that_recovers_is_healthy(tmp_path):
    rows = [(0.05, 1.0, 0.5, 1.0)] * 5 + [(0.05, 60.0, 0.5, 1.0)] + [(0.04, 1.1, 0.55, 0.95)] * 4
    assert_healthy(tmp_path, _verl_steps(rows))


def test_grpo_loss_zero_from_the_start_is_healthy(tmp_path):
    log = "".join(
        f"{{'loss': 0.0, 'grad_norm': {0.3 + i / 50}, 'learning_rate': 1e-06, 'reward': {0.2 + i / 40}, "
        f"'reward_std': 0.3, 'entropy': 0.7, 'epoch': {i / 10}}}\n"
        for i in range(8)
    )
    assert_healthy(tmp_path, log)


def test_grad_norm_exactly_zero_with_reward_spread_is_no_update(tmp_path):
    rec = "{{'loss': -0.0, 'grad_norm': 0.0, 'learning_rate': 3e-07, 'reward': 0.64, 'reward_std': {std}, 'kl': 0.0}}\n"
    c = first(tmp_path, rec.format(std=0.16))
    assert c.kind == "collapse" and c.severity == "warning" and "exactly 0" in c.title
    assert any("deepspeed" in f.why for f in c.fixes)
    c = first(tmp_path, rec.format(std=0.16) * 3)  # three logged steps: an error
    assert c.kind == "collapse" and c.severity == "error" and "all 3 logged steps" in c.title


def test_grad_norm_zero_with_nothing_to_learn_is_healthy(tmp_path):
    # every group scored alike (reward std 0): a zero gradient is right; a warm-up at lr 0 too
    assert_healthy(
        tmp_path,
        "{'loss': 0.0, 'grad_norm': 0.0, 'learning_rate': 1e-06, 'reward': 1.0, 'reward_std': 0.0}\n",
    )
    assert_healthy(
        tmp_path, "{'loss': 0.3, 'grad_norm': 0.0, 'learning_rate': 0.0, 'reward': 0.5, 'reward_std': 0.2}\n"
    )
    # one zero among non-zero norms is no finding either
    assert_healthy(
        tmp_path,
        "{'loss': 0.3, 'grad_norm': 0.0, 'learning_rate': 1e-06}\n{'loss': 0.3, 'grad_norm': 0.4, 'learning_rate': 1e-06}\n",
    )


# ---- mismatch -----------------------------------------------------------------------------------

MISMATCH_LOGS = {
    "verl_is_mean": ("step:{i} - rollout_corr/rollout_is_mean:{v} - actor/pg_loss:0.1\n", 3.1, 1.02),
    "verl_ess": ("step:{i} - rollout_corr/rollout_is_eff_sample_size:{v} - actor/pg_loss:0.1\n", 0.12, 0.93),
    "trl_logp": (
        "{{'loss': 0.01, 'sampling/sampling_logp_difference/mean': {v}, 'epoch': {i}}}\n",
        0.21,
        0.01,
    ),
    "trl_is": (
        "{{'loss': 0.01, 'sampling/importance_sampling_ratio/mean': {v}, 'epoch': {i}}}\n",
        0.31,
        0.99,
    ),
    "verl_kl": ("step:{i} - rollout_corr/kl:{v} - actor/pg_loss:0.1\n", 0.35, 0.002),
    "openrlhf": ("Train epoch [1/1]: {i}it, policy_loss={v}e-3, vllm_kl={v}, reward=0.5\n", 0.4, 0.001),
    "nemo": ('{{"step": {i}, "train/token_mult_prob_error": {v}, "train/loss": 0.1}}\n', 1.31, 1.011),
    "skyrl": (
        "step {i}: policy/rollout_train_logprobs_abs_diff_mean={v} policy/policy_loss=0.1\n",
        0.4,
        0.012,
    ),
    "slime": (
        '{{"train/step": {i}, "train/train_rollout_logprob_abs_diff": {v}, "train/loss": 0.1}}\n',
        0.2,
        0.02,
    ),
}


@pytest.mark.parametrize("fmt, bad, good", MISMATCH_LOGS.values(), ids=MISMATCH_LOGS.keys())
def test_mismatch_outside_the_published_bound(tmp_path, fmt, bad, good):
    c = first(tmp_path, "".join(fmt.format(i=i, v=bad) for i in range(1, 5)))
    assert c.kind == "mismatch" and c.severity == "warning" and c.fixes
    assert "bound:" in c.evidence[0] and "(ours: " in c.evidence[0]


@pytest.mark.parametrize("fmt, bad, good", MISMATCH_LOGS.values(), ids=MISMATCH_LOGS.keys())
def test_mismatch_inside_the_bound_is_healthy(tmp_path, fmt, bad, good):
    assert_healthy(tmp_path, "".join(fmt.format(i=i, v=good) for i in range(1, 5)))


def test_one_step_over_the_bound_among_many_is_healthy(tmp_path):
    log = "".join(f"step:{i} - rollout_corr/rollout_is_mean:{2.5 if i == 3 else 1.0}\n" for i in range(1, 9))
    assert_healthy(tmp_path, log)


def test_probability_difference_is_read_as_probabilities(tmp_path):
    # |dp| <= |d logp|: the bound carries over from log-probs as an implication, and the reading says so
    c = first(tmp_path, "".join(f"step:{i} - training/rollout_probs_diff_mean:0.2\n" for i in range(1, 5)))
    assert c.kind == "mismatch" and "probability: |p_rollout - p_train| (not log-probs)" in c.evidence[0]
    assert "1-Lipschitz" in c.evidence[0]
    # a batch's max difference of probabilities is large in healthy runs: no bound on it
    row = "training/rollout_probs_diff_mean:0.004 - training/rollout_probs_diff_max:0.93"
    assert_healthy(tmp_path, "".join(f"step:{i} - {row}\n" for i in range(1, 5)))


# ---- libraries: versions, engine features, engine limits, FSDP ------------------------------------

TRL_KWARG = """\
Traceback (most recent call last):
  File "/home/u/train_grpo.py", line 40, in <module>
    trainer = GRPOTrainer(model=model, args=args, train_dataset=ds)
  File "/opt/conda/lib/python3.11/site-packages/trl/trainer/grpo_trainer.py", line 512, in __init__
    self.llm = LLM(model=model.name_or_path, enable_sleep_mode=True, model_impl="vllm")
TypeError: LLM.__init__() got an unexpected keyword argument 'model_impl'
"""


def test_unexpected_keyword_from_another_library_is_a_version_mismatch(tmp_path):
    c = first(tmp_path, TRL_KWARG)
    assert c.kind == "version_mismatch" and "trl -> vllm" in c.where and "model_impl" in c.where
    assert "between trl and vllm" in c.title
    assert any("trl" in f.why and "vllm" in f.why for f in c.fixes)


def test_module_attribute_missing_is_a_version_mismatch(tmp_path):
    log = (
        "Traceback (most recent call last):\n"
        '  File "/usr/local/lib/python3.10/dist-packages/transformers/modeling_utils.py", line 88, in <module>\n'
        "    from torch.distributed.tensor import DTensor\n"
        "AttributeError: module 'torch.distributed' has no attribute 'tensor'\n"
    )
    c = first(tmp_path, log)
    assert c.kind == "version_mismatch" and c.where.startswith("transformers -> torch")


def test_cannot_import_name_from_a_library_is_a_version_mismatch(tmp_path):
    log = (
        "Traceback (most recent call last):\n"
        '  File "/usr/local/lib/python3.10/site-packages/verl/workers/rollout/vllm_rollout.py", line 3, in <module>\n'
        "    from vllm.worker.worker_base import WorkerWrapperBase\n"
        "ImportError: cannot import name 'WorkerWrapperBase' from 'vllm.worker.worker_base'\n"
    )
    c = first(tmp_path, log)
    assert c.kind == "version_mismatch" and c.where.startswith("verl -> vllm")
    assert "imported by verl/workers/rollout/vllm_rollout.py" in c.where


def test_engine_without_the_weight_update_call(tmp_path):
    log = (
        "(WorkerDict pid=812) Traceback (most recent call last):\n"
        '(WorkerDict pid=812)   File "/opt/verl/verl/workers/sharding_manager/fsdp_sglang.py", line 160, in update_weights\n'
        "(WorkerDict pid=812)     await self.inference_engine.update_weights_from_tensor(named_tensors)\n"
        "(WorkerDict pid=812) AttributeError: 'HttpServerEngineAdapter' object has no attribute "
        "'update_weights_from_tensor'\n"
    )
    c = first(tmp_path, log)
    assert c.kind == "engine_feature"
    assert (
        c.where
        == "HttpServerEngineAdapter.update_weights_from_tensor (inference_engine.update_weights_from_tensor)"
    )
    assert c.phase == "weight_sync" and c.fixes


def test_request_dropped_for_length_is_an_engine_limit(tmp_path):
    log = (
        "INFO 03-02 10:00:01 llm_engine.py:230] Initializing an LLM engine (v0.6.3) with config: max_model_len=8192\n"
        "WARNING 03-02 10:01:12 scheduler.py:1086] Input prompt (9125 tokens) is too long and exceeds limit of 8192\n"
    )
    c = first(tmp_path, log)
    # vLLM's prompt limit is min(max_model_len, max_num_batched_tokens): the log printed max_model_len=8192
    assert c.kind == "engine_limit" and c.where == "max_model_len" and "dropped" in c.title
    assert c.severity == "warning"
    line = "WARNING 02-16 15:37:32 scheduler.py:947] Input prompt (2501 tokens) is too long and exceeds limit of 2048\n"
    c = first(tmp_path, line)  # neither printed: the message cannot tell, both are named
    assert c.where == "max_model_len or max_num_batched_tokens" and len(c.fixes) >= 2
    c = first(tmp_path, "vllm serve m --max-model-len 128000\n" + line)  # the other one printed, larger
    assert c.where == "max_num_batched_tokens"


def test_prompt_over_max_model_len_exception(tmp_path):
    log = (
        "Traceback (most recent call last):\n"
        '  File "/usr/lib/python3/site-packages/vllm/engine/llm_engine.py", line 2040, in _validate_model_input\n'
        "    raise ValueError(\n"
        "ValueError: The decoder prompt (length 10240) is longer than the maximum model length of 8192. Make sure "
        "that `max_model_len` is no smaller than the number of text tokens plus multimodal tokens.\n"
    )
    c = first(tmp_path, log)
    assert (
        c.kind == "engine_limit"
        and c.where == "max_model_len (at _validate_model_input)"
        and c.severity == "error"
    )
    assert "10240-token prompt" in c.title


@pytest.mark.parametrize(
    "msg, shown",
    [
        ("ValueError: Must flatten tensors with uniform dtype but got torch.float32 and torch.bfloat16", "fp32 and bf16"),
        ("AssertionError: FSDP expects uniform original parameter dtype but got {torch.bfloat16, torch.float32}",
         "bf16 and fp32"),
    ],
)  # fmt: skip
def test_fsdp_flatten_is_a_dtype_error(tmp_path, msg, shown):
    log = (
        "Traceback (most recent call last):\n"
        '  File "/usr/lib/python3/site-packages/torch/distributed/fsdp/_flat_param.py", line 770, in _validate_tensors_to_flatten\n'
        f"{msg}\n"
    )
    c = first(tmp_path, log)
    assert c.kind == "dtype_error" and shown in c.title and c.fixes


def test_dtype_titles_name_every_operand():
    sdpa = (
        "RuntimeError: Expected query, key, and value to have the same dtype, but got query.dtype: float key.dtype: "
        "float and value.dtype: c10::BFloat16 instead."
    )
    assert (
        dtype_title(sdpa, "fp32", "fp32")
        == "Dtype error: query fp32, key fp32, value bf16 (one op needs one dtype)"
    )
    bare = "RuntimeError: self and mat2 must have the same dtype"
    assert (
        dtype_title(bare, None, None)
        == "Dtype error: self and mat2 of different dtypes (the message names neither dtype)"
    )
    mm = "RuntimeError: expected mat1 and mat2 to have the same dtype, but got: float != c10::BFloat16"
    assert dtype_title(mm, "fp32", "bf16") == "Dtype error: mat1 fp32, mat2 bf16"


def test_unknown_exception_names_its_library_and_phase(tmp_path):
    log = (
        "Traceback (most recent call last):\n"
        '  File "/home/u/verl/verl/workers/fsdp_workers.py", line 700, in generate_sequences\n'
        "    output = self.rollout.generate_sequences(prompts=prompts)\n"
        '  File "/usr/lib/python3/site-packages/vllm/worker/model_runner.py", line 1650, in execute_model\n'
        "    hidden = model_executable(**inputs)\n"
        "RuntimeError: something nobody has a rule for\n"
    )
    c = first(tmp_path, log)
    assert c.title.startswith("Unrecognised failure") and "vllm" in c.where
    assert c.phase == "generate"
    assert any(e.startswith("raised inside vllm (") for e in c.evidence)


# ---- healthy logs of every new rule -------------------------------------------------------------

HEALTHY = {
    "fp16_backoff": "[INFO] [stage3.py:1850:_overflow_clean_up] [deepspeed] OVERFLOW! Rank 0 Skipping step. "
    "Attempted loss scale: 65536, reducing to 32768\n{'loss': 1.2, 'grad_norm': 2.1, 'learning_rate': 1e-05, 'epoch': 0.1}\n"
    "{'loss': 1.1, 'grad_norm': 1.9, 'learning_rate': 1e-05, 'epoch': 0.2}\n",
    "kv_cache_info": "INFO 01-30 03:19:14 kv_cache_utils.py:395] # GPU blocks: 1381\n"
    "INFO 01-30 03:19:14 gpu_executor.py:122] Maximum concurrency for 8192 tokens per request: 5.39x\n"
    "INFO 01-30 03:19:20 model_runner.py:1523] max_num_batched_tokens=8192, max_model_len=8192\n",
    "weight_update_info": "[2025-05-01 10:00:00] Update weights begin.\n[2025-05-01 10:00:02] Update weights end.\n"
    "(WorkerDict pid=1) INFO: update_weights_from_tensor took 1.2 s\n",
    "bullets": "Step 1/10\n  • Loss: 0.51\n  • Avg Reward: 0.20\nStep 2/10\n  • Loss: 0.49\n  • Avg Reward: 0.25\n",
    "tables": "| step | loss | reward |\n|---|---|---|\n| 1 | 0.5 | 0.2 |\n| 2 | 0.4 | 0.3 |\n",
}


@pytest.mark.parametrize("text", HEALTHY.values(), ids=HEALTHY.keys())
def test_healthy_logs_get_no_warning(tmp_path, text):
    assert_healthy(tmp_path, text)


def test_readme_mismatch_table_is_the_vocabulary():
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text(encoding="utf-8")
    section = readme.split("**One mismatch vocabulary.**", 1)[1].split("\n\n", 2)[1]
    rows = [r for r in section.splitlines() if r.startswith("| ") and not r.startswith("| framework")]
    assert len(rows) == len(vocab.MISMATCH)
    for row, m in zip(rows, vocab.MISMATCH):
        assert f"`{m.name}`" in row and f"`{m.ours.replace('{}', '*')}`" in row, row


def test_fp16_skipped_step_grad_norm_inf_is_healthy(tmp_path):
    # DeepSpeed fp16: the overflow step's grad norm is inf, the step is skipped, the scale backs off
    log = (
        "{'loss': 1.31, 'grad_norm': 2.1, 'learning_rate': 1e-05, 'epoch': 0.1}\n"
        "[INFO] [logging.py:96:log_dist] [Rank 0] Overflow detected. Skipping step. Attempted loss scale: 65536, "
        "reducing to 32768\n"
        "{'loss': 1.29, 'grad_norm': inf, 'learning_rate': 1e-05, 'epoch': 0.2}\n"
        "{'loss': 1.25, 'grad_norm': 1.9, 'learning_rate': 1e-05, 'epoch': 0.3}\n"
    )
    assert_healthy(tmp_path, log)


def test_grad_norm_nan_that_stays_is_still_a_finding_under_fp16(tmp_path):
    log = (
        "[INFO] [stage_1_and_2.py:1800:step] [deepspeed] OVERFLOW! Rank 0 Skipping step. Attempted loss scale: 65536, "
        "reducing to 32768\n"
        "{'loss': 1.31, 'grad_norm': 2.1, 'epoch': 0.1}\n{'loss': 1.29, 'grad_norm': nan, 'epoch': 0.2}\n"
        "{'loss': 1.27, 'grad_norm': nan, 'epoch': 0.3}\n"
    )
    assert first(tmp_path, log).kind == "nonfinite"


@pytest.mark.parametrize(
    "line, where",
    [
        ("ImportError: tokenizers>=0.11.1,!=0.11.3,<0.14 is required for a normal functioning of this module, but "
         "found tokenizers==0.14.0.", "tokenizers"),
        ("vllm 0.6.3 requires torch==2.4.0, but you have torch 2.5.1 which is incompatible.\n"
         "RuntimeError: operator torchvision::nms does not exist", "vllm -> torch"),
    ],
)  # fmt: skip
def test_version_checks_name_the_pair(tmp_path, line, where):
    c = first(tmp_path, line + "\n")
    assert c.kind == "version_mismatch" and c.where == where and c.fixes


def test_flash_attention_fp32_is_an_unsupported_dtype(tmp_path):
    # the kernel has no fp32 implementation: a dtype the software refuses, not operands that disagree
    c = first(tmp_path, "RuntimeError: FlashAttention only support fp16 and bf16 data type\n")
    assert c.kind == "dtype_unsupported" and "fp32" in c.title


def test_pip_conflict_in_a_healthy_install_is_only_a_note(tmp_path):
    log = (
        "ERROR: pip's dependency resolver does not currently take into account all the packages that are installed.\n"
        "vllm 0.6.3 requires torch==2.4.0, but you have torch 2.5.1 which is incompatible.\n"
        "{'loss': 0.9, 'grad_norm': 1.0, 'epoch': 0.1}\n"
    )
    d = diagnose(tmp_path, log)
    assert [c.severity for c in d.causes if c.kind == "version_mismatch"] == ["info"]


def test_a_mismatch_before_a_collapse_is_named_in_its_evidence(tmp_path):
    rows = [(0.05, 1.0 + i / 10, 0.4, 0.9) for i in range(6)] + [(0.0, "nan", 0.0, 0.0)] * 3
    log = "".join(
        f"step:{i} - actor/pg_loss:{lo} - actor/grad_norm:{g} - critic/score/mean:{r} - actor/entropy:{e} - "
        f"rollout_corr/rollout_is_mean:2.7\n"
        for i, (lo, g, r, e) in enumerate(rows, 1)
    )
    causes = diagnose(tmp_path, log).causes
    assert causes[0].kind == "collapse" and causes[0].evidence[-1].startswith(
        "preceded by: Rollout-vs-trainer"
    )
    assert any(c.kind == "mismatch" and c.severity == "warning" for c in causes)


def test_sparse_reward_at_zero_for_two_steps_after_a_spike_is_healthy(tmp_path):
    rows = [(0.05, 1.0, 0.1, 1.0)] * 5 + [
        (0.05, 40.0, 0.1, 1.0),
        (0.05, 1.0, 0.0, 1.0),
        (0.05, 1.0, 0.0, 1.0),
    ]
    assert_healthy(tmp_path, _verl_steps(rows))
