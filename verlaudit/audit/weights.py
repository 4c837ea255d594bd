"""A model's own state, re-read: weights far out of family, non-finite weights, and dtypes that
changed after setup. Pure functions over a model (or its named tensors) -> findings.

- `weight_findings`: parameters are grouped with their siblings (the same parameter of every
  decoder layer: ``model.layers.{i}.mlp.down_proj.weight``); a member whose RMS is `OUTLIER_RATIO`
  times the median of the others or more (`PAIR_RATIO` with a single sibling) is out of family (a corrupted or mis-converted checkpoint, a
  layer scaled by user code), and any NaN/Inf stored in a weight is named. One norm per parameter and
  one host read for the whole model; the `Auditor` runs it at setup and on full-audit steps.
- `user_hooks`: forward hooks that user code (``model.setup``, a callback) put on the models before the
  audit attached, one info finding per hooked module, so a diagnosis can say that a module whose output
  went wrong has someone else's code on it (hooks of torch, transformers, FSDP2 and this project are
  not user code).
- `DtypeWatch`: the parameter and buffer dtypes seen at setup, compared on full-audit steps with a
  metadata read (``tensor.dtype``, no device work): a buffer or parameter that user code cast to a
  lower precision after setup (rotary ``inv_freq`` in bf16) becomes a finding at the step it is seen.

Exercised by `pytest tests/test_root_cause.py -k "weight or dtype_watch or user_hooks or inv_freq"`.
"""

from __future__ import annotations

import math
import re
import statistics
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from trainer.precision import dtype_name
from verlaudit import kinds as K
from verlaudit.rundir import Finding

OUTLIER_RATIO = 10.0
"""RMS / the median of its siblings at which a weight is out of family. Trained checkpoints keep a
parameter's RMS within a few times across depth; a 10x jump is not a trained layer."""
PAIR_RATIO = 100.0
"""The same with a single sibling (a two-layer model), where the median is that one layer: a
higher bar, since the pair alone has to say which side is odd."""
_INDEX = re.compile(r"\.\d+\.")

_LOW = (torch.float16, torch.bfloat16)


def family(name: str) -> str:
    """A parameter's family: its name with the layer indices replaced (``model.layers.*.mlp.up_proj.weight``)."""
    return _INDEX.sub(".*.", name)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t  # an FSDP2 shard: this rank's part


def weight_rms(named: Iterable[tuple[str, torch.Tensor]]) -> dict[str, float]:
    """RMS of every floating, non-empty tensor, read with one host read per device (NaN/Inf kept)."""
    items = [(n, _local(t.detach())) for n, t in named if t.is_floating_point()]
    items = [(n, t) for n, t in items if t.numel()]
    out: dict[str, float] = {}
    by_device: dict[torch.device, list[tuple[str, torch.Tensor]]] = {}
    for n, t in items:
        by_device.setdefault(t.device, []).append((n, t))
    for group in by_device.values():
        # accumulated and returned in fp32 without an fp32 copy of each weight (a 7B bf16 model's
        # copies would be 27 GB of transient allocations per role and sampled step)
        # one reduction per tensor: foreach_norm reached about 1 TB/s on the H200 on a 7B model's fp32
        # masters, per-tensor norms near the bandwidth (benchmarks/maxima_bench.py)
        norms = [torch.linalg.vector_norm(t, 2, dtype=torch.float32) for _, t in group]
        sizes = torch.tensor([float(t.numel()) for _, t in group], device=norms[0].device)
        rms = (torch.stack(norms) / sizes.sqrt()).tolist()
        out.update({n: v for (n, _), v in zip(group, rms)})
    return out


def weight_findings(
    role: str, rms: dict[str, float], *, step: int | None = None, phase: str | None = None
) -> list[Finding]:
    """Non-finite weights (one finding per module) and members far out of their family."""
    out: list[Finding] = []
    for name, v in rms.items():
        if not math.isfinite(v):
            module = name.rsplit(".", 1)[0]
            out.append(
                Finding(
                    severity="error",
                    kind=K.WEIGHT_NONFINITE,
                    role=role,
                    where=module,
                    step=step,
                    phase=phase,
                    observed={"parameter": name, "rms": str(v)},
                    expected="finite",
                    message=f"{name} holds non-finite values: every forward through {module} returns NaN/Inf",
                    fix=f"reload or inspect the weights of {module} (the checkpoint or the code that wrote them); "
                    "a precision change cannot make a stored NaN finite",
                )
            )
    families: dict[str, list[tuple[str, float]]] = {}
    for name, v in rms.items():
        if math.isfinite(v) and _INDEX.search(name):
            families.setdefault(family(name), []).append((name, v))
    for fam, members in families.items():
        if len(members) < 2:
            continue
        bar = PAIR_RATIO if len(members) == 2 else OUTLIER_RATIO
        for name, v in members:
            median = statistics.median(x for n, x in members if n != name)
            ratio = v / median if median > 0 else 0.0
            if ratio >= bar:
                module = name.rsplit(".", 1)[0]
                out.append(
                    Finding(
                        severity="error",
                        kind=K.WEIGHT_OUTLIER,
                        role=role,
                        where=module,
                        step=step,
                        phase=phase,
                        observed={
                            "parameter": name,
                            "rms": v,
                            "family_median_rms": median,
                            "ratio": round(ratio, 1),
                        },
                        expected=f"within {bar:g}x of the other {fam}",
                        message=f"{name} has RMS {v:.3g}, {ratio:.3g}x the median of its {len(members) - 1} siblings "
                        f"({median:.3g}): far out of family (a corrupted or mis-converted checkpoint, or code that "
                        "scaled it)",
                        fix=f"reload or inspect the weights of {module} (compare with the source checkpoint); do not "
                        "change the precision to hide it: its activations are out of range in any dtype",
                    )
                )
    return out


class DtypeWatch:
    """Parameter and buffer dtypes of each role at setup, compared later with a metadata read."""

    def __init__(self, models: dict[str, nn.Module]) -> None:
        self.models = models
        self.setup = {role: self._dtypes(m) for role, m in models.items()}

    @staticmethod
    def _dtypes(model: nn.Module) -> dict[str, tuple[str, torch.dtype]]:
        out = {n: ("parameter", p.dtype) for n, p in model.named_parameters() if p.is_floating_point()}
        out.update({n: ("buffer", b.dtype) for n, b in model.named_buffers() if b.is_floating_point()})
        return out

    def changes(self, *, step: int | None, phase: str | None = None) -> list[Finding]:
        """One finding per module whose parameters or buffers now hold a lower precision than at setup."""
        out: list[Finding] = []
        for role, model in self.models.items():
            before = self.setup.get(role, {})
            lowered: dict[str, list[tuple[str, str, Any, Any]]] = {}
            for name, (what, dtype) in self._dtypes(model).items():
                was = before.get(name, (what, dtype))[1]
                if dtype != was and _bits(dtype) < _bits(was):
                    lowered.setdefault(name.rsplit(".", 1)[0], []).append(
                        (name.rsplit(".", 1)[-1], what, was, dtype)
                    )
            for module, items in lowered.items():
                kind = K.BUFFER_PRECISION if all(w == "buffer" for _, w, _, _ in items) else K.PARAM_STORAGE
                names = ", ".join(n for n, _, _, _ in items)
                was, now = dtype_name(items[0][2]), dtype_name(items[0][3])
                out.append(
                    Finding(
                        severity="error" if kind == K.PARAM_STORAGE else "warning",
                        kind=kind,
                        role=role,
                        where=module,
                        step=step,
                        phase=phase,
                        observed={n: dtype_name(d) for n, _, _, d in items},
                        expected=was,
                        message=f"{names} of {module} became {now} after setup (was {was}): code that ran during "
                        "training (a hook, a callback, the model's own forward) cast it",
                        fix=f"find the cast of {module} (a forward hook or model.setup code, .to()/.half()/.bfloat16() on "
                        f"the module or its buffers) and keep {names} in {was}",
                    )
                )
        return out


def _bits(dtype: torch.dtype) -> int:
    return torch.finfo(dtype).bits if dtype.is_floating_point else 64


_OWN_HOOKS = ("torch.", "transformers.", "accelerate.", "trainer.", "verlaudit.", "peft.")


def user_hooks(role: str, model: nn.Module) -> list[Finding]:
    """One info finding per module carrying a forward (pre-)hook defined outside torch, transformers and
    this project: user code that can change what the module returns."""
    out: list[Finding] = []
    for name, m in model.named_modules():
        hooks = [*m._forward_pre_hooks.values(), *m._forward_hooks.values()]
        hooks = [getattr(h, "func", h) for h in hooks]  # a functools.partial: the function it calls
        mine = [h for h in hooks if not str(getattr(h, "__module__", "") or "").startswith(_OWN_HOOKS)]
        if mine:
            names = [
                f"{getattr(h, '__module__', '?')}.{getattr(h, '__qualname__', type(h).__name__)}"
                for h in mine
            ]
            out.append(
                Finding(
                    severity="info",
                    kind=K.USER_HOOK,
                    role=role,
                    where=name or "<root>",
                    observed=names,
                    expected=None,
                    message=f"{name or 'the model'} carries {len(mine)} forward hook(s) from user code: {', '.join(names)}",
                    fix="a hook can change this module's inputs or output (dtype, scale, values)",
                )
            )
    return out


GROWTH_RATIO = 4.0
"""A weight matrix's RMS over its value at setup at which it has grown (random-init and trained
matrices alike stay within a small factor of it over a short run at a sane learning rate)."""
GROWTH_SHARE = 0.8
"""The share of a role's weight matrices that must have grown for the learning rate to be the cause:
every layer, not one (one layer alone is a module's problem, `weight_findings`)."""


class GrowthWatch:
    """Weight-norm growth of the trainable roles' weight matrices since setup, from the RMS the audit
    reads anyway (setup and full-audit steps): when most matrices grew `GROWTH_RATIO` times or more,
    the updates are too large for the weights -- the learning rate, named with its key -- and the
    per-layer growth and per-update rate are the evidence."""

    def __init__(self, lrs: dict[str, float | None]) -> None:
        self.lrs = lrs
        """Trainable role -> its learning rate (``algo.lr``, ``algo.critic_lr``)."""
        self.setup: dict[str, dict[str, float]] = {}
        self.reported: set[str] = set()

    @staticmethod
    def _matrices(rms: dict[str, float], model: nn.Module) -> dict[str, float]:
        shapes = {n: p.dim() for n, p in model.named_parameters() if p.requires_grad}
        return {n: v for n, v in rms.items() if shapes.get(n, 0) >= 2 and math.isfinite(v) and v > 0}

    def start(self, role: str, model: nn.Module, rms: dict[str, float]) -> None:
        self.setup[role] = self._matrices(rms, model)

    def findings(
        self, role: str, model: nn.Module, rms: dict[str, float], *, step: int, updates: int
    ) -> list[Finding]:
        """``dynamics/weight_growth`` once per role, at the first audited step where it shows."""
        base = self.setup.get(role)
        if not base or role in self.reported or updates < 1:
            return []
        now = self._matrices(rms, model)
        growth = {n: now[n] / base[n] for n in base if n in now}
        if not growth:
            return []
        grown = [n for n, g in growth.items() if g >= GROWTH_RATIO]
        if len(grown) < GROWTH_SHARE * len(growth):
            return []
        self.reported.add(role)
        median = statistics.median(growth.values())
        per_update = median ** (1.0 / updates) - 1.0
        lr = self.lrs.get(role)
        key = "algo.critic_lr" if role == "critic" else "algo.lr"
        worst = max(growth, key=growth.__getitem__)
        return [
            Finding(
                severity="error",
                kind=K.WEIGHT_GROWTH,
                role=role,
                where="*",
                step=step,
                phase=None,
                observed={
                    "grown": len(grown),
                    "matrices": len(growth),
                    "median_growth": round(median, 3),
                    "max_growth": {worst: round(growth[worst], 3)},
                    "per_update_growth": round(per_update, 4),
                    "updates": updates,
                    "lr": lr,
                },
                expected=f"weight RMS within {GROWTH_RATIO:g}x of setup",
                message=f"{len(grown)} of the {role}'s {len(growth)} weight matrices grew {GROWTH_RATIO:g}x or more "
                f"in {updates} update step(s) (median {median:.3g}x, {per_update:.1%} per update): every layer "
                f"grows, not one, so the updates are too large for the weights -- the learning rate ({key} "
                f"{lr if lr is not None else '?'}) -- and fp16 activations and gradients grow with them",
                fix=f"lower {key} (now {lr if lr is not None else '?'}) by 10x or more; keep the precision",
            )
        ]
