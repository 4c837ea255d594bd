"""Python exceptions with a recognisable message: dtype errors (`verlaudit.dtypes`, the parser the live
auditor uses too),
``.numpy()`` on bf16, ops without a kernel for a dtype, device mismatches, torch.compile failures,
import errors (a missing module, an API moved between versions, a native extension built for another
torch: ``undefined symbol``), and framework configuration checks (TRL's ``must be evenly divisible by
the number of generations``, DeepSpeed's ``Check batch related parameters``). Every exception line is
also kept (``exception_line``) for the other families and for the "unrecognised failure" fallback.
Exercised by ``pytest tests/test_log_rules.py -k exceptions``.
"""

from __future__ import annotations

import re
from pathlib import PurePosixPath

from verlaudit import verl_keys as V
from verlaudit.analysis.causes import Cause, Fix, dtype_fixes
from verlaudit.analysis.logs.frameworks import LogContext, advice, applied, fixes, pinned_pair
from verlaudit.analysis.logs.lines import EXCEPTION, LogLine, hints, is_code_line, package_of, parse_frame
from verlaudit.analysis.logs.parts import with_part
from verlaudit.analysis.logs.scan import Hit, LogFacts, place, quote, site
from verlaudit.dtypes import WORDINGS, dtype_name, parse_dtype_message

DEVICE = re.compile(
    r"Expected all tensors to be on the same device, but (?:found at least two devices, )?(.*)"
)
COMPILE = re.compile(
    r"torch\._dynamo\.exc\.\w+[^\n]*|torch\._inductor\.exc\.\w+[^\n]*"
    r"|BackendCompilerFailed[^\n]*|InductorError[^\n]*"
    # torch.compile's own refusals, raised as plain errors ("RuntimeError: torch.compile with fullgraph=True found
    # no compiled frames"); a log line that only mentions torch.compile is not one
    r"|(?:RuntimeError|AssertionError|ValueError): torch\.compile\b[^\n]*"
    # Triton's compiler (a kernel Inductor generated, or a user's @triton.jit) and the guards Inductor's generated
    # code asserts (`assert_size_stride`: "expected size 1280==1280, stride 1==256 at dim=1")
    r"|triton\.compiler\.errors\.\w+[^\n]*|expected size \d+==\d+, stride \d+==\d+ at dim=\d+[^\n]*"
)
# where an exception raised inside the compiler stack comes from (its innermost frame): Dynamo, Inductor, FX, AOT
# autograd (functorch), fake tensors, Triton; and the lines Dynamo prints under any of its errors
_COMPILER_FRAME = re.compile(
    r"/torch/(?:_dynamo|_inductor|fx|_functorch|_subclasses|_export)/|/triton/(?:compiler|runtime|language)/"
)
_DYNAMO_TRAILER = re.compile(
    r"torch\._dynamo\.config\.(?:verbose|suppress_errors)\b|TORCHDYNAMO_VERBOSE=1|Set TORCH_LOGS=\S*dynamo"
)
_DYNAMO_SET = re.compile(r"^\s*((?:torch\.)?_dynamo\.config\.\w+\s*=\s*\S+)\s*$")
# a Dynamo config the message itself points at ("... by adding logging methods to config.ignore_logger_methods")
_DYNAMO_NAMED = re.compile(r"(?<![\w.])(?:torch\._dynamo\.)?config\.(\w+)")
_ATEN = re.compile(r"\baten\.\w+(?:\.(?:default|Tensor|Scalar|int|out|\w+_\w+))?")
_IMPORT = [
    ("missing", re.compile(r"No module named '([\w.]+)'")),
    ("cannot_import", re.compile(r"cannot import name '(\w+)' from '([\w.]+)'")),
    ("symbol", re.compile(r"(\S+\.so[\w.]*): undefined symbol: (\S+)")),
    ("shared_lib", re.compile(r"(lib[\w.+-]+\.so[\w.]*): cannot open shared object file")),
    ("wrapped", re.compile(r"Failed to import ([\w.]+) because of the following error")),
]
# a package's own version attributes, generated into its version module by its build (setuptools-scm's
# __version_tuple__, versioneer's): one that does not import means a broken install of that package
_OWN_VERSION = re.compile(r"^(?:__version__|__version_tuple__|version_tuple|__git_version__|git_version)$")
_CONFIG = [
    ("trl_generations", re.compile(
        r"The (?:effective|global) train batch size \(([^)]*)\) must be evenly divisible by the number of "
        r"generations per prompt \((\d+)\)"
        r"(?:.*?the valid values for the number of generations are: (\[[^\]]*\]))?")),
    ("ds_batch", re.compile(
        r"Check batch related parameters\. train_batch_size is not equal to micro_batch_per_gpu \* "
        r"gradient_acc_step \* world_size\s*(\d+) != (\d+) \* (\d+) \* (\d+)")),
]  # fmt: skip
UNKNOWN_MODULE = (
    "which module: a log has no module tracker; rerun the suite under `verlaudit run` (audit level full)"
)


_HAS = hints(
    "dtype", "scalar type", "type (", "ScalarType", "not implemented for", "device", "dynamo", "inductor",
    "Inductor", "Compiler", "module", "import", "undefined symbol", "shared object", "divisible",
    "batch related", "_dynamo.config", "torch.compile", "expected size", "triton.compiler",
)  # fmt: skip
_DTYPE_HINTS = hints(*(w.hint for w in WORDINGS))
_BY_WORDING = {"numpy": "numpy_dtype", "not_implemented": "not_implemented"}


def detect(line: LogLine) -> list[Hit]:
    """Exception lines and the recognised error messages in one line."""
    text = line.text
    out = []
    m = EXCEPTION.match(text.strip())
    if m and not m["type"].endswith("Warning"):
        out.append(
            Hit("exception_line", line, {"type": m["type"], "inner": m["inner"], "msg": m["msg"] or ""})
        )
    if _DTYPE_HINTS(text):
        d = parse_dtype_message(text)
        if d:
            fields = {
                "observed": d.observed,
                "expected": d.expected,
                "message": d.message,
                "op": d.op,
                "what": d.what,
            }
            out.append(Hit(_BY_WORDING.get(d.wording, "dtype_error"), line, fields))
    if text.startswith("    ") and (mc := _BARE_CALL.search(text)):  # a frame's source line (its frame cut)
        out.append(Hit("code_call", line, {"call": mc[1], "args": _args(text, mc.end())}))
    elif "(" in text and (mc := _PASTED_CALL.match(text)):  # IPython's `---> 67 ...`, or the line pasted bare
        out.append(Hit("code_call", line, {"call": mc[1], "args": _args(text, mc.end())}))
    if text.strip() == "from user code:":  # Dynamo names the user frame it was tracing on the next line
        out.append(Hit("compile_user_code", line, want=8))
    if "_dynamo.config." in text and (
        mc := _DYNAMO_SET.match(text)
    ):  # the fallback Dynamo prints under its error
        out.append(Hit("dynamo_config_set", line, {"set": mc[1]}))
    if ("DYNAMO" in text or "_dynamo" in text or "dynamo" in text) and _DYNAMO_TRAILER.search(text):
        out.append(Hit("dynamo_trailer", line))
    if not _HAS(text):
        return out
    for rule, pat in (
        ("device_mismatch", DEVICE),
        ("compile_error", COMPILE),
    ):
        mm = pat.search(text)
        if mm:
            out.append(
                Hit(
                    rule,
                    line,
                    {"groups": mm.groups(), "match": mm[0]},
                    want=2 if rule == "compile_error" else 0,
                )
            )
    for rule, pat in _IMPORT + _CONFIG:
        mm = pat.search(text)
        if mm and rule == "shared_lib" and re.search(r"\bNCCL (?:INFO|WARN)\b", text):
            continue  # NCCL's own lines: a plugin probe that falls back (INFO), or the NCCL rule's (WARN)
        if mm:
            out.append(Hit(rule, line, {"groups": mm.groups()}))
    return out


def explain(facts: LogFacts, ctx: LogContext) -> list[Cause]:
    """Dtype, device, compile, import and configuration causes."""
    return [
        c
        for c in (
            _dtype(facts, ctx),
            _numpy(facts, ctx),
            _not_impl(facts, ctx),
            _device(facts, ctx),
            _compile(facts, ctx),
            _import(facts, ctx),
            _config(facts, ctx),
        )
        if c
    ]


_OPERAND = re.compile(r"\b(\w+)\.dtype:?\s*((?:c10::)?[\w:.]+)")
_PAIR = re.compile(r"\b([A-Za-z_]\w*) and (\w+) (?:must|should|to) (?:have|be) (?:the )?same dtype")


def dtype_title(text: str, observed: str | None, expected: str | None) -> str:
    """A dtype error's title from every operand the message names (``query fp32, key fp32, value
    bf16``), the observed / expected pair when that is all it says, or the operands alone when it
    names no dtype (``self and mat2 must have the same dtype``)."""
    ops = [(n, dtype_name(t.rstrip(",.")) or t) for n, t in _OPERAND.findall(text)]
    if len(ops) >= 3 or (len(ops) == 2 and observed == expected):
        return "Dtype error: " + ", ".join(f"{n} {t}" for n, t in ops) + " (one op needs one dtype)"
    if observed is None and expected is None:
        m = _PAIR.search(text)
        if m:
            return f"Dtype error: {m[1]} and {m[2]} of different dtypes (the message names neither dtype)"
        return "Dtype error: operands of different dtypes (the message names neither dtype)"
    m = _PAIR.search(text)
    if m and observed and expected and m[1] != "vectors":
        return f"Dtype error: {m[1]} {observed}, {m[2]} {expected}"
    return f"Dtype error: {observed or '?'} where {expected or '?'} was expected"


# the call a source line makes, its result assigned or not (`out, q = flash_attn_cuda.varlen_fwd(`)
_BARE_CALL = re.compile(r"^\s+(?:[\w\[\], .]+=\s*)?(?:return\s+)?([A-Za-z_][\w.]*)\(")
# a source line a reporter pasted above the error without its frame: IPython's marked line (`---> 67     return f(`)
# or the statement alone (`torch.matmul(a, self.w)`, `out = self.proj(x)`): a dotted call, not prose
_PASTED_CALL = re.compile(
    r"^(?:-*>\s*\d+\s+)?(?:[\w\[\], .]+=\s*)?(?:return\s+)?((?:[A-Za-z_]\w*\.)+[A-Za-z_]\w*|[a-z_]\w*_\w*)\("
)


def _args(text: str, start: int) -> str | None:
    """The arguments a call's source line passes, when they close on that line (``a, self.w``)."""
    depth, i = 1, start
    while i < len(text) and depth:
        depth += {"(": 1, ")": -1}.get(text[i], 0)
        i += 1
    args = text[start : i - 1].strip() if depth == 0 else ""
    return args[:120] or None


def _operands_where(where: str | None, tb, facts: LogFacts | None = None, no: int = 0) -> str | None:
    """A dtype error's place with the operands its op got (`scan.site`): the message names the dtypes,
    the frame names the tensors; a paste cut to the source line above the message names the call."""
    at = site(tb)
    if at:
        return f"{where or tb.frames[-1].func} ({at})"
    if facts is not None and (tb is None or not tb.frames):
        calls = [h for h in facts.of("code_call") if 0 < no - h.no <= 2]
        if calls:
            c = calls[-1].fields
            call = c["call"] + (f"({c['args']})" if c.get("args") else "")
            return f"{where} / {call}" if where else call
    return where


def _dtype(facts: LogFacts, ctx: LogContext) -> Cause | None:
    h = facts.first("dtype_error")
    if h is None:
        return None
    d = h.fields
    pl = place(facts, h.line)
    obs, exp = d.get("observed"), d.get("expected")
    under = applied("bf16_instead_of_fp16", ctx)
    what = (
        d.get("what")
        or "An op received operands (or input and weights) of different dtypes outside autocast."
    )
    if under:
        what += (
            " The log shows bf16 mixed precision already set: a tensor or module kept in another dtype (a "
            "value "
            "or reward head, an lm_head upcast to fp32, an input built as float) met the bf16 compute."
        )
    if ctx.framework in (None, "verl"):
        fx = [f for f in dtype_fixes(obs) if not (under and f.verl == V.PARAM_DTYPE_BF16)]
        if under:
            fx.insert(
                0,
                advice(
                    "cast the module that produced the odd tensor to the compute dtype, or run it under "
                    "autocast; the setting is already bf16"
                ),
            )
    else:
        fx = fixes(
            ctx,
            advice(
                "the model and what feeds it must share one compute dtype: with bf16=True / fp16=True the "
                "Trainer "
                "autocasts its own forward, but a model loaded in bf16 meeting fp32 inputs or a head kept "
                "in fp32 "
                "(value head, lm_head cast) outside that forward fails",
                suite="precision.preset: bf16",
            ),
            advice(
                "under DeepSpeed the engine casts the wrapped model to bf16 / fp16 itself; modules used "
                "outside it "
                "(generation with the unwrapped model, reward / value models) must be cast the same way"
            )
            if ctx.shows("deepspeed")
            else None,
            ("bf16_instead_of_fp16", "mixed precision on: ops cast their inputs") if not under else None,
        )
    if "grad_dtype" in (
        d.get("message") or ""
    ):  # not operands: the parameter's gradient dtype, fixed at init
        fx = [
            advice(
                "FSDP2 fixes each parameter's gradient dtype when it initialises lazily (the first forward), from "
                "the parameters that require grad then: make them trainable before that first forward (or "
                "call the root module's _lazy_init() while they are), and run frozen passes under "
                "torch.no_grad() instead of requires_grad_(False); setting the parameter's grad_dtype = None "
                "only silences the check"
            ),
        ] + fx
    return Cause(
        "error",
        "dtype_error",
        dtype_title(h.line.text, obs, exp),
        what,
        evidence=[quote(h.line)] + pl.evidence(),
        fixes=fx,
        unknown=[UNKNOWN_MODULE],
        where=with_part(_operands_where(pl.culprit(), pl.tb, facts, h.no), facts, h.no),
        phase=pl.phase,
        rank=pl.rank,
        line=h.no,
        score=40.0,
        data={"observed": obs, "expected": exp},
    )


def _numpy(facts: LogFacts, ctx: LogContext) -> Cause | None:
    h = facts.first("numpy_dtype")
    if h is None:
        return None
    name = h.fields["message"].rsplit(" ", 1)[-1]
    pl = place(facts, h.line)
    return Cause(
        "error",
        "dtype_error",
        f"{name} tensor converted to numpy",
        f"NumPy has no {name}: a `.numpy()` / `np.asarray` on a {dtype_name(name)} tensor fails. "
        "In RL code this is usually a reward model or a logging/metrics hook receiving bf16 outputs.",
        evidence=[quote(h.line)] + pl.evidence(),
        fixes=[
            Fix(None, None, "call `.float()` before `.numpy()` (or `.to(torch.float32)`)"),
            Fix(
                "precision.overrides.reward.compute_dtype: fp32",
                V.REWARD_MODEL_DTYPE_FP32 if ctx.framework in (None, "verl") else None,
                "or keep the role whose output is converted in fp32",
            ),
        ],
        unknown=[UNKNOWN_MODULE],
        where=pl.culprit(),
        phase=pl.phase,
        rank=pl.rank,
        line=h.no,
        score=35.0,
        data={"observed": dtype_name(name), "expected": "fp32"},
    )


def _not_impl(facts: LogFacts, ctx: LogContext) -> Cause | None:
    h = facts.first("not_implemented")
    if h is None:
        return None
    op, dt = h.fields["op"], h.fields["message"].rsplit("'", 2)[-2]
    pl = place(facts, h.line)
    return Cause(
        "error",
        "dtype_error",
        f"Op {op} has no {dtype_name(dt)} kernel on this device",
        f"'{op}' is not implemented for {dt} here (typically fp16 matmuls on CPU, or an old GPU without "
        "bf16).",
        evidence=[quote(h.line)] + pl.evidence(),
        fixes=[
            Fix("precision.preset: fp32", None, "on CPU run fp32 or bf16"),
            Fix(
                "device: cuda",
                V.DEVICE_CUDA if ctx.framework in (None, "verl") else None,
                "fp16 kernels exist on the GPU",
            ),
        ],
        where=pl.culprit() or op,
        phase=pl.phase,
        rank=pl.rank,
        line=h.no,
        score=35.0,
        data={"observed": dtype_name(dt)},
    )


def _device(facts: LogFacts, ctx: LogContext) -> Cause | None:
    h = facts.first("device_mismatch")
    if h is None:
        return None
    pl = place(facts, h.line)
    offload = ctx.is_true("param_offload", "optimizer_offload", "offload_param.device")
    return Cause(
        "error",
        "device_mismatch",
        "Tensors on different devices",
        "An op mixed tensors on two devices: typically a reward function or collator returned CPU tensors, "
        "or "
        "an offloaded model (param_offload) was called without being moved back."
        + (" The log shows offloading switched on." if offload else ""),
        evidence=[quote(h.line)] + pl.evidence(),
        fixes=[
            Fix(
                "data.reward_fn: <return tensors on the batch's device or plain floats>",
                V.REWARD_MANAGER if ctx.framework in (None, "verl") else None,
                "the trainer converts lists/floats itself",
            )
        ],
        unknown=[UNKNOWN_MODULE],
        where=pl.culprit(),
        phase=pl.phase,
        rank=pl.rank,
        line=h.no,
        score=35.0,
    )


_OFF_WHERE = "compilation disabled (TORCH_COMPILE_DISABLE, TORCHDYNAMO_DISABLE or torch.compiler.disable)"


def _compile_off(said: str) -> Fix | None:
    """The remedy when compilation is switched off while the code still demands a compiled graph
    (fullgraph=True): PyTorch's "Dynamo tracing is disabled" / "torch.compile is disabled" under the error."""
    if not re.search(r"(?:Dynamo tracing|torch\.compile|compilation) is disabled", said, re.I):
        return None
    return advice(
        "compilation is disabled (TORCH_COMPILE_DISABLE=1 / TORCHDYNAMO_DISABLE=1 or torch.compiler.disable) "
        "while a fullgraph=True region needs a compiled frame: use TORCHDYNAMO_DISABLE=1 instead of "
        "TORCH_COMPILE_DISABLE=1, or drop fullgraph=True / compile where compilation is off"
    )


def compiled_exception(facts: LogFacts) -> Hit | None:
    """An exception no compile message names that the compiler stack raised all the same: its innermost frame is
    Dynamo's, Inductor's, FX's, AOT autograd's or Triton's (an ``AssertionError`` in Dynamo's variable tracker, a
    ``KeyError`` in an FX pass), or Dynamo's trailer ("Set torch._dynamo.config.verbose=True", "fall back to eager
    by setting torch._dynamo.config.suppress_errors") follows it, or Dynamo's "from user code:" does. The cause
    built from it is marked ``by_frames``: another family's cause on the same line (a CUDA OOM inside a compiled
    graph) wins over it (`verlaudit.analysis.logs.explain`)."""
    after = [x.no for x in facts.of("dynamo_trailer", "compile_user_code")]
    for h in facts.of("exception_line"):
        if "Warning" in h.fields.get("type", "") or "out of memory" in (h.fields.get("msg") or "").lower():
            continue
        tb = facts.traceback_near(h.no, h.line.rank)
        inner = tb.frames[-1].path.replace("\\", "/") if tb and tb.frames else ""
        if _COMPILER_FRAME.search(inner) or any(0 < n - h.no <= 12 for n in after):
            return h
    return None


# long: one compile cause from its message or its frames: the op, the backend import, the traced frame, the advice
def _compile(facts: LogFacts, ctx: LogContext) -> Cause | None:
    h = facts.first("compile_error")
    by_frames = h is None
    if h is None:
        h = compiled_exception(facts)
    if h is None:
        return None
    pl = place(facts, h.line)
    said = h.text()  # the error with the lines under it (Inductor prints the failing op's message there)
    op = _ATEN.search(said)
    advised = [
        advice(f"the message's own advice: torch._dynamo.config.{n}, set as the message says")
        for n in dict.fromkeys(_DYNAMO_NAMED.findall(said))
    ] + [
        advice(f"the message's own advice: {x.fields['set']} (falls back to eager where Dynamo fails)")
        for x in facts.of("dynamo_config_set")[:1]
    ]
    decode = any(
        "rollout.py" in f.path or "_decode_forward" in f.func for tb in facts.tracebacks for f in tb.frames
    )
    verlish = ctx.framework in (None, "verl")
    rollout_fix = Fix(
        "rollout.compile: false", None, "the rollout's compiled decode step (the CUDA graph still applies)"
    )
    layer_fix = Fix(
        "model.compile: false", V.TORCH_COMPILE_OFF if verlish else None, "the compiled training layers"
    )
    trace = advice(
        "drop torch.compile on the failing module (or mark the data-dependent code with "
        "torch.compiler.disable / allow graph breaks) and run it eagerly"
    )
    user = facts.first("compile_user_code")
    traced = [f"while tracing {user.follow[0].strip()[:300]}"] if user and user.follow else []
    # the backend's own error, printed under "raised:": an import of a name its library does not export is
    # a torch / compiler-library version pair (Inductor importing triton's triton_key), not the traced code
    inner = next((x for x in facts.of("cannot_import") if 0 <= x.no - h.no <= 3), None)
    lib = inner.fields["groups"][1].split(".")[0] if inner else None
    if inner:
        name = inner.fields["groups"][0]
        traced.append(f"the backend failed on: {quote(inner.line)}")
        fx = [
            advice(
                f"install the {lib} release the installed torch was built with (torch pins it: `pip show torch` "
                f"/ its requirements; pip install '{lib}==<that version>'), so {lib} exports {name} again"
            )
        ]
        fx += [layer_fix] if verlish else [trace]
    else:
        fx = [rollout_fix, layer_fix] if decode else ([layer_fix, rollout_fix] if verlish else [trace])
    off = _compile_off(said)
    fx = advised + ([off] if off else []) + fx
    g = inner.fields["groups"] if inner else ()
    # the place: the traceback's own frames, unless they are all the compiler's (then the frame Dynamo traced)
    own = [f for f in pl.tb.frames if not _COMPILER_FRAME.search(f.path.replace("\\", "/"))] if pl.tb else []
    where = (
        op[0]
        if op
        else f"{g[1]} ({g[0]})"
        if g
        else ((own and pl.culprit()) or _traced_frame(user) or pl.culprit())
    )
    raised_in = None
    stride = "stride" in h.fields.get("match", "") and "at dim=" in h.fields.get("match", "")
    if stride and not where:
        where = "torch._inductor compiled graph (assert_size_stride)"
    if by_frames:  # the compiler module that raised it, from the innermost frame
        tb = pl.tb
        path = tb.frames[-1].path.replace("\\", "/") if tb and tb.frames else ""
        mm = _COMPILER_FRAME.search(path)
        raised_in = mm[0].strip("/").replace("/", ".") if mm else "torch._dynamo"
        where = f"{where} ({raised_in})" if where else raised_in
    return Cause(
        "error",
        "compile_error",
        (
            "torch.compile refused: compilation is disabled (TORCH_COMPILE_DISABLE / TORCHDYNAMO_DISABLE) but a "
            "fullgraph region needs a compiled frame"
            if off
            else "torch.compile failed"
        )  # fmt: skip
        + (f": {h.line.text.strip()[:120]} raised inside {raised_in}" if raised_in else "")
        + (
            ": the compiled graph's size/stride guard failed (a tensor laid out otherwise than it was compiled for)"
            if stride
            else ""
        )
        + (f" on {op[0]}" if op else "")
        + (
            f": its backend cannot import {inner.fields['groups'][0]} from {lib} (a {lib} release torch was not built with)"
            if inner
            else ""
        )
        + (" in the rollout's decode step" if decode else ""),
        "Dynamo could not trace the code (an unsupported call, data-dependent control flow, a graph break "
        "under fullgraph) or Inductor could not compile it. Nothing is wrong with the run's numerics: the "
        "eager path runs the same model.",
        evidence=[quote(h.line)] + pl.evidence() + traced,
        fixes=fx,
        where=_OFF_WHERE if off else where,
        phase=pl.phase,
        rank=pl.rank,
        line=h.no,
        score=35.0,
        data={"by_frames": by_frames},
    )


def _traced_frame(user: Hit | None) -> str | None:
    """The user's frame Dynamo was tracing (the frame line under "from user code:" and its source line):
    ``pkg/model.py:185 forward: fuse_object_embeddings``."""
    frames = []
    for i, text in enumerate(user.follow if user else []):
        if (f := parse_frame(text)) is not None:
            nxt = user.follow[i + 1] if i + 1 < len(user.follow) else ""
            f.code = nxt.strip() if is_code_line(nxt) and parse_frame(nxt) is None else None
            frames.append(f)
        elif text.strip() and not is_code_line(text):
            break  # the trailer after the stack
    f = next(
        (f for f in reversed(frames) if f.func not in ("wrapper", "inner", "_call_impl", "forward_call")),
        None,
    )
    if f is None:
        return None
    short = "/".join(f.path.replace("\\", "/").split("/")[-2:])
    return f"{short}:{f.lineno} {f.where()}"


def _package(so_path: str) -> str:
    """The package a native extension belongs to
    (``.../flash_attn_2_cuda.cpython-310-...so`` -> flash_attn)."""
    p = PurePosixPath(so_path)
    if p.parent.name and p.parent.name not in ("site-packages", "dist-packages", "lib", ""):
        return p.parent.name
    stem = p.name.split(".", 1)[0]
    while True:
        shorter = re.sub(r"_(?:\d+|cuda|C|ext|kernels?|lib)$", "", stem)
        if shorter == stem or not shorter:
            return stem
        stem = shorter


def _import_reading(rule: str, g: tuple) -> tuple[str, str, str, str]:
    """(package, title, what, fix) for one kind of import failure."""
    if rule == "symbol":
        pkg = _package(g[0])
        pip = pkg.replace("_", "-")
        abi = re.match(r"_ZN(?:3c10|2at|5torch)", g[1]) is not None  # a c10 / ATen / torch symbol
        against = (
            "torch (a c10 / ATen symbol is missing): a binary for another torch ABI" if abi else "a library"
        )
        return (
            pkg,
            f"{pkg}: native extension does not load (undefined symbol)",
            f"{pkg}'s compiled extension was built against another version of {against}.",
            f"reinstall {pip} as a build for the installed torch and CUDA (the matching wheel, or pip "
            "install "
            f"--no-build-isolation {pip} to build against it)",
        )
    if rule == "shared_lib":
        return (
            g[0],
            f"Shared library {g[0]} not found",
            "A native library a package needs is not on the loader path.",
            "install the CUDA / system library the wheel was built for, or a wheel built for the installed "
            "one",
        )
    if rule == "missing":
        pkg = g[0].split(".")[0]
        return (
            pkg,
            f"No module named '{g[0]}'",
            f"{pkg} is not installed in the environment the code ran in.",
            f"pip install {pkg.replace('_', '-')} (the version the framework pins)",
        )
    if rule == "cannot_import":
        pkg = g[1].split(".")[0]
        return (
            pkg,
            f"cannot import {g[0]} from {g[1]}",
            f"The installed {pkg} does not provide {g[0]}: a version the calling code was not written for.",
            f"install the {pkg} version the framework pins (its requirements / setup), not the latest",
        )
    return (
        g[0],
        f"Failed to import {g[0]}",
        "A lazy import failed; the underlying error is printed after it.",
        "read the error under 'Failed to import': the missing package or the broken binary it names",
    )


_RAY_ENV = (
    "the import ran inside a Ray actor: install the package in the environment Ray starts workers in, on "
    "every "
    "node, or ship it with the job (ray job submit --runtime-env-json '{\"pip\": [...]}', or "
    "runtime_env={'pip': [...]} in ray.init)"
)


def _importer(tb) -> str | None:
    """``pkg/mod/file.py``: the user's file whose import statement failed (the innermost frame whose source line
    imports), the module that needs the package (logsg branch)."""
    for f in reversed(tb.frames if tb else []):
        if f.code and re.match(r"\s*(?:from\s+[\w.]+\s+)?import\b", f.code) and not f.library:
            return "/".join(f.path.replace("\\", "/").split("/")[-4:])
    return None


def _import(facts: LogFacts, ctx: LogContext) -> Cause | None:
    hits = facts.of("missing", "cannot_import", "symbol", "shared_lib", "wrapped")
    if not hits:
        return None

    # a library that logs its own import failure as a WARNING carries on without the part (vLLM's "Failed to
    # import from vllm._C with ImportError(...)"): a degraded run, not the error that ended it; an import error
    # the run raised (in a traceback, at error level) is read first
    def warned(x: Hit) -> bool:
        return (x.line.level or "").upper().startswith("W") and not any(
            tb.start <= x.no <= tb.end for tb in facts.tracebacks
        )

    pool = [x for x in hits if not warned(x)] or hits
    first = {h.rule: h for h in reversed(pool)}  # the first hit of each kind; the most telling kind wins
    h = next(first[r] for r in ("symbol", "shared_lib", "missing", "cannot_import", "wrapped") if r in first)
    pkg, title, what, fix_text = _import_reading(h.rule, h.fields["groups"])
    own_version = h.rule == "cannot_import" and _OWN_VERSION.match(h.fields["groups"][0]) is not None
    wrapped = {t.fields["groups"][0] for t in facts.of("ray_task")}
    in_ray = bool(wrapped & {"ModuleNotFoundError", "ImportError"}) or h.line.source is not None
    pl = place(facts, h.line)
    kind, where = "import_error", pkg
    if h.rule == "symbol":  # the native extension that does not load, when its name is not the package's
        ext = PurePosixPath(h.fields["groups"][0]).name.split(".", 1)[0]
        where = f"{pkg} ({ext})" if ext != pkg else pkg
    if own_version:  # its own version does not import: the package's install is broken, not another's pin
        pkg, title, what, fix_text, where = _broken_install(h, hits)
    elif h.rule == "cannot_import":  # a name the installed package does not export: a version pair
        importer = next(
            (p for f in reversed(pl.tb.frames if pl.tb else []) if (p := package_of(f.path)) and p != pkg),
            None,
        )
        kind, where = "version_mismatch", f"{importer} -> {pkg}" if importer else pkg
        if "." in h.fields["groups"][1]:  # the module that lacks the name, whole (logsg branch)
            where += f" ({h.fields['groups'][1]}.{h.fields['groups'][0]})"
        if importer:
            fix_text = (
                f"install the {pkg} version {importer} pins (its requirements / setup), or a {importer} "
                f"release written for the installed {pkg}"
            )
    # a package the framework installs through an extra of its own (NeMo-RL's `uv run --extra mcore` brings
    # nemo and megatron; `trl[vllm]`): the extra, not the bare package, which may be another project of the name
    framework = next(
        (p for f in reversed(pl.tb.frames if pl.tb else []) if (p := package_of(f.path)) and p != pkg),
        (ctx.framework or "").replace("-", "_"),
    )
    if h.rule in ("missing", "cannot_import") and not own_version and (imp := _importer(pl.tb)):
        where += f" (imported by {imp})"
    if h.rule == "cannot_import":  # which side is older the log rarely says: both remedies, as commands
        name, pip = h.fields["groups"][0], pkg.replace("_", "-")
        fix_text += (
            f"; if the installed {pkg} predates {name}: pip install --upgrade {pip}; if it removed {name}: pin "
            f"{pip} to the release the importing code was written for"
        )
    extra = (
        pinned_pair(framework, pkg) if h.rule in ("missing", "cannot_import") and not own_version else None
    )
    if extra is not None and h.rule == "missing":
        where += f" ({framework} installs it with {extra.why.split(':', 1)[0]})"
    return Cause(
        "warning" if warned(h) else "error",
        kind,
        title,
        what,
        evidence=[quote(x.line) for x in hits[:3]] + pl.evidence(),
        fixes=fixes(ctx, extra, advice(fix_text), advice(_RAY_ENV) if in_ray else None),
        where=where,
        phase="init",
        rank=pl.rank,
        line=h.no,
        score=46.0,
    )


def _broken_install(h: Hit, hits: list[Hit]) -> tuple[str, str, str, str, str]:
    """(package, title, what, fix, where) of a package that cannot import its own version attribute: its
    install is broken (with its native extension's undefined symbol, when the log shows one, as the reason)."""
    name, module = h.fields["groups"]
    pkg = module.split(".")[0]
    sym = next((x for x in hits if x.rule == "symbol" and _package(x.fields["groups"][0]) == pkg), None)
    title = f"{pkg}: broken install (its own {name} does not import)"
    what = (
        f"{pkg} cannot import its own version attribute ({name}, written into its version module when the "
        "package is built): the installed copy is a build that did not finish, an editable / source checkout "
        "whose build step was not run, or files of two installs mixed in one site-packages"
        + (
            f"; its compiled extension does not load either ({quote(sym.line, 160)}): it was built against "
            "another torch"
            if sym
            else ""
        )
        + "."
    )
    fix_text = (
        f"reinstall {pkg} cleanly (pip uninstall {pkg.replace('_', '-')}, then the wheel built for the installed "
        "torch and CUDA, or rebuild from source with pip install --no-build-isolation -e .)"
    )
    where = f"{pkg} ({PurePosixPath(sym.fields['groups'][0]).name.split('.', 1)[0]})" if sym else pkg
    return pkg, title, what, fix_text, where


def _config(facts: LogFacts, ctx: LogContext) -> Cause | None:
    h = facts.first("trl_generations", "ds_batch")
    if h is None:
        return None
    g = h.fields["groups"]
    pl = place(facts, h.line)
    if h.rule == "trl_generations":
        valid = g[2] or "a divisor of it"
        title, where = f"GRPO batch ({g[0]}) is not divisible by num_generations={g[1]}", "num_generations"
        what = (
            "GRPO groups each prompt's generations inside one effective batch (processes x per-device "
            "batch x "
            "accumulation steps), so num_generations must divide it."
        )
        fx = [
            Fix(
                None,
                None,
                f"set num_generations to one of {valid}, or change per_device_train_batch_size / "
                "gradient_accumulation_steps / the number of processes so it divides the batch",
                key="GRPOConfig.num_generations",
                framework="trl",
            )
        ]
    else:
        title, where = (
            f"DeepSpeed batch sizes inconsistent: {g[0]} != {g[1]} x {g[2]} x {g[3]}",
            "train_batch_size",
        )
        what = (
            "DeepSpeed requires train_batch_size = micro batch per GPU x gradient accumulation steps x "
            "world size."
        )
        fx = [
            Fix(
                None,
                None,
                'give two of the three (or "auto" under the HF Trainer / accelerate) and let DeepSpeed '
                "derive the third",
                key="train_batch_size / train_micro_batch_size_per_gpu / gradient_accumulation_steps",
                framework="deepspeed",
            )
        ]
    return Cause(
        "error",
        "exception",
        title,
        what,
        evidence=[quote(h.line)] + pl.evidence(),
        fixes=fx,
        where=where,
        phase="init",
        rank=pl.rank,
        line=h.no,
        score=44.0,
    )
