"""A failed run through the planner: the memory picture at the moment a run ran out of memory.

`memory_at_failure(run, phase, step)` re-plans a run from its manifest (config and recorded policy)
and returns the planner phase inside the failing trainer phase, its components and their memory
classes (activations, parameters, gradients, optimizer state, KV cache); `verlaudit diagnose` uses
it to name what filled the GPU and to check each suggested fix. Exercised by `pytest tests/test_plan.py`.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping
from typing import Any

from trainer.config import TrainConfig, upgrade_recorded_config
from trainer.precision import PrecisionPolicy
from verlaudit.plan.memory_model import GIB, Estimate, Phase
from verlaudit.plan.planner import optimizer_steps_per_step, phases_in, plan_config
from verlaudit.rundir import RunDir


def memory_class(component: str) -> str:
    """The class of one planner component (named ``"<role> <what>"`` by `verlaudit.plan.memory_model`)."""
    if "optimizer" in component:
        return "optimizer state"
    if "grads" in component:
        return "gradients"
    if any(w in component for w in ("params", "weight copies", "gathered")):
        return "parameters"
    if component.startswith("rollout") and any(w in component for w in ("KV", "sampling", "scores", "batch")):
        return "kv cache + rollout logits"
    return "activations"  # saved activations, checkpoints, logits islands, workspaces


@dataclasses.dataclass(frozen=True)
class MemoryAtFailure:
    """The planner's view of the moment a run ran out of memory (GiB per GPU)."""

    phase: str
    """The planner phase (``"actor_update: end of forward"``) the estimate is for."""
    components: dict[str, float]
    classes: dict[str, float]
    allocated: float
    device: float
    """``allocated`` with the allocator's reserve and the CUDA context: what the device must hold."""
    capacity: float | None
    notes: tuple[str, ...]

    @property
    def dominant(self) -> str:
        return max(self.classes, key=self.classes.get)  # type: ignore[arg-type]


def run_plan_inputs(run: RunDir, changes: Mapping[str, Any] | None = None) -> tuple[Any, Any, int, str]:
    """(TrainConfig, policy, GPUs, AdamW kind) of a run, from its manifest; ``changes`` (a nested
    config mapping) is merged into the config first, and then the policy is re-resolved from it."""
    data = json.loads(json.dumps(run.manifest.get("config") or {}))
    for section, values in (changes or {}).items():
        data[section] = {**(data.get(section) or {}), **values} if isinstance(values, Mapping) else values
    cfg = TrainConfig.from_dict(upgrade_recorded_config(data), where="manifest.json: config")
    recorded = run.manifest.get("policy")
    policy = None if changes or not recorded else PrecisionPolicy.from_dict(recorded, "manifest.json: policy")
    env = run.manifest.get("environment") or {}
    device = str(env.get("device") or cfg.device)
    return cfg, policy, run_world_size(run), "fused" if device.startswith("cuda") else "foreach"


def run_world_size(run: RunDir) -> int:
    """GPUs (ranks) the run used: the worker records ``manifest.distributed.world_size`` under torchrun."""
    dist = run.manifest.get("distributed") or {}
    env = run.manifest.get("environment") or {}
    return int(dist.get("world_size") or env.get("world_size") or 1)


def capacity_gib(run: RunDir) -> float | None:
    """What the process could use: the emulation cap, else the device total the allocator saw."""
    mem = (run.status or {}).get("memory") or {}
    for v in ((run.manifest.get("emulation") or {}).get("memory_cap_gb"), mem.get("device_total_gb"),
              (run.manifest.get("environment") or {}).get("total_memory_gb")):  # fmt: skip
        if isinstance(v, (int, float)) and math.isfinite(v) and v > 0:
            return float(v)
    return None


def memory_at_failure(run: RunDir, phase: str | None, step: int | None) -> MemoryAtFailure:
    """The planner's estimate at the failing phase: of the planner phases inside ``phase``, the
    first that needs more than the device has (where the allocation would fail), else the largest.
    ValueError when the manifest's config cannot be planned (unknown architecture, missing model)."""
    cfg, policy, gpus, optimizer = run_plan_inputs(run)
    est, notes = plan_config(cfg, gpus=gpus, optimizer=optimizer, policy=policy)
    phases = list(est.phases)
    first_step = step in (0, None) and (run.status or {}).get("last_completed_step") is None
    if first_step and optimizer_steps_per_step(cfg) == 1:
        # AdamW allocates its moments in its first step(): before a role's first optimizer step
        # they do not exist yet, which is what a step-0 OOM in a forward or backward sees.
        stepped: set[str] = set()
        kept = []
        for p in phases:
            if p.name.endswith("optimizer step"):
                stepped.add(p.name.split("_update")[0])
            comp = {k: v for k, v in p.components.items()
                    if not (k.endswith("optimizer moments") and k.split(" ")[0] not in stepped)}  # fmt: skip
            kept.append(Phase(p.name, comp))
        phases = kept
        notes.append("first step: AdamW moments are not allocated before each role's first optimizer step")
    inside = phases_in(Estimate(tuple(phases)), phase) if phase else []
    candidates = inside or phases
    cap = capacity_gib(run)
    need = [Estimate((p,)).device_bytes() / GIB for p in candidates]
    over = [i for i, n in enumerate(need) if cap is not None and n >= cap]
    i = over[0] if over else max(range(len(candidates)), key=lambda j: candidates[j].total)
    chosen = candidates[i]
    comp = {k: v / GIB for k, v in sorted(chosen.components.items(), key=lambda kv: -kv[1])}
    classes: dict[str, float] = {}
    for k, v in comp.items():
        classes[memory_class(k)] = classes.get(memory_class(k), 0.0) + v
    classes = dict(sorted(classes.items(), key=lambda kv: -kv[1]))
    return MemoryAtFailure(chosen.name, comp, classes, chosen.total / GIB, need[i], cap, tuple(notes))
