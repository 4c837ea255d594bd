"""A collective or tensor op refused for where its tensors live (logsg branch, issue 25), read from the
message's structure whatever op or framework:

- ``No backend type associated with device type <d>``: a collective (``dist.broadcast``, ``all_reduce``,
  ...) got a tensor on device ``<d>`` over a process group with no backend for that device (a CPU tensor
  on an NCCL-only group); the call is the innermost user frame's;
- ``found no DeviceMesh from dtensor args for <op>``: an op that DTensor dispatches got DTensor arguments
  it cannot place (a plain c10d collective called on DTensor parameters or buffers, mixed DTensor / plain
  tensor arguments).

Both are an ``exception`` whose fix is the change the message implies: the tensor on the group's device
or a group with a backend for it; the collective on the local shard (``to_local()``) or the full tensor,
not on the DTensor. Exercised by ``pytest tests/test_log_families.py -k placement``.
"""

from __future__ import annotations

import re

from verlaudit.analysis.causes import Cause
from verlaudit.analysis.logs.frameworks import LogContext, advice, fixes
from verlaudit.analysis.logs.lines import LogLine, hints
from verlaudit.analysis.logs.scan import Hit, LogFacts, Traceback, place, quote

_NO_BACKEND = re.compile(r"No backend type associated with device type (?P<dev>\w+)")
_NO_MESH = re.compile(r"found no DeviceMesh from dtensor args for (?P<op>[\w.]+?)(?:\.default)?!?(?:\s|$)")
_HAS = hints("No backend type", "found no DeviceMesh")
_COLLECTIVE = re.compile(
    r"(?:^|\.)(broadcast\w*|all_reduce\w*|all_gather\w*|reduce_scatter\w*|reduce|gather|scatter\w*|all_to_all\w*"
    r"|send|recv|isend|irecv|barrier|broadcast_object_list)$"
)


def detect(line: LogLine) -> list[Hit]:
    text = line.text
    if not _HAS(text):
        return []
    if m := _NO_BACKEND.search(text):
        return [Hit("no_backend_for_device", line, {"device": m["dev"]})]
    if m := _NO_MESH.search(text):
        return [Hit("dtensor_no_mesh", line, {"op": m["op"]})]
    return []


def _collective_call(tb: Traceback | None) -> tuple[str | None, str | None]:
    """(the collective call a frame's source line makes, the function of the user's frame that made it)."""
    frames = tb.frames if tb else []
    for f in reversed(frames):
        call = f.call()
        if call and _COLLECTIVE.search(call) and not f.library:
            return call, f.func
    for f in reversed(frames):
        call = f.call()
        if call and _COLLECTIVE.search(call):
            return call, f.func
    return None, None


def explain(facts: LogFacts, ctx: LogContext) -> list[Cause]:
    out = []
    if (h := facts.first("no_backend_for_device")) is not None:
        out.append(_no_backend(facts, ctx, h))
    if (h := facts.first("dtensor_no_mesh")) is not None:
        out.append(_no_mesh(facts, ctx, h))
    return out


def _no_backend(facts: LogFacts, ctx: LogContext, h: Hit) -> Cause:
    dev = h.fields["device"]
    pl = place(facts, h.line)
    call, func = _collective_call(pl.tb)
    what_call = call or "the collective"
    where = " / ".join(x for x in (pl.culprit(), f"{func}: {call}" if call and func else call) if x) or None
    other = "cuda" if dev == "cpu" else "cpu"
    return Cause(
        "error",
        "exception",
        f"{what_call} got a {dev} tensor over a process group with no {dev} backend",
        f"A collective runs on the backend its process group has for the tensor's device; the group here has "
        f"none for {dev} (an NCCL-only group given a CPU tensor, or a Gloo-only group given a CUDA tensor): the "
        "tensor was created on the wrong device for that group.",
        evidence=[quote(h.line)] + pl.evidence(),
        fixes=fixes(
            ctx,
            advice(
                f"create the tensor passed to {what_call} on the group's device ({other}: e.g. "
                "device=torch.cuda.current_device() for an NCCL group), or move it there before the call"
            ),
            advice(
                f"or pass {what_call} a group with a {dev} backend (dist.new_group(backend='gloo') for CPU "
                "tensors; init_process_group(backend='cpu:gloo,cuda:nccl') gives the default group both)"
            ),
        ),  # fmt: skip
        where=where,
        phase=pl.phase,
        rank=pl.rank,
        line=h.no,
        score=36.0,
        data={"device": dev, "call": call},
    )


def _no_mesh(facts: LogFacts, ctx: LogContext, h: Hit) -> Cause:
    op = h.fields["op"]
    pl = place(facts, h.line)
    leaf = op.rsplit(".", 1)[-1].rstrip("_")
    return Cause(
        "error",
        "exception",
        f"{op} called on DTensor arguments it cannot place (no DeviceMesh among them)",
        f"DTensor dispatches {op} only when its DTensor arguments carry a device mesh it can compute on; a plain "
        "c10d collective called on a DTensor (a parameter or buffer of an FSDP2 / tensor-parallel module), or "
        "DTensors mixed with plain tensors, leaves it none.",
        evidence=[quote(h.line)] + pl.evidence(),
        fixes=fixes(
            ctx,
            advice(
                f"do not call {leaf} on DTensor parameters or buffers: call it on the local shard "
                f"(tensor.to_local()) or on tensor.full_tensor(), or skip the {leaf} for DTensors (their "
                "placement already says how each rank holds them)"
            ),
        ),  # fmt: skip
        where=" / ".join(x for x in (pl.culprit(), op) if x),
        phase=pl.phase,
        rank=pl.rank,
        line=h.no,
        score=36.0,
        data={"op": op},
    )
