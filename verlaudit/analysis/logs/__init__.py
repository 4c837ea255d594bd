"""Rules that explain a foreign training log, one module per family: ``distributed`` (NCCL / Gloo
timeouts, kills, Ray actor deaths), ``memory`` (CUDA vs host OOM, KV cache), ``engines`` (vLLM /
SGLang, bf16 on old GPUs, weight sync), ``scaling`` (GradScaler, DeepSpeed, apex), ``exceptions``
(dtype, import, configuration errors), ``libraries`` (version mismatches between libraries, engine
features and limits, FSDP's dtype flattening), ``features`` (an engine refusing a mode or feature as configured), ``placement`` (a
collective or DTensor op refused for where its tensors live), ``checks`` (a failed configuration check, its keys resolved
to the ones the user sets), ``outputs`` (outputs compared with a reference and found apart), ``datasize`` (a
dataset too small for one batch / optimizer step), ``raisers`` (the category by who raised and in which
call: an engine's NotImplementedError, NCCL's transport timeout, an actor dead in its __init__), ``recovered`` (tracebacks the log recovered from, which the
never-clean fallback leaves out), with
``frameworks`` (which framework, the settings it printed, the fix vocabulary) and ``phases`` (the phase
from frames). Each family has a per-line ``detect`` and a pure ``explain(facts, ctx) -> list[Cause]`` over the bounded facts one streaming pass collected:

    scan = new_scan()
    for no, line in enumerate(lines, 1):
        scan.feed(no, line)
    causes, ctx = explain(scan.facts())

``table`` reads every metric format into one per-step table before any rule runs (verl step lines and
file-logger JSON lines, HF Trainer / TRL dicts over one line or several, JSON lines, key=value and
key: value lines, printed tables; ``files``: trainer_state.json, TensorBoard event files, W&B files),
``records`` draws the non-finite evidence from it, ``trends`` the collapse signature and the
rollout-vs-trainer mismatch (one vocabulary across frameworks: ``vocab``); ``read`` reads a log file in
one bounded pass. ``explain`` never lets a log with an error line, a
non-zero exit, a kill or a hang come back clean; ``explain_text`` runs the same families over a run's
recorded traceback. The order (root before cascade) is the run's: ``classify`` gives a log cause its
class in the root-cause rules, `verlaudit.analysis.diagnose.diagnosis.diagnose_log` orders with them.
Exercised by ``pytest tests/test_log_rules.py tests/test_log_corpus.py``.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path

from verlaudit.analysis.causes import Cause, Fix
from verlaudit.analysis.logs import (
    advice,
    checks,
    culprit,
    datasize,
    distributed,
    engines,
    exceptions,
    features,
    frameworks,
    libraries,
    memory,
    outputs,
    parts,
    phases,
    placement,
    raisers,
    ratios,
    recovered,
    scaling,
)
from verlaudit.analysis.logs.frameworks import LogContext
from verlaudit.analysis.logs.lines import message_advice, package_of
from verlaudit.analysis.logs.read import LogRead, log_lines, read_log
from verlaudit.analysis.logs.scan import LogFacts, LogScan, Traceback, place, quote

DETECTORS = (
    distributed.detect,
    memory.detect,
    engines.detect,
    scaling.detect,
    exceptions.detect,
    libraries.detect,
    checks.detect,
    outputs.detect,
    advice.detect,
    features.detect,  # logsg branch
    placement.detect,  # logsg branch
    datasize.detect,  # logs12 branch
    recovered.detect,  # logs12 branch
    parts.detect,  # logs12 branch
    raisers.detect,  # logs13 branch
    ratios.detect,  # logs13 branch
    culprit.detect,  # cul13 branch
)
FAMILIES = (
    distributed.explain,
    memory.explain,
    engines.explain,
    scaling.explain,
    exceptions.explain,
    libraries.explain,
    checks.explain,
    outputs.explain,
    features.explain,  # logsg branch
    placement.explain,  # logsg branch
    datasize.explain,  # logs12 branch
    raisers.explain,  # logs13 branch
    ratios.explain,  # logs13 branch
)
CASCADE = frozenset({"nccl_timeout", "nccl_error", "killed", "ray_actor_died", "engine_error"})
"""Kinds that are usually the consequence of another failure in the same log (a rank that died makes
the others time out; a dead worker makes its callers fail): an earlier failure of another kind is
listed before them as the root."""
FAILURE = "log_failure"
"""The class of a log's error that is not a cascade: a root for the cascades after it."""
CASCADE_CLASS = "log_cascade"
"""The class of a log's error of a kind in ``CASCADE``."""
SEVERITY_ORDER = {"error": 0, "warning": 1, "info": 2}


def new_scan() -> LogScan:
    """A streaming scan that runs every family's detector on each line."""
    return LogScan(DETECTORS)


def read(path: Path) -> LogRead:
    """One bounded pass over a log file: the families' facts and the metric records' NaN evidence
    (ValueError for a file that is not a log)."""
    return read_log(path, new_scan())


def explain(facts: LogFacts) -> tuple[list[Cause], LogContext]:
    """Every family's causes for the facts of one log (with the unrecognised-failure fallback), and the
    log's context (framework, settings). Not yet ordered: the root-cause rules order them
    (`verlaudit.analysis.diagnose.diagnosis.order_by_root`, with ``classify``)."""
    ctx = frameworks.context(facts.markers, facts.settings)
    causes = _without_shadowed([c for family in FAMILIES for c in family(facts, ctx)])
    causes += unrecognised(facts, causes)
    advice.attach(causes, facts)
    for c in causes:
        c.framework = ctx.framework
    return causes, ctx


def _without_shadowed(causes: list[Cause]) -> list[Cause]:
    """Drops a cause a family read only from where an exception was raised (``data["by_frames"]``: an exception
    inside the compiler stack) when another family's error explains the same line by its message."""
    said = {
        c.line
        for c in causes
        if c.severity == "error" and not c.data.get("by_frames") and c.kind != "exception"
    }
    return [c for c in causes if not (c.data.get("by_frames") and c.line in said)]


def explain_text(text: str) -> list[Cause]:
    """Every family's causes for one piece of error text from verlaudit's own trainer (a run's recorded
    error and traceback, status.json): the same rules as a foreign log, with the fix vocabulary of our
    trainer (suite keys, verl keys: no framework), its phases (`trainer.events.PHASES`, through the
    one table `phases.TABLE`), and no unrecognised-failure fallback (the run directory explains an
    exception it does not recognise itself)."""
    scan = new_scan()
    for no, line in enumerate(text.splitlines(), 1):
        scan.feed(no, line)
    facts, ctx = scan.facts(), LogContext(None)
    causes = _without_shadowed([c for family in FAMILIES for c in family(facts, ctx)])
    for c in causes:
        tb = facts.traceback_near(c.line, c.rank) if c.line is not None else None
        c.phase = phases.trainer_phase(c.phase, [f.func for f in tb.frames] if tb else ())
    return causes


def ranked(causes: Sequence[Cause]) -> list[Cause]:
    """A log's causes in the order the root-cause rules start from (a run's is
    `verlaudit.analysis.causes.rank`): errors before warnings before notes; among errors a cascade
    (a kind in ``CASCADE``) after the others, then log order, then score."""
    big = 1 << 40

    def key(c: Cause) -> tuple:
        cascade = c.severity == "error" and c.kind in CASCADE
        return (SEVERITY_ORDER.get(c.severity, 3), cascade, c.line if c.line is not None else big, -c.score)

    return sorted(causes, key=key)


def classify(cause: Cause) -> str:
    """A log cause's class in the root-cause rules (`verlaudit.analysis.diagnose.rules`): a log cannot
    tell the classes a run's records tell (which collator, which module), only which failure came
    first and which kinds follow another failure: ``FAILURE`` or ``CASCADE_CLASS`` for an error,
    ``other`` (in no rule) for a warning or a note."""
    if cause.severity != "error":
        return "other"
    return CASCADE_CLASS if cause.kind in CASCADE else FAILURE


def unrecognised(facts: LogFacts, causes: Sequence[Cause]) -> list[Cause]:
    """Never clean on a failure: when no error-level cause explains a log that holds an exception, an
    ERROR line, a non-zero exit, a kill or a hang (or a traceback), one "unrecognised failure" cause
    quoting the line, with the frame, the library and the phase it came from, and the remedy the message
    itself advises (`lines.message_advice`). An unknown failure whose frames run the trainer's weight
    update into the engine is a ``weight_sync`` failure whatever its message."""
    if any(c.severity == "error" for c in causes):
        return []
    rank_of = {"exception": 0, "kill": 1, "exit": 2, "hang": 3, "error": 4}
    # a traceback the log recovered from (Python ignored it, or a retry loop logged it and the run went on) is
    # not the failure: its lines are left out (`recovered`)
    skip = recovered.recovered_lines(facts)
    signals = sorted(
        (s for s in facts.signals if s[1].no not in skip), key=lambda s: (rank_of.get(s[0], 9), s[1].no)
    )
    tb = next((t for t in facts.tracebacks if t.frames and t.start not in skip), None)
    if not signals and tb is None:
        return []
    sig, title, ev, where, phase, rank, no, advised = _unknown_place(facts, signals, tb)
    what = {
        "exception": "An exception ended the run with a message verlaudit does not recognise.",
        "kill": "A process was killed or crashed.",
        "exit": "A process exited with a non-zero status.",
        "hang": "Something timed out: a hang.",
        "error": "The log reports an error.",
        "traceback": "A traceback without a recognised error.",
    }[sig]
    fixes = [Fix(None, None, f"the message's own advice: {a}") for a in advised]
    kind = "weight_sync" if phase == "weight_sync" else "exception"
    checker = _engine_config_frame(facts.traceback_near(no, rank) if no is not None else tb)
    if (
        kind == "exception" and checker is not None
    ):  # the engine's own check of the configuration it was given
        kind = "engine_feature"
        title = "Engine refused its configuration: " + title.removeprefix("Unrecognised failure: ")
        ev.append(f"raised while the engine checked its configuration ({checker})")
        what += (
            f" It was raised while the inference engine built and checked its configuration ({checker}): the engine "
            "(its release, its platform build: CUDA / ROCm / CPU) refuses a mode, feature or value the setup asks for."
        )
        fixes.append(
            Fix(None, None, f"read the check in {checker}: turn off the feature it refuses (sleep mode, prefix "
                "caching, chunked prefill, CUDA graphs, a parallel layout) or use an engine release / platform build "
                "that supports it (the one the trainer pins)")
        )  # fmt: skip
    if kind == "weight_sync":  # the engine's load_weights under the trainer's update call
        title = "Weight sync failed: " + title.removeprefix("Unrecognised failure: ")
        ev.append("phase weight_sync: the frames run the trainer's weight update into the rollout engine")
        what += (
            " It happened while the trainer's weights were loaded into the rollout engine: the engine's model "
            "class does not take the names, shapes or dtypes the trainer sends (a model the installed engine "
            "release serves through another class, or a name mapping that differs)."
        )
        fixes.append(
            Fix(None, None, "compare the parameter names (and shapes) the trainer sends with the ones the engine's "
                "model class loads (its load_weights / name mapper), and use the engine release the trainer "
                "pairs with this model architecture")
        )  # fmt: skip
    return [
        Cause(
            "error",
            kind,
            title,
            what + " It is a failure all the same: the quoted line is the place to start.",
            evidence=ev,
            where=where,
            phase=phase,
            rank=rank,
            line=no,
            score=10.0,
            fixes=fixes,
            unknown=["the cause: this message is not one of the failure patterns verlaudit explains"],
        )
    ]


def _unknown_place(facts: LogFacts, signals: list, tb: Traceback | None) -> tuple:
    """(signal, title, evidence, where, phase, rank, line, advice) of an unrecognised failure: its first
    signal's line (the innermost message of an exception chain), or a traceback whose exception line was
    cut (also one an ERROR-level logger printed line by line)."""
    line = None
    if signals:
        sig, line = signals[0]
        tb_here = facts.traceback_near(line.no, line.rank)
        if sig == "exception" and tb_here and tb_here.exc and tb_here.exc.no >= line.no:
            line = tb_here.exc
        elif sig == "error" and tb_here and tb_here.start <= line.no <= tb_here.end and tb_here.exc is None:
            sig, line, tb = "traceback", None, tb_here
    else:
        sig, line = "traceback", tb.exc if tb and tb.exc else None
    if line is None and tb is not None:
        f = tb.frames[-1]
        title = f"Unrecognised failure: a traceback cut after {f.func} ({f.path}:{f.lineno})"
        ev = [f"line {tb.start}: traceback with {len(tb.frames)} frame(s), no exception line"]
        ev += _library_evidence(tb)
        where = " / ".join(x for x in (tb.culprit(), _library(tb)) if x) or None
        return sig, title, ev, where, (tb.phase() or (None,))[0], tb.rank, tb.start, []
    pl = place(facts, line)
    ev = [quote(line)] + pl.evidence() + _library_evidence(pl.tb)
    ev += [f"also: {quote(s[1], 160)}" for s in signals[1:3] if s[1].no != line.no]
    advised, named = message_advice(line.text)
    where = pl.culprit(_library(pl.tb)) or (", ".join(named) if named else None)
    if pl.tb is not None and (own := pl.tb.user_frames()):  # the file of the user's frame that raised it
        short = "/".join(own[-1].path.replace("\\", "/").split("/")[-2:])
        where = f"{where} / {short}" if where and short not in where else where or short
    # the model part the message (or the lines that continue it) names: a parameter in a shape error, a module path
    part = next((h.fields["path"] for h in facts.of("module_path") if 0 <= h.no - line.no <= 4), None)
    if part and part not in (where or ""):
        where = f"{part} / {where}" if where else part
    title = f"Unrecognised failure: {line.text.strip()[:200]}"
    return sig, title, ev, where, pl.phase, pl.rank, line.no, advised


_ENGINE_CONFIG = re.compile(
    r"^(?:create_engine_config|_verify_\w+|verify_\w+|check_and_update_config|__post_init__|_check_\w+|"
    r"check_server_args|_handle_\w+_args)$"
)


def _engine_config_frame(tb: Traceback | None) -> str | None:
    """``package func (path:line)`` of the innermost frame of an inference engine (vLLM, SGLang) that builds or
    checks its configuration (``create_engine_config``, ``_verify_*``, ``__post_init__`` of a config class)."""
    for f in reversed(tb.frames if tb else []):
        pkg = package_of(f.path)
        if pkg in ("vllm", "sglang"):  # the frame's function, or the call its line makes (a paste cut there)
            call = (f.call() or "").rsplit(".", 1)[-1]
            name = f.func if _ENGINE_CONFIG.match(f.func) else call if _ENGINE_CONFIG.match(call) else None
            return f"{pkg} {name} ({f.path.rsplit('/', 1)[-1]}:{f.lineno})" if name else None
    return None


def _library(tb: Traceback | None) -> str | None:
    """The package of the innermost library frame (where an unknown exception was raised)."""
    for f in reversed(tb.frames if tb else []):
        if f.library and (pkg := package_of(f.path)):
            return pkg
    return None


def _library_evidence(tb: Traceback | None) -> list[str]:
    """Where inside a library an unknown exception came from, and the libraries it went through."""
    lib = _library(tb)
    if tb is None or lib is None:
        return []
    f = next(f for f in reversed(tb.frames) if f.library and package_of(f.path) == lib)
    libs: list[str] = []
    for g in reversed(tb.frames):
        p = package_of(g.path)
        if p and p not in libs:
            libs.append(p)
    return [
        f"raised inside {lib} ({f.path}:{f.lineno} in {f.func}); libraries, innermost first: {', '.join(libs)}"
    ]


__all__ = [
    "CASCADE",
    "CASCADE_CLASS",
    "DETECTORS",
    "FAILURE",
    "FAMILIES",
    "LogContext",
    "LogFacts",
    "LogRead",
    "LogScan",
    "classify",
    "culprit",
    "explain",
    "explain_text",
    "log_lines",
    "new_scan",
    "ranked",
    "read",
    "unrecognised",
]
