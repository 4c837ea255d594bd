"""Out-of-memory, told apart by which memory ran out: GPU memory (PyTorch's CUDA OOM messages, both
wordings; ``CUDA error: out of memory``; vLLM's sleep-mode wake-up in the cumem allocator), host RAM
(Ray's memory monitor and the raylet's kill summary, the kernel's OOM killer), and the inference
engine's KV-cache sizing (vLLM V0 / V1 and SGLang refusing to start). The fixes follow the phase the
frames show: an OOM in the no-grad log-prob pass gets smaller log-prob micro-batches, not gradient
checkpointing. Exercised by ``pytest tests/test_log_rules.py -k memory``.
"""

from __future__ import annotations

import re
from typing import Any

from verlaudit import verl_keys as V
from verlaudit.analysis.causes import Cause, Fix
from verlaudit.analysis.logs.deaths import _dead_actor
from verlaudit.analysis.logs.frameworks import LogContext, advice, fixes
from verlaudit.analysis.logs.lines import LogLine, hints
from verlaudit.analysis.logs.phases import phase_of_name
from verlaudit.analysis.logs.scan import Hit, LogFacts, place, quote

# ---- CUDA OOM messages
_UNIT = {"b": 1 / 1024**3, "bytes": 1 / 1024**3, "kib": 1 / 1024**2, "mib": 1 / 1024, "gib": 1.0}
_N = r"([\d.]+) ?(GiB|MiB|KiB|bytes|B)"
OOM_NEW = re.compile(
    rf"Tried to allocate {_N}\. GPU (\d+) has a total capac(?:i)?ty of {_N} of which {_N} (?:is )?free\."
    rf"(?:.*?this process has {_N} memory in use\.)?(?:.*?Of the allocated memory {_N} is allocated by "
    r"PyTorch, "
    rf"(?:with {_N} allocated in private pools \(e\.g\., CUDA Graphs\), )?and {_N} is reserved by PyTorch "
    r"but "
    rf"unallocated)?",
    re.S,
)
OOM_OLD = re.compile(
    rf"Tried to allocate {_N} \(GPU (\d+); {_N} total capacity; {_N} already allocated; {_N} free; "
    rf"{_N} reserved in total by PyTorch\)"
)
OOM_ANY = re.compile(
    r"(?:CUDA|HIP) out of memory|OutOfMemoryError|CUDA error: out of memory|Cuda failure 'out of memory'|"
    r"No available memory for the cache blocks",
    re.I,
)


def _gib(num: str | None, unit: str | None) -> float | None:
    return None if num is None else float(num) * _UNIT[str(unit).lower()]


def parse_oom(text: str) -> dict[str, Any] | None:
    """Numbers of the first CUDA OOM message in ``text``, in GiB (keys absent when it lacks them); a
    detailed message (either PyTorch wording) wins over a bare "out of memory" line."""
    m = OOM_NEW.search(text)
    if m:
        g = m.groups()
        vals = {
            "tried_gib": _gib(g[0], g[1]),
            "gpu": int(g[2]),
            "total_gib": _gib(g[3], g[4]),
            "free_gib": _gib(g[5], g[6]),
            "process_in_use_gib": _gib(g[7], g[8]),
            "allocated_gib": _gib(g[9], g[10]),
            "reserved_unallocated_gib": _gib(g[13], g[14]),
            "message": m[0][:400],
        }
        return {k: v for k, v in vals.items() if v is not None}
    m = OOM_OLD.search(text)
    if m:
        g = m.groups()
        alloc, reserved = _gib(g[5], g[6]), _gib(g[9], g[10])
        return {
            "tried_gib": _gib(g[0], g[1]),
            "gpu": int(g[2]),
            "total_gib": _gib(g[3], g[4]),
            "allocated_gib": alloc,
            "free_gib": _gib(g[7], g[8]),
            "reserved_unallocated_gib": (reserved or 0.0) - (alloc or 0.0),
            "message": m[0],
        }
    m = OOM_ANY.search(text)
    if not m:
        return None
    start, stop = text.rfind("\n", 0, m.start()) + 1, text.find("\n", m.start())
    return {"message": text[start : stop if stop >= 0 else len(text)].strip()[:400]}


# ---- per-line detection
_KV = [
    ("kv_no_blocks", re.compile(r"No available memory for the cache blocks")),
    ("kv_max_len", re.compile(r"The model's max seq len \((\d+)\) is larger than the maximum number of "
                              r"tokens that "
                              r"can be stored in KV cache \((\d+)\)")),
    ("kv_v1", re.compile(r"To serve at least one request with the models?'s max seq len \((\d+)\)")),
    ("kv_free_memory", re.compile(r"Free memory on device(?: (\S+))? \(([\d.]+)/([\d.]+) GiB\) on startup "
                                  r"is less "
                                  r"than desired GPU memory utilization \(([\d.]+), ([\d.]+) GiB\)")),
    ("kv_sglang", re.compile(r"Not enough memory\. Please try to increase --mem-fraction-static")),
    # TGI's warm-up: the batch it is configured to prefill does not fit next to the weights
    ("kv_tgi", re.compile(r"Not enough memory to handle (\d+) (prefill|total) tokens")),
    ("kv_blocks", re.compile(r"# (?:GPU|cuda) blocks: (\d+)")),
    # the engine's own KV-cache capacity at start, non-positive: nothing is left for the cache after the
    # weights (SGLang's "max_total_tokens=N is larger than the profiled value -561981", vLLM V1's "Available KV
    # cache memory: -1.2 GiB" / "GPU KV cache size: 0 tokens"); a positive capacity is a healthy line
    ("kv_nonpositive", re.compile(
        r"larger than the profiled value (-\d+|0)\b|Available KV cache memory: (-[\d.]+|0(?:\.0+)?) GiB"
        r"|GPU KV cache size: (-?0|-[\d,]+) tokens|KV Cache is allocated\. #tokens: (0|-\d+)\b")),
]  # fmt: skip
# vLLM's memory budget at start (V0 and early V1 workers): the share of the card the engine takes for weights,
# activations and KV cache; the CUDA graphs it captures next (and NCCL buffers, the CUDA context of other
# processes) allocate outside it
_BUDGET = re.compile(
    r"total_gpu_memory \(([\d.]+) ?GiB\) x gpu_memory_utilization \(([\d.]+)\) = ([\d.]+) ?GiB"
)
# a function that turns a whole [batch, seq, vocab] logits tensor into log-probs or entropy, named by a frame, the
# source line of one, or a line of a call chain pasted above the OOM (`from_parallel_logits_to_logprobs`,
# `log_softmax(`, `entropy_from_logits`); a pass's own method (compute_log_prob) names no such function
_VOCAB_FN = re.compile(r"\b(\w*(?:log_softmax|logits_to_\w+|_from_logits|from_parallel_logits)\w*)\b")
# the inference engine's own processes: SGLang's scheduler ("[... TP0] Scheduler hit an exception"), vLLM's engine
# core and workers (EngineCore_DP0, VllmWorker, RayWorkerWrapper, "[core.py:..]" lines)
_ENGINE_PROC = re.compile(
    r"\bTP\d+(?: EP\d+)?\] Scheduler hit an exception|\bEngineCore(?:_DP\d+)?\b|\bVllmWorker\b|RayWorkerWrapper"
    r"|\[core\.py:\d+\]|\bsglang::scheduler"
)


def _engine_name(matched: str) -> str:
    if "Scheduler" in matched:
        return f"SGLang scheduler {matched.split(']', 1)[0]}"
    return "vLLM engine core" if "core.py" in matched else f"vLLM {matched}"


VOCAB_SHARE = 0.1
"""One allocation above this share of the GPU in an OOM is a whole-vocabulary tensor (logits, log-softmax,
entropy of a micro-batch x sequence x vocab, in fp32): the pass that makes it wants chunking."""
_CAPTURE = re.compile(r"Capturing (?:cudagraphs|CUDA graphs?)", re.I)
HEADROOM_GIB = 1.0
"""Memory left outside vLLM's budget below which CUDA-graph capture (typically 0.2-2 GiB, more with many batch
sizes) and the CUDA context / NCCL buffers have no room: vLLM's own hint says to lower gpu_memory_utilization
when capture runs out of memory."""
_MONITOR = re.compile(
    r"Memory on the node \([^)]*\)(?: where the \w+ (?:\((?P<detail>[^()]*)\) )?was running)? was "
    r"(?P<used>[\d.]+)GB / (?P<total>[\d.]+)GB \((?P<frac>[\d.]+)\), which exceeds the memory usage "
    r"threshold of "
    r"(?P<thr>[\d.]*\d)"
)
# the monitor's older wording (Ray < 1.x raised it in the driver): "ray.memory_monitor.RayOutOfMemoryError: More than 95%
# of the memory on node X is used (15.98 / 16.82 GB). The top 5 memory consumers are:" and a "PID MEM COMMAND" table
_MONITOR_OLD = re.compile(
    r"RayOutOfMemoryError: More than (?P<pct>\d+(?:\.\d+)?)% of the memory on node (?P<node>\S+) is used "
    r"\((?P<used>[\d.]+) / (?P<total>[\d.]+) ?GB\)"
)
_RAY_HOST_EXC = re.compile(r"RayOutOfMemoryError|ray\.exceptions\.OutOfMemoryError")
_HOST = [
    ("host_task_killed", re.compile(r"Task was killed due to the node running low on memory|\d+ worker\(s\) "
                                    r"were "
                                    r"killed due to the node running low on memory|NODE_OUT_OF_MEMORY"
                                    # the trailer of the monitor's kill message, when a paste keeps only it
                                    r"|how to address the out of memory issue: \S*ray-oom-prevention")),
    # a row of the monitor's "PID MEM(GB) COMMAND" table of the largest users, largest first
    ("host_top_row", re.compile(r"^\s*\d+\s+[\d.]+\s+ray::(\w+)")),
    ("host_raylet", re.compile(r"(\d+) Workers \(tasks / actors\) killed due to memory pressure \(OOM\)")),
    # the kernel's OOM killer in its every release's words (dmesg, /var/log/messages, journalctl): "Out of memory: Kill
    # process N (name) score S or sacrifice child" (older), "Out of memory: Killed process N (name)", "Killed process N
    # (name) total-vm:...", "oom_reaper: reaped process N (name)"; a cgroup's, a container's (Kubernetes' OOMKilled,
    # Docker's exit with OOMKilled true) and Slurm's ("Detected 1 oom-kill event(s) in StepId=...") report of it
    # the process's own allocation in host memory failing: PyTorch's CPU allocator, ENOMEM, numpy, C++'s bad_alloc
    ("host_alloc", re.compile(r"DefaultCPUAllocator: (?:not enough memory|can't allocate memory)[^\n]*"
                              r"|\[Errno 12\] Cannot allocate memory|^MemoryError\b[^\n]*|\bstd::bad_alloc\b"
                              r"|Unable to allocate [\d.]+ [KMGT]i?B for an array")),
    ("host_kernel", re.compile(r"Out of memory: Kill(?:ed)? process (\d+) \(([^)]+)\)|Memory cgroup out of memory|"
                               r"invoked oom-killer|oom-kill:|\bKilled process (\d+) \(([^)]+)\) total-vm:"
                               r"|oom_reaper: reaped process (\d+) \(([^)]+)\)|\bOOMKilled\b|\"OOMKilled\":\s*true"
                               r"|Detected \d+ oom[-_]kill events?|Out of memory and no killable processes")),
]  # fmt: skip
_TABLE_ROW = re.compile(r"^\s*(\d+)\s+([\d.]+)(?:GB|GiB)?\s+(.+?)\s*$")


_HAS = hints(
    "emory",
    "MEMORY",
    "blocks",
    "KV cache",
    "KV Cache",
    "max seq len",
    "oom-kill",
    "oom_kill",
    "oom_reaper",
    "OOMKilled",
    "total-vm:",
    "allocate",
    "MemoryError",
    "bad_alloc",
    "OOM",
    "profiled value",
    "Not enough memory",
    "ray::",
    "cudagraph",
    "CUDA graph",
    "log_",
    "logprob",
    "entropy",
)


def detect(line: LogLine) -> list[Hit]:
    """Memory messages in one line (CUDA OOM, host-RAM kills, KV-cache sizing)."""
    text = line.text
    if not _HAS(text):
        return []
    out: list[Hit] = []
    for rule, pat in _KV:
        m = pat.search(text)
        if m:
            out.append(Hit(rule, line, {"groups": m.groups()}, want=1 if rule == "kv_v1" else 0))
    m = _MONITOR.search(text)
    if m:
        out.append(Hit("host_monitor", line, m.groupdict(), want=14))
    elif m := _MONITOR_OLD.search(text):
        f = {"used": m["used"], "total": m["total"], "thr": f"{float(m['pct']) / 100:g}", "detail": None}
        out.append(Hit("host_monitor", line, f, want=14))
    if m := _BUDGET.search(text):
        out.append(Hit("vllm_budget", line, {"groups": m.groups()}))
    if _CAPTURE.search(text):
        out.append(Hit("graph_capture", line, {}))
    if ("log" in text or "entropy" in text) and (m := _VOCAB_FN.search(text)):
        out.append(Hit("vocab_fn", line, {"fn": m[1]}))
    for rule, pat in _HOST:
        m = pat.search(text)
        if m:
            out.append(Hit(rule, line, {"groups": m.groups()}))
    if any(
        h.rule not in ("kv_blocks", "kv_nonpositive", "vllm_budget", "graph_capture", "vocab_fn") for h in out
    ):
        return out
    # Ray's host-memory exceptions (RayOutOfMemoryError, ray.exceptions.OutOfMemoryError) name no CUDA memory
    ray_host = "memory on the node" in text.lower() or _RAY_HOST_EXC.search(text) is not None
    oom = None if ray_host else parse_oom(text)
    if oom and not text.lstrip().startswith(("If ", "To ")):  # vLLM's INFO advice about OOM is not one
        out.append(Hit("cuda_oom", line, oom))
    return out


# ---- causes
def explain(facts: LogFacts, ctx: LogContext) -> list[Cause]:
    """CUDA OOM, host OOM and KV-cache causes of a log."""
    found = [c for c in (_cuda_oom(facts, ctx), _host_oom(facts, ctx), *_kv_cache(facts, ctx)) if c]
    return found + [c for c in [_headroom(facts, ctx)] if c]


def _headroom(facts: LogFacts, ctx: LogContext) -> Cause | None:
    """vLLM's memory budget leaving less than ``HEADROOM_GIB`` of the card outside it while CUDA graphs are
    captured (not with enforce_eager): a warning on its own, the likely reason of a CUDA OOM at capture or
    in the first decoding steps (the OOM's own cause comes first where the log shows one)."""
    budget, capture = facts.first("vllm_budget"), facts.first("graph_capture")
    # (a capture line outweighs an enforce_eager=True read from vLLM's own hint "set 'enforce_eager=True'")
    if budget is None or (capture is None and str(ctx.settings.get("enforce_eager", "")).lower() == "true"):
        return None
    total, util, _ = (float(x) for x in budget.fields["groups"])
    left = total * (1.0 - util)
    if not 0.0 < util < 1.0 or left >= HEADROOM_GIB:
        return None
    ev = [quote(budget.line), f"outside the budget: {total:g} GiB x (1 - {util:g}) = {left:.2f} GiB"]
    if capture is not None:
        ev.append(quote(capture.line, 200))
    pl = place(facts, budget.line)
    return Cause(
        "warning",
        "oom",
        f"vLLM's gpu_memory_utilization {util:g} leaves {left:.2f} GiB of the {total:g} GiB GPU outside its "
        "budget: CUDA-graph capture has no room",
        "vLLM takes gpu_memory_utilization x the GPU's memory for the weights, the profiled activations and "
        "the KV cache (the cache gets all the rest of that budget); CUDA-graph capture, the CUDA context and "
        f"NCCL buffers allocate outside it. Under {HEADROOM_GIB:g} GiB is left for them here, so capture (or "
        "the first decoding steps) runs out of memory, or another process on the GPU does.",
        evidence=ev + pl.evidence(),
        fixes=fixes(
            ctx,
            (
                "rollout_memory",
                f"lower it (e.g. {max(0.5, round(util - 0.08, 2)):g}): leave 1-2 GiB outside it",
            ),
            ("enforce_eager", "no CUDA-graph capture, so nothing is allocated outside the budget"),
            ("max_num_seqs", "fewer sequences per step: fewer and smaller graphs to capture"),
            ("max_model_len", "a shorter context if the cache must shrink"),
        ),
        where="vllm gpu_memory_utilization",
        phase="init",
        rank=pl.rank,
        line=budget.no,
        score=20.0,
    )


# long: one CUDA OOM cause from every fact its message gives (phase, fragmentation, one huge allocation, a whole-vocabulary tensor, the device and who shares it)
def _cuda_oom(facts: LogFacts, ctx: LogContext) -> Cause | None:
    hits = facts.of("cuda_oom")
    if not hits:
        return None
    # the first OOM, but the first detailed message of the same failure when the first line is bare
    first = hits[0]
    detailed = next((h for h in hits if "tried_gib" in h.fields and h.no - first.no < 30), first)
    oom = dict(detailed.fields)
    pl = place(facts, first.line)
    allocator = re.search(r"([\w-]+allocator)\.cpp", first.line.text)
    wake = bool(allocator) or any(f.func == "wake_up" for f in (pl.tb.frames if pl.tb else []))
    phase = "weight_sync" if wake else pl.phase
    engine = _ENGINE_PROC.search(f"{first.line.source or ''} {first.line.text}")
    if phase is None and engine:
        phase, pl.phase_why = "generate", "raised in the inference engine's own process"
    what = "The GPU ran out of memory."
    frag, alloc = oom.get("reserved_unallocated_gib"), oom.get("allocated_gib")
    fragmented = frag is not None and alloc is not None and frag > 0.2 * max(alloc, 1e-9)
    if fragmented:
        what += (
            f" {frag:.3g} GiB was reserved but unallocated: fragmentation made it fail earlier than needed."
        )
    tried, total = oom.get("tried_gib"), oom.get("total_gib")
    if tried and total and tried > 0.1 * total:
        what += (
            f" A single {tried:.3g} GiB allocation ({tried / total:.0%} of the GPU): usually logits / "
            "log-softmax / entropy of a whole micro-batch x sequence x vocab in fp32."
        )
    vocab = _vocab_pass(facts, first, tried, total)
    if vocab:
        what += (
            f" The allocation comes from {vocab}, which turns a whole micro-batch x sequence x vocabulary of logits "
            "into log-probs / entropy at once: chunk that computation (or shrink its micro-batch)."
        )
    what += _PHASE_WHAT.get(phase or "", "")
    ev = [quote(first.line)] + ([quote(detailed.line)] if detailed is not first else [])
    nums = {k: v for k, v in oom.items() if k.endswith("_gib")}
    if nums:
        ev.append("device view: " + ", ".join(f"{k[:-4]} {v:.3g} GiB" for k, v in nums.items()))
    ev += pl.evidence()
    if wake and pl.phase != "weight_sync":
        ev.append("phase: weight_sync (sleep-mode wake_up re-maps the engine's memory)")
    # the device the message names, and the other processes it lists on it (a GPU shared with other jobs)
    gpu = oom.get("gpu")
    procs = set(re.findall(r"Process (\d+) has [\d.]+ ?[KMG]i?B memory in use", detailed.line.text))
    shared = f", shared by {len(procs)} processes" if len(procs) > 1 else ""
    if len(procs) > 1:
        what += (
            f" The message lists {len(procs)} processes holding memory on this GPU: where they are not this job's "
            "own ranks, another job or test shares the GPU."
        )
    title = (
        "vLLM sleep-mode wake_up ran out of GPU memory" + (f" in the {allocator[1]}" if allocator else "")
        if wake
        else f"CUDA out of memory{f' on GPU {gpu}' if gpu is not None else ''}{shared}"
        f"{_PHASE_TITLE.get(phase or '', '')}"
    )
    return Cause(
        "error",
        "oom",
        title,
        what,
        evidence=ev,
        fixes=_with_vocab(
            fixes(ctx, *_vocab_fixes(phase, vocab)), _oom_fixes(phase, ctx, fragmented, facts), vocab
        ),
        where=pl.culprit(
            allocator[1] if allocator else None,
            vocab and _vocab_where(vocab, ctx),
            engine and _engine_name(engine[0]),
        ),
        phase=phase,
        rank=pl.rank,
        line=first.no,
        score=40.0,
        data=oom,
        unknown=[
            "memory classes: the message gives totals only, not how much is parameters, gradients, "
            "optimizer state or activations; `verlaudit plan` estimates them, a run under verlaudit "
            "measures per phase"
        ],
    )


def _vocab_pass(facts: LogFacts, oom: Hit, tried: float | None, total: float | None) -> str | None:
    """The log-prob / log-softmax / entropy function an OOM came from (a frame of its traceback, a call-chain
    line up to 15 lines above it), else "a whole-vocabulary tensor" when one allocation is over ``VOCAB_SHARE``
    of the GPU; None otherwise."""
    tb = facts.traceback_near(oom.no, oom.line.rank)
    for f in reversed(tb.frames if tb else []):
        if _VOCAB_FN.search(f"{f.func} {f.code or ''}"):
            return f.func  # (the function, or the one whose line calls it)
    frames = {ln for t in facts.tracebacks for ln in range(t.start, t.end + 1) if t.frames}
    near = [h for h in facts.of("vocab_fn") if 0 <= oom.no - h.no <= 15 and h.no not in frames]
    if near:
        return near[-1].fields["fn"]
    if tried and total and tried > VOCAB_SHARE * total:
        return "a whole-vocabulary tensor"
    return None


def _vocab_where(vocab: str, ctx: LogContext) -> str:
    f = fixes(ctx, ("entropy_chunking", ""))
    key = (f[0].key or f[0].verl) if f and (f[0].key or f[0].verl) else None
    return f"{vocab} (full-vocab logits" + (f"; chunked by {key}" if key else "") + ")"


def _with_vocab(first: list[Fix], rest: list[Fix], vocab: str | None) -> list[Fix]:
    """The vocab-tensor fixes first where a function was named; after the phase's first fix where only the
    allocation's size suggests one (the phase's micro-batch is then as likely the lever)."""
    keys = {(f.verl, f.key) for f in rest}
    first = [f for f in first if (f.verl, f.key) not in keys or f.verl is f.key is None]
    if vocab and vocab.startswith("a whole"):
        return rest[:1] + first + rest[1:]
    return first + [f for f in rest if f not in first]


def _vocab_fixes(phase: str | None, vocab: str | None) -> list:
    if not vocab:
        return []
    return [
        ("entropy_chunking", "log-probs / entropy over chunks of the sequence instead of one fp32 [batch x seq x "
         "vocab] tensor"),
        ("logprob_micro_batch", "fewer sequences per log-prob micro-batch: the vocab tensor shrinks with it")
        if phase != "update" else ("train_micro_batch", "fewer sequences per micro-batch: the vocab tensor shrinks"),
    ]  # fmt: skip


_PHASE_TITLE = {
    "logprob": " in the no-grad log-prob pass",
    "reference": " in the reference log-prob pass",
    "update": " in the update (forward + backward)",
    "generate": " in generation",
    "values": " in the value pass",
    "checkpoint": " while saving a checkpoint",
    "init": " while loading / initialising",
    "weight_sync": " in weight sync",
}
_PHASE_WHAT = {
    "logprob": " The pass runs without gradients: activations are not kept, so gradient checkpointing does "
    "not "
    "help; the micro-batch's logits (and entropy) are the peak.",
    "reference": " The reference model's forward runs without gradients: its micro-batch and its resident "
    "weights "
    "are the levers.",
    "update": " Forward and backward: activations, gradients and optimizer state are all resident.",
    "generate": " Generation: the engine's KV cache and the batch of sequences in flight are the levers.",
    "weight_sync": " The engine's weights and KV cache come back while the trainer's state is still on the "
    "GPU.",
}


def _oom_fixes(phase: str | None, ctx: LogContext, fragmented: bool, facts: LogFacts) -> list:
    alloc = (
        Fix(None, V.ALLOC_CONF, "lets the allocator grow segments")
        if ctx.framework in (None, "verl")
        else advice("set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True so the allocator can grow segments")
    )
    entropy = any("entropy" in (f.func + (f.code or "")) for tb in facts.tracebacks for f in tb.frames)
    by_phase = {
        "logprob": [
            ("logprob_micro_batch", "smaller log-prob micro-batches (the no-grad pass's peak)"),
            ("entropy_chunking", "computes the entropy over vocab chunks") if entropy else None,
            ("param_offload", "frees the actor's parameters while they are not gathered"),
        ],
        "reference": [
            ("ref_logprob_micro_batch", "smaller reference micro-batches"),
            ("ref_offload", "keeps the reference weights on the CPU between passes"),
        ],
        "update": [
            ("grad_checkpointing", "activation memory", "precision.grad_checkpointing: true"),
            ("train_micro_batch", "smaller micro-batches", "algo.micro_batch_size: <half>"),
            ("zero3", "shards parameters, gradients and optimizer state"),
            ("optimizer_offload", "optimizer state to the CPU"),
            ("param_offload", "parameters to the CPU"),
        ],
        "generate": [
            ("rollout_memory", "lower if the trainer shares the GPU with the engine"),
            ("max_num_seqs", "fewer sequences in flight"),
            ("response_length", "shorter responses: a smaller KV cache per sequence"),
        ],
        "weight_sync": [
            ("param_offload", "the trainer's parameters off the GPU before the engine wakes up"),
            ("optimizer_offload", "the optimizer state off the GPU before the engine wakes up"),
            ("rollout_memory", "a smaller engine footprint (weights + KV cache) beside the trainer"),
            ("sleep_mode", "the engine releases its memory while the trainer runs"),
        ],
        "init": [("param_offload", "parameters to the CPU"), ("zero3", "shards the model at load time")],
        "checkpoint": [advice("gather the state dict on the CPU, or save sharded checkpoints")],
        "values": [("train_micro_batch", "smaller critic micro-batches")],
    }
    generic = [
        (
            "grad_checkpointing",
            "activation memory, if it happened in a training forward / backward",
            "precision.grad_checkpointing: true",
        ),
        ("train_micro_batch", "smaller micro-batches", "algo.micro_batch_size: <half>"),
        ("logprob_micro_batch", "smaller micro-batches in the log-prob passes, if it happened there"),
        ("zero3", "shards parameters, gradients and optimizer state"),
        ("param_offload", "model state memory: parameters to the CPU", "precision.preset: bf16-pure"),
    ]
    return fixes(ctx, alloc if fragmented else None, *by_phase.get(phase or "", generic))


def _monitor(mon: Hit) -> tuple[str, str | None, str | None, list[str], str | None]:
    """Ray's memory-monitor message: (title part, the killed task, the largest user, evidence, the phase
    the killed task's or the largest users' method names tell)."""
    f = mon.fields
    name = re.search(r"name=([^,]+)", f.get("detail") or "")
    killed = name[1] if name else None
    part = f": node at {float(f['used']):.4g} of {float(f['total']):.4g} GB (threshold {f['thr']})"
    rows = sorted((m for m in (_TABLE_ROW.match(t) for t in mon.follow) if m), key=lambda m: -float(m[2]))
    top = rows[0][3].removeprefix("ray::").split()[0] if rows else None
    ev = ["top memory users: " + "; ".join(f"{m[3][:60]} {m[2]} GB" for m in rows[:4])] if rows else []
    methods = [n.split(":")[-1].split()[0].split(".")[-1] for n in [killed or "", *(m[3] for m in rows)] if n]
    phase = next((p for p in map(phase_of_name, methods) if p), None)
    return part, killed, top, ev, phase


def _host_oom(facts: LogFacts, ctx: LogContext) -> Cause | None:
    hits = facts.of("host_monitor", "host_task_killed", "host_raylet", "host_kernel", "host_alloc")
    if not hits:
        return None
    mon, kernel = facts.first("host_monitor"), facts.first("host_kernel")
    part, killed, top, table, phase_hint = _monitor(mon) if mon else ("", None, None, [], None)
    row = facts.first("host_top_row")
    if top is None and row is not None and abs(row.no - hits[0].no) <= 20:  # the table without its header
        top, table = row.fields["groups"][0], [quote(row.line)]
    named = [g for k in facts.of("host_kernel") for g in k.fields["groups"][1::2] if g]
    if (
        kernel and named
    ):  # the kill's own line names the process (the "invoked oom-killer" line above it does not)
        killed = killed or named[0]
    pl = place(facts, hits[0].line)
    if pl.phase is None and phase_hint:
        pl.phase, pl.phase_why = phase_hint, "the killed / largest processes' methods"
    ray = mon or facts.count("host_raylet", "host_task_killed")
    alloc = not (ray or kernel) and facts.first("host_alloc") is not None
    who = "Ray's memory monitor" if ray else "the kernel's OOM killer" if not alloc else "the allocator"
    what = (
        f"Host (CPU) memory ran out and {who} killed a process: this is not a CUDA OOM, GPU settings do not "
        "help. The killed process is the most recently scheduled one, not necessarily the one that grew"
        + (f"; the largest user was {top}." if top else ".")
    )
    offload = ctx.is_true("param_offload", "optimizer_offload", "adam_offload", "offload_param.device")
    fx = fixes(
        ctx,
        advice(
            "offloading keeps parameters / optimizer state in host RAM: this run offloads, so turn it off or "
            "give the node more RAM"
        )
        if offload
        else None,
        advice("save checkpoints less often, sharded, without gathering the full state dict on one host")
        if pl.phase == "checkpoint"
        else None,
        advice(
            "load weights on one rank or shard them at load time (low_cpu_mem_usage, meta-device init, "
            "ZeRO-3 "
            "init) instead of a full CPU copy per process"
        )
        if pl.phase == "init"
        else None,
        ("token_budget", "smaller per-GPU token budgets: smaller batches held in host memory between passes"),
        advice("run fewer worker processes per node, or give the node more RAM"),
        ("host_memory_threshold", "only if the node has headroom the monitor does not count (a stopgap)"),
    )
    if alloc:  # no process was killed: the process's own allocation in host memory failed
        what = (
            "Host (CPU) memory ran out: the process's own allocation in host RAM failed (PyTorch's CPU allocator, "
            "the kernel's ENOMEM, numpy, C++'s bad_alloc): this is not a CUDA OOM, GPU settings do not help."
        )
    return Cause(
        "error",
        "oom_host",
        f"Host RAM exhausted: {hits[0].line.text.strip()[:140]}"
        if alloc
        else f"Host RAM exhausted{part}; {who} killed {killed or 'a worker'}",
        what,
        evidence=[quote(h.line) for h in hits[:3]] + table + pl.evidence(),
        fixes=fx,
        where=" / ".join(x for x in (top or killed, _killed_actor(facts)) if x) or None,
        phase=pl.phase,
        rank=pl.rank,
        line=hits[0].no,
        score=42.0,
        unknown=["which allocation grew: Ray and the kernel report totals per process only"],
    )


def _kv_cache(facts: LogFacts, ctx: LogContext) -> list[Cause]:
    hit = facts.first(
        "kv_no_blocks", "kv_max_len", "kv_v1", "kv_free_memory", "kv_sglang", "kv_tgi"
    ) or facts.first("kv_nonpositive")
    if hit is not None:
        return [_kv_cause(hit, facts, ctx)]
    blocks = facts.first("kv_blocks")
    failed = next(
        (h for h in facts.of("engine_method_error") if h.fields.get("method") == "initialize_cache"), None
    )
    if blocks is None:
        return []
    n = int(blocks.fields["groups"][0])
    if failed is None and n == 0:
        # zero GPU blocks is a failure however the log goes on (vLLM V0 raises "No available memory for the
        # cache blocks" next; a paste often stops at the line or at "Traceback"): no request can be served
        return [_kv_cause(Hit("kv_no_blocks", blocks.line, {"groups": ()}), facts, ctx)]
    if failed is None:
        return []
    # vLLM V0's initialize_cache raises with blocks > 0 only when max_model_len exceeds the cache
    rule = "kv_no_blocks" if n == 0 else "kv_max_len_inferred"
    return [
        _kv_cause(Hit(rule, failed.line, {"groups": (), "blocks": n, "blocks_line": blocks.line}), facts, ctx)
    ]


_RAISE = ("rollout_memory", "raise it: a larger share of the GPU for weights + KV cache")
_LOWER_LEN = ("max_model_len", "lower it to what the cache holds (prompt + response length is enough)")
_TRAINER_OFF = (
    "param_offload",
    "if the trainer shares the GPU: its state off the GPU before the engine starts",
)
_MAX_LEN_WHAT = (
    "The engine must fit at least one sequence of max_model_len tokens in its KV cache at start; the model's "
    "default context (often 32K-128K) is larger than the cache left after the weights."
)


def _kv_max_len_title(h: Hit) -> str:
    g = h.fields["groups"]
    if h.rule == "kv_max_len":
        return f"KV cache holds {g[1]} tokens, fewer than max_model_len {g[0]}"
    if h.rule == "kv_max_len_inferred":
        blocks = h.fields["blocks"]
        return f"vLLM's cache initialisation failed: {blocks} blocks cannot hold one max_model_len sequence"
    nums = re.search(
        r"max seq len \((\d+)\),? \(?([\d.]+) GiB KV cache is needed.*?available KV cache memory "
        r"\(([\d.]+) GiB\)(?:.*?estimated maximum model length is (\d+))?",
        h.text(""),
    )
    if not nums:
        return f"KV cache too small for one request of max_model_len {g[0]}"
    fits = f" (max_model_len <= {nums[4]} fits)" if nums[4] else ""
    return f"One {nums[1]}-token request needs {nums[2]} GiB of KV cache; {nums[3]} GiB is available{fits}"


def _kv_reading(h: Hit) -> tuple[str, str, str, list]:
    """(title, culprit, what, remedies) for one KV-cache sizing failure."""
    g = h.fields["groups"]
    if h.rule == "kv_no_blocks":
        return (
            "No memory left for KV-cache blocks after the weights and activation profiling",
            "gpu_memory_utilization",
            "The engine's memory budget (gpu_memory_utilization x GPU memory) is used up by the weights "
            "and the "
            "profiled activations, so no KV-cache block fits: raise the budget, or free what else holds "
            "the GPU.",
            [
                _RAISE,
                _TRAINER_OFF,
                (
                    "enforce_eager",
                    "no CUDA-graph capture: the start-up profile then keeps that memory for the cache",
                ),
                ("max_num_seqs", "a smaller profiling batch leaves more for the cache"),
            ],
        )
    if h.rule == "kv_free_memory":
        _, free, total, util, want = g
        return (
            f"vLLM asks for {util} x {float(total):.4g} GiB = {want} GiB but only {free} GiB is free at "
            "start",
            "gpu_memory_utilization",
            "vLLM's start-up check: gpu_memory_utilization is a share of the whole GPU, and another process "
            "(a colocated trainer, a previous engine, another job) already holds part of it.",
            [
                ("rollout_memory", f"lower it below {float(free) / float(total):.2f} (free / total)"),
                ("sleep_mode", "a colocated engine should release its memory while the trainer runs"),
                _TRAINER_OFF,
            ],
        )
    if h.rule == "kv_nonpositive":
        sglang = _engine_of(h) == "sglang"
        value = next(v for v in g if v is not None)
        return (
            f"{'SGLang' if sglang else 'The engine'}'s KV-cache capacity came out at {value}"
            f"{' GiB' if 'GiB' in h.line.text else ' tokens'}: nothing is left for the cache after the weights",
            "--mem-fraction-static" if sglang else "gpu_memory_utilization",
            "The engine sizes its KV cache from what its memory budget leaves after the weights and the "
            "profiled activations; here that is zero or negative: the weights (per GPU) take the whole budget, "
            "so no request can be served. More GPUs per copy of the weights (tensor parallelism), a larger "
            "budget, or a smaller model / quantised weights leave room for the cache.",
            (
                [
                    Fix(None, None, "raise it: a larger static pool for weights + KV cache",
                        key="--mem-fraction-static", framework="sglang"),
                    advice("spread the weights over more GPUs (--tp-size) or serve quantised weights"),
                ]
                if sglang
                else [_RAISE, _TRAINER_OFF, advice("spread the weights over more GPUs (tensor parallelism)")]
            ),
        )  # fmt: skip
    if h.rule == "kv_sglang":
        return (
            "SGLang: no memory left for the KV-cache pool",
            "--mem-fraction-static",
            "SGLang's static pool (mem_fraction_static x GPU memory) must hold the weights and the KV cache; "
            "after the weights nothing was left for the cache. Raising the fraction gives the pool more (and "
            "leaves less for activations); a shorter context needs less.",
            [_RAISE, _LOWER_LEN],
        )
    if h.rule == "kv_tgi":
        n, what_tokens = g
        flag = "--max-batch-prefill-tokens" if what_tokens == "prefill" else "--max-batch-total-tokens"
        return (
            f"TGI: not enough GPU memory for {n} {what_tokens} tokens at warm-up",
            flag,
            "Text Generation Inference warms up with its largest configured batch; the memory left after the weights "
            "does not hold it (activations and KV cache of that many tokens).",
            [advice(f"decrease {flag} (and --max-total-tokens / --max-input-tokens with it), or give each shard more "
                    "memory: more shards (--num-shard), quantised weights (--quantize)")],
        )  # fmt: skip
    return _kv_max_len_title(h), "max_model_len", _MAX_LEN_WHAT, [_LOWER_LEN, _RAISE]


def _engine_of(h: Hit) -> str:
    """The engine a KV-cache line comes from: SGLang's wording (``profiled value``, ``KV Cache is
    allocated``) or its scheduler's ``[... TP0]`` prefix, else vLLM."""
    text = h.line.text
    return "sglang" if "profiled value" in text or "KV Cache is allocated" in text else "vllm"


def _kv_cause(h: Hit, facts: LogFacts, ctx: LogContext) -> Cause:
    title, where, what, remedies = _kv_reading(h)
    if h.rule not in ("kv_sglang", "kv_tgi") and not where.startswith(
        "--"
    ):  # the engine whose key it is (vLLM's messages)
        where = f"{'sglang' if _engine_of(h) == 'sglang' else 'vllm'} {where}"
    pl = place(facts, h.line)
    ev = [quote(h.fields["blocks_line"])] if "blocks_line" in h.fields else []
    ev.append(quote(h.line))
    if h.rule == "kv_max_len_inferred":
        ev.append("vLLM raises on initialize_cache with blocks > 0 only when max_model_len exceeds the cache")
    return Cause(
        "error",
        "oom_kv_cache",
        title,
        what,
        evidence=ev + pl.evidence(),
        fixes=fixes(ctx, *remedies),
        where=where,
        phase=pl.phase or "init",
        rank=pl.rank,
        line=h.no,
        score=44.0,
    )


def _killed_actor(facts: LogFacts) -> str | None:
    """The class of the Ray actor whose worker the monitor killed, as its death message prints it
    (``class_name: monitor_memory_usage.<locals>.MemoryMonitorActor``) (logsg branch)."""
    cls = _dead_actor(facts).get("class_name")
    return f"actor {cls.rsplit('.', 1)[-1]}" if cls else None
