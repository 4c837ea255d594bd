"""The user's line an op came from: the innermost frame outside torch, the trainer and verlaudit.

Used by the plug-in recorder (`plugins.Recorder`) and the own-loop checks (`integrations.loop_*`) to name
``file:line (function)`` in a finding. One path test per file (`_FILES`), not per frame and op.
"""

from __future__ import annotations

import os
import sys

import torch

import trainer

_VERLAUDIT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_SKIP_DIRS = tuple(
    d + os.sep for d in (os.path.dirname(torch.__file__), os.path.dirname(trainer.__file__), _VERLAUDIT)
)
"""torch, the trainer and verlaudit: frames that are not the user's."""
_THIS = (os.path.abspath(__file__), os.path.join(os.path.dirname(os.path.abspath(__file__)), "plugins.py"))
"""This module and the recorder's: their frames are the audit's dispatch, never a culprit line."""
_LIBRARY = os.sep + "site-packages" + os.sep


def user_frame(depth: int = 2) -> str | None:
    """``file:line (function)`` of the innermost frame outside torch, trainer and verlaudit, else of
    the innermost outside torch and this module (a built-in plug-in of the trainer), else None."""
    f = sys._getframe(depth)
    fallback = None
    while f is not None:
        kind = _FILES.get(f.f_code.co_filename)
        if kind is None:
            kind = _FILES[f.f_code.co_filename] = _file_kind(f.f_code.co_filename)
        if kind == "user":
            return f"{_rel(f.f_code.co_filename)}:{f.f_lineno} ({f.f_code.co_name})"
        if fallback is None and kind == "ours":
            fallback = f"{_rel(f.f_code.co_filename)}:{f.f_lineno} ({f.f_code.co_name})"
        f = f.f_back
    return fallback


_FILES: dict[str, str] = {}
"""co_filename -> ``user``, ``ours`` (the trainer's or verlaudit's, not this module) or ``torch``: one
path test per file, not per frame and op."""


def _file_kind(name: str) -> str:
    path = os.path.abspath(name)
    if path.startswith(_SKIP_DIRS[0]) or path in _THIS or name.startswith("<") or _LIBRARY in path:
        return "torch"  # an installed library (transformers' Module.to) is not where the user's line is
    return "ours" if path.startswith(_SKIP_DIRS) else "user"


def _rel(path: str) -> str:
    try:
        rel = os.path.relpath(path)
    except ValueError:
        return path
    return path if rel.startswith("..") else rel
