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
            elif isinstance(v, tuple):  # plain data: a suite's list (train_files, gdpo_reward_keys)
                v = list(v)
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


class FlatSections(Section):
    """Mixin: a config built of sections (each field a `Section`) that users read and write as ONE flat
    mapping: every key names a field of exactly one section, so ``{clip_ratio: 0.1}`` sets
    ``policy_loss.clip_ratio``. The sections are the code's structure; the keys stay flat in suites,
    specs and ``to_dict``. ``cfg.clip_ratio`` reads through to its section, the constructor takes flat
    keywords, and ``__post_init__`` (when the class has one) runs after the sections are built, for the
    checks that span sections. Declare it ``@dataclasses.dataclass(frozen=True, init=False)``."""

    @classmethod
    def sections(cls) -> dict[str, type]:
        """Section field -> its Section class, in declaration order."""
        hints = typing.get_type_hints(cls)
        return {f.name: hints[f.name] for f in dataclasses.fields(cls)}  # type: ignore[arg-type]

    @classmethod
    def section_of(cls) -> dict[str, str]:
        """Flat key -> the section field holding it (built once per class)."""
        cached = cls.__dict__.get("_section_of_cache")
        if cached is None:
            cached = {}
            for name, sec in cls.sections().items():
                for f in dataclasses.fields(sec):
                    assert f.name not in cached, f"{cls.__name__}: key {f.name} in two sections"
                    cached[f.name] = name
            cls._section_of_cache = cached  # type: ignore[attr-defined]
        return cached

    @classmethod
    def keys(cls) -> tuple[str, ...]:
        """Every flat key, section by section."""
        return tuple(cls.section_of())

    @classmethod
    def defaults(cls) -> dict[str, Any]:
        """Flat key -> its default."""
        out: dict[str, Any] = {}
        for sec in cls.sections().values():
            for f in dataclasses.fields(sec):
                out[f.name] = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
        return out

    def __init__(self, **flat: Any) -> None:
        where = type(self).section_of()
        unknown = [k for k in flat if k not in where]
        if unknown:
            raise TypeError(f"{type(self).__name__}: unexpected keyword argument {unknown[0]!r}")
        for name, sec in type(self).sections().items():
            object.__setattr__(self, name, sec(**{k: v for k, v in flat.items() if where[k] == name}))
        post = getattr(self, "__post_init__", None)
        if post is not None:
            post()

    def __getattr__(self, name: str) -> Any:
        # only reached when ordinary lookup fails: a flat key reads through to its section
        section = type(self).section_of().get(name) if not name.startswith("_") else None
        if section is None:
            raise AttributeError(f"{type(self).__name__} has no attribute {name!r}")
        return getattr(object.__getattribute__(self, section), name)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None, where: str = "") -> Any:
        data = {} if data is None else data
        if not isinstance(data, Mapping):
            raise ValueError(f"{where or cls.__name__}: expected a mapping, got {type(data).__name__}")
        at = cls.section_of()
        hints = {name: typing.get_type_hints(sec) for name, sec in cls.sections().items()}
        kwargs: dict[str, Any] = {}
        for key, value in data.items():
            path = f"{where}.{key}" if where else str(key)
            if key not in at:
                renamed = getattr(cls, "_renamed", {})
                if key in renamed:
                    raise ValueError(f"{path}: {renamed[key]}")
                raise ValueError(f"{path}: unknown key; expected one of {', '.join(sorted(at))}")
            kwargs[key] = _coerce(value, hints[at[key]][key], path)
        try:
            return cls(**kwargs)
        except ValueError as e:
            msg = str(e)
            raise ValueError(f"{where}.{msg}" if where and not msg.startswith(where) else msg) from None

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for name in type(self).sections():
            out.update(getattr(self, name).to_dict())
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
