"""Failed configuration checks: an ``AssertionError`` or ``ValueError`` whose message or asserted
expression names the settings it compares (verl's ``max_token_len must be greater than the sequence
length. Got max_token_len=16384 and max_seq_len=40960``, ``ppo_mini_batch_size 0 should be larger than 0
after normalization``, ``assert model_hf_config.max_position_embeddings >= config.prompt_length +
config.response_length``, NeMo-RL's ``num_total_tokens=21 > max_model_len=20``). Each name is resolved to
the key the user sets: a key the log printed (its leaf holds the name, the printed value first when the
message gives one), else the framework's own spelling of a worker-side name (verl: `verl_keys.WORKER_NAMES`);
the fix says which way each key must move for the check to hold (the message's numbers tell), and the
message's own advice ("Try prompt_batch_size=8") comes first. A check no family explains otherwise is an
``exception`` that names its keys, not an unrecognised failure. Exercised by
``pytest tests/test_log_failures.py -k check``.
"""

from __future__ import annotations

import re

from verlaudit import verl_keys as V
from verlaudit.analysis.causes import Cause, Fix
from verlaudit.analysis.logs.frameworks import LogContext, advice
from verlaudit.analysis.logs.lines import LogLine, message_advice
from verlaudit.analysis.logs.scan import Hit, LogFacts, place, quote

_CHECK_TYPES = re.compile(r"^(?:\w+\.)*(?:AssertionError|ValueError|\w*Config\w*Error|ValidationError)$")
# a name and the number the message gives it: `name=16384`, `name (2048)`, `name: 3`, `name 0 should ...`
_PAIR = re.compile(
    r"\b([a-z][a-z0-9]*(?:_[a-z0-9]+)+)(?:\s*=\s*|\s*\(\s*|:\s*|\s+)(-?\d+(?:\.\d+)?)(?![\w.])"
)
_NAME = re.compile(r"(?<![\w/])(?:[A-Za-z_]\w*\.)*([a-z][a-z0-9]*(?:_[a-z0-9]+)+)\b(?![(/])")
_ASSERT = re.compile(r"^\s*(?:>\s+)?assert\s+(?P<expr>.+?)(?:,\s*(?:f?[\"'].*|\\)?)?\s*\\?$")
# an engine's own arguments: a log of no known framework that names one names the engine's key, not verl's
_ENGINE_ARGS = frozenset(
    {"max_model_len", "max_num_batched_tokens", "max_num_seqs", "gpu_memory_utilization"}
)
_NOT_KEYS = frozenset({"should_not_happen", "self_attn", "state_dict", "named_parameters", "is_available"})


def detect(line: LogLine) -> list[Hit]:
    """An ``assert ...`` source line a reporter pasted above its AssertionError (no frame above it)."""
    m = _ASSERT.match(line.text) if "assert " in line.text else None
    return [Hit("assert_line", line, {"expr": m["expr"].strip()})] if m else []


def explain(facts: LogFacts, ctx: LogContext) -> list[Cause]:
    """The first failed configuration check whose names resolve to settings (or carry numbers)."""
    for h in facts.of("exception_line"):
        if _CHECK_TYPES.match(h.fields.get("type", "")):
            c = _check(facts, ctx, h)
            if c is not None:
                return [c]
    return []


def _asserted(facts: LogFacts, h: Hit) -> str | None:
    """The expression the failed assertion checked: its frame's source line, else a pasted ``assert`` line
    just above the exception."""
    tb = facts.traceback_near(h.no, h.line.rank)
    code = tb.frames[-1].code if tb and tb.frames else None
    if code and (m := _ASSERT.match("    " + code)):
        return m["expr"].strip()
    near = [a for a in facts.of("assert_line") if 0 < h.no - a.no <= 4]
    return near[-1].fields["expr"] if near else None


def resolve(name: str, value: str | None, ctx: LogContext, phase: str | None) -> list[str]:
    """The keys a user sets for ``name``: printed keys whose leaf holds it (the one printed with ``value``
    first), the framework's spelling of a worker-side name (verl), in the phase's order."""
    part = re.compile(rf"(?:^|_){re.escape(name)}(?:_|$)")
    # (the bare name itself is no answer: the settings scan reads the message's own `name=value` too)
    printed = [k for k in ctx.settings if k != name and part.search(k.rsplit(".", 1)[-1])]
    printed.sort(key=lambda k: ctx.settings[k] != value)
    known: list[str] = []
    if ctx.framework == "verl" or (ctx.framework is None and name not in _ENGINE_ARGS):
        known = list(V.WORKER_NAMES.get(name, ()))
        if phase in ("logprob", "reference") and len(known) > 1:  # the log-prob passes' own budgets first
            known.sort(key=lambda k: (V.REF if phase == "reference" else V.ROLLOUT) not in k)
    keys: list[str] = []
    for k in printed[:2] + known:
        if k not in keys and not any(k in x for x in keys):
            keys.append(k)
    return keys


# long: reads the names, their numbers, the asserted expression and the advice of one check message
# a setting named in prose with its number in parentheses: "tensor parallel size (3)", "number of attention heads
# (40)": the words joined as the key would be spelled (leading "total" / "number of" / "the" dropped)
_PROSE_PAIR = re.compile(r"((?:[A-Za-z]+ ){1,4}[A-Za-z]+) \((-?\d+(?:\.\d+)?)\)")
_PROSE_DROP = re.compile(r"^(?:(?:the|total|number|of|a|an|your|given|got|must|be|is|by|than|to)\s+)+", re.I)


def _prose_pairs(msg: str) -> dict[str, str]:
    out = {}
    for phrase, value in _PROSE_PAIR.findall(msg):
        words = _PROSE_DROP.sub("", phrase.lower()).split()[-3:]
        while words and words[0] in (
            "divisible",
            "by",
            "than",
            "of",
            "to",
            "smaller",
            "larger",
            "greater",
            "less",
        ):
            words = words[1:]
        if len(words) >= 2:
            out["_".join(words)] = value
    return out


def _check(facts: LogFacts, ctx: LogContext, h: Hit) -> Cause | None:
    msg = h.fields.get("msg") or ""
    expr = _asserted(facts, h)
    pairs = {n: v for n, v in _PAIR.findall(msg)} or _prose_pairs(msg)
    names: list[str] = []
    for n in [*pairs, *_NAME.findall(msg), *(_NAME.findall(expr) if expr else [])]:
        if n not in names and n not in _NOT_KEYS:
            names.append(n)
    pl = place(facts, h.line)
    resolved = {n: resolve(n, pairs.get(n), ctx, pl.phase) for n in names}
    keys = [k for n in names for k in resolved[n]]
    if not keys and len(pairs) < 2:
        return None  # names no setting and compares no numbers: not a check this can read
    for n in pairs:  # a name the message gives a number is the setting's own name where nothing resolves it
        resolved[n] = resolved[n] or [n]
    advised, _ = message_advice(msg)
    fx: list[Fix] = [Fix(None, None, f"the message's own advice: {a}") for a in advised]
    numbers = {n: float(v) for n, v in pairs.items()}
    # a divisibility check has no "larger" side: the numbers tell no direction
    ordered_not = bool(re.search(r"divisib|multiple of|\s%\s", f"{msg} {expr or ''}"))
    for n in names:
        for k in resolved[n][:3]:
            mine = numbers.get(n)
            others = [v for m, v in numbers.items() if m != n]
            if mine is not None and len(others) == 1 and others[0] != mine and not ordered_not:
                way = "at least" if mine < others[0] else "at most"
                shown = f"{others[0]:g}"
                why = f"set {k} to {way} {shown} (the check compares {n}={mine:g} with {shown})"
            else:
                why = f"change {k} so the check holds" + (f": {expr}" if expr else f" ({msg.strip()[:120]})")
            fx.append(advice(why))
    if not keys:
        fx.append(advice(f"change the settings the check compares so it holds: {msg.strip()[:160]}"))
    compared = ", ".join(f"{n}={v}" for n, v in pairs.items()) or (expr or "")
    where = ", ".join(keys[:4]) or ", ".join(pairs)
    if keys and (bare := [n for n in pairs if resolved[n] == [n]]):
        where = ", ".join([*keys[:4], *bare[:2]])
    return Cause(
        "error",
        "exception",
        f"Configuration check failed: {msg.strip()[:180]}",
        "A check on the run's configuration failed: the settings it compares do not fit each other (or the "
        "model). Nothing numerical went wrong; the run stopped at the check."
        + (f" It compares {compared}." if compared else ""),
        evidence=[quote(h.line)]
        + ([f"asserted: {expr}"] if expr else [])
        + [f"{n} is set by {', '.join(resolved[n])}" for n in names if resolved[n]]
        + pl.evidence(),
        fixes=fx,
        where=where + (f" ({compared[:120]})" if compared and compared != where else ""),
        phase=pl.phase or "init",
        rank=pl.rank,
        line=h.no,
        score=12.0,
        data={"names": names, "keys": keys, "numbers": pairs},
    )
