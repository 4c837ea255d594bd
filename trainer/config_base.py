"""The machinery under every config section (`trainer.config`, `trainer.algo_config`): keyword-only
frozen dataclasses built from plain data, with a field-path ValueError for an unknown key, a wrong
type or a value out of range. Exercised by `pytest tests/test_config.py`.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any

UNSET = "unset"
"""A variant's value for an inherited key that puts the key back to its default (``null`` does the
same for a key whose type has no null of its own); `without_unset` applies it before parsing."""


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
        missing = [n for n, f in fields.items() if n not in kwargs and _required(f)]
        if missing:
            path = f"{where}.{missing[0]}" if where else missing[0]
            need = ", ".join(n for n, f in fields.items() if _required(f))
            raise ValueError(f"{path}: missing; {getattr(cls, '_noun', cls.__name__)} needs {need}")
        try:
            return cls(**kwargs)
        except ValueError as e:
            msg = str(e)
            raise ValueError(f"{where}.{msg}" if where and not msg.startswith(where) else msg) from None

    def to_dict(self) -> dict[str, Any]:
        out = {}
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            v = getattr(self, f.name)
            if isinstance(v, Mapping):
                v = dict(v)
            elif isinstance(v, Path):
                v = str(v)
            elif hasattr(v, "to_dict"):  # a Section, or a value class with from_dict/to_dict
                v = v.to_dict()
            out[f.name] = v
        return out


def _required(f: dataclasses.Field) -> bool:
    return f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING


def without_unset(data: Any) -> Any:
    """``data`` with every key whose value is `UNSET` dropped (at any depth): after a variant is
    merged onto its base, the key then takes its default."""
    if isinstance(data, Mapping):
        return {k: without_unset(v) for k, v in data.items() if not (isinstance(v, str) and v == UNSET)}
    return data


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
    if isinstance(hint, type) and callable(getattr(hint, "from_dict", None)):
        return hint.from_dict(value, path)  # a value class that reads its own plain data
    if hint is Path:
        if not isinstance(value, (str, Path)):
            raise ValueError(f"{path}: expected a path, got {value!r}")
        return Path(value)
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
