"""The registry of finding kinds (verlaudit/kinds.py) against what the audit writes and diagnose reads.

Every kind the audit writes (found by reading verlaudit/audit/ source: ``Finding(kind=...)``, the
helpers that pass a kind on to one, ``kind = ...`` before it, comparisons with ``.kind``) is a
registered constant, never a string (the scan is shown to fail on planted ones); every registered
kind has a class and a one-line meaning and is written somewhere; the rule table speaks the
registry's classes; and a run directory written with the old catch-all kinds reads as the new kinds
and diagnoses the same as one written with them. Run: `pytest tests/test_kinds.py`.
"""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import pytest

from verlaudit import kinds as K
from verlaudit.analysis.diagnose.diagnosis import diagnose_run
from verlaudit.analysis.diagnose.rules import RULES
from verlaudit.rundir import RunWriter, current_kind, read_run

ROOT = Path(__file__).resolve().parents[1]
AUDIT = ROOT / "verlaudit" / "audit"
INTEGRATIONS = ROOT / "verlaudit" / "integrations"
REGISTRY_NAMES = {"K", "kinds"}
"""How audit code names verlaudit.kinds (``from verlaudit import kinds as K``)."""


# ---------------------------------------------------------------- the scan of the audit's source


def _helpers(tree: ast.Module) -> dict[str, tuple[int, bool]]:
    """Functions that hand their ``kind`` parameter to ``Finding(kind=kind)`` (writers), or compare it
    with a finding's ``.kind`` (readers: `FindingLog.find`): name -> (its position among the call's
    arguments, ``self`` not counted; whether it writes)."""
    out = {}
    for fn in ast.walk(tree):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        names = [a.arg for a in fn.args.args]
        if "kind" not in names + [a.arg for a in fn.args.kwonlyargs]:
            continue
        writes = any(
            isinstance(c, ast.Call)
            and _is_finding(c.func)
            and any(
                k.arg == "kind" and isinstance(k.value, ast.Name) and k.value.id == "kind" for k in c.keywords
            )
            for c in ast.walk(fn)
        )
        reads = any(
            isinstance(c, ast.Compare)
            and any(isinstance(x, ast.Attribute) and x.attr == "kind" for x in (c.left, *c.comparators))
            and any(isinstance(x, ast.Name) and x.id == "kind" for x in (c.left, *c.comparators))
            for c in ast.walk(fn)
        )
        if writes or reads:  # a keyword-only kind has no position (-1)
            at = names.index("kind") - (names[:1] == ["self"]) if "kind" in names else -1
            out[fn.name] = (at, writes)
    return out


def _is_finding(func: ast.expr) -> bool:
    return (isinstance(func, ast.Name) and func.id == "Finding") or (
        isinstance(func, ast.Attribute) and func.attr == "Finding"
    )


def _callee(func: ast.expr) -> str | None:
    return func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None


def _kind_expressions(tree: ast.Module, helpers: dict[str, tuple[int, bool]]) -> list[tuple[ast.expr, bool]]:
    """(expression, strict): what the source gives as a finding's kind. ``strict`` False for the other
    side of a ``.kind`` comparison and a reader's argument, where only a ``family/name`` string is a
    finding kind (module records have kinds too: ``call.kind == "linear"``; ``str.find`` is a method too)."""
    out: list[tuple[ast.expr, bool]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            name = _callee(node.func)
            at, strict = helpers.get(name, (-1, True))
            if _is_finding(node.func) or name in helpers:
                out += [(k.value, strict) for k in node.keywords if k.arg == "kind"]
            if 0 <= at < len(node.args):
                out.append((node.args[at], strict))
        elif isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            if any(isinstance(s, ast.Attribute) and s.attr == "kind" for s in sides):
                out += [(s, False) for s in sides if not (isinstance(s, ast.Attribute) and s.attr == "kind")]
    return out


def _assignments(nodes) -> dict[str, list[ast.expr]]:
    """Names assigned in ``nodes`` (a function's body and its parameters' defaults, or a module's
    top-level statements) -> the values assigned."""
    out: dict[str, list[ast.expr]] = {}
    for node in nodes:
        if isinstance(node, ast.Assign):
            for t in node.targets:
                if isinstance(t, ast.Name):
                    out.setdefault(t.id, []).append(node.value)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.value is not None:
            out.setdefault(node.target.id, []).append(node.value)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):  # a parameter's default
            args = node.args.args[len(node.args.args) - len(node.args.defaults) :]
            for a, d in [*zip(args, node.args.defaults), *zip(node.args.kwonlyargs, node.args.kw_defaults)]:
                if d is not None:
                    out.setdefault(a.arg, []).append(d)
    return out


def _leaves(expr: ast.expr, assigned: dict[str, list[ast.expr]], seen: frozenset = frozenset()):
    """What an expression can evaluate to, as ("literal", text) / ("constant", NAME) / ("built", source);
    a name is followed to what is assigned to it in the file (a parameter without default: nothing)."""
    if isinstance(expr, ast.Constant):
        if isinstance(expr.value, str):
            yield "literal", expr.value
    elif (
        isinstance(expr, ast.Attribute)
        and isinstance(expr.value, ast.Name)
        and expr.value.id in REGISTRY_NAMES
    ):
        yield "constant", expr.attr
    elif isinstance(expr, ast.Name):
        if expr.id not in seen:
            for v in assigned.get(expr.id, []):
                yield from _leaves(v, assigned, seen | {expr.id})
    elif isinstance(expr, ast.IfExp):
        yield from _leaves(expr.body, assigned, seen)
        yield from _leaves(expr.orelse, assigned, seen)
    elif isinstance(expr, (ast.Tuple, ast.List, ast.Set)):
        for e in expr.elts:
            yield from _leaves(e, assigned, seen)
    elif isinstance(expr, ast.Starred):
        yield from _leaves(expr.value, assigned, seen)
    elif isinstance(expr, ast.Call) and _callee(expr.func) in ("frozenset", "set", "tuple"):
        for a in expr.args:
            yield from _leaves(a, assigned, seen)
    elif isinstance(expr, (ast.JoinedStr, ast.BinOp)):
        yield "built", ast.unparse(expr)


def scan(
    source: str, filename: str = "<source>", helpers: dict[str, tuple[int, bool]] | None = None
) -> tuple[set[str], list[str]]:
    """(the registered kinds the source writes, one line per problem: a kind written as a string, a
    constant that is not a registered kind, a kind built from pieces). ``helpers``: the functions of
    other files that pass a kind on to a Finding (`_helpers`)."""
    tree = ast.parse(source, filename=filename)
    module = _assignments(n for n in tree.body if not isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)))
    scope_of: dict[int, dict[str, list[ast.expr]]] = {}  # id(node) -> the names its function assigns
    for fn in ast.walk(tree):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            own = _assignments(ast.walk(fn))
            for node in ast.walk(fn):
                scope_of[id(node)] = {**module, **own}  # the innermost function walks last and wins
    written: set[str] = set()
    problems: list[str] = []
    for expr, strict in _kind_expressions(tree, {**(helpers or {}), **_helpers(tree)}):
        where = f"{filename}:{expr.lineno}"
        for what, text in _leaves(expr, scope_of.get(id(expr), module)):
            if what == "constant":
                value = getattr(K, text, None)
                if isinstance(value, str) and value in K.FINDINGS:
                    written.add(value)
                else:
                    problems.append(f"{where}: K.{text} is not a kind registered in verlaudit/kinds.py")
            elif what == "built":
                problems.append(f"{where}: a kind built at run time ({text}); use a registered constant")
            elif text.endswith("/") and any(k.startswith(text) for k in K.FINDINGS):
                continue  # a family, as `FindingLog.find` takes one
            elif strict or "/" in text:
                known = "registered: use its constant" if text in K.FINDINGS else "not registered"
                problems.append(f"{where}: kind {text!r} written as a string ({known})")
    return written, problems


def scan_audit() -> tuple[set[str], list[str]]:
    files = sorted(AUDIT.glob("*.py")) + sorted(INTEGRATIONS.glob("*.py"))  # plug24: the own loop's checks
    sources = {p: p.read_text(encoding="utf-8") for p in files}
    helpers = {k: v for text in sources.values() for k, v in _helpers(ast.parse(text)).items()}
    written: set[str] = set()
    problems: list[str] = []
    for path, text in sources.items():
        w, p = scan(text, str(path.relative_to(ROOT)), helpers)
        written |= w
        problems += p
    return written, problems


def test_every_kind_the_audit_writes_is_a_registered_constant():
    written, problems = scan_audit()
    assert problems == []
    # and the registry holds nothing the audit never writes
    assert sorted(set(K.FINDINGS) - written) == []


PLANTED = """
from verlaudit import kinds as K
from verlaudit.rundir import Finding


def _f(severity, kind, where, **kw):
    return Finding(severity=severity, kind=kind, where=where, message="m", **kw)


PLANTED_KINDS = ("numerics/overflow", "numerics/planted_in_a_tuple")


def check(f, x):
    out = [Finding(severity="error", kind="boundary/planted", message="m")]
    out.append(_f("error", K.NOT_A_KIND, "w"))
    kind = "numerics/planted_by_name" if x else K.OVERFLOW
    out.append(Finding(severity="error", kind=kind, message="m"))
    out.append(Finding(severity="error", kind=K.OVERFLOW, message="m"))
    out.append(Finding(severity="error", kind="numerics/overflow", message="m"))
    out.append(Finding(severity="error", kind=f"numerics/{x}", message="m"))
    if f.kind == "dtype/planted_compared" or f.kind in PLANTED_KINDS or f.kind == "linear":
        return out
    return find(out, "numerics/planted_read") + find(out, "numerics/") + [x.find("a")]


def find(findings, kind):
    return [f for f in findings if f.kind == kind]
"""


def test_the_scan_fails_on_planted_kinds():
    written, problems = scan(PLANTED, "planted.py")
    assert written == {K.OVERFLOW}
    text = "\n".join(problems)
    for planted in (
        "'boundary/planted' written as a string (not registered)",
        "K.NOT_A_KIND is not a kind registered",
        "'numerics/planted_by_name' written as a string (not registered)",
        "'numerics/overflow' written as a string (registered: use its constant)",
        "a kind built at run time (f'numerics/{x}')",
        "'dtype/planted_compared' written as a string (not registered)",
        "'numerics/planted_in_a_tuple' written as a string (not registered)",
        "'numerics/planted_read' written as a string (not registered)",
    ):
        assert planted in text, text
    assert "linear" not in text  # a module's kind compared with .kind is not a finding kind
    # the eight above and the tuple's registered numerics/overflow; a family handed to a reader is no
    # kind, and the text str.find looks for is none either
    assert len(problems) == 9


def test_the_scan_fails_on_a_kind_planted_in_the_audit():
    path = AUDIT / "boundaries.py"
    source = path.read_text(encoding="utf-8")
    assert "K.REWARD_NONFINITE" in source
    _, problems = scan(source.replace("K.REWARD_NONFINITE", '"boundary/reward_planted"', 1), "boundaries.py")
    assert (
        len(problems) == 1 and "'boundary/reward_planted' written as a string (not registered)" in problems[0]
    )
    _, problems = scan(source.replace("K.REWARD_NONFINITE", "K.REWARD_PLANTED", 1), "boundaries.py")
    assert len(problems) == 1 and "K.REWARD_PLANTED is not a kind registered" in problems[0]


# ---------------------------------------------------------------- the registry itself


@pytest.mark.parametrize("table", [K.FINDINGS, K.CAUSES], ids=["findings", "causes"])
def test_every_kind_has_a_class_and_a_one_line_meaning(table):
    for name, k in table.items():
        assert k.name == name and k.cls in K.CLASSES, k
        assert k.meaning and "\n" not in k.meaning and len(k.meaning) <= 100, k
    if table is K.FINDINGS:
        assert all(re.fullmatch(r"[a-z0-9_]+/[a-z0-9_]+", n) for n in table)
        assert not [n for n, k in table.items() if k.cls == "other"]  # every finding kind is classed


def test_every_class_of_the_rule_table_is_registered():
    assert {c for rule in RULES for c in rule} <= set(K.CLASSES)
    assert not set(K.ROOT_CLASSES) & set(K.SYMPTOM_CLASSES)


def test_a_lookup_of_an_unknown_kind_raises_with_the_known_names():
    assert K.finding(K.REWARD_DEVICE).cls == "reward_device"
    with pytest.raises(ValueError, match="'boundary/reward' is not registered.*boundary/reward_device"):
        K.finding("boundary/reward")
    assert K.class_of("some/newer_kind") == "other"
    assert K.cause_class(f"finding:{K.COLLATOR_FLOAT_IDS}") == "ids_float"
    assert K.cause_class("oom") == "oom" and K.cause_class("oom_host") == "other"


def test_registering_a_kind_twice_or_with_an_unknown_class_raises():
    with pytest.raises(ValueError, match="registered twice"):
        K._f(K.OOM, "oom", "again")
    with pytest.raises(ValueError, match="unknown class 'oomm'"):
        K._c("planted_cause", "oomm", "a typo in the class")
    assert "planted_cause" not in K.CAUSES


# ---------------------------------------------------------------- old run directories

OLD = [
    # (old kind, observed, expected, message) as the audit wrote them -> the kind today
    ("boundary/collator", "list", "torch.long tensor", "input_ids is a list, not a tensor", K.COLLATOR_NOT_TENSOR),
    ("boundary/collator", "fp32", "int64", "input_ids from collator c is fp32", K.COLLATOR_FLOAT_IDS),
    ("boundary/collator", "int32", "int64", "input_ids is int32, not int64", K.COLLATOR_ID_WIDTH),
    ("boundary/collator", [0, 107], [0, 99], "input_ids holds ids in [0, 107]", K.COLLATOR_ID_RANGE),
    ("boundary/collator", {"input_ids": 2, "attention_mask": 3}, "one batch size", "tensors disagree", K.COLLATOR_SHAPE),
    ("boundary/collator", [2, 7], [2, 8], "attention_mask has shape (2, 7)", K.COLLATOR_SHAPE),
    ("boundary/reward", "int64", "fp32", "reward is an integer tensor (int64)", K.REWARD_DTYPE),
    ("boundary/reward", "fp64", "fp32", "reward is float64", K.REWARD_DTYPE),
    ("boundary/reward", "bf16", "fp32", "reward is bf16", K.REWARD_DTYPE),
    ("boundary/reward", "cpu", "cuda:0", "reward tensor is on cpu while training runs on cuda:0", K.REWARD_DEVICE),
    ("boundary/reward", "fp64 (numpy)", "fp32 tensor", "reward is a float64 numpy array", K.REWARD_DTYPE),
    ("boundary/reward", "list", "fp32 tensor", "reward is a Python list", K.REWARD_LIST),
    ("boundary/reward", "['a', 'b']", "numbers", "reward list holds non-numbers", K.REWARD_NOT_NUMBERS),
    ("boundary/reward", [2, 1], [2], "reward has shape (2, 1)", K.REWARD_SHAPE),
    ("boundary/reward", "nan", "finite", "1 of 2 rewards are non-finite", K.REWARD_NONFINITE),
    ("boundary/rollout_tokens", [0, 32000], [0, 31999], "response_ids outside the vocabulary", K.ROLLOUT_TOKEN_RANGE),
    ("boundary/rollout_tokens", [[2, 3], [2, 4]], [2, 4], "shapes differ", K.ROLLOUT_SHAPE),
    ("dtype/float_became_int", "torch.int64", "fp32", "old_logprobs of actor is not a floating tensor", K.ISLAND_NOT_FLOAT),
    ("dtype/float_became_int", "int64", "bf16", "model.layers.0.mlp received an integer tensor", K.FLOAT_BECAME_INT),
    ("dtype/param_storage", {"bf16": 3}, "fp32", "3 of 9 parameters", K.PARAM_STORAGE),
]  # fmt: skip


@pytest.mark.parametrize(
    "old, observed, expected, message, new", OLD, ids=lambda x: x if isinstance(x, str) else ""
)
def test_an_old_kind_reads_as_the_kind_today(old, observed, expected, message, new):
    assert current_kind({"kind": old, "observed": observed, "expected": expected, "message": message}) == new


def test_every_kind_the_old_mapping_gives_is_registered():
    assert {new for *_, new in OLD} <= set(K.FINDINGS)
    assert not {"boundary/collator", "boundary/reward", "boundary/rollout_tokens"} & set(K.FINDINGS)


def _write(path: Path, findings: list[dict], status: dict | None) -> None:
    with RunWriter(path) as w:
        w.write_manifest({"variant": path.name, "suite": "t", "seed": 0, "config": {"steps": 2}})
        w.metrics(0, {"actor/loss": "nan" if status and status.get("reason") == "nonfinite" else 0.5})
        if status:
            w.status("failed", **status)
        else:
            w.status("completed")
    with (path / "findings.jsonl").open("w") as fh:  # as an old writer left them, kinds and all
        fh.writelines(json.dumps(f) + "\n" for f in findings)


def _f(
    kind, observed, expected, *, severity="error", where="collator:c.input_ids", role="actor", phase="rollout"
):
    return {
        "severity": severity,
        "kind": kind,
        "message": f"{kind} observed {observed}",
        "role": role,
        "where": where,
        "step": 0,
        "phase": phase,
        "observed": observed,
        "expected": expected,
        "fix": f"fix {kind}",
    }


_DTYPE_ERROR = {"reason": "dtype_error", "step": 0, "phase": "rollout", "role": "actor", "where": "model.embed_tokens",
                "error": "RuntimeError: Expected tensor for argument #1 'indices' to have Long, but got Float"}  # fmt: skip
SCENARIOS = {
    # float ids from the collator, then the embedding's dtype error
    "float-ids": ([_f("boundary/collator", "fp32", "int64")], _DTYPE_ERROR),
    # a list instead of a tensor, and ids past the vocabulary in another field
    "list-and-range": (
        [
            _f("boundary/collator", "list", "torch.long tensor"),
            _f("boundary/collator", [0, 107], [0, 99], where="collator:c.labels"),
        ],
        None,
    ),
    # a NaN reward (after a list info) and the NaN loss it makes
    "nan-reward": (
        [
            _f("boundary/reward", "list", "fp32 tensor", severity="info", where="reward:function:r", role="reward",
               phase="reward"),
            _f("boundary/reward", "nan", "finite", where="reward:function:r", role="reward", phase="reward"),
        ],
        {"reason": "nonfinite", "step": 0, "phase": "actor_update", "error": "non-finite loss"},
    ),
    # an fp16 reward model's scores in fp16, on the CPU
    "rm-fp16-on-cpu": (
        [
            _f("boundary/reward_model", {"fp16": 10}, "fp32", where="score", role="reward", phase=None),
            _f("boundary/reward", "fp16", "fp32", severity="warning", where="reward:model:m", role="reward",
               phase="reward"),
            _f("boundary/reward", "cpu", "cuda:0", severity="warning", where="reward:model:m", role="reward",
               phase="reward"),
        ],
        None,
    ),
}  # fmt: skip


def _new(rec: dict) -> dict:
    return {**rec, "kind": current_kind(rec)}


def _view(d) -> list[tuple]:
    return [
        (c.kind, c.cls, c.title, c.chain, c.consequence_of, c.severity, [x.why for x in c.fixes])
        for c in d.causes
    ]


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_an_old_run_directory_diagnoses_as_one_with_todays_kinds(tmp_path, name):
    findings, status = SCENARIOS[name]
    _write(tmp_path / "old", findings, status)
    _write(tmp_path / "new", [_new(f) for f in findings], status)
    old, new = read_run(tmp_path / "old"), read_run(tmp_path / "new")
    assert [f.kind for f in old.findings] == [f.kind for f in new.findings]
    assert all(f.kind in K.FINDINGS for f in old.findings)
    d_old, d_new = diagnose_run(old), diagnose_run(new)
    assert _view(d_old) == _view(d_new) and d_old.causes


def test_what_the_old_runs_diagnose_to(tmp_path):
    """The roots the old kinds gave, kept: the float ids before the dtype error, the NaN reward before
    the NaN loss, the reward model's dtype before the fp16 reward it scores; the reward on the CPU is no
    longer a dtype problem that the reward model's dtype explains."""
    by = {}
    for name, (findings, status) in SCENARIOS.items():
        _write(tmp_path / name, findings, status)
        by[name] = diagnose_run(read_run(tmp_path / name)).causes
    root = by["float-ids"][0]
    assert (root.kind, root.cls) == (f"finding:{K.COLLATOR_FLOAT_IDS}", "ids_float")
    assert any(c.kind == "dtype_error" and c.consequence_of == root.title for c in by["float-ids"])
    root = by["nan-reward"][0]
    assert root.cls == "reward_nonfinite"
    assert any(c.kind == "nonfinite" and c.consequence_of == root.title for c in by["nan-reward"])
    rm = by["rm-fp16-on-cpu"]
    assert rm[0].cls == "reward_model_dtype"
    dtype = next(c for c in rm if c.cls == "reward_dtype")
    device = next(c for c in rm if c.cls == "reward_device")
    assert dtype.consequence_of == rm[0].title and device.consequence_of is None and device.fixes
    assert {c.cls for c in by["list-and-range"]} == {"batch_shape", "ids_range"}


BASELINES = sorted((ROOT / "reports" / "baselines").glob("*/*/*/findings.jsonl"))


@pytest.mark.parametrize("path", BASELINES, ids=lambda p: str(p.parent.relative_to(ROOT)))
def test_the_committed_baselines_read_as_registered_kinds(path):
    assert all(f.kind in K.FINDINGS for f in read_run(path.parent).findings)
