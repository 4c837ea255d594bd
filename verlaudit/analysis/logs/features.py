"""An inference engine refusing a mode or feature in the configuration it was started with (logsg branch,
issue 25): the engine's own check says the feature is restricted, in the few shapes every such check takes:
``<feature> can only be used ...``, ``<feature> is (only / not) supported ...``, ``<feature> does not support
...``, ``<feature> cannot be used with ...``, ``<feature> requires ...``, ``<feature> is not compatible with
...``. Which feature is read from the message against the engines' feature vocabulary (`FEATURES`: the
phrase a message uses and the engine argument that turns it on), so a new check of an old feature is read
too; a restriction message naming no engine feature is left to the other families.

The cause is an ``engine_feature``: the engine, its version or its mode lacks what the setup asks of it. The
fix names the argument that turns the feature on (to turn it off, or to start the engine so that the
restriction holds), in the engine's spelling. Exercised by ``pytest tests/test_log_families.py -k feature``.
"""

from __future__ import annotations

import re

from verlaudit.analysis.causes import Cause, Fix
from verlaudit.analysis.logs.frameworks import LogContext
from verlaudit.analysis.logs.lines import LogLine, hints
from verlaudit.analysis.logs.scan import Hit, LogFacts, place, quote

FEATURES: tuple[tuple[re.Pattern[str], str, str, bool], ...] = (
    (re.compile(r"\bsleep[ _-]?mode\b", re.I), "enable_sleep_mode", "sleep mode (offloading the weights and KV cache between rollouts)", True),
    (re.compile(r"\bprefix[ _-]?caching\b|\bradix[ _-]?cache\b", re.I), "enable_prefix_caching", "prefix caching", True),
    (re.compile(r"\bchunked[ _-]?prefill\b", re.I), "enable_chunked_prefill", "chunked prefill", True),
    (re.compile(r"\bcuda[ _-]?graphs?\b", re.I), "enforce_eager", "CUDA graphs", False),
    (re.compile(r"\bspeculative(?: decoding)?\b|\bngram\b|\bspec(?:ulative)?_?decode\b", re.I), "speculative_config", "speculative decoding", False),
    (re.compile(r"\bLoRA\b|\blora adapters?\b", re.I), "enable_lora", "LoRA adapters", False),
    (re.compile(r"\bexpert[ _-]?parallel(?:ism)?\b", re.I), "enable_expert_parallel", "expert parallelism", False),
    (re.compile(r"\bpipeline[ _-]?parallel(?:ism)?\b", re.I), "pipeline_parallel_size", "pipeline parallelism", False),
    (re.compile(r"\bmulti[ _-]?step (?:scheduling|decoding)\b", re.I), "num_scheduler_steps", "multi-step scheduling", True),
    (re.compile(r"\basync output processing\b", re.I), "disable_async_output_proc", "async output processing", True),
    (re.compile(r"\bprompt (?:logprobs|adapters?)\b", re.I), "enable_prompt_adapter", "prompt adapters", False),
)  # fmt: skip
"""(how a message names the feature, the engine argument that turns it on, what it is, whether only an engine has
it: a feature other libraries have too (LoRA, pipeline parallelism, CUDA graphs) counts only where the frames or
the log show an engine)."""

_RESTRICTED = re.compile(
    r"(?P<feat>[A-Za-z][\w ./-]{2,60}?)\s+(?:mode\s+)?(?P<how>can only be used|can only run|is only supported|"
    r"are only supported|only supports?|is not (?:yet )?supported|are not (?:yet )?supported|is not compatible|"
    r"are not compatible|cannot be used|can not be used|does not support|do not support|doesn't support|"
    r"requires|must be disabled|must be enabled|is incompatible)\b(?P<rest>.*)",
    re.I,
)
_HAS = hints(
    "can only", "only support", "not supported", "not compatible", "cannot be used", "can not be used",
    "not support", "requires", "must be", "incompatible", "n't support",
)  # fmt: skip
_ERRORISH = re.compile(r"\b(?:Error|Exception|assert|ERROR|raise)\b|^\s*\w+Error:", re.I)


def detect(line: LogLine) -> list[Hit]:
    """A restriction message (an exception's or an ERROR line's) that names an engine feature."""
    text = line.text
    if not _HAS(text) or not _ERRORISH.search(text):
        return []
    m = _RESTRICTED.search(text)
    if m is None:
        return []
    head = m[0][: m.end("how") - m.start()]  # the feature is named before the restriction
    for pat, key, what, only in FEATURES:
        if pat.search(head):
            fields = {"key": key, "what": what, "how": m["how"], "rest": m["rest"], "engine_only": only}
            return [Hit("engine_mode", line, fields)]
    return []


def explain(facts: LogFacts, ctx: LogContext) -> list[Cause]:
    h = facts.first("engine_mode")
    if h is None:
        return []
    key, what = h.fields["key"], h.fields["what"]
    pl = place(facts, h.line)
    frames = " ".join(f.path for f in (pl.tb.frames if pl.tb else []))
    shown = (
        re.search(r"\b(?:vllm|sglang)\b", frames) or ctx.framework in ("vllm", "sglang") or ctx.shows("vllm")
    )
    if not (h.fields["engine_only"] or shown):
        return []
    engine = "sglang" if ctx.framework == "sglang" or ctx.shows("sglang") else "vllm"
    turn_off = "True" if key.startswith("disable_") or key == "enforce_eager" else "False"
    msg = h.line.text.strip()
    return [
        Cause(
            "error",
            "engine_feature",
            f"The rollout engine refuses {what} as configured: {msg[:160]}",
            f"The inference engine's own check refused {what} in the mode, version or layout it was started "
            "with: the feature is restricted (to one engine instance per process, to a backend, to a "
            "parallel layout) and the setup asks for it outside that restriction. It is a pairing of the "
            "setup with the engine's feature, not a numerical problem.",
            evidence=[quote(h.line)] + pl.evidence(),
            fixes=[
                Fix(
                    None,
                    None,
                    f"start the engine so the restriction holds, or without {what}: {key}={turn_off} "
                    f"(the engine argument that turns it on); the message says what it allows: {h.fields['how']}"
                    f"{h.fields['rest'][:120]}",
                    key=f"{key}={turn_off}",
                    framework=engine,
                ),
            ],
            where=key,
            phase=pl.phase or "init",
            rank=pl.rank,
            line=h.no,
            score=45.0,
            data={"feature": key},
        )
    ]
