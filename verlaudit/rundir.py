"""The run directory: the only interface between running a variant and analysing it.

One directory per variant run::

    manifest.json    resolved config, precision policy with reasons, environment, audit settings;
                     ``overridden`` (the user's checkpoint / tokenizer settings the trainer replaced,
                     both values), and for a run audited in place ``contract`` (the precision contract
                     resolved from the user's own loop) and ``integration`` (framework, adapter)
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
Anything else a reader cannot use (a manifest that is a list, a line that is not an object, a step
that is not an integer) is a ValueError naming the file, line and field. Exercised by
`pytest tests/test_rundir.py`.
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
    """Stable identifier, one of `verlaudit.kinds.FINDINGS`: ``dtype/module_input``,
    ``boundary/collator_float_ids``, ``numerics/nonfinite_forward``, ``memory/oom``, ..."""
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
    """A JSON object file, or None when missing; a damaged file, or one holding something other than
    an object, raises ValueError naming it."""
    p = Path(path)
    if not p.exists():
        return None
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{p}: not valid JSON ({e}); the file is damaged — rerun or delete it") from None
    if not isinstance(data, dict):
        raise ValueError(
            f"{p}: expected a JSON object {{...}}, got {_kind(data)}; the file is damaged or not verlaudit's"
        )
    return data


def iter_jsonl(path: str | os.PathLike) -> Iterator[dict[str, Any]]:
    """Records of a JSONL file (see `iter_jsonl_lines`)."""
    return (rec for _, rec in iter_jsonl_lines(path))


def iter_jsonl_lines(path: str | os.PathLike) -> Iterator[tuple[int, dict[str, Any]]]:
    """(line number, record) of a JSONL file. A truncated or damaged *last* line (a killed writer) is
    skipped; a damaged line in the middle, or a complete line that is not a JSON object (no writer of
    ours makes one, whole or cut), raises ValueError naming file and line."""
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
            raise ValueError(f"{p}:{i + 1}: expected a JSON object per line, got {_kind(rec)}")
        yield i + 1, rec


def _kind(value: Any) -> str:
    names = {
        list: "a list",
        str: "a string",
        bool: "a boolean",
        int: "a number",
        float: "a number",
        dict: "an object",
    }
    return "null" if value is None else names.get(type(value), type(value).__name__)


# What each field of a run-directory file must be (None is accepted for every field; unknown
# fields are kept). Readers rely on these types; a file from elsewhere that breaks them is named.
_MANIFEST = {"schema_version": int, "variant": str, "suite": str, "seed": int, "started_at": str, "config": dict,
             "policy": dict, "environment": dict, "memory": dict, "audit": dict, "emulation": dict, "inject": dict,
             "distributed": dict}  # fmt: skip
_STATUS = {"state": str, "reason": str, "error": str, "phase": str, "where": str, "role": str, "traceback": str,
           "step": int, "last_completed_step": int, "steps": int, "rank": int, "failed_at": float, "memory": dict}  # fmt: skip
_FINDING = {"severity": str, "kind": str, "message": str, "role": str, "where": str, "step": int, "phase": str,
            "fix": str, "rank": int, "count": int}  # fmt: skip
STATES = ("completed", "failed")


def _check_fields(data: Mapping[str, Any], schema: Mapping[str, type], where: str) -> None:
    for key, want in schema.items():
        v = data.get(key)
        if not _has_type(v, want):
            what = {str: "a string", int: "an integer", float: "a number", dict: "an object"}[want]
            raise ValueError(f"{where}: {key}: expected {what}, got {_kind(v)} {json.dumps(v)[:40]}")


def _has_type(v: Any, want: type) -> bool:
    if v is None:
        return True
    if want in (int, float) and isinstance(v, bool):
        return False
    return isinstance(v, (int, float) if want is float else want)


def _check_manifest(m: Mapping[str, Any], p: Path) -> None:
    _check_fields(m, _MANIFEST, str(p))
    for section, v in (m.get("config") or {}).items():
        if isinstance(v, list) or (
            section in ("model", "data", "algo", "precision", "rollout")
            and v is not None
            and not isinstance(v, dict)
        ):
            raise ValueError(f"{p}: config.{section}: expected an object, got {_kind(v)}")
    roles = (m.get("policy") or {}).get("roles")
    if roles is not None and not (
        isinstance(roles, dict) and all(isinstance(r, dict) for r in roles.values())
    ):
        raise ValueError(
            f"{p}: policy.roles: expected an object of role -> object, got {json.dumps(roles)[:60]}"
        )


def _check_status(st: Mapping[str, Any], p: Path) -> None:
    _check_fields(st, _STATUS, str(p))
    if "state" in st and st["state"] not in STATES:
        raise ValueError(f"{p}: state: {st['state']!r}; expected one of {', '.join(STATES)}")


def _metric_record(rec: dict[str, Any], where: str) -> dict[str, Any]:
    step = rec.get("step")
    if isinstance(step, bool) or not isinstance(step, int):
        raise ValueError(f"{where}: step: expected an integer, got {_kind(step)} {json.dumps(step)[:40]}")
    for k, v in rec.items():
        if not _is_number(v):
            raise ValueError(f"{where}: {k}: expected a number, got {_kind(v)} {json.dumps(v)[:40]}")
    return rec


def _is_number(v: Any) -> bool:
    """A metric value: a number, null, or one of the strings `dumps` writes for non-finite floats."""
    if v is None or isinstance(v, (int, float)):
        return True
    if not isinstance(v, str):
        return False
    try:
        float(v)
    except ValueError:
        return False
    return True


def _finding(rec: dict[str, Any], where: str) -> Finding:
    _check_fields(rec, _FINDING, where)
    for key in ("severity", "kind", "message"):
        if rec.get(key) is None:
            raise ValueError(f"{where}: {key}: missing; a finding needs severity, kind and message")
    try:
        return Finding.from_dict({**rec, "kind": current_kind(rec)})
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None


_NONFINITE_WORDS = ("nan", "inf", "-inf", "nan+inf")


def current_kind(rec: Mapping[str, Any]) -> str:
    """The kind a finding record has today: run directories written before the catch-all kinds were
    split (`verlaudit.kinds`) say ``boundary/collator``, ``boundary/reward`` or ``boundary/rollout_tokens``
    for several problems, told apart by what they observed and expected (the values the audit wrote
    for each), and ``dtype/float_became_int`` also for a log-prob or loss that was not a float tensor.
    Every other kind is returned as it is. `pytest tests/test_kinds.py` checks that every kind this
    returns is registered."""
    kind, obs, exp = str(rec.get("kind")), rec.get("observed"), rec.get("expected")
    if kind == "boundary/collator":
        if exp == "torch.long tensor":
            return "boundary/collator_not_tensor"
        if isinstance(obs, str) and obs.startswith(("fp", "bf")):
            return "boundary/collator_float_ids"
        if isinstance(obs, str) and obs.startswith(("int", "uint")):
            return "boundary/collator_id_width"
        if isinstance(exp, list) and len(exp) == 2 and exp[0] == 0:
            return "boundary/collator_id_range"  # [0, vocab - 1]; a shape mismatch expects [batch, length]
        return "boundary/collator_shape"
    if kind == "boundary/reward":
        if exp == "finite" or str(obs).lower() in _NONFINITE_WORDS:
            return "boundary/reward_nonfinite"
        if exp == "numbers":
            return "boundary/reward_not_numbers"
        if isinstance(obs, list):
            return "boundary/reward_shape"
        if obs == "list":
            return "boundary/reward_list"
        return "boundary/reward_dtype" if exp in ("fp32", "fp32 tensor") else "boundary/reward_device"
    if kind == "boundary/rollout_tokens":
        shapes = isinstance(obs, list) and bool(obs) and isinstance(obs[0], list)
        return "boundary/rollout_shape" if shapes else "boundary/rollout_token_range"
    if kind == "dtype/float_became_int" and "not a floating tensor" in str(rec.get("message")):
        return "dtype/island_not_float"
    return kind


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
    manifest, status = read_json(p / MANIFEST), read_json(p / STATUS)
    if manifest is not None:
        _check_manifest(manifest, p / MANIFEST)
    if status is not None:
        _check_status(status, p / STATUS)
    events = [rec for ln, rec in iter_jsonl_lines(p / EVENTS) if _event(rec, f"{p / EVENTS}:{ln}")]
    return RunDir(
        path=p,
        manifest=manifest or {},
        metrics=[_metric_record(rec, f"{p / METRICS}:{ln}") for ln, rec in iter_jsonl_lines(p / METRICS)],
        findings=[_finding(rec, f"{p / FINDINGS}:{ln}") for ln, rec in iter_jsonl_lines(p / FINDINGS)],
        events=events,
        status=status,
    )


def _event(rec: dict[str, Any], where: str) -> bool:
    if not isinstance(rec.get("kind"), str):
        raise ValueError(
            f"{where}: kind: expected a string naming the event, got {json.dumps(rec.get('kind'))[:40]}"
        )
    return True
