"""Inference-engine and hardware-support failures: bf16 refused on a GPU below compute capability 8.0
(vLLM's ``Bfloat16 is only supported on GPUs with compute capability of at least 8.0``, the HF
Trainer's and accelerate's bf16 checks, PyTorch's), the engines' own runtime errors (SGLang's
``Scheduler hit an exception``, ``alloc_req_slots runs out of memory``; vLLM's ``Error executing
method``, a dead engine core), and weight sync from the trainer into the engine failing on a name,
a shape or a dtype (``KeyError`` in ``load_weights``, ``There is no module or parameter named``,
``Worker failed to update weights``). Exercised by ``pytest tests/test_log_rules.py -k engines``.
"""

from __future__ import annotations

import re

from verlaudit.analysis.causes import Cause
from verlaudit.analysis.logs.frameworks import LogContext, advice, fixes
from verlaudit.analysis.logs.lines import LogLine, hints
from verlaudit.analysis.logs.phases import phase_of_name
from verlaudit.analysis.logs.scan import Hit, LogFacts, place, quote, site

_RULES = [
    ("bf16_unsupported", re.compile(
        # the GPU sentence is optional: vLLM's message spans lines when printed as a raised ValueError
        r"Bfloat16 is only supported on GPUs with compute capability of at least 8\.0\.(?:\s*Your (.+?) GPU "
        r"(?:has compute capability ([\d.]+?)\.?(?:\s|$)|does not have a compute capability))?"
        r"|Your setup doesn't support bf16/(?:gpu|cpu)|bf16 mixed precision requires PyTorch >= [\d.]+ and "
        r"a supported "
        r"device|Current CUDA Device does not support bfloat16|type bf16 not supported in this "
        r"architecture")),
    # a kernel or library refusing this GPU's generation: FlashAttention-2 below Ampere, a bf16 GEMM cuBLAS has no
    # kernel for, a wheel built without kernels for this architecture
    ("gpu_too_old", re.compile(
        r"(FlashAttention(?:-?2)? only supports Ampere GPUs or newer)"
        r"|(CUBLAS_STATUS_NOT_SUPPORTED when calling `?cublas\w*\(.*CUDA_R_16BF)"
        r"|(no kernel image is available for execution on the device"
        r"|CUDA capability sm_(\d+) is not compatible with the current PyTorch installation)")),
    ("gpu_name", re.compile(r"\b(Tesla V100|V100|T4|Tesla P100|P40|RTX 20\d0|Quadro RTX \d+|TITAN V)\b")),
    ("engine_method_error", re.compile(r"Error executing method '?(\w+)'?\. This might cause deadlock")),
    ("engine_error", re.compile(
        r"Scheduler hit an exception|TpModelWorkerClient hit an exception|EngineCore encountered a fatal "
        r"error|"
        r"\bEngineDeadError\b|AsyncEngineDeadError|Engine core initialization failed|WorkerProc hit an "
        r"exception")),
    # an engine's worker process that ended under it: vLLM V1's multiproc executor ("Worker proc VllmWorker-1 died
    # unexpectedly, shutting down executor"), V0's ("Worker VllmWorkerProcess pid 77 died, exit code: -15",
    # "got fatal signal from worker processes"), SGLang's parent ("Received sigquit from a child proces[s]. It
    # usually means the child failed.", "Child process unexpectedly failed with an exit code 1")
    ("engine_worker_died", re.compile(
        r"Worker proc (\S+) died unexpectedly|Worker (VllmWorkerProcess) pid \d+ died, exit code: (-?\d+)"
        r"|got fatal signal from worker processes|Received sigquit from a child proces"
        r"|Child process unexpectedly failed with an exit code (-?\d+)")),
    ("sglang_req_slots", re.compile(r"alloc_req_slots runs out of memory")),
    ("sglang_oom", re.compile(r"(Prefill|Decode) out of memory\b")),
    ("weight_sync_name", re.compile(r"There is no module or parameter named '([^']+)' in (\w+)")),
    # (and a sentence saying a weight update / sync / refit into the engine failed, in any trainer's words: NeMo-RL's
    # "Updating weights for the generation policy failed during refit", "Failed to update weights", "weight sync
    # failed", "refit failed")
    ("weight_sync_failed", re.compile(r"Error in ([\w.]*update_weights\w*): (.+)|Worker failed to update "
                                      r"weights"
                                      r"|(?i:\b(?:updat|sync|synchroni[sz]|refit|broadcast|push)\w*\s+(?:the\s+)?(?:model\s+|policy\s+)?"
                                      r"(?:weights?|parameters|params)\b[^.\n]{0,60}?\bfail(?:ed|ure)\b"
                                      r"|\bfail(?:ed|ure)\s+(?:to\s+|in\s+|while\s+|during\s+)?(?:update|sync|synchroni[sz]|"
                                      r"refit|broadcast|push)\w*\s+(?:the\s+)?(?:model\s+|policy\s+)?(?:weights?|parameters?|params)\b"
                                      r"|\b(?:weights?|parameter) (?:update|sync|synchroni[sz]ation|refit|broadcast) failed"
                                      # SGLang's update_weights_from_distributed after a failed copy
                                      r"|weights of the \w+ are partially updated"
                                      # a load or update that moved nothing: "Loaded 0 of 291 tensors", "updated 0
                                      # parameters" (logs13 branch)
                                      r"|(?i:\b(?:loaded|updated|received|synced|copied|broadcast)\s+0\s+(?:of\s+[1-9]\d*\s+)?"
                                      r"(?:tensors|parameters|params|weights|shards)\b)"
                                      r"|\brefit failed|\bfailed during refit)")),
    # vLLM's warning when its model code runs outside `set_current_vllm_config` (a trainer's refit calling the model's
    # process_weights_after_loading / load_weights by hand): the layers then read a default config
    ("vllm_config_unset", re.compile(r"Current vLLM config is not set")),
    # a parameter a weight load names beside a shape: a debug print's "Weight name X", PyTorch's "size
    # mismatch for X: copying a param with shape ...", a loader's "param X ... shape"
    # an engine's weight loader refusing a tensor's layout for a live parameter, in its own words (vLLM's fused-MoE
    # loader: "shard_dim=0 is not a valid data dimension for a 3D tensor"; its default loader: "Attempted to load
    # weight (torch.Size([..])) into parameter (torch.Size([..]))")
    # a line naming a weight-update call the trainer makes into the engine (a request to its endpoint, a log of
    # the call): an engine failure right after it failed that sync (logsg branch)
    ("weight_update_call", re.compile(r"\b((?:update|sync|broadcast|send|push)_\w*?(?:weights?|params?|parameters)"
                                      r"(?:_\w+)?)\b")),
    ("loader_layout", re.compile(r"shard_dim=\d+ is not a valid data dimension for a \d+D tensor"
                                 r"|Attempted to load weight \(torch\.Size\(\[[\d, ]*\]\)\) into parameter")),
    ("weight_named", re.compile(r"\bWeight name:? '?(?P<n>[\w.]+\w)'?|size mismatch for (?P<m>[\w.]+\w): copying a "
                                r"param with shape|\bparam(?:eter)? '?(?P<p>[\w.]+\.\w*(?:weight|bias))'? (?:has )?"
                                r"(?:shape|size)")),
]  # fmt: skip
_KEYS = (
    "Ampere",
    "no kernel image",
    "CUBLAS_STATUS_NOT_SUPPORTED",
    "is not compatible with the current PyTorch",
    "f16",
    "bf16",
    "Bfloat16",
    "bfloat16",
    "V100",
    "T4",
    "P100",
    "P40",
    "RTX",
    "TITAN",
    "Error executing method",
    "hit an exception",
    "Engine",
    "died",
    "sigquit",
    "fatal signal",
    "Child process",
    "alloc_req_slots",
    "out of memory",
    "no module or parameter",
    "update weights",
    "update_weights",
    "Weight name",
    "_weight",
    "_param",
    "size mismatch for",
    "weights",
    "weight sync",
    "weight update",
    "parameter sync",
    "parameter update",
    "refit",
    "Refit",
    "vLLM config",
    "shard_dim",
    "Attempted to load weight",
    "param",
    "tensors",
    "weights",
    "shards",
)
# frames of the trainer -> engine weight copy (verl's sharding managers, TRL, OpenRLHF, NeMo-RL,
# vLLM's loaders)
_SYNC = re.compile(
    r"load_weights|weight_loader|update_params|update_weights|sync_weights|broadcast_to_vllm|"
    r"update_named_param|_move_model_to_vllm|refit|sharding_manager"
)
# an engine's per-layer loaders (vLLM's FusedMoE._load_w13 / _load_w2, _load_model_weight_or_group_weight_scale)
# and the argument every vLLM / SGLang weight_loader takes, the tensor the loader narrows into its shard: a
# failure there is the load's (a sync's unless the frames show the engine's first load of its checkpoint)
_LOADER = re.compile(r"_load_w\d+\b|_load_\w*weight|\bloaded_weight\b")


_HAS = hints(*_KEYS)


# a setting assigned a bf16 value, in the syntax the log wrote it: `mixed_precision = "bf16"`, `--dtype bfloat16`,
# `dtype=torch.bfloat16` (an engine's config dump), `torch_dtype: bf16`: the fix repeats it with fp16
_BF16_ASSIGN = re.compile(
    r"(?<![\w.-])(?:--[a-z][\w-]*[ =]|[A-Za-z_][\w.]*\s*[:=]\s*)([\"']?)(?:torch\.)?(?:bf16|bfloat16)\1(?![\w-])"
)
_ASSIGN_ORDER = ("mixed_precision", "dtype", "precision")


def detect(line: LogLine) -> list[Hit]:
    """Engine and hardware-support messages in one line."""
    text = line.text
    if not _HAS(text):
        return []
    out = []
    for m in list(_BF16_ASSIGN.finditer(text))[:2]:
        out.append(Hit("bf16_assign", line, {"text": m[0]}))
    for rule, pat in _RULES:
        m = pat.search(text)
        if m:
            fields = {"groups": m.groups()}
            if rule == "engine_method_error":
                fields["method"] = m[1]
            if rule == "engine_worker_died":
                fields["method"] = m[1] or m[2]
            if (
                rule == "weight_sync_failed"
                and m[1] is None
                and re.search(r"\bretr(?:y|ying|ied)\b", text, re.I)
            ):
                continue  # "weight update failed, retrying": a retry is not the failure (its last attempt would say so)
            # a GPU sentence the line lacks may follow on the next line
            want = 1 if rule == "bf16_unsupported" and m.lastindex is None else 0
            out.append(Hit(rule, line, fields, want=want))
    return out


def explain(facts: LogFacts, ctx: LogContext) -> list[Cause]:
    """bf16 on an old GPU, engine runtime errors, weight-sync failures."""
    return [
        c
        for c in (_bf16(facts, ctx), _too_old(facts, ctx), _weight_sync(facts, ctx), _engine(facts, ctx))
        if c
    ]


def _too_old(facts: LogFacts, ctx: LogContext) -> Cause | None:
    """A kernel the GPU's generation lacks: FlashAttention-2 (Ampere and newer), cuBLAS's bf16 GEMM (a bf16
    dtype problem: the bf16 reading's fixes), a build without this architecture's kernels."""
    h = facts.first("gpu_too_old")
    if h is None or facts.first("bf16_unsupported"):
        return None
    flash, gemm, build, sm = h.fields["groups"]
    gpu = facts.first("gpu_name")
    on = f" ({gpu.fields['groups'][0]})" if gpu else ""
    pl = place(facts, h.line)
    if flash or gemm:
        title = (
            f"FlashAttention-2 needs an Ampere-or-newer GPU{on}"
            if flash
            else f"cuBLAS has no bf16 GEMM for this GPU{on}: bf16 needs compute capability >= 8.0"
        )
        fx = fixes(
            ctx,
            *(_fp16_as_written(facts) if gemm else []),
            advice("load the model with attn_implementation='sdpa' (or 'eager') instead of 'flash_attention_2', or "
                   "uninstall flash-attn so the framework falls back") if flash else None,
            ("fp16_instead_of_bf16", "fp16 instead of bf16 on this GPU", "precision.preset: fp16") if gemm else None,
        )  # fmt: skip
        what = ("The kernel the run asked for does not exist for this GPU generation (pre-Ampere: V100, T4, RTX 20xx): "
                "the setting must change, not the code.")  # fmt: skip
        kind, where = (
            "dtype_unsupported",
            "flash_attention_2 (attn_implementation)" if flash else "bf16 GEMM (cuBLAS)",
        )
    else:
        title = (
            "CUDA: no kernel image for this GPU"
            + (f" (sm_{sm})" if sm else on)
            + ": a build without its architecture"
        )
        fx = fixes(
            ctx,
            advice(
                "install a torch (and compiled extensions: flash-attn, vLLM, apex) built for this GPU's architecture and "
                "CUDA version (the matching wheel; from source: TORCH_CUDA_ARCH_LIST with its compute capability)"
            ),
        )
        what = ("The installed binaries carry no kernels for this GPU's compute capability: a wheel built for other "
                "architectures (or a too-new torch for an old GPU).")  # fmt: skip
        kind, where = "cuda_error", f"sm_{sm}" if sm else (site(pl.tb) or "the installed CUDA binaries")
    return Cause("error", kind, title, what, evidence=[quote(h.line)] + pl.evidence(), fixes=fx, where=where,
                 phase=pl.phase or "init", rank=pl.rank, line=h.no, score=40.0)  # fmt: skip


_NEXT_GPU = re.compile(r"^\s*Your (.+?) GPU has compute capability ([\d.]+?)\.?(?:\s|$)")


def _bf16(facts: LogFacts, ctx: LogContext) -> Cause | None:
    h = facts.first("bf16_unsupported")
    if h is None:
        return None
    g = h.fields["groups"]
    nxt = _NEXT_GPU.search(" ".join(h.follow)) if h.follow and g[0] is None else None
    gpu = g[0] or (nxt[1] if nxt else None)
    gpu = gpu or (facts.first("gpu_name").fields["groups"][0] if facts.first("gpu_name") else None)
    cc = g[1] or (nxt[2] if nxt else None)
    title = (
        "bf16 is not supported on this GPU"
        + (f": {gpu}" if gpu else "")
        + (f" has compute capability {cc} (bf16 needs >= 8.0)" if cc else "")
    )
    pl = place(facts, h.line)
    what = (
        "bf16 needs an Ampere-or-newer GPU (compute capability >= 8.0); this one is older, so the framework "
        "refuses the bf16 setting. Use fp16 (with loss scaling in training) or fp32."
    )
    fx = fixes(
        ctx,
        *_fp16_as_written(facts),
        ("fp16_instead_of_bf16", "fp16 instead of bf16 on this GPU", "precision.preset: fp16"),
        advice(
            'a DeepSpeed config with "bf16": {"enabled": "auto"} follows the trainer\'s bf16 / fp16 '
            "arguments: change those, not only the JSON"
        )
        if ctx.shows("deepspeed") or ctx.framework in ("hf-trainer", "trl")
        else None,
    )
    return Cause(
        "error",
        "dtype_unsupported",
        title,
        what,
        evidence=[quote(h.line)] + pl.evidence(),
        fixes=fx,
        where=(f"compute capability {cc}" if cc else "bf16")
        + (f" ({at})" if (at := site(pl.tb)) else "")
        + (f", asked by {asked}" if (asked := _bf16_setting(ctx)) else ""),
        phase=pl.phase or "init",
        rank=pl.rank,
        line=h.no,
        score=45.0,
        data={"gpu": gpu, "compute_capability": cc},
    )


def _fp16_as_written(facts: LogFacts) -> list:
    """The log's own bf16 assignments (the causing key first: mixed_precision, then a dtype), rewritten with
    fp16 in the same syntax."""
    seen = {h.fields["text"]: h for h in facts.of("bf16_assign")}

    def rank(text: str) -> int:
        key = re.split(r"[\s:=]", text.lstrip("-"), maxsplit=1)[0].lower()
        return (
            next((i for i, k in enumerate(_ASSIGN_ORDER) if k in key), len(_ASSIGN_ORDER))
            + ("save" in key) * 9
        )

    out = []
    for text in sorted(seen, key=rank)[:2]:
        new = re.sub(r"bfloat16|bf16", lambda m: "float16" if m[0] == "bfloat16" else "fp16", text)
        out.append(advice(f"{new} where the log sets {text} (line {seen[text].no}): this GPU has no bf16"))
    return out


# the trainer's update call into the engine (a plain model load at start-up runs load_weights too)
_UPDATE = re.compile(
    r"update_params|update_weights?\w*|sync_weights|broadcast_to_vllm|update_named_param|_move_model_to_vllm|refit"
    r"|sharding_manager|load_weights_from_\w+"
)


def update_frames(tb) -> bool:
    """Whether a traceback runs the trainer's weight update into the engine (not a start-up model load)."""
    return bool(tb and tb.frames) and bool(
        _UPDATE.search(" ".join(f"{f.func} {f.code or ''}" for f in tb.frames))
    )


# the setting that asks each framework for bf16 (where the log prints none of its own)
_BF16_SETTING = {
    "accelerate": "mixed_precision=bf16",
    "hf-trainer": "TrainingArguments.bf16=True",
    "trl": "TrainingArguments.bf16=True",
    "deepspeed": "bf16.enabled=true",
    "vllm": "dtype (auto takes the model config's bfloat16)",
    "sglang": "--dtype (auto takes the model config's bfloat16)",
}


def _bf16_setting(ctx: LogContext) -> str | None:
    """The setting that asked for bf16: one the log printed with a bf16 value, else the framework's own."""
    for key, value in ctx.settings.items():
        leaf = key.rsplit(".", 1)[-1]
        if leaf in (
            "mixed_precision",
            "dtype",
            "torch_dtype",
            "bf16",
            "param_dtype",
        ) and value.lower().replace("torch.", "") in ("bf16", "bfloat16", "true"):
            return f"{key}={value}"
    return _BF16_SETTING.get(ctx.framework or "")


def _sync_frames(tb) -> bool:
    return bool(tb.frames) and bool(_SYNC.search(" ".join(f"{f.func} {f.code or ''}" for f in tb.frames)))


def _sync_error(facts: LogFacts) -> LogLine | None:
    """The exception line of a KeyError / shape / assertion error raised inside the weight copy (its
    traceback shows the sync frames), or a KeyError quoted next to such a traceback."""
    for tb in facts.tracebacks:
        exc = tb.exc.text.strip() if tb.exc else ""
        if (tb.phase() or ("",))[0] == "init":  # building the engine (init_model), not a sync (logsg branch)
            continue
        if re.search(
            r"out of memory|NCCL|OutOfMemory|CUDA error|illegal memory access|device-side assert", exc, re.I
        ):  # an OOM, a timeout or a kernel fault (an earlier kernel's, reported late) in sync: not a mismatch
            continue
        loader = bool(_LOADER.search(" ".join(f"{f.func} {f.code or ''}" for f in tb.frames)))
        if (_sync_frames(tb) or loader) and re.match(
            r"(?:\w+\.)*(KeyError|AssertionError|RuntimeError|ValueError|IndexError)\b", exc
        ):
            return tb.exc
        # an engine parameter without what the loader reads, under the trainer's update call
        if update_frames(tb) and re.match(r"(?:\w+\.)*(AttributeError|TypeError)\b", exc):
            return tb.exc
    for h in facts.of("exception_line"):
        if h.fields.get("type", "").endswith("KeyError") and any(
            _sync_frames(tb) and min(abs(tb.start - h.no), abs(tb.end - h.no)) <= 6 for tb in facts.tracebacks
        ):
            return h.line
    return None


def _sync_failure(facts: LogFacts) -> tuple[LogLine, str | None, str, Hit | None] | None:
    """(line, the parameter or method named, title, the engine's "failed to update" hit) of a weight sync."""
    named = facts.first("weight_sync_name")
    tried = facts.of("weight_sync_failed")
    failed = next((h for h in tried if h.fields["groups"][0]), tried[0] if tried else None)
    if named:
        name, model = named.fields["groups"]
        return named.line, name, f"Weight sync: the engine's {model} has no parameter named '{name}'", failed
    if failed and failed.fields["groups"][0]:
        method, msg = failed.fields["groups"]
        return failed.line, method, f"Weight sync failed in {method}: {msg.strip()[:160]}", failed
    # the engine's worker failing a weight-update method it was asked to run; the parameter a line beside it
    # names (with its shape) is the one that did not fit
    method = next((h for h in facts.of("engine_method_error") if _UPDATE.fullmatch(h.fields["method"])), None)
    if method is not None:
        near = [w for w in facts.of("weight_named") if abs(w.no - method.no) <= 12]
        if near:
            w = min(near, key=lambda x: abs(x.no - method.no))
            name = next(v for v in w.fields["groups"] if v)
            shapes = re.findall(r"torch\.Size\(\[([\d, ]+)\]\)", w.line.text)
            shown = f" (shapes [{shapes[0]}] and [{shapes[1]}])" if len(shapes) >= 2 else ""
            title = f"Weight sync failed in {method.fields['method']}: {name} does not fit the engine's parameter{shown}"
            return w.line, name, title, method
        return (
            method.line,
            method.fields["method"],
            f"Weight sync failed in {method.fields['method']}",
            method,
        )
    err = _sync_error(facts)
    if err is not None:
        m = re.search(r"KeyError: '([^']+)'", err.text)
        title = (
            f"Weight sync: the engine has no parameter '{m[1]}'"
            if m
            else f"Weight sync failed: {err.text.strip()[:160]}"
        )
        return err, m[1] if m else None, title, failed
    if failed is not None:
        return failed.line, None, "Weight sync into the inference engine failed", failed
    if (after := _after_update_call(facts)) is not None:
        return after
    layout = facts.first("loader_layout")
    tb = facts.traceback_near(layout.no) if layout else None
    # the same refusal under the engine's first load of a checkpoint (no sync frame) is the model's, not the sync's
    if layout is None or (
        tb is not None and not _sync_frames(tb) and _LOAD.search(" ".join(f.func for f in tb.frames))
    ):
        return None
    text = layout.line.text.strip()
    return (
        layout.line,
        None,
        f"Weight sync: the engine's loader refused the tensor's layout: {text[:160]}",
        None,
    )


AFTER_CALL = 12
"""Lines between a weight-update call and an engine failure that failed it."""


def _after_update_call(facts: LogFacts) -> tuple[LogLine, str, str, Hit | None] | None:
    """An engine's own failure (its scheduler or worker raised) within `AFTER_CALL` lines after a line naming
    a weight-update call into it, with no frame of its own that places it elsewhere: that sync failed."""
    calls = [h for h in facts.of("weight_update_call") if not h.line.text.lstrip().startswith("File ")]
    for err in facts.of("engine_error", "engine_method_error"):
        before = [c for c in calls if 0 <= err.no - c.no <= AFTER_CALL]
        tb = facts.traceback_near(err.no + 1)
        elsewhere = tb is not None and (p := tb.phase()) is not None and p[0] != "weight_sync"
        if before and not elsewhere:
            call = before[-1].fields["groups"][0]
            return err.line, call, f"Weight sync failed: the engine raised right after {call}", None
    return None


_LOAD = re.compile(r"load_model|initialize_model|_initialize_kv_caches|from_pretrained|init_device")


_SYNC_WHAT = (
    "Copying the trainer's weights into the rollout engine failed: the engine's model has no parameter of "
    "that "
    "name, or the tensor's shape / layout / dtype does not fit the engine's parameter. The trainer's names "
    "carry "
    "wrappers the engine does not know (LoRA's base_layer, torch.compile's _orig_mod, FSDP's wrappers), or "
    "the "
    "trainer and the engine disagree on the model's layout (a converter, a MoE backend, a version pair the "
    "framework was not tested with)."
)


def _weight_sync(facts: LogFacts, ctx: LogContext) -> Cause | None:
    found = _sync_failure(facts)
    if found is None:
        return None
    line, name, title, failed = found
    if any(0 <= line.no - h.no <= AFTER_CALL for h in facts.of("nccl_net_timeout")):
        return (
            None  # NCCL's transport timed out just before: the collective's timeout (raisers), not a mismatch
        )
    pl = place(facts, line)
    ev = [quote(line)] + ([quote(failed.line)] if failed and failed.line is not line else []) + pl.evidence()
    wrappers = [
        p
        for p in ("base_layer", "_orig_mod", "_fsdp_wrapped_module", "_checkpoint_wrapped")
        if p in (name or "")
    ]
    frames = " ".join(f.func for tb in facts.tracebacks for f in tb.frames)
    unset = facts.first("vllm_config_unset")
    if unset is not None and unset.line is not line:
        ev.append(quote(unset.line))
    lora = "lora" in f"{name} {frames}".lower() or "base_layer" in (name or "")
    fx = fixes(
        ctx,
        advice(
            "vLLM ran its model code outside its config context ('Current vLLM config is not set'): make the "
            "trainer's engine-side refit calls (the model's load_weights, process_weights_after_loading()) inside "
            "`with set_current_vllm_config(vllm_config):` (the worker's model_runner.vllm_config), as vLLM's own "
            "loader does"
        )
        if unset is not None
        else None,
        advice(
            f"strip the {', '.join(wrappers)} wrapper from the names before the sync (merge LoRA into the "
            "base "
            "weights, or pass the unwrapped module)"
        )
        if wrappers
        else None,
        advice(
            "use the engine version the framework pins for this trainer version; a newer engine renames or "
            "re-lays out parameters (fused experts, quantised layouts)"
        ),
        advice(
            "with LoRA: sync the adapters the way the framework documents (verl: lora_rank with its LoRA "
            "sync "
            "path; TRL: merge before pushing to vLLM)"
        )
        if lora
        else None,
    )
    return Cause(
        "error",
        "weight_sync",
        title,
        _SYNC_WHAT
        + (
            " Here vLLM also warned that its config was not set: its model code ran outside the engine's config "
            "context, so the layers read defaults instead of the engine's settings."
            if unset is not None
            else ""
        ),
        evidence=ev,
        fixes=fx,
        where=name
        or (
            "the engine-side refit call outside set_current_vllm_config (vLLM config not set)"
            if unset is not None
            else pl.culprit()
        ),
        phase="weight_sync",
        rank=pl.rank,
        line=line.no,
        score=41.0,
    )


def _worker_died(
    died: Hit, last: str | None, culprit: str | None, ctx: LogContext
) -> tuple[str, str | None, str, list]:
    """(title, where, what, fixes) of an engine worker's death its parent reports."""
    worker = died.fields.get("method")
    title = f"Engine worker {worker} died" if worker else "An engine worker process died"
    if last:
        title += f": {last}"
    what = (
        "A worker process of the rollout engine ended (its parent says so and shuts the engine down); the "
        "worker's own error, if it printed one, is above this line, often in another process's output."
    )
    fx = fixes(
        ctx,
        advice(
            "look above for the worker's last lines (a CUDA OOM, a CUDA fault, a SIGSEGV / SIGKILL, a host "
            "OOM kill); with tensor parallelism check /dev/shm size and NCCL between the GPUs"
        ),
        advice("use the engine version the framework pins for this trainer version"),
    )
    return title, worker or culprit, what, fx


def _engine(facts: LogFacts, ctx: LogContext) -> Cause | None:
    slots = facts.first("sglang_req_slots")
    oom = facts.first("sglang_oom")
    errs = facts.of("engine_error")
    methods = [h for h in facts.of("engine_method_error") if h.fields.get("method") != "initialize_cache"]
    died = facts.first("engine_worker_died")
    h = slots or oom or (errs[0] if errs else None) or died or (methods[0] if methods else None)
    if h is None:
        return None
    pl = place(facts, h.line)
    tb = facts.traceback_near(h.no + 1)
    last = tb.exc.text.strip()[:200] if tb and tb.exc else None
    if h is slots:
        title, where = "SGLang ran out of request slots (alloc_req_slots)", "--max-running-requests"
        what = (
            "The scheduler's request-to-token pool had no free slot for the next batch: more requests are "
            "running "
            "than the pool was sized for."
        )
        fx = fixes(
            ctx,
            ("max_num_seqs", "fewer requests in flight"),
            ("rollout_memory", "a larger pool (raise it if the weights leave room)"),
        )
    elif h is oom:
        title, where = f"SGLang {oom.fields['groups'][0].lower()} out of memory", "--chunked-prefill-size"
        what = "The engine's activations for a prefill / decode batch did not fit beside its KV-cache pool."
        fx = fixes(
            ctx, ("max_num_seqs", "smaller batches"), ("rollout_memory", "lower: more room for activations")
        )
    elif h is died:
        title, where, what, fx = _worker_died(died, last, pl.culprit(), ctx)
    else:
        method = h.fields.get("method")
        title = (
            "Inference engine error"
            + (f" in {method}" if method else "")
            + (f": {last}" if last else " (the engine's own traceback follows it)")
        )
        where = method or pl.culprit()
        what = (
            "The rollout engine's scheduler or worker raised; every request in flight fails and the "
            "trainer waiting "
            "on it sees the cascade."
        )
        fx = fixes(
            ctx,
            advice(
                "the engine's traceback (below the line quoted) names the failing call; if it is a "
                "CUDA fault, rerun with CUDA_LAUNCH_BLOCKING=1 and without CUDA graphs (enforce_eager)"
            ),
            advice("use the engine version the framework pins for this trainer version"),
        )
    return Cause(
        "error",
        "engine_error",
        title,
        what,
        evidence=[quote(h.line)] + pl.evidence(),
        fixes=fx,
        where=where,
        phase=pl.phase or (phase_of_name(where) if where else None) or "generate",
        rank=pl.rank,
        line=h.no,
        score=37.0,
    )
