"""The recipes `trainer.train` dispatches to (``algo.name``), registered by the module that holds each
one's ``run(config, observer, resolved)``. The module is imported on lookup, not here: the config
validates names without loading models, engines and data. Exercised by `pytest tests/test_train.py`.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from trainer.registry import Registry

RECIPE: Registry = Registry("algo.name", unknown="{key}: unknown algorithm {name!r}; expected one of {names}")
"""``algo.name`` -> the recipe's module. Metadata: ``critic`` (the recipe trains a critic), ``estimator``
(its advantage estimator when ``adv_estimator`` is unset; None: no rollout, no advantages)."""

RECIPE.add("ppo", "trainer.ppo", critic=True, estimator="gae")
RECIPE.add("grpo", "trainer.grpo", critic=False, estimator="grpo")
RECIPE.add("dpo", "trainer.dpo", critic=False, estimator=None)

ALGORITHMS = RECIPE.names()
"""Every ``algo.name``."""


def recipe_run(name: str) -> Callable[..., Any]:
    """The ``run`` of recipe ``name`` (ValueError naming the known recipes otherwise)."""
    return importlib.import_module(RECIPE.get(name)).run
