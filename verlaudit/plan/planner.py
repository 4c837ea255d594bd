"""The memory planner as a library: one training step's phases and their bytes, per GPU.

`plan_config(cfg)` composes the phases of a PPO, GRPO or DPO step (rollout, reward, reference,
critic values, old log-probs, actor and critic updates) from the per-phase byte model in
`verlaudit.plan.memory_model` (which knows tensors; this module knows the step); `plan_suite` plans
`resolve_checkpoint_layers` turns ``checkpoint_layers: auto`` into a number.
The ``verlaudit plan`` command (`verlaudit.commands.plan`) and failed-run reconstruction
(`verlaudit.analysis.diagnose.failure`) sit on top. Exercised by `pytest tests/test_plan.py`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

from trainer.config import ModelConfig, TrainConfig
from trainer.precision import PrecisionPolicy, RolePolicy
from verlaudit.plan import memory_model as mm
from verlaudit.plan.memory_model import GIB, Architecture, Estimate, Logits, Phase, Shape, TrainedModel


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


def rollout_policy(policy: PrecisionPolicy) -> RolePolicy:
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


def optimizer_steps_per_step(cfg: TrainConfig) -> int:
    """AdamW steps of the actor in one training step (mini-batches x epochs; DPO: mini-batches).
    Batch and mini-batch sizes are global, so the count does not depend on the number of GPUs."""
    algo = cfg.algo
    rows = algo.batch_size * (algo.group_size if algo.name == "grpo" else 1)
    minis = math.ceil(rows / max(1, min(algo.mini_batch_size, rows)))
    return minis * (1 if algo.name == "dpo" else algo.ppo_epochs)


# long: the step planned in the order it runs (resident state, then each phase), notes where they arise
def plan_config(
    cfg: TrainConfig, *, gpus: int = 1, optimizer: str = "fused", policy: PrecisionPolicy | None = None
) -> tuple[Estimate, list[str]]:
    """All phases of one step of ``cfg`` on each of ``gpus`` GPUs (FSDP2 when more than one),
    and notes on what the estimate assumed. ``policy``: the resolved policy when known (a run's
    manifest records it), else resolved from ``cfg.precision``."""
    notes: list[str] = []
    pc = cfg.precision
    if policy is None:
        # planning needs no run: the policy the config describes (a run's is in its spec and manifest)
        policy = pc.build_policy()
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
            "(reports/gpu/fsdp_2xh200.md); without rollout.engine: fused the HF decode keeps every layer gathered"
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
        phases.append(
            mm.frozen_forward_phase(
                "ref",
                arch,
                "causal_lm",
                policy["reference"],
                ref_shape,
                resident=resident,
                params_resident=True,
                world_size=w,
            )
        )
        micro = min(algo.micro_batch_size, pairs)
        shape = Shape(sequences=2 * micro, seq_len=seq, logit_positions=r_len + 1)
        accumulation = min(algo.mini_batch_size, pairs) > micro
        phases += mm.train_phases(
            actor,
            shape,
            accumulation=accumulation,
            resident=_without(resident, "actor"),
            logits=Logits(entropy=False),
        )
        return Estimate(tuple(phases)), notes

    rows = math.ceil(algo.batch_size / w) * (algo.group_size if algo.name == "grpo" else 1)
    batch = {"rollout batch": rows * seq * 8 * 2 + rows * r_len * 4 * 6}  # ids, masks, fp32 per-token terms
    res = {**resident, **batch}
    phases.append(
        mm.generate_phase(
            arch,
            rollout_policy(policy),
            sequences=rows,
            prompt_len=p_len,
            new_tokens=r_len,
            resident=res,
            world_size=w,
            fused=cfg.rollout.kind == "fused",
        )
    )
    full = Shape(sequences=rows, seq_len=seq, logit_positions=r_len + 1)
    if rm_arch is not None:
        rm_shape = dataclasses.replace(full, logit_positions=0)
        phases.append(
            mm.frozen_forward_phase(
                "reward",
                rm_arch,
                "seqcls",
                policy["reward"],
                rm_shape,
                resident=res,
                params_resident=True,
                world_size=w,
            )
        )
    if use_ref:
        phases.append(
            mm.frozen_forward_phase(
                "ref",
                arch,
                "causal_lm",
                policy["reference"],
                full,
                resident=res,
                params_resident=True,
                world_size=w,
            )
        )
    if critic is not None:
        phases.append(
            mm.frozen_forward_phase(
                "critic values",
                critic.arch,
                "value",
                policy["critic"],
                dataclasses.replace(full, logit_positions=0),
                resident=res,
                params_resident=True,
                world_size=w,
            )
        )
    phases.append(
        mm.frozen_forward_phase(
            "old log-probs",
            arch,
            "causal_lm",
            policy["actor"],
            full,
            resident=res,
            params_resident=True,
            world_size=w,
        )
    )
    micro = min(algo.micro_batch_size, rows)
    accumulation = min(algo.mini_batch_size, rows) > micro
    shape = dataclasses.replace(full, sequences=micro)
    phases += mm.train_phases(
        actor, shape, accumulation=accumulation, resident=_without(res, "actor"), logits=Logits(entropy=True)
    )
    if critic is not None:
        phases += mm.train_phases(
            critic,
            dataclasses.replace(shape, logit_positions=0),
            accumulation=accumulation,
            resident=_without(res, "critic"),
            prefix="critic",
        )
    return Estimate(tuple(phases)), notes


def shadow_gib(cfg: TrainConfig, *, rows: int) -> float:
    """The fp32 shadow's extra device memory on a shadowed step of ``cfg`` (`mm.shadow_bytes`), for
    the actor, in GiB; 0 when ``rows`` is 0."""
    if rows <= 0:
        return 0.0
    arch = architecture_of(cfg.model)
    seq = cfg.data.prompt_length + cfg.data.response_length
    parts = mm.shadow_bytes(
        arch, seq_len=seq, rows=rows, param_bytes=mm.nbytes(cfg.precision.build_policy()["actor"].param_dtype)
    )
    return sum(parts.values()) / GIB


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
    cfg: TrainConfig,
    *,
    gpus: int = 1,
    target_gib: float | None,
    optimizer: str = "fused",
    allocator_cap: bool = False,
) -> tuple[TrainConfig, str | None]:
    """``precision.checkpoint_layers: auto`` -> the fewest checkpointed decoder layers (the most
    layers keeping their activations, the least recompute) whose planned peak fits ``target_gib``
    less `AUTO_HEADROOM`; all layers when nothing smaller fits or there is no GPU target. Returns
    the config with a number and a note saying what was chosen and why; other configs unchanged.
    ``allocator_cap``: ``target_gib`` caps the caching allocator (target emulation), so the CUDA
    context is not counted against it (`memory_model.Estimate.need_bytes`)."""
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
        est = plan_config(with_layers(n), gpus=gpus, optimizer=optimizer)[0]
        return est.need_bytes(allocator_cap=allocator_cap) / GIB

    fit = fewest_checkpointed_layers(layers, need, budget)
    if fit is None:
        return with_layers(None), (
            f"checkpoint_layers auto: even all {layers} layers checkpointed exceed {budget:.4g} GiB; "
            "checkpointing all"
        )
    n, gib = fit
    return with_layers(n), (
        f"checkpoint_layers auto: {n} of {layers} decoder layers checkpointed, {layers - n} keep their "
        f"activations ({gib:.4g} GiB planned per GPU, budget {budget:.4g} GiB = {target_gib:.4g} x "
        f"{1 - AUTO_HEADROOM:.2f})"
    )


def _without(parts: dict[str, int], prefix: str) -> dict[str, int]:
    """``parts`` minus the given role's own state (train_phases adds it back with its gradients)."""
    return {k: v for k, v in parts.items() if not k.startswith(f"{prefix} ")}
