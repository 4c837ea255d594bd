"""A run directory as TensorBoard event files: every metric as a scalar, the findings and the status as
text, the loss-scale history (one point per optimizer step, from events.jsonl) as scalars.

Works on any run directory, ours or an adapter's, finished, failed or killed (it reads through
`verlaudit.rundir.read_run`). Uses the `tensorboard` package's event writer and summary protos (no
TensorFlow); it is an optional dependency, and a missing one is a one-line error saying how to get it.
``verlaudit tensorboard DIR`` and ``verlaudit run --tensorboard`` call `export` / `export_tree`.
Exercised by `pytest tests/test_integrations_tensorboard.py`.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from verlaudit.rundir import RunDir, is_run_dir, read_run, to_float

TB_DIR = "tensorboard"
"""The event files' folder: inside a run directory, or (one subfolder per run) inside a suite's."""


def require() -> Any:
    """The tensorboard pieces the export uses; ValueError saying how to install them when missing."""
    try:
        from tensorboard.compat.proto import event_pb2
        from tensorboard.plugins.scalar.summary_v2 import scalar_pb
        from tensorboard.plugins.text.summary_v2 import text_pb
        from tensorboard.summary.writer.event_file_writer import EventFileWriter
    except ImportError as e:
        raise ValueError(
            f"TensorBoard export needs the tensorboard package ({e}); install it with "
            "pip install tensorboard (it is in verlaudit's test extra: pip install -e '.[test]')"
        ) from None
    return event_pb2, scalar_pb, text_pb, EventFileWriter


def finding_lines(run: RunDir) -> dict[int, list[str]]:
    """Markdown lines of the findings, by the step each was first seen at (setup: 0)."""
    out: dict[int, list[str]] = {}
    for f in run.findings:
        at = ", ".join(
            x for x in (f.role, f.where, f.phase and f"phase {f.phase}", f.count > 1 and f"x{f.count}") if x
        )
        line = f"- **{f.severity}** `{f.kind}` ({at}): {f.message}" + (f" -- fix: {f.fix}" if f.fix else "")
        out.setdefault(int(f.step or 0), []).append(line)
    return out


def scale_history(run: RunDir) -> list[tuple[int, str, float, bool]]:
    """(step, role, loss scale after the step, skipped) of every optimizer step with a scaler."""
    out = []
    for e in run.events:
        scaler = e.get("scaler") or {}
        if e.get("kind") == "optimizer_step" and scaler.get("mode") not in (None, "none"):
            out.append(
                (
                    int(e.get("step") or 0),
                    str(e.get("role")),
                    to_float(scaler.get("scale")),
                    bool(e.get("skipped")),
                )
            )
    return out


def export(run_dir: str | Path, logdir: str | Path | None = None) -> tuple[Path, int]:
    """Writes ``run_dir``'s event file under ``logdir`` (default ``run_dir/tensorboard``); returns the
    folder and how many summaries it wrote."""
    event_pb2, scalar_pb, text_pb, EventFileWriter = require()
    run = read_run(run_dir)
    out = Path(logdir) if logdir is not None else Path(run_dir) / TB_DIR
    out.mkdir(parents=True, exist_ok=True)
    writer = EventFileWriter(str(out))
    wall = time.time()
    n = 0

    def put(step: int, summary: Any) -> None:
        nonlocal n
        writer.add_event(event_pb2.Event(wall_time=wall, step=step, summary=summary))
        n += 1

    try:
        for line in run.metrics:
            step = int(line["step"])
            for key, value in line.items():
                if key != "step" and value is not None:
                    put(step, scalar_pb(key, to_float(value)))
        for i, (_step, role, scale, skipped) in enumerate(scale_history(run)):
            put(i, scalar_pb(f"loss_scale/{role}/per_optimizer_step", scale))
            put(i, scalar_pb(f"loss_scale/{role}/skipped", 1.0 if skipped else 0.0))
        for step, lines in sorted(finding_lines(run).items()):
            put(step, text_pb("findings", "\n".join(lines)))
        st = run.status or {}
        status = f"**{run.state}**" + "".join(
            f"; {k}: {st[k]}" for k in ("reason", "step", "phase", "where", "error") if st.get(k) is not None
        )
        put(0, text_pb("status", f"{run.name}: {status}"))
    finally:
        writer.close()
    return out, n


def export_tree(path: str | Path, logdir: str | Path | None = None) -> list[tuple[Path, int]]:
    """A run directory, or every run directory of a suite's output (each under ``logdir/<run>``,
    default ``path/tensorboard/<run>``, so TensorBoard shows them side by side)."""
    p = Path(path)
    if is_run_dir(p):
        return [export(p, logdir)]
    runs = sorted(c for c in p.iterdir() if is_run_dir(c)) if p.is_dir() else []
    if not runs:
        raise ValueError(
            f"{p}: neither a run directory (manifest.json/metrics.jsonl/status.json) nor a folder of them; "
            "pass a run directory or a suite's output directory, e.g. reports/<suite>/<timestamp>"
        )
    base = Path(logdir) if logdir is not None else p / TB_DIR
    return [export(r, base / r.name) for r in runs]
