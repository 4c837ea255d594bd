"""User code named in a config: ``module:attr`` or ``path/to/file.py:attr`` -> the callable, imported,
never eval-ed. A module of its own, importing nothing from the trainer, so that any trainer module can
resolve a plug-in (data: dataset, collator, reward function; models: reward-model loader, model setup)
without an import cycle. Exercised by `pytest tests/test_data.py tests/test_root_cause.py`.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import re
import sys
from collections.abc import Callable
from typing import Any

_MODULE_SPEC = re.compile(r"^[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*$")
_ATTR_SPEC = re.compile(r"^[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*$")


def resolve_callable(spec: str, where: str) -> Callable:
    """``pkg.mod:attr`` or ``path/to/file.py:attr`` -> the callable; ``attr`` may be dotted (``Cls.make``).

    Raises ValueError naming ``where``, the spec and the problem: bad form, file missing, import error
    (with its message), attribute missing, not callable.
    """
    form = "expected 'package.module:attr' or 'path/to/file.py:attr'"
    if not isinstance(spec, str) or spec.count(":") < 1:
        raise ValueError(f"{where}: {spec!r} has no ':'; {form}")
    target, _, attr = spec.rpartition(":")
    if not target or not _ATTR_SPEC.match(attr):
        raise ValueError(f"{where}: {spec!r} is not of the form {form[9:]}")
    if target.endswith(".py"):
        if not os.path.isfile(target):
            raise ValueError(f"{where}: {spec!r}: file {target!r} not found (relative to {os.getcwd()})")
        name = "_user_" + re.sub(r"\W", "_", os.path.abspath(target))
        try:
            module_spec = importlib.util.spec_from_file_location(name, target)
            assert module_spec is not None and module_spec.loader is not None
            module = importlib.util.module_from_spec(module_spec)
            sys.modules[name] = module  # dataclasses and pickling look the module up by name
            module_spec.loader.exec_module(module)
        except Exception as e:  # any error in user code becomes a clean, located message
            sys.modules.pop(name, None)
            raise ValueError(f"{where}: {spec!r}: importing {target} failed: {type(e).__name__}: {e}") from e
    else:
        if not _MODULE_SPEC.match(target):
            raise ValueError(f"{where}: {spec!r}: {target!r} is neither a module name nor a .py file; {form}")
        try:
            module = importlib.import_module(target)
        except Exception as e:  # ImportError, or any error raised by the module's top level
            raise ValueError(f"{where}: {spec!r}: importing {target} failed: {type(e).__name__}: {e}") from e
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"{where}: {spec!r}: {target} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ValueError(f"{where}: {spec!r}: {attr} is a {type(obj).__name__}, not callable")
    return obj
