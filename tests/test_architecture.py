"""The import graph: no cycles between modules (imports inside functions count too: a circle broken
by a deferred import is still a circle), the trainer never imports verlaudit, and the packages depend
one way, floor by floor (`FLOORS`: commands above run above analysis / audit / verl above plan above
the shared top-level modules above trainer; nothing imports up a floor or sideways).
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


FLOORS: tuple[tuple[str, ...], ...] = (
    # top: `python -m verlaudit`, the table of commands (it finds each by name), the commands
    # (parsing, printing, the glue between steps)
    ("verlaudit.__main__",),
    ("verlaudit.cli",),
    ("verlaudit.commands",),
    # running a suite, and the adapters that audit someone else's trainer
    ("verlaudit.run", "verlaudit.integrations"),
    # reading run directories and logs; the observer; a verl job's translation
    ("verlaudit.analysis", "verlaudit.audit", "verlaudit.verl"),
    # the memory model and planner: a library over configs
    ("verlaudit.plan",),
    # the shared vocabularies: run-directory names, dtypes, finding kinds, verl's keys
    ("verlaudit.rundir", "verlaudit.dtypes", "verlaudit.kinds", "verlaudit.verl_keys", "verlaudit"),
    # the own loop's finding kinds (re-exported by verlaudit.kinds), the registry's machinery, and the
    # classes finding kinds are filed under (the registry's parts, split out for length)
    ("verlaudit.kinds_loop",),
    ("verlaudit.kinds_effects", "verlaudit.kinds_update", "verlaudit.kinds_tokens"),
    ("verlaudit.kind_registry",),
    ("verlaudit.kind_classes",),
    # the trainer, which knows nothing of verlaudit
    ("trainer",),
)  # fmt: skip
"""The packages from the top floor down: a module imports only from floors below its own (and from its
own package); two packages on one floor do not know each other. Inside a package the same holds for
its parts (`INNER`)."""

INNER: dict[str, tuple[tuple[str, ...], ...]] = {
    "verlaudit.analysis": (
        ("verlaudit.analysis.diagnose", "verlaudit.analysis.report", "verlaudit.analysis.ci"),
        ("verlaudit.analysis.logs",),
        ("verlaudit.analysis.causes",),
    ),
}  # fmt: skip


def floor_of(module: str, floors: tuple[tuple[str, ...], ...]) -> tuple[int, str] | None:
    """(floor index, the package) of the longest package on ``floors`` that holds ``module``."""
    best: tuple[int, str] | None = None
    for i, names in enumerate(floors):
        for pkg in names:
            if (module == pkg or module.startswith(pkg + ".")) and (best is None or len(pkg) > len(best[1])):
                best = (i, pkg)
    return best


def upward_imports(graph: dict[str, set[str]], floors=FLOORS, inner=INNER) -> list[tuple[str, str]]:
    """Every import that goes up a floor or sideways to another package on the same floor, at the
    package level and inside each package of ``inner``."""
    bad = []
    for levels in (floors, *inner.values()):
        for m, deps in graph.items():
            a = floor_of(m, levels)
            for d in deps:
                b = floor_of(d, levels)
                if a and b and a[1] != b[1] and b[0] <= a[0]:
                    bad.append((m, d))
    return sorted(set(bad))


def test_every_module_sits_on_a_floor():
    graph = import_graph()
    assert [m for m in graph if floor_of(m, FLOORS) is None] == []
    for pkg, levels in INNER.items():
        assert [m for m in graph if m.startswith(pkg + ".") and floor_of(m, levels) is None] == []


def test_packages_import_only_downward():
    assert upward_imports(import_graph()) == []


def test_the_floor_check_fails_on_a_planted_upward_import():
    graph = {k: set(v) for k, v in import_graph().items()}
    graph["verlaudit.plan.planner"].add("verlaudit.run.suite")  # a library reading suites
    graph["verlaudit.audit.auditor"].add("verlaudit.analysis.causes")  # a sibling on the same floor
    graph["verlaudit.analysis.logs.scan"].add("verlaudit.analysis.diagnose.rules")  # up inside analysis
    assert upward_imports(graph) == [
        ("verlaudit.analysis.logs.scan", "verlaudit.analysis.diagnose.rules"),
        ("verlaudit.audit.auditor", "verlaudit.analysis.causes"),
        ("verlaudit.plan.planner", "verlaudit.run.suite"),
    ]


MAY_NOT_IMPORT = {
    # the run directory is the interface: analysis reads it, never starts a run or attaches an audit
    "verlaudit.analysis": ("verlaudit.run", "verlaudit.audit"),
    # the observer knows the trainer's events and the run directory, nothing that runs or reads runs
    "verlaudit.audit": ("verlaudit.run", "verlaudit.analysis", "verlaudit.plan"),
    # the planner is a library over configs; only its command reads suites
    "verlaudit.plan.memory_model": ("verlaudit.run", "verlaudit.audit", "verlaudit.analysis"),
    "verlaudit.plan.planner": ("verlaudit.run", "verlaudit.audit", "verlaudit.analysis"),
    "verlaudit.analysis.diagnose.failure": ("verlaudit.run", "verlaudit.audit", "verlaudit.analysis"),
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
