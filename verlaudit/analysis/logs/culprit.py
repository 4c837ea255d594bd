"""The culprit of a pasted log's first cause, resolved from the whole log: the families name what the failing
line says; this names what a maintainer would blame from everything else the log shows. Candidates come from
the traceback around the cause (the innermost frame of the user's code or of a training framework, with its
file, and the Ray task it ran in), from the lines of the log (a failing pytest node, the DeepSpeed logger
site of a loss-scale message, the other processes an OOM message lists on the GPU) and from a per-framework
table of which setting bounds which failure in which phase (``GOVERNING``, read with the settings the log
prints for their current value). ``resolve`` names the best-supported candidates in the cause's ``where``
(after what the family already said: nothing is taken away) and adds the fix that turns the same key, with a
direction and the value the log shows; where nothing supports a key it names none. Only the first cause of a
diagnosis is resolved (`verlaudit.analysis.diagnose.diagnosis.diagnose_log`); the kinds and their order are
the families'. Exercised by ``pytest tests/test_log_culprit.py``.
"""

from __future__ import annotations

import dataclasses
import re

from verlaudit.analysis.causes import Cause, Fix
from verlaudit.analysis.logs.frameworks import _SPELLING, LogContext
from verlaudit.analysis.logs.lines import _CHECKOUT, _PACKAGE, Frame, LogLine
from verlaudit.analysis.logs.scan import _HANDOFFS, _WRAPPERS, Hit, LogFacts, Traceback

# the packages whose frames are the training side of a run (the trainer, its model code, its optimizer and
# sharding wrappers): the innermost such frame is where the run's own code met the failure. Kernels, engines,
# torch itself and Ray are where it surfaced, not what a maintainer blames.
TRAINING_SIDE = frozenset(
    {
        "verl",
        "trl",
        "openrlhf",
        "nemo_rl",
        "slime",
        "areal",
        "realhf",
        "roll",
        "ROLL",
        "deepspeed",
        "megatron",
        "transformers",
        "accelerate",
        "peft",
        "torchtune",
        "llamafactory",
    }
)
# kinds whose families already name their own culprit from the message (a rank, a library and its version, a
# request limit, a metric): their frames add nothing a maintainer would blame
_BY_MESSAGE = frozenset(
    {
        "nccl_timeout",
        "nccl_error",
        "killed",
        "ray_actor_died",
        "oom_host",
        "oom_kv_cache",
        "engine_limit",
        "mismatch",
        "nonfinite",
        "collapse",
        "import_error",
        "version_mismatch",
        "loss_scale_collapse",
        "overflow_skips",
    }
)
# kinds whose families name the call where it failed (the engine's weight-load call, the unscale site): the
# frame they name only gains its file
_FILE_ONLY = frozenset({"weight_sync", "engine_feature", "unscale_fp16"})

# Which setting bounds a GPU OOM in which phase: the memory a phase needs grows with the micro-batch that phase
# runs (the remedy names of `frameworks._SPELLING`, spelled there per framework). Sources:
# - verl: docs/examples/config.rst (ppo_micro_batch_size_per_gpu bounds the actor update's forward/backward,
#   log_prob_micro_batch_size_per_gpu the rollout's and the reference's log-prob passes; gpu_memory_utilization
#   the share vLLM takes for weights and KV cache) and docs/perf/perf_tuning.rst;
# - TRL: docs/source/reducing_memory_usage.md (per_device_train_batch_size, gradient checkpointing) and the
#   GRPOConfig reference (vllm_gpu_memory_utilization in colocate mode);
# - OpenRLHF: README "Performance tuning" (--micro_train_batch_size, --micro_rollout_batch_size,
#   --vllm_gpu_memory_utilization);
# - NeMo-RL: docs/design-docs/training-backends.md and the GRPO recipes (policy.train_micro_batch_size,
#   policy.logprob_batch_size, policy.generation.vllm_cfg.gpu_memory_utilization);
# - DeepSpeed: docs/_pages/config-json.md (train_micro_batch_size_per_gpu);
# - HF Trainer / accelerate: the TrainingArguments reference (per_device_train_batch_size).
GOVERNING: dict[str, str] = {
    "update": "train_micro_batch",
    "logprob": "logprob_micro_batch",
    "reference": "ref_logprob_micro_batch",
    "generate": "rollout_memory",
}
_DIRECTION = {"rollout_memory": "lower"}  # every micro-batch: lower; the engine's share of the GPU: lower too
_PHASE_WORDS = {
    "update": "the training update",
    "logprob": "the log-prob pass",
    "reference": "the reference log-prob pass",
    "generate": "the rollout engine",
}

_PYTEST = re.compile(r"^\s*(?:FAILED|ERROR)\s+(?P<node>[\w./-]+\.py::[\w:\[\].-]+)")
_DS_SITE = re.compile(r"\[(?P<file>\w+\.py):(?P<ln>\d+):(?P<func>\w+)\]")
_LOSS_SCALE = re.compile(r"OVERFLOW|loss[ _]scale", re.I)
_RAY_TASK = re.compile(r"\bray::(?P<cls>[A-Z]\w*)\.(?P<meth>\w+)\(")
_PROCESS = re.compile(r"Process (\d+) has ([\d.]+) ?([KMG])i?B memory in use")
_UNIT = {"K": 1 / (1 << 20), "M": 1 / 1024, "G": 1.0}


def detect(line: LogLine) -> list[Hit]:
    """The lines that name a culprit in passing: a failing pytest node, the DeepSpeed logger site of a
    loss-scale message, a Ray task header (``ray::Worker.method()``)."""
    text = line.text
    out: list[Hit] = []
    if (m := _PYTEST.match(text)) and " - " in text:
        out.append(Hit("pytest_node", line, {"node": m["node"]}))
    if "[" in text and _LOSS_SCALE.search(text) and (m := _DS_SITE.search(text)):
        out.append(Hit("ds_site", line, {"file": m["file"], "ln": int(m["ln"]), "func": m["func"]}))
    if "ray::" in text and (m := _RAY_TASK.search(text)):
        out.append(Hit("ray_task_line", line, {"task": f"{m['cls']}.{m['meth']}"}))
    return out


def package_of(path: str) -> str | None:
    """The package a frame's file belongs to: the installed one, else the innermost known checkout in the path
    (``/tmp/ray/session_x/working_dir_files/nemo_rl/...`` is nemo_rl, not ray)."""
    if m := _PACKAGE.search(path):
        return m[1]
    found = [m[1] for m in _CHECKOUT.finditer(path.replace("\\", "/"))]
    return found[-1] if found else None


def _rel(f: Frame) -> str:
    """A frame's file from its package root (``verl/workers/fsdp_workers.py``), else its last two parts."""
    path = f.path.replace("\\", "/")
    pkg = package_of(path)
    if pkg and (i := path.rfind(f"/{pkg}/")) >= 0:
        return path[i + 1 :]
    return "/".join(path.split("/")[-2:])


def site_frame(tb: Traceback | None) -> Frame | None:
    """The innermost frame of the user's own code or of a training framework (``TRAINING_SIDE``), passing over
    generic wrappers and Ray hand-offs: where the run's code met the failure."""
    for f in reversed(tb.frames if tb else []):
        if f.func in _WRAPPERS or f.call() in _HANDOFFS or f.path.startswith("<"):
            continue
        pkg = package_of(f.path)
        if (pkg is None and not f.library) or pkg in TRAINING_SIDE:
            return f
    return None


def _site(f: Frame) -> str:
    return f"{f.where()} ({_rel(f)}:{f.lineno})"


def _named(where: str | None, piece: str) -> bool:
    return bool(where) and piece.lower() in where.lower()


def _join(where: str | None, extra: str) -> str:
    return f"{where}; {extra}" if where else extra


def _frames(c: Cause, facts: LogFacts) -> None:
    tb = facts.traceback_near(c.line, c.rank) if c.line is not None else None
    f = site_frame(tb)
    own = f is not None and package_of(f.path) is None
    # an unsupported dtype is blamed on the user's call that passed it, not on a framework's own check
    if (
        f is not None
        and not (c.kind == "dtype_unsupported" and not own)
        and not (c.kind in _FILE_ONLY and own)
    ):
        file = _rel(f).rsplit("/", 1)[-1]
        w = f.where()
        if c.where is None:
            c.where = _site(f)
        elif not _named(c.where, file) and not (own and w in c.where):  # the user's frame, already named
            if w in c.where:
                c.where = c.where.replace(w, _site(f), 1)
            elif c.kind not in _FILE_ONLY:
                c.where = _join(c.where, f"at {_site(f)}")
    # the Ray task the failing process ran (its header line sits just above or below the frames)
    if tb is None and c.line is None:  # a cause read from the metrics has no line to look around
        return
    lo, hi = (tb.start - 3, tb.end + 3) if tb else (c.line - 3, c.line + 3)  # type: ignore[operator]
    task = next((h.fields["task"] for h in facts.of("ray_task_line") if lo <= h.no <= hi), None)
    if task and not _named(c.where, task) and not task.startswith("WorkerDict."):
        c.where = _join(c.where, f"in the Ray task {task}")


def _processes(c: Cause) -> None:
    """The processes an OOM message lists on the GPU, largest first: where the message also marks this process,
    the listed ones are other jobs or tests holding it; where it marks none (a container's own pid is not the
    host's), they hold the GPU and one of them may be this job."""
    text = " ".join(c.evidence[:2])
    procs: dict[str, float] = {}
    for pid, num, unit in _PROCESS.findall(text):
        procs.setdefault(pid, float(num) * _UNIT[unit])
    marked = "this process has" in text
    if not procs or (not marked and len(procs) < 2):
        return
    top = sorted(procs.items(), key=lambda kv: -kv[1])
    said = ", ".join(f"process {pid} ({gib:.3g} GiB)" for pid, gib in top[:3])
    pid = top[0][0]
    if marked:
        c.where = _join(c.where, f"GPU shared with {said}")
        why = f"check what process {pid} is (nvidia-smi, ps -p {pid}): stop it or run this job on a GPU it does not hold"
    else:
        c.where = _join(c.where, f"GPU held by {said} (the message marks none as this job's own)")
        why = f"check which of the processes on the GPU are this job's (nvidia-smi; process {pid} holds the most)"
    c.fixes.append(
        Fix(None, None, f"{why} (CUDA_VISIBLE_DEVICES), or run the tests / jobs that share it one at a time")
    )


def _spelled(remedy: str, ctx: LogContext) -> str | None:
    """The key of ``remedy`` in the log's framework (``_SPELLING``), without the alternatives in parentheses."""
    fw = ctx.framework
    name = _SPELLING.get(remedy, {}).get(fw or "")
    return re.sub(r"\s*\(.*$", "", name).strip() if name else None


def _governing(c: Cause, ctx: LogContext) -> None:
    """A GPU OOM in a known phase of a known framework: the setting that bounds that phase's memory, its value
    where the log prints it, and the fix that lowers it."""
    if c.phase is None:
        _unknown_phase(c, ctx)
        return
    remedy = GOVERNING.get(c.phase)
    key = _spelled(remedy, ctx) if remedy else None
    if not key or _named(c.where, key.rsplit(".", 1)[-1]):
        return
    leaf = key.rsplit(".", 1)[-1].lstrip("-").split("=")[0]
    value = ctx.setting(key.lstrip("-"), leaf)
    shown = f" = {value} in the log" if value is not None else ""
    c.where = _join(c.where, f"{key}{shown}, which bounds {_PHASE_WORDS[c.phase or '']}'s memory")
    direction = _DIRECTION.get(remedy or "", "lower")
    to = ""
    if value is not None and value.strip().isdigit() and int(value) > 1:
        to = f" from {value} to {max(1, int(value) // 2)}"
    why = f"{direction} {key}{to}: it bounds the memory of {_PHASE_WORDS[c.phase or '']}, where it ran out"
    for i, f in enumerate(c.fixes):  # the family's fix that turns this key already: give it the log's value
        if key in f"{f.verl or ''} {f.key or ''}":
            if to:
                c.fixes[i] = dataclasses.replace(
                    f, why=f"{f.why} ({direction} it{to}: the log shows {value})"
                )
            return
    fix = (
        Fix(None, key, why)
        if ctx.framework == "verl"
        else Fix(None, None, why, key=key, framework=ctx.framework)
    )
    c.fixes.append(fix)


def _unknown_phase(c: Cause, ctx: LogContext) -> None:
    """A GPU OOM of a known training framework whose phase the log does not show: the micro-batches that bound a
    training step's memory (the update's and the log-prob pass's), named as what to check, not as the cause."""
    keys = list(
        dict.fromkeys(k for r in ("train_micro_batch", "logprob_micro_batch") if (k := _spelled(r, ctx)))
    )
    if not keys or any(_named(c.where, k.rsplit(".", 1)[-1]) for k in keys):
        return
    shown = []
    for k in keys:
        v = ctx.setting(k.lstrip("-"), k.rsplit(".", 1)[-1].lstrip("-"))
        shown.append(f"{k} = {v}" if v is not None else k)
    verb = "bounds" if len(keys) == 1 else "bound"
    c.where = _join(c.where, f"phase not shown: {' and '.join(shown)} {verb} a step's memory")
    said = " ".join(f"{f.verl or ''} {f.key or ''}" for f in c.fixes)
    if all(k in said for k in keys):  # the family's fixes turn them already
        return
    why = (f"lower {' and '.join(keys)}: the log does not show which pass ran out; the update's and the log-prob "
           "pass's micro-batches bound a step's memory")  # fmt: skip
    key = " / ".join(keys)
    fw = ctx.framework
    c.fixes.append(Fix(None, key, why) if fw == "verl" else Fix(None, None, why, key=key, framework=fw))


def _pytest(c: Cause, facts: LogFacts) -> None:
    node = next((h.fields["node"] for h in facts.of("pytest_node") if h.no == c.line), None)
    if node and not _named(c.where, node):
        c.where = _join(c.where, f"in the test {node}")


# DeepSpeed's fp16 block (docs/_pages/config-json.md, "FP16 training options"): the dynamic loss scale starts at
# 2**initial_scale_power, halves on an overflow (after `hysteresis` overflows), doubles after loss_scale_window
# clean steps, and never drops below min_loss_scale
_FP16_KEYS = "fp16.initial_scale_power, fp16.loss_scale_window, fp16.hysteresis, fp16.min_loss_scale"


def _loss_scale(c: Cause, facts: LogFacts) -> None:
    h = facts.first("ds_site")
    if h is None or _named(c.where, "fp16."):  # the family named the setting already
        return
    site = f"{h.fields['file']}:{h.fields['ln']} {h.fields['func']}"
    stage = re.fullmatch(r"stage_?(\d)\.py", h.fields["file"])
    owner = f"DeepSpeed's ZeRO stage {stage[1]} optimizer" if stage else "DeepSpeed's fp16 optimizer"
    if not _named(c.where, h.fields["file"]):
        c.where = _join(c.where, f"fp16 dynamic loss scale of {owner} ({site}; config {_FP16_KEYS})")
    c.fixes.append(
        Fix(None, None, "a scale that keeps halving to its floor means the gradients overflow at every scale: lower "
            "the learning rate (the DeepSpeed optimizer block's lr, or the launcher's learning_rate / --lr) and resume "
            "from the last checkpoint before the collapse; if it still collapses, resume in bf16 or fp32 "
            "(fp16.enabled=false)", key="fp16.min_loss_scale / optimizer.params.lr", framework="deepspeed")
    )  # fmt: skip


_OFFLOAD_KEY = re.compile(r"offload", re.I)
_ON = frozenset({"true", "1", "yes", "cpu", "nvme"})
_TWO_DEVICES = re.compile(r"\bcpu\b.*\bcuda|\bcuda.*\bcpu\b", re.I | re.S)


def _offload(c: Cause, facts: LogFacts, ctx: LogContext) -> None:
    """Tensors on cpu and cuda in one op where the log turns an offload on: the offloaded state (parameters or
    optimizer state moved to the CPU between steps, `frameworks._SPELLING`'s param / optimizer offload keys) met
    the GPU tensors of a pass that ran before it was moved back. Where the log prints no offload setting but the
    op is the optimizer's step, the optimizer-offload option is named as what to check."""
    if not _TWO_DEVICES.search(f"{c.title} {' '.join(c.evidence[:1])}"):
        return
    on = [(k, v) for k, v in ctx.settings.items() if _OFFLOAD_KEY.search(k) and v.strip().lower() in _ON]
    if on:
        k, v = sorted(on, key=lambda kv: "optim" not in kv[0].lower())[0]  # an optimizer offload first
        if not _named(c.where, k):
            c.where = _join(
                c.where, f"{k} = {v} in the log: offloaded state on the cpu meets the GPU tensors"
            )
        why = (f"set {k} off (false / none), or move the offloaded state back to the GPU before this pass (the "
               "framework's load / prepare hook) and offload again after it")  # fmt: skip
        c.fixes.append(
            Fix(None, k, why)
            if ctx.framework == "verl"
            else Fix(None, None, why, key=k, framework=ctx.framework)
        )
        return
    tb = facts.traceback_near(c.line, c.rank) if c.line is not None else None
    optim = next(
        (f for f in reversed(tb.frames if tb else []) if "/torch/optim/" in f.path.replace("\\", "/")), None
    )
    if optim is None:
        return
    c.where = _join(c.where, f"optimizer step ({_rel(optim)}:{optim.lineno} {optim.func})")
    key = _spelled("optimizer_offload", ctx)
    check = f" ({key})" if key else ""
    c.fixes.append(
        Fix(None, None, f"check the optimizer-offload option{check}: optimizer state kept on the cpu while the "
            "parameters and gradients are on cuda makes the step mix devices; keep the state with the parameters")
    )  # fmt: skip


def resolve(c: Cause, facts: LogFacts, ctx: LogContext) -> Cause:
    """Names in ``c.where`` (after what its family said) the culprit candidates the whole log supports, and adds
    the fixes that go with them. Returns ``c``."""
    if c.severity != "error":
        return c
    if c.kind not in _BY_MESSAGE:
        _frames(c, facts)
    if c.kind in ("device_mismatch", "exception", "cuda_error"):
        _offload(c, facts, ctx)
    if c.kind == "oom":
        _governing(c, ctx)
        _processes(c)
    if c.line is not None:
        _pytest(c, facts)
    if c.kind in ("loss_scale_collapse", "overflow_skips"):
        _loss_scale(c, facts)
    return c
