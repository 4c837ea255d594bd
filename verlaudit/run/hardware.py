"""GPU targets a suite can name, and what this machine actually has.

A suite says which hardware its numbers are meant for (``hardware.target: a100-80gb``). The runner
compares that target with the present device to decide how to emulate it: cap the process's usable
memory to the target's, refuse bf16 variants on targets without bf16 (V100/T4-class), and refuse
suites that need more GPUs than present. Memory sizes are GiB (1024**3 bytes), the unit
``torch.cuda`` and the ``*_gb`` metrics use; a card sold as "80 GB" reports about 80 GiB.
Exercised by `pytest tests/test_runner.py -k hardware`.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True, kw_only=True)
class GpuTarget:
    """One GPU model as the runner emulates it."""

    name: str
    """Canonical target name used in suites (``a100-80gb``)."""
    memory_gb: float | None
    """Usable memory per device in GiB as the driver reports it; None for ``cpu`` (no cap)."""
    bf16: bool
    """Native bf16 support (compute capability 8.0+); False refuses bf16 variants."""
    compute_capability: tuple[int, int] | None
    """For the record in manifests and messages; None for ``cpu``."""


# Memory as nvidia-smi reports total memory (MiB / 1024), not the marketing number.
TARGETS: dict[str, GpuTarget] = {
    t.name: t
    for t in (
        GpuTarget(name="cpu", memory_gb=None, bf16=True, compute_capability=None),
        GpuTarget(name="t4", memory_gb=15.0, bf16=False, compute_capability=(7, 5)),
        GpuTarget(name="v100-16gb", memory_gb=16.0, bf16=False, compute_capability=(7, 0)),
        GpuTarget(name="v100-32gb", memory_gb=32.0, bf16=False, compute_capability=(7, 0)),
        GpuTarget(name="a10g", memory_gb=22.5, bf16=True, compute_capability=(8, 6)),
        GpuTarget(name="l4", memory_gb=22.5, bf16=True, compute_capability=(8, 9)),
        GpuTarget(name="rtx4090", memory_gb=24.0, bf16=True, compute_capability=(8, 9)),
        GpuTarget(name="a100-40gb", memory_gb=40.0, bf16=True, compute_capability=(8, 0)),
        GpuTarget(name="a100-80gb", memory_gb=80.0, bf16=True, compute_capability=(8, 0)),
        GpuTarget(name="h100-80gb", memory_gb=79.6, bf16=True, compute_capability=(9, 0)),
        GpuTarget(name="h200", memory_gb=140.4, bf16=True, compute_capability=(9, 0)),
    )
}
ALIASES = {"v100": "v100-32gb", "a100": "a100-80gb", "h100": "h100-80gb", "h200-141gb": "h200"}


def get_target(name: str, where: str = "hardware.target") -> GpuTarget:
    """The target called ``name`` (case-insensitive, aliases accepted); ValueError listing the names."""
    key = str(name).lower()
    key = ALIASES.get(key, key)
    if key not in TARGETS:
        raise ValueError(f"{where}: unknown target {name!r}; expected one of {', '.join(TARGETS)}")
    return TARGETS[key]


@dataclasses.dataclass(frozen=True, kw_only=True)
class PresentDevice:
    """What the runner found on this machine."""

    cuda: bool
    gpu_count: int
    gpu_name: str | None = None
    memory_gb: float | None = None
    """Total memory of GPU 0 in GiB."""
    bf16: bool = True


def detect() -> PresentDevice:
    """The GPUs torch can see (GPU 0 describes them all: suites assume one GPU kind)."""
    import torch

    if not torch.cuda.is_available():
        return PresentDevice(cuda=False, gpu_count=0)
    props = torch.cuda.get_device_properties(0)
    return PresentDevice(
        cuda=True,
        gpu_count=torch.cuda.device_count(),
        gpu_name=props.name,
        memory_gb=props.total_memory / 1024**3,
        bf16=torch.cuda.is_bf16_supported(including_emulation=False),
    )
