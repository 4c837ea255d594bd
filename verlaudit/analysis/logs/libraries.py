"""Failures that name the libraries they come from, read from the message and its frames:

- ``version_mismatch``: one library calling another with an API the installed version does not have
  (``TypeError: f() got an unexpected keyword argument 'x'`` / ``missing 1 required positional
  argument``, ``AttributeError: module 'torch' has no attribute 'x'``), or a version check that names
  both (transformers' ``X>=a is required for ..., but found X==b``, pip's ``A requires X>=a, but you
  have X b``): the culprit is the pair, the caller (the innermost frame's package) and the callee (the
  package the message names, or the one that defines the class it names); the fix pins the pair;
- ``engine_feature``: the trainer calls an inference engine's method the engine (its version, its
  backend) does not have (``'SGLangWorker' object has no attribute 'update_weights_from_tensor'``);
- ``engine_limit``: a request over an engine's configured limits (vLLM's prompt longer than
  ``max_model_len``, ``Input prompt (N tokens) is too long and exceeds limit of M``: the request is
  dropped; ``max_num_batched_tokens`` smaller than ``max_model_len``; SGLang's input length check);
- FSDP / FSDP2 flattening parameters of mixed dtypes (``Must flatten tensors with uniform dtype but got
  torch.float32 and torch.bfloat16``, ``FSDP expects uniform original parameter dtype``): a
  ``dtype_error``; flash-attn refusing fp32 (``FlashAttention only supports fp16 and bf16``) is a
  ``dtype_unsupported``: a dtype the kernel has no implementation for, not two operands that disagree;
  mixed ``requires_grad`` in one FSDP unit: an ``exception`` with FSDP's remedy.

Exercised by ``pytest tests/test_log_formats.py -k libraries``.
"""

from __future__ import annotations

import re

from verlaudit import verl_keys as V
from verlaudit.analysis.causes import Cause, Fix
from verlaudit.analysis.logs.engines import update_frames
from verlaudit.analysis.logs.frameworks import LogContext, advice, fixes, pinned_pair
from verlaudit.analysis.logs.lines import LogLine, failure_signal, hints, package_of
from verlaudit.analysis.logs.scan import Hit, LogFacts, Traceback, place, quote
from verlaudit.dtypes import dtype_name

_API = [
    # the exception type and the quotes are often lost when a user retypes the error: the message is enough
    ("unexpected_kwarg", re.compile(r"(?:TypeError: |^|\s)(?P<callee>[\w.<>]+)\(\) got an unexpected keyword argument "
                                    r"'?(?P<arg>\w+)'?")),
    ("missing_arg", re.compile(r"TypeError: (?P<callee>[\w.<>]+)\(\) missing \d+ required (?:positional|keyword-only) "
                               r"arguments?: '(?P<arg>\w+)'")),
    ("module_attr", re.compile(r"AttributeError: module '(?P<mod>[\w.]+)' has no attribute '(?P<arg>\w+)'")),
    # (a class named with its module, ``'torch.dtype' object``: the module's package defines it; logsg branch)
    ("object_attr", re.compile(r"(?:AttributeError: |^)'(?P<cls>[\w.]+)' object has no attribute '(?P<arg>\w+)'")),
    # logsg branch: a call whose arguments the callee's signature does not take in the installed release: too
    # many positionals, or torch's argument parser rejecting the call (no overload takes these arguments; a None
    # where the installed torch reads a dimension name); a version pair when a library's frame made the call
    ("positional_count", re.compile(r"TypeError: (?P<callee>[\w.<>]+)\(\) takes (?:from \d+ to )?\d+ positional "
                                    r"arguments? but (?P<arg>\d+) (?:were|was) given")),
    ("arg_parser", re.compile(r"(?P<callee>[\w.]+)\(\) received an invalid combination of arguments"
                              r"|Please look up dimensions by name, got: name = (?P<arg>None)")),
    # transformers' require_version / dependency_versions_check, and pip's resolver
    ("required_version", re.compile(r"(?P<arg>[A-Za-z][\w.-]*)(?P<spec>[<>=!~][^ ]*) is required for [^,]*, but found "
                                    r"(?P<mod>[A-Za-z][\w.-]*)==(?P<found>[\w.+-]+)")),
    ("pip_conflict", re.compile(r"(?P<callee>[A-Za-z][\w.-]*) [\w.+-]+ requires (?P<mod>[A-Za-z][\w.-]*)(?P<spec>[<>=!~][^,]*), "
                                r"but you have (?P=mod) (?P<found>[\w.+-]+)")),
]  # fmt: skip
# SGLang's data-parallel controller drops a request type it does not dispatch: "Invalid object:
# UpdateWeightReqInput(model_path=...)" (its io_struct request classes all end in ReqInput)
_DROPPED_REQ = re.compile(r"Invalid object: (?P<req>\w+ReqInput)\(")
# a client's HTTP 404 from a server it calls (the endpoint does not exist there): TRL's VLLMClient ("Request
# failed: 404, ..."), requests ("404 Client Error: Not Found for url: URL"), openai ("NotFoundError: Error code:
# 404"), aiohttp ("ClientResponseError: 404, message='Not Found', url=URL('URL')"); a server's access-log line is not
_HTTP_404 = re.compile(
    r"Request failed: 404\b|404 Client Error: Not Found for url: (?P<url>\S+)|NotFoundError: Error code: 404"
    r"|ClientResponseError: 404, message='Not Found', url=(?:URL\(')?(?P<url2>[^')\s]+)"
)
_FLATTEN = re.compile(
    r"Must flatten tensors with uniform dtype but got (?P<a>[\w.]+) and (?P<b>[\w.]+)"
    r"|FSDP expects uniform original parameter dtype but got \{(?P<set>[^}]*)\}"
)
_FLASH = re.compile(r"FlashAttention only supports? fp16 and bf16 data type")
_FLATTEN_GRAD = re.compile(r"Must flatten tensors with uniform ``?requires_grad``?")
_LIMITS = [
    ("max_model_len", re.compile(r"prompt \(length (?P<n>\d+)\) is longer than the maximum model length of (?P<m>\d+)", re.I)),
    ("max_model_len", re.compile(r"prompt length of (?P<n>\d+) is longer than the maximum model length of (?P<m>\d+)", re.I)),
    ("max_model_len", re.compile(r"prompt \(total length (?P<n>\d+)\) is too long to fit into the model \(context length (?P<m>\d+)\)")),
    ("max_model_len", re.compile(r"maximum context length is (?P<m>\d+) tokens\. However, you requested (?P<n>\d+) tokens")),
    ("max_model_len", re.compile(r"User-specified max_model_len \((?P<n>\d+)\) is greater than the derived max_model_len")),
    ("prompt_limit", re.compile(r"Input prompt \((?P<n>\d+) tokens\) is too long and exceeds limit of (?P<m>\d+)")),
    ("block_manager", re.compile(r"Input prompt \((?P<n>\d+) tokens\) \+ lookahead slots \(\d+\) is too long and "
                                 r"exceeds the capacity of block_manager")),
    ("max_num_batched_tokens", re.compile(r"max_num_batched_tokens \((?P<m>\d+)\) is smaller than max_model_len \((?P<n>\d+)\)")),
    ("max_num_batched_tokens", re.compile(r"(?P<n>\d+) tokens?\)?[^\n]{0,40}exceeds?[^\n]{0,30}max_num_batched_tokens"
                                          r"(?:[^\d\n]{0,20}(?P<m>\d+))?")),
    # an item (a multimodal item's encoder tokens, a sequence) larger than the per-step token budget
    ("max_num_batched_tokens", re.compile(r"\((?P<n>\d+)\) is (?:larger|greater) than max_num_batched_tokens \((?P<m>\d+)\)")),
    ("context_length", re.compile(r"Input length \((?P<n>\d+) tokens\) exceeds the maximum allowed length \((?P<m>\d+) tokens\)")),
    # (the apostrophe escaped, as a JSON error body quotes it: "model\\'s")
    ("context_length", re.compile(r"input \((?P<n>\d+) tokens\) is longer than the model\\?'s context length \((?P<m>\d+) tokens\)", re.I)),
    # the same limit in other engines' words: SGLang's OpenAI server ("Requested token count exceeds the model's
    # maximum context length of 4096 tokens. You requested a total of 5000 tokens"), TGI's input validation
    # ("`inputs` tokens + `max_new_tokens` must be <= 4096. Given: 4000 `inputs` tokens and 200 `max_new_tokens`",
    # "`inputs` must have less than 1024 tokens. Given: 2000"), llama.cpp / Ollama ("the request exceeds the
    # available context size"), and a plain "exceeds the model's (maximum) context length (of) N"
    ("context_length", re.compile(r"exceeds the model\\?'s maximum context length of (?P<m>\d+) tokens(?:\. You requested a "
                                  r"total of (?P<n>\d+) tokens)?", re.I)),
    ("max_total_tokens", re.compile(r"`?inputs`? tokens \+ `?max_new_tokens`? must be <= (?P<m>\d+)\. Given: (?P<n>\d+) `?inputs`? "
                                    r"tokens")),
    ("max_input_tokens", re.compile(r"`?inputs`? must have less than (?P<m>\d+) tokens\. Given: (?P<n>\d+)")),
    ("context_length", re.compile(r"(?:request|prompt|input)\w* (?:\(\d+ tokens\) )?exceeds the available context size"
                                  r"|(?:input|prompt|sequence) length (?:of )?\(?(?P<n>\d+)\)? exceeds (?:the )?(?:model\\?'s )?"
                                  r"(?:maximum )?context length (?:of )?\(?(?P<m>\d+)", re.I)),
]  # fmt: skip
_HAS = hints(
    "unexpected keyword", "required positional", "required keyword", "has no attribute", "flatten tensors",
    "uniform original", "maximum model length", "too long", "context length", "max_model_len",
    "max_num_batched_tokens", "maximum allowed length", "is required for", "but you have", "FlashAttention",
    "maximum context length", "max_new_tokens", "less than", "context size", "exceeds",
    "Invalid object", "404", "invalid combination", "look up dimensions", "positional argument",
)  # fmt: skip
_ENGINE_CLASS = re.compile(
    r"Worker|Engine|Runner|Executor|^LLM$|Scheduler|Server|Rollout|Generator|Client", re.I
)
_ENGINE_METHODS = re.compile(
    r"^(?:update_weights\w*|init_weights_update_group|update_named_param\w*|load_weights|collective_rpc|"
    r"sleep|wake_up|reset_prefix_cache|release_memory_occupation|resume_memory_occupation|"
    r"flush_cache|get_weights_by_name|init_weight_update_group|add_lora|generate\w*)$"
)
# what vLLM's V0 LLMEngine exposes and the V1 engine does not (the trainer reaches into the workers through it)
_V0_ONLY = frozenset({"model_executor", "driver_worker"})
_BUILTIN = frozenset({"NoneType", "str", "list", "dict", "int", "float", "tuple", "bool", "bytes", "set"})
# the package that defines a class or function a message names (the callee of a version mismatch)
# (first match wins: peft's LoraConfig and vLLM's config classes before transformers' catch-all *Config)
_OWNER = [
    (re.compile(r"^(?:LLM|SamplingParams|EngineArgs|AsyncEngineArgs|LLMEngine|AsyncLLMEngine|AsyncLLM|"
                r"GuidedDecodingParams|LoRARequest|LoRAConfig|VllmConfig|CacheConfig|ParallelConfig|"
                r"SchedulerConfig|LoadConfig|DeviceConfig)\b"), "vllm"),
    (re.compile(r"^(?:LoraConfig|PeftModel\w*|get_peft_model)\b"), "peft"),
    (re.compile(r"^(?:GRPOConfig|GRPOTrainer|SFTTrainer|SFTConfig|DPOTrainer|DPOConfig|PPOTrainer|"
                r"RewardTrainer|AutoModelForCausalLMWithValueHead)\b"), "trl"),
    (re.compile(r"^(?:TrainingArguments|Trainer|PreTrainedModel|PretrainedConfig|AutoModel\w*|AutoTokenizer|"
                r"\w+ForCausalLM|\w+Config|GenerationConfig|\w+Tokenizer\w*)\b"), "transformers"),
    (re.compile(r"^(?:Accelerator|AcceleratorState)\b"), "accelerate"),
    (re.compile(r"^(?:DeepSpeedEngine|DeepSpeedZeroOptimizer\w*)\b"), "deepspeed"),
    (re.compile(r"^(?:FullyShardedDataParallel|FSDP|fully_shard|MixedPrecision\w*|DTensor|DeviceMesh)\b"), "torch"),
    (re.compile(r"^(?:Dataset|DatasetDict|load_dataset)\b"), "datasets"),
]  # fmt: skip


# packages whose dotted class names a message may print whole (logsg branch)
_PACKAGES = frozenset({"torch", "vllm", "sglang", "transformers", "peft", "trl", "accelerate", "deepspeed", "ray",
                       "verl", "openrlhf", "nemo_rl", "megatron", "flash_attn", "triton", "numpy", "datasets"})  # fmt: skip


# attributes a library attaches to objects of another: vLLM sets ``weight_loader`` on every torch Parameter
# of its model classes, so a Parameter without one is a checkpoint tensor the installed vLLM's model class
# does not define (a model or layout newer than the vLLM release)
_ATTR_OWNER = {"weight_loader": "vllm"}


# a model architecture the installed library predates: vLLM's "Model architectures ['X'] are not supported for
# now", transformers' "model type `qwen3` but Transformers does not recognize this architecture" (its KeyError: 'qwen3')
_ARCH = re.compile(
    r"Model architectures? \[?'?(?P<arch>\w+)'?\]? (?:are|is) not supported"
    r"|model type `(?P<mtype>[\w-]+)` but Transformers does not recognize this architecture"
)


def detect(line: LogLine) -> list[Hit]:
    """API, engine-feature, engine-limit and FSDP flattening messages in one line."""
    text = line.text
    if not _HAS(text) and "not supported" not in text and "does not recognize this arch" not in text:
        return []
    out = []
    if m := _ARCH.search(text):
        out.append(
            Hit(
                "unknown_arch",
                line,
                {"arch": m["arch"] or m["mtype"], "lib": "vllm" if m["arch"] else "transformers"},
            )
        )
    for rule, pat in _API:
        m = pat.search(text)
        if m:
            out.append(Hit(rule, line, m.groupdict()))
    m = _DROPPED_REQ.search(text)
    if m:
        out.append(Hit("dropped_request", line, m.groupdict()))
    m = _HTTP_404.search(text)
    if m:
        out.append(Hit("http_missing", line, {"url": m["url"] or m["url2"]}))
    m = _FLATTEN.search(text)
    if m:
        found = [m["a"], m["b"]] if m["a"] else re.findall(r"[\w.]+", m["set"] or "")
        out.append(Hit("fsdp_flatten", line, {"dtypes": [dtype_name(d) or d for d in found]}))
    elif _FLASH.search(text):
        out.append(Hit("fsdp_flatten", line, {"dtypes": [], "flash": True}))
    elif _FLATTEN_GRAD.search(text):
        out.append(Hit("fsdp_requires_grad", line))
    if "KV cache" not in text:
        for setting, pat in _LIMITS:
            m = pat.search(text)
            if m:
                out.append(Hit("engine_limit", line, {"setting": setting, **m.groupdict()}))
                break
    return out


def explain(facts: LogFacts, ctx: LogContext) -> list[Cause]:
    """Version mismatches, missing engine features, engine limits, FSDP flattening."""
    return [c for c in (_api(facts, ctx), _limit(facts, ctx), _flatten(facts, ctx)) if c]


_PLAIN = frozenset({"str", "dict", "list", "tuple", "int", "float", "bytes"})
"""Plain values a caller passes where a library's API of another release takes one of its own objects (a model
name as a string where vLLM 0.6.6 takes a BaseModelPath): ``'str' object has no attribute 'name'`` raised in the
library's own frame."""


def _plain_in_library(tb: Traceback | None) -> str | None:
    """The package whose own (innermost, installed) frame raised an AttributeError, when it is not torch's or the
    standard library's: the library reads an attribute of the objects its API takes."""
    frames = tb.frames if tb else []
    if not frames or not frames[-1].library:
        return None
    pkg = package_of(frames[-1].path)
    return pkg if pkg and pkg not in ("torch", "numpy") else None


def _libraries(tb: Traceback | None) -> list[str]:
    """The packages of a traceback's frames, innermost first, each once."""
    out: list[str] = []
    for f in reversed(tb.frames if tb else []):
        pkg = package_of(f.path)
        if pkg and pkg not in out:
            out.append(pkg)
    return out


def owner(name: str, libs: list[str]) -> str | None:
    """The package that defines ``name`` (a class, ``Class.method`` or a module path)."""
    head = name.split(".", 1)[0]
    for pat, pkg in _OWNER:
        if pat.match(head):
            return pkg
    # a class its message names with its module (``torch.dtype``, ``vllm.config.ModelConfig``): that package
    return head if "." in name and head in _PACKAGES else None


def _path_version(tb: Traceback | None, pkg: str | None) -> str | None:
    """A version of ``pkg`` the traceback's paths name (an environment called ``..._vllm_0.6.3``, an egg or
    dist-info directory ``vllm-0.6.3``): the release the environment was meant to hold."""
    if tb is None or not pkg:
        return None
    pat = re.compile(
        rf"(?<![A-Za-z]){re.escape(pkg)}[-_=]v?(\d+\.\d+(?:\.\d+)?(?:\.post\d+)?)(?![\d.])", re.I
    )
    for f in tb.frames:
        if m := pat.search(f.path):
            return m[1]
    return None


# (they share the frames' reading and differ in what they name and fix)
# long: three families of API message: a keyword, a module attribute, an engine method
def _arch(facts: LogFacts, ctx: LogContext, h: Hit) -> Cause:
    arch, lib = h.fields["arch"], h.fields["lib"]
    pl = place(facts, h.line)
    return Cause(
        "error",
        "version_mismatch",
        f"The installed {lib} does not know the model architecture {arch}: a release older than the model",
        f"{lib} looks the model's architecture up in its own registry; {arch} is not in the installed release, "
        "which predates the model (or serves it under another class).",
        evidence=[quote(h.line)] + pl.evidence(),
        fixes=fixes(
            ctx,
            advice(
                f"pip install -U {lib}: a release that lists {arch} (its supported-models page / release "
                "notes name the first one)"
            ),
            advice(
                f"if the framework pins {lib}, upgrade the framework to a release that pins a {lib} with "
                f"{arch}"
            ),
        ),  # fmt: skip
        where=f"{lib} ({arch})",
        phase=pl.phase or "init",
        rank=pl.rank,
        line=h.no,
        score=44.0,
        data={"callee": lib, "name": arch},
    )


def _api(facts: LogFacts, ctx: LogContext) -> Cause | None:
    if (arch := facts.first("unknown_arch")) is not None:
        return _arch(facts, ctx, arch)
    dropped = facts.first("dropped_request")
    if dropped is not None:
        return _dropped_request(facts, ctx, dropped)
    missing = facts.first("http_missing")
    if missing is not None:
        return _http_missing(facts, ctx, missing)
    req = facts.first("required_version", "pip_conflict")
    if req is not None:
        return _required(facts, ctx, req)
    h = facts.first(
        "unexpected_kwarg", "missing_arg", "module_attr", "object_attr", "positional_count", "arg_parser"
    )
    while h is not None and h.rule == "object_attr":
        cls, attr = h.fields["cls"], h.fields["arg"]
        if _ENGINE_CLASS.search(cls) and (
            _ENGINE_METHODS.match(attr) or "weight" in attr or _engine_owned(cls, facts, h)
        ):
            return _engine_feature(facts, ctx, h)
        tb = facts.traceback_near(h.no, h.line.rank)
        under_update = update_frames(tb)
        if not under_update and (_ATTR_OWNER.get(attr) or (cls not in _BUILTIN and owner(cls, []))):
            break  # a library's object lacks what its caller expects: a version mismatch, read below
        if not under_update and cls in _PLAIN and _plain_in_library(tb):
            break  # a library's own code read its object's field off a plain value the caller passed
        # (under the trainer's weight update into the engine it is the weight sync's failure: engines)
        rest = [x for x in facts.of("unexpected_kwarg", "missing_arg", "module_attr") if x.no > h.no]
        h = rest[0] if rest else None
    if h is None or h.rule == "arg_parser":
        return _arg_parser(facts, ctx, h) if h else None
    pl = place(facts, h.line)
    libs = _libraries(pl.tb)
    arg = h.fields["arg"]
    callee, name, what = _api_names(h, libs)
    if _own_call(pl.tb, h, callee):
        return None  # the user's own code called a function of its own with another signature: an exception
    caller = next((p for p in libs if p != callee), None)
    pair = [p for p in (caller, callee) if p]
    where = " -> ".join(pair) if pair else name
    pins = " and ".join(pair) if pair else "the two libraries"
    named = callee or caller  # (a library whose own frames raised: the one whose release the paths name)
    meant = _path_version(pl.tb, named)
    return Cause(
        "error",
        "version_mismatch",
        f"Version mismatch{f' between {caller} and {callee}' if caller and callee else ''}: {what}",
        f"{caller or 'The calling code'} was written against another version of {callee or 'the library it calls'}: "
        "the installed one renamed, removed or added that argument or attribute. Nothing is wrong with "
        "the run's settings; the environment holds a pair of versions that were never released together.",
        evidence=[quote(h.line)] + pl.evidence() + ([f"libraries in the traceback: {', '.join(libs)}"] if libs else []),
        fixes=fixes(
            ctx,
            pinned_pair(caller, callee),
            advice(f"the paths name {named} {meant}: if that is the release meant, reinstall it cleanly (pip "
                   f"uninstall {named}; pip install '{named}=={meant}'): a stale or mixed install holds another "
                   "release's files") if meant else None,
            advice(f"install the versions of {pins} that {caller or 'the framework'} pins (its requirements / "
                   f"setup.py; pip install '{callee or 'the library'}==<the pinned version>'), or upgrade "
                   f"{caller or 'the framework'} to a release written for the installed {callee or 'library'}"),
            advice(f"if the installed {callee} predates the argument (the caller is the newer side): pip install "
                   f"-U {callee}") if callee and h.rule in ("unexpected_kwarg", "object_attr") else None,
            advice(f"or, in the calling code, stop passing {arg} (the installed {callee or 'library'} does not "
                   "know it) where the default serves") if h.rule == "unexpected_kwarg" else None,
            advice(f"or, in the calling code, read it as getattr(obj, '{arg}', None) where a missing value is "
                   "acceptable (the installed release removed or renamed it)") if h.rule == "object_attr" else None,
        ),
        unknown=["which versions are installed: run `pip list | grep -i -E '" + "|".join(pair or ["torch"]) + "'`"],
        where=f"{where} ({name}{'' if h.rule in ('module_attr', 'object_attr') else f': {arg}'})"
        + (f", called from {at}" if (at := _frame_of(pl.tb, caller)) else ""),
        phase=pl.phase,
        rank=pl.rank,
        line=h.no,
        score=44.0,
        data={"caller": caller, "callee": callee, "name": name, "argument": arg},
    )  # fmt: skip


def _api_names(h: Hit, libs: list[str]) -> tuple[str | None, str, str]:
    """(the callee package, the name the message names, what it says) of an API message."""
    arg = h.fields["arg"]
    if h.rule == "module_attr":
        callee, name = h.fields["mod"].split(".")[0], f"{h.fields['mod']}.{arg}"
        what = f"module {h.fields['mod']} has no {arg}"
    elif h.rule == "object_attr":
        cls = h.fields["cls"]
        callee, name = _ATTR_OWNER.get(arg) or owner(cls, libs), f"{cls}.{arg}"
        what = f"{cls} has no attribute '{arg}'"
        if callee is None and cls in _PLAIN and libs:  # a plain value where the library reads its own object
            callee = libs[0]
            what = f"{callee} reads '{arg}' off a plain {cls} it was given (its installed API takes an object there)"
    else:
        name = h.fields["callee"]
        callee = owner(name, libs) or next((p for p in libs[1:2]), None)
        verb = {"unexpected_kwarg": "does not take", "positional_count": "does not take"}.get(
            h.rule, "requires"
        )
        what = f"{name}() {verb} " + (
            f"{arg} positional arguments" if h.rule == "positional_count" else f"'{arg}'"
        )
    return callee, name, what


def _own_call(tb: Traceback | None, h: Hit, callee: str | None) -> bool:
    """Whether a signature error is a call inside the user's own code (logsg branch): the innermost frame, where
    a TypeError about a call's arguments is raised, is the user's, and no library is known to define the callee
    (``__new__() missing 1 required positional argument`` in a script's own function). A mismatch between
    libraries is raised in a library's frame, or names a library's class."""
    if h.rule not in ("missing_arg", "positional_count") or tb is None or not tb.frames or callee is not None:
        return False
    return not tb.frames[-1].library


def _arg_parser(facts: LogFacts, ctx: LogContext, h: Hit) -> Cause | None:
    """Torch's argument parser rejecting a call a library's frame made (logsg branch): the library was written
    for another torch. From the user's own frame it is the user's call, not a pair: no cause here."""
    pl = place(facts, h.line)
    frames = pl.tb.frames if pl.tb else []
    if not frames or not frames[-1].library:
        return None
    inner = frames[-1]
    caller = package_of(inner.path)
    if caller in (None, "torch"):
        return None
    op = h.fields.get("callee") or inner.call() or "a torch op"
    at = _frame_of(pl.tb, caller)
    msg = h.line.text.strip()
    return Cause(
        "error",
        "version_mismatch",
        f"Version mismatch between {caller} and torch: torch rejects the arguments {caller} passes to {op}",
        f"{caller}'s code ({at or inner.func}) calls {op} with arguments the installed torch's signature does not "
        f"take ({msg[:120]}): {caller} was written for another torch release (an argument form the installed "
        "torch reads differently, e.g. a None where it now parses a dimension name).",
        evidence=[quote(h.line)]
        + pl.evidence()
        + [f"libraries in the traceback: {', '.join(_libraries(pl.tb))}"],
        fixes=fixes(
            ctx,
            advice(
                f"pip install --upgrade {caller} torch: a {caller} release written for the installed torch (or "
                f"the torch its requirements pin)"
            ),
            advice(
                f"or pin torch to the release the installed {caller} was tested with (its requirements / setup)"
            ),
        ),  # fmt: skip
        unknown=[f"which versions are installed: run `pip list | grep -i -E '{caller}|torch'`"],
        where=f"{caller} -> torch ({at or inner.func}: {op})",
        phase=pl.phase,
        rank=pl.rank,
        line=h.no,
        score=44.0,
        data={"caller": caller, "callee": "torch", "name": op, "argument": h.fields.get("arg")},
    )


def _required(facts: LogFacts, ctx: LogContext, h: Hit) -> Cause:
    """A version check that names both sides: transformers' ``X>=a is required ..., but found X==b``,
    pip's ``A 1.0 requires X>=a, but you have X b``."""
    f = h.fields
    pkg, spec, found = f["mod"], f["spec"].rstrip("."), f["found"].rstrip(".")
    who = f.get("callee")
    pl = place(facts, h.line)
    caller = who or next((p for p in _libraries(pl.tb) if p != pkg), None)
    # pip's resolver warns in many healthy installs: a finding only where the log also failed
    failed = h.rule == "required_version" or any(
        sig in ("exception", "kill", "exit") for sig, _ in facts.signals
    )
    return Cause(
        "error" if failed else "info",
        "version_mismatch",
        f"Version mismatch: {pkg} {found} installed, {pkg}{spec} required" + (f" by {caller}" if caller else ""),
        f"{caller or 'A package'} checks the version of {pkg} it needs and the installed one is outside it.",
        evidence=[quote(h.line)] + pl.evidence(),
        fixes=fixes(ctx, advice(f"pip install '{pkg}{spec}' (the range {caller or 'the framework'} asks for), or a "
                                f"{caller or 'framework'} release written for {pkg} {found}")),
        where=f"{caller} -> {pkg}" if caller else pkg,
        phase=pl.phase or "init",
        rank=pl.rank,
        line=h.no,
        score=46.0,
        data={"caller": caller, "callee": pkg, "required": spec, "found": found},
    )  # fmt: skip


def _frame_of(tb: Traceback | None, pkg: str | None) -> str | None:
    """``trl/trainer/sft_trainer.py __init__``: the innermost frame of package ``pkg`` (the caller's line
    that made the call the installed callee does not take)."""
    for f in reversed(tb.frames if tb and pkg else []):
        if package_of(f.path) == pkg and f"/{pkg}/" in f.path:
            return f"{pkg}/{f.path.rsplit(f'/{pkg}/', 1)[-1]} {f.func}"
    return None


def _engine_owned(cls: str, facts: LogFacts, h: Hit) -> bool:
    """Whether an engine-like class (``LLMEngine``, a ``Worker``) without an attribute is the inference
    engine's own: vLLM / SGLang define it, or the innermost library frame is the engine's: the engine (its
    version, its V0 / V1 mode, its backend) lacks what the caller reaches for."""
    if owner(cls, []) in ("vllm", "sglang"):
        return True
    tb = facts.traceback_near(h.no, h.line.rank)
    libs = _libraries(tb)
    attr = re.escape(h.fields["arg"])
    reads = [f.code for f in (tb.frames if tb else []) if f.code and re.search(rf"\.{attr}\b", f.code)]
    # the caller's line reaches the attribute through the engine's handle (`self.llm.llm_engine.workers[0].model`)
    return (bool(libs) and libs[0] in ("vllm", "sglang")) or any(
        re.search(r"\bllm_engine\b|\bvllm\b|\bsglang\b", code) for code in reads
    )


def _reached(tb: Traceback | None, attr: str) -> tuple[str | None, str | None]:
    """(the attribute chain a frame's source line reads to reach ``attr``: ``llm_engine.model_executor``;
    the innermost library frame it is read in: ``vllm/entrypoints/llm.py collective_rpc``)."""
    chain = None
    for f in reversed(tb.frames if tb else []):
        m = re.search(rf"(\w+)\.{re.escape(attr)}\b", f.code or "")
        if m:
            chain = f"{m[1]}.{attr}" if m[1] != "self" else attr
            break
    lib = next((f for f in reversed(tb.frames if tb else []) if f.library and package_of(f.path)), None)
    at = None
    if lib is not None:
        pkg = package_of(lib.path)
        at = f"{pkg}/{lib.path.rsplit(f'/{pkg}/', 1)[-1]} {lib.func}" if f"/{pkg}/" in lib.path else lib.func
    return chain, at


def _engine_feature(facts: LogFacts, ctx: LogContext, h: Hit) -> Cause:
    cls, attr = h.fields["cls"], h.fields["arg"]
    pl = place(facts, h.line)
    libs = _libraries(pl.tb)
    chain, at = _reached(pl.tb, attr)
    low = (cls + " " + " ".join(libs)).lower()
    engine = "sglang" if "sglang" in low else "vllm" if "vllm" in low else owner(cls, [])
    weight = "weight" in attr or attr in ("load_weights", "init_weights_update_group", "update_named_param")
    verl = ctx.framework in (None, "verl")
    return Cause(
        "error",
        "engine_feature",
        f"The rollout engine has no {attr}: {cls} lacks the {'weight-update' if weight else 'engine'} call the trainer makes",
        f"The trainer called {cls}.{attr}, which this engine{f' ({engine})' if engine else ''} does not provide in "
        "its installed version or with the backend / mode the configuration chose. "
        + ("The weights cannot reach the engine, so no rollout after the first would see the update. " if weight else "")
        + "It is a pairing of trainer, engine version and engine mode, not a numerical problem.",
        evidence=[quote(h.line)] + pl.evidence(),
        fixes=[
            Fix(None, V.ROLLOUT_NAME if verl else None,
                f"use the engine (and engine version) the framework supports for {attr}: its pinned "
                f"{engine or 'engine'} version, or the rollout engine / mode its docs pair with this trainer"),
            advice(f"upgrade or pin {engine or 'the engine'} to the release that provides {cls}.{attr} (the "
                   "framework's requirements name it)"),
            *([advice(f"vLLM moved its workers: {cls}.driver_worker became model_executor.driver_worker (0.4), and "
                      "the V1 engine (the default from 0.8) has no model_executor at all: set VLLM_USE_V1=0 where the "
                      "installed vLLM still ships the V0 engine, or reach the workers through LLM.collective_rpc")]
              if engine == "vllm" and attr in _V0_ONLY else []),
        ],
        where=f"{cls}.{attr}" + (f" ({', '.join(x for x in (chain, at and f'read in {at}') if x)})" if chain or at else ""),
        phase="weight_sync" if weight else pl.phase,
        rank=pl.rank,
        line=h.no,
        score=45.0,
        data={"class": cls, "method": attr, "engine": engine},
    )  # fmt: skip


def _http_missing(facts: LogFacts, ctx: LogContext, h: Hit) -> Cause:
    """A trainer's HTTP call into its inference server answered 404: the server has no such endpoint."""
    pl = place(facts, h.line)
    frames = pl.tb.frames if pl.tb else []
    call = frames[-1].func if frames else None
    url = h.fields.get("url")
    path = re.sub(r"^\w+://[^/]+", "", url) if url else None
    weight = bool(re.search(r"weight|communicator|world_size|update|sync", f"{call} {url}", re.I))
    return Cause(
        "error",
        "engine_feature",
        "The inference server has no endpoint for the trainer's call: HTTP 404"
        + (f" from {call}" if call else "") + (f" ({path})" if path else ""),
        "The trainer talks to a separately started inference server over HTTP and the server answered 404 Not "
        "Found: it does not serve that route. A plain OpenAI-compatible server (vllm serve, SGLang's) has only "
        "the OpenAI API; the weight-sync and control routes a trainer needs come with the trainer's own server "
        "entry point, in a matching version.",
        evidence=[quote(h.line)] + pl.evidence(),
        fixes=fixes(ctx, advice("start the server with the trainer's own entry point (TRL: `trl vllm-serve`, "
                                "not `vllm serve`) in the version the trainer pins, and point the client at "
                                "its host and port")),
        where=" ".join(x for x in (call, f"({path})" if path else None) if x) or pl.culprit(),
        phase="weight_sync" if weight else pl.phase,
        rank=pl.rank,
        line=h.no,
        score=44.0,
    )  # fmt: skip


def _dropped_request(facts: LogFacts, ctx: LogContext, h: Hit) -> Cause:
    """SGLang's data-parallel controller refusing a request type it does not dispatch to its workers."""
    req = h.fields["req"]
    call = re.sub(
        r"(?<!^)(?=[A-Z])", "_", req.removesuffix("ReqInput")
    ).lower()  # UpdateWeight -> update_weight
    weight = "weight" in call
    pl = place(facts, h.line)
    return Cause(
        "error",
        "engine_feature",
        f"SGLang dropped the {call} request ({req}): its data-parallel controller does not dispatch it",
        f"SGLang's data-parallel controller forwards the request types it knows to its workers and logs "
        f"'Invalid object' for the others: the {call} call never reached a worker. With dp_size above 1 the "
        "installed SGLang does not support this call; "
        + ("the trainer's weights never reach the engine, so every later rollout samples the old policy." if weight
           else "the call had no effect."),
        evidence=[quote(h.line)] + pl.evidence(),
        fixes=fixes(ctx, advice("upgrade sglang to a release whose data-parallel controller dispatches "
                                f"{req} (the {call} API under data parallelism), or serve with --dp-size 1 "
                                "(tensor parallelism instead)")),
        unknown=["the server's dp_size and SGLang version: `pip show sglang` and the server's launch flags"],
        where=f"sglang data-parallel controller ({call}, dp_size > 1)",
        phase="weight_sync" if weight else pl.phase,
        rank=pl.rank,
        line=h.no,
        score=45.0,
        data={"request": req, "engine": "sglang"},
    )  # fmt: skip


_LIMIT_WHAT = {
    "max_model_len": "a prompt (with its response budget) longer than the engine's max_model_len",
    "prompt_limit": "a prompt over the scheduler's limit (min of max_model_len and max_num_batched_tokens): "
                    "vLLM ignores the request and returns nothing for it",
    "block_manager": "a prompt the KV-cache block manager cannot hold at all: the request is ignored",
    "max_num_batched_tokens": "max_num_batched_tokens below the sequence length: longer prompts are refused",
    "context_length": "an input longer than the engine's context length",
    "max_total_tokens": "an input whose tokens plus max_new_tokens exceed the server's max_total_tokens",
    "max_input_tokens": "an input longer than the server's max_input_tokens",
}  # fmt: skip


# limits an engine names in its own words, and the server flag that sets each (SGLang's server arguments, TGI's
# launcher arguments)
_ENGINE_OWN_LIMITS = {
    "context_length": "raise the server's context length (SGLang: --context-length; vLLM: --max-model-len; with "
                      "rope scaling for a length beyond the model's trained one), or send shorter prompts",
    "max_total_tokens": "raise TGI's --max-total-tokens (and --max-input-tokens), or lower max_new_tokens / send "
                        "shorter inputs",
    "max_input_tokens": "raise TGI's --max-input-tokens (below --max-total-tokens), or send shorter inputs",
}  # fmt: skip


def _limit(facts: LogFacts, ctx: LogContext) -> Cause | None:
    h = facts.first("engine_limit")
    if h is None:
        return None
    f = h.fields
    pl = place(facts, h.line)
    setting = f["setting"]
    key = (
        "max_num_batched_tokens" if setting in ("max_num_batched_tokens", "prompt_limit") else "max_model_len"
    )
    # SGLang's limit is its context_length (--context-length), vLLM's max_model_len: the engine's own key
    shown = setting if setting in _ENGINE_OWN_LIMITS else key
    if setting == "prompt_limit":  # vLLM's limit is min(max_model_len, max_num_batched_tokens): which one?
        key, shown = _binding_limit(facts, f.get("m"))
    failed = (
        bool(facts.traceback_near(h.no, h.line.rank))
        or h.line.text.lstrip().split(":")[0].endswith("Error")
        or failure_signal(h.line) in ("exception", "error")  # an ERROR line, a server's error body
    )
    n, m = f.get("n"), f.get("m")
    noun = "multimodal item" if "mm_item" in h.line.text else "prompt"  # vLLM: max_tokens_per_mm_item
    verl = ctx.framework in (None, "verl")
    return Cause(
        "error" if failed else "warning",
        "engine_limit",
        f"Engine limit: {f'a {n}-token {noun}' if n else 'a request'} over {shown}"
        + (f" ({m})" if m else "") + ("" if failed else ": the request is dropped"),
        f"The inference engine refused {_LIMIT_WHAT[setting]}. The engine's limits come from its configuration "
        "(max_model_len, max_num_batched_tokens, the model's context length), not from memory.",
        evidence=[quote(h.line)] + pl.evidence() + [f"also: {quote(x.line, 160)}" for x in facts.of("engine_limit")[1:3]],
        fixes=fixes(
            ctx,
            advice(_ENGINE_OWN_LIMITS[setting]) if setting in _ENGINE_OWN_LIMITS else None,
            Fix(None, V.ROLLOUT_MAX_NUM_BATCHED_TOKENS if verl else None,
                "raise max_num_batched_tokens to at least max_model_len (chunked prefill lifts the limit too)",
                key=None if verl else "max_num_batched_tokens (--max-num-batched-tokens)",
                framework=None if verl else "vllm") if "max_num_batched_tokens" in shown else None,
            ("max_model_len", "raise the engine's max_model_len to prompt + response length"),
            Fix(None, "data.filter_overlong_prompts=True" if verl else None,
                "or drop prompts over the limit before they reach the engine (data.max_prompt_length)"),
        ),
        where=shown + (f" (at {at})" if (at := pl.tb.culprit() if pl.tb else None) else ""),
        phase="generate",
        rank=pl.rank,
        line=h.no,
        score=42.0,
        data={"setting": key, "length": n, "limit": m},
    )  # fmt: skip


def _binding_limit(facts: LogFacts, limit: str | None) -> tuple[str, str]:
    """(the key, the name shown) of the setting behind vLLM's ``exceeds limit of M``: the prompt limit is
    min(max_model_len, max_num_batched_tokens), so the one the log prints as M (or the one left when the
    log prints the other above M); both when the log shows neither (the message alone cannot tell)."""
    keys = ("max_model_len", "max_num_batched_tokens")
    printed = {key: next((v for k, v in facts.settings.items() if k.endswith(key)), None) for key in keys}
    for key, other in (keys, keys[::-1]):
        if limit and printed[key] == limit:
            return key, key
        if limit and (printed[other] or "").isdigit() and int(printed[other]) > int(limit):
            return key, key  # the other one is printed and larger: this one binds
    return "max_num_batched_tokens", "max_model_len or max_num_batched_tokens"


def _flatten(facts: LogFacts, ctx: LogContext) -> Cause | None:
    h = facts.first("fsdp_flatten", "fsdp_requires_grad")
    if h is None:
        return None
    pl = place(facts, h.line)
    verl = ctx.framework in (None, "verl")
    if h.rule == "fsdp_requires_grad":
        return Cause(
            "error", "exception", "FSDP cannot flatten frozen and trainable parameters into one unit",
            "FSDP1 flattens each wrapped unit's parameters into one flat parameter, which has one "
            "requires_grad: a unit mixing frozen and trainable parameters (LoRA, a frozen tower) fails.",
            evidence=[quote(h.line)] + pl.evidence(),
            fixes=[advice("FullyShardedDataParallel(use_orig_params=True) (accelerate: fsdp_use_orig_params: true), "
                          "or wrap the frozen modules in their own FSDP units")],
            where="use_orig_params", phase=pl.phase or "init", rank=pl.rank, line=h.no, score=40.0,
        )  # fmt: skip
    if h.fields.get("flash"):
        return Cause(
            "error", "dtype_unsupported", "Unsupported dtype: FlashAttention got fp32 inputs (it runs fp16 and bf16 only)",
            "flash-attn has kernels for fp16 and bf16 only: the model (or the attention's inputs) is in fp32, "
            "typically a model loaded without a torch_dtype, or run outside autocast.",
            evidence=[quote(h.line)] + pl.evidence(),
            fixes=fixes(ctx, ("bf16_instead_of_fp16", "run the model in bf16 mixed precision"),
                        advice("load the model with torch_dtype=torch.bfloat16, or attn_implementation='sdpa' "
                               "for an fp32 model")),
            unknown=[], where="flash_attn (fp32 inputs)", phase=pl.phase, rank=pl.rank, line=h.no, score=40.0,
            data={"observed": "fp32", "expected": "bf16"},
        )  # fmt: skip
    dts = [d for d in h.fields["dtypes"] if d]
    shown = " and ".join(dts) or "mixed"
    return Cause(
        "error",
        "dtype_error",
        f"Dtype error: FSDP flattens one dtype per unit, got {shown} parameters",
        "FSDP (FSDP1's flat parameter; FSDP2's fully_shard) needs every parameter of a wrapped unit in one "
        "original dtype; MixedPrecision casts at compute time only. A module loaded or cast into another dtype "
        "(a value head or an lm_head kept in fp32, LoRA weights in fp32 over a bf16 base, a model loaded in "
        "bf16 next to fp32 buffers made trainable) breaks the unit.",
        evidence=[quote(h.line)] + pl.evidence(),
        fixes=[
            Fix("precision.overrides.<role>.param_dtype: fp32", V.MODEL_DTYPE_FP32 if verl else None,
                "load every parameter in one dtype (fp32 master weights; FSDP's mixed precision then computes in bf16)"),
            advice("or cast the odd module (the head, the adapters) to the model's dtype before wrapping, or wrap "
                   "it in its own FSDP unit"),
        ],
        unknown=["which module holds the odd dtype: print {p.dtype for p in module.parameters()} per unit"],
        where="FSDP flat parameter (mixed parameter dtypes)"
        + (f", raised in {pl.tb.frames[-1].func}" if pl.tb and pl.tb.frames else ""),
        phase=pl.phase or "init",
        rank=pl.rank,
        line=h.no,
        score=41.0,
        data={"observed": dts[1] if len(dts) > 1 else None, "expected": dts[0] if dts else None},
    )  # fmt: skip
