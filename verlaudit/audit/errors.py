"""Failures as results: classify an exception, parse dtype errors, find the module that raised.

`classify(exc)` -> ``oom`` | ``nonfinite`` | ``dtype_error`` | ``interrupted`` | ``exception``.
`parse_dtype_error(message)` pulls observed / expected dtypes out of PyTorch's messages with
`verlaudit.dtypes` (every wording it knows: ``expected scalar type BFloat16 but found Float``,
``expected m1 and m2 to have the same dtype``, ``Input type (...) and weight type (...)``...).
`innermost_module(tb, names)` walks the traceback for the deepest frame whose ``self`` is a module
of an audited model — this works at every audit level, hooks or not. `format_traceback(exc)` keeps
the head and the tail of a long traceback for status.json. Exercised by
`pytest tests/test_audit_checks.py tests/test_dtypes.py`.
"""

from __future__ import annotations

import traceback
import types
from collections.abc import Mapping

from verlaudit.dtypes import parse_dtype_message


def parse_dtype_error(message: str) -> dict[str, str | None] | None:
    """{"observed", "expected", "pattern"} when ``message`` is a dtype error, else None
    (`verlaudit.dtypes.parse_dtype_message`: the same reading `verlaudit diagnose` gives a log)."""
    found = parse_dtype_message(message)
    return None if found is None else found.to_dict()


def is_oom(exc: BaseException) -> bool:
    name = type(exc).__name__
    msg = str(exc)
    return (
        name == "OutOfMemoryError"
        or "CUDA out of memory" in msg
        or "out of memory" in msg.lower()
        and "cuda" in msg.lower()
        or "DefaultCPUAllocator: can't allocate memory" in msg
        or isinstance(exc, MemoryError)
    )


def classify(exc: BaseException) -> str:
    """The status reason for an exception that escaped training."""
    if isinstance(exc, KeyboardInterrupt) or type(exc).__name__ == "Interrupted":
        return "interrupted"
    if is_oom(exc):
        return "oom"
    if type(exc).__name__ == "NonFiniteLossError":
        return "nonfinite"
    if parse_dtype_error(str(exc)) is not None:
        return "dtype_error"
    return "exception"


def innermost_module(
    tb: types.TracebackType | None, names: Mapping[int, tuple[str, str]]
) -> tuple[str, str] | None:
    """(role, module path) of the deepest traceback frame whose ``self`` is an audited module.
    ``names`` maps ``id(module)`` -> (role, qualified name)."""
    found = None
    while tb is not None:
        obj = tb.tb_frame.f_locals.get("self")
        if obj is not None and id(obj) in names:
            found = names[id(obj)]
        tb = tb.tb_next
    return found


def one_line(exc: BaseException, limit: int = 400) -> str:
    text = f"{type(exc).__name__}: {exc}".replace("\n", " ").strip()
    return text if len(text) <= limit else text[: limit - 3] + "..."


TRACEBACK_HEAD = 2000
TRACEBACK_TAIL = 6000


def format_traceback(exc: BaseException, head: int = TRACEBACK_HEAD, tail: int = TRACEBACK_TAIL) -> str:
    """The formatted traceback, at most about ``head + tail`` characters: a long one keeps its first
    lines (``Traceback (most recent call last):`` and the outermost frames) and its last ones (the
    innermost frames and the error), cut at line ends with a marked gap between them."""
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    return cut_middle(text, head, tail)


def cut_middle(text: str, head: int, tail: int) -> str:
    """``text`` unchanged when it fits in ``head + tail`` characters, else its first ``head`` and last
    ``tail`` characters (each shortened to whole lines where a line end is near) with a marker line
    saying how many characters were left out."""
    if len(text) <= head + tail:
        return text
    first = text[:head]
    if "\n" in first[head // 2 :]:
        first = first[: first.rindex("\n") + 1]
    last = text[len(text) - tail :]
    if "\n" in last[: tail // 2]:
        last = last[last.index("\n") + 1 :]
    cut = len(text) - len(first) - len(last)
    return f"{first}... [{cut} characters of the traceback cut here] ...\n{last}"
