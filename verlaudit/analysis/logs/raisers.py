"""Failures whose category follows from who raised them and in which phase, before the exception's class
(logs13 branch):

- ``engine_feature``: a ``NotImplementedError`` raised in an inference engine's own frame (vLLM, SGLang,
  TensorRT-LLM, LMDeploy): the engine, in its installed release or in the mode / engine class the setup chose
  (vLLM's V0 ``AsyncLLMEngine.collective_rpc_async``), does not implement the call the trainer makes;
- ``nccl_timeout``: NCCL's own transport warning that a connection timed out (``NCCL WARN Call to
  ibv_modify_qp failed with error Connection timed out``, a socket's ``Connection timed out``): the collective's
  timeout is the category and the call it ran in (the trainer's weight update into the engine) is the phase;
- ``ray_actor_died``: a Ray actor that died in its creation task (``The actor died because of an error raised
  in its creation task, ray::...Worker.__init__()``): the actor never came up; its ``__init__`` frame is where.

Exercised by ``pytest tests/test_log_families13.py``.
"""

from __future__ import annotations

import re

from verlaudit.analysis.causes import Cause
from verlaudit.analysis.logs.frameworks import LogContext, advice, fixes
from verlaudit.analysis.logs.lines import LogLine, hints, package_of
from verlaudit.analysis.logs.phases import phase_of_name
from verlaudit.analysis.logs.scan import Hit, LogFacts, Traceback, place, quote

ENGINES = ("vllm", "sglang", "tensorrt_llm", "lmdeploy")
"""The inference engines' packages: a frame in one of them is the engine's own code."""

_NOT_IMPLEMENTED = re.compile(r"(?:^|\s|:\s)NotImplementedError\b(?::\s*(?P<msg>.*))?$")
_NCCL_NET_TIMEOUT = re.compile(
    r"NCCL WARN (?P<what>[^\n]*?(?:Connection timed out|timed out|Timeout)[^\n]*)"
    r"|NCCL (?:error|WARN)[^\n]*?(?P<sock>socket\w*[^\n]*?timed out)"
)
_ACTOR_INIT = re.compile(
    r"The actor died because of an error raised in its creation task, ray::(?:[\w.-]+:)?(?P<cls>\w+)\.__init__\(\)"
    r"(?: \(pid=(?P<pid>\d+))?"
)
# the method an executor / rollout server reports failing, or the route a trainer's call reached the server by
_METHOD_ERROR = re.compile(
    r"Error executing method '?(\w+)'?|Method execution failed: (\w+)|\"POST /(\w+)/? HTTP/[\d.]+\" 200"
)
# the calls of the trainer's weight update into the engine, by name (the worker method an executor runs)
_SYNC_CALL = re.compile(
    r"update_weights?\w*|init_communicator|init_process_group|init_weight_update_group|update_named_param\w*|"
    r"broadcast_to_vllm|sync_weights|refit\w*|load_weights"
)
_HAS = hints(
    "NotImplementedError",
    "NCCL",
    "creation task",
    "Error executing method",
    "Method execution failed",
    "POST /",
)


def detect(line: LogLine) -> list[Hit]:
    """Engine NotImplementedError lines, NCCL transport timeouts, actors that died in their __init__."""
    text = line.text
    if not _HAS(text):
        return []
    out = []
    if m := _NOT_IMPLEMENTED.search(text.rstrip()):
        out.append(Hit("engine_not_impl", line, {"msg": (m["msg"] or "").strip()}))
    if m := _NCCL_NET_TIMEOUT.search(text):
        out.append(Hit("nccl_net_timeout", line, {"what": (m["what"] or m["sock"] or "").strip()}))
    if m := _ACTOR_INIT.search(text):
        out.append(Hit("actor_init_died", line, {"cls": m["cls"], "pid": m["pid"]}))
    if m := _METHOD_ERROR.search(text):
        out.append(Hit("method_failed", line, {"method": m[1] or m[2] or m[3]}))
    return out


def explain(facts: LogFacts, ctx: LogContext) -> list[Cause]:
    """The causes read from who raised and in which call."""
    return [c for c in (_not_implemented(facts, ctx), _net_timeout(facts, ctx), _actor_init(facts, ctx)) if c]


def _engine_frame(tb: Traceback | None):
    """The innermost frame of an inference engine's own code in a traceback, with its package."""
    for f in reversed(tb.frames if tb else []):
        if (pkg := package_of(f.path)) in ENGINES:
            return f, pkg
    return None


def _sync_phase(facts: LogFacts, no: int, tb: Traceback | None) -> str | None:
    """``weight_sync`` when the failing call is the trainer's weight update into the engine: a frame of it, or
    the method an executor / server reports failing within a few lines (``Error executing method update_weight``,
    ``POST /init_communicator/`` before a ``collective_rpc``)."""
    names = [f.func for f in (tb.frames if tb else [])] + [
        h.fields["method"] for h in facts.of("method_failed") if abs(h.no - no) <= 12
    ]
    if any(_SYNC_CALL.fullmatch(n or "") or phase_of_name(n) == "weight_sync" for n in names):
        return "weight_sync"
    return None


def _not_implemented(facts: LogFacts, ctx: LogContext) -> Cause | None:
    for h in facts.of("engine_not_impl"):
        tb = facts.traceback_near(h.no, h.line.rank)
        if tb is None or tb.exc is None or tb.exc.no != h.no:
            continue  # the exception line of a traceback, not a word in prose
        found = _engine_frame(tb)
        if found is None:
            continue
        f, pkg = found
        pl = place(facts, h.line)
        call = f.func
        file = f.path.replace("\\", "/").split(f"/{pkg}/", 1)[-1]
        phase = _sync_phase(facts, h.no, tb) or pl.phase
        msg = h.fields["msg"]
        return Cause(
            "error",
            "engine_feature",
            f"The inference engine does not implement {call} ({pkg})" + (f": {msg[:120]}" if msg else ""),
            f"{pkg}'s own code raised NotImplementedError in {call} ({file}:{f.lineno}): the installed {pkg} "
            "release, or the engine class / mode the setup chose (an async or V0 engine, an executor backend), "
            "lacks the call the trainer or its rollout server makes"
            + (" to set up the weight update" if phase == "weight_sync" else "")
            + ". It is a pairing of trainer, engine version and engine mode, not a numerical problem.",
            evidence=[quote(h.line)] + pl.evidence() + [f"raised in {pkg} ({f.path}:{f.lineno} in {f.func})"],
            fixes=fixes(
                ctx,
                advice(
                    f"use the {pkg} release (and engine mode) the trainer pins for this call: a newer {pkg} "
                    f"implements {f.func} in more engine classes; with vLLM, the V1 engine (VLLM_USE_V1=1) where "
                    "the V0 engine lacks it"
                ),
                advice(f"or turn off the feature that needs {f.func} in the trainer's configuration"),
            ),
            where=f"{pkg} {call} ({file}:{f.lineno})",
            phase=phase,
            rank=pl.rank,
            line=h.no,
            score=45.0,
            data={"engine": pkg, "method": f.func},
        )
    return None


def _net_timeout(facts: LogFacts, ctx: LogContext) -> Cause | None:
    h = facts.first("nccl_net_timeout")
    if h is None or facts.first("nccl_timeout") is not None:
        return None  # the watchdog's own timeout line is the collective rule's
    pl = place(facts, h.line)
    after = [x for x in facts.of("method_failed") if 0 <= x.no - h.no <= 12]
    method = after[0].fields["method"] if after else None
    tb = facts.traceback_near(after[0].no + 1, after[0].line.rank) if after else pl.tb
    phase = _sync_phase(facts, h.no, tb) or pl.phase
    where = f"{method} (NCCL: {h.fields['what'][:80]})" if method else f"NCCL: {h.fields['what'][:80]}"
    return Cause(
        "error",
        "nccl_timeout",
        "NCCL connection timed out"
        + (f" in {method}" if method else "")
        + (f" during {phase}" if phase else ""),
        "NCCL's transport could not reach a peer in time (an InfiniBand queue pair or a socket that never "
        "connected): the collective"
        + (" of the trainer's weight update into the rollout engine" if phase == "weight_sync" else "")
        + " timed out, and the call that ran it failed with it. The network between the two sides (the HCA / "
        "interface NCCL picked, a firewall, a container's network) is the cause, not the weights.",
        evidence=[quote(h.line)] + ([quote(after[0].line)] if after else []) + pl.evidence(),
        fixes=fixes(
            ctx,
            advice(
                "rerun with NCCL_DEBUG=INFO to see the transport and interface NCCL chose; pin the right ones "
                "(NCCL_IB_HCA, NCCL_SOCKET_IFNAME) or, where InfiniBand is not reachable between the two sides, "
                "NCCL_IB_DISABLE=1"
            ),
            advice(
                "in containers: share the host network (--network host) and give the container the IB devices"
            ),
        ),
        where=where,
        phase=phase,
        rank=pl.rank,
        line=h.no,
        score=34.0,
    )


def _actor_init(facts: LogFacts, ctx: LogContext) -> Cause | None:
    h = facts.first("actor_init_died")
    if h is None:
        return None
    cls = h.fields["cls"]
    pl = place(facts, h.line)
    tb = next(
        (t for t in facts.tracebacks if t.start >= h.no - 2 and any(f.func == "__init__" for f in t.frames)),
        None,
    )
    tb = tb or pl.tb
    inits = [f for f in reversed(tb.frames if tb else []) if f.func == "__init__"]
    init = next((f for f in inits if not f.library), inits[0] if inits else None)  # the user's own first
    inner = tb.frames[-1] if tb and tb.frames else None
    at = None
    if init is not None:
        short = "/".join(init.path.replace("\\", "/").split("/")[-2:])
        at = f"{short}:{init.lineno}" + (f": {init.call()}" if init.call() else "")
    exc = tb.exc.text.strip()[:160] if tb and tb.exc else None
    return Cause(
        "error",
        "ray_actor_died",
        f"Ray actor died in its creation task: {cls}.__init__" + (f" ({exc})" if exc else ""),
        f"The {cls} actor raised in its __init__, so Ray marked it dead before it served a call: every call on "
        "it fails next (ActorDiedError). The error is the actor's own start-up (its model load, its process "
        "group, a broadcast of the loaded weights), not a crash or a kill."
        + (f" Its __init__ was at {at} when it raised." if at else " The paste cuts its traceback."),
        evidence=[quote(h.line)]
        + ([f"innermost frame: {inner.path}:{inner.lineno} in {inner.func}"] if inner else [])
        + pl.evidence(),
        fixes=fixes(
            ctx,
            advice(
                f"read the actor's own traceback under the line (the frame in {cls}.__init__ names the step that "
                "failed); a known start-up bug of the framework's recipe is fixed in its newer releases"
            ),
        ),
        where=f"{cls}.__init__" + (f" ({at})" if at else ""),
        phase="init",
        rank=pl.rank,
        line=h.no,
        score=33.0,
        unknown=[] if exc else ["the actor's exception: the paste cuts its traceback before the message"],
    )
