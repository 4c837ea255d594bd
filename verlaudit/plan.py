"""``verlaudit plan SUITE.yaml``: each variant's peak device memory per GPU, before running it.

For every variant of a suite: the architecture (exact parameter counts from the preset's or local
model's config), the resolved precision policy per role, and the step's shape give the phases of a
PPO, GRPO or DPO step (`verlaudit.memory_model`); the largest is the predicted peak, printed with
its components, the target GPU's memory and whether it fits. ``--json`` prints the same as JSON.
Exercised by `pytest tests/test_plan.py` and `verlaudit plan suites/llama7b_h200.yaml`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from typing import Any

from trainer.config import ModelConfig, TrainConfig
from trainer.precision import PrecisionPolicy, RolePolicy, resolve_policy
from verlaudit import memory_model as mm
from verlaudit.memory_model import GIB, Architecture, Estimate, Logits, Phase, Shape, TrainedModel


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


def plan_config(cfg: TrainConfig, *, gpus: int = 1, optimizer: str = "fused") -> tuple[Estimate, list[str]]:
    """All phases of one step of ``cfg`` on each of ``gpus`` GPUs (FSDP2 when more than one),
    and notes on what the estimate assumed."""
    notes: list[str] = []
    pc = cfg.precision
    policy = resolve_policy(pc.preset, pc.overrides, grad_checkpointing=pc.grad_checkpointing, where="")
    arch = architecture_of(cfg.model)
    algo, data = cfg.algo, cfg.data
    w = gpus
    p_len, r_len = data.prompt_length, data.response_length
    seq = p_len + r_len
    actor = TrainedModel(
        arch=arch, kind="causal_lm", policy=policy["actor"], world_size=w, optimizer=optimizer
    )
    resident: dict[str, int] = {}
    for k, v in actor.state().items():
        resident[f"actor {k}"] = v
    use_ref = algo.name == "dpo" or algo.kl_coef > 0
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
        critic = TrainedModel(
            arch=c_arch, kind="value", policy=policy["critic"], world_size=w, optimizer=optimizer
        )
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
                                    new_tokens=r_len, resident=res, world_size=w))  # fmt: skip
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


def _without(parts: dict[str, int], prefix: str) -> dict[str, int]:
    """``parts`` minus the given role's own state (train_phases adds it back with its gradients)."""
    return {k: v for k, v in parts.items() if not k.startswith(f"{prefix} ")}


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
        est, notes = plan_config(cfg, gpus=n, optimizer=optimizer)
        out.append(VariantPlan(name, cfg, est, hw.target, target_gib, n, tuple(notes)))
    return out


def render(plans: list[VariantPlan]) -> str:
    """A summary table, then each variant's peak components (GiB)."""
    from tabulate import tabulate

    def yes(v: bool | None) -> str:
        return "n/a (cpu: host memory)" if v is None else ("yes" if v else "NO")

    rows = [
        [p.variant, p.config.algo.name, p.config.precision.preset, p.config.precision.grad_checkpointing,
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
