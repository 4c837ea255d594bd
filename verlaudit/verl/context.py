"""The state of one from-verl mapping (`Context`): the script's overrides by key, what has been
consumed, and the records (`Record`: what became of each key) and suite values made so far.
`verlaudit.verl.mapping` drives it. Exercised by `pytest tests/test_from_verl.py`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from trainer.config import TrainConfig
from verlaudit.verl.launch import Launch, Override
from verlaudit.verl.rows import NO_DEFAULT, Unmapped, canonical


@dataclasses.dataclass(frozen=True)
class Record:
    """What became of one verl key."""

    kind: str
    """``mapped``, ``default`` (left out of the script: verl's default written), ``consistent`` (nothing to
    set) or ``unmapped``."""
    verl: str
    text: str
    """The value as the script wrote it (or verl's default)."""
    suite: str | None = None
    value: Any = None
    reason: str = ""
    line: int | None = None


class Context:
    """The script's overrides by key, what has been consumed, and the records and suite values made."""

    def __init__(self, launch: Launch) -> None:
        self.by_key: dict[str, Override] = {}
        for o in launch.overrides:
            self.by_key[canonical(o.key)] = o  # Hydra: the last override of a key wins
        self.used: set[str] = set()
        self.records: list[Record] = []
        self.notes: list[str] = []
        self.train: dict[str, Any] = {}
        self.algo = "ppo"
        """Our recipe: ``ppo`` (verl's gae) or ``grpo`` (every critic-free estimator)."""
        self.estimator: str | None = None
        """``algo.adv_estimator`` when the recipe's own (gae, grpo) is not the script's."""
        self.unread: dict[str, str] = {}
        """Algo options nothing reads in this job -> why (`_unread`)."""
        self.ours = TrainConfig().to_dict()

    def has(self, key: str) -> bool:
        return key in self.by_key and self.by_key[key].op != "delete"

    def get(self, key: str, default: Any = None) -> Any:
        """The script's value of ``key`` (or ``default``), without consuming it."""
        return self.by_key[key].value if self.has(key) else default

    def set(self, path: str, value: Any) -> None:
        node = self.train
        *parents, last = path.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[last] = value

    def _ours(self, path: str) -> Any:
        node: Any = self.ours
        for p in path.split("."):
            node = node.get(p, NO_DEFAULT) if isinstance(node, Mapping) else NO_DEFAULT
        return node

    def record(
        self,
        kind: str,
        key: str,
        *,
        suite: str | None = None,
        value: Any = None,
        reason: str = "",
        text: str | None = None,
        apply: bool = True,
    ) -> None:
        """Records what became of ``key`` (consuming it) and, for mapped keys, sets the suite value under
        ``train:`` (``apply=False``: a value outside ``train:``, set by the caller)."""
        o = self.by_key.get(key)
        self.used.add(key)
        if o is not None and o.problems and kind != "unmapped":
            kind, reason = "unmapped", "; ".join(o.problems)
        if kind in ("mapped", "default") and suite is not None and apply:
            self.set(suite, value)
        verl_key = o.key if o is not None else key
        shown = text if text is not None else (o.text if o is not None else "")
        self.records.append(
            Record(kind, verl_key, shown, suite, value, reason, o.line if o is not None else None)
        )

    def value(self, key: str, default: Any, convert: Callable[[Any], Any] = lambda v: v) -> tuple[Any, bool]:
        """``(converted value, from the script)``; the script's value when it can be read, else ``default``.
        A value that does not convert is recorded unmapped and ``default`` comes back."""
        if not self.has(key):
            return default, False
        o = self.by_key[key]
        if o.problems:
            self.record("unmapped", key)
            return default, False
        try:
            return convert(o.value), True
        except Unmapped as e:
            self.record("unmapped", key, reason=str(e))
            return default, False

    def default(self, key: str, suite: str, value: Any, text: str) -> None:
        """verl's default for a key the script leaves out, written when ours differs."""
        if self._ours(suite) != value:
            self.record("default", key, suite=suite, value=value, text=text)
