"""Scores `verlaudit diagnose` on the corpus of real training logs in tests/fixtures/logs.

Each fixture is a log excerpt from a public issue thread under a ``#: key: value`` header that names the
thread, the failure category, the culprit, the phase, and the cause and fix the thread established
(format and category definitions: tests/fixtures/logs/README.md). The header is stripped before
diagnosis (it names the answer), the body is diagnosed as a plain log file, and the first cause is
scored against the header:

- category right: the verdict is not clean and the first cause's kind is one of
  ``ACCEPTED_KINDS[category]``; for a control (category ``clean``) the verdict must be clean, and a
  non-clean verdict is a false alarm;
- culprit right: the first cause's ``where`` or title names the culprit: either the whole header
  culprit, normalised (lower case, letters, digits and dots only), occurs in it (a culprit written as one
  identifier: ``rank3``, ``compute capability 7.0``), or one of the identifiers the culprit names does
  (``culprit_identifiers``: a culprit written as a phrase names its module path, class, config key,
  rank or library, and the prose around them is not scored); not scored when the header says
  ``none shown``;
- fix right: one of the header's ``backticked`` fix tokens, canonicalised, occurs in the text of one of
  the first cause's fixes (its suite key, verl key, the key in the log's own framework and its why);
  not scored when the fix is ``unknown`` or ``none needed``.

Run: ``PYTHONPATH=$PWD python benchmarks/diagnose_corpus.py --heldout tests/fixtures/logs_heldout --out
reports/diagnose_corpus.md`` (``--update-readme`` also rewrites the fixture table of the README of the
``--fixtures`` directory; ``--heldout DIR`` scores a held-out directory in its own section).
Header checks: ``pytest tests/test_log_corpus.py``.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures" / "logs"

FRAMEWORKS = (
    "verl",
    "trl",
    "openrlhf",
    "nemo-rl",
    "deepspeed",
    "vllm",
    "sglang",
    "pytorch",
    "accelerate",
    "ray",
    "hf-trainer",
)
PHASES = ("generate", "logprob", "reference", "update", "weight_sync", "checkpoint", "init", "unknown")
REQUIRED = ("source", "framework", "category", "culprit", "phase", "cause", "fix")
OPTIONAL = ("notes",)
HEADER_PREFIX = "#: "
NO_CULPRIT = "none shown"
NO_FIX = ("unknown", "none needed")

# Category -> the cause kinds that count as right: the kinds diagnose emits for a log (Cause.kind in
# verlaudit.analysis.causes; the log rules in verlaudit.analysis.logs). A plain `oom` is deliberately not
# accepted for the KV-cache and host-RAM categories: issue 17 names those two mislabels. `cuda_error` (a
# kernel fault the NCCL watchdog or an engine reports) fits an engine's error and another exception alike;
# `nccl_error` (NCCL itself failed, not its timeout) fits the collective-failure category. A collapse
# whose trigger is a NaN gradient norm is a non-finite failure too, and the other way round (one
# signature, two names); a name a package no longer exports (`cannot import name`) is an import error and
# a version mismatch alike; an engine lacking the weight-update call the trainer makes fails the weight sync.
ACCEPTED_KINDS: dict[str, frozenset[str]] = {
    "oom_gpu": frozenset({"oom"}),
    "oom_host": frozenset({"oom_host"}),
    "oom_kv_cache": frozenset({"oom_kv_cache"}),
    "nccl_timeout": frozenset({"nccl_timeout", "nccl_error"}),
    "killed": frozenset({"killed"}),
    "ray_actor_died": frozenset({"ray_actor_died", "killed"}),
    "dtype_error": frozenset({"dtype_error"}),
    "dtype_unsupported": frozenset({"dtype_unsupported", "refused"}),
    "nonfinite": frozenset({"nonfinite", "collapse"}),
    "loss_scale": frozenset({"loss_scale_collapse", "overflow_skips"}),
    "unscale_fp16": frozenset({"unscale_fp16"}),
    "import_error": frozenset({"import_error", "version_mismatch"}),
    "weight_sync": frozenset({"weight_sync", "engine_feature"}),
    "compile_error": frozenset({"compile_error"}),
    "exception": frozenset({"exception", "device_mismatch", "cuda_error"}),
    "engine_error": frozenset({"engine_error", "cuda_error"}),
    "version_mismatch": frozenset({"version_mismatch", "import_error"}),
    "engine_feature": frozenset({"engine_feature", "weight_sync"}),
    "engine_limit": frozenset({"engine_limit"}),
    "collapse": frozenset({"collapse", "nonfinite"}),
    "mismatch": frozenset({"mismatch"}),
    "clean": frozenset(),  # scored on the verdict, not on a kind
}
CATEGORIES = tuple(ACCEPTED_KINDS)


@dataclasses.dataclass(frozen=True)
class Fixture:
    """One corpus log: the parsed header and the log lines below it."""

    path: Path
    header: dict[str, str]
    body: str

    @property
    def category(self) -> str:
        return self.header["category"]

    @property
    def is_control(self) -> bool:
        return self.category == "clean"


def read_fixture(path: str | Path) -> Fixture:
    """Parses one fixture; ValueError naming the file and the field when the header is malformed."""
    p = Path(path)
    lines = p.read_text(encoding="utf-8").splitlines(keepends=True)
    header: dict[str, str] = {}
    n = 0
    for n, line in enumerate(lines):  # n ends as the index of the first body line
        if not line.startswith(HEADER_PREFIX):
            break
        key, sep, value = line[len(HEADER_PREFIX) :].partition(":")
        key, value = key.strip(), value.strip()
        if not sep or key not in REQUIRED + OPTIONAL:
            raise ValueError(
                f"{p}: header line {n + 1}: expected '#: <key>: <value>' with a key in "
                f"{REQUIRED + OPTIONAL}, got {line.strip()!r}"
            )
        if key in header:
            raise ValueError(f"{p}: header field {key!r} given twice")
        if not value:
            raise ValueError(f"{p}: header field {key!r} is empty; write 'unknown' or 'none shown'")
        header[key] = value
    else:
        n = len(lines)
    missing = [k for k in REQUIRED if k not in header]
    if missing:
        raise ValueError(f"{p}: header lacks {missing}; every fixture needs {list(REQUIRED)}")
    for key, allowed in (("framework", FRAMEWORKS), ("category", CATEGORIES), ("phase", PHASES)):
        if header[key] not in allowed:
            raise ValueError(f"{p}: header field {key!r} is {header[key]!r}; expected one of {list(allowed)}")
    body = "".join(lines[n:])
    if any(line.startswith(HEADER_PREFIX) for line in lines[n:]):
        raise ValueError(f"{p}: a '#: ' header line after the log body began; keep the header block on top")
    if not body.strip():
        raise ValueError(f"{p}: no log lines below the header")
    return Fixture(p, header, body)


def read_corpus(directory: str | Path = FIXTURES) -> list[Fixture]:
    """Every ``*.log`` fixture of the corpus, sorted by file name."""
    paths = sorted(Path(directory).glob("*.log"))
    if not paths:
        raise ValueError(f"{directory}: no *.log fixtures")
    return [read_fixture(p) for p in paths]


def norm_culprit(text: str) -> str:
    """Lower case, letters, digits and dots only: 'local_rank 3' and '[rank3]' compare by content."""
    return re.sub(r"[^a-z0-9.]", "", text.lower())


# Library names a culprit phrase may blame: one counts as an identifier when it is the culprit's first
# word or carries a version ('vllm 0.8.4', 'accelerate==0.23.0', 'slime v0.2.4', 'OpenRLHF < 0.9.5'), not
# when the phrase only mentions it ('NCCL bundled with torch': torch is not blamed).
LIBRARIES = frozenset(
    {
        "accelerate",
        "apex",
        "bitsandbytes",
        "deepspeed",
        "flash_attn",
        "megatron",
        "nccl",
        "nemo_rl",
        "openrlhf",
        "peft",
        "pytorch",
        "ray",
        "sglang",
        "slime",
        "torch",
        "torchtune",
        "transformers",
        "triton",
        "trl",
        "unsloth",
        "verl",
        "vllm",
        "xformers",
    }
)
_VERSION_AFTER = re.compile(r"\s*(?:==|>=|<=|<|>|~=|\s)\s*v?\d+(?:\.\d+)*")
_TOKEN = re.compile(
    r"`([^`]+)`|(--[A-Za-z][\w-]*)|((?:local_?)?rank)\s*[_:=\[]?\s*(\d+)\b"
    r"|([A-Za-z_][\w.-]*(?:/[\w.-]+)*(?::\d+)?)"
)
_DOTTED = re.compile(r"^[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+$")
_CAMEL = re.compile(r"[a-z][A-Z]|[A-Z]{2}[a-z]")


def _canon_id(text: str) -> str:
    return text.lower().replace("-", "_").strip(".")


def _distinct(name: str) -> bool:
    """A lone name distinctive enough to stand for the dotted path it ends: snake_case or CamelCase
    ('_validate_tensors_to_flatten', 'NGRAMWorker'; not 'weight', 'generate' or a dunder)."""
    core = name.strip("_")
    return not name.startswith("__") and ("_" in core or _CAMEL.search(core) is not None)


def _word_ids(word: str, first: bool, rest: str) -> list[str]:
    """The identifiers one word of a culprit names (``rest``: the text after it, for a library's version)."""
    low = _canon_id(word)
    if low in LIBRARIES:  # blamed when it leads the culprit or carries a version; else only mentioned
        return [low] if first or _VERSION_AFTER.match(rest) else []
    if "/" in word:
        return [word, word.rsplit("/", 1)[1]] if word.endswith(".py") else []
    if _DOTTED.match(word):
        parts = word.split(".")
        if max(len(p) for p in parts) < 3:  # 'i.e', 'e.g'
            return []
        out = [word]
        names = [p for p in parts if not (p.startswith("__") and p.endswith("__"))]
        if _distinct(names[-1]):
            out.append(names[-1])
        if len(names) >= 2 and names[-2][:1].isupper() and _CAMEL.search(names[-2]):
            out.append(names[-2])
        return out
    if "_" in word.strip("_") or (len(word) >= 5 and _CAMEL.search(word)):
        return [word]
    return []


def culprit_identifiers(culprit: str) -> list[str]:
    """The identifiers a header's culprit names, canonicalised (lower case, '-' as '_'): a
    ``backticked`` token (one word whole; a phrase by the rules below); CLI flags (``--dp-size`` ->
    ``dp_size``); ranks (``local_rank 2`` -> ``rank2``); file paths (``a/b/vllm_rollout.py`` and its file
    name); dotted paths and, for one, its snake_case or CamelCase leaf and owning class
    (``FSDPParamGroup._init_mp_dtypes`` also names ``_init_mp_dtypes`` and ``FSDPParamGroup``; a dunder
    or a plain word such as ``weight`` names nothing alone); snake_case names (config keys, functions:
    ``max_num_batched_tokens``, ``WorkerDict_0:5``); CamelCase names of five letters or more (classes:
    ``NGRAMWorker``); and a library of ``LIBRARIES`` when the culprit blames it (its first word, or
    followed by a version). Prose, numbers, versions and a library only mentioned are not identifiers."""
    out: list[str] = []
    for m in _TOKEN.finditer(culprit):
        tick, flag, rank_word, rank_no, word = m.groups()
        if tick:
            found = [tick] if not tick.split()[1:] else culprit_identifiers(" " + tick)
        elif flag:
            found = [flag.lstrip("-")]
        elif rank_word:
            found = [f"rank{rank_no}"]
        else:
            found = _word_ids(
                word.rstrip(".-"), m.start() == len(culprit) - len(culprit.lstrip()), culprit[m.end() :]
            )
        for name in map(_canon_id, found):
            if name and name not in out:
                out.append(name)
    return out


def _names(identifier: str, text: str) -> bool:
    """``text`` (canonicalised) names ``identifier`` as a whole name: not inside a longer name (rank2 is
    not rank21; a library may prefix a module name: vllm in vllm_rollout)."""
    if identifier.startswith("rank") and identifier[4:].isdigit():
        return re.search(rf"rank[\s_:=\[]*{identifier[4:]}(?!\d)", text) is not None
    tail = r"(?![a-z0-9])" if identifier in LIBRARIES else r"(?![a-z0-9_])"
    return re.search(rf"(?<![a-z0-9_]){re.escape(identifier)}{tail}", text) is not None


def culprit_named(culprit: str, text: str) -> bool:
    """The culprit rule of the module docstring: the whole normalised culprit occurs in ``text`` (a cause's
    where and title), or one of its ``culprit_identifiers`` does."""
    if norm_culprit(culprit) in norm_culprit(text):
        return True
    canon = re.sub(r"(?<![\w-])--(?=\w)", "", text.lower()).replace(
        "-", "_"
    )  # a flag's dashes are not its name
    return any(_names(i, canon) for i in culprit_identifiers(culprit))


_DTYPE_WORDS = (("bfloat16", "bf16"), ("float16", "fp16"), ("float32", "fp32"))


def canon_fix(text: str) -> str:
    """Lower case, '-' as '_', no spaces around '=', dtype names shortened (float16 -> fp16)."""
    t = re.sub(r"\s*=\s*", "=", text.lower().replace("-", "_"))
    for long, short in _DTYPE_WORDS:
        t = t.replace(long, short)
    return t


def fix_tokens(fix: str) -> list[str]:
    """The backticked key tokens of a header's fix line, canonicalised (leading '_' of a CLI flag dropped)."""
    return [canon_fix(t).lstrip("_") for t in re.findall(r"`([^`]+)`", fix)]


@dataclasses.dataclass
class Score:
    """The diagnosis of one fixture against its header (None: not scored for this fixture)."""

    fixture: Fixture
    verdict: str
    kind: str
    title: str
    category_right: bool
    culprit_right: bool | None
    fix_right: bool | None
    false_alarm: bool | None
    error: str | None = None


def _diagnose_fn() -> Callable[[Path], Sequence[Any]]:
    # the layout moved diagnose under verlaudit.analysis; the old home still works on older checkouts
    try:
        from verlaudit.analysis.diagnose.diagnosis import diagnose_path
    except ImportError:
        from verlaudit.diagnose import diagnose_path
    return diagnose_path


def score_fixture(fx: Fixture, workdir: Path, diagnose: Callable[[Path], Sequence[Any]]) -> Score:
    """Diagnoses the body of one fixture (header stripped) and scores the first cause."""
    log = workdir / fx.path.name
    log.write_text(fx.body, encoding="utf-8")
    try:
        (d,) = diagnose(log)
    except Exception as e:  # noqa: BLE001 - a crash is recorded as this fixture's result, the rest still run
        crash = f"{type(e).__name__}: {e}"[:200]
        return Score(
            fx, "crash", "-", crash, False, None, None, True if fx.is_control else None, error=repr(e)
        )
    first = d.causes[0] if d.causes else None
    kind, title = (first.kind, first.title) if first else ("-", "no problems found")
    if fx.is_control:
        return Score(fx, d.verdict, kind, title, d.verdict == "clean", None, None, d.verdict != "clean")
    # a failure called clean is wrong whatever its first (info-level) cause says
    category_right = first is not None and d.verdict != "clean" and first.kind in ACCEPTED_KINDS[fx.category]
    culprit = fx.header["culprit"]
    culprit_right = None
    if culprit != NO_CULPRIT:
        culprit_right = first is not None and culprit_named(culprit, f"{first.where or ''} {first.title}")
    fix_right = None
    tokens = fix_tokens(fx.header["fix"])
    if fx.header["fix"] not in NO_FIX and tokens:
        texts = [
            canon_fix(f"{f.suite or ''} {f.verl or ''} {getattr(f, 'key', None) or ''} {f.why}")
            for f in (first.fixes if first else [])
        ]
        fix_right = any(t in text for t in tokens for text in texts)
    return Score(fx, d.verdict, kind, title, category_right, culprit_right, fix_right, None)


def score_corpus(fixtures: Sequence[Fixture]) -> list[Score]:
    """Scores every fixture; the diagnosis sees only each log body, in a temporary directory."""
    diagnose = _diagnose_fn()
    with tempfile.TemporaryDirectory(prefix="diagnose_corpus_") as tmp:
        return [score_fixture(fx, Path(tmp), diagnose) for fx in fixtures]


def _mark(v: bool | None, bad_when: bool = False) -> str:
    """'yes' / 'no' with the bad outcome in bold; '-' when not scored."""
    if v is None:
        return "-"
    text = "yes" if v else "no"
    return f"**{text}**" if v == bad_when else text


def _cell(text: str, width: int = 90) -> str:
    text = " ".join(str(text).split()).replace("|", "\\|")
    return text if len(text) <= width else text[: width - 1] + "…"


def _pct(a: int, b: int) -> str:
    return f"{a}/{b} ({100 * a / b:.0f}%)" if b else "0/0"


def _ratio(scores: Sequence[Score], attr: str) -> tuple[int, int]:
    vals = [getattr(s, attr) for s in scores if getattr(s, attr) is not None]
    return sum(bool(v) for v in vals), len(vals)


def _commit() -> str:
    """The checked-out commit the report measured (the code under test), or 'unknown' outside git."""
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
        )
    except OSError:
        return "unknown"
    return out.stdout.strip() or "unknown"


def _summary(scores: Sequence[Score]) -> list[str]:
    """The summary lines of one set of scored fixtures."""
    failures = [s for s in scores if not s.fixture.is_control]
    controls = [s for s in scores if s.fixture.is_control]
    cat = sum(s.category_right for s in failures)
    cul, cul_n = _ratio(failures, "culprit_right")
    fix, fix_n = _ratio(failures, "fix_right")
    clean_failures = [s for s in failures if s.verdict == "clean"]
    alarms = [s for s in controls if s.false_alarm]
    crashes = [s for s in scores if s.error]
    frameworks = {s.fixture.header["framework"] for s in failures}
    return [
        f"- failures: {len(failures)} across {len(frameworks)} frameworks; controls: {len(controls)}",
        f"- category right: {_pct(cat, len(failures))}",
        f"- culprit right (where the header names one): {_pct(cul, cul_n)}",
        f"- fix right (where the thread established one): {_pct(fix, fix_n)}",
        f"- failures called clean: {len(clean_failures)}"
        + (f" ({', '.join(s.fixture.path.stem for s in clean_failures)})" if clean_failures else ""),
        f"- false alarms on controls: {len(alarms)}/{len(controls)}"
        + (f" ({', '.join(s.fixture.path.stem for s in alarms)})" if alarms else ""),
        f"- crashes: {len(crashes)}",
    ]


def _table(scores: Sequence[Score]) -> list[str]:
    lines = [
        "| fixture | expected | verdict | first kind | title | category | culprit | fix | false alarm |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for s in scores:
        lines.append(
            f"| {s.fixture.path.stem} | {s.fixture.category} | {s.verdict} | {s.kind} | {_cell(s.title)} "
            f"| {_mark(s.category_right)} | {_mark(s.culprit_right)} | {_mark(s.fix_right)} "
            f"| {_mark(s.false_alarm, bad_when=True)} |"
        )
    return lines


def render(
    scores: Sequence[Score], command: str, heldout: Sequence[Score] = (), heldout_dir: str | None = None
) -> str:
    """The markdown report: summary lines, then one table row per fixture; the held-out fixtures'
    summary and table after it, in their own section, headed by the directory they came from
    (``heldout_dir``, as given to ``--heldout``; else the directory of their first fixture)."""
    lines = [
        "# `verlaudit diagnose` on the real-log corpus",
        "",
        f"Command: `{command}` ({time.strftime('%Y-%m-%d')}, commit {_commit()}, CPU;",
        "the diagnosis reads only each log's body).",
        "Fixtures and the header format: tests/fixtures/logs/README.md; scoring rules: the docstring of "
        "benchmarks/diagnose_corpus.py.",
        "",
        *_summary(scores),
        "",
        *_table(scores),
    ]
    if heldout:
        where = heldout_dir or _shown(heldout[0].fixture.path.parent)
        lines += [
            "",
            "## Held-out logs",
            "",
            f"{where}: logs in the same format, kept out of the corpus the rules were written "
            "against and scored only here.",
            "",
            *_summary(heldout),
            "",
            *_table(heldout),
        ]
    return "\n".join(lines) + "\n"


def _shown(path: Path) -> str:
    """A directory as the report names it: relative to the repository when inside it."""
    try:
        return str(path.resolve().relative_to(ROOT))
    except ValueError:
        return str(path)


README_TABLE_HEAD = (
    "## Fixtures\n\n| fixture | framework | category | phase | source |\n|---|---|---|---|---|\n"
)


def update_readme(fixtures: Sequence[Fixture], readme: Path) -> None:
    """Rewrites the fixture table that ends the corpus README (everything after '## Fixtures')."""
    text = readme.read_text(encoding="utf-8")
    if "## Fixtures" not in text:
        raise ValueError(f"{readme}: no '## Fixtures' section to rewrite")
    rows = [
        f"| {f.path.name} | {f.header['framework']} | {f.category} | {f.header['phase']} |" for f in fixtures
    ]
    rows = [f"{row} {f.header['source']} |" for row, f in zip(rows, fixtures)]
    readme.write_text(
        text[: text.index("## Fixtures")] + README_TABLE_HEAD + "\n".join(rows) + "\n", encoding="utf-8"
    )


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--fixtures", default=str(FIXTURES), help="directory of *.log fixtures")
    p.add_argument("--out", help="also write the markdown report to this file")
    p.add_argument("--heldout", help="also score this directory of held-out fixtures, in its own section")
    p.add_argument(
        "--update-readme", action="store_true", help="rewrite the fixture table of the corpus README"
    )
    args = p.parse_args(argv)
    try:
        fixtures = read_corpus(args.fixtures)
        if args.update_readme:
            update_readme(fixtures, Path(args.fixtures) / "README.md")
        scores = score_corpus(fixtures)
        heldout = score_corpus(read_corpus(args.heldout)) if args.heldout else []
    except ValueError as e:
        print(f"diagnose_corpus: {e}", file=sys.stderr)
        return 2
    command = (
        "PYTHONPATH=$PWD python benchmarks/diagnose_corpus.py"
        + (f" --heldout {args.heldout}" if args.heldout else "")
        + (f" --out {args.out}" if args.out else "")
    )
    report = render(scores, command, heldout, _shown(Path(args.heldout)) if args.heldout else None)
    print(report)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(report, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
