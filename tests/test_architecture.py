"""The import graph: no cycles between modules (imports inside functions count too: a circle broken
by a deferred import is still a circle), the trainer never imports verlaudit, and the packages depend
one way (benchmarks -> verlaudit -> trainer; inside verlaudit, no package imports one that imports it).
Run: `pytest tests/test_architecture.py`."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("trainer", "verlaudit")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def import_graph() -> dict[str, set[str]]:
    """module -> the project modules it imports, anywhere in its body (a TYPE_CHECKING import is a
    dependency too: the two modules know each other's insides)."""
    modules = {module_name(p): p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        deps: set[str] = set()
        for node in ast.walk(tree):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                # `from pkg import mod` names a module when pkg.mod is one
                targets = [f"{node.module}.{a.name}" for a in node.names] + [node.module]
            for t in targets:
                while t and t not in modules:
                    t = t.rpartition(".")[0]
                if t and t != name and not name.startswith(t + ".") and t.split(".")[0] in PACKAGES:
                    deps.add(t)
        graph[name] = deps
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_graph_sees_deferred_imports():
    # the check would be worthless if imports inside functions were missed
    graph = import_graph()
    assert "verlaudit.plan.planner" in graph["verlaudit.run.runner"] or any(
        d.startswith("verlaudit.plan") for d in graph["verlaudit.run.runner"]
    )
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_cycles():
    assert cycles(import_graph()) == []


def test_trainer_never_imports_verlaudit():
    bad = {m: sorted(d for d in deps if d.startswith("verlaudit")) for m, deps in import_graph().items()}
    assert {m: d for m, d in bad.items() if m.startswith("trainer") and d} == {}


MAY_NOT_IMPORT = {
    # the run directory is the interface: analysis reads it, never starts a run or attaches an audit
    "verlaudit.analysis": ("verlaudit.run", "verlaudit.audit"),
    # the observer knows the trainer's events and the run directory, nothing that runs or reads runs
    "verlaudit.audit": ("verlaudit.run", "verlaudit.analysis", "verlaudit.plan"),
    # the planner is a library over configs; only its command reads suites
    "verlaudit.plan.memory_model": ("verlaudit.run", "verlaudit.audit", "verlaudit.analysis"),
    "verlaudit.plan.planner": ("verlaudit.run", "verlaudit.audit", "verlaudit.analysis"),
    "verlaudit.plan.failure": ("verlaudit.run", "verlaudit.audit", "verlaudit.analysis"),
    "verlaudit.rundir": ("verlaudit.",),
    # dtype names and PyTorch's dtype messages: shared by the live audit and the log reader
    "verlaudit.dtypes": ("verlaudit.",),
}


def test_each_part_imports_only_what_it_may():
    graph = import_graph()
    bad = [
        (m, d)
        for m, deps in graph.items()
        for part, banned in MAY_NOT_IMPORT.items()
        if m == part or m.startswith(part + ".")
        for d in deps
        if any(d == b or d.startswith(b if b.endswith(".") else b + ".") for b in banned)
    ]
    assert bad == []
