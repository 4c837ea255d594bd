"""Running a suite: every variant in its own process (the library under `verlaudit run`).

Preflight (`verlaudit.run.preflight`): import every plug-in and read every model directory the
suite names. Plan (pure, `plan_runs`): resolve the device, check the GPU count, decide target
emulation (memory cap, bf16 refusal) and the precision policy, once, into one
`verlaudit.run.spec.RunSpec` per (variant, seed). Execute (`execute`): write it as spec.json and
start ``python -m verlaudit.run.worker spec.json`` per run, so an OOM, NaN abort or crash is
recorded in that run's directory and the next variant still runs; a tqdm bar per variant is fed by
polling the child's metrics.jsonl, and the caller hears of each run as it ends (`Progress`). Ctrl-C
stops the running child (it records ``interrupted``) and returns what was done. The command on top
(parsing, printing, the report) is `verlaudit.commands.run`. Exercised by `pytest tests/test_runner.py`.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import verlaudit
from trainer.precision import PrecisionPolicy
from verlaudit.run import worker
from verlaudit.run.hardware import PresentDevice, detect, get_target
from verlaudit.run.spec import Emulation, RunSpec
from verlaudit.run.suite import Suite, SuiteRun
from verlaudit.rundir import METRICS, RUNNER, SPEC, STATUS, SUITE_COPY, WORKER_LOG, read_json, to_float

GRACE_S = 30.0
"""How long an interrupted worker gets to write its status before SIGTERM, then SIGKILL."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class PlannedRun:
    """One run with the spec its worker gets, or the reason the runner refuses to start it."""

    run: SuiteRun
    spec: RunSpec
    refused: str | None = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class Plan:
    device: str
    """``cpu`` or ``cuda``: where every variant runs."""
    notes: tuple[str, ...]
    """What the runner decided and why, printed before starting (target emulation, CPU fallback)."""
    runs: tuple[PlannedRun, ...]


def resolve_device(suite: Suite, present: PresentDevice, override: str | None) -> tuple[str, list[str]]:
    """Where the suite runs, with the notes explaining it; ValueError when it cannot run here."""
    target = get_target(suite.hardware.target)
    notes: list[str] = []
    wanted = override or (suite.train.device if suite.train.device != "auto" else None)
    if wanted is not None and wanted.startswith("cuda"):
        if not present.cuda:
            raise ValueError(f"--device {wanted}: no CUDA GPU is visible on this machine; use --device cpu")
        device = "cuda"
    elif wanted == "cpu":
        device = "cpu"
    elif target.memory_gb is None:
        device = "cpu"  # a CPU suite measures CPU behaviour even where a GPU exists
    elif present.cuda:
        device = "cuda"
    else:
        # A GPU suite silently moved to CPU would run for hours (7B on CPU) and its memory numbers
        # would mean nothing for the target; ask the user to choose.
        raise ValueError(
            f"suite {suite.name!r} targets {suite.hardware.gpus} x {target.name} (hardware.target) but this "
            "machine has no CUDA GPU. Run it on a GPU machine, or pass --device cpu (and a small --steps) "
            "to run it on CPU anyway, without memory emulation"
        )
    if device == "cpu" and target.memory_gb is not None:
        notes.append(
            f"target {target.name} is not emulated on CPU: running on CPU as requested; memory numbers are "
            "host RSS, not GPU memory"
        )
    if device == "cuda":
        if suite.hardware.gpus > present.gpu_count:
            raise ValueError(
                f"suite {suite.name!r} needs {suite.hardware.gpus} GPUs (hardware.gpus) but this machine has "
                f"{present.gpu_count} ({present.gpu_name}); run it where {suite.hardware.gpus} GPUs are visible, "
                "or set hardware.gpus to the GPUs you have"
            )
    elif suite.hardware.gpus > 1:
        notes.append(
            f"hardware.gpus={suite.hardware.gpus} on CPU: {suite.hardware.gpus} gloo processes per variant "
            "(torchrun + FSDP2 on CPU, the same code path as on GPUs)"
        )
    return device, notes


def emulation_for(suite: Suite, present: PresentDevice, device: str) -> Emulation:
    """The spec's ``emulation``: memory cap (GiB) when the target has less memory than this GPU."""
    target = get_target(suite.hardware.target)
    target_gb = suite.hardware.memory_gb or target.memory_gb
    if device != "cuda":
        reason = None if target.memory_gb is None else f"{target.name} not emulated: running on CPU"
        return Emulation(target=target.name, reason=reason)
    if target_gb is None:
        return Emulation(target=target.name, reason="cpu target run on a GPU as requested")
    here = present.memory_gb or 0.0
    if target_gb < here:
        return Emulation(
            target=target.name,
            memory_cap_gb=float(target_gb),
            reason=f"emulating {target.name}: the allocator capped at {target_gb:.4g} GiB of "
            f"{present.gpu_name}'s {here:.1f} GiB, so OOMs happen where they would on the target",
        )
    return Emulation(
        target=target.name,
        reason=f"{target.name} has {target_gb:.4g} GiB, not less than {present.gpu_name}'s {here:.1f} GiB: "
        "no cap; this GPU may OOM where the target would not",
    )


def bf16_refusal(policy: PrecisionPolicy, suite: Suite, present: PresentDevice, device: str) -> str | None:
    """Why a policy cannot run on the target (bf16 on a V100/T4-class GPU), else None: the runner's
    hardware check, made from the target and the GPU found here instead of by each worker."""
    import torch

    from trainer.precision import dtype_name

    target = get_target(suite.hardware.target)
    bf16_roles = [r for r, rp in policy.roles.items() if torch.bfloat16 in (rp.param_dtype, rp.compute_dtype)]
    if not bf16_roles:
        return None
    if not target.bf16:
        cc = ".".join(map(str, target.compute_capability or ()))
        return (
            f"target {target.name} (compute capability {cc}) has no native bf16; roles {', '.join(bf16_roles)} "
            f"use {dtype_name(torch.bfloat16)} under preset {policy.preset!r}. Use precision.preset: fp16 "
            "(fp16 autocast, fp32 master weights, dynamic loss scaling)"
        )
    if device == "cuda" and not present.bf16:
        return f"{present.gpu_name} has no native bf16 support; use precision.preset: fp16"
    return None


def plan_runs(
    suite: Suite, out_dir: Path, present: PresentDevice, device_override: str | None = None
) -> Plan:
    """Everything decided before the first process starts; raises ValueError if the suite can't run here."""
    from verlaudit.plan.planner import resolve_checkpoint_layers

    device, notes = resolve_device(suite, present, device_override)
    emulation = emulation_for(suite, present, device)
    if emulation.reason and emulation.reason not in " ".join(notes):
        notes.append(emulation.reason)
    # what checkpoint_layers: auto plans for: the emulated target's cap, else this GPU's memory
    usable_gib = (emulation.memory_cap_gb or present.memory_gb) if device == "cuda" else None
    runs = []
    for run in suite.expand():
        # train.device records the decision for the trainer run alone (the worker reads spec.device):
        # one process sees its GPU as index 0; several ranks get plain "cuda", each taking
        # cuda:LOCAL_RANK (trainer.distributed.init_distributed)
        one = device == "cuda" and suite.hardware.gpus == 1
        cfg = dataclasses.replace(run.config, device="cuda:0" if one else device)
        try:
            cfg, auto = resolve_checkpoint_layers(
                cfg,
                gpus=suite.hardware.gpus,
                target_gib=usable_gib,
                allocator_cap=emulation.memory_cap_gb is not None,
            )
        except ValueError as e:
            raise ValueError(f"{suite.source}: variants.{run.variant}.{e}") from None
        if auto:
            notes.append(f"{run.variant}: {auto}")
        run = dataclasses.replace(run, config=cfg)
        spec = run_spec(run, suite, out_dir, device=device, emulation=emulation)
        runs.append(PlannedRun(run=run, spec=spec, refused=bf16_refusal(spec.policy, suite, present, device)))
    return Plan(device=device, notes=tuple(notes), runs=tuple(runs))


def run_spec(run: SuiteRun, suite: Suite, out_dir: Path, *, device: str, emulation: Emulation) -> RunSpec:
    """The spec of one planned run: the only place a run's precision policy is taken from its config
    (the worker and the trainer receive it from here)."""
    return RunSpec(
        variant=run.variant,
        suite=suite.name,
        seed=run.seed,
        run_dir=out_dir / run.run_name,
        train=run.config,
        audit=suite.audit,
        emulation=emulation,
        device=device,
        policy=run.config.precision.build_policy(),
    )


def launch_command(spec_path: str | os.PathLike, gpus: int) -> list[str]:
    """One process per variant; ``torchrun --nproc_per_node gpus`` when the suite asks for several
    (FSDP2: rank 0 writes the variant's run dir, rank k its ``rank<k>`` subdirectory)."""
    if gpus > 1:
        return [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc_per_node={gpus}",
            "-m",
            "verlaudit.run.worker",
            str(spec_path),
        ]
    return [sys.executable, "-m", "verlaudit.run.worker", str(spec_path)]


def now() -> str:
    return _dt.datetime.now().astimezone().isoformat(timespec="seconds")


class _MetricsTail:
    """Reads the complete lines appended to a run's metrics.jsonl since the last poll."""

    def __init__(self, path: Path) -> None:
        self.path, self.offset, self.last = path, 0, {}

    def poll(self) -> dict[str, Any]:
        if not self.path.exists():
            return self.last
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            chunk = f.read()
        end = chunk.rfind(b"\n")
        if end < 0:
            return self.last
        self.offset += end + 1
        for line in chunk[: end + 1].decode("utf-8", "replace").splitlines():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue  # the worker's own file: a damaged line is reported by the reader later
            if isinstance(rec, dict):
                self.last = rec
        return self.last


def _postfix(m: Mapping[str, Any]) -> dict[str, str]:
    out = {}
    for label, key in (
        ("loss", "actor/loss"),
        ("reward", "critic/score/mean"),
        ("margin", "rewards/margins"),
        ("mem_gb", "perf/device_memory_peak_gb"),
    ):
        if key in m:
            out[label] = f"{to_float(m[key]):.3g}"
    return out


def worker_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The worker's environment: the caller's as it is (a host that needs NCCL or NVSHMEM settings,
    NVLink multicast off on some shared hosts, exports them before `verlaudit run`: README "The
    commands"), unbuffered output, and this checkout first on the path."""
    env = dict(environ)
    env["PYTHONUNBUFFERED"] = "1"
    root = str(Path(verlaudit.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join([root, *filter(None, [env.get("PYTHONPATH")])])
    return env


def _run_one(planned: PlannedRun, gpus: int, progress: bool) -> dict[str, Any]:
    """Starts the worker, follows its metrics, waits for it; returns what runner.json records.
    KeyboardInterrupt is re-raised after the child has been stopped."""
    from tqdm import tqdm

    run_dir = planned.spec.run_dir
    run_dir.mkdir(parents=True, exist_ok=True)
    spec_path = run_dir / SPEC
    spec_path.write_text(json.dumps(planned.spec.to_dict(), indent=2), encoding="utf-8")
    cmd = launch_command(spec_path, gpus)
    env = worker_env(os.environ)
    started = time.monotonic()
    record: dict[str, Any] = {"command": cmd, "started_at": now()}
    tail = _MetricsTail(run_dir / METRICS)
    steps = planned.spec.train.steps
    # own session: a terminal Ctrl-C reaches only the runner, which forwards exactly one SIGINT
    with open(run_dir / WORKER_LOG, "wb") as log:
        child = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        bar = tqdm(
            total=steps,
            desc=planned.run.run_name,
            unit="step",
            disable=None if progress else True,
            leave=True,
        )
        try:
            while child.poll() is None:
                time.sleep(0.5)
                _update_bar(bar, tail.poll())
        except KeyboardInterrupt:
            record["interrupted"] = True
            _stop(child)
            raise
        finally:
            _update_bar(bar, tail.poll())
            bar.close()
            record.update(returncode=child.wait(), wall_s=round(time.monotonic() - started, 2))
            (run_dir / RUNNER).write_text(json.dumps(record, indent=2), encoding="utf-8")
    return record


def _update_bar(bar: Any, last: Mapping[str, Any]) -> None:
    if "step" in last:
        bar.n = int(last["step"]) + 1
        bar.set_postfix(_postfix(last), refresh=False)
        bar.refresh()


def _stop(child: subprocess.Popen) -> None:
    """SIGINT (the worker records status ``interrupted``), then SIGTERM, then SIGKILL."""
    for sig, wait in ((signal.SIGINT, GRACE_S), (signal.SIGTERM, 10.0), (signal.SIGKILL, 10.0)):
        if child.poll() is not None:
            return
        child.send_signal(sig)
        try:
            child.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue
        except KeyboardInterrupt:  # a second Ctrl-C: the user wants out now
            child.kill()
            child.wait()
            return


@dataclasses.dataclass(frozen=True, kw_only=True)
class Progress:
    """What `execute` tells its caller as each run ends: the run, and how it ended."""

    name: str
    run_dir: Path
    refused: str | None = None
    """The reason no worker started (the run directory holds the refusal)."""
    record: Mapping[str, Any] | None = None
    """runner.json of a run whose worker started (command, exit code, wall time)."""
    not_started: tuple[str, ...] | None = None
    """Set when Ctrl-C stopped this run: the runs of the plan that were never started."""


def execute(
    plan: Plan,
    suite: Suite,
    out_dir: Path,
    *,
    progress: bool = True,
    on_run: Callable[[Progress], None] | None = None,
) -> tuple[list[str], bool]:
    """Runs the plan; returns (run names started or written, interrupted). ``on_run`` hears of each
    run as it ends (the command prints a summary line from it); ``progress`` draws the bars."""
    tell = on_run or (lambda _p: None)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / SUITE_COPY).write_text(
        json.dumps({**suite.to_dict(), "source": suite.source, "device": plan.device}, indent=2),
        encoding="utf-8",
    )
    done: list[str] = []
    previous = signal.signal(signal.SIGTERM, _sigterm_as_interrupt)
    try:
        for planned in plan.runs:
            name = planned.run.run_name
            if planned.refused:
                # no worker starts; its module still writes the directory (manifest and status)
                worker.write_refused(planned.spec, planned.refused)
                done.append(name)
                tell(Progress(name=name, run_dir=out_dir / name, refused=planned.refused))
                continue
            try:
                record = _run_one(planned, suite.hardware.gpus, progress)
            except KeyboardInterrupt:
                done.append(name)
                left = tuple(p.run.run_name for p in plan.runs if p.run.run_name not in done)
                tell(Progress(name=name, run_dir=out_dir / name, not_started=left))
                return done, True
            done.append(name)
            tell(Progress(name=name, run_dir=out_dir / name, record=record))
    finally:
        signal.signal(signal.SIGTERM, previous)
    return done, False


def _sigterm_as_interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def default_out_dir(suite: Suite) -> Path:
    return Path("reports") / suite.name / _dt.datetime.now().strftime("%Y%m%d-%H%M%S")


def loadavg() -> str:
    try:
        return "/".join(f"{x:.1f}" for x in os.getloadavg())
    except OSError:  # not available on every platform
        return "n/a"


def record_run(out_dir: Path, *, command: str, started_at: str, load: str, wall_s: float) -> None:
    """Adds the command, its wall time and the machine to suite.json (the report header shows them)."""
    import platform

    path = out_dir / SUITE_COPY
    data = json.loads(path.read_text(encoding="utf-8")) if path.exists() else {}
    data["run"] = {
        "command": command,
        "started_at": started_at,
        "wall_s": round(wall_s, 1),
        "machine": f"{os.cpu_count()} CPUs ({platform.machine()}, {platform.system()})" + _gpu_words(),
        "load_at_start": load,
    }
    path.write_text(json.dumps(data, indent=2), encoding="utf-8")


def _gpu_words() -> str:
    present = detect()
    return f", {present.gpu_count} x {present.gpu_name}" if present.cuda else ", no GPU"


def failed(run_dir: Path) -> bool:
    status = read_json(run_dir / STATUS)
    return status is None or (status.get("state") != "completed" and status.get("reason") != "refused")
