"""One variant run in its own process: ``python -m verlaudit.run.worker SPEC.json``.

SPEC.json (the runner's contract)::

    {"variant": "bf16", "suite": "tiny_cpu", "seed": 0, "run_dir": "reports/tiny_cpu/<ts>/bf16",
     "train": {<TrainConfig dict>}, "audit": {"level": "full", "full_steps": 2, "every": 10},
     "emulation": {"target": "a100-80gb", "memory_cap_gb": 80, "reason": "..."}, "inject": {...}}

Writes manifest.json first, one metrics.jsonl line per step and findings.jsonl as it goes, and
status.json last. Exit code 0: completed; 1: failed (status.json says why: oom, nonfinite,
dtype_error, exception, interrupted); 2: the spec itself is wrong (message on stderr). The spec's
``seed`` is the run's seed (it replaces ``train.seed``).

Under torchrun (``python -m torch.distributed.run --nproc_per_node N -m verlaudit.run.worker SPEC.json``,
what the runner starts for ``hardware.gpus: N``) every rank audits itself: rank 0 writes ``run_dir``,
rank k writes ``run_dir/rank<k>`` (its own manifest, metrics, findings stamped with its rank, and
status), each rank measures its own GPU. A failing rank leaves at once (``os._exit(1)`` after its
status), so torchrun stops the peers instead of leaving them blocked in a collective.
Exercised by `pytest tests/test_worker.py tests/test_distributed_e2e.py`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import signal
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

SPEC_KEYS = ("variant", "suite", "seed", "run_dir", "train", "audit", "emulation", "inject")


@dataclasses.dataclass(frozen=True)
class Spec:
    variant: str
    suite: str
    seed: int
    run_dir: Path
    train: Any  # TrainConfig
    audit: Any  # AuditSettings
    emulation: dict[str, Any]
    inject: dict[str, Any] | None


def load_spec(path: str | os.PathLike) -> Spec:
    """Reads and validates SPEC.json; ValueError names the file and the field."""
    from trainer.config import TrainConfig
    from verlaudit.audit import AuditSettings

    p = Path(path)
    if not p.is_file():
        raise ValueError(f"{p}: no such spec file; usage: python -m verlaudit.run.worker SPEC.json")
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{p}:{e.lineno}: not valid JSON ({e.msg})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{p}: expected a JSON object with keys {', '.join(SPEC_KEYS)}")
    for k in data:
        if k not in SPEC_KEYS:
            raise ValueError(f"{p}: {k}: unknown key; expected one of {', '.join(SPEC_KEYS)}")
    for k in ("variant", "run_dir", "train"):
        if k not in data:
            raise ValueError(f"{p}: {k}: missing; a spec needs variant, run_dir and train")
    for k in ("variant", "suite", "run_dir"):
        if k in data and (not isinstance(data[k], str) or not data[k]):
            raise ValueError(f"{p}: {k}: expected a non-empty string, got {data[k]!r}")
    seed = data.get("seed", data["train"].get("seed", 0) if isinstance(data["train"], dict) else 0)
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"{p}: seed: expected an integer, got {seed!r}")
    try:
        train = TrainConfig.from_dict({**data["train"], "seed": seed} if isinstance(data["train"], dict)
                                      else data["train"], where="train")  # fmt: skip
        settings = AuditSettings.from_dict(data.get("audit") or {}, where="audit")
        emulation = data.get("emulation") or {}
        if not isinstance(emulation, dict) or set(emulation) - {"target", "memory_cap_gb", "reason"}:
            raise ValueError(f"emulation: expected {{target, memory_cap_gb, reason}}, got {emulation!r}")
        cap = emulation.get("memory_cap_gb")
        if cap is not None and (isinstance(cap, bool) or not isinstance(cap, (int, float)) or cap <= 0):
            raise ValueError(f"emulation.memory_cap_gb: expected a number > 0 or null, got {cap!r}")
        inject = data.get("inject")
        if inject is not None and not isinstance(inject, dict):
            raise ValueError(f"inject: expected a mapping, got {inject!r}")
    except ValueError as e:
        raise ValueError(f"{p}: {e}") from None
    return Spec(variant=data["variant"], suite=data.get("suite", ""), seed=seed, run_dir=Path(data["run_dir"]),
                train=train, audit=settings, emulation=dict(emulation), inject=inject)  # fmt: skip


def environment(device: Any, memory: Any) -> dict[str, Any]:
    """Versions and hardware for the manifest; GPU facts come from NVML when it is there."""
    import importlib.metadata

    import torch
    import transformers

    try:
        vllm = importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        vllm = None
    env = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "vllm": vllm,
        "cuda": torch.version.cuda,
        "device": str(device),
        "gpu_name": memory.gpu_name,
        "driver": memory.driver,
        "total_memory_gb": memory.total_bytes / 1024**3 if memory.total_bytes else None,
        "cpu_count": os.cpu_count(),
    }
    if device.type == "cuda" and env["gpu_name"] is None:
        env["gpu_name"] = torch.cuda.get_device_name(device)
        env["total_memory_gb"] = torch.cuda.get_device_properties(device).total_memory / 1024**3
    return env


def apply_memory_cap(emulation: Mapping[str, Any], device: Any) -> dict[str, Any]:
    """Caps this process's CUDA allocator at ``memory_cap_gb`` to emulate a smaller GPU."""
    import torch

    out = dict(emulation)
    cap = emulation.get("memory_cap_gb")
    if cap is None:
        return out
    if device.type != "cuda":
        out["applied"] = False
        out["cap_reason"] = "not applied: the run is on CPU (no CUDA allocator to cap)"
        return out
    if device.index is None:  # set_per_process_memory_fraction needs an index; bare "cuda" is the current one
        device = torch.device("cuda", torch.cuda.current_device())
    total = torch.cuda.get_device_properties(device).total_memory / 1024**3
    if cap >= total:
        out["applied"] = False
        out["cap_reason"] = f"not applied: cap {cap:g} GB >= device memory {total:.1f} GB"
        return out
    torch.cuda.set_per_process_memory_fraction(cap / total, device)
    out.update(
        applied=True,
        fraction=cap / total,
        device=str(device),
        cap_reason=f"allocator of {device} capped at {cap:g} of {total:.1f} GB",
    )
    return out


class Interrupted(KeyboardInterrupt):
    """SIGTERM from the runner: treated like Ctrl-C (status ``interrupted``)."""


def _on_sigterm(signum: int, frame: Any) -> None:
    raise Interrupted(f"signal {signum}")


def run(spec: Spec) -> int:
    """Runs one variant and writes its run directory; returns the exit code (0 completed, 1 failed)."""
    from trainer import distributed as dist_mod
    from trainer.common import resolve_device
    from verlaudit.audit import Auditor
    from verlaudit.audit.inject import Fanout, FaultInjector
    from verlaudit.rundir import RANK_DIR, RunWriter

    cfg = spec.train
    # before resolve_device and the memory cap: under torchrun each rank takes cuda:LOCAL_RANK
    info = dist_mod.init_distributed(cfg.device)
    device = info.device if info.distributed else resolve_device(cfg.device)
    run_dir = spec.run_dir if info.rank == 0 else spec.run_dir / RANK_DIR.format(rank=info.rank)
    writer = RunWriter(run_dir, rank=info.rank)
    auditor = Auditor(writer, spec.audit, device=device)
    injector = FaultInjector(spec.inject) if spec.inject else None
    emulation = apply_memory_cap(spec.emulation, device)
    try:
        policy = cfg.precision.resolve(device).to_dict()
    except ValueError as e:
        policy = {"error": str(e)}
    writer.write_manifest({
        "variant": spec.variant, "suite": spec.suite, "seed": spec.seed,
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "config": cfg.to_dict(), "policy": policy,
        "environment": environment(device, auditor.memory),
        "memory": {"source": auditor.memory.source, "reason": auditor.memory.reason},
        "audit": spec.audit.to_dict(), "emulation": emulation, "inject": spec.inject,
        "distributed": info.to_dict(),
    })  # fmt: skip
    observer = Fanout([injector, auditor]) if injector else auditor
    previous = signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        from trainer.train import train

        try:
            with auditor:
                train(cfg, observer)
        finally:  # the worker is manifest.json's one writer: the audit's memory peaks join it now
            writer.update_manifest(memory_summary=auditor.memory.summary())
    except BaseException as e:  # every failure becomes a status, then exit 1; nothing is swallowed silently
        failure = auditor.failure or {
            "reason": "interrupted" if isinstance(e, KeyboardInterrupt) else "exception",
            "error": f"{type(e).__name__}: {e}",
        }
        # failed_at orders the ranks' failures: the first one is the cause, later ones (a peer's
        # closed connection, torchrun's SIGTERM) are consequences
        writer.status("failed", **failure, rank=info.rank, failed_at=time.time())
        print(
            f"verlaudit.run.worker: {spec.variant}: rank {info.rank}: failed ({failure['reason']}): "
            f"{failure.get('error')}",
            file=sys.stderr,
            flush=True,
        )
        if info.distributed:
            # peers may be blocked in a collective this rank will never join: leave now (no
            # interpreter teardown, which could itself wait on the process group) and let torchrun
            # stop them
            writer.close()
            os._exit(1)
        return 1
    finally:
        signal.signal(signal.SIGTERM, previous)
        if injector is not None:
            injector.remove()
        writer.close()
    writer.status("completed", step=auditor.last_completed_step, steps=cfg.steps)
    writer.close()
    dist_mod.destroy()
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1 or argv[0] in ("-h", "--help"):
        print("usage: python -m verlaudit.run.worker SPEC.json", file=sys.stderr)
        return 2
    try:
        spec = load_spec(argv[0])
    except ValueError as e:
        print(f"verlaudit.run.worker: bad spec: {e}", file=sys.stderr)
        return 2
    return run(spec)


if __name__ == "__main__":
    sys.exit(main())
