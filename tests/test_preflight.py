"""Everything a suite names outside its file (plug-ins, model directories, presets, tasks) is imported
and checked before any worker starts, by `verlaudit run` and `verlaudit plan` alike; a
``file.py:attr`` plug-in is relative to the suite file and reaches the worker as an absolute path.

Run: `pytest tests/test_preflight.py`.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from trainer.data import resolve_callable
from verlaudit import cli
from verlaudit.run import runner
from verlaudit.run.hardware import PresentDevice
from verlaudit.run.preflight import preflight
from verlaudit.run.suite import load_suite
from verlaudit.run.worker import load_spec

PLUGINS = """\
def dataset():
    return [{"prompt": "1 2:", "answer": "1111"}]

def collator(examples, tokenizer):
    return {}

def reward(prompts, responses, examples):
    return [0.0] * len(responses)

def reward_model(tokenizer, device):
    return None

def one_arg_collator(examples):
    return {}

def reward_two(prompts, responses):
    return []

def dataset_needs_n(n):
    return []

def loader_one(tokenizer):
    return None

def flexible(*args, **kwargs):
    return []

def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    return 0.0

def score_no_truth(data_source, solution_str):
    return 0.0

def score_strict(data_source, solution_str, ground_truth, extra_info):
    return 0.0

NOT_CALLABLE = 3
"""


@pytest.fixture
def suite_dir(tmp_path, monkeypatch):
    """suites/s.yaml with its plug-ins in suites/plugins/user.py; the current directory elsewhere."""
    d = tmp_path / "suites"
    (d / "plugins").mkdir(parents=True)
    (d / "plugins" / "user.py").write_text(PLUGINS)
    (d / "plugins" / "broken.py").write_text("import not_a_module_anywhere\n")
    elsewhere = tmp_path / "cwd"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    return d


def write_suite(d: Path, train: str = "", variant: str = "{}") -> Path:
    p = d / "s.yaml"
    p.write_text(
        f"name: s\ntrain: {{steps: 1, device: cpu{', ' + train if train else ''}}}\nvariants:\n  a: {variant}\n"
    )
    return p


def test_a_relative_plugin_reaches_the_worker_as_the_suite_meant_it(suite_dir, tmp_path):
    p = write_suite(
        suite_dir, "data: {collator: plugins/user.py:collator, reward_fn: plugins/user.py:reward}"
    )
    suite = load_suite(p)
    path = str(suite_dir / "plugins" / "user.py")
    assert suite.variants["a"].data.collator == f"{path}:collator"
    assert suite.train.data.reward_fn == f"{path}:reward"
    preflight(suite)
    # the spec the runner writes holds the absolute path; the worker, from any directory, imports it
    plan = runner.plan_runs(suite, tmp_path / "out", PresentDevice(cuda=False, gpu_count=0))
    spec_path = tmp_path / "spec.json"
    spec_path.write_text(json.dumps(plan.runs[0].spec.to_dict()))
    spec = load_spec(spec_path)
    assert resolve_callable(spec.train.data.collator, "data.collator").__name__ == "collator"
    # the copy the report directory keeps round-trips to the same resolved configs
    assert type(suite).from_dict(suite.to_dict(), source=suite.source).variants == suite.variants


def test_absolute_paths_and_modules_are_kept(suite_dir):
    path = suite_dir / "plugins" / "user.py"
    p = write_suite(suite_dir, f"data: {{collator: '{path}:collator', reward_fn: 'tests.faults:nan_reward'}}")
    suite = load_suite(p)
    assert suite.train.data.collator == f"{path}:collator"
    assert suite.train.data.reward_fn == "tests.faults:nan_reward"


def test_verl_compute_score_is_resolved_and_checked_like_the_others(suite_dir):
    (suite_dir / "rows.jsonl").write_text("")
    rows = suite_dir / "rows.jsonl"
    p = write_suite(
        suite_dir,
        f"data: {{train_files: '{rows}', compute_score: plugins/user.py:compute_score, "
        "compute_score_kwargs: {scale: 2}}",
    )
    suite = load_suite(p)
    assert suite.train.data.compute_score == f"{suite_dir / 'plugins' / 'user.py'}:compute_score"
    preflight(suite)


def test_every_plugin_point_with_a_good_plugin_passes(suite_dir):
    p = write_suite(
        suite_dir,
        "data: {dataset: plugins/user.py:dataset, collator: plugins/user.py:collator, "
        "reward_fn: plugins/user.py:flexible}, model: {reward_model: plugins/user.py:reward_model}",
    )
    preflight(load_suite(p))


BAD = [
    # (train: section, variant, error: field and what)
    ("data: {collator: plugins/nope.py:collator}", "{}",
     r"train\.data\.collator: '.*plugins/nope\.py:collator': file .*/suites/plugins/nope\.py not found \(a "
     r"file\.py:attr path is relative to the suite file's directory"),
    ("", "{data: {reward_fn: plugins/user.py:missing}}",
     r"variants\.a\.data\.reward_fn: .*has no attribute 'missing'"),
    ("data: {dataset: plugins/user.py:NOT_CALLABLE}", "{}", r"train\.data\.dataset: .*NOT_CALLABLE is a int, not callable"),
    ("data: {collator: plugins/broken.py:f}", "{}",
     r"train\.data\.collator: .*importing .*broken\.py failed: ModuleNotFoundError: No module named 'not_a_module_anywhere'"),
    ("data: {collator: 'no_such_module_xyz:f'}", "{}",
     r"train\.data\.collator: 'no_such_module_xyz:f': importing no_such_module_xyz failed: ModuleNotFoundError"),
    ("data: {collator: plugins/user.py}", "{}", r"train\.data\.collator: 'plugins/user\.py' has no ':'"),
    # signatures: what the trainer passes, which the plug-in does not accept
    ("data: {collator: plugins/user.py:one_arg_collator}", "{}",
     r"train\.data\.collator: .*the trainer calls it as one_arg_collator\(examples, tokenizer\), which its "
     r"signature one_arg_collator\(examples\) does not accept"),
    ("", "{data: {reward_fn: plugins/user.py:reward_two}}",
     r"variants\.a\.data\.reward_fn: .*calls it as reward_two\(prompts, responses, examples\)"),
    ("data: {dataset: plugins/user.py:dataset_needs_n}", "{}", r"train\.data\.dataset: .*calls it as dataset_needs_n\(\)"),
    ("model: {reward_model: plugins/user.py:loader_one}", "{}",
     r"train\.model\.reward_model: .*calls it as loader_one\(tokenizer, device\)"),
    # model directories, presets, tasks
    ("model: {preset: tiny-lama}", "{}", r"train\.model\.preset: unknown preset 'tiny-lama'; expected one of tiny-llama"),
    ("", "{model: {path: /no/such/model}}", r"variants\.a\.model\.path: '/no/such/model' does not exist"),
    ("model: {path: '{empty}'}", "{}", r"train\.model\.path: '.*empty' has no config\.json"),
    ("model: {path: '{bad_config}'}", "{}", r"train\.model\.path: '.*bad_config': its config\.json does not load"),
    ("model: {critic_path: missing_critic}", "{}",
     r"train\.model\.critic_path: '.*/suites/missing_critic' does not exist \(a relative path is relative to the suite"),
    # the critic's vocabulary against the tokenizer's ids, as the actor's (nothing but the config is loaded)
    ("algo: {name: ppo}, model: {critic_path: '{small_vocab}'}", "{}",
     r"train\.model\.critic_path: '.*small_vocab' embeds 10 ids but the tokenizer has \d+"),
    ("model: {path: '{small_vocab}'}", "{}", r"train\.model\.path: '.*small_vocab' embeds 10 ids"),
    ("model: {reward_model: '{small_vocab}'}", "{}", r"train\.model\.reward_model: '.*small_vocab' embeds 10 ids"),
    # the user's model code: imported and its signature checked like every plug-in
    ("model: {setup: plugins/nope.py:setup}", "{}", r"train\.model\.setup: .*plugins/nope\.py not found"),
    ("model: {setup: plugins/user.py:reward_two}", "{}",
     r"train\.model\.setup: .*the trainer calls it as reward_two\(model, role, tokenizer\)"),
    ("algo: {name: ppo}", "{model: {setup: {critic: plugins/user.py:missing}}}",
     r"variants\.a\.model\.setup\.critic: .*has no attribute 'missing'"),
    ("model: {tokenizer: '{empty}'}", "{}", r"train\.model\.tokenizer: could not load a tokenizer from"),
    ("model: {tokenizer: /no/tok}", "{}", r"train\.model\.tokenizer: '/no/tok' is not a directory"),
    ("model: {reward_model: 'preset:huge'}", "{}", r"train\.model\.reward_model: unknown preset 'preset:huge'"),
    ("model: {reward_model: rm_dir_typo}", "{}", r"train\.model\.reward_model: '.*/suites/rm_dir_typo' is neither an existing directory"),
    ("data: {task: digitz}", "{}", r"train\.data\.task: unknown task 'digitz'; expected one of digits"),
    # verl's data and reward function (data.train_files, data.compute_score, called by keyword)
    ("data: {train_files: [rows.parquet]}", "{}", r"train\.data\.train_files: .*/suites/rows\.parquet not found"),
    ("data: {train_files: '{rows}', compute_score: plugins/user.py:score_no_truth}", "{}",
     r"train\.data\.compute_score: .*the trainer calls it as score_no_truth\(data_source=data_source, "
     r"solution_str=solution_str, ground_truth=ground_truth, extra_info=extra_info\)"),
    ("data: {train_files: '{rows}', compute_score: plugins/user.py:score_strict}",
     "{data: {compute_score_kwargs: {scale: 2}}}", r"variants\.a\.data\.compute_score: .*extra_info=extra_info, "
     r"scale=scale\), which its signature score_strict"),
]  # fmt: skip


def _fill(text: str, tmp_path: Path) -> str:
    (tmp_path / "empty").mkdir(exist_ok=True)
    bad = tmp_path / "bad_config"
    bad.mkdir(exist_ok=True)
    (bad / "config.json").write_text('{"model_type": "no-such-architecture"}')
    (tmp_path / "rows.jsonl").write_text("")
    if "{small_vocab}" in text:
        _small_vocab_model(tmp_path / "small_vocab")
    text = text.replace("{empty}", str(tmp_path / "empty")).replace("{rows}", str(tmp_path / "rows.jsonl"))
    return text.replace("{bad_config}", str(bad)).replace("{small_vocab}", str(tmp_path / "small_vocab"))


def _small_vocab_model(path: Path) -> None:
    """A 1-layer Qwen2 directory embedding 10 ids, fewer than the project's tokenizer has."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    cfg = Qwen2Config(vocab_size=10, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1)  # fmt: skip
    AutoModelForCausalLM.from_config(cfg).save_pretrained(path)


@pytest.mark.parametrize("command", ["run", "plan", "recommend"])
@pytest.mark.parametrize("train, variant, message", BAD, ids=[f"{i}" for i in range(len(BAD))])
def test_a_bad_plugin_or_model_path_stops_run_and_plan_before_any_worker(
    suite_dir, tmp_path, capsys, monkeypatch, command, train, variant, message
):
    def no_worker(*a, **k):
        raise AssertionError("a worker was started")

    if command == "recommend" and not message.startswith("train"):
        pytest.skip("recommend runs candidates made from train:, not the suite's variants")
    monkeypatch.setattr(runner, "_run_one", no_worker)
    p = write_suite(suite_dir, _fill(train, tmp_path), _fill(variant, tmp_path))
    capsys.readouterr()  # what writing the test's model directories printed
    argv = [command, str(p)] + (["--out", str(tmp_path / "out")] if command != "plan" else [])
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    # the suite file and the line of the key (the suite's lines: 1 name, 2 train, 3 variants, 4 the variant)
    line = 2 if message.startswith("train") else 4
    assert err.startswith(f"verlaudit {command}: error: {p}:{line}: ") and err.count("\n") == 1, err
    assert re.search(message, err), err
    if command != "run":
        assert not (tmp_path / "out").exists()
        return
    # nothing lost: the refused variant's run directory holds the one-line error for `verlaudit diagnose`
    (status,) = [json.loads(p.read_text()) for p in (tmp_path / "out").glob("*/status.json")]
    assert status["state"] == "failed" and status["reason"] == "preflight"
    assert status["error"] == err.removeprefix(f"verlaudit {command}: error: ").strip()


def test_the_error_names_the_line_of_the_key_with_flags_too(suite_dir):
    p = suite_dir / "s.yaml"
    p.write_text(
        "name: s\ntrain:\n  steps: 1\n  model:\n    preset: tiny-llama\n    setup: plugins/nope.py:setup\n"
        "variants:\n  a: {}\n"
    )
    for flags in ({}, {"steps": 1, "device": "cpu"}):
        with pytest.raises(ValueError, match=rf"^{re.escape(str(p))}:6: train\.model\.setup: "):
            preflight(load_suite(p, **flags))


def test_a_suite_with_one_refused_variant_stops_and_keeps_why(suite_dir, tmp_path, capsys):
    from verlaudit.run.preflight import preflight_problems

    p = suite_dir / "s.yaml"
    p.write_text(
        "name: s\ntrain: {steps: 1, device: cpu}\nvariants:\n  good: {}\n"
        "  bad: {data: {reward_fn: plugins/user.py:missing}}\n  also: {}\n"
    )
    suite = load_suite(p)
    problems = preflight_problems(suite)
    assert list(problems) == ["bad"] and "variants.bad.data.reward_fn" in str(problems["bad"])
    with pytest.raises(ValueError, match="variants.bad.data.reward_fn"):
        preflight(suite)  # plan and recommend stop at the first problem
    out = tmp_path / "out"
    # run stops too, before any worker (no good variant ran), and the refused one's directory says why
    assert cli.main(["run", str(p), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "variants.bad.data.reward_fn" in err and err.count("\n") == 1
    assert sorted(d.name for d in out.iterdir()) == ["bad"]
    status = json.loads((out / "bad" / "status.json").read_text())
    assert status["state"] == "failed" and status["reason"] == "preflight"
    assert "has no attribute 'missing'" in status["error"] and "\n" not in status["error"]
