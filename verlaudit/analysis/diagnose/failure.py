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

from trainer.config import TrainConfig
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
    need: float = 0.0
    """What is compared with ``capacity``: ``device``, or without the CUDA context under an allocator cap."""
    allocator_cap: bool = False
    """``capacity`` is an allocator cap (target emulation), not the device's memory."""
    pass_shown: str | None = None
    """The forward the traceback shows (``training forward`` or ``old log-probs``), when it tells."""

    @property
    def dominant(self) -> str:
        return max(self.classes, key=self.classes.get)  # type: ignore[arg-type]


_BEFORE_VERL_KEYS = ("value_clip", "kl_estimator", "kl_in_reward", "normalize_advantages")
"""Algo keys of run directories recorded before the verl keys (the suite refuses them, naming the new key)."""


def recorded_config(data: Mapping[str, Any]) -> dict[str, Any]:
    """A manifest's TrainConfig dict in today's keys, so run directories recorded before the verl keys
    keep reading (the one place that maps them; a suite or spec with these keys is refused): ``value_clip``
    -> ``cliprange_value`` (its 0, no clipping, becomes 1e9), a positive ``kl_coef`` -> the KL term the run
    had (in the reward for PPO with ``kl_in_reward``, else a loss term), ``kl_estimator`` k1/k3 ->
    kl/low_var_kl, and the options that recipe did not read dropped; ``rollout.cache`` / ``rollout.fused``
    -> the ``rollout.engine`` they selected. A current config comes back unchanged."""
    out = _recorded_rollout(dict(data))
    algo = dict(out.get("algo") or {})
    if not any(k in algo for k in _BEFORE_VERL_KEYS):
        return out
    value_clip = algo.pop("value_clip", 0.2)
    estimator = {"k1": "kl", "k3": "low_var_kl"}.get(algo.pop("kl_estimator", "k1"), "kl")
    in_reward = algo.pop("kl_in_reward", True)
    algo.pop("normalize_advantages", None)
    kl_coef = algo.pop("kl_coef", 0.05)
    name = algo.get("name", "ppo")
    if name == "ppo":
        algo["cliprange_value"] = value_clip if value_clip > 0 else 1e9
    else:
        algo.pop("vf_coef", None)
    if name != "dpo" and kl_coef > 0:
        if name == "ppo" and in_reward:
            algo.update(use_kl_in_reward=True, kl_coef=kl_coef, kl_penalty=estimator)
        else:
            algo.update(use_kl_loss=True, kl_loss_coef=kl_coef, kl_loss_type=estimator)
    out["algo"] = algo
    return out


def _recorded_rollout(out: dict[str, Any]) -> dict[str, Any]:
    """``rollout.cache`` / ``rollout.fused`` of a run recorded before ``rollout.engine``, as the engine they
    selected (a suite that writes them is refused with the key that replaced them)."""
    rollout = dict(out.get("rollout") or {})
    if "cache" in rollout or "fused" in rollout:
        cache, fused = rollout.pop("cache", None), rollout.pop("fused", None)
        if rollout.get("engine") is None:
            rollout["engine"] = "fused" if fused else ("static" if cache == "static" else "hf")
        out["rollout"] = rollout
    return out


def run_plan_inputs(run: RunDir, changes: Mapping[str, Any] | None = None) -> tuple[Any, Any, int, str]:
    """(TrainConfig, policy, GPUs, AdamW kind) of a run, from its manifest; ``changes`` (a nested
    config mapping) is merged into the config first, and then the policy is re-resolved from it."""
    data = json.loads(json.dumps(run.manifest.get("config") or {}))
    for section, values in (changes or {}).items():
        data[section] = {**(data.get(section) or {}), **values} if isinstance(values, Mapping) else values
    cfg = TrainConfig.from_dict(recorded_config(data), where="manifest.json: config")
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
    """What the process could use: the emulation cap where it was applied, else the device total
    the allocator saw."""
    return capacity(run)[0]


def capacity(run: RunDir) -> tuple[float | None, bool]:
    """(GiB, is an allocator cap): the emulation cap applied with
    ``torch.cuda.set_per_process_memory_fraction`` caps the caching allocator only (the CUDA context is
    outside it); without one, the device's total memory."""
    emu = run.manifest.get("emulation") or {}
    cap = emu.get("memory_cap_gb")
    if emu.get("applied", True) is not False and _positive(cap):
        return float(cap), True
    mem = (run.status or {}).get("memory") or {}
    for v in (mem.get("device_total_gb"), (run.manifest.get("environment") or {}).get("total_memory_gb")):
        if _positive(v):
            return float(v), False
    return None, False


def _positive(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0


def need_gib(estimate: Estimate, allocator_cap: bool) -> float:
    """What an estimate needs against a capacity of that kind (`Estimate.need_bytes`), GiB."""
    return estimate.need_bytes(allocator_cap=allocator_cap) / GIB


TRAINING_FRAMES = ("in update_actor", "in update_critic", "in backward", "in pair_logps")
"""Traceback frames of the trainer's training passes (trainer/ppo.py, trainer/common.py, trainer/dpo.py);
without one, an actor_update failure is in the old-log-prob forward that starts the phase."""


def pass_in_traceback(traceback: Any, phase: str | None) -> str | None:
    """Which forward of ``actor_update`` the traceback shows: ``training forward`` when a training
    frame is on the stack, ``old log-probs`` when the actor's log-prob forward is without one; None
    when the traceback does not tell (no traceback, another phase, a failure raised at the phase edge)."""
    tb = str(traceback or "")
    if phase != "actor_update" or "File " not in tb:
        return None
    if any(frame in tb for frame in TRAINING_FRAMES):
        return "training forward"
    if "in actor_logprobs" in tb:
        return "old log-probs"
    return None


def failing_phases(estimate: Estimate, trainer_phase: str | None, shown: str | None) -> list[Phase]:
    """The planner phases a failure in ``trainer_phase`` can be in, narrowed to the forward the
    traceback shows (`pass_in_traceback`); every phase when the trainer phase is unknown."""
    inside = phases_in(estimate, trainer_phase) if trainer_phase else []
    if shown is not None:
        narrowed = [p for p in inside if p.name.startswith("old log-probs") == (shown == "old log-probs")]
        inside = narrowed or inside
    return inside or list(estimate.phases)


def memory_at_failure(run: RunDir, phase: str | None, step: int | None) -> MemoryAtFailure:
    """The planner's estimate at the failing phase: of the planner phases inside ``phase`` (narrowed to
    the forward the traceback shows), the first that needs more than the process could use (where the
    allocation would fail), else the largest. ValueError when the manifest's config cannot be planned
    (unknown architecture, missing model)."""
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
            comp = {
                k: v
                for k, v in p.components.items()
                if not (k.endswith("optimizer moments") and k.split(" ")[0] not in stepped)
            }
            kept.append(Phase(p.name, comp))
        phases = kept
        notes.append("first step: AdamW moments are not allocated before each role's first optimizer step")
    shown = pass_in_traceback((run.status or {}).get("traceback"), phase)
    candidates = failing_phases(Estimate(tuple(phases)), phase, shown)
    cap, allocator_cap = capacity(run)
    need = [need_gib(Estimate((p,)), allocator_cap) for p in candidates]
    over = [i for i, n in enumerate(need) if cap is not None and n >= cap]
    i = over[0] if over else max(range(len(candidates)), key=lambda j: candidates[j].total)
    chosen = candidates[i]
    comp = {k: v / GIB for k, v in sorted(chosen.components.items(), key=lambda kv: -kv[1])}
    classes: dict[str, float] = {}
    for k, v in comp.items():
        classes[memory_class(k)] = classes.get(memory_class(k), 0.0) + v
    classes = dict(sorted(classes.items(), key=lambda kv: -kv[1]))
    device = Estimate((chosen,)).device_bytes() / GIB
    return MemoryAtFailure(
        chosen.name,
        comp,
        classes,
        chosen.total / GIB,
        device,
        cap,
        tuple(notes),
        need=need[i],
        allocator_cap=allocator_cap,
        pass_shown=shown,
    )
