"""The run directory: the only interface between running a variant and analysing it.

One directory per variant run::

    manifest.json    resolved config, precision policy with reasons, environment, audit settings
    metrics.jsonl    one JSON object per step (``step`` plus flat ``component/quantity/stat`` keys)
    findings.jsonl   one `Finding` per line
    events.jsonl     numerics / memory records that are not per-step metrics (optional)
    shadow.jsonl, opcounts.jsonl, gradhealth.jsonl
                     per-module precision records of the sampled steps (optional): the fp32
                     shadow's errors, op counts by dtype, gradient health
    status.json      written last: ``completed`` or ``failed`` with reason, step and phase.
                     Its absence means the process was killed.

Writers append and flush every line; readers accept a truncated last line and a missing status,
so `verlaudit diagnose` works on runs that died half-way and on runs copied from another machine.
Exercised by `pytest tests/test_rundir.py`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

SCHEMA_VERSION = 1

# A variant's run directory. The first five are the contract every reader relies on; the last three
# are the runner's record of how it launched the variant (readable when the worker died early).
MANIFEST = "manifest.json"
METRICS = "metrics.jsonl"
FINDINGS = "findings.jsonl"
EVENTS = "events.jsonl"
STATUS = "status.json"
SHADOW = "shadow.jsonl"
OPCOUNTS = "opcounts.jsonl"
GRADHEALTH = "gradhealth.jsonl"
RECORD_FILES = (SHADOW, OPCOUNTS, GRADHEALTH)
"""Per-module precision records of the sampled steps, beside the contract's files; the auditor writes them."""
SPEC = "spec.json"
RUNNER = "runner.json"
WORKER_LOG = "worker.log"
RANK_DIR = "rank{rank}"
"""Rank k > 0 of a multi-GPU run writes its own run directory under the variant's."""

# A suite's report directory (``reports/<suite>/<timestamp>/``): the run directories plus these.
SUITE_COPY = "suite.json"
REPORT_MD = "report.md"
REPORT_CSV = "report.csv"
REPORT_RUNS_CSV = "report_runs.csv"
RECOMMEND_MD = "recommend.md"
"""`verlaudit recommend`'s ranking, beside its candidates' run directories."""
SEVERITIES = ("info", "warning", "error")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Finding:
    """One audit observation that breaks (or may break) the precision contract."""

    severity: str
    """``info``, ``warning`` or ``error``."""
    kind: str
    """Stable identifier, e.g. ``dtype/module_input``, ``boundary/collator``, ``numerics/nonfinite_forward``,
    ``numerics/overflow``, ``memory/oom``, ``runtime/dtype_error``."""
    message: str
    """One sentence a person can read."""
    role: str | None = None
    where: str | None = None
    """Module qualified name (``model.layers.3.mlp.down_proj``) or boundary name (``collator``)."""
    step: int | None = None
    phase: str | None = None
    observed: Any = None
    expected: Any = None
    fix: str | None = None
    rank: int = 0
    count: int = 1
    """How many times the same (kind, role, where) was seen; repeats are folded into one record."""

    def __post_init__(self) -> None:
        if self.severity not in SEVERITIES:
            raise ValueError(f"Finding.severity: {self.severity!r}; expected one of {SEVERITIES}")

    def to_dict(self) -> dict[str, Any]:
        return {k: _jsonable(v) for k, v in dataclasses.asdict(self).items()}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Finding:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


def _jsonable(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)  # "nan", "inf", "-inf": JSON has no literal for them
    if isinstance(v, Mapping):
        return {str(k): _jsonable(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    if isinstance(v, (str, int, float, bool)) or v is None:
        return v
    if hasattr(v, "item") and getattr(v, "numel", lambda: 2)() == 1:
        return _jsonable(v.item())
    return str(v)


def dumps(obj: Any) -> str:
    """One JSON line; non-finite floats become strings, unknown objects their ``str``."""
    return json.dumps(_jsonable(obj), separators=(",", ":"), allow_nan=False)


def to_float(v: Any) -> float:
    """Reads back a metric value written by `dumps` ("nan"/"inf" strings included)."""
    if isinstance(v, str):
        return float(v)
    return float("nan") if v is None else float(v)


class RunWriter:
    """Appends to a run directory. Every line is flushed (and fsync'd at status) as written."""

    def __init__(self, path: str | os.PathLike, *, rank: int = 0) -> None:
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        self._files: dict[str, Any] = {}
        self.rank = rank
        """The process's rank in a torchrun job: stamped on every finding it writes."""

    def _append(self, name: str, record: Mapping[str, Any]) -> None:
        f = self._files.get(name)
        if f is None:
            f = self._files[name] = open(self.path / name, "a", encoding="utf-8")
        f.write(dumps(record) + "\n")
        f.flush()

    def write_manifest(self, manifest: Mapping[str, Any]) -> None:
        data = {"schema_version": SCHEMA_VERSION, **manifest}
        _atomic_write(self.path / MANIFEST, json.dumps(_jsonable(data), indent=2, allow_nan=False))

    def update_manifest(self, **fields: Any) -> None:
        current = read_json(self.path / MANIFEST) or {}
        current.update(fields)
        self.write_manifest(current)

    def metrics(self, step: int, metrics: Mapping[str, Any]) -> None:
        self._append(METRICS, {"step": step, **metrics})

    def finding(self, finding: Finding) -> None:
        self._append(FINDINGS, self._ranked(finding).to_dict())

    def _ranked(self, finding: Finding) -> Finding:
        return finding if finding.rank == self.rank else dataclasses.replace(finding, rank=self.rank)

    def replace_findings(self, findings: list[Finding]) -> None:
        """Rewrites findings.jsonl atomically (repeat counts of folded findings changed)."""
        f = self._files.pop(FINDINGS, None)
        if f is not None:
            f.close()
        text = "".join(dumps(self._ranked(x).to_dict()) + "\n" for x in findings)
        _atomic_write(self.path / FINDINGS, text)

    def event(self, kind: str, **data: Any) -> None:
        self._append(EVENTS, {"kind": kind, **data})

    def records(self, name: str, records: list[Mapping[str, Any]]) -> None:
        """Appends ``records`` to one of `RECORD_FILES`."""
        if name not in RECORD_FILES:
            raise ValueError(f"RunWriter.records: {name!r} is not one of {', '.join(RECORD_FILES)}")
        for rec in records:
            self._append(name, rec)

    def status(self, state: str, **data: Any) -> None:
        """``state``: ``completed`` or ``failed`` (with ``reason``, ``step``, ``phase``, ``error``)."""
        for f in self._files.values():
            f.flush()
            os.fsync(f.fileno())
        _atomic_write(self.path / STATUS, json.dumps(_jsonable({"state": state, **data}), indent=2))

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()

    def __enter__(self) -> RunWriter:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def read_json(path: str | os.PathLike) -> dict[str, Any] | None:
    """A JSON file, or None when missing; a damaged file raises ValueError naming it."""
    p = Path(path)
    if not p.exists():
        return None
    try:
        return json.loads(p.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{p}: not valid JSON ({e}); the file is damaged — rerun or delete it") from None


def iter_jsonl(path: str | os.PathLike) -> Iterator[dict[str, Any]]:
    """Records of a JSONL file. A truncated or damaged *last* line (a killed writer) is skipped;
    a damaged line in the middle raises ValueError naming file and line."""
    p = Path(path)
    if not p.exists():
        return
    with open(p, encoding="utf-8", errors="replace") as f:
        lines = f.read().split("\n")
    # the text after the final newline is a partial line unless the file ended with "\n"
    last_complete = len(lines) - 1
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            if i >= last_complete - 1 and all(not x.strip() for x in lines[i + 1 :]):
                return  # truncated tail: the writer died mid-line
            raise ValueError(f"{p}:{i + 1}: damaged line (not JSON) in the middle of the file") from None
        if not isinstance(rec, dict):
            if i >= last_complete - 1:
                return
            raise ValueError(f"{p}:{i + 1}: expected a JSON object per line")
        yield rec


@dataclasses.dataclass
class RunDir:
    """Everything a finished, failed or killed run left behind, read tolerantly."""

    path: Path
    manifest: dict[str, Any]
    metrics: list[dict[str, Any]]
    findings: list[Finding]
    events: list[dict[str, Any]]
    status: dict[str, Any] | None

    @property
    def state(self) -> str:
        """``completed``, ``failed``, or ``killed`` (no status.json), or ``empty`` (nothing written)."""
        if self.status is not None:
            return str(self.status.get("state", "failed"))
        return "killed" if (self.manifest or self.metrics) else "empty"

    @property
    def name(self) -> str:
        return str(self.manifest.get("variant") or self.path.name)

    def series(self, key: str) -> list[tuple[int, float]]:
        """(step, value) for every step that recorded ``key``."""
        return [(int(m["step"]), to_float(m[key])) for m in self.metrics if key in m and "step" in m]


def read_records(path: str | os.PathLike, name: str) -> list[dict[str, Any]]:
    """The records of one of `RECORD_FILES` in run directory ``path`` ([] when absent), read as
    tolerantly as the rest (`iter_jsonl`)."""
    if name not in RECORD_FILES:
        raise ValueError(f"read_records: {name!r} is not one of {', '.join(RECORD_FILES)}")
    return list(iter_jsonl(Path(path) / name))


def is_run_dir(path: str | os.PathLike) -> bool:
    p = Path(path)
    return p.is_dir() and any((p / n).exists() for n in (MANIFEST, METRICS, STATUS))


def read_run(path: str | os.PathLike) -> RunDir:
    """Reads a run directory; raises ValueError when ``path`` is not one."""
    p = Path(path)
    if not p.is_dir():
        raise ValueError(f"{p}: no such run directory")
    if not is_run_dir(p):
        raise ValueError(
            f"{p}: not a run directory (no {MANIFEST}, {METRICS} or {STATUS}); "
            "pass a variant's directory, e.g. reports/<suite>/<timestamp>/<variant>"
        )
    findings = [Finding.from_dict(d) for d in iter_jsonl(p / FINDINGS) if "severity" in d]
    return RunDir(
        path=p,
        manifest=read_json(p / MANIFEST) or {},
        metrics=list(iter_jsonl(p / METRICS)),
        findings=findings,
        events=list(iter_jsonl(p / EVENTS)),
        status=read_json(p / STATUS),
    )
