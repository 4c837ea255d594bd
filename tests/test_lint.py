"""The tree is as `ruff check` and `ruff format` leave it (the rules and line length in pyproject.toml),
so CI catches a lint error or an unformatted file like any other failure. ruff is pinned in the test
extra: another release may lay code out differently. Run: `pytest tests/test_lint.py`.
"""

from __future__ import annotations

import ast
import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _ruff(*args: str) -> subprocess.CompletedProcess:
    if importlib.util.find_spec("ruff") is None:
        pytest.fail("ruff is not installed: pip install -e '.[test]' (the test extra pins it)")
    return subprocess.run(
        [sys.executable, "-m", "ruff", *args], cwd=ROOT, capture_output=True, text=True, timeout=300
    )


def test_ruff_check_is_clean():
    r = _ruff("check", "--no-cache", "--output-format", "concise", ".")
    assert r.returncode == 0, f"ruff check found problems (fix: ruff check --fix .):\n{r.stdout}{r.stderr}"


def test_ruff_format_leaves_every_file_as_it_is():
    r = _ruff("format", "--no-cache", "--check", ".")
    assert r.returncode == 0, f"files ruff format would change (run: ruff format .):\n{r.stdout}{r.stderr}"


MAX_LINES = 820
"""The house's ~800 lines per file, with room for a docstring's growth; past it, split the module."""
MAX_FUNCTION = 80
"""Longer functions carry a one-line ``# long: <why>`` comment right above them (or their decorators)."""


def _sources() -> list[Path]:
    return sorted(
        p for d in ("verlaudit", "trainer", "benchmarks", "tests") for p in (ROOT / d).rglob("*.py")
    )


def _frozen(p: Path) -> bool:
    """A file of a frozen blind bench (its folder holds FROZEN.md with every file's sha256): it stays as its
    blind author froze it, so the length rule is not applied to it."""
    return any((d / "FROZEN.md").exists() for d in p.parents if ROOT in d.parents)


def test_no_module_is_longer_than_the_house_allows():
    long = {
        str(p.relative_to(ROOT)): n
        for p in _sources()
        if not _frozen(p) and (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert long == {}, f"split these modules (over {MAX_LINES} lines): {long}"


def test_every_long_function_says_why():
    unexplained = []
    for p in _sources():
        lines = p.read_text().splitlines()
        for node in ast.walk(ast.parse("\n".join(lines))):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            if node.end_lineno - node.lineno + 1 <= MAX_FUNCTION:
                continue
            first = min([node.lineno] + [d.lineno for d in node.decorator_list])
            if not lines[first - 2].strip().startswith("# long:"):
                unexplained.append(f"{p.relative_to(ROOT)}:{node.lineno} {node.name}")
    assert unexplained == [], f"split these or say why above them ('# long: <why>'): {unexplained}"


def long_reasons_repeated(files: dict[str, str]) -> dict[str, list[str]]:
    """Each ``# long:`` reason given above more than one function (``files``: name -> text): a copied
    reason says nothing about the function under it."""
    seen: dict[str, list[str]] = {}
    for name, text in files.items():
        for n, line in enumerate(text.splitlines(), 1):
            if line.strip().startswith("# long:"):
                reason = " ".join(line.strip().removeprefix("# long:").split()).lower()
                seen.setdefault(reason, []).append(f"{name}:{n}")
    return {r: where for r, where in seen.items() if len(where) > 1}


def test_long_reasons_are_not_copies():
    tree = {str(p.relative_to(ROOT)): p.read_text() for p in _sources()}
    assert long_reasons_repeated(tree) == {}
    planted = {"a.py": "# long: the same words\ndef f(): pass\n", "b.py": "# long: The  same words\n"}
    assert long_reasons_repeated(planted) == {"the same words": ["a.py:1", "b.py:1"]}


def test_cited_test_files_exist():
    # docstrings say which test exercises a module: a renamed or removed test file leaves them lying
    cited = re.compile(r"(?<![\w/.])tests/(test_\w+\.py)")
    missing = sorted(
        f"{p.relative_to(ROOT)} cites tests/{name}"
        for p in [*_sources(), ROOT / "README.md"]
        for name in set(cited.findall(p.read_text()))
        if not (ROOT / "tests" / name).exists()
    )
    assert missing == [], missing
