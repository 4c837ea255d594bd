"""The machinery under every config section (`trainer.config`, `trainer.algo_config`): keyword-only
frozen dataclasses built from plain data, with a field-path ValueError for an unknown key, a wrong
type or a value out of range. Exercised by `pytest tests/test_config.py`.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Mapping
from typing import Any


class Section:
    """Mixin: recursive from_dict / to_dict for keyword-only frozen dataclasses."""

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None, where: str = "") -> Any:
        data = {} if data is None else data
        if not isinstance(data, Mapping):
            raise ValueError(f"{where or cls.__name__}: expected a mapping, got {type(data).__name__}")
        hints = typing.get_type_hints(cls)
        fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
        kwargs: dict[str, Any] = {}
        for key, value in data.items():
            path = f"{where}.{key}" if where else str(key)
            if key not in fields:
                renamed = getattr(cls, "_renamed", {})
                if key in renamed:
                    raise ValueError(f"{path}: {renamed[key]}")
                raise ValueError(f"{path}: unknown key; expected one of {', '.join(sorted(fields))}")
            kwargs[key] = _coerce(value, hints[key], path)
        try:
            return cls(**kwargs)
        except ValueError as e:
            msg = str(e)
            raise ValueError(f"{where}.{msg}" if where and not msg.startswith(where) else msg) from None

    def to_dict(self) -> dict[str, Any]:
        out = {}
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            v = getattr(self, f.name)
            out[f.name] = (
                v.to_dict() if isinstance(v, Section) else (dict(v) if isinstance(v, Mapping) else v)
            )
        return out


def _coerce(value: Any, hint: Any, path: str) -> Any:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(hint)
        if value is None and type(None) in args:
            return None
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return _coerce(value, a, path)
            except ValueError as e:
                errors.append(str(e))
        raise ValueError(errors[0] if len(errors) == 1 else f"{path}: {value!r} matches none of {hint}")
    if isinstance(hint, type) and issubclass(hint, Section):
        return hint.from_dict(value, path)
    if origin in (dict, Mapping, typing.Mapping):
        if not isinstance(value, Mapping):
            raise ValueError(f"{path}: expected a mapping, got {value!r}")
        return dict(value)
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise ValueError(f"{path}: expected a list, got {value!r}")
        return tuple(value)
    if hint is bool:
        if not isinstance(value, bool):
            raise ValueError(f"{path}: expected true or false, got {value!r}")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{path}: expected an integer, got {value!r}")
        return value
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            if isinstance(value, str):
                try:
                    return float(value)  # YAML reads 1e-6 as a string
                except ValueError:
                    pass
            raise ValueError(f"{path}: expected a number, got {value!r}")
        return float(value)
    if hint is str:
        if not isinstance(value, str):
            raise ValueError(f"{path}: expected a string, got {value!r}")
        return value
    return value


def check(cond: bool, path: str, msg: str) -> None:
    """Raise ``ValueError("<path>: <msg>")`` unless ``cond``."""
    if not cond:
        raise ValueError(f"{path}: {msg}")
