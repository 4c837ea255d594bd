"""A diagnosis's fix, written back as the lines of the user's own verl script.

A run made by ``verlaudit from-verl`` carries the script's overrides (key, value text, line, the
line as written, and the shell variable the value came from) in its manifest under
``config.origin.verl``. A `Fix` names verl keys in verl 0.5's spelling (`verlaudit.verl_keys`);
`script_lines` finds the same key in the script (under the spelling the script used), and returns the
script's line before and after the change: the ``key=value`` word itself, or the ``NAME=value`` line
when the value is ``$NAME`` and no other key uses ``$NAME``; a key the script does not set becomes a line to add. A fix without a
value takes it from its suite key when the table's row says the two are the same value. Pure: no
I/O. Exercised by `pytest tests/test_from_verl.py`.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Mapping
from typing import Any

from verlaudit.verl.rows import ROWS, canonical

_WORD = re.compile(r"^([A-Za-z_]\w*(?:\.\w+)+)(?:=(\S+))?$")
_LONG_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def _canonical(key: str) -> str:
    return canonical(key.lstrip("+~"))


def _fix_parts(verl: str) -> list[tuple[bool, str, str | None]]:
    """``(is_env, key, value)`` for each ``key[=value]`` of a Fix's verl text: alternatives split by
    `` / ``, several keys to set together by spaces (``A=true B=0.01 (or C with D)``: A and B), and a
    parenthesised remark ignored; ``env NAME=value`` is an environment variable."""
    out = []
    for part in verl.split(" / "):
        words = part.split(" (", 1)[0].split()
        if words[:1] == ["env"] and len(words) > 1 and "=" in words[1]:
            name, _, value = words[1].partition("=")
            out.append((True, name, value))
            continue
        for word in words:
            m = _WORD.match(word)
            if m:
                out.append((False, m.group(1), m.group(2)))
    return out


def _suite_value(suite: str | None, key: str) -> str | None:
    """The value of a Fix's suite text (``algo.lr: 1e-07``) when the table maps it 1:1 to ``key``."""
    if not suite or ":" not in suite:
        return None
    path, _, value = suite.partition(":")
    value = value.strip().split()[0] if value.strip() else ""
    if not value or value.startswith("<"):
        return None
    for row in ROWS:
        if row.suite == path.strip() and row.invertible and _canonical(row.verl) == _canonical(key):
            return value
    return None


def _spelled_like(value: str, old: str) -> str:
    """``bf16`` written as the script writes dtypes (``bfloat16`` where it used ``float16``...)."""
    if old.strip("'\"") in _LONG_DTYPES.values() and value in _LONG_DTYPES:
        return _LONG_DTYPES[value]
    return value


def _replace_word(line: str, key: str, value: str) -> str:
    """``line`` with the value of its ``key=...`` word (``+key``, quotes and all) replaced."""
    pattern = re.compile(r"((?:^|\s)['\"]?\+{0,2}" + re.escape(key) + r"=)(\"[^\"]*\"|'[^']*'|[^\s'\"\\]*)")
    return pattern.sub(lambda m: m.group(1) + value, line, count=1)


def _quote(value: str) -> str:
    return value if re.fullmatch(r"[\w.,:/+\-\[\]@=]+", value) else shlex.quote(value)


def _sub_value(pattern: str, line: str, value: str, keep_tail: bool = False) -> str:
    """``line`` with the second group of ``pattern`` replaced by ``value`` (a third group kept)."""
    return re.sub(
        pattern, lambda m: m.group(1) + value + ((m.group(3) or "") if keep_tail else ""), line, count=1
    )


def _override_lines(source: str, o: Mapping[str, Any], value: str, *, yaml: bool, shared: bool) -> list[str]:
    """The before/after lines for one override the script sets (``shared``: its ``$VAR`` feeds other keys)."""
    if o.get("var") and not o.get("var_line"):
        return [
            f"{source}, line {o['line']}: {o['line_text'].strip()}   <- ${o['var']} comes from the "
            f"environment: set {o['var']}={_quote(value)}"
        ]
    if o.get("var") and not shared:
        line, old = o["var_line"], o["var_line_text"]
        assign = r"(^\s*(?:export\s+)?" + re.escape(o["var"]) + r"=)(\"[^\"]*\"|'[^']*'|\S*)"
        new = _sub_value(assign, old, _quote(value))
    else:  # the key's own word (a variable several keys share changes for this key only)
        line, old = o["line"], o["line_text"]
        if yaml:
            new = _sub_value(r"^(\s*[^:#]+:\s*)(.*?)(\s*#.*)?$", old, value, keep_tail=True)
        else:
            new = _replace_word(old, o["key"], _quote(value))
    if new == old:
        return [f"{source}, line {line}: {old.strip()}   <- already reads {value}"]
    return [f"{source}, line {line}: {old.strip()}", f"{' ' * len(source)}  now: {new.strip()}"]


def script_lines(origin: Mapping[str, Any], verl: str | None, suite: str | None = None) -> list[str]:
    """The script's lines as they should read after the fix (empty when the fix names no verl key)."""
    if not verl:
        return []
    source = str(origin.get("source", "your script"))
    yaml = origin.get("kind") == "yaml"
    by_key: dict[str, Mapping[str, Any]] = {}
    uses: dict[str, int] = {}
    for o in origin.get("overrides") or ():
        by_key[_canonical(o["key"])] = o
        uses[o.get("var") or ""] = uses.get(o.get("var") or "", 0) + 1
    out: list[str] = []
    for is_env, key, value in _fix_parts(verl):
        o = by_key.get(_canonical(key))
        value = value if value is not None else _suite_value(suite, key)
        if is_env:
            out.append(f"{source}: add before the command: export {key}={value}")
        elif o is None and value is None:
            out.append(f"{source}: {key} is not set in the script (verl's default applies); set it")
        elif o is None:
            out.append(
                f"{source}: add {key.rsplit('.', 1)[-1]}: {value} under {key.rsplit('.', 1)[0]}"
                if yaml
                else f"{source}: add to the command:  {key}={_quote(value)} \\"
            )
        elif value is None:
            out.append(f"{source}, line {o['line']}: {o['line_text'].strip()}   <- change this value")
        else:
            value = _spelled_like(value, o.get("text", ""))
            out += _override_lines(source, o, value, yaml=yaml, shared=uses.get(o.get("var") or "", 0) > 1)
    return out
