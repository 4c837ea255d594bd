"""One streaming pass over a log that keeps what the rules need, bounded whatever the log's size:
the rule families' hits (the first and the last few of each), the tracebacks (frames, the exception
that ended each, the Ray task it came from), the failure-signal lines, the framework markers, the
settings the log prints, and the activity lines that tell the phase. ``LogScan.feed(no, line)`` is
called once per line; ``LogScan.facts()`` hands the rules a frozen summary.
Exercised by ``pytest tests/test_log_rules.py``.
"""

from __future__ import annotations

import dataclasses
import re
from collections import Counter, deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from verlaudit.analysis.logs import frameworks, phases
from verlaudit.analysis.logs.lines import (
    EXCEPTION,
    MAX_TEXT,
    Frame,
    LogLine,
    failure_signal,
    is_code_line,
    package_of,
    parse_frame,
    parse_line,
)

_WRAPPERS = frozenset(
    {
        "func",
        "wrapper",
        "inner",
        "decorate_context",
        "_call_impl",
        "_wrapped_call_impl",
        "wrapped_fn",
        "f",
        "run_method",
        "execute_method",
        "auto_init_wrapper",
        "<module>",
    }
)
_HANDOFFS = frozenset({"ray.get", "ray.wait", "fut.result", "future.result", "self.__get_result"})
KEEP = 12
"""Hits of one rule kept from the start of the log and again from its end."""
MAX_FRAMES = 60
MAX_TRACEBACKS = 12
MAX_SETTINGS = 600


@dataclasses.dataclass
class Hit:
    """One recognised message: the rule that matched, the line, the fields it read, and (when the
    rule asked for them) the text of the lines that follow it."""

    rule: str
    line: LogLine
    fields: dict[str, Any] = dataclasses.field(default_factory=dict)
    want: int = 0
    follow: list[str] = dataclasses.field(default_factory=list)

    @property
    def no(self) -> int:
        return self.line.no

    def text(self, sep: str = " ") -> str:
        """The line's text with the follow lines appended (``sep=""`` rejoins a hard-wrapped paste)."""
        return sep.join([self.line.text, *self.follow])


Detector = Callable[[LogLine], list[Hit]]


@dataclasses.dataclass
class Traceback:
    """A Python traceback as one process printed it (lines of other processes may interleave)."""

    start: int
    end: int
    rank: int | None
    source: str | None
    frames: list[Frame] = dataclasses.field(default_factory=list)
    exc: LogLine | None = None
    """The exception line that ended it (None for a traceback cut short)."""
    task: str | None = None
    """The Ray task a ``RayTaskError(X): ray::Actor.method()`` line names (``Actor.method``)."""
    inner: str | None = None
    """The exception type RayTaskError wraps (``OutOfMemoryError``)."""

    def user_frames(self) -> list[Frame]:
        return [f for f in self.frames if not f.library]

    def culprit(self) -> str | None:
        """``func: call`` of the innermost frame of the user's own code (else the innermost frame),
        passing over Ray's ``ray.get`` hand-offs and generic wrappers, which name no place."""
        frames = self.user_frames() or self.frames
        for f in reversed(frames):
            if f.func not in _WRAPPERS and f.call() not in _HANDOFFS:
                return self._constructed(f) or f.where()
        return None

    def _constructed(self, f: Frame) -> str | None:
        """``CudaGraphRunner.__init__``: a constructor frame named by the class its caller's line builds (a frame
        names its function, not its class; the caller's ``CudaGraphRunner(self)`` does) (logsg branch)."""
        if f.func != "__init__" or f not in self.frames:
            return None
        i = self.frames.index(f)
        call = self.frames[i - 1].call() if i > 0 else None
        cls = call.rsplit(".", 1)[-1] if call else ""
        if not cls[:1].isupper():
            return None
        inner = f.call()
        return f"{cls}.__init__" + (f": {inner}" if inner and inner.rsplit(".", 1)[-1] != "__init__" else "")

    def phase(self) -> tuple[str, str] | None:
        """From the frames; else from the Ray task it came from
        (``WorkerDict.actor_rollout_update_actor``)."""
        found = phases.phase_of_frames(self.frames)
        if found is None and self.task and (p := phases.phase_of_name(self.task)):
            found = (p, self.task)
        return found


@dataclasses.dataclass(frozen=True)
class LogFacts:
    """What one pass over a log kept: every rule's hits (first and last ``KEEP``), their counts, the
    tracebacks, the failure-signal lines, the framework markers, the settings and the activity lines."""

    lines: int
    hits: Mapping[str, list[Hit]]
    counts: Mapping[str, int]
    tracebacks: Sequence[Traceback]
    signals: Sequence[tuple[str, LogLine]]
    markers: Mapping[str, int]
    settings: Mapping[str, str]
    activity: Sequence[tuple[int, str]]

    def of(self, *rules: str) -> list[Hit]:
        """The kept hits of these rules, in log order."""
        return sorted((h for r in rules for h in self.hits.get(r, [])), key=lambda h: h.no)

    def first(self, *rules: str) -> Hit | None:
        hits = self.of(*rules)
        return hits[0] if hits else None

    def count(self, *rules: str) -> int:
        return sum(self.counts.get(r, 0) for r in rules)

    def traceback_near(self, no: int, rank: int | None = None) -> Traceback | None:
        """The traceback that holds line ``no`` (or ends at it), else the nearest one of the same
        rank within a few lines (a reporter may quote the error above the traceback)."""
        best, dist = None, 1 << 30
        for tb in self.tracebacks:
            if tb.start <= no <= tb.end and tb.frames:
                return tb
            d = min(abs(tb.start - no), abs(tb.end - no)) + (0 if tb.frames else 3)  # frames tell more
            if d < dist and (rank is None or tb.rank in (None, rank)):
                best, dist = tb, d
        return best if dist <= 6 else None

    def phase_at(self, no: int, rank: int | None = None) -> tuple[str, str] | None:
        """(phase, why) for a failure at line ``no``: from the nearest traceback's frames, else from the
        traceback that ends the log's driver side, else from the last activity line before it."""
        tb = self.traceback_near(no, rank)
        found = tb.phase() if tb else None
        if found:
            return found
        for other in reversed(self.tracebacks):
            if other.start > no and (found := other.phase()):
                return found
        before = [(ln, p) for ln, p in self.activity if ln <= no]
        return (before[-1][1], f"activity at line {before[-1][0]}") if before else None


class LogScan:
    """Feed it a log line by line; ``facts()`` is the bounded summary the rules read."""

    def __init__(self, detectors: Iterable[Detector]) -> None:
        self.detectors = list(detectors)
        self.lines = 0
        self.first: dict[str, list[Hit]] = {}
        self.last: dict[str, deque[Hit]] = {}
        self.counts: Counter[str] = Counter()
        self.pending: list[Hit] = []
        self.tracebacks_first: list[Traceback] = []
        self.tracebacks_last: deque[Traceback] = deque(maxlen=MAX_TRACEBACKS)
        self.open: dict[tuple[str | None, int | None], Traceback] = {}
        self.code_for: dict[tuple[str | None, int | None], Frame] = {}
        self.signals_first: list[tuple[str, LogLine]] = []
        self.signals_last: deque[tuple[str, LogLine]] = deque(maxlen=KEEP)
        self.markers: Counter[str] = Counter()
        self.settings: dict[str, str] = {}
        self.activity: deque[tuple[int, str]] = deque(maxlen=64)

    def feed(self, no: int, raw: str) -> None:
        line = parse_line(no, raw)
        self.lines = max(self.lines, no)
        for h in self.pending:
            h.follow.append(line.text)
        self.pending = [h for h in self.pending if len(h.follow) < h.want]
        for det in self.detectors:
            for hit in det(line):
                self._keep(hit)
        self._traceback(line)
        sig = failure_signal(line)
        if sig:
            if len(self.signals_first) < KEEP:
                self.signals_first.append((sig, line))
            else:
                self.signals_last.append((sig, line))
        # with its prefixes: `(WorkerDict pid=..)` marks verl; a framework seen a few times is settled
        settled = [m for m, n in self.markers.items() if n >= 3]
        for m in frameworks.markers(raw[:MAX_TEXT], settled):
            self.markers[m] += 1
        if len(self.settings) < MAX_SETTINGS:
            for k, v in frameworks.settings(line.text):
                self.settings.setdefault(k, v[:200])
        act = phases.activity(line.text)
        if act and (not self.activity or self.activity[-1][1] != act):
            self.activity.append((no, act))

    def _keep(self, hit: Hit) -> None:
        self.counts[hit.rule] += 1
        first = self.first.setdefault(hit.rule, [])
        if len(first) < KEEP:
            first.append(hit)
        else:
            self.last.setdefault(hit.rule, deque(maxlen=KEEP)).append(hit)
        if hit.want:
            self.pending.append(hit)

    def _traceback(self, line: LogLine) -> None:
        key = (line.source, line.rank)
        text = line.text
        stripped = text.strip()
        if stripped.startswith("Traceback (most recent call last)"):
            self._close(key)
            if len(self.open) >= MAX_TRACEBACKS:  # many processes' tracebacks at once: keep the newest
                self._close(next(iter(self.open)))
            self.open[key] = Traceback(line.no, line.no, line.rank, line.source)
            return
        frame = parse_frame(text)
        if frame:
            tb = self.open.get(key)
            if tb is None:  # frames without their "Traceback" line: a cut paste
                if len(self.open) >= MAX_TRACEBACKS:
                    self._close(next(iter(self.open)))
                tb = self.open[key] = Traceback(line.no, line.no, line.rank, line.source)
            if len(tb.frames) >= MAX_FRAMES:
                del tb.frames[10]  # keep the outermost and the innermost frames
            tb.frames.append(frame)
            tb.end = line.no
            if len(self.code_for) >= MAX_TRACEBACKS:
                self.code_for.clear()
            self.code_for[key] = frame  # waits for its source line (ranks' lines interleave)
            return
        if key in self.code_for and is_code_line(text):
            self.code_for.pop(key).code = stripped[:300]
            return
        self.code_for.pop(key, None)
        m = EXCEPTION.match(stripped)
        tb = self.open.get(key)
        if m and not m["type"].endswith("Warning"):
            if tb is None:
                tb = Traceback(line.no, line.no, line.rank, line.source)
            tb.end = line.no
            msg = m["msg"] or ""
            if m["inner"] and msg.startswith("ray::"):  # RayTaskError(X): ray::A.b() -- frames follow
                tb.task, tb.inner = msg[5:].split("(", 1)[0], m["inner"]
                # the actor's repr names the module that defines it (`repr=<slime.backends.x.Actor object`)
                if (mod := re.search(r"repr=<((?:[A-Za-z_]\w*\.)+)[A-Za-z_]\w* object", msg)) and "." in mod[
                    1
                ][:-1]:
                    tb.task += f" ({mod[1][:-1]})"
                self.open[key] = tb
                return
            tb.exc = line
            self.open.pop(key, None)
            self._store(tb)

    def _close(self, key: tuple[str | None, int | None]) -> None:
        tb = self.open.pop(key, None)
        if tb is not None:
            self._store(tb)

    def _store(self, tb: Traceback) -> None:
        if len(self.tracebacks_first) < MAX_TRACEBACKS:
            self.tracebacks_first.append(tb)
        else:
            self.tracebacks_last.append(tb)

    def facts(self) -> LogFacts:
        """The summary so far (tracebacks still open count, as cut tracebacks)."""
        tbs = [*self.tracebacks_first, *self.tracebacks_last, *self.open.values()]
        hits = {r: [*h, *self.last.get(r, ())] for r, h in self.first.items()}
        signals = [*self.signals_first, *self.signals_last]
        return LogFacts(
            self.lines,
            hits,
            dict(self.counts),
            sorted(tbs, key=lambda t: t.start),
            signals,
            dict(self.markers),
            dict(self.settings),
            list(self.activity),
        )


def quote(line: LogLine, limit: int = 300) -> str:
    """Evidence text for one line: its number, the rank / process that printed it, and its text."""
    who = "".join(
        [f" rank {line.rank}" if line.rank is not None else "", f" {line.source}" if line.source else ""]
    )
    return f"line {line.no}{f' ({who.strip()})' if who else ''}: {line.text.strip()[:limit]}"


@dataclasses.dataclass
class Place:
    """Where in the run a failure line sits: the phase, the traceback around it, the rank and process."""

    line: LogLine
    phase: str | None = None
    phase_why: str | None = None
    tb: Traceback | None = None

    @property
    def rank(self) -> int | None:
        if self.line.rank is not None:
            return self.line.rank
        return self.tb.rank if self.tb else None

    def culprit(self, *extra: str | None, frame: bool = True) -> str | None:
        """The culprit: the rank, the Ray process and task, the innermost user frame's call, ``extra``."""
        parts = [
            f"rank {self.rank}" if self.rank is not None else None,
            self.line.source,
            self.tb.task if self.tb else None,
            self.tb.culprit() if self.tb and frame else None,
            *extra,
        ]
        seen: list[str] = []
        for p in parts:
            if p and p not in seen and p not in ("raylet",):
                seen.append(p)
        return " / ".join(seen) or None

    def evidence(self) -> list[str]:
        out = []
        if self.tb and self.tb.frames:
            f = (self.tb.user_frames() or self.tb.frames)[-1]
            out.append(f"raised from {f.path}:{f.lineno} in {f.func}" + (f": {f.code}" if f.code else ""))
        if self.phase:
            out.append(f"phase: {self.phase} ({self.phase_why})")
        return out


def site(tb: Traceback | None) -> str | None:
    """The source line of a traceback's culprit frame (the user's innermost, else the innermost) and its
    file: ``torch.matmul(attention_probs, value_layer), in transformers/models/bert/modeling_bert.py``:
    the call and the tensors a message's dtypes or settings belong to (an assignment's target dropped)."""
    frames = (tb.user_frames() or tb.frames) if tb else []
    f = frames[-1] if frames else None
    if f is None or not f.code or "(" not in f.code:
        return None
    call = f.code.strip()
    call = call.split("=", 1)[1].strip() if re.match(r"^[\w.,\s:\[\]]+=[^=]", call) else call
    pkg = package_of(f.path)
    path = f.path.rsplit(f"/{pkg}/", 1)[1] if pkg and f"/{pkg}/" in f.path else f.path.rsplit("/", 1)[-1]
    return f"{call[:120]}, in {f'{pkg}/' if pkg else ''}{path}"


def place(facts: LogFacts, line: LogLine) -> Place:
    """The Place of a failure line, read from the facts."""
    tb = facts.traceback_near(line.no, line.rank)
    found = facts.phase_at(line.no, line.rank)
    return Place(line, found[0] if found else None, found[1] if found else None, tb)
