"""Named variants of an algorithm part, each registered once where it is defined (verl's
``register_policy_loss`` / ``register_adv_est`` style): a decorator to add one, and one lookup that raises
with the known names. Every list of names (config validation, from-verl's choices, the README table that
tests/test_algo_keys.py checks) is read from the registry, so a new loss or estimator is one decorated
definition. The registries: `trainer.losses` (policy losses, KL estimators, loss aggregation modes, DPO
losses), `trainer.advantages` (advantage estimators), `trainer.recipes` (ppo, grpo, dpo).
Exercised by `pytest tests/test_algo_keys.py`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Generic, TypeVar

T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class Entry(Generic[T]):
    """One registered variant: its name, the object, and what the registry's users read about it."""

    name: str
    value: T
    info: Mapping[str, Any]
    alias_of: str | None = None
    """The canonical name when this name is an alias (verl's ``k1`` for ``kl``)."""


class Registry(Generic[T]):
    """Name -> variant, in registration order (the order names are listed in errors and docs)."""

    def __init__(self, key: str, unknown: str = "{key} {name!r}: expected one of {names}") -> None:
        self.key = key
        """The config key whose values these are (``loss_mode``), for messages."""
        self._unknown = unknown
        self._entries: dict[str, Entry[T]] = {}

    def register(self, name: str, *, aliases: tuple[str, ...] = (), **info: Any) -> Callable[[T], T]:
        """Decorator: ``@REG.register("vanilla")`` adds the decorated object under ``name`` (and each alias);
        ``info`` is free metadata (what an estimator needs, which keys a loss reads)."""

        def decorator(value: T) -> T:
            self.add(name, value, aliases=aliases, **info)
            return value

        return decorator

    def add(self, name: str, value: T, *, aliases: tuple[str, ...] = (), **info: Any) -> None:
        """Registers ``value`` under ``name``; a name registered twice is a programming error."""
        for n in (name, *aliases):
            assert n not in self._entries, f"{self.key}: {n!r} registered twice"
        self._entries[name] = Entry(name, value, dict(info))
        for a in aliases:
            self._entries[a] = Entry(a, value, dict(info), alias_of=name)

    def entry(self, name: str) -> Entry[T]:
        """The entry of ``name``; ValueError naming the key and every known name otherwise."""
        if name not in self._entries:
            raise ValueError(self._unknown.format(key=self.key, name=name, names=", ".join(self.names())))
        return self._entries[name]

    def get(self, name: str) -> T:
        """The variant registered as ``name`` (see `entry` for the error)."""
        return self.entry(name).value

    def names(self, *, aliases: bool = True) -> tuple[str, ...]:
        """Every registered name in registration order (aliases after their canonical name)."""
        return tuple(n for n, e in self._entries.items() if aliases or e.alias_of is None)

    def where(self, **info: Any) -> tuple[str, ...]:
        """The canonical names whose metadata has every ``key=value`` of ``info``."""
        return tuple(
            n
            for n, e in self._entries.items()
            if e.alias_of is None and all(e.info.get(k) == v for k, v in info.items())
        )

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())
