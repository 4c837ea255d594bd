"""``verlaudit plan SUITE.yaml``: each variant's peak device memory per GPU, before running it.

For every variant of a suite (its plug-ins and model directories checked first, as `verlaudit run`
does: `verlaudit.run.preflight`): the architecture (exact parameter counts from the preset's or local
model's config), the resolved precision policy per role, and the step's shape give the phases of a
PPO, GRPO or DPO step (`verlaudit.plan.planner`); the largest is the predicted peak, printed with
its components, the target GPU's memory and whether it fits. ``--json`` prints the same as JSON.
Exercised by `pytest tests/test_plan.py` and `verlaudit plan suites/llama7b_h200.yaml`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from typing import Any

from trainer.config import TrainConfig
from verlaudit.plan import memory_model as mm
from verlaudit.plan.memory_model import GIB, Estimate
from verlaudit.plan.planner import plan_config, resolve_checkpoint_layers
from verlaudit.run.hardware import get_target
from verlaudit.run.preflight import preflight
from verlaudit.run.suite import load_suite


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


def plan_suite(
    suite: Any, *, gpus: int | None = None, memory_gb: float | None = None, optimizer: str = "fused"
) -> list[VariantPlan]:
    """One `VariantPlan` per variant of a loaded `verlaudit.run.suite.Suite`."""
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
        [
            p.variant,
            p.config.algo.name,
            p.config.precision.preset,
            _ckpt_words(p.config.precision),
            p.estimate.peak.name,
            f"{p.estimate.peak_bytes / GIB:.3g}",
            f"{p.estimate.device_bytes() / GIB:.3g}",
            "-" if p.target_gib is None else f"{p.target_gib:.4g}",
            yes(p.fits),
        ]
        for p in plans
    ]
    head = [
        "variant",
        "algo",
        "preset",
        "grad ckpt",
        "peak phase",
        "peak allocated GiB",
        "device needed GiB",
        f"target GiB ({plans[0].target} x{plans[0].gpus})",
        "fits",
    ]
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
        f"{mm.CONTEXT_BYTES / GIB:.1f} GiB (CUDA context); per GPU. Where verlaudit run emulates a smaller "
        "target on this GPU it caps the allocator alone, so there the CUDA context does not count against it."
    )
    return "\n".join(parts)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("suite", help="suite YAML (e.g. suites/llama7b_h200.yaml)")
    parser.add_argument("--variants", help="comma-separated variants to plan (default: all)")
    parser.add_argument("--gpus", type=int, help="GPUs per variant (default: the suite's hardware.gpus)")
    parser.add_argument("--memory-gb", type=float, help="usable GiB per GPU (default: the suite's target)")
    parser.add_argument(
        "--optimizer",
        choices=("fused", "foreach"),
        default="fused",
        help="AdamW implementation (the trainer uses fused on CUDA)",
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of tables")


def main(args: argparse.Namespace) -> int:
    variants = [v for v in args.variants.split(",") if v] if args.variants else None
    if args.gpus is not None and args.gpus < 1:
        raise ValueError(f"--gpus: must be >= 1, got {args.gpus}")
    suite = load_suite(args.suite, variants=variants)
    preflight(suite)
    plans = plan_suite(suite, gpus=args.gpus, memory_gb=args.memory_gb, optimizer=args.optimizer)
    if args.json:
        print(json.dumps({"suite": suite.name, "variants": [p.to_dict() for p in plans]}, indent=2))
    else:
        print(render(plans))
    return 0
