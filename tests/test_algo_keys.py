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
    """AlgoConfig's key -> the string literal under it, in the section class that holds the key."""
    tree = ast.parse(Path(inspect.getsourcefile(AlgoConfig)).read_text())
    sections = {cls.__name__ for cls in AlgoConfig.sections().values()}
    docs, last = {}, None
    for cls in (n for n in tree.body if isinstance(n, ast.ClassDef) and n.name in sections):
        for node in cls.body:
            if isinstance(node, ast.AnnAssign):
                last = node.target.id
            elif isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and last:
                docs[last], last = node.value.value, None
    return docs


def test_every_field_is_documented():
    docs = field_docstrings()
    assert AlgoConfig.keys() and [k for k in AlgoConfig.keys() if k not in docs] == []


def test_every_section_field_is_a_flat_key():
    # the sections hold every key once; the flat keys are what a suite writes
    held = [f.name for sec in AlgoConfig.sections().values() for f in dataclasses.fields(sec)]
    assert sorted(held) == sorted(AlgoConfig.keys()) == sorted(AlgoConfig().to_dict())


@pytest.mark.parametrize("key", sorted(V.ALGO_KEYS))
def test_docstring_names_the_verl_key(key):
    assert key in AlgoConfig.keys(), key
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
    for key in AlgoConfig.keys():
        if key in V.ALGO_KEYS or key in ("dpo_loss", "label_smoothing", "discopop_tau", "beta"):
            assert f"`{key}`" in section, key


def _readme_section() -> str:
    readme = (ROOT / "README.md").read_text()
    return readme.split("## Compatibility with verl and TRL", 1)[1].split("\n## ", 1)[0]


def _registries():
    from trainer import advantages as A
    from trainer import losses as L
    from trainer import recipes as R

    return {
        "loss_mode": L.POLICY_LOSS,
        "adv_estimator": A.ADV_ESTIMATOR,
        "kl_penalty": L.KL_ESTIMATOR,
        "loss_agg_mode": L.LOSS_AGG,
        "dpo_loss": L.DPO_LOSS,
        "name": R.RECIPE,
    }


@pytest.mark.parametrize(
    "key", ["loss_mode", "adv_estimator", "kl_penalty", "loss_agg_mode", "dpo_loss", "name"]
)
def test_readme_rows_list_every_registered_name_as_supported(key):
    # every name of a registry is on a README row that says supported (or differs), none on a "not supported"
    # row: the table and the code read from one list
    rows = [line for line in _readme_section().splitlines() if line.startswith("|") or "ours is" in line]
    for name in _registries()[key].names():
        on = [r for r in rows if (f"`name: {name}`" if key == "name" else f"`{name}`") in r]
        assert on, (key, name)
        assert (
            any("not supported" not in r.rsplit("|", 2)[-2] for r in on if r.startswith("|")) or key == "name"
        )


def test_registry_lookup_names_every_known_variant():
    for key, registry in _registries().items():
        with pytest.raises(ValueError) as info:
            registry.get("no-such-variant")
        assert all(n in str(info.value) for n in registry.names()), key
        assert str(info.value).count("\n") == 0
