"""Several runs in one worker process: how `verlaudit recommend` runs a single-GPU suite's candidates, so
the imports, the CUDA context and the first use of each kernel are paid once instead of once per
candidate (``--isolate`` goes back to one process each, `verlaudit.run.runner.execute`).

`execute` keeps `runner.execute`'s contract: the same run directories (spec.json, worker.log,
runner.json, what the worker writes), the same `runner.Progress` callbacks as each run ends, Ctrl-C
stops the running one and returns what was done. And it keeps the isolation that matters: a run that
fails (an OOM is an exception like any other) ends its process and the runs after it start in a fresh
one (`verlaudit.run.worker.run_many`); a process that dies without a status (a crash, the kernel's
OOM killer) has the run in progress recorded as the runner records a dead worker (runner.json's exit
code, no status) and the rest go on in a new process. What the runs share is the process: the torch
settings a run may change are put back between runs, and a run that leaves device memory allocated
hands the rest to a fresh process. Exercised by `pytest tests/test_recommend_batch.py`.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import verlaudit
from verlaudit.run import runner, worker
from verlaudit.run.runner import Plan, PlannedRun, Progress
from verlaudit.run.suite import Suite
from verlaudit.rundir import METRICS, RUNNER, SPEC, STATUS, SUITE_COPY, WORKER_LOG, read_json

PROCESS_LOG = "workers.log"
"""In the output directory: what the shared processes print outside any run (each run's own output is in
its worker.log)."""


def execute(
    plan: Plan,
    suite: Suite,
    out_dir: Path,
    *,
    progress: bool = True,
    on_run: Callable[[Progress], None] | None = None,
) -> tuple[list[str], bool]:
    """`runner.execute` with the runs sharing worker processes; several GPUs per run (torchrun) fall
    back to one process per run."""
    if suite.hardware.gpus > 1:
        return runner.execute(plan, suite, out_dir, progress=progress, on_run=on_run)
    tell = on_run or (lambda _p: None)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / SUITE_COPY).write_text(
        json.dumps({**suite.to_dict(), "source": suite.source, "device": plan.device}, indent=2),
        encoding="utf-8",
    )
    done: list[str] = []
    pending: list[PlannedRun] = []
    for planned in plan.runs:
        name = planned.run.run_name
        if planned.refused:
            worker.write_refused(planned.spec, planned.refused)
            done.append(name)
            tell(Progress(name=name, run_dir=out_dir / name, refused=planned.refused))
            continue
        planned.spec.run_dir.mkdir(parents=True, exist_ok=True)
        spec_path = planned.spec.run_dir / SPEC
        spec_path.write_text(json.dumps(planned.spec.to_dict(), indent=2), encoding="utf-8")
        pending.append(planned)
    previous = signal.signal(signal.SIGTERM, runner._sigterm_as_interrupt)
    try:
        while pending:
            pending, interrupted = _one_process(pending, out_dir, progress, tell, done)
            if interrupted:
                left = tuple(p.run.run_name for p in plan.runs if p.run.run_name not in done)
                tell(Progress(name=done[-1], run_dir=out_dir / done[-1], not_started=left))
                return done, True
    finally:
        signal.signal(signal.SIGTERM, previous)
    return done, False


def worker_command(spec_paths: list[Path]) -> list[str]:
    """One worker process for several specs, run in order (`verlaudit.run.worker.run_many`)."""
    return [sys.executable, "-m", "verlaudit.run.worker", *map(str, spec_paths)]


def _env() -> dict[str, str]:
    """The worker's environment, as `runner` gives it (NVLink multicast off, unbuffered, this tree first)."""
    env = {
        "NCCL_NVLS_ENABLE": "0",
        "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
        "NVSHMEM_DISABLE_NVLS": "1",
        **os.environ,
    }
    env["PYTHONUNBUFFERED"] = "1"
    root = str(Path(verlaudit.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join([root, *filter(None, [env.get("PYTHONPATH")])])
    return env


# long: one loop follows a process through several runs: status files appearing, the bar, Ctrl-C and a death
def _one_process(
    pending: list[PlannedRun],
    out_dir: Path,
    progress: bool,
    tell: Callable[[Progress], None],
    done: list[str],
) -> tuple[list[PlannedRun], bool]:
    """One worker process for ``pending``, followed until it exits; returns the runs it left (from
    the first without a status after the one it was on) and whether the user interrupted."""
    from tqdm import tqdm

    cmd = worker_command([p.spec.run_dir / SPEC for p in pending])
    at, started = 0, time.monotonic()
    record: dict[str, Any] = {"command": cmd, "started_at": runner.now(), "shared_process": True}

    def bar_for(i: int) -> Any:
        return tqdm(
            total=pending[i].spec.train.steps,
            desc=pending[i].run.run_name,
            unit="step",
            disable=None if progress else True,
            leave=True,
        )

    def finish(i: int, returncode: int | None, **extra: Any) -> dict[str, Any]:
        nonlocal started
        planned = pending[i]
        state = (read_json(planned.spec.run_dir / STATUS) or {}).get("state")
        if returncode is None:
            returncode = 0 if state == "completed" else 1
        rec = {**record, "returncode": returncode, "wall_s": round(time.monotonic() - started, 2), **extra}
        (planned.spec.run_dir / RUNNER).write_text(json.dumps(rec, indent=2), encoding="utf-8")
        done.append(planned.run.run_name)
        started = time.monotonic()
        record["started_at"] = runner.now()
        return rec

    with open(out_dir / PROCESS_LOG, "ab") as log:
        child = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, env=_env(), start_new_session=True
        )
        bar, tail = bar_for(0), runner._MetricsTail(pending[0].spec.run_dir / METRICS)
        try:
            while True:
                exited = child.poll() is not None
                while at < len(pending) and (pending[at].spec.run_dir / STATUS).exists():
                    runner._update_bar(bar, tail.poll())
                    bar.close()
                    rec = finish(at, None)
                    tell(Progress(name=done[-1], run_dir=pending[at].spec.run_dir, record=rec))
                    at += 1
                    if at < len(pending):
                        bar, tail = bar_for(at), runner._MetricsTail(pending[at].spec.run_dir / METRICS)
                if exited or at >= len(pending):
                    break
                runner._update_bar(bar, tail.poll())
                time.sleep(0.5)
        except KeyboardInterrupt:
            runner._stop(child)
            bar.close()
            if at < len(pending):
                finish(at, child.wait(), interrupted=True)
            return [], True
        bar.close()
        returncode = child.wait()
    began = at < len(pending) and (pending[at].spec.run_dir / WORKER_LOG).exists()
    if at < len(pending) and (began or at == 0):
        # it died inside a run, without the run's status (or before any run: no second try, so every
        # process moves the queue on): recorded as runner.execute records a dead worker
        rec = finish(at, returncode if returncode != 0 else 1)
        tell(Progress(name=done[-1], run_dir=pending[at].spec.run_dir, record=rec))
        at += 1
    return pending[at:], False
