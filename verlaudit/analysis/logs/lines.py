"""One log line as the rules see it: its text with the launchers' prefixes taken off (Ray's
``(WorkerDict pid=..., ip=...)``, torch's ``[rank3]:``, docker compose's ``vllm-1  | ``, vLLM's logger
``ERROR 03-10 17:16:32 [core.py:1229]``, timestamps,
ANSI colour codes, a reporter's ``> `` quoting) and what those prefixes said (the rank, the process,
the log level); traceback frames and the call each frame makes; which lines are failure signals.
Pure functions of one line, so the streaming reader can call them line by line. Exercised by
``pytest tests/test_log_rules.py -k lines``.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable

MAX_TEXT = 4000
"""Characters of a line the rules look at (no message they match is longer)."""


@dataclasses.dataclass(frozen=True)
class LogLine:
    """A line of a log: its number, its text without launcher prefixes, and what the prefixes said."""

    no: int
    text: str
    rank: int | None = None
    """The distributed rank the line's prefix names (``[rank3]:``, ``[default3]:``), if any."""
    source: str | None = None
    """The process that printed it, from a Ray prefix (``WorkerDict``, ``raylet``, ``EngineCore_DP0``)."""
    level: str | None = None
    """``E``/``W``/``I`` from a glog prefix, or ``ERROR``/``WARNING``/... from a logging prefix."""


_ANSI = re.compile(r"(?:\x1b)?\[[0-9;]*m")
_PREFIX = re.compile(
    r"""(?:
      (?P<iso>\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}(?:\.\d+)?Z?\s+)                 # 2024-06-28T06:11:52.68Z
    | (?P<stamp>\[\d{4}-\d{2}-\d{2}[ T]\d{2}:\d{2}:\d{2}(?:[.,]\d+)?Z?\]\s*)        # [2024-08-21 03:38:02]
    | (?P<compose>[\w.]+-\d+\s+\|\s?)                                                # vllm-1  |
    # vLLM's logger: ERROR 03-10 17:16:32 [core.py:1229] (older: ... scheduler.py:947]; the level is kept; one space taken, so a
    # traceback's indentation after it stays the traceback's)
    | (?P<vlevel>ERROR|WARNING|INFO|DEBUG|CRITICAL)\s\d{2}-\d{2}\s\d{2}:\d{2}:\d{2}(?:\.\d+)?\s\[?[\w./-]+:\d+\]\s?
    | (?P<quote>>\s?(?=\S))                                                          # > quoted
    | (?P<tick>`{1,3}(?=[A-Za-z_]))                                                 # `RuntimeError: ...` (a code span)
    | \s*E\s{3,}(?=\S)                                                              # pytest's failure lines: E   AssertionError
    # (WorkerDict pid=1, ip=10.0.0.1)
    | \((?:(?P<source>[A-Za-z_][\w.:-]*)(?:,?\s*pid=\d+)?|pid=\d+)(?:,\s*ip=[^)]*)?\)\s?
    | \[(?:rank|RANK)[- ]?(?P<rank>\d+)\]:?\s?                                      # [rank3]:  [rank-6]:
    | \[default(?P<local>\d+)\]:\s?                                                  # torchrun --tee
    )""",
    re.X,
)
_GLUED_RANK = re.compile(r"\[rank(\d+)\]:")
_LEVEL = re.compile(
    r"^(?:\[?(?P<glog>[EWIF])(?:\d{4} \d{2}:\d{2}:\d{2}\.\d+(?:\s+\d+)?\s+|\s)[\w./-]+:\d+\]"
    r"|\[?(?P<name>ERROR|WARNING|WARN|INFO|DEBUG|CRITICAL|FATAL)\]?[\s:])"
)


# the level of Python logging's default format and loguru's, after the timestamp that starts the line:
# "2024-01-01 12:00:00,123 - __main__ - ERROR - msg", "2024-01-01 12:00:00.123 | ERROR    | mod:fn:42 - msg",
# "2024-01-01 12:00:00 ERROR msg", "12:00:00 ERROR msg"
_MID_LEVEL = re.compile(
    r"^(?:\d{4}-\d{2}-\d{2}[ T][\d:.,]+\S*|\d{2}:\d{2}:\d{2}[\d.,]*)\s*(?:[-|]\s*(?:[\w.<>-]+\s*[-|]\s*)?)?\[?"
    r"(?P<name>ERROR|CRITICAL|FATAL|WARNING|WARN|INFO|DEBUG)\b"
)


def hints(*words: str) -> Callable[[str], re.Match | None]:
    """A cheap test run before a family's regexes: whether a line holds any of ``words`` (one C-level
    search instead of a Python loop over substrings, for every line of a long log)."""
    return re.compile("|".join(map(re.escape, words))).search


def parse_line(no: int, raw: str) -> LogLine:
    """``raw`` as a LogLine: launcher prefixes (any order, repeated) stripped and remembered."""
    text = _ANSI.sub("", raw[:MAX_TEXT].rstrip("\r\n"))
    rank = source = vlevel = None
    pos, tick = 0, False
    while True:
        m = _PREFIX.match(text, pos)
        if not m or m.end() == pos:
            break
        if m["source"]:
            source = m["source"]
        if m["rank"] or m["local"]:
            rank = int(m["rank"] or m["local"])
        if m["vlevel"]:
            vlevel = m["vlevel"]
        tick = tick or bool(m["tick"])
        pos = m.end()
    text = text[pos:]
    if tick:  # the code span's closing backticks
        text = text.rstrip().rstrip("`")
    if rank is None:  # a rank prefix glued to a progress bar: `... 10.54s/it][rank2]:[E225 ...`
        m = _GLUED_RANK.search(text)
        if m:
            rank, text = int(m[1]), text[m.end() :]
    lv = _LEVEL.match(text.lstrip())
    level = (lv["glog"] or lv["name"]) if lv else vlevel
    if level is None and text[:1].isdigit() and (mid := _MID_LEVEL.match(text)):
        level = mid["name"]
    return LogLine(no, text, rank, source, level)


# ---- traceback frames
@dataclasses.dataclass
class Frame:
    """One traceback frame: where, in which function, and the source line it was executing."""

    path: str
    lineno: int
    func: str
    code: str | None = None

    @property
    def library(self) -> bool:
        """A frame of an installed package or the interpreter, not of the user's own code."""
        p = self.path
        return ("-packages/" in p or "/lib/python3" in p or p.startswith("<frozen")) and "/verl/" not in p

    def call(self) -> str | None:
        """The first call the frame's source line makes (``self.base_model.generate``), if it shows one."""
        if not self.code or self.code.lstrip().startswith("raise "):  # `raise ValueError(...)` calls nothing
            return None
        code = self.code
        eq, paren = code.find("="), code.find("(")
        if 0 <= eq and (paren < 0 or eq < paren) and code[eq + 1 : eq + 2] != "=":  # `x = f(...)`
            code = code[eq + 1 :]
        m = _CALL.search(code)
        return m[1] if m else None

    def where(self) -> str:
        """``func: call`` (or just ``func``): the culprit a frame names."""
        call = self.call()
        return f"{self.func}: {call}" if call and call.split(".")[-1] != self.func else self.func


_PACKAGE = re.compile(r"(?:site|dist)-packages/(?:\.?[\w-]+\.(?:egg|dist-info)/)?([A-Za-z_]\w*)")
_CHECKOUT = re.compile(
    r"/(verl|trl|openrlhf|nemo_rl|skyrl\w*|slime|vllm|sglang|deepspeed|transformers|accelerate|torch|"
    r"megatron|ray|peft|flash_attn|apex|datasets|realhf|areal|ROLL|roll)/"
)


def package_of(path: str) -> str | None:
    """The top-level package a frame's file belongs to (an installed one, or a checkout of a known
    framework: ``/opt/verl/verl/...`` is verl); None for the user's own code."""
    m = _PACKAGE.search(path) or _CHECKOUT.search(path)
    return m[1] if m and m[1] not in ("__pycache__",) else None


_FRAME = re.compile(
    r'^\s*(?:File\s+)?"?(?P<path>[^"\s][^"]*?\.pyx?|<[^>]+>)"?, line (?P<ln>\d+), in (?P<func>[\w.<>]+)'
)
_FLIGHT = re.compile(r"^\s*#\d+ (?P<func>[\w.<>]+) from (?P<path>\S+\.py):(?P<ln>\d+)")
_CALL = re.compile(
    r"(?<![\w.])(?!(?:return|yield|await|if|elif|while|for|in|not|and|or|is|lambda|assert|with|del|else)\b)"
    r"([A-Za-z_][\w.]*)\s*\("
)  # a keyword before a parenthesis (`return (a * b).sum(`) is no call (logsg branch)
_CARET = re.compile(r"^\s*[\^~]+\s*$")


def parse_frame(text: str) -> Frame | None:
    """A Python traceback frame line (also a reporter's clipped ``path.py", line N, in f``) or a
    flight-recorder stack entry (``#0 all_reduce from .../distributed_c10d.py:3174``)."""
    m = _FRAME.match(text) or _FLIGHT.match(text)
    return Frame(m["path"], int(m["ln"]), m["func"]) if m else None


def is_code_line(text: str) -> bool:
    """Whether ``text`` can be the source line printed under a frame (indented, not carets)."""
    return text.startswith("    ") and bool(text.strip()) and not _CARET.match(text)


# ---- failure signals
EXCEPTION = re.compile(
    # (a bare `Exception: msg` / `Error: msg` too: Python's `raise Exception(...)`, a tool's own error line)
    r"^(?P<type>(?:[A-Za-z_]\w*\.)*(?:[A-Z]\w*(?:Error|Exception|Exit|Interrupt|Failure|Failed)\w*|Exception|Error))"
    r"(?:\((?P<inner>[\w.]+)\))?(?::\s*(?P<msg>.*))?$"
)
_EXIT = re.compile(
    r"exit(?:ed)? (?:with )?(?:exit )?(?:code|status)[ "
    r":=]*(?P<code>-?[1-9]\d*)\b|exitcode\s*:\s*(?P<ec>-?[1-9]\d*)\b"
    r"|returned non-zero exit status (?P<nz>-?\d+)|\bChildFailedError\b"
    # make's report of a recipe that failed, and a launcher's "exited with a non-zero code"
    r"|^make(?:\[\d+\])?: \*\*\* .*\bError \d+\s*$|exited with a non-zero (?:exit )?(?:code|status)",
    re.I,
)
_KILL = re.compile(
    r"^Killed\s*$|\d+/\d+ \[[^\]]*\]\s*Killed\s*$|Signal \d+ \(SIG\w+\) received|\bSIGKILL\b|Segmentation fault|core dumped|"
    r"terminate called after throwing|Killing subprocess \d+|exited on signal \d+|srun: error: \S+: tasks? [\d,-]+: "
    # a native crash's own report: abseil's failure-signal handler (Ray, JAX), Python's faulthandler
    r"|\*\*\* SIG[A-Z]+ received at\b|^Fatal Python error: (?:Segmentation fault|Aborted|Bus error)"
    # the shell's report of a process a signal ended
    # glibc's heap checks and a crash handler's banner
    r"|^\*\*\* Error in `[^']*': |\b(?:double free or corruption|malloc\(\): (?:corrupted|memory corruption)|free\(\): "
    r"invalid pointer|corrupted size vs\. prev_size|\*\*\* stack smashing detected)|\bSegfault encountered\b"
    # (the whole line: vLLM's "Aborted request cmpl-1" is no crash)
    r"|^(?:[\w./-]+: line \d+:\s+\d+ )?(?:Bus error|Illegal instruction|Floating point exception|Aborted)"
    r"(?: \(core dumped\))?(?:\s+\S*python\S*(?: .*)?)?\s*$"
)
# hangs the launchers report (a plain "timed out" is left out: healthy logs retry downloads that time out)
_HANG = re.compile(
    r"Watchdog caught|watchdog got stuck|Timeout at NCCL work|Timed out waiting \d+ ?ms|wait timeout after "
    r"\d+ ?ms|"
    r"Heartbeat monitor timed out|DistStoreError|RendezvousTimeoutError"
)


_KILL_HINTS = hints(
    "*** Error in",
    "corruption",
    "malloc(",
    "free(",
    "corrupted size",
    "stack smashing",
    "Segfault",
    "Bus error",
    "Illegal instruction",
    "Floating point exception",
    "Aborted",
    "Killed",
    "Signal",
    "SIGKILL",
    "Segmentation",
    "core dumped",
    "terminate called",
    "Killing",
    "on signal",
    "srun",
    "received at",
    "Fatal Python error",
)
_HANG_HINTS = hints(
    "atchdog", "Timeout at", "Timed out", "wait timeout", "Heartbeat", "DistStoreError", "Rendezvous"
)
_EXIT_HINTS = hints("exit", "Exit", "EXIT", "ChildFailed", "make")


def failure_signal(line: LogLine) -> str | None:
    """What kind of failure ``line`` signals: ``exception`` (a Python exception line), ``error`` (an
    ERROR-level log line), ``exit`` (a non-zero exit), ``kill`` (a signal, a crash) or ``hang`` (a
    timeout); None for every other line (INFO advice that mentions errors included)."""
    text = line.text.strip()
    m = EXCEPTION.match(text)
    if m and not m["type"].endswith("Warning"):
        return "exception"
    if _KILL_HINTS(text) and _KILL.search(text):
        return "kill"
    if _EXIT_HINTS(text) and _EXIT.search(text):
        return "exit"
    if _HANG_HINTS(text) and _HANG.search(text):
        return "hang"
    if line.level in ("E", "F", "ERROR", "CRITICAL", "FATAL") or text.startswith("Error executing job"):
        return "error"
    if text.startswith("{") and '"error' in text and _HTTP_ERROR.search(text):
        return "error"
    if ("rror" in text[:40] or "FATAL" in text[:40]) and _ERROR_LINE.match(text):
        return "error"
    return None


# a tool's or a library's own error line without a logging level: "error: ...", "srun: error: ...", "CUDA error: ...",
# "NCCL error: ...", "FATAL: ..." (git's lowercase "fatal:" is left out: frameworks call git and print its refusals)
_ERROR_LINE = re.compile(
    r"^(?:[\w./-]+: )?(?:error|(?:CUDA|NCCL|cuDNN|CUBLAS|HIP|MPI) error|FATAL)(?:\[\w+\])?: \S"
)


# an OpenAI-compatible server's error body (vLLM, SGLang, TGI): {"object":"error","message":...,"code":400},
# {"error": {"message": ..., "type": "BadRequestError"}}, {"error":"Input validation error: ..."}
_HTTP_ERROR = re.compile(
    r'^\{\s*"(?:object|status)"\s*:\s*"error"|^\{\s*"error"\s*:\s*[{"]|"type"\s*:\s*"\w*Error"'
)


# ---- what a message advises
_ADVICE = re.compile(
    r"^(?:you (?:can|may|should|might)|consider|try|please|set|increase|decrease|reduce|lower|raise|use|pass|"
    r"install|upgrade|downgrade|make sure|ensure|"
    r"to (?:proceed|fix|avoid|resolve|adjust|change|disable|enable|increase|decrease|reduce|lower|raise|allow|work around)\b)",
    re.I,
)
_ADVISED = re.compile(
    r"(?<![\w-])--[a-z][\w-]*|\b[A-Z][A-Z0-9]*_[A-Z0-9_]+=\S+|\b[a-z][a-z0-9]*_[a-z0-9_]+=\S+"
)


def message_advice(message: str) -> tuple[list[str], list[str]]:
    """(the sentences of an error message that advise a remedy, the flags / variables / keys they name):
    many messages say their own fix ("To proceed regardless, set RAY_OBJECT_STORE_ALLOW_SLOW_STORAGE=1.
    Consider ... --shm-size in Docker.")."""
    sentences = [s.strip() for s in re.split(r"(?<=[.!?])\s+", message) if s.strip()]
    advice = [
        s
        for s in sentences
        if _ADVICE.match(s)
        or re.search(r"\byou can set\b|\bconsider\b|\bset the environment variable\b", s, re.I)
    ]
    names: list[str] = []
    for s in advice:
        for n in _ADVISED.findall(s):
            n = n.rstrip(".,;)")
            if n not in names:
                names.append(n)
    return advice[:3], names
