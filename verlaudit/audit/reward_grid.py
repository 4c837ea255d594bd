"""A reward on a grid coarser than its inputs warrant (prec13): ``reward/value_grid``.

A reward function whose values are all multiples of 10^-k (k = 1..3), not all whole numbers, a handful of
distinct values over several calls, while the responses it scored vary, has rounded its score somewhere:
a score formatted to k decimals and read back (``f"{p:.1f}"``, ``"%.2f"``, a log record), ``round(x, k)``,
a ``decimal`` context of few significant digits, a ``quantize``. Designed reward levels are not that:
values that are literal constants of the function's module (``return 0.2`` for a formatted answer) stay
quiet. The finding needs the construct too: the user's module (the function, unwrapped from the
trainer's adapter) is read for a rounding construct of that many digits, and it is named with its
file:line; without one nothing is said (a reward of 0.25 steps from a count over four characters is a
partial credit, not a rounding).

Read on audited steps from the reward function's own call (`verlaudit.audit.auditor.Auditor.plugin_call`):
no second call, no fork; the values and the source text only. Exercised by `pytest tests/test_reward_grid.py`.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from verlaudit import kinds as K
from verlaudit.rundir import Finding

DIGITS = (1, 2, 3)
"""Decimal places of the grids looked for (0.1, 0.01, 0.001)."""
HANDFUL = 4
"""Distinct values at most for a grid to be coarse (more: the score has the resolution it needs)."""
MIN_VALUES = 8
"""Rewards (pooled over the audited calls) before the grid is judged."""
MIN_RESPONSES = 4
"""Distinct responses among them: the inputs vary."""
_OURS = (str(Path(__file__).resolve().parents[2] / "trainer"), str(Path(__file__).resolve().parents[1]))
"""The trainer's and verlaudit's own files: adapters around the user's function, never its source."""
_PATTERNS: tuple[tuple[re.Pattern[str], str], ...] = (
    (re.compile(r"[:%][-+ #0]*\d*\.(\d+)[fFgGe%]"), "a score formatted to {k} decimal place(s) and read back"),
    (re.compile(r"\bround\([^()]*(?:\([^()]*\)[^()]*)*,\s*(?:ndigits\s*=\s*)?(-?\d+)\s*\)"), "round(x, {k})"),
    (re.compile(r"getcontext\(\)\s*\.\s*prec\s*=\s*(\d+)|prec\s*=\s*(\d+)"), "a decimal context of {k} significant digits"),
    (re.compile(r"\.quantize\((?:\s*(?:decimal\.)?Decimal\(\s*['\"]([0-9.eE+-]+)['\"])?"), "Decimal.quantize({k})"),
)  # fmt: skip


def _grid(values: Sequence[float]) -> int | None:
    """The coarsest decimal grid (places) every value is on, when they are not all whole numbers."""
    if all(float(v).is_integer() for v in values):
        return None
    for k in DIGITS:
        s = 10**k
        if all(abs(v * s - round(v * s)) <= 1e-9 * max(1.0, abs(v * s)) for v in values):
            return k
    return None


def user_function(fn: Any) -> Callable | None:
    """The user's function behind ``fn``: unwrapped from partials, ``__wrapped__`` and the closures of the
    trainer's adapters (verl's compute_score is called per row by one), else None."""
    seen: set[int] = set()
    todo = [fn]
    while todo:
        f = todo.pop(0)
        if id(f) in seen or len(seen) > 32:
            continue
        seen.add(id(f))
        if isinstance(f, functools.partial):
            todo.append(f.func)
            continue
        f = getattr(f, "__func__", f)
        code = getattr(f, "__code__", None)
        if code is None:
            call = None if isinstance(f, type) else vars(type(f)).get("__call__")
            if getattr(call, "__code__", None) is not None:
                todo.append(call)
            # an adapter object (verl's compute_score behind the trainer's VerlReward): what it holds
            held = getattr(f, "__dict__", None) if not isinstance(f, type) else None
            todo += [v for v in (held or {}).values() if callable(v) and not isinstance(v, type)]
            continue
        if not code.co_filename.startswith(_OURS):
            return f
        todo += [getattr(f, "__wrapped__", None)] if hasattr(f, "__wrapped__") else []
        for cell in getattr(f, "__closure__", None) or ():
            try:
                v = cell.cell_contents
            except ValueError:
                continue
            if callable(v):
                todo.append(v)
    return None


def _literals(fn: Callable) -> set[float]:
    """Float constants of the user's module's code (the function's and everything it defines)."""
    out: set[float] = set()
    mod = inspect.getmodule(fn)
    codes = [getattr(v, "__code__", None) for v in vars(mod).values()] if mod is not None else []
    codes.append(getattr(fn, "__code__", None))
    todo = [c for c in codes if c is not None]
    while todo:
        c = todo.pop()
        for k in c.co_consts:
            if isinstance(k, float) or (isinstance(k, int) and not isinstance(k, bool)):
                out.add(float(k))
            elif hasattr(k, "co_consts"):
                todo.append(k)
    return out


def _reached(fn: Callable) -> list[Callable]:
    """``fn`` and the functions of its own file it calls by name (transitively): the code its values pass."""
    path = getattr(getattr(fn, "__code__", None), "co_filename", None)
    out, todo, seen = [], [fn], set()
    while todo and len(out) < 32:
        f = todo.pop(0)
        code = getattr(f, "__code__", None)
        if code is None or id(code) in seen or code.co_filename != path:
            continue
        seen.add(id(code))
        out.append(f)
        names, codes = set(), [code]
        while codes:
            c = codes.pop()
            names.update(c.co_names)
            codes += [k for k in c.co_consts if hasattr(k, "co_names")]
        g = getattr(f, "__globals__", {})
        todo += [g[n] for n in sorted(names) if callable(g.get(n))]
    return out


def _lines(fn: Callable) -> list[tuple[int, str]]:
    """(line number, text) of what ``fn``'s values pass through: its source, the same file's functions it
    calls, and its module's top-level statements (a decimal context set at import)."""
    try:
        path = inspect.getsourcefile(fn)
        text = Path(path).read_text(encoding="utf-8").splitlines() if path else []
    except (OSError, TypeError, UnicodeDecodeError):
        return []
    picked: dict[int, str] = {}
    for f in _reached(fn):
        try:
            body, start = inspect.getsourcelines(f)
        except (OSError, TypeError):
            continue
        picked.update({start + j: line for j, line in enumerate(body)})
    top: dict[int, str] = {}
    for i, line in enumerate(text, 1):  # top level: outside def / class bodies
        if line[:1] not in ("", " ", "\t", "#") and not line.startswith(
            ("def ", "class ", "async def ", "@")
        ):
            top[i] = line
    # the function's own code first: a construct there is the one its values pass, a module's the fallback
    return sorted(picked.items()) + sorted((i, t) for i, t in top.items() if i not in picked)


def construct(fn: Callable, k: int) -> tuple[str, int, str, str] | None:
    """(file, line, text, what) of the first rounding construct the user's values pass that fits a k-place
    grid (k decimals, or at most 3 significant digits for a decimal context), else None."""
    lines = _lines(fn)
    path = inspect.getsourcefile(fn) if lines else None
    for i, line in lines:
        code = line.split("#", 1)[0]
        for pat, what in _PATTERNS:
            for m in pat.finditer(code):
                num = next((g for g in m.groups() if g), "")
                if "quantize" in what:
                    places = len(num.split(".", 1)[1]) if "." in num else 0
                    fits = places == k
                elif "context" in what:
                    fits = num.isdigit() and int(num) <= 3
                else:
                    fits = num.isdigit() and int(num) == k
                if fits:
                    return str(path), i, line.strip(), what.format(k=num)
    return None


def precision_construct(fn: Any) -> tuple[str, int, str, str] | None:
    """(file, line, text, what) of a construct that compares at limited precision in the user's code a
    reward passes (a decimal context of few digits, a round(), a quantize), whatever its digits, else None."""
    user = user_function(fn)
    if user is None:
        return None
    lines = _lines(user)
    path = inspect.getsourcefile(user) if lines else None
    for i, line in lines:
        code = line.split("#", 1)[0]
        for pat, what in _PATTERNS[1:]:  # a display format is not a comparison
            m = pat.search(code)
            num = next((g for g in m.groups() if g), "") if m else ""
            if m and not ("context" in what and not (num.isdigit() and int(num) <= 12)):
                return str(path), i, line.strip(), what.format(k=num)
    return None


def lenient_hint(findings: list[Finding], fn: Any) -> list[Finding]:
    """``reward/answer_lenient`` findings of the reward probe with the construct that makes the comparison
    lenient named (its file:line), where the user's code has one: both sides rounded before ==."""
    out = []
    for f in findings:
        found = precision_construct(fn) if f.kind == K.REWARD_ANSWER_LENIENT else None
        if found is None:
            out.append(f)
            continue
        path, line, text, what = found
        at = f"{Path(path).name}:{line}"
        said = f"the comparison runs at limited precision: {at} `{text}` ({what}) rounds both sides before they are compared, so answers that differ past those digits compare equal"
        tolerance = (
            ": its numeric comparison has a tolerance (rel_tol / abs_tol) wider than the answers' spacing"
        )
        msg = f.message.replace(tolerance, f": {said}") if tolerance in f.message else f"{f.message}; {said}"
        f = dataclasses.replace(
            f,
            message=msg,
            observed={**(f.observed or {}), "precision_at": at, "precision": what},
            fix=f"compare exactly, not through {what} ({at}): int(pred) == int(truth) or the extracted text == "
            "str(ground_truth); where decimals are needed, compare under decimal.localcontext() with enough "
            "prec for the answers' digits, and keep a reduced context for the report that needs it",
        )
        out.append(f)
    return out


class GridWatch:
    """The reward function's values pooled over audited calls; one finding a run at most."""

    def __init__(self) -> None:
        self.values: list[float] = []
        self.responses: set[str] = set()
        self.calls = 0
        self.done = False

    def observe(
        self, fn: Any, responses: Sequence[Any], values: Sequence[float] | None, *, where: str, ctx: dict
    ) -> list[Finding]:
        if (
            self.done
            or not values
            or not all(isinstance(v, float | int) and math.isfinite(v) for v in values)
        ):
            return []
        self.values += [float(v) for v in values]
        self.responses.update(str(r) for r in responses)
        self.calls += 1
        distinct = sorted(set(self.values))
        if len(self.values) < MIN_VALUES or len(self.responses) < MIN_RESPONSES or self.calls < 2:
            return []
        if len(distinct) > HANDFUL:
            self.done = True  # the score has resolution: nothing to say this run
            return []
        k = _grid(distinct)
        user = user_function(fn)
        if k is None or user is None:
            return []
        if all(v in _literals(user) for v in distinct):
            return []  # designed levels: the module writes these values itself
        found = construct(user, k)
        if found is None:
            return []
        self.done = True
        path, line, text, what = found
        name = getattr(user, "__qualname__", getattr(user, "__name__", "the reward function"))
        shown = ", ".join(f"{v:g}" for v in distinct)
        return [
            Finding(
                severity="error" if len(distinct) == 1 else "warning",
                kind=K.REWARD_VALUE_GRID,
                role="reward",
                where=where,
                step=ctx.get("step"),
                phase=ctx.get("phase") or "reward",
                observed={
                    "values": distinct,
                    "grid": 10.0**-k,
                    "rewards": len(self.values),
                    "responses": len(self.responses),
                    "at": f"{Path(path).name}:{line}",
                },
                expected=f"a score with the resolution of its inputs (more than {HANDFUL} values)",
                message=f"the reward function {name} returns values on a grid of {10.0**-k:g}: {len(self.values)} "
                f"rewards of {len(self.responses)} distinct responses took only {len(distinct)} value(s) ({shown}), "
                f"none of them a constant the module writes; {Path(path).name}:{line} rounds it ({what}: "
                f"`{text}`), so responses the score tells apart get the same reward (a decimal/format round "
                "trip loses the score's precision)",
                fix=f"return the unrounded float score from {name} ({Path(path).name}:{line}): keep the rounding "
                "(format, round, decimal context) for display only, and never read the reward back from a "
                "formatted string or log record",
            )
        ]
