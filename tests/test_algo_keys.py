"""Every algorithm option names its verl key in one place (verlaudit/verl_keys.py ALGO_KEYS), the field's
docstring in trainer/algo_config.py names the same key, and the README's compatibility table lists our key.

Run: PYTHONPATH=. pytest -q tests/test_algo_keys.py
"""

import ast
import dataclasses
import inspect
from pathlib import Path

import pytest

from trainer.config import AlgoConfig
from verlaudit import verl_keys as V

ROOT = Path(__file__).resolve().parents[1]


def field_docstrings() -> dict[str, str]:
    """AlgoConfig's field -> the string literal under it."""
    tree = ast.parse(Path(inspect.getsourcefile(AlgoConfig)).read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "AlgoConfig")
    docs, last = {}, None
    for node in cls.body:
        if isinstance(node, ast.AnnAssign):
            last = node.target.id
        elif isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and last:
            docs[last], last = node.value.value, None
    return docs


def test_every_field_is_documented():
    docs = field_docstrings()
    assert [f.name for f in dataclasses.fields(AlgoConfig) if f.name not in docs] == []


@pytest.mark.parametrize("key", sorted(V.ALGO_KEYS))
def test_docstring_names_the_verl_key(key):
    assert key in {f.name for f in dataclasses.fields(AlgoConfig)}, key
    tail = ".".join(V.ALGO_KEYS[key].split(".")[-2:])  # docstrings drop the actor_rollout_ref. prefix
    assert tail in field_docstrings()[key], (key, V.ALGO_KEYS[key])


def test_helpers_and_role_keys():
    assert V.algo_key("algo.lam") == "algorithm.lam"
    assert V.algo_key("clip_ratio_high") == "actor_rollout_ref.actor.clip_ratio_high"
    assert V.algo_key("loss_mode") == "actor_rollout_ref.actor.policy_loss.loss_mode"
    assert V.algo_override("use_kl_in_reward", True) == "algorithm.use_kl_in_reward=true"
    assert V.algo_override("loss_scale_factor", None) == "actor_rollout_ref.actor.loss_scale_factor=null"
    with pytest.raises(KeyError):
        V.algo_key("dpo_loss")  # TRL's, not verl's
    # the role-aware helpers keep their meaning
    assert V.micro_batch("critic") == "critic.ppo_micro_batch_size_per_gpu"
    assert V.algo_key("micro_batch_size") == V.MICRO_BATCH


def test_readme_table_lists_every_algorithm_option():
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Compatibility with verl and TRL", 1)[1].split("\n## ", 1)[0]
    for f in dataclasses.fields(AlgoConfig):
        if f.name in V.ALGO_KEYS or f.name in ("dpo_loss", "label_smoothing", "discopop_tau", "beta"):
            assert f"`{f.name}`" in section, f.name
    from trainer.losses import DPO_LOSSES

    for kind in DPO_LOSSES:
        assert f"`{kind}`" in section, kind
