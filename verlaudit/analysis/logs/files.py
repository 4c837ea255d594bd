"""Metric files that are not text logs, read into the same per-step records as a log's lines
(`verlaudit.analysis.logs.table`): the HF Trainer's ``trainer_state.json`` (its ``log_history``: one
dict per logging step, with ``step``), TensorBoard event files (``events.out.tfevents.*``, read with the
``tensorboard`` package's own reader, an optional dependency: a one-line message says how to install it),
and W&B offline run files: ``wandb-history.jsonl`` and ``wandb-summary.json`` are JSON and read as
text; the binary ``run-<id>.wandb`` has no documented format and is refused with what to pass
instead. Exercised by ``pytest tests/test_log_formats.py -k files``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from verlaudit.analysis.logs import table

MAX_JSON = 256 * 1024 * 1024
"""Bytes of a trainer_state.json read at once (one JSON document: it cannot be streamed)."""
TENSORBOARD_PIN = "tensorboard>=2.21,<3"


def kind(path: Path) -> str | None:
    """``tensorboard``, ``trainer_state``, ``wandb_binary`` or None (a text log)."""
    name = path.name
    if "tfevents" in name:
        return "tensorboard"
    if name.endswith(".wandb"):
        return "wandb_binary"
    if name.endswith(".json") and _log_history(path) is not None:
        return "trainer_state"
    return None


def _log_history(path: Path) -> list[Any] | None:
    try:
        if path.stat().st_size > MAX_JSON:
            return None
        with open(path, encoding="utf-8") as f:
            head = f.read(1)
            if head != "{":
                return None
            obj = json.loads(head + f.read())
    except (OSError, ValueError, UnicodeDecodeError):
        return None
    hist = obj.get("log_history") if isinstance(obj, dict) else None
    return hist if isinstance(hist, list) else None


def trainer_state_records(path: Path) -> Iterator[dict[str, Any]]:
    """One record per ``log_history`` entry that holds a training metric (``_line``: its ordinal)."""
    for i, entry in enumerate(_log_history(path) or [], 1):
        rec = table.json_record(entry, i)
        if rec is not None:
            rec["_source"] = "trainer_state"
            yield rec


def _scalar(value: Any) -> float | None:
    if value.HasField("simple_value"):
        return float(value.simple_value)
    if value.HasField("tensor"):
        from tensorboard.util import tensor_util

        arr = tensor_util.make_ndarray(value.tensor)
        if arr.size == 1 and arr.dtype.kind in "fiu":
            return float(arr.reshape(()))
    return None


def tensorboard_records(path: Path) -> Iterator[dict[str, Any]]:
    """One record per step of a TensorBoard event file (its scalars by tag; ``_line``: the ordinal of
    the event that started the step). ValueError when the tensorboard package is missing."""
    try:
        from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
    except ImportError:
        raise ValueError(
            f"{path}: a TensorBoard event file; reading it needs the tensorboard package: "
            f"pip install '{TENSORBOARD_PIN}' (or pass the training log as text)"
        ) from None
    rec: dict[str, Any] | None = None
    try:
        for i, event in enumerate(EventFileLoader(str(path)).Load(), 1):
            if not event.HasField("summary"):
                continue
            if rec is not None and rec["step"] != event.step:
                yield rec
                rec = None
            for v in event.summary.value:
                x = _scalar(v)
                if x is None:
                    continue
                if rec is None:
                    rec = {"step": int(event.step), "_line": i, "_source": "tensorboard"}
                if len(rec) < table.MAX_KEYS:
                    rec[v.tag] = x if math.isfinite(x) or x != x or abs(x) == math.inf else x
    except Exception as e:  # noqa: BLE001 - a corrupt or truncated file: say which and why
        if rec is not None:
            yield rec
        raise ValueError(
            f"{path}: cannot read the TensorBoard event file ({type(e).__name__}: {e})"
        ) from None
    if rec is not None:
        yield rec


def wandb_binary(path: Path) -> ValueError:
    return ValueError(
        f"{path}: a W&B binary run file (.wandb), whose record format wandb does not document; pass the "
        "run's files/wandb-history.jsonl or files/output.log (the console), or the training log"
    )
