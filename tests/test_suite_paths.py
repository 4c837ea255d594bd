"""Every path a suite names is relative to the suite file, resolved once when the suite loads
(`verlaudit.run.suite.resolve_paths`), whatever the current directory: one test per key, each run from
another directory, and absolute paths kept as written. The preflight (`verlaudit.run.preflight`) then
finds each file where the suite meant it, before any worker starts.

Run: `pytest tests/test_suite_paths.py`.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.verl_job import tiny_qwen_dir
from trainer.tokenizer import build_tokenizer
from verlaudit.run.preflight import preflight
from verlaudit.run.suite import load_suite

PLUGINS = """\
def dataset():
    return [{"prompt": "1 2:", "answer": "1111"}]

def collator(examples, tokenizer):
    return {}

def reward(prompts, responses, examples):
    return [0.0] * len(responses)

def reward_model(tokenizer, device):
    return None

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return 0.0

def setup(model, role, tokenizer):
    return None
"""


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return tiny_qwen_dir(tmp_path_factory.mktemp("model") / "tiny")


@pytest.fixture
def suite_dir(tmp_path, monkeypatch, model_dir) -> Path:
    """``proj/suite/`` holds the suite and everything it names; the current directory is elsewhere."""
    d = tmp_path / "proj" / "suite"
    (d / "plug").mkdir(parents=True)
    (d / "plug" / "user.py").write_text(PLUGINS)
    (d / "models").symlink_to(model_dir.parent, target_is_directory=True)
    build_tokenizer().save_pretrained(d / "tok")
    (d / "rows.jsonl").write_text("")
    (d / "more.jsonl").write_text("")
    (d / "baselines" / "cpu").mkdir(parents=True)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    return d


def _suite(d: Path, train: str, top: str = "") -> Path:
    p = d / "s.yaml"
    p.write_text(f"name: s\n{top}train: {{steps: 1, device: cpu, {train}}}\nvariants:\n  a: {{}}\n")
    return p


# (key, the train: entry with each path written as @<path relative to the suite file>, the value the
# configs hold, that path relative to the suite file)
KEYS = [
    ("model.path", "model: {path: @models/tiny}", lambda c: c.model.path, "models/tiny"),
    ("model.tokenizer", "model: {tokenizer: @tok}", lambda c: c.model.tokenizer, "tok"),
    ("model.critic_path", "algo: {name: ppo}, model: {critic_path: @models/tiny}",
     lambda c: c.model.critic_path, "models/tiny"),
    ("model.setup", "model: {setup: @plug/user.py:setup}", lambda c: c.model.setup, "plug/user.py:setup"),
    ("model.setup.<role>", "algo: {name: ppo}, model: {setup: {critic: @plug/user.py:setup}}",
     lambda c: c.model.setup["critic"], "plug/user.py:setup"),
    ("model.reward_model (directory)", "model: {reward_model: @models/tiny}",
     lambda c: c.model.reward_model, "models/tiny"),
    ("model.reward_model (loader)", "model: {reward_model: @plug/user.py:reward_model}",
     lambda c: c.model.reward_model, "plug/user.py:reward_model"),
    ("data.train_files", "data: {train_files: @rows.jsonl}", lambda c: c.data.train_files, "rows.jsonl"),
    ("data.train_files (list)", "data: {train_files: [@rows.jsonl, @more.jsonl]}",
     lambda c: c.data.train_files[1], "more.jsonl"),
    ("data.dataset", "data: {dataset: @plug/user.py:dataset}", lambda c: c.data.dataset, "plug/user.py:dataset"),
    ("data.collator", "data: {collator: @plug/user.py:collator}", lambda c: c.data.collator,
     "plug/user.py:collator"),
    ("data.reward_fn", "data: {reward_fn: @plug/user.py:reward}", lambda c: c.data.reward_fn,
     "plug/user.py:reward"),
    ("data.compute_score", "data: {train_files: @rows.jsonl, compute_score: @plug/user.py:compute_score}",
     lambda c: c.data.compute_score, "plug/user.py:compute_score"),
]  # fmt: skip


@pytest.mark.parametrize("key, train, value, rel", KEYS, ids=[k[0] for k in KEYS])
def test_a_relative_path_is_relative_to_the_suite_file(suite_dir, key, train, value, rel):
    suite = load_suite(_suite(suite_dir, train.replace("@", "")))
    for cfg in (suite.train, suite.variants["a"]):
        assert value(cfg) == str(suite_dir / rel), key
    preflight(suite)  # from another directory: every file is found where the suite meant it


@pytest.mark.parametrize("key, train, value, rel", KEYS, ids=[k[0] for k in KEYS])
def test_an_absolute_path_is_kept_as_written(suite_dir, key, train, value, rel):
    elsewhere = suite_dir.parent / "other"  # absolute: not under the suite's directory, kept as written
    suite = load_suite(_suite(suite_dir, train.replace("@", f"{elsewhere}/")))
    assert value(suite.variants["a"]) == f"{elsewhere}/{rel}"


def test_the_compare_baseline_is_relative_to_the_suite_file(suite_dir):
    suite = load_suite(_suite(suite_dir, "", top="compare: {baseline: baselines/cpu}\n"))
    assert suite.compare.baseline == str(suite_dir / "baselines" / "cpu")
    absolute = str(suite_dir / "baselines" / "cpu")
    assert (
        load_suite(_suite(suite_dir, "", top=f"compare: {{baseline: '{absolute}'}}\n")).compare.baseline
        == absolute
    )
