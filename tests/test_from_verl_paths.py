"""`verlaudit from-verl` writes the paths a verl script names relative to the suite it writes: a file
below the suite's directory, or in the same project (the directory from-verl runs in) as the suite, is
written relative to the suite file (`verlaudit.verl.writer.suite_paths`), so the suite runs from any
directory and in any clone; one outside both is written absolute and named in a note. Exercised with
verl's data files, its compute_score file and a local model directory.

Run: `pytest tests/test_from_verl_paths.py`.
"""

from __future__ import annotations

import yaml

from tests.verl_job import gsm8k_rows, tiny_qwen_dir, write_parquet, write_reward
from verlaudit import cli
from verlaudit.run.preflight import preflight
from verlaudit.run.suite import load_suite

SCRIPT = """\
python3 -m verl.trainer.main_ppo \\
    algorithm.adv_estimator=grpo \\
    data.train_files={data} \\
    data.train_batch_size=2 \\
    data.max_prompt_length=64 \\
    data.max_response_length=4 \\
    actor_rollout_ref.model.path={model} \\
    actor_rollout_ref.actor.ppo_mini_batch_size=2 \\
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2 \\
    actor_rollout_ref.rollout.n=2 \\
    custom_reward_function.path={reward} \\
    trainer.total_training_steps=1
"""


def test_paths_are_written_relative_to_the_suite_where_they_can_be(tmp_path, monkeypatch, capsys):
    project, outside = tmp_path / "project", tmp_path / "outside"
    (project / "data").mkdir(parents=True)
    (project / "suites").mkdir()
    outside.mkdir()
    write_parquet(project / "data" / "train.parquet", gsm8k_rows(4))
    write_reward(project / "suites" / "reward.py")
    model = tiny_qwen_dir(outside / "model")
    # the script names its files as verl reads them: relative to where it runs (the project), or absolute
    script = project / "run.sh"
    script.write_text(SCRIPT.format(data="data/train.parquet", reward="suites/reward.py", model=model))
    monkeypatch.chdir(project)
    assert cli.main(["from-verl", "run.sh", "-o", "suites/job.yaml", "--target", "cpu"]) == 0
    printed = capsys.readouterr().out
    train = yaml.safe_load((project / "suites" / "job.yaml").read_text())["train"]
    assert train["data"]["train_files"] == "../data/train.parquet"  # same project: relative, with ..
    assert train["data"]["compute_score"] == "reward.py:compute_score"  # below the suite's directory
    assert train["model"]["path"] == str(model)  # outside the project: absolute, and said so
    assert f"note: {model}: outside the suite's directory and the directory from-verl ran in" in printed
    # from another directory, the suite finds every file where the script meant it
    monkeypatch.chdir(tmp_path)
    suite = load_suite(project / "suites" / "job.yaml")
    assert suite.train.data.train_files == str(project / "data" / "train.parquet")
    assert suite.train.data.compute_score == f"{project / 'suites' / 'reward.py'}:compute_score"
    preflight(suite)
