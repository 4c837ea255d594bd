"""Precision policies as contracts, and the loss scaler.

A `PrecisionPolicy` states, for every role (actor, critic, reference, reward, rollout), where
parameters live (the master copy), what dtype the matmuls run in, how gradients are reduced, what
dtype the optimizer state has, how the loss is scaled, and which fp32 islands are intended. Each
choice carries the reason it was made, so a manifest can print it and an auditor can tell an
intended fp32 island from an accidental one. Exercised by `pytest tests/test_precision.py`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Iterable, Mapping
from typing import Any

import torch

ROLES = ("actor", "critic", "reference", "reward", "rollout")
TRAINABLE_ROLES = ("actor", "critic")
FROZEN_ROLES = ("reference", "reward")
PRESETS = ("fp32", "fp16", "bf16", "bf16-pure")
LOSS_SCALING = ("none", "static", "dynamic")
ISLANDS = ("norm", "softmax", "rotary", "logprobs", "loss")
"""Computations a mixed-precision policy keeps in fp32 on purpose: normalisation statistics,
attention softmax, rotary embeddings, log-probs taken from logits, and the losses."""

DTYPES: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "float32": torch.float32,
    "fp16": torch.float16,
    "float16": torch.float16,
    "half": torch.float16,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
}


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bf16"``; the short names used in manifests and findings."""
    return {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.float64: "fp64"}.get(
        dtype, str(dtype).replace("torch.", "")
    )


def parse_dtype(value: str | torch.dtype, where: str) -> torch.dtype:
    """Accepts ``fp32``/``float32``/``torch.float32`` etc.; raises ValueError naming ``where``."""
    if isinstance(value, torch.dtype):
        return value
    key = str(value).lower().removeprefix("torch.")
    if key not in DTYPES:
        raise ValueError(f"{where}: unknown dtype {value!r}; expected one of fp32, fp16, bf16")
    return DTYPES[key]


@dataclasses.dataclass(frozen=True, kw_only=True)
class RolePolicy:
    """The precision contract of one role."""

    role: str
    """One of `ROLES`."""
    param_dtype: torch.dtype
    """Storage dtype of the parameters: the master copy for trainable roles."""
    compute_dtype: torch.dtype
    """Dtype the matmuls run in (the autocast target, or the parameter dtype without autocast)."""
    autocast: bool
    """True: compute through ``torch.autocast(compute_dtype)``; False: compute in ``param_dtype``."""
    grad_dtype: torch.dtype
    """Dtype of ``.grad`` (equals ``param_dtype`` on one device)."""
    reduce_dtype: torch.dtype
    """Dtype gradients are reduced in across data-parallel ranks (FSDP ``reduce_dtype``)."""
    optim_state_dtype: torch.dtype
    """Dtype of the optimizer moments (AdamW keeps them in the parameter dtype)."""
    loss_scaling: str
    """``none``, ``static`` or ``dynamic`` (`LossScaler`)."""
    init_scale: float = 2.0**16
    """Initial (or static) loss scale."""
    growth_interval: int = 2000
    """Dynamic scaling: finite steps in a row before the scale doubles."""
    fp32_islands: tuple[str, ...] = ()
    """Subset of `ISLANDS` that stays fp32 on purpose under this policy."""
    grad_checkpointing: bool = False
    """Activation (gradient) checkpointing for this role's model."""
    checkpoint_layers: int | None = None
    """With checkpointing: how many decoder layers are checkpointed, counted from the first (None:
    all). The last ``L - checkpoint_layers`` keep their activations: no recompute there, more memory
    (selective checkpointing, spent where the memory planner says it fits)."""
    trainable: bool = False
    """Whether the role has an optimizer."""
    reasons: Mapping[str, str] = dataclasses.field(default_factory=dict)
    """Field name -> why this value was chosen (printed in the manifest)."""

    @property
    def low_precision(self) -> bool:
        return self.compute_dtype in (torch.float16, torch.bfloat16)

    def autocast_ctx(self, device_type: str) -> contextlib.AbstractContextManager:
        """``torch.autocast`` to the compute dtype when the policy autocasts, else a no-op."""
        if not self.autocast:
            return contextlib.nullcontext()
        return torch.autocast(device_type=device_type, dtype=self.compute_dtype)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if isinstance(v, torch.dtype):
                v = dtype_name(v)
            elif isinstance(v, tuple):
                v = list(v)
            elif isinstance(v, Mapping):
                v = dict(v)
            out[f.name] = v
        return out


@dataclasses.dataclass(frozen=True, kw_only=True)
class PrecisionPolicy:
    """The resolved policy of a run: one `RolePolicy` per role, the preset it came from."""

    preset: str
    roles: Mapping[str, RolePolicy]

    def __getitem__(self, role: str) -> RolePolicy:
        return self.roles[role]

    def to_dict(self) -> dict[str, Any]:
        return {"preset": self.preset, "roles": {r: p.to_dict() for r, p in self.roles.items()}}

    @classmethod
    def from_dict(cls, data: Any, where: str = "policy") -> PrecisionPolicy:
        """The inverse of `to_dict` (a run spec's or manifest's ``policy``); ValueError naming the
        field on anything that is not one."""
        if not isinstance(data, Mapping) or not isinstance(data.get("roles"), Mapping):
            raise ValueError(
                f"{where}: expected {{preset, roles: {{role: {{...}}}}}}, got {str(data)[:80]!r}"
            )
        fields = {f.name for f in dataclasses.fields(RolePolicy)}
        roles = {}
        for role, d in data["roles"].items():
            at = f"{where}.roles.{role}"
            if role not in ROLES or not isinstance(d, Mapping):
                raise ValueError(
                    f"{at}: expected a role ({', '.join(ROLES)}) with its fields, got {str(d)[:80]!r}"
                )
            unknown = sorted(set(d) - fields)
            if unknown:
                raise ValueError(
                    f"{at}.{unknown[0]}: unknown field; expected one of {', '.join(sorted(fields))}"
                )
            kw = dict(d)
            for k in [k for k in kw if k.endswith("_dtype")]:
                kw[k] = parse_dtype(kw[k], f"{at}.{k}")
            kw["fp32_islands"] = tuple(kw.get("fp32_islands", ()))
            kw["reasons"] = dict(kw.get("reasons", {}))
            try:
                roles[role] = RolePolicy(**kw)
            except TypeError as e:
                raise ValueError(f"{at}: {e}") from None
        return cls(preset=str(data.get("preset")), roles=roles)


_OVERRIDABLE = {
    "param_dtype",
    "compute_dtype",
    "autocast",
    "grad_dtype",
    "reduce_dtype",
    "optim_state_dtype",
    "loss_scaling",
    "init_scale",
    "growth_interval",
    "grad_checkpointing",
    "checkpoint_layers",
}


def _preset_role(preset: str, role: str) -> RolePolicy:
    trainable = role in TRAINABLE_ROLES
    f32, f16, b16 = torch.float32, torch.float16, torch.bfloat16
    islands = ISLANDS
    if preset == "fp32":
        r = "fp32 preset: everything in float32"
        return RolePolicy(
            role=role,
            param_dtype=f32,
            compute_dtype=f32,
            autocast=False,
            grad_dtype=f32,
            reduce_dtype=f32,
            optim_state_dtype=f32,
            loss_scaling="none",
            fp32_islands=islands,
            trainable=trainable,
            reasons={"param_dtype": r, "compute_dtype": r, "loss_scaling": "fp32 needs no loss scaling"},
        )
    if preset in ("fp16", "bf16"):
        cd = f16 if preset == "fp16" else b16
        reasons = {
            "compute_dtype": f"{preset} preset: matmuls under torch.autocast({dtype_name(cd)})",
            "loss_scaling": (
                "fp16 gradients underflow below 6e-8: dynamic loss scaling, skip non-finite steps"
                if preset == "fp16"
                else "bf16 has fp32's exponent range: no loss scaling"
            ),
        }
        if trainable:
            reasons["param_dtype"] = f"{preset} preset: fp32 master weights, AdamW state in fp32"
            pd = f32
        elif role == "rollout":
            reasons["param_dtype"] = "rollout engine generates with the actor's weights in the compute dtype"
            pd = cd
        else:
            reasons["param_dtype"] = f"frozen role: no master copy needed, stored in {preset} to halve memory"
            pd = cd
        return RolePolicy(
            role=role,
            param_dtype=pd,
            compute_dtype=cd,
            autocast=pd != cd,
            grad_dtype=pd,
            reduce_dtype=f32,
            optim_state_dtype=pd,
            loss_scaling="dynamic" if (preset == "fp16" and trainable) else "none",
            fp32_islands=islands,
            trainable=trainable,
            reasons=reasons,
        )
    if preset == "bf16-pure":
        r = "bf16-pure preset: bf16 parameters and optimizer state (verl model_dtype=bfloat16)"
        return RolePolicy(
            role=role,
            param_dtype=b16,
            compute_dtype=b16,
            autocast=False,
            grad_dtype=b16,
            reduce_dtype=b16,
            optim_state_dtype=b16,
            loss_scaling="none",
            fp32_islands=("norm", "softmax", "logprobs", "loss"),
            trainable=trainable,
            reasons={
                "param_dtype": r,
                "compute_dtype": r,
                "optim_state_dtype": r,
                "loss_scaling": "bf16 has fp32's exponent range: no loss scaling",
                "fp32_islands": "HF norms upcast internally; log-probs and losses taken in fp32",
            },
        )
    raise ValueError(f"precision.preset: unknown preset {preset!r}; expected one of {', '.join(PRESETS)}")


def check_policy(
    preset: str,
    overrides: Mapping[str, Mapping[str, Any]] | None = None,
    *,
    grad_checkpointing: bool | Mapping[str, bool] = False,
    checkpoint_layers: int | None = None,
    where: str = "precision",
) -> None:
    """Every rule `resolve_policy` enforces on the fields, without building the policy: what a config
    checks when it is constructed (`trainer.config.PrecisionConfig`); the policy itself is built once,
    by whoever runs it (`verlaudit.run.runner.run_spec`, or `trainer.common.resolve` alone)."""
    _checked_fields(preset, overrides, grad_checkpointing, checkpoint_layers, where)


# long: the preset, the roles, checkpointing, then each role's overrides, one rule per branch
def _checked_fields(
    preset: str,
    overrides: Mapping[str, Mapping[str, Any]] | None,
    grad_checkpointing: bool | Mapping[str, bool],
    checkpoint_layers: int | None,
    where: str,
) -> tuple[dict[str, bool], dict[str, dict[str, Any]]]:
    """(role -> grad checkpointing, role -> override field -> parsed value); ValueError naming the
    field path (``where``) on unknown presets, roles, fields or dtypes."""

    def at(key: str) -> str:
        return f"{where}.{key}" if where else key

    if preset not in PRESETS:
        raise ValueError(f"{at('preset')}: unknown preset {preset!r}; expected one of {', '.join(PRESETS)}")
    overrides = dict(overrides or {})
    for role in overrides:
        if role not in ROLES:
            raise ValueError(f"{at('overrides')}: unknown role {role!r}; expected one of {', '.join(ROLES)}")
    if isinstance(grad_checkpointing, bool):
        gc = {r: grad_checkpointing and r in TRAINABLE_ROLES for r in ROLES}
    else:
        for role in grad_checkpointing:
            if role not in TRAINABLE_ROLES:
                raise ValueError(
                    f"{at('grad_checkpointing')}: {role!r} has no backward; expected one of {TRAINABLE_ROLES}"
                )
        gc = {r: bool(grad_checkpointing.get(r, False)) for r in ROLES}
    if checkpoint_layers is not None:
        if (
            isinstance(checkpoint_layers, bool)
            or not isinstance(checkpoint_layers, int)
            or checkpoint_layers < 0
        ):
            raise ValueError(
                f"{at('checkpoint_layers')}: expected a number of decoder layers >= 0 (or unset for all), "
                f"got {checkpoint_layers!r}"
            )
        if not any(gc.values()):
            raise ValueError(
                f"{at('checkpoint_layers')}: set, but grad_checkpointing is off for every role; "
                "set grad_checkpointing: true or remove checkpoint_layers"
            )
    parsed: dict[str, dict[str, Any]] = {}
    for role in ROLES:
        parsed[role] = {}
        for key, value in dict(overrides.get(role, {})).items():
            path = at(f"overrides.{role}.{key}")
            if key not in _OVERRIDABLE:
                raise ValueError(f"{path}: unknown field; expected one of {', '.join(sorted(_OVERRIDABLE))}")
            if key.endswith("dtype"):
                value = parse_dtype(value, path)
            elif key == "loss_scaling" and value not in LOSS_SCALING:
                raise ValueError(f"{path}: {value!r}; expected one of {', '.join(LOSS_SCALING)}")
            elif key in ("autocast", "grad_checkpointing") and not isinstance(value, bool):
                raise ValueError(f"{path}: expected true or false, got {value!r}")
            elif key == "grad_checkpointing" and value and role not in TRAINABLE_ROLES:
                raise ValueError(f"{path}: role {role!r} has no backward to checkpoint")
            elif key == "checkpoint_layers" and (
                isinstance(value, bool)
                or not isinstance(value, int)
                or value < 0
                or role not in TRAINABLE_ROLES
            ):
                raise ValueError(
                    f"{path}: expected a number of layers >= 0 for a trainable role, got {value!r}"
                )
            parsed[role][key] = value
        changes, base = parsed[role], _preset_role(preset, role)
        pd = changes.get("param_dtype", base.param_dtype)
        cd = changes.get("compute_dtype", base.compute_dtype)
        dtypes_changed = "param_dtype" in changes or "compute_dtype" in changes
        autocast = changes.get("autocast", pd != cd if dtypes_changed else base.autocast)
        if not autocast and pd != cd:
            raise ValueError(
                f"{at('overrides.' + role)}: compute_dtype {dtype_name(cd)} differs from "
                f"param_dtype {dtype_name(pd)} with autocast false; set autocast: true"
            )
    return gc, parsed


def resolve_policy(
    preset: str,
    overrides: Mapping[str, Mapping[str, Any]] | None = None,
    *,
    grad_checkpointing: bool | Mapping[str, bool] = False,
    checkpoint_layers: int | None = None,
    device: str | torch.device = "cpu",
    where: str = "precision",
) -> PrecisionPolicy:
    """Builds the policy of a run from a preset, per-role overrides and the device.

    ``overrides`` maps a role to field values, e.g. ``{"critic": {"compute_dtype": "bf16"}}``.
    Raises ValueError naming the field path (``where``) on unknown presets, roles, fields or dtypes
    (`check_policy`'s rules), and when the device cannot run the policy (bf16 on a GPU without bf16).
    """
    gc, parsed = _checked_fields(preset, overrides, grad_checkpointing, checkpoint_layers, where)
    roles: dict[str, RolePolicy] = {}
    for role in ROLES:
        base = _preset_role(preset, role)
        changes: dict[str, Any] = {"grad_checkpointing": gc[role]}
        reasons = dict(base.reasons)
        if gc[role]:
            reasons["grad_checkpointing"] = "requested: trade recompute for activation memory"
            if checkpoint_layers is not None:
                changes["checkpoint_layers"] = checkpoint_layers
                reasons["checkpoint_layers"] = (
                    f"selective: the first {checkpoint_layers} decoder layers recompute, the rest keep activations"
                )
        for key, value in parsed[role].items():
            changes[key] = value
            shown = value if not isinstance(value, torch.dtype) else dtype_name(value)
            reasons[key] = f"per-role override {where + '.' if where else ''}overrides.{role}.{key}={shown}"
        if "param_dtype" in changes or "compute_dtype" in changes:
            pd = changes.get("param_dtype", base.param_dtype)
            cd = changes.get("compute_dtype", base.compute_dtype)
            changes.setdefault("autocast", pd != cd)
            changes.setdefault("grad_dtype", pd)
            changes.setdefault("optim_state_dtype", pd)
        fp16_compute = changes.get("compute_dtype", base.compute_dtype) == torch.float16
        if role in TRAINABLE_ROLES and "loss_scaling" not in changes:
            if fp16_compute and base.loss_scaling == "none":
                changes["loss_scaling"] = "dynamic"
                reasons["loss_scaling"] = (
                    "fp16 compute: dynamic loss scaling added (fp16 gradients underflow)"
                )
            elif not fp16_compute and base.loss_scaling != "none":
                changes["loss_scaling"] = "none"
                reasons["loss_scaling"] = "compute overridden away from fp16: no loss scaling needed"
        roles[role] = dataclasses.replace(base, reasons=reasons, **changes)
    policy = PrecisionPolicy(preset=preset, roles=roles)
    check_hardware(policy, device, where=where)
    return policy


def check_hardware(policy: PrecisionPolicy, device: str | torch.device, *, where: str = "precision") -> None:
    """Refuses what the device cannot do. CPU runs fp16 and bf16 (slowly); a CUDA GPU needs
    bf16 support (compute capability 8.0+) for any bf16 role."""
    dev = torch.device(device)
    if dev.type != "cuda":
        return
    uses_bf16 = [r for r, p in policy.roles.items() if torch.bfloat16 in (p.param_dtype, p.compute_dtype)]
    if uses_bf16 and not torch.cuda.is_bf16_supported(including_emulation=False):
        name = torch.cuda.get_device_name(dev)
        raise ValueError(
            f"{where}: roles {', '.join(uses_bf16)} need bf16, which {name} does not support natively "
            "(compute capability < 8.0); use the fp16 preset (fp16 autocast with dynamic loss scaling)"
        )


FP32_BUFFER_MARKERS = ("inv_freq", "rotary")
"""Floating buffers whose name contains one of these stay fp32 through a cast (the "rotary" island):
rotary frequencies rounded to bf16/fp16 shift every position's angle, and HF upcasts them to fp32
for cos/sin only after the rounding has happened."""


def cast_module(module: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """``module.to(dtype)`` except the rotary buffers (`FP32_BUFFER_MARKERS`), which keep their
    unrounded values in fp32; the buffers stay persistent or not as they were."""
    keep = []
    for name, buf in module.named_buffers():
        if buf.is_floating_point() and any(m in name.lower() for m in FP32_BUFFER_MARKERS):
            owner_name, _, leaf = name.rpartition(".")
            keep.append((module.get_submodule(owner_name), leaf, buf))
    module.to(dtype=dtype)
    for owner, leaf, buf in keep:
        # the saved tensor is the one from before the cast: no round trip through the low dtype
        owner._buffers[leaf] = buf.to(dtype=torch.float32)
    return module


def cast_model(model: torch.nn.Module, policy: RolePolicy) -> torch.nn.Module:
    """Puts parameters and floating buffers in the role's storage dtype, rotary buffers kept fp32."""
    return cast_module(model, policy.param_dtype)


def _fused_unscale_supported(dev: torch.device, dtype: torch.dtype) -> bool:
    """torch's fused check-and-unscale kernel has no bf16 variant on CUDA (seen on torch 2.11)."""
    return not (dev.type == "cuda" and dtype == torch.bfloat16)


class LossScaler:
    """Loss scaling with the semantics of ``torch.amp.GradScaler``, plus a non-finite guard.

    ``mode="dynamic"``: scale the loss, unscale the gradients, skip the step and multiply the scale by
    ``backoff_factor`` when any gradient is non-finite; multiply it by ``growth_factor`` after
    ``growth_interval`` finite steps in a row. ``mode="static"``: same, the scale never changes.
    ``mode="none"``: scale 1; non-finite gradients still skip the step when ``skip_nonfinite`` (so a
    bf16 overflow is a counted skip, not a silent NaN in the weights).

    Unlike GradScaler it exposes its whole state (`state()`), works on any device and dtype, and
    all-reduces ``found_inf`` for sharded (FSDP2 DTensor) gradients, over ``process_group`` or, when
    that is None, over the gradients' device mesh, like ``ShardedGradScaler``.
    """

    def __init__(
        self,
        mode: str = "dynamic",
        *,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        min_scale: float = 2.0**-24,
        skip_nonfinite: bool = True,
        process_group: Any = None,
    ) -> None:
        if mode not in LOSS_SCALING:
            raise ValueError(
                f"loss_scaling: unknown mode {mode!r}; expected one of {', '.join(LOSS_SCALING)}"
            )
        self.mode = mode
        self.scale = 1.0 if mode == "none" else float(init_scale)
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self.growth_interval = growth_interval
        self.min_scale = min_scale
        self.skip_nonfinite = skip_nonfinite
        self.process_group = process_group
        self.growth_tracker = 0
        self.steps = 0
        self.skipped_steps = 0
        self.backoffs = 0
        self.growths = 0
        self.last_found_inf = False
        self.last_event = "none"  # "growth" | "backoff" | "none"

    @classmethod
    def for_policy(cls, policy: RolePolicy, *, process_group: Any = None) -> LossScaler:
        return cls(
            policy.loss_scaling,
            init_scale=policy.init_scale,
            growth_interval=policy.growth_interval,
            process_group=process_group,
        )

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss if self.scale == 1.0 else loss * self.scale

    def unscale_(self, params: Iterable[torch.nn.Parameter]) -> bool:
        """Divides gradients by the scale in place; returns whether any gradient is non-finite."""
        grads = []
        reduce_group = self.process_group
        sharded = False
        for p in params:
            if p.grad is None:
                continue
            g = p.grad
            if hasattr(g, "to_local"):  # DTensor (FSDP2): unscale the local shard
                sharded = True
                if reduce_group is None and g.device_mesh.ndim == 1:
                    reduce_group = g.device_mesh.get_group()
                g = g.to_local()
            grads.append(g)
        found = False
        if grads:
            by_key: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
            for g in grads:
                by_key.setdefault((g.device, g.dtype), []).append(g)
            flags = []
            for (dev, dtype), group in by_key.items():
                flags.append(self._check_and_unscale(group, dev, dtype))
            total = sum(f.to(flags[0].device) for f in flags)
            if reduce_group is not None or sharded:
                import torch.distributed as dist

                # every rank must take the same skip decision: a rank that steps while another
                # skips would let the next reduce-scatter mix gradients scaled differently.
                # Sharded grads without an explicit group: their mesh's group (WORLD for an N-D mesh).
                dist.all_reduce(total, group=reduce_group)
            found = bool(total.item() > 0)
        self.last_found_inf = found
        return found

    def _check_and_unscale(
        self, group: list[torch.Tensor], dev: torch.device, dtype: torch.dtype
    ) -> torch.Tensor:
        """GradScaler's fused kernel where it exists; it has no bf16 CUDA kernel (bf16-pure gradients),
        so there: unscale with a foreach multiply and detect non-finite values through the inf-norm,
        which is nan or inf exactly when some element is (and cannot overflow, unlike the 2-norm)."""
        found_inf = torch.zeros(1, device=dev, dtype=torch.float32)
        if _fused_unscale_supported(dev, dtype):
            inv = torch.full((1,), 1.0 / self.scale, device=dev, dtype=torch.float32)
            torch._amp_foreach_non_finite_check_and_unscale_(group, found_inf, inv)
            return found_inf
        if self.scale != 1.0:
            torch._foreach_mul_(group, 1.0 / self.scale)
        norms = torch.stack(torch._foreach_norm(group, float("inf"))).float()
        return found_inf + (~torch.isfinite(norms)).any().float()

    def should_step(self) -> bool:
        return not (self.last_found_inf and (self.skip_nonfinite or self.mode != "none"))

    def update(self) -> None:
        """Call once per optimizer step, after the step or skip."""
        self.steps += 1
        self.last_event = "none"
        if self.last_found_inf:
            if self.should_step() is False:
                self.skipped_steps += 1
            if self.mode == "dynamic":
                self.scale = max(self.scale * self.backoff_factor, self.min_scale)
                self.backoffs += 1
                self.last_event = "backoff"
            self.growth_tracker = 0
        elif self.mode == "dynamic":
            self.growth_tracker += 1
            if self.growth_tracker >= self.growth_interval:
                grown = self.scale * self.growth_factor
                if math.isfinite(grown):
                    self.scale = grown
                    self.growths += 1
                    self.last_event = "growth"
                self.growth_tracker = 0

    def state(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "scale": self.scale,
            "growth_tracker": self.growth_tracker,
            "found_inf": self.last_found_inf,
            "event": self.last_event,
            "steps": self.steps,
            "skipped_steps": self.skipped_steps,
            "backoffs": self.backoffs,
            "growths": self.growths,
        }
