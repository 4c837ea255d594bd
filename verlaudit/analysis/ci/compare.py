"""``verlaudit compare RUN --baseline BASELINE``: regression checks for CI, per variant x check.

RUN and BASELINE are run directories or suite report directories (variants matched by run
directory name). Checks, each a JUnit test case:

- ``status``: a variant that completed in the baseline must complete now.
- ``memory``: peak device memory (``perf/device_memory_peak_gb``, NVML) may grow by ``memory_rel``
  (default 5%). When both runs measured host RSS instead (CPU, no NVML) the peak includes the
  interpreter and libraries and moves by tens of MB with thread counts and allocator arenas, so a
  difference counts only above ``max(memory_rel x baseline, rss_abs_gb)`` (default 0.25 GB); runs
  whose memory sources differ are not comparable (skipped, with the reason).
- ``allocator_memory``: ``perf/max_memory_allocated_gb`` (CUDA only) may grow by ``memory_rel``.
- ``step_time``: median ``perf/step_time_s`` (first step excluded: warm-up) may grow by
  ``step_time_ratio`` (default 1.5x; CPU timings are noisy and machine-dependent).
- ``trajectory:<metric>`` (default ``actor/loss``, plus every metric of the baseline's tolerance
  model): per step ``|now - baseline| <= atol(step)`` and the residual mean
  ``|mean(now - baseline)| <= mean_atol`` so a small one-sided drift that stays inside the per-step
  band is still caught; NaN where the baseline was finite fails. Which tolerance applies, per step,
  in this order: ``loss_atol`` / ``loss_mean_atol`` set explicitly (``--tolerances`` over the suite's
  ``compare:`` mapping), else the baseline's ``tolerances.json`` (per variant, metric and step,
  measured across CPU kernels: `verlaudit.analysis.ci.tolerance`) for the steps it covers, else the
  defaults below. The markdown and JUnit say which applied at each step.
- ``findings``: no error-level finding (kind, role, where) that the baseline did not have.
- ``overflow``: no more skipped optimizer steps (``*/skipped``) and no new overflow findings.
- ``gate:<expr>``: gate expressions (`verlaudit.analysis.ci.gates`) from the suite or ``--gate``.

Tolerances come from the run's suite (``compare:`` mapping in the suite YAML, copied to the
report's suite.json), then ``--tolerances key=value,...``. Output: a markdown summary, JUnit XML,
exit 1 on any regression, 2 on bad input. ``--update-baseline`` copies RUN into BASELINE (default
``reports/baselines/<suite>/<device>/``), prints what changed, and keeps the baseline's
tolerances.json (a noise model, re-derived only by `benchmarks/derive_tolerances.py`). Exercised by
`pytest tests/test_compare.py tests/test_tolerance.py tests/test_ci_baseline.py`.
"""

from __future__ import annotations

import dataclasses
import math
import re
import shutil
import statistics
import xml.etree.ElementTree as ET
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from trainer.config_base import Section
from verlaudit.analysis.ci import tolerance as tolmodel
from verlaudit.analysis.ci.baseline_notes import write_notes
from verlaudit.analysis.ci.gates import Gate, check_gates, check_known_metrics, parse_gate
from verlaudit.rundir import (
    FINDINGS,
    MANIFEST,
    METRICS,
    STATUS,
    SUITE_COPY,
    RunDir,
    is_run_dir,
    read_json,
    read_run,
)

DEFAULT_TOLERANCES: dict[str, float] = {
    "memory_rel": 0.05,
    "rss_abs_gb": 0.25,
    "step_time_ratio": 1.5,
    "loss_atol": 0.05,
    "loss_mean_atol": 0.01,
}
"""Defaults for runs that are not bitwise reproducible (GPU kernels, other CPUs); a suite whose runs
are (CPU, fixed seed, one thread) should tighten the loss tolerances in its ``compare:`` mapping."""
BASELINE_FILES = (MANIFEST, METRICS, FINDINGS, STATUS)
"""What a committed baseline keeps of each run (events.jsonl is left out: large, and not compared)."""


@dataclasses.dataclass
class Check:
    variant: str
    check: str
    verdict: str  # "pass" | "fail" | "skip"
    baseline: str = ""
    now: str = ""
    tolerance: str = ""
    message: str = ""


@dataclasses.dataclass(frozen=True)
class Settings:
    tolerances: Mapping[str, float]
    trajectories: tuple[str, ...]
    variant_tolerances: Mapping[str, Mapping[str, float]]
    gates: tuple[Gate, ...]
    sources: Mapping[str, str] = dataclasses.field(default_factory=dict)
    """Tolerance key -> where it was set explicitly (``--tolerances``, ``suite``); absent: default."""

    def for_variant(self, name: str) -> dict[str, float]:
        base = name.rsplit("-s", 1)[0] if re.search(r"-s\d+$", name) else name
        return {
            **self.tolerances,
            **self.variant_tolerances.get(base, {}),
            **self.variant_tolerances.get(name, {}),
        }

    def explicit_for_variant(self, name: str) -> dict[str, str]:
        """Tolerance key -> source, for the keys set by the suite or the command line (these win
        over the baseline's tolerance model)."""
        base = name.rsplit("-s", 1)[0] if re.search(r"-s\d+$", name) else name
        out = dict(self.sources)
        for v in (base, name):
            for k in self.variant_tolerances.get(v, {}):
                if out.get(k) != "--tolerances":
                    out[k] = f"suite compare.variant_tolerances.{v}"
        return out


def _tolerance_map(data: Any, where: str) -> dict[str, float]:
    if not isinstance(data, Mapping):
        raise ValueError(f"{where}: expected a mapping of tolerances, got {data!r}")
    out = {}
    for k, v in data.items():
        if k not in DEFAULT_TOLERANCES:
            raise ValueError(
                f"{where}.{k}: unknown tolerance; expected one of {', '.join(DEFAULT_TOLERANCES)}"
            )
        if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0:
            raise ValueError(f"{where}.{k}: expected a non-negative number, got {v!r}")
        out[k] = float(v)
    return out


@dataclasses.dataclass(frozen=True, kw_only=True)
class CompareConfig(Section):
    """A suite's ``compare:`` mapping, as written (`Section`: unknown keys and wrong types name the
    field). `load_settings` turns it into `Settings`, with the command line on top."""

    tolerances: Any = None
    """Tolerance -> value (`DEFAULT_TOLERANCES` names them); over the defaults for every variant."""
    trajectories: Any = ("actor/loss",)
    """Metrics whose per-step trajectories are compared with the baseline's."""
    variant_tolerances: Any = None
    """Variant -> tolerances, over ``tolerances`` for that variant (and its ``-s<seed>`` runs)."""
    gates: Any = None
    """Gate expressions (`verlaudit.analysis.ci.gates`), each a check of every variant."""
    baseline: str | None = None
    """The baseline directory ``verlaudit compare`` uses without ``--baseline``; relative to the suite
    file (`verlaudit.run.suite` resolves it). Unset: ``reports/baselines/<suite>/<device>/``."""

    def __post_init__(self) -> None:
        _tolerance_map(self.tolerances or {}, "tolerances")
        traj = self.trajectories
        if not isinstance(traj, (list, tuple)) or not all(isinstance(t, str) for t in traj):
            raise ValueError(f"trajectories: expected a list of metric names, got {traj!r}")
        vt = self.variant_tolerances or {}
        if not isinstance(vt, Mapping):
            raise ValueError(f"variant_tolerances: expected variant -> tolerances, got {vt!r}")
        for k, v in vt.items():
            _tolerance_map(v, f"variant_tolerances.{k}")
        gates = self.gates or []
        if not isinstance(gates, (list, tuple)):
            raise ValueError(f"gates: expected a list of gate expressions, got {gates!r}")
        for i, g in enumerate(gates):
            try:
                parse_gate(g)
            except ValueError as e:
                raise ValueError(f"gates[{i}]: {e}") from None


def load_settings(
    compare: Mapping[str, Any] | None, cli_tolerances: Sequence[str] = (), cli_gates: Sequence[str] = ()
) -> Settings:
    """Validates the suite's ``compare:`` mapping (`CompareConfig`) and applies the command line on top."""
    cfg = CompareConfig.from_dict(compare, "compare")
    suite_tol = _tolerance_map(cfg.tolerances or {}, "compare.tolerances")
    tol = {**DEFAULT_TOLERANCES, **suite_tol}
    sources = dict.fromkeys(suite_tol, "suite compare.tolerances")
    for item in cli_tolerances:
        for part in filter(None, (p.strip() for p in item.split(","))):
            if "=" not in part:
                raise ValueError(f"--tolerances {part!r}: expected key=value, e.g. loss_atol=1e-6")
            k, v = part.split("=", 1)
            try:
                tol.update(_tolerance_map({k.strip(): float(v)}, "--tolerances"))
            except ValueError as e:
                raise ValueError(str(e) if "unknown" in str(e) else f"--tolerances {part!r}: {e}") from None
            sources[k.strip()] = "--tolerances"
    vt = {str(k): _tolerance_map(v, "") for k, v in (cfg.variant_tolerances or {}).items()}
    gates = [parse_gate(g) for g in cfg.gates or []]
    for g in cli_gates:
        try:
            gates.append(parse_gate(g))
        except ValueError as e:
            raise ValueError(f"--gate: {e}") from None
    return Settings(tol, tuple(cfg.trajectories), vt, tuple(gates), sources)


# --------------------------------------------------------------------------------------------
# reading


def load_runs(path: str | Path, what: str) -> tuple[dict[str, RunDir], dict[str, Any]]:
    """name -> RunDir for a run directory or a suite report directory, and the suite copy (or {})."""
    p = Path(path)
    if not p.is_dir():
        raise ValueError(f"{what} {p}: no such directory; pass a run directory or a suite report directory")
    if is_run_dir(p):
        suite = read_json(p.parent / SUITE_COPY) or {}
        return {p.name: read_run(p)}, suite
    runs = {c.name: read_run(c) for c in sorted(p.iterdir()) if is_run_dir(c)}
    if not runs:
        raise ValueError(
            f"{what} {p}: contains no run directories ({MANIFEST} / {METRICS}); for a baseline, create "
            "it with --update-baseline"
        )
    return runs, read_json(p / SUITE_COPY) or {}


def _values(run: RunDir, key: str) -> list[float]:
    return [v for _, v in run.series(key)]


def _peak(run: RunDir, key: str) -> float | None:
    xs = [v for v in _values(run, key) if math.isfinite(v)]
    return max(xs) if xs else None


def _mem_source(run: RunDir) -> str | None:
    return ((run.manifest.get("memory") or {}).get("source")) or None


def _g(v: float | None) -> str:
    return "-" if v is None else f"{v:.6g}"


# --------------------------------------------------------------------------------------------
# checks: pure functions (name, baseline, now, tolerances) -> Check


def check_status(name: str, base: RunDir, now: RunDir) -> Check:
    b, n = base.state, now.state
    reason = (now.status or {}).get("reason")
    msg = f"baseline {b}, now {n}" + (
        f" ({reason} at step {(now.status or {}).get('step')})" if reason else ""
    )
    if b == "completed" and n != "completed":
        return Check(name, "status", "fail", b, n, "must stay completed", f"regression: {msg}")
    return Check(name, "status", "pass", b, n, "must stay completed", msg)


def check_memory(name: str, base: RunDir, now: RunDir, tol: Mapping[str, float]) -> Check:
    key = "perf/device_memory_peak_gb"
    b, n = _peak(base, key), _peak(now, key)
    sb, sn = _mem_source(base), _mem_source(now)
    if b is None or n is None:
        return Check(name, "memory", "skip", _g(b), _g(n), "", f"{key} not recorded by both runs")
    if sb != sn:
        return Check(
            name,
            "memory",
            "skip",
            f"{_g(b)} ({sb})",
            f"{_g(n)} ({sn})",
            "",
            f"memory sources differ ({sb} vs {sn}): not comparable",
        )
    allowed = tol["memory_rel"] * b
    label = f"+{tol['memory_rel']:.0%}"
    if sb == "rss":
        allowed = max(allowed, tol["rss_abs_gb"])
        label += f" or {tol['rss_abs_gb']:g} GB (RSS)"
    verdict = "fail" if n - b > allowed else "pass"
    msg = f"peak {n:.4g} GB vs {b:.4g} GB ({(n - b) / b:+.1%}, source {sb})" if b > 0 else f"peak {n:.4g} GB"
    return Check(
        name, "memory", verdict, _g(b), _g(n), label, ("regression: " if verdict == "fail" else "") + msg
    )


def check_allocator(name: str, base: RunDir, now: RunDir, tol: Mapping[str, float]) -> Check | None:
    key = "perf/max_memory_allocated_gb"
    b, n = _peak(base, key), _peak(now, key)
    if b is None or n is None or b <= 0:
        return None  # CPU runs have no allocator statistics: no test case rather than a skip per variant
    verdict = "fail" if n > b * (1 + tol["memory_rel"]) else "pass"
    return Check(
        name,
        "allocator_memory",
        verdict,
        _g(b),
        _g(n),
        f"+{tol['memory_rel']:.0%}",
        f"allocator peak {n:.4g} GB vs {b:.4g} GB ({(n - b) / b:+.1%})",
    )


def check_step_time(name: str, base: RunDir, now: RunDir, tol: Mapping[str, float]) -> Check:
    b, n = _values(base, "perf/step_time_s")[1:], _values(now, "perf/step_time_s")[1:]
    if not b or not n:
        return Check(name, "step_time", "skip", "", "", "", "fewer than 2 timed steps in one of the runs")
    mb, mn = statistics.median(b), statistics.median(n)
    ratio = mn / mb if mb > 0 else math.inf
    verdict = "fail" if ratio > tol["step_time_ratio"] else "pass"
    return Check(
        name,
        "step_time",
        verdict,
        f"{mb:.4g} s",
        f"{mn:.4g} s",
        f"x{tol['step_time_ratio']:g}",
        f"median step time x{ratio:.2f} of baseline (first step excluded)",
    )


def check_trajectory(
    name: str,
    key: str,
    base: RunDir,
    now: RunDir,
    tol: Mapping[str, float],
    model: tolmodel.Model | None = None,
    explicit: Mapping[str, str] | None = None,
) -> Check:
    """Per-step and mean-residual check of one metric; ``model`` gives per-step tolerances where
    ``explicit`` (tolerance key -> source) does not override them."""
    explicit = explicit or {}
    b, n = dict(base.series(key)), dict(now.series(key))
    check = f"trajectory:{key}"
    if not b:
        return Check(name, check, "skip", "", "", "", f"{key} not in the baseline")
    steps = sorted(set(b) & set(n))
    missing = sorted(set(b) - set(n))
    if not steps:
        return Check(
            name, check, "fail", f"{len(b)} steps", "0 steps", "", f"regression: no {key} recorded now"
        )
    per_step = tolmodel.step_tolerances(steps, tol, model, explicit)
    bad_nan = [s for s in steps if math.isfinite(b[s]) and not math.isfinite(n[s])]
    ok = [i for i, s in enumerate(steps) if math.isfinite(b[s]) and math.isfinite(n[s])]
    res = [n[steps[i]] - b[steps[i]] for i in ok]
    mean = tolmodel.mean_tolerance(len(res), tol, model, explicit)
    label = tolmodel.tolerance_label(steps, per_step, mean)
    over = [
        (steps[i], abs(n[steps[i]] - b[steps[i]]), per_step[i][0])
        for i in ok
        if abs(n[steps[i]] - b[steps[i]]) > per_step[i][0]
    ]
    mean_res = tolmodel.mean_residual([b[steps[i]] for i in ok], [n[steps[i]] for i in ok])
    problems = []
    if bad_nan:
        problems.append(f"non-finite at step(s) {bad_nan[:5]} where the baseline was finite")
    for s, d, a in over[:3]:
        problems.append(f"step {s}: {n[s]:.6g} vs {b[s]:.6g} (|d| {d:.3g} > {a:.2g})")
    if len(over) > 3:
        problems.append(f"{len(over) - 3} more step(s) outside tolerance")
    if abs(mean_res) > mean[0]:
        problems.append(
            f"one-sided drift: mean residual {mean_res:+.3g} over {len(res)} steps (> {mean[0]:.2g})"
        )
    if missing:
        problems.append(f"{len(missing)} baseline step(s) missing now (from step {missing[0]})")
    ratios = [abs(n[steps[i]] - b[steps[i]]) / per_step[i][0] if per_step[i][0] > 0 else math.inf for i in ok]
    worst = max(range(len(ok)), key=lambda j: ratios[j], default=None)
    summary = f"{len(steps)} steps, mean d {mean_res:+.3g}"
    if worst is not None:
        s = steps[ok[worst]]
        summary += f", closest to tolerance: step {s} |d| {abs(n[s] - b[s]):.3g} ({ratios[worst]:.2f} of it)"
    return Check(
        name,
        check,
        "fail" if problems else "pass",
        f"{len(b)} steps",
        f"{len(n)} steps",
        label,
        ("regression: " + "; ".join(problems)) if problems else summary,
    )


def _error_keys(run: RunDir) -> set[tuple[Any, ...]]:
    return {(f.kind, f.role, f.where) for f in run.findings if f.severity == "error"}


def check_findings(name: str, base: RunDir, now: RunDir) -> Check:
    new = sorted(_error_keys(now) - _error_keys(base), key=str)
    n_b, n_n = len(_error_keys(base)), len(_error_keys(now))
    if new:
        shown = "; ".join(f"{k} in {r or '-'} {w or '-'}" for k, r, w in new[:5])
        return Check(
            name,
            "findings",
            "fail",
            str(n_b),
            str(n_n),
            "no new errors",
            f"regression: new error findings: {shown}",
        )
    return Check(name, "findings", "pass", str(n_b), str(n_n), "no new errors", "no new error-level findings")


def _skips(run: RunDir) -> float:
    keys = {k for m in run.metrics for k in m if k.endswith("/skipped")}
    return sum(v for k in keys for v in _values(run, k) if math.isfinite(v))


def check_overflow(name: str, base: RunDir, now: RunDir) -> Check:
    sb, sn = _skips(base), _skips(now)
    ob = {(f.kind, f.role, f.where) for f in base.findings if "overflow" in f.kind}
    new_of = sorted({(f.kind, f.role, f.where) for f in now.findings if "overflow" in f.kind} - ob, key=str)
    problems = []
    if sn > sb:
        problems.append(f"skipped optimizer steps {sb:g} -> {sn:g}")
    if new_of:
        problems.append("new overflow findings: " + "; ".join(f"{k} at {w}" for k, _, w in new_of[:3]))
    return Check(
        name,
        "overflow",
        "fail" if problems else "pass",
        f"{sb:g} skipped",
        f"{sn:g} skipped",
        "no new skips/overflows",
        ("regression: " + "; ".join(problems)) if problems else "no new skips",
    )


def preset_of(run: RunDir) -> str | None:
    return ((run.manifest.get("config") or {}).get("precision") or {}).get("preset")


def trajectory_checks(
    name: str, base: RunDir, now: RunDir, settings: Settings, model: tolmodel.ToleranceModel | None
) -> list[Check]:
    """The suite's trajectories and every metric the baseline's model covers for this variant."""
    tol, explicit = settings.for_variant(name), settings.explicit_for_variant(name)
    found = model.for_variant(name, preset_of(base)) if model else None
    metrics = dict.fromkeys([*settings.trajectories, *(found[1].metrics if found else ())])
    out = []
    for key in metrics:
        mm = found[1].metrics.get(key) if found else None
        out.append(check_trajectory(name, key, base, now, tol, (found[0], mm) if mm else None, explicit))
    return out


def compare_runs(
    base_runs: Mapping[str, RunDir],
    now_runs: Mapping[str, RunDir],
    settings: Settings,
    model: tolmodel.ToleranceModel | None = None,
) -> list[Check]:
    """Every check for every variant, in variant order; ``model``: the baseline's tolerances.json."""
    known = {k for r in now_runs.values() for m in r.metrics for k in m}
    check_known_metrics(settings.gates, sorted(known))
    out: list[Check] = []
    for name in sorted(set(base_runs) | set(now_runs)):
        if name not in now_runs:
            out.append(
                Check(
                    name,
                    "status",
                    "fail",
                    base_runs[name].state,
                    "missing",
                    "must exist",
                    "regression: variant is in the baseline but was not run",
                )
            )
            continue
        now = now_runs[name]
        if name not in base_runs:
            out.append(
                Check(name, "status", "skip", "missing", now.state, "", "new variant: no baseline yet")
            )
            out += _gate_checks(name, now, settings)
            continue
        base, tol = base_runs[name], settings.for_variant(name)
        out.append(check_status(name, base, now))
        out.append(check_memory(name, base, now, tol))
        alloc = check_allocator(name, base, now, tol)
        if alloc:
            out.append(alloc)
        out.append(check_step_time(name, base, now, tol))
        out += trajectory_checks(name, base, now, settings, model)
        out.append(check_findings(name, base, now))
        out.append(check_overflow(name, base, now))
        out += _gate_checks(name, now, settings)
    return out


def _gate_checks(name: str, now: RunDir, settings: Settings) -> list[Check]:
    if not settings.gates:
        return []
    keys = {k for m in now.metrics for k in m if k != "step"}
    series = {k: _values(now, k) for k in keys}
    return [
        Check(name, f"gate:{r['gate']}", "pass" if r["passed"] else "fail", "", "", r["gate"], r["message"])
        for r in check_gates(settings.gates, series)
    ]


def config_differences(base_runs: Mapping[str, RunDir], now_runs: Mapping[str, RunDir]) -> list[str]:
    """Config keys that differ between matched variants: a regression may simply be a changed suite."""
    out = []
    for name in sorted(set(base_runs) & set(now_runs)):
        a = _flatten(base_runs[name].manifest.get("config") or {})
        b = _flatten(now_runs[name].manifest.get("config") or {})
        diff = [k for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
        if diff:
            out.append(f"{name}: " + ", ".join(f"{k} {a.get(k)!r} -> {b.get(k)!r}" for k in diff[:6]))
    return out


def _flatten(d: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, Mapping) and v:
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


# --------------------------------------------------------------------------------------------
# output


def render_markdown(checks: Sequence[Check], run: str, baseline: str, notes: Sequence[str] = ()) -> str:
    fails = [c for c in checks if c.verdict == "fail"]
    head = "REGRESSION" if fails else "no regression"
    lines = [f"## verlaudit compare: {head}", "",
             f"`{run}` vs baseline `{baseline}`: {len(checks)} checks, {len(fails)} failed, "
             f"{sum(c.verdict == 'skip' for c in checks)} skipped", ""]  # fmt: skip
    for n in notes:
        lines.append(f"> config differs: {n}")
    if notes:
        lines.append("")
    lines += ["| variant | check | baseline | now | tolerance | verdict |", "|---|---|---|---|---|---|"]
    for c in checks:
        mark = {"pass": "pass", "fail": "**FAIL**", "skip": "skip"}[c.verdict]
        cells = [c.variant, c.check, c.baseline, c.now, c.tolerance, f"{mark}: {c.message}"]
        lines.append("| " + " | ".join(x.replace("|", "\\|") for x in cells) + " |")
    return "\n".join(lines) + "\n"


def render_junit(checks: Sequence[Check], suite: str) -> str:
    """JUnit XML: one <testcase> per variant x check, <failure>/<skipped> children."""
    root = ET.Element("testsuites", name="verlaudit compare")
    ts = ET.SubElement(
        root,
        "testsuite",
        name=f"verlaudit.analysis.ci.compare.{suite}",
        tests=str(len(checks)),
        failures=str(sum(c.verdict == "fail" for c in checks)),
        errors="0",
        skipped=str(sum(c.verdict == "skip" for c in checks)),
    )
    root.set("tests", ts.get("tests"))
    root.set("failures", ts.get("failures"))
    for c in checks:
        tc = ET.SubElement(ts, "testcase", classname=f"{suite}.{c.variant}", name=c.check, time="0")
        if c.verdict == "fail":
            f = ET.SubElement(tc, "failure", message=c.message[:500], type="regression")
            f.text = f"baseline: {c.baseline}\nnow: {c.now}\ntolerance: {c.tolerance}\n{c.message}"
        elif c.verdict == "skip":
            ET.SubElement(tc, "skipped", message=c.message[:500])
        else:
            out = ET.SubElement(tc, "system-out")
            out.text = f"tolerance: {c.tolerance}\n{c.message}" if c.tolerance else c.message
    ET.indent(root)
    return '<?xml version="1.0" encoding="UTF-8"?>\n' + ET.tostring(root, encoding="unicode") + "\n"


# --------------------------------------------------------------------------------------------
# baselines


def device_slug(run: RunDir) -> str:
    env = run.manifest.get("environment") or {}
    name = env.get("gpu_name")
    if not name or str(env.get("device", "cpu")).startswith("cpu"):
        return "cpu"
    return re.sub(r"[^a-z0-9]+", "-", str(name).lower()).strip("-")


def default_baseline(runs: Mapping[str, RunDir], suite: Mapping[str, Any]) -> Path:
    first = next(iter(runs.values()))
    name = suite.get("name") or first.manifest.get("suite") or "suite"
    return Path("reports") / "baselines" / str(name) / device_slug(first)


def write_baseline(now_runs: Mapping[str, RunDir], run_path: Path, dest: Path) -> None:
    """Copies the runs into ``dest`` (runs no longer there are removed); a tolerances.json already
    there is kept: it models kernel noise, which a new baseline run does not re-measure."""
    dest.mkdir(parents=True, exist_ok=True)
    for old in dest.iterdir():
        if old.is_dir() and is_run_dir(old) and old.name not in now_runs:
            shutil.rmtree(old)
    for name, run in now_runs.items():
        d = dest / name
        d.mkdir(exist_ok=True)
        for f in BASELINE_FILES:
            if (run.path / f).exists():
                shutil.copyfile(run.path / f, d / f)
            elif (d / f).exists():
                (d / f).unlink()
    src_suite = run_path / SUITE_COPY if not is_run_dir(run_path) else run_path.parent / SUITE_COPY
    if src_suite.exists():
        shutil.copyfile(src_suite, dest / SUITE_COPY)
    write_notes(dest)


def model_note(model: tolmodel.ToleranceModel | None, runs: Mapping[str, RunDir], dest: Path) -> str:
    derive = f"python benchmarks/derive_tolerances.py --baseline {dest}"
    if model is None:
        return f"no {tolmodel.TOLERANCE_FILE} in {dest}: trajectories use loss_atol / loss_mean_atol; derive one with `{derive}`"
    uncovered = [n for n in runs if model.for_variant(n, preset_of(runs[n])) is None]
    longest = max((len(r.metrics) for r in runs.values()), default=0)
    note = f"kept {model.path} (steps 0-{model.steps - 1}, variants {', '.join(model.variants)})"
    if uncovered:
        note += f"; not covered: {', '.join(uncovered)} (loss_atol applies)"
    if longest > model.steps:
        note += f"; steps >= {model.steps} use loss_atol"
    return note + f"; re-derive after a change to the suite or the trainer's numerics: `{derive}`"
