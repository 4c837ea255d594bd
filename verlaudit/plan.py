"""``verlaudit plan SUITE.yaml``: each variant's peak device memory per GPU, before running it.

For every variant of a suite: the architecture (exact parameter counts from the preset's or local
model's config), the resolved precision policy per role, and the step's shape give the phases of a
PPO, GRPO or DPO step (`verlaudit.memory_model`); the largest is the predicted peak, printed with
its components, the target GPU's memory and whether it fits. ``--json`` prints the same as JSON.
`memory_at_failure` runs the same planner over a failed run's manifest, for `verlaudit diagnose`.
Exercised by `pytest tests/test_plan.py` and `verlaudit plan suites/llama7b_h200.yaml`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from collections.abc import Callable, Mapping
from typing import Any

from trainer.config import ModelConfig, TrainConfig, upgrade_recorded_config
from trainer.precision import PrecisionPolicy, RolePolicy, parse_dtype
from verlaudit import memory_model as mm
from verlaudit.memory_model import GIB, Architecture, Estimate, Logits, Phase, Shape, TrainedModel
from verlaudit.rundir import RunDir


def architecture_of(model_cfg: ModelConfig, *, path: str | None = None, where: str = "model") -> Architecture:
    """The actor's architecture (or the one at ``path``): a local config.json, else the preset with
    its overrides, exactly as `trainer.models` would build it."""
    path = path if path is not None else model_cfg.path
    if path is not None:
        from transformers import AutoConfig

        try:
            cfg = AutoConfig.from_pretrained(path, local_files_only=True)
        except (OSError, ValueError) as e:
            raise ValueError(f"{where}: cannot read a model config from {path!r}: {e}") from None
        return Architecture.from_config(cfg, name=str(path))
    from trainer.models import load_tokenizer, preset_config

    return Architecture.from_config(
        preset_config(model_cfg, load_tokenizer(model_cfg)), name=model_cfg.preset
    )


def _rollout_policy(policy: PrecisionPolicy) -> RolePolicy:
    """The rollout engine runs the actor's weights (stored in the actor's dtype) in the rollout
    role's compute dtype: autocast casts them when the two differ."""
    actor, roll = policy["actor"], policy["rollout"]
    return dataclasses.replace(
        roll, param_dtype=actor.param_dtype, autocast=actor.param_dtype != roll.compute_dtype
    )


def _reward_arch(cfg: TrainConfig, notes: list[str]) -> Architecture | None:
    spec = cfg.model.reward_model
    if spec is None:
        return None
    if spec.startswith("preset:"):
        return architecture_of(ModelConfig(preset=spec.removeprefix("preset:")))
    import os

    if os.path.isdir(spec):
        return architecture_of(cfg.model, path=spec, where="model.reward_model")
    notes.append(f"reward model {spec!r} comes from a user loader: its memory is not counted")
    return None


TRAINER_PHASES: dict[str, tuple[str, ...]] = {
    "rollout": ("rollout",),
    "reward": ("reward",),
    "ref": ("ref",),
    "critic": ("critic values",),
    "actor_update": ("old log-probs", "actor_update"),
    "critic_update": ("critic_update",),
}
"""The trainer's phase markers (`trainer.events`) -> the planner phases that run inside them (a
planner phase is named ``"<prefix>: <moment>"``); the actor's old-log-prob pass runs in actor_update."""


def phases_in(estimate: Estimate, trainer_phase: str) -> list[Phase]:
    """The planner phases that run inside one of the trainer's phases, in step order."""
    prefixes = TRAINER_PHASES.get(trainer_phase, ())
    return [p for p in estimate.phases if p.name.split(":")[0] in prefixes]


def policy_from_dict(data: Any, where: str = "policy") -> PrecisionPolicy:
    """The inverse of `PrecisionPolicy.to_dict` (a run manifest's ``policy``); ValueError naming
    the field on anything that is not one."""
    if not isinstance(data, dict) or not isinstance(data.get("roles"), dict):
        raise ValueError(f"{where}: expected {{preset, roles: {{role: {{...}}}}}}, got {str(data)[:80]!r}")
    fields = {f.name for f in dataclasses.fields(RolePolicy)}
    roles = {}
    for role, d in data["roles"].items():
        kw = {k: v for k, v in dict(d).items() if k in fields}
        for k in [k for k in kw if k.endswith("_dtype")]:
            kw[k] = parse_dtype(kw[k], f"{where}.roles.{role}.{k}")
        kw["fp32_islands"] = tuple(kw.get("fp32_islands", ()))
        try:
            roles[role] = RolePolicy(**kw)
        except TypeError as e:
            raise ValueError(f"{where}.roles.{role}: {e}") from None
    return PrecisionPolicy(preset=str(data.get("preset")), roles=roles)


def optimizer_steps_per_step(cfg: TrainConfig) -> int:
    """AdamW steps of the actor in one training step (mini-batches x epochs; DPO: mini-batches).
    Batch and mini-batch sizes are global, so the count does not depend on the number of GPUs."""
    algo = cfg.algo
    rows = algo.batch_size * (algo.group_size if algo.name == "grpo" else 1)
    minis = math.ceil(rows / max(1, min(algo.mini_batch_size, rows)))
    return minis * (1 if algo.name == "dpo" else algo.ppo_epochs)


def plan_config(
    cfg: TrainConfig, *, gpus: int = 1, optimizer: str = "fused", policy: PrecisionPolicy | None = None
) -> tuple[Estimate, list[str]]:
    """All phases of one step of ``cfg`` on each of ``gpus`` GPUs (FSDP2 when more than one),
    and notes on what the estimate assumed. ``policy``: the resolved policy when known (a run's
    manifest records it), else resolved from ``cfg.precision``."""
    notes: list[str] = []
    pc = cfg.precision
    if policy is None:
        policy = pc.resolve(where="")
    arch = architecture_of(cfg.model)
    algo, data = cfg.algo, cfg.data
    w = gpus
    p_len, r_len = data.prompt_length, data.response_length
    seq = p_len + r_len
    device_type = "cpu" if cfg.device == "cpu" else "cuda"  # auto: the planner plans a GPU
    if w > 1 and cfg.sharding == "shard_grad_op":
        notes.append(
            "sharding: shard_grad_op keeps gathered parameters between forward and backward, which is not "
            "modelled: +3.6 GiB per GPU measured for the 7B update at 16 x 1024 with checkpointing "
            "(reports/gpu/fsdp_2xh200.md); without rollout.fused the HF decode keeps every layer gathered"
        )
    trained = dict(world_size=w, optimizer=optimizer, compiled=cfg.model.compile, device_type=device_type)
    actor = TrainedModel(arch=arch, kind="causal_lm", policy=policy["actor"], **trained)
    resident: dict[str, int] = {}
    for k, v in actor.state().items():
        resident[f"actor {k}"] = v
    use_ref = algo.uses_reference  # DPO, or a KL term in the reward or the loss (verl builds it only then)
    if use_ref:
        ref = policy["reference"]
        resident["reference params"] = math.ceil(arch.params("causal_lm") * mm.nbytes(ref.param_dtype) / w)
    critic = None
    if algo.name == "ppo":
        c_arch = (
            architecture_of(cfg.model, path=cfg.model.critic_path, where="model.critic_path")
            if cfg.model.critic_path
            else arch
        )
        critic = TrainedModel(arch=c_arch, kind="value", policy=policy["critic"], **trained)
        for k, v in critic.state().items():
            resident[f"critic {k}"] = v
    rm_arch = _reward_arch(cfg, notes) if algo.name != "dpo" else None
    if rm_arch is not None:
        resident["reward model params"] = math.ceil(
            rm_arch.params("seqcls") * mm.nbytes(policy["reward"].param_dtype) / w
        )

    phases: list[Phase] = []
    if algo.name == "dpo":
        pairs = math.ceil(algo.batch_size / w)
        ref_shape = Shape(sequences=2 * pairs, seq_len=seq, logit_positions=r_len + 1)
        phases.append(mm.frozen_forward_phase("ref", arch, "causal_lm", policy["reference"], ref_shape,
                                              resident=resident, params_resident=True, world_size=w))  # fmt: skip
        micro = min(algo.micro_batch_size, pairs)
        shape = Shape(sequences=2 * micro, seq_len=seq, logit_positions=r_len + 1)
        accumulation = min(algo.mini_batch_size, pairs) > micro
        phases += mm.train_phases(actor, shape, accumulation=accumulation, resident=_without(resident, "actor"),
                                  logits=Logits(entropy=False))  # fmt: skip
        return Estimate(tuple(phases)), notes

    rows = math.ceil(algo.batch_size / w) * (algo.group_size if algo.name == "grpo" else 1)
    batch = {"rollout batch": rows * seq * 8 * 2 + rows * r_len * 4 * 6}  # ids, masks, fp32 per-token terms
    res = {**resident, **batch}
    phases.append(mm.generate_phase(arch, _rollout_policy(policy), sequences=rows, prompt_len=p_len,
                                    new_tokens=r_len, resident=res, world_size=w,
                                    fused=cfg.rollout.cache == "static" and cfg.rollout.fused))  # fmt: skip
    full = Shape(sequences=rows, seq_len=seq, logit_positions=r_len + 1)
    if rm_arch is not None:
        rm_shape = dataclasses.replace(full, logit_positions=0)
        phases.append(mm.frozen_forward_phase("reward", rm_arch, "seqcls", policy["reward"], rm_shape,
                                              resident=res, params_resident=True, world_size=w))  # fmt: skip
    if use_ref:
        phases.append(mm.frozen_forward_phase("ref", arch, "causal_lm", policy["reference"], full,
                                              resident=res, params_resident=True, world_size=w))  # fmt: skip
    if critic is not None:
        phases.append(mm.frozen_forward_phase("critic values", critic.arch, "value", policy["critic"],
                                              dataclasses.replace(full, logit_positions=0), resident=res,
                                              params_resident=True, world_size=w))  # fmt: skip
    phases.append(mm.frozen_forward_phase("old log-probs", arch, "causal_lm", policy["actor"], full,
                                          resident=res, params_resident=True, world_size=w))  # fmt: skip
    micro = min(algo.micro_batch_size, rows)
    accumulation = min(algo.mini_batch_size, rows) > micro
    shape = dataclasses.replace(full, sequences=micro)
    phases += mm.train_phases(actor, shape, accumulation=accumulation, resident=_without(res, "actor"),
                              logits=Logits(entropy=True))  # fmt: skip
    if critic is not None:
        phases += mm.train_phases(critic, dataclasses.replace(shape, logit_positions=0), accumulation=accumulation,
                                  resident=_without(res, "critic"), prefix="critic")  # fmt: skip
    return Estimate(tuple(phases)), notes


AUTO_HEADROOM = 0.05
"""``checkpoint_layers: auto`` plans to at most 95% of the GPU: the planner was within 1.1% of every
measured H200 peak (reports/gpu/planner_vs_reference.md); the rest absorbs allocator fragmentation
beyond `memory_model.FRAGMENTATION` and what the planner does not model (a user's collator, hooks)."""


def fewest_checkpointed_layers(
    layers: int, need_gib: Callable[[int], float], budget_gib: float
) -> tuple[int, float] | None:
    """The smallest number of checkpointed layers ``n`` (0..layers) whose ``need_gib(n)`` fits
    ``budget_gib``, with that need; None when not even all layers fit. Fewer checkpointed layers
    means less recompute, so the first fit is the fastest."""
    for n in range(layers + 1):
        need = need_gib(n)
        if need <= budget_gib:
            return n, need
    return None


def resolve_checkpoint_layers(
    cfg: TrainConfig, *, gpus: int = 1, target_gib: float | None, optimizer: str = "fused"
) -> tuple[TrainConfig, str | None]:
    """``precision.checkpoint_layers: auto`` -> the fewest checkpointed decoder layers (the most
    layers keeping their activations, the least recompute) whose planned peak fits ``target_gib``
    less `AUTO_HEADROOM`; all layers when nothing smaller fits or there is no GPU target. Returns
    the config with a number and a note saying what was chosen and why; other configs unchanged."""
    pc = cfg.precision
    checked = isinstance(pc.checkpoint_layers, int) and pc.grad_checkpointing is not False
    if not checked and pc.checkpoint_layers != "auto":
        return cfg, None
    layers = architecture_of(cfg.model).num_layers
    if checked:
        if pc.checkpoint_layers > layers:
            raise ValueError(
                f"precision.checkpoint_layers: {pc.checkpoint_layers}, but the model has {layers} decoder "
                f"layers; use at most {layers}, or auto"
            )
        return cfg, None

    def with_layers(n: int | None) -> TrainConfig:
        return dataclasses.replace(cfg, precision=dataclasses.replace(pc, checkpoint_layers=n))

    if target_gib is None:
        return with_layers(
            None
        ), "checkpoint_layers auto: no GPU memory target (CPU run), all layers checkpointed"
    budget = target_gib * (1 - AUTO_HEADROOM)

    def need(n: int) -> float:
        return plan_config(with_layers(n), gpus=gpus, optimizer=optimizer)[0].device_bytes() / GIB

    fit = fewest_checkpointed_layers(layers, need, budget)
    if fit is None:
        return with_layers(None), (
            f"checkpoint_layers auto: even all {layers} layers checkpointed exceed {budget:.1f} GiB; "
            "checkpointing all"
        )
    n, gib = fit
    return with_layers(n), (
        f"checkpoint_layers auto: {n} of {layers} decoder layers checkpointed, {layers - n} keep their "
        f"activations ({gib:.1f} GiB planned per GPU, budget {budget:.1f} GiB = {target_gib:.1f} x "
        f"{1 - AUTO_HEADROOM:.2f})"
    )


def _without(parts: dict[str, int], prefix: str) -> dict[str, int]:
    """``parts`` minus the given role's own state (train_phases adds it back with its gradients)."""
    return {k: v for k, v in parts.items() if not k.startswith(f"{prefix} ")}


# --------------------------------------------------------------------------------------------
# a failed run through the planner (`verlaudit diagnose` on an out-of-memory run)

MEMORY_CLASSES = ("activations", "parameters", "gradients", "optimizer state", "kv cache + rollout logits")


def memory_class(component: str) -> str:
    """The class of one planner component (named ``"<role> <what>"`` by `verlaudit.memory_model`)."""
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
    policy = None if changes or not recorded else policy_from_dict(recorded, "manifest.json: policy")
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


@dataclasses.dataclass(frozen=True)
class VariantPlan:
    variant: str
    config: TrainConfig
    estimate: Estimate
    target: str
    target_gib: float | None
    gpus: int
    notes: tuple[str, ...]

    @property
    def fits(self) -> bool | None:
        if self.target_gib is None:
            return None
        return self.estimate.device_bytes() <= self.target_gib * GIB

    def to_dict(self) -> dict[str, Any]:
        p = self.config.precision
        return {
            "variant": self.variant,
            "algo": self.config.algo.name,
            "preset": p.preset,
            "grad_checkpointing": p.grad_checkpointing,
            "checkpoint_layers": p.checkpoint_layers,
            "gpus": self.gpus,
            "target": self.target,
            "target_gib": self.target_gib,
            "fits": self.fits,
            "notes": list(self.notes),
            **self.estimate.to_dict(),
        }


def plan_suite(suite: Any, *, gpus: int | None = None, memory_gb: float | None = None,
               optimizer: str = "fused") -> list[VariantPlan]:  # fmt: skip
    """One `VariantPlan` per variant of a loaded `verlaudit.suite.Suite`."""
    from verlaudit.hardware import get_target

    hw = suite.hardware
    n = gpus or hw.gpus
    target_gib = memory_gb or hw.memory_gb or get_target(hw.target).memory_gb
    out = []
    for name, cfg in suite.variants.items():
        try:
            cfg, auto = resolve_checkpoint_layers(cfg, gpus=n, target_gib=target_gib, optimizer=optimizer)
        except ValueError as e:
            raise ValueError(f"variants.{name}.{e}") from None
        est, notes = plan_config(cfg, gpus=n, optimizer=optimizer)
        notes = ([auto] if auto else []) + notes
        out.append(VariantPlan(name, cfg, est, hw.target, target_gib, n, tuple(notes)))
    return out


def _ckpt_words(pc: Any) -> str:
    if pc.grad_checkpointing is False:
        return "off"
    if pc.checkpoint_layers is None:
        return "all layers" if pc.grad_checkpointing else str(pc.grad_checkpointing)
    if pc.checkpoint_layers == 0:
        return "none of the layers"  # selective checkpointing chose (or was told) to keep every layer's activations
    return f"first {pc.checkpoint_layers} layers"


def render(plans: list[VariantPlan]) -> str:
    """A summary table, then each variant's peak components (GiB)."""
    from tabulate import tabulate

    def yes(v: bool | None) -> str:
        return "n/a (cpu: host memory)" if v is None else ("yes" if v else "NO")

    rows = [
        [p.variant, p.config.algo.name, p.config.precision.preset, _ckpt_words(p.config.precision),
         p.estimate.peak.name, f"{p.estimate.peak_bytes / GIB:.3g}", f"{p.estimate.device_bytes() / GIB:.3g}",
         "-" if p.target_gib is None else f"{p.target_gib:.1f}", yes(p.fits)]
        for p in plans
    ]  # fmt: skip
    head = ["variant", "algo", "preset", "grad ckpt", "peak phase", "peak allocated GiB",
            "device needed GiB", f"target GiB ({plans[0].target} x{plans[0].gpus})", "fits"]  # fmt: skip
    parts = [tabulate(rows, head, tablefmt="github")]
    for p in plans:
        comp = sorted(p.estimate.peak.components.items(), key=lambda kv: -kv[1])
        unit, scale = ("GiB", GIB) if p.estimate.peak_bytes >= GIB else ("MiB", 1024**2)  # tiny models
        table = [[k, f"{v / scale:.2f}"] for k, v in comp] + [
            ["total (allocated)", f"{p.estimate.peak_bytes / scale:.2f}"]
        ]
        parts.append(
            f"\n{p.variant}: peak at {p.estimate.peak.name}\n"
            + tabulate(table, ["component", unit], tablefmt="github")
        )
        parts += [f"  note: {n}" for n in p.notes]
    parts.append(
        f"\ndevice needed = allocated peak x {1 + mm.FRAGMENTATION:.2f} (allocator reserve) + "
        f"{mm.CONTEXT_BYTES / GIB:.1f} GiB (CUDA context); per GPU."
    )
    return "\n".join(parts)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("suite", help="suite YAML (e.g. suites/llama7b_h200.yaml)")
    parser.add_argument("--variants", help="comma-separated variants to plan (default: all)")
    parser.add_argument("--gpus", type=int, help="GPUs per variant (default: the suite's hardware.gpus)")
    parser.add_argument("--memory-gb", type=float, help="usable GiB per GPU (default: the suite's target)")
    parser.add_argument("--optimizer", choices=("fused", "foreach"), default="fused",
                        help="AdamW implementation (the trainer uses fused on CUDA)")  # fmt: skip
    parser.add_argument("--json", action="store_true", help="print JSON instead of tables")


def main(args: argparse.Namespace) -> int:
    from verlaudit.suite import load_suite

    variants = [v for v in args.variants.split(",") if v] if args.variants else None
    if args.gpus is not None and args.gpus < 1:
        raise ValueError(f"--gpus: must be >= 1, got {args.gpus}")
    suite = load_suite(args.suite, variants=variants)
    plans = plan_suite(suite, gpus=args.gpus, memory_gb=args.memory_gb, optimizer=args.optimizer)
    if args.json:
        print(json.dumps({"suite": suite.name, "variants": [p.to_dict() for p in plans]}, indent=2))
    else:
        print(render(plans))
    return 0
