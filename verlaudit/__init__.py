"""verlaudit: a precision-auditing harness for RL post-training (PPO, GRPO, DPO).

``verlaudit.watch(...)`` audits a training loop of your own (`verlaudit.integrations.watch`). It is
looked up on first use, by name: this package stays on the bottom floor (tests/test_architecture.py),
and ``import verlaudit`` stays cheap (no torch).
"""

import importlib
from typing import Any

__version__ = "0.1.0"

_LAZY = {"watch": "verlaudit.integrations.watch"}
"""Public names that live on a higher floor: name -> the module that defines it."""


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'verlaudit' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])
