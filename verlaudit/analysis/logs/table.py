"""The per-step metric table of a foreign log, read before any rule runs, from every format users
paste or keep: verl's console step lines (``step:N - key:value - ...``) and its ``file`` logger's JSON
lines (``{"step": n, "data": {...}}``); HF Trainer / TRL log dicts (``{'loss': 0.0, 'grad_norm': nan,
...}``, values quoted or not, anywhere in a line, printed over several lines or hard-wrapped by a
terminal, cut off when the process died mid-print); other JSON lines (a ``step`` / ``global_step`` /
``_step`` key, else their ordinal); ``key=value`` and ``key: value`` lines (several pairs on one line,
or a block of one-pair lines such as NeMo-RL's ``• Loss: 0.12`` under a ``Step 3/100`` header); printed
tables (a ``| step | loss |`` header over rows, or ``│ name │ value │`` rows). The files that are not
text logs (`verlaudit.analysis.logs.files`: ``trainer_state.json``, TensorBoard event files, W&B
offline run files) give the same records. A record is ``{"step": n, "_line": line, "_source": format,
key: float, ...}``; ``MetricTable.series`` keeps, for the metrics the rules read (`vocab`), bounded
per-step series. Exercised by ``pytest tests/test_log_formats.py tests/test_logparse.py``.
"""

from __future__ import annotations

import json
import math
import re
from collections import deque
from collections.abc import Iterable
from typing import Any

from verlaudit.analysis.logs import vocab

HEAD, TAIL = 2000, 8000
"""Points of one series kept from the start of a log and again from its end."""
MAX_PENDING = 60
"""Lines one printed dict may span (a TRL GRPO dict pretty-printed one key a line)."""
MAX_KEYS = 400
"""Metrics one record keeps (a record is a log line's worth of numbers, not a config dump)."""

_NUMBER = r"[-+]?(?:nan|inf(?:inity)?|(?:\d+\.?\d*|\.\d+)(?:e[-+]?\d+)?)"
_VERL_STEP = re.compile(r"step:(\d+)\s+-\s+(.*)")
_VERL_KV = re.compile(rf"([\w./@-]+):\s*(?:np\.float\d*\()?({_NUMBER})", re.I)
# An HF Trainer / TRL log dict anywhere in a line (after a tqdm bar or a logger prefix), or cut off.
_DICT_START = re.compile(r"\{\s*(['\"])[\w/.@() -]+\1\s*:")
_HF_KV = re.compile(r"(['\"])([\w/.@() -]+)\1:\s*['\"]?([^'\",}]+)['\"]?")
_KV = re.compile(rf"(?<![\w./-])([A-Za-z_][\w./@-]*)\s*[=:]\s*(?:np\.float\d*\()?({_NUMBER})(?![\w.])", re.I)
_STEP_HEADER = re.compile(r"\b(?:step|iteration|iter)\s*[:#]?\s*(\d+)(?:\s*/\s*\d+)?\b", re.I)
_BULLET = re.compile(rf"^[\s•*·>-]*([A-Za-z][\w ./@()-]{{0,60}}?)\s*[:=]\s*({_NUMBER})\s*[%\w/]*\s*$", re.I)
_STEP_HINT = re.compile(r"[Ss]tep|STEP|[Ii]ter").search
_CELL_SPLIT = re.compile(r"\s*[|│┃]\s*")
_RULE_CHARS = set("+-=─━┼╇╈┏┓┗┛┡┩└┘┌┐├┤┬┴╋╞╡╪═ ")
_STEP_KEYS = (
    "step",
    "global_step",
    "_step",
    "train/global_step",
    "training/global_step",
    "iteration",
    "iter",
)


def number(text: Any) -> float | None:
    """A value as a float (``tensor(nan, device=...)``, ``np.float64(0.2)``, ``'0.69'`` too); None for
    what is not a number (not evidence of a NaN)."""
    if isinstance(text, bool):
        return None
    if isinstance(text, (int, float)):
        return float(text)
    if not isinstance(text, str):
        return None
    v = text.strip().strip("'\"")
    for wrap in ("tensor(", "np.float64(", "np.float32(", "np.float16(", "np.float_("):
        if v.startswith(wrap):
            v = v[len(wrap) :].split(",", 1)[0].rstrip(")")
    v = v.rstrip("%")
    try:
        return float(v)
    except ValueError:
        return None


def _step_of(values: dict[str, Any]) -> int | None:
    for k in _STEP_KEYS:
        v = values.get(k)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
            return int(v)
    return None


def flat(obj: dict[str, Any], prefix: str = "") -> Iterable[tuple[str, Any]]:
    """The leaves of a nested dict as (``a/b``, value) pairs."""
    for k, v in obj.items():
        if isinstance(v, dict):
            yield from flat(v, f"{prefix}{k}/")
        else:
            yield f"{prefix}{k}", v


def json_record(obj: Any, ln: int) -> dict[str, Any] | None:
    """A record from one JSON object: verl's file logger (``{"step": n, "data": {...}}``), a W&B
    history row (``_step``), a flat metrics dict; None for an object that holds no training metric."""
    if not isinstance(obj, dict):
        return None
    source = "json"
    body = obj
    if isinstance(obj.get("data"), dict) and "step" in obj:
        body, source = obj["data"], "verl_file"
    values = {k: number(v) for k, v in flat(body) if len(k) < 200}
    values = {k: v for k, v in values.items() if v is not None}
    if not vocab.has_metric(values):
        return None
    step = _step_of(obj if source == "verl_file" else values)
    if "_step" in obj:
        source = "wandb"
    rec: dict[str, Any] = {"step": step, "_line": ln, "_source": source}
    rec.update(dict(list(values.items())[:MAX_KEYS]))
    return rec


def hf_record(text: str, ln: int) -> dict[str, Any] | None:
    """A record from one printed Python dict (whole, or cut off at its end)."""
    values = ((k, number(v)) for _, k, v in _HF_KV.findall(text))
    kept = {k: v for k, v in values if v is not None}
    if not vocab.has_metric(kept):
        return None
    rec: dict[str, Any] = {"step": None, "_line": ln, "_source": "hf"}
    rec.update(dict(list(kept.items())[:MAX_KEYS]))
    return rec


def _join(head: str, more: str) -> str:
    """Rejoin a printed dict's next line: with a space after a comma or an opening brace (a
    pretty-printed dict), without one inside a token (a terminal's hard wrap)."""
    if head.rstrip().endswith((",", "{")) or more[:1].isspace():
        return f"{head.rstrip()} {more.strip()}"
    return head + more.strip()


def _closed(text: str, start: int) -> bool:
    return text.find("}", start) >= 0


class Series:
    """One metric's (step, line, value) points, the first ``HEAD`` and the last ``TAIL``."""

    def __init__(self) -> None:
        self.head: list[tuple[int, int, float]] = []
        self.tail: deque[tuple[int, int, float]] = deque(maxlen=TAIL)
        self.count = 0

    def add(self, step: int, line: int, value: float) -> None:
        self.count += 1
        (self.head if len(self.head) < HEAD else self.tail).append((step, line, value))

    def points(self) -> list[tuple[int, int, float]]:
        return [*self.head, *self.tail]


class MetricTable:
    """Feed it a log line by line (``feed`` returns the records that line completed; ``finish`` the
    ones still open at the end); ``series`` holds the rules' metrics by our names (`vocab.canonical`),
    ``keys`` the log's own names for them."""

    def __init__(self) -> None:
        self.records = 0
        self.ordinal = 0
        self.series: dict[str, Series] = {}
        self.keys: dict[str, str] = {}
        """Our name -> the first of the log's own names that fed it."""
        self.last: dict[str, Any] | None = None
        self._pending: tuple[int, str] | None = None  # (first line, text so far) of an open dict
        self._pending_lines = 0
        self._block: tuple[int, dict[str, float]] | None = None  # (first line, pairs) of one-pair lines
        self._header: list[str] | None = None  # a table's column names
        self._step_header: int | None = None
        self.formats: dict[str, int] = {}
        self.names: set[str] = set()
        """Every numeric metric name the records held (bounded): what tells an RL objective's log (a reward,
        a KL, an advantage logged beside the loss) from a supervised one's."""

    # ---- the records
    def _emit(self, rec: dict[str, Any] | None, out: list[dict[str, Any]]) -> None:
        """Keep a record (None: nothing); one without a step of its own gets its ordinal among those."""
        if rec is None:
            return
        if rec["step"] is None:
            self.ordinal += 1
            rec["step"] = self.ordinal
        elif isinstance(rec["step"], float) and math.isfinite(
            rec["step"]
        ):  # a table's or a JSON line's `step: 2.0`
            rec["step"] = int(rec["step"])
        self.records += 1
        self.formats[rec["_source"]] = self.formats.get(rec["_source"], 0) + 1
        self.last = rec
        for k, v in rec.items():
            if k.startswith("_") or k == "step" or not isinstance(v, float):
                continue
            if len(self.names) < 256:
                self.names.add(k)
            ours = vocab.canonical(k)
            if ours is None or self.keys.setdefault(ours, k) != k:  # one log name feeds one series
                continue
            self.series.setdefault(ours, Series()).add(rec["step"], rec["_line"], v)
        out.append(rec)

    def add(self, rec: dict[str, Any]) -> list[dict[str, Any]]:
        """A record read from a file that is not a text log (`verlaudit.analysis.logs.files`)."""
        out: list[dict[str, Any]] = []
        self._emit(rec, out)
        return out

    def _flush_pending(self, out: list[dict[str, Any]]) -> None:
        if self._pending is not None:
            ln, text = self._pending
            self._pending = None
            self._emit(hf_record(text, ln), out)

    def _flush_block(self, out: list[dict[str, Any]]) -> None:
        if self._block is not None:
            ln, pairs = self._block
            self._block = None
            if len(pairs) >= 2 and vocab.has_metric(pairs):
                step = _step_of(pairs)
                step = step if step is not None else self._step_header
                rec = {"step": step, "_line": ln, "_source": "kv"}
                rec.update(pairs)
                self._emit(rec, out)

    def finish(self) -> list[dict[str, Any]]:
        """The records still open at the end of the log (a dict cut off by a dead process, a block)."""
        out: list[dict[str, Any]] = []
        self._flush_pending(out)
        self._flush_block(out)
        return out

    # (a verl step line is also key:value pairs, a dict line holds quoted pairs, a table row numbers)
    # long: one dispatch over the line formats, in the order that keeps them apart
    def feed(self, ln: int, line: str) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        text = line.strip()
        if self._pending is not None:
            start, so_far = self._pending
            self._pending_lines += 1
            cont = (
                text[:1] in ("'", '"', "}")
                or so_far.rstrip().endswith(",")
                or (bool(text) and not text[:1].isalpha() and self._pending_lines < 3)
            )
            if cont and self._pending_lines <= MAX_PENDING:
                joined = _join(so_far, line)
                if _closed(text, 0):
                    self._pending = None
                    self._emit(hf_record(joined[: joined.find("}", len(so_far) - 1) + 1], start), out)
                else:
                    self._pending = (start, joined)
                return out
            self._flush_pending(out)
        if not text:
            self._flush_block(out)
            return out
        # verl console step line
        if "step:" in text:
            m = _VERL_STEP.search(text)
            if m:
                self._flush_block(out)
                rec: dict[str, Any] = {"step": int(m[1]), "_line": ln, "_source": "verl"}
                values = ((k, number(v)) for k, v in _VERL_KV.findall(m[2]))
                rec.update({k: v for k, v in values if v is not None})
                self._emit(rec, out)
                return out
        # JSON lines (verl's file logger, W&B history, metrics.jsonl of other trainers)
        if text.startswith("{") and text.endswith("}") and '"' in text[:3]:
            try:
                obj = json.loads(text)
            except ValueError:
                obj = None
            if obj is not None:
                self._flush_block(out)
                self._emit(json_record(obj, ln), out)
                return out
        # printed Python dicts, whole or open
        if "{'" in text or '{"' in text or "{ '" in text:
            found = False
            for m in _DICT_START.finditer(text):
                found = True
                end = text.find("}", m.start())
                if end < 0:
                    self._flush_block(out)
                    self._pending, self._pending_lines = (ln, text[m.start() :]), 0
                    return out
                self._emit(hf_record(text[m.start() : end + 1], ln), out)
            if found:
                return out
        # a table row
        if ("|" in text or "│" in text or "┃" in text) and "%|" not in text and self._table(ln, text, out):
            return out
        if self._header is not None and set(text) <= _RULE_CHARS:  # tabulate's `+====+` rule under the header
            return out
        self._header = None
        # key=value / key: value pairs, one line of several or a block of one-pair lines
        metric = vocab.metric_hint(text)
        short = len(text) < 120
        h = _STEP_HEADER.search(text) if (metric or short) and _STEP_HINT(text) else None
        bullet = _BULLET.match(text) if short and ("=" in text or ":" in text) else None
        if not metric and bullet is None:  # most lines: no pairs worth reading
            self._flush_block(out)
            if h:
                self._step_header = int(h[1])
            return out
        pairs = (
            {k: v for k, v in ((k, number(v)) for k, v in _KV.findall(text)) if v is not None}
            if metric
            else {}
        )
        if bullet and len(pairs) <= 1:
            key, value = bullet[1].strip(), number(bullet[2])
            if value is not None and not text.lower().startswith(("step", "iteration")):
                if self._block is None:
                    self._block = (ln, {})
                self._block[1][key] = value
                return out
        self._flush_block(out)
        if len(pairs) >= 2 and vocab.has_metric(pairs):
            step = _step_of(pairs)
            if step is None and h:
                step = int(h[1])
            rec = {"step": step, "_line": ln, "_source": "kv"}
            rec.update(dict(list(pairs.items())[:MAX_KEYS]))
            self._emit(rec, out)
        elif h and len(text) < 120:
            self._step_header = int(h[1])
        return out

    def _table(self, ln: int, text: str, out: list[dict[str, Any]]) -> bool:
        """A printed table's row: a header of metric names, a row of numbers under it, or a
        ``name | value`` row of a two-column table (kept as a block of pairs)."""
        cells = [c for c in _CELL_SPLIT.split(text.strip("|│┃ ")) if c != ""]
        if len(cells) < 2 or set(text) <= set("|│┃+-=─━┼╇╈┏┓┗┛┡┩└┘┌┐├┤┬┴╋: "):
            return set(text) <= set("|│┃+-=─━┼╇╈┏┓┗┛┡┩└┘┌┐├┤┬┴╋: ") and self._header is not None
        if any(_KV.search(c) for c in cells):  # `Step 3 | loss: 0.1 | ...`: pairs, not a table
            return False
        nums = [number(c) for c in cells]
        if len(cells) == 2 and nums[0] is None and nums[1] is not None:
            if self._block is None:
                self._block = (ln, {})
            self._block[1][cells[0]] = nums[1]
            return True
        if all(n is None for n in nums):
            names = [c.lower() for c in cells]
            if any(
                n in ("step", "steps", "global_step", "iteration", "epoch") for n in names
            ) or vocab.has_metric(dict.fromkeys(cells, 0.0)):
                self._flush_block(out)
                self._header = cells
                return True
            return False
        if self._header is not None and len(cells) == len(self._header):
            values = {k: v for k, v in zip(self._header, nums) if v is not None}
            step = next(
                (int(v) for k, v in values.items() if k.lower() in ("step", "steps", "global_step")), None
            )
            rec = {"step": step, "_line": ln, "_source": "table"}
            rec.update(values)
            self._emit(rec, out)
            return True
        return False
