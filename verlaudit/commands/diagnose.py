"""`verlaudit diagnose PATH`: cause, culprit and fix for a run directory, a suite's runs or a log.

The command: diagnose the path (`verlaudit.analysis.diagnose.diagnosis`), render each diagnosis as
text (or ``--json``), and for a run made by `verlaudit from-verl` show each fix as the lines of the
user's own verl script (`verlaudit.verl.roundtrip`). Exit code 1 when an error-level cause was found,
0 otherwise, 2 on bad input. Exercised by `pytest tests/test_diagnose.py tests/test_log_rules.py`.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path

from verlaudit.analysis.causes import Fix
from verlaudit.analysis.diagnose.diagnosis import Diagnosis, diagnose_path
from verlaudit.rundir import MANIFEST, read_json
from verlaudit.verl.roundtrip import script_lines


def render_text(d: Diagnosis) -> str:
    lines = [f"{d.source_kind} {d.source}", f"  {d.summary}", f"  verdict: {d.verdict}"]
    if not d.causes:
        lines.append("  no problems found")
    for i, c in enumerate(d.causes, 1):
        lines.append(f"  {i}. [{c.severity}] {c.title}")
        if d.source_kind == "log" and (
            c.framework or c.phase or c.rank is not None
        ):  # where it sits in the run
            at = [
                f"culprit: {c.where}" if c.where else None,
                f"phase: {c.phase}" if c.phase else None,
                f"rank: {c.rank}" if c.rank is not None else None,
            ]
            if any(at):
                lines.append("     " + "; ".join(a for a in at if a))
        if c.chain:
            lines.append(f"     root cause: {' -> '.join(c.chain)}")
        if c.consequence_of:
            lines.append(f"     consequence of the root cause above: {c.consequence_of}")
        lines.append(f"     what: {c.what}")
        for e in c.evidence:
            lines.append(f"     - {e}")
        for f in c.fixes:
            parts = [
                f"suite: {f.suite}" if f.suite else None,
                f"verl: {f.verl}" if f.verl else None,
                f"{f.framework}: {f.key}" if f.key else None,
            ]
            head = "; ".join(p for p in parts if p)
            lines.append(f"     fix: {head}{' — ' if head and f.why else ''}{f.why}")
            lines.extend(_verl_script_lines(d, f))
        for u in c.unknown:
            lines.append(f"     cannot tell: {u}")
    return "\n".join(lines)


def _verl_script_lines(d: Diagnosis, fix: Fix) -> list[str]:
    """For a run made by `verlaudit from-verl`: the fix as the user's own verl script lines."""
    manifest = read_json(Path(d.source) / MANIFEST) if d.source_kind == "run" else None
    origin = (((manifest or {}).get("config") or {}).get("origin") or {}).get("verl")
    if not origin:
        return []
    return [f"       {line}" for line in script_lines(origin, fix.verl, fix.suite)]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "path", help="a variant's run directory, a suite report directory, or a log/traceback file"
    )
    p.add_argument("--json", action="store_true", help="machine-readable output")


def main(args: argparse.Namespace) -> int:
    diags = diagnose_path(args.path)
    if args.json:
        print(
            json.dumps(
                {"diagnoses": [d.to_dict() for d in diags], "verdict": _overall(diags)}, indent=2, default=str
            )
        )
    else:
        if len(diags) > 1:
            print(f"summary ({len(diags)} runs):")
            for d in diags:
                top = _headline(d)
                print(f"  {d.verdict:8s} {d.summary} — {top}")
            print()
        print("\n\n".join(render_text(d) for d in diags))
    return 1 if _overall(diags) == "error" else 0


def _headline(d: Diagnosis) -> str:
    """The first cause in one line: its chain when it has one."""
    if not d.causes or d.verdict == "clean":
        return "no problems found"
    first = d.causes[0]
    return " -> ".join(first.chain) if first.chain else first.title


def _overall(diags: Sequence[Diagnosis]) -> str:
    v = {d.verdict for d in diags}
    return "error" if "error" in v else "warning" if "warning" in v else "clean"
