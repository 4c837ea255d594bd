"""Precision the suite asked for vs precision that happened, read from the objects that hold it (prec13).

- `optim_state_findings`: the optimizer's state tensors (AdamW's ``exp_avg`` / ``exp_avg_sq``, SGD's
  ``momentum_buffer``) in another dtype than the role's ``optim_state_dtype``: the key (an override, or
  the preset) says one precision, the moments are kept in another (``precision/requested_not_realised``).
- `grad_findings`: a ``.grad`` in another dtype than the role's ``grad_dtype`` override (the trainer's
  gradients take the parameter's dtype): the same kind, naming ``precision.overrides.<role>.grad_dtype``.
- `compute_findings`: a role computing below the run's preset (``precision.overrides.<role>.compute_dtype``),
  with the measured size: its output on a probe batch against the same forward in fp32
  (``precision/compute_below_contract``).
- `AccumWatch`: many micro-batch gradients summed into a low-precision ``.grad``: each micro-batch's
  gradient is also summed in fp32 (a tensor hook, a sample of every parameter), and the accumulated
  ``.grad`` is compared with that sum; above a few roundings of the exact sum it is
  ``numerics/grad_accumulation_rounding``, with the count, the dtype and the predicted error
  (``sqrt(n/3)`` roundings for ``n`` additions into a running sum).

Exercised by `pytest tests/test_precision_realised.py`.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from trainer.precision import PrecisionPolicy, RolePolicy, resolve_policy
from verlaudit import kinds as K
from verlaudit.dtypes import dtype_name as dn
from verlaudit.rundir import Finding

LOW = (torch.float16, torch.bfloat16)
SAMPLE = 4096
"""Elements of each parameter's gradient the accumulation watch keeps (the first ones, flattened)."""
ROUNDINGS = 3.0
"""The accumulated gradient's error, in roundings of the exact sum to the grad dtype, from which it is a
warning: one or two roundings are what any low-precision .grad carries."""
MIN_MICRO = 4
"""Micro-batches per optimizer step below which accumulation is not judged (too few additions)."""


def _override(policy: RolePolicy, field: str) -> bool:
    return str((policy.reasons or {}).get(field, "")).startswith("per-role override")


def _key(role: str, policy: RolePolicy, field: str) -> str:
    return f"precision.overrides.{role}.{field}" if _override(policy, field) else "precision.preset"


def _bits(d: torch.dtype) -> int:
    return torch.finfo(d).bits if d.is_floating_point else 0


def optim_state_findings(
    role: str, optimizer: Any, policy: RolePolicy, *, step: int | None = None, phase: str | None = None
) -> list[Finding]:
    """The optimizer's per-parameter state tensors against ``policy.optim_state_dtype`` (one finding)."""
    state = getattr(optimizer, "state", None)
    groups = getattr(optimizer, "param_groups", None)
    if not isinstance(state, Mapping) or not isinstance(groups, list):
        return []
    counts: dict[torch.dtype, int] = {}
    names: set[str] = set()
    for g in groups:
        for p in g.get("params", []):
            # a parameter kept apart from the policy's dtype (TRL's fp32 lm_head): its state follows it
            if p.dtype != policy.param_dtype:
                continue
            for k, v in (state.get(p) or {}).items():
                if isinstance(v, torch.Tensor) and v.is_floating_point() and v.shape == p.shape and v.dim():
                    counts[v.dtype] = counts.get(v.dtype, 0) + 1
                    names.add(str(k))
    want = policy.optim_state_dtype
    wrong = {d: n for d, n in counts.items() if d != want}
    if not wrong:
        return []
    got = max(wrong, key=lambda d: wrong[d])
    key = _key(role, policy, "optim_state_dtype")
    total = sum(counts.values())
    kind = type(optimizer).__name__
    wider = _bits(got) > _bits(want)
    effect = (
        f"the memory the key was to save is spent anyway ({dn(got)} moments take {_bits(got) // _bits(want)}x "
        f"the {dn(want)} bytes) and the manifest and memory plan describe a run that does not exist"
        if wider
        else f"the moments carry {dn(got)} rounding the suite did not ask for"
    )
    told = f"{key}: {dn(want)}" if key != "precision.preset" else f"the preset's optim_state_dtype {dn(want)}"
    return [
        Finding(
            severity="warning",
            kind=K.PRECISION_NOT_REALISED,
            role=role,
            where=key,
            step=step,
            phase=phase,
            observed={dn(d): n for d, n in counts.items()},
            expected=dn(want),
            message=f"{told} was asked for, but the {role}'s optimizer ({kind}) keeps its moments "
            f"({', '.join(sorted(names))}) in {dn(got)}: {wrong[got]} of its {total} state tensors, read after "
            f"its first step (it allocates them in the parameters' dtype, {dn(policy.param_dtype)}), so the "
            f"configured and the effective optimizer-state precision differ: {effect}",
            fix=f"remove the override {key} (this trainer's {kind} keeps its state in the parameter dtype, "
            f"param_dtype {dn(policy.param_dtype)}); to get {dn(want)} moments, store the {role}'s parameters in "
            f"{dn(want)} (precision.overrides.{role}.param_dtype) or use an optimizer that allocates its state "
            f"in {dn(want)}"
            if key != "precision.preset"
            else f"use an optimizer whose state follows the preset's {dn(want)}, or a preset whose "
            f"optim_state_dtype is {dn(got)}",
        )
    ]


def grad_overridden(policy: RolePolicy) -> bool:
    """Whether the role's ``grad_dtype`` was set by a per-role override (not the preset)."""
    return _override(policy, "grad_dtype")


def grad_findings(
    role: str,
    params: list[tuple[str, torch.Tensor]],
    policy: RolePolicy,
    *,
    step: int | None,
    phase: str | None,
) -> list[Finding]:
    """``.grad`` against a ``grad_dtype`` the suite set by an override (one finding per role), or []."""
    if not _override(policy, "grad_dtype"):
        return []
    for name, p in params:
        g = getattr(p, "grad", None)
        if g is None or g.dtype == policy.grad_dtype:
            continue
        key = f"precision.overrides.{role}.grad_dtype"
        want, got = dn(policy.grad_dtype), dn(g.dtype)
        return [
            Finding(
                severity="warning",
                kind=K.PRECISION_NOT_REALISED,
                role=role,
                where=key,
                step=step,
                phase=phase,
                observed=got,
                expected=want,
                message=f"{key}: {want} was asked for, but the {role}'s gradients are {got} (first: {name}, whose "
                f"parameter is {dn(p.dtype)}): autograd writes .grad in the parameter's dtype, so the configured "
                f"and the effective gradient precision differ",
                fix=f"remove the override {key} (gradients follow param_dtype {dn(p.dtype)}), or set "
                f"precision.overrides.{role}.param_dtype: {want} if {want} gradients are what you want",
            )
        ]
    return []


def contract(preset: str) -> PrecisionPolicy | None:
    """The preset's own policy, without the run's overrides (None for a preset this trainer lacks)."""
    try:
        return resolve_policy(preset)
    except (ValueError, TypeError):
        return None


def _probe_inputs(model: nn.Module, vocab: int | None) -> tuple[torch.Tensor, torch.Tensor] | None:
    p = next((q for q in model.parameters()), None)
    if p is None or not vocab:
        return None
    g = torch.Generator().manual_seed(1234)
    ids = torch.randint(0, int(vocab), (2, 16), generator=g).to(p.device)
    return ids, torch.ones_like(ids)


def _out(model: nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor | None:
    out = model(input_ids=ids, attention_mask=mask)
    out = getattr(out, "logits", out)
    if isinstance(out, (tuple, list)) and out:
        out = out[0]
    return out.detach().double() if isinstance(out, torch.Tensor) and out.is_floating_point() else None


def _measure(model: nn.Module, policy: RolePolicy, vocab: int | None) -> float | None:
    """Mean relative difference of the role's output under its policy vs the same forward in fp32."""
    inputs = _probe_inputs(model, vocab)
    if inputs is None:
        return None
    ids, mask = inputs
    was = model.training
    model.eval()  # dropout off: both forwards are the same function
    try:
        with torch.no_grad():
            with policy.autocast_ctx(ids.device.type) if policy.autocast else contextlib.nullcontext():
                low = _out(model, ids, mask)
            with torch.autocast(device_type=ids.device.type, enabled=False):
                ref = _out(model, ids, mask)
    except Exception:  # noqa: BLE001 - a user's model with another signature: nothing to measure
        return None
    finally:
        model.train(was)
    if low is None or ref is None or low.shape != ref.shape:
        return None
    scale = ref.abs().mean()
    if not torch.isfinite(scale) or float(scale) == 0.0:
        return None
    return float((low - ref).abs().mean() / scale)


_WHAT = {
    "critic": "values",
    "actor": "logits",
    "reference": "logits (the KL anchor)",
    "reward": "scores",
}


def compute_findings(
    policy: PrecisionPolicy, models: Mapping[str, nn.Module], vocab: int | None
) -> list[Finding]:
    """Roles whose compute override is below the preset's, with the measured effect on their output."""
    base = contract(policy.preset)
    if base is None:
        return []
    out = []
    for role, model in models.items():
        if role not in policy.roles or role not in base.roles or not isinstance(model, nn.Module):
            continue
        got, want = policy[role], base[role]
        if not _override(got, "compute_dtype") or _bits(got.compute_dtype) >= _bits(want.compute_dtype):
            continue
        if any(p.dtype != torch.float32 for p in model.parameters() if p.is_floating_point()):
            continue  # the fp32 recompute needs fp32 weights; a stored-low role is the storage finding's
        size = _measure(model, got, vocab)
        if size is None or size == 0.0:
            continue
        key = f"precision.overrides.{role}.compute_dtype"
        what = _WHAT.get(role, "outputs")
        out.append(
            Finding(
                severity="warning",
                kind=K.COMPUTE_BELOW_CONTRACT,
                role=role,
                where=key,
                observed={"compute_dtype": dn(got.compute_dtype), "relative_difference": size},
                expected=dn(want.compute_dtype),
                message=f"{key}: {dn(got.compute_dtype)} computes the {role} below the {policy.preset} preset's "
                f"{dn(want.compute_dtype)}: on a probe batch its {what} differ from the same forward in "
                f"{dn(want.compute_dtype)} by {size:.3%} on average (mean relative), rounding the run's "
                f"{dn(want.compute_dtype)} contract does not have (its gradients carry it too)",
                fix=f"remove the override {key} (the role then computes in the preset's {dn(want.compute_dtype)}), "
                f"or choose a preset whose compute is {dn(got.compute_dtype)} if that precision is meant",
            )
        )
    return out


class AccumWatch:
    """Micro-batch gradients summed in fp32 beside the trainer's low-precision ``.grad`` (sampled steps)."""

    def __init__(self, sample: int = SAMPLE) -> None:
        self.sample = sample
        self._handles: list[Any] = []
        self._exact: dict[str, dict[str, torch.Tensor]] = {}
        self._last: dict[str, dict[str, torch.Tensor]] = {}
        self._micro: dict[str, int] = {}
        self.reported: set[str] = set()

    def arm(self, role: str, model: nn.Module, policy: RolePolicy) -> None:
        """Hooks on the role's trainable parameters whose gradients are fp16 / bf16 (until `disarm`)."""
        if role in self.reported or any(h[0] == role for h in self._handles):
            return
        exact = self._exact.setdefault(role, {})
        for name, p in model.named_parameters():
            if not p.requires_grad or p.dtype not in LOW or hasattr(p, "to_local"):
                continue
            self._handles.append((role, p.register_hook(self._adder(exact, name))))

    def _adder(self, exact: dict[str, torch.Tensor], name: str):
        n = self.sample

        def add(grad: torch.Tensor) -> None:
            g = grad.detach().reshape(-1)[:n].double()
            exact[name] = exact[name] + g if name in exact else g

        return add

    def disarm(self) -> None:
        for _, h in self._handles:
            h.remove()
        self._handles.clear()
        self._exact.clear()
        self._last.clear()
        self._micro.clear()

    def backward(self, role: str, model: nn.Module) -> None:
        """After a micro-batch's backward: the accumulated ``.grad`` so far (before unscale and clip)."""
        if role not in self._exact:
            return
        self._micro[role] = self._micro.get(role, 0) + 1
        last = self._last.setdefault(role, {})
        for name, p in model.named_parameters():
            if name in self._exact[role] and p.grad is not None:
                last[name] = p.grad.detach().reshape(-1)[: self.sample].double()

    def step(
        self, role: str, policy: RolePolicy, config: Mapping[str, Any], *, step: int | None, phase: str | None
    ) -> list[Finding]:
        """At the optimizer step: the accumulated .grad against the fp32 sum; resets the role's sums."""
        exact, last = self._exact.get(role) or {}, self._last.get(role) or {}
        n = self._micro.get(role, 0)
        self._exact[role], self._last[role], self._micro[role] = {}, {}, 0
        names = [k for k in exact if k in last and last[k].numel() == exact[k].numel()]
        if n < MIN_MICRO or not names or role in self.reported:
            return []
        dtype = next((p for p in [policy.grad_dtype] if p in LOW), torch.bfloat16)
        s = torch.cat([exact[k] for k in names])
        g = torch.cat([last[k] for k in names])
        norm = float(s.norm())
        if not math.isfinite(norm) or norm == 0.0 or not torch.isfinite(g).all():
            return []
        err = float((g - s).norm()) / norm
        floor = float((s.to(dtype).double() - s).norm()) / norm
        if floor == 0.0 or err <= ROUNDINGS * floor:
            return []
        self.reported.add(role)
        predicted = math.sqrt(n / 3.0)
        algo = (config or {}).get("algo") or {}
        mb, mini = algo.get("micro_batch_size"), algo.get("mini_batch_size")
        preset = (config or {}).get("precision", {}).get("preset") if isinstance(config, Mapping) else None
        keep = max(1, n // 4)
        micro = -(-int(mini) // keep) if isinstance(mini, int) and mini > 0 else None
        return [
            Finding(
                severity="warning",
                kind=K.GRAD_ACCUMULATION_ROUNDING,
                role=role,
                where="algo.micro_batch_size",
                step=step,
                phase=phase,
                observed={
                    "micro_batches": n,
                    "relative_error": err,
                    "one_rounding": floor,
                    "dtype": dn(dtype),
                },
                expected=f"<= {ROUNDINGS:g} roundings",
                message=f"the {role}'s gradient is accumulated in {dn(dtype)} .grad over {n} micro-batches per "
                f"optimizer step (algo.micro_batch_size {mb}, algo.mini_batch_size {mini}"
                + (f", precision.preset {preset}" if preset else "")
                + f"): each addition rounds the running sum to {dn(dtype)}, so the accumulated gradient is "
                f"{err:.2g} (relative) from the same micro-batch gradients summed in fp32, {err / floor:.1f}x "
                f"the {floor:.2g} of one {dn(dtype)} rounding of the exact sum (predicted ~{predicted:.1f}x for "
                f"{n} additions)",
                fix="accumulate fewer, larger micro-batches (raise algo.micro_batch_size"
                + (
                    f" to {micro} or more: {keep} additions per step"
                    if micro
                    else f": {keep} or fewer additions"
                )
                + f"), or keep fp32 gradients: the bf16 preset (fp32 master weights, fp32 .grad) instead of "
                f"bf16-pure grad_dtype {dn(dtype)}",
            )
        ]
