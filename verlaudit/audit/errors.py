"""Failures as results: classify an exception, parse dtype errors, find the module that raised.

`classify(exc)` -> ``oom`` | ``nonfinite`` | ``dtype_error`` | ``interrupted`` | ``exception``.
`parse_dtype_error(message)` pulls observed / expected dtypes out of PyTorch's messages
(``expected scalar type BFloat16 but found Float``, ``mat1 and mat2 must have the same dtype``,
``Input type (...) and weight type (...) should be the same`` ...). `innermost_module(tb, names)`
walks the traceback for the deepest frame whose ``self`` is a module of an audited model — this
works at every audit level, hooks or not. Exercised by `pytest tests/test_audit_checks.py`.
"""

from __future__ import annotations

import re
import types
from collections.abc import Mapping

_DTYPE_WORDS = [
    (r"bfloat16|bf16", "bf16"),
    (r"half|float16|fp16", "fp16"),
    (r"double|float64", "fp64"),
    (r"float32|float|fp32", "fp32"),
    (r"long|int64", "int64"),
    (r"int32|\bint\b", "int32"),
    (r"bool", "bool"),
]
DTYPE_PATTERNS = [
    # (regex, group holding the observed dtype, group holding the expected dtype)
    (re.compile(r"expected scalar type (\w+) but found (\w+)", re.I), 2, 1),
    (re.compile(r"mat1 and mat2 must have the same dtype(?:, but got (\S+) and (\S+))?", re.I), 1, 2),
    (re.compile(r"expected mat1 and mat2 to have the same dtype, but got:? (\S+) != (\S+)", re.I), 1, 2),
    (re.compile(r"expected m1 and m2 to have the same dtype, but got:? (\S+) != (\S+)", re.I), 1, 2),
    (
        re.compile(r"Input type \(([^)]+)\) and (?:weight|bias) type \(([^)]+)\) should be the same", re.I),
        1,
        2,
    ),
    (re.compile(r"Found dtype (\w+) but expected (\w+)", re.I), 1, 2),
    (
        re.compile(
            r"expected query, key, and value to have the same dtype, but got query\.dtype: (\S+)"
            r" key\.dtype: (\S+)",
            re.I,
        ),
        1,
        2,
    ),  # fmt: skip
    (
        re.compile(
            r"'indices' to have one of the following scalar types: (\w+).*but got (\S+) instead", re.I
        ),
        2,
        1,
    ),
    (re.compile(r"Got unsupported ScalarType (\w+)", re.I), 1, None),
    (re.compile(r"expected both vectors to have same dtype, but found (\w+) and (\w+)", re.I), 1, 2),
    (re.compile(r"self and mat2 must have the same dtype(?:, but got (\S+) and (\S+))?", re.I), 1, 2),
    (re.compile(r"result type (\w+) can't be cast to the desired output type (\w+)", re.I), 1, 2),
]


def short_dtype(word: str | None) -> str | None:
    """``c10::BFloat16`` / ``torch.cuda.HalfTensor`` / ``Float`` -> ``bf16`` / ``fp16`` / ``fp32``."""
    if not word:
        return None
    w = word.lower().replace("c10::", "").replace("torch.", "").replace("cuda.", "").replace("tensor", "")
    w = w.strip(",.:;'\"")
    for pattern, name in _DTYPE_WORDS:
        if re.fullmatch(pattern, w) or re.search(pattern, w):
            return name
    return w or None


def parse_dtype_error(message: str) -> dict[str, str | None] | None:
    """{"observed", "expected", "pattern"} when ``message`` is a dtype mismatch, else None."""
    for rx, obs, exp in DTYPE_PATTERNS:
        m = rx.search(message)
        if m:
            return {
                "observed": short_dtype(m.group(obs)) if obs else None,
                "expected": short_dtype(m.group(exp)) if exp else None,
                "pattern": rx.pattern.split("(")[0].strip()[:60],
            }
    return None


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
