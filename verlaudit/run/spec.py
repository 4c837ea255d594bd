"""The resolved run spec: what the runner decided for one (variant, seed), and all the worker reads.

`verlaudit run` decides each run once, before any worker starts (`verlaudit.run.runner.plan_runs`:
the device, the memory cap, ``checkpoint_layers: auto``, the precision policy), and writes the result
as the run directory's spec.json (`RunSpec.to_dict`). The worker (``python -m verlaudit.run.worker
spec.json``) reads it back (`RunSpec.from_dict`) and hands the device and the policy to
`trainer.train.train`, so nothing downstream decides them again. A spec is a `Section` like every
config (`trainer.config_base`); every mistake in one is a ValueError naming the field path (``train.algo.lr: must be > 0``, ``policy.roles.actor.param_dtype:
...``). Exercised by `pytest tests/test_spec.py` and `pytest tests/test_worker.py`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from trainer.config import TrainConfig
from trainer.config_base import Section
from trainer.precision import PrecisionPolicy
from verlaudit.audit import AuditSettings

DEVICE_TYPES = ("cpu", "cuda")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Emulation(Section):
    """How the run stands in for the suite's target GPU."""

    target: str | None = None
    """The suite's ``hardware.target`` (``a100-80gb``, ``cpu``, ...)."""
    memory_cap_gb: float | None = None
    """Usable GPU memory (GiB) the worker caps its allocator at; None: no cap."""
    reason: str | None = None
    """Why the cap is (or is not) there, in words (printed by the runner, kept in the manifest)."""

    def __post_init__(self) -> None:
        cap = self.memory_cap_gb
        if cap is not None and (isinstance(cap, bool) or not isinstance(cap, (int, float)) or cap <= 0):
            raise ValueError(f"memory_cap_gb: expected a number > 0 or null, got {cap!r}")
        for name in ("target", "reason"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise ValueError(f"{name}: expected a string or null, got {value!r}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunSpec(Section):
    """One run, fully decided: the worker's only input."""

    _noun = "a spec"

    variant: str
    """The suite's variant name."""
    suite: str = ""
    """The suite's name."""
    seed: int
    """The run's seed; ``train.seed`` equals it."""
    run_dir: Path
    """Where the worker writes the run directory (rank k of several: ``run_dir/rank<k>``)."""
    train: TrainConfig
    """The variant's training config, with the runner's decisions applied (``device``,
    ``precision.checkpoint_layers`` instead of ``auto``)."""
    audit: AuditSettings = dataclasses.field(default_factory=AuditSettings)
    emulation: Emulation = dataclasses.field(default_factory=Emulation)
    inject: Mapping[str, Any] | None = None
    """Faults to plant (`verlaudit.audit.inject.FaultInjector`), for tests; None for real runs."""
    device: str
    """The device type decided for the run: ``cpu`` or ``cuda``. The index is the process's own: a
    single process takes ``cuda:0``, rank k under torchrun ``cuda:LOCAL_RANK``
    (`trainer.distributed.init_distributed`)."""
    policy: PrecisionPolicy
    """The precision policy the runner built from ``train.precision`` (`verlaudit.run.runner.run_spec`,
    once per run; checked against the target there: bf16 on a GPU without bf16 is refused before any
    worker starts)."""

    def __post_init__(self) -> None:
        for name in ("variant", "suite"):
            value = getattr(self, name)
            if not isinstance(value, str) or (name == "variant" and not value):
                raise ValueError(f"{name}: expected a non-empty string, got {value!r}")
        if not str(self.run_dir):
            raise ValueError("run_dir: expected a directory path, got ''")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"seed: expected an integer, got {self.seed!r}")
        if self.train.seed != self.seed:
            raise ValueError(f"train.seed: {self.train.seed} differs from the run's seed {self.seed}")
        if self.device not in DEVICE_TYPES:
            raise ValueError(f"device: {self.device!r}; expected one of {', '.join(DEVICE_TYPES)}")
        if self.train.device != "auto" and self.train.device.split(":")[0] != self.device:
            raise ValueError(
                f"train.device: {self.train.device!r} contradicts the run's device {self.device!r}"
            )
        if self.policy.preset != self.train.precision.preset:
            raise ValueError(
                f"policy.preset: {self.policy.preset!r} is not train.precision.preset "
                f"{self.train.precision.preset!r}"
            )

    @classmethod
    def from_dict(cls, data: Any, where: str = "") -> RunSpec:
        """Validates spec data (`Section.from_dict`); ValueError names the field (``train.algo.lr: must
        be > 0``). The spec's ``seed`` (default: the config's) replaces whatever ``train`` carried."""
        if not isinstance(data, Mapping):
            raise ValueError(f"spec: expected a mapping, got {data!r}")
        train = data.get("train")
        if isinstance(train, Mapping):
            seed = data.get("seed", train.get("seed", 0))
            if isinstance(seed, bool) or not isinstance(seed, int):
                raise ValueError(f"seed: expected an integer, got {seed!r}")
            data = {**data, "seed": seed, "train": {**train, "seed": seed}}
        return super().from_dict(data, where)
