"""Numpy bools added inside a plug-in: ``np.bool_ + np.bool_`` is a logical or, not a count.

A reward that scores several checks as numpy bools (``np.bool_(pred == answer)``, ``arr.any()``, a
comparison of numpy scalars) and adds them (``(exact + has_number + short) / 3``) gets ``True`` for any
number of passing checks: the sum is 0 or 1, never 2 or 3, and the score takes two values where it meant
four. Python bools and numpy integers count; only numpy's bool scalar does this.

`BoolAdd` traces the real call of a reward function or collator on an audited step (``sys.settrace``,
only frames whose code is in the user's files: not torch, numpy, installed libraries, the trainer or
verlaudit). When such a frame returns with two or more locals that are ``np.bool_``, its source is parsed
once and every ``+`` chain whose operands are two or more of those names is a hit, with the names' values
at return: the call's count (Python ints) against numpy's or. Nothing is re-run; the cost is one trace
call per Python frame of the plug-in on audited steps. Exercised by `pytest tests/test_probes_numpy.py`.
"""

from __future__ import annotations

import ast
import inspect
import os
import sys
import textwrap
from collections.abc import Mapping
from typing import Any

import torch

import trainer
from verlaudit import kinds as K
from verlaudit.rundir import Finding

_OURS = tuple(
    os.path.dirname(os.path.abspath(m.__file__)) + os.sep for m in (torch, trainer, sys.modules["verlaudit"])
)
_LIBRARY = os.sep + "site-packages" + os.sep
_KIND: dict[str, bool] = {}
"""co_filename -> whether it is the user's file."""
_CHAINS: dict[Any, list[tuple[int, list[str], str]]] = {}
"""code object -> its ``+`` chains of names: (line, names, source text)."""


def _is_user(name: str) -> bool:
    got = _KIND.get(name)
    if got is None:
        path = os.path.abspath(name)
        got = _KIND[name] = not (name.startswith("<") or _LIBRARY in path or path.startswith(_OURS))
    return got


def _leaves(node: ast.AST) -> list[ast.AST]:
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        return _leaves(node.left) + _leaves(node.right)
    return [node]


def _chains(code) -> list[tuple[int, list[str], str]]:
    """The ``a + b (+ c ...)`` chains of plain names in ``code``'s function (outermost only)."""
    got = _CHAINS.get(code)
    if got is not None:
        return got
    out: list[tuple[int, list[str], str]] = []
    try:
        lines, first = inspect.getsourcelines(code)
        src = textwrap.dedent("".join(lines))
        tree = ast.parse(src)
    except (OSError, TypeError, SyntaxError):
        tree, first, src = None, 0, ""
    inner: set[int] = set()
    for node in ast.walk(tree) if tree is not None else ():
        if not (isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add)) or id(node) in inner:
            continue
        leaves = _leaves(node)
        for sub in ast.walk(node):
            if sub is not node:
                inner.add(id(sub))
        names = [n.id for n in leaves if isinstance(n, ast.Name)]
        if len(names) >= 2:
            out.append(
                (first + node.lineno - 1, names, ast.get_source_segment(src, node) or " + ".join(names))
            )
    _CHAINS[code] = out
    return out


class BoolAdd:
    """A trace over one plug-in call noting ``+`` chains of numpy bools in the user's frames."""

    def __init__(self) -> None:
        self.hits: dict[tuple[str, int], dict[str, Any]] = {}
        self._prev = None

    def __enter__(self) -> BoolAdd:
        try:
            import numpy as np
        except ImportError:  # no numpy: nothing to trace
            self.np = None
            return self
        self.np = np
        self._prev = sys.gettrace()
        sys.settrace(self._call)
        return self

    def __exit__(self, *exc) -> bool:
        if self.np is not None:
            sys.settrace(self._prev)
        return False

    def _call(self, frame, event, arg):
        if event == "call" and _is_user(frame.f_code.co_filename):
            return self._local
        return None

    def _local(self, frame, event, arg):
        if event == "return":
            try:
                self._inspect(frame)
            except Exception:  # the probe never breaks the user's call
                pass
        return self._local

    def _inspect(self, frame) -> None:
        np_bool = self.np.bool_
        bools = {k: bool(v) for k, v in frame.f_locals.items() if type(v) is np_bool}
        if len(bools) < 2:
            return
        for line, names, text in _chains(frame.f_code):
            used = [n for n in names if n in bools]
            if len(used) < 2:
                continue
            key = (frame.f_code.co_filename, line)
            h = self.hits.setdefault(
                key,
                {
                    "function": frame.f_code.co_name,
                    "text": text,
                    "names": used,
                    "calls": 0,
                    "differ": 0,
                    "most": 0,
                },
            )
            count = sum(bools[n] for n in used)
            h["calls"] += 1
            h["differ"] += int(count > 1)
            h["most"] = max(h["most"], count)

    def findings(self, *, where: str, ctx: Mapping[str, Any], role: str = "reward") -> list[Finding]:
        out = []
        for (file, line), h in self.hits.items():
            if not h["differ"]:
                continue  # no call had two checks true at once: the or and the count agree so far
            names = h["names"]
            at = f"{where} {os.path.basename(file)}:{line} ({h['function']})"
            out.append(
                Finding(
                    severity="warning",
                    kind=K.PLUGIN_NUMPY_BOOL_ADD,
                    role=role,
                    where=at,
                    message=f"{os.path.basename(file)}:{line} adds numpy bools ({h['text']}: {', '.join(names)} are "
                    f"np.bool_): numpy bool + bool is a logical or, so the sum is 0 or 1; in {h['differ']} of "
                    f"{h['calls']} calls {h['most']} of them were true and the sum still counted 1, so the score "
                    "takes fewer values than the checks it adds",
                    observed={"calls": h["calls"], "calls_undercounted": h["differ"], "names": names},
                    expected="a count of the true checks (Python int / bool arithmetic)",
                    fix=f"{at}: convert the checks before adding them: int({names[0]}) + int({names[1]}) + ... "
                    "(or Python bool(...) values, or np.sum / astype(int) on an array of them)",
                    **ctx,
                )
            )
        return out
