"""A verl launch script or Hydra YAML -> the job's overrides, each with the line it came from.

Shell scripts are read the way bash reads the lines users share: ``\\`` continuations, ``#`` comments,
single and double quotes, ``$VAR`` / ``${VAR}`` / ``${VAR:-default}`` from assignments earlier in the
script (``NAME=value``, ``export NAME=value``) or else from the environment, and commands separated by
newlines, ``;``, ``&&``, ``||`` and ``|``. Nothing is executed: ``$(pwd)`` is the directory
from-verl runs in (as the script would run from it), other ``$(...)`` and backquotes stay unresolved
and the keys that use them are reported. The job is the first command that runs a
``-m <module>`` whose name is verl's ``main_ppo`` (or a recipe's ``main_*``); its ``key=value`` words
are Hydra overrides (``+key=value`` adds a key, ``++`` forces, ``~key`` deletes) and their values
are parsed as Hydra parses them (numbers, booleans, null, ``[a,b]`` lists, ``{k: v}`` dicts, quoted
strings). A YAML file is flattened to dotted keys (``defaults:`` lists are noted, not expanded).
Exercised by `pytest tests/test_verl_launch.py`.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_ASSIGN = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)=(.*)$", re.S)
_OVERRIDE = re.compile(r"^(\+\+|\+|~)?([A-Za-z_][\w.\-/@]*)(=(.*))?$", re.S)
_REDIRECT = re.compile(r"^\d*(>>?|<)(&\d+)?$|^&>")
_WHOLE_VAR = re.compile(r'^"?(?:\$([A-Za-z_]\w*)|\$\{([A-Za-z_]\w*)\})"?$')
_ENTRY = re.compile(r"^(verl\.trainer\.main_\w+|recipe\.[\w.]+\.main_\w+|[\w.]*main_ppo)$")
UNRESOLVED = "\x00"
"""Marks a word whose text holds a ``$(...)``/backquote or an unset variable (never in real text)."""


@dataclasses.dataclass(frozen=True)
class Word:
    """One shell word after quote removal and expansion."""

    text: str
    raw: str
    """As written in the file (quotes and ``$`` references kept)."""
    line: int
    """1-based line where the word starts."""
    problems: tuple[str, ...] = ()
    """Why the text is not what bash would see (``$X is set neither in the script nor in the environment``)."""


@dataclasses.dataclass(frozen=True)
class Override:
    """One Hydra override of the job, with where it came from (for the diagnosis round trip)."""

    key: str
    value: Any
    """Parsed as Hydra parses it."""
    text: str
    """The value's text after shell expansion."""
    line: int
    line_text: str
    """The whole source line, as written."""
    op: str = "set"
    """``set``, ``add`` (``+key``), ``force_add`` (``++key``) or ``delete`` (``~key``)."""
    problems: tuple[str, ...] = ()
    var: str | None = None
    """When the value is exactly ``$VAR``: the variable, and the line that assigned it (or None when it
    came from the environment)."""
    var_line: int | None = None
    var_line_text: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            k: v for k, v in dataclasses.asdict(self).items() if v not in (None, (), "set") or k == "text"
        }


@dataclasses.dataclass(frozen=True)
class Launch:
    """What `read_launch` found in a file."""

    source: str
    kind: str
    """``script`` or ``yaml``."""
    entry: str
    """The module run (``verl.trainer.main_ppo``), or ``yaml``."""
    overrides: tuple[Override, ...]
    notes: tuple[str, ...] = ()
    config_name: str | None = None
    """Hydra ``--config-name`` (``ppo_megatron_trainer``...), when given."""

    def get(self, key: str) -> Override | None:
        """The last override of ``key`` (Hydra applies them in order)."""
        for o in reversed(self.overrides):
            if o.key == key:
                return o
        return None


# ---------------------------------------------------------------- shell words


class _Scanner:
    """Splits a script into commands of `Word`s, expanding variables from ``env`` as it goes."""

    def __init__(self, text: str, env: Mapping[str, str]) -> None:
        self.s, self.i, self.line = text, 0, 1
        self.vars: dict[str, tuple[str, int | None]] = {k: (v, None) for k, v in env.items()}

    def peek(self, k: int = 0) -> str:
        j = self.i + k
        return self.s[j] if j < len(self.s) else ""

    def take(self) -> str:
        c = self.s[self.i]
        self.i += 1
        if c == "\n":
            self.line += 1
        return c

    def commands(self):
        """Yields each command as a list of words (after the assignments of the ones before it)."""
        words: list[Word] = []
        while self.i < len(self.s):
            c = self.peek()
            if c == "\\" and self.peek(1) == "\n":
                self.take(), self.take()
            elif c in " \t\r":
                self.take()
            elif c == "#":
                while self.i < len(self.s) and self.peek() != "\n":
                    self.take()
            elif c in "\n;|&" and not (c == "&" and self.peek(1) == ">"):
                self.take()
                if c in "|&" and self.peek() == c:
                    self.take()
                if words:
                    yield words
                    words = []
            else:
                words.append(self.word())
        if words:
            yield words

    def _expand(self, problems: list[str]) -> str:
        """After a ``$``: the value of the reference that follows (`UNRESOLVED` when unknown)."""
        if self.s.startswith("(pwd)", self.i):  # the directory the script runs from: ours
            self.i += len("(pwd)")
            return os.getcwd()
        if self.peek() == "(":
            depth, start = 0, self.i
            while self.i < len(self.s):
                ch = self.take()
                depth += (ch == "(") - (ch == ")")
                if depth == 0:
                    break
            problems.append(
                f"$({self.s[start + 1 : self.i - 1]}) is a command substitution; from-verl runs nothing"
            )
            return UNRESOLVED
        if self.peek() == "{":
            self.take()
            start = self.i
            while self.i < len(self.s) and self.peek() != "}":
                self.take()
            body = self.s[start : self.i]
            if self.i < len(self.s):
                self.take()
            m = re.match(r"^([A-Za-z_][A-Za-z0-9_]*|\d+)(:?[-=+?])?(.*)$", body, re.S)
            if not m:
                problems.append(f"${{{body}}} is not a variable reference from-verl can expand")
                return UNRESOLVED
            name, op, default = m.group(1), m.group(2) or "", m.group(3)
            value = self.vars.get(name, (None, None))[0]
            is_set = value is not None and (value != "" or not op.startswith(":"))
            if op.endswith("+"):
                return default if is_set else ""
            if is_set:
                return value
            if op[-1:] in ("-", "="):
                default = self._expand_text(default, problems)
                if op.endswith("="):
                    self.vars[name] = (default, self.line)
                return default
            problems.append(f"${name} is set neither in the script nor in the environment")
            return UNRESOLVED
        m = _NAME.match(self.s, self.i) or re.compile(r"\d|[@*#?$!]").match(self.s, self.i)
        if not m:
            return "$"
        self.i = m.end()
        if m.group(0) in self.vars:
            return self.vars[m.group(0)][0]
        problems.append(f"${m.group(0)} is set neither in the script nor in the environment")
        return UNRESOLVED

    def _expand_text(self, text: str, problems: list[str]) -> str:
        """``$`` references inside ``text`` (a ``${VAR:-default}`` default), with this scanner's variables."""
        if "$" not in text:
            return text
        sub = _Scanner(text, {})
        sub.vars = self.vars
        out = []
        while sub.i < len(sub.s):
            if sub.peek() == "$":
                sub.take()
                out.append(sub._expand(problems))
            else:
                out.append(sub.take())
        return "".join(out)

    def word(self) -> Word:
        line, start = self.line, self.i
        out: list[str] = []
        problems: list[str] = []
        while self.i < len(self.s):
            c = self.peek()
            if c in " \t\r\n;" or (c in "|&" and not (out and out[-1] in "<>")):
                break
            if c == "\\":
                self.take()
                if self.i < len(self.s):
                    ch = self.take()
                    out.append("" if ch == "\n" else ch)
            elif c == "'":
                self.take()
                while self.i < len(self.s) and self.peek() != "'":
                    out.append(self.take())
                if self.i < len(self.s):
                    self.take()
            elif c == '"':
                self.take()
                while self.i < len(self.s) and self.peek() != '"':
                    d = self.peek()
                    if d == "\\" and self.peek(1) in '"\\$`\n':
                        self.take()
                        ch = self.take()
                        out.append("" if ch == "\n" else ch)
                    elif d == "$":
                        self.take()
                        out.append(self._expand(problems))
                    elif d == "`":
                        out.append(self._backquote(problems))
                    else:
                        out.append(self.take())
                if self.i < len(self.s):
                    self.take()
            elif c == "$":
                self.take()
                out.append(self._expand(problems))
            elif c == "`":
                out.append(self._backquote(problems))
            else:
                out.append(self.take())
        return Word(text="".join(out), raw=self.s[start : self.i], line=line, problems=tuple(problems))

    def _backquote(self, problems: list[str]) -> str:
        self.take()
        start = self.i
        while self.i < len(self.s) and self.peek() != "`":
            self.take()
        problems.append(f"`{self.s[start : self.i]}` is a command substitution; from-verl runs nothing")
        if self.i < len(self.s):
            self.take()
        return UNRESOLVED


# ---------------------------------------------------------------- Hydra values


def _split_top(body: str, sep: str) -> list[str]:
    parts, depth, quote, cur = [], 0, "", []
    for ch in body:
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch in "[{":
            depth += 1
        elif ch in "]}":
            depth -= 1
        elif ch == sep and depth == 0:
            parts.append("".join(cur))
            cur = []
            continue
        cur.append(ch)
    if "".join(cur).strip() or parts:
        parts.append("".join(cur))
    return parts


_INT = re.compile(r"^[+-]?\d[\d_]*$")
_FLOAT = re.compile(r"^[+-]?(\d[\d_]*\.\d*|\.\d+|\d[\d_]*)([eE][+-]?\d+)?$|^[+-]?(inf|nan)$", re.I)


def parse_value(text: str) -> Any:
    """A Hydra override value: ``null``, booleans (any case), ints, floats (``1e-6``, ``.5``, ``inf``),
    quoted strings, ``[a, b]`` lists, ``{k: v}`` dicts; anything else is the string itself."""
    t = text.strip()
    if t == "":
        return ""
    if t.lower() in ("null", "~"):
        return None
    if t.lower() in ("true", "false"):
        return t.lower() == "true"
    if _INT.match(t):
        return int(t.replace("_", ""))
    if _FLOAT.match(t):
        return float(t.replace("_", ""))
    if len(t) >= 2 and t[0] == t[-1] and t[0] in "'\"":
        return t[1:-1]
    if t.startswith("[") and t.endswith("]"):
        return [parse_value(p) for p in _split_top(t[1:-1], ",")]
    if t.startswith("{") and t.endswith("}"):
        out = {}
        for item in _split_top(t[1:-1], ","):
            k, _, v = item.partition(":")
            out[str(parse_value(k))] = parse_value(v)
        return out
    return t


# ---------------------------------------------------------------- scripts


def _entry_index(words: list[Word]) -> int | None:
    """Index of the module word after ``-m`` when it names a verl trainer entry (or a ``main_ppo.py``)."""
    for i, w in enumerate(words):
        if w.text == "-m" and i + 1 < len(words) and _ENTRY.match(words[i + 1].text):
            return i + 1
        if w.text.endswith(("main_ppo.py", "main_dapo.py")):
            return i
    return None


def read_script(path: str | Path, env: Mapping[str, str] | None = None) -> Launch:
    """The first verl trainer command of a shell script, its overrides and notes."""
    p = Path(path)
    text = p.read_text(encoding="utf-8")
    lines = text.splitlines()
    sc = _Scanner(text, os.environ if env is None else env)
    notes: list[str] = []
    found: tuple[list[Word], int] | None = None
    for words in sc.commands():
        head = 0
        while head < len(words) and _ASSIGN.match(words[head].text):
            head += 1
        k = _entry_index(words)
        if found is not None and k is None and all(_OVERRIDE.match(w.text) and "." in w.text for w in words):
            notes.append(
                f"line {words[0].line}: {words[0].raw} ... looks like overrides, but bash ended the verl "
                "command before this line (a comment or a missing '\\' on the line above): they are "
                "not part of the job"
            )
            continue
        if k is not None:
            if found is None:
                found = (words, k)
            else:
                notes.append(
                    f"line {words[k].line}: a second verl command ({words[k].text}); only the first "
                    f"(line {found[0][found[1]].line}) is read"
                )
            continue
        cmd = words[head].text if head < len(words) else None
        if cmd is None:  # NAME=value lines; `NAME=value cmd` sets NAME for that command only
            assigns = words
        elif cmd in ("export", "declare", "local", "readonly"):
            assigns = [w for w in words[1:] if not w.text.startswith("-")]
        else:
            assigns = []
        for w in assigns:
            m = _ASSIGN.match(w.text)
            if m and found is None:
                sc.vars[m.group(1)] = (m.group(2) if not w.problems else UNRESOLVED, w.line)
    if found is None:
        raise ValueError(
            f"{p}: no verl trainer command found (python3 -m verl.trainer.main_ppo key=value ...); "
            "pass the launch script that runs it, or verl's Hydra YAML"
        )
    words, k = found
    return _overrides_of(p, lines, words, k, notes, sc.vars)


def _overrides_of(p: Path, lines: list[str], words: list[Word], k: int, notes: list[str], vars_) -> Launch:
    overrides: list[Override] = []
    config_name = None
    rest = words[k + 1 :]
    i = 0
    while i < len(rest):
        w = rest[i]
        i += 1
        if (
            w.text.startswith("--config-name")
            or w.text.startswith("--config-path")
            or w.text in ("-cn", "-cp")
        ):
            value = w.text.partition("=")[2] if "=" in w.text else (rest[i].text if i < len(rest) else "")
            i += 0 if "=" in w.text else 1
            if w.text.startswith(("--config-name", "-cn")):
                config_name = value
            notes.append(
                f"line {w.line}: {w.text.split('=')[0]} {value}: verl's config file is not read; keys "
                "the script does not set take verl's ppo_trainer.yaml defaults"
            )
            continue
        if _REDIRECT.match(w.text):
            i += 0 if re.search(r"&\d+$|\S[<>]\S", w.text) else 1  # `> log` names its target in the next word
            continue
        if w.raw in ("$@", '"$@"', "$*", '"$*"'):
            notes.append(f"line {w.line}: {w.raw} passes the script's own arguments on; none are assumed")
            continue
        m = _OVERRIDE.match(w.text)
        if not m or (m.group(3) is None and m.group(1) != "~"):
            notes.append(f"line {w.line}: {w.raw!r} is not a Hydra key=value override; ignored")
            continue
        op = {"+": "add", "++": "force_add", "~": "delete", None: "set"}[m.group(1)]
        value_text = m.group(4) or ""
        ref = _WHOLE_VAR.match(w.raw.partition("=")[2])
        var = ref.group(1) or ref.group(2) if ref else None
        var_line = vars_.get(var, (None, None))[1] if var else None
        overrides.append(
            Override(
                key=m.group(2),
                value=None if UNRESOLVED in value_text else parse_value(value_text),
                text=value_text.replace(UNRESOLVED, "?"),
                line=w.line,
                line_text=lines[w.line - 1],
                op=op,
                problems=w.problems,
                var=var,
                var_line=var_line,
                var_line_text=lines[var_line - 1] if var_line else None,
            )
        )
    entry = words[k].text
    if not entry.endswith("main_ppo") and not entry.endswith("main_ppo.py"):
        notes.append(
            f"entry {entry}: a recipe's own trainer; its keys are read as main_ppo's, and recipe logic "
            "beyond them is not reproduced"
        )
    return Launch(
        source=str(p),
        kind="script",
        entry=entry,
        overrides=tuple(overrides),
        notes=tuple(notes),
        config_name=config_name,
    )


# ---------------------------------------------------------------- YAML


def read_yaml_config(path: str | Path) -> Launch:
    """A Hydra YAML in verl's ppo_trainer.yaml shape, flattened to one override per leaf key."""
    import yaml

    p = Path(path)
    text = p.read_text(encoding="utf-8")
    lines = text.splitlines()
    try:
        root = yaml.compose(text)
    except yaml.YAMLError as e:
        raise ValueError(f"{p}: YAML error: {e}") from None
    if not isinstance(root, yaml.MappingNode):
        raise ValueError(f"{p}: expected a mapping of verl config sections (actor_rollout_ref, data, ...)")
    overrides: list[Override] = []
    notes: list[str] = []

    def walk(node: yaml.Node, prefix: str) -> None:
        for key_node, value_node in node.value:
            key = f"{prefix}{key_node.value}"
            if key == "defaults":
                notes.append(
                    f"line {key_node.start_mark.line + 1}: the Hydra defaults list is not expanded; keys "
                    "it would pull in take verl's ppo_trainer.yaml defaults"
                )
                continue
            if isinstance(value_node, yaml.MappingNode) and value_node.value:
                walk(value_node, key + ".")
                continue
            line = key_node.start_mark.line + 1
            segment = text[value_node.start_mark.index : value_node.end_mark.index]
            value = yaml.safe_load(segment) if segment.strip() else None
            if (
                isinstance(value, str)
                and isinstance(value_node, yaml.ScalarNode)
                and value_node.style is None
            ):
                value = parse_value(value)  # PyYAML reads 1e-6 as a string; Hydra (OmegaConf) as a float
            overrides.append(
                Override(key=key, value=value, text=segment.strip(), line=line, line_text=lines[line - 1])
            )

    walk(root, "")
    return Launch(source=str(p), kind="yaml", entry="yaml", overrides=tuple(overrides), notes=tuple(notes))


def read_launch(path: str | Path, env: Mapping[str, str] | None = None) -> Launch:
    """A ``.yaml``/``.yml`` file as a Hydra config, anything else as a shell script."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"{p}: no such file; pass your verl launch script (.sh) or Hydra config (.yaml)")
    if p.suffix in (".yaml", ".yml"):
        return read_yaml_config(p)
    return read_script(p, env)
