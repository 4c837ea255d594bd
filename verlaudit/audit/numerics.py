"""Gradient and update numerics: non-finite gradients, underflow, lost updates, loss-scale events.

Pure functions over gradients and parameter snapshots; they return numbers and `Finding`s and
register nothing (`verlaudit.audit.optimizer` calls them around each optimizer step). The
per-module numerics the probes replay are in `module_numerics`. Exercised by
`pytest tests/test_audit_probes.py tests/test_audit_update_underflow.py`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from trainer.precision import RolePolicy
from verlaudit import kinds as K
from verlaudit.dtypes import dtype_name as dn
from verlaudit.rundir import Finding

GRAD_UNDERFLOW_WARN = 0.05
UPDATE_UNDERFLOW_WARN = 0.5
"""Warn when more than this fraction of sampled elements with a non-zero gradient kept their value
through an optimizer step. High on purpose: the check runs at the always-on boundary level, and
bf16-pure at a too-small lr loses nearly all of them (reports/gpu/fsdp_2xh200.md)."""
UPDATE_SAMPLE = 4096
"""Elements per parameter tensor snapshotted to measure lost updates (a fixed sample keeps memory flat)."""
UPDATE_SEED = 0


@dataclasses.dataclass
class GradStats:
    nonfinite: int = 0
    """Non-finite gradient elements."""
    first_nonfinite: list[str] = dataclasses.field(default_factory=list)
    """Up to five parameters with non-finite gradients, in parameter order."""
    underflow_frac: float = 0.0
    """Fraction of gradient elements below the compute dtype's smallest normal (zero included),
    embeddings excluded (their untouched rows are zero by construction)."""
    elements: int = 0


def grad_stats(
    named_params: Iterable[tuple[str, torch.Tensor]],
    compute_dtype: torch.dtype,
    *,
    underflow: bool = True,
    nonfinite: bool = True,
) -> GradStats:
    """Counts over the parameters' ``.grad``; see `grad_counts`."""
    grads = ((n, p.grad) for n, p in named_params)
    return grad_counts(grads, compute_dtype, underflow=underflow, nonfinite=nonfinite)


def grad_counts(
    named_grads: Iterable[tuple[str, torch.Tensor | None]],
    compute_dtype: torch.dtype,
    *,
    underflow: bool = True,
    nonfinite: bool = True,
) -> GradStats:
    """Non-finite and (``underflow``) tiny gradient elements, counted on the gradients as held: after
    a backward they still carry the loss scale, which is what the low-precision backward held. All
    counts stay on the device until one read at the end: a read per parameter would be a stream sync
    per parameter on a GPU."""
    tiny = torch.finfo(compute_dtype).tiny if compute_dtype.is_floating_point else 0.0
    names, bad, small, sizes = [], [], [], []
    for name, g in named_grads:
        if g is None:
            continue
        if hasattr(g, "to_local"):
            g = g.to_local()
        names.append(name)
        if nonfinite:
            bad.append((~torch.isfinite(g)).sum())
        if underflow and "embed" not in name:
            small.append((g.abs() < tiny).sum())
            sizes.append(g.numel())
    if not names or not (bad or small):
        return GradStats()
    dev = (bad or small)[0].device
    counts = torch.stack([c.to(dev, torch.float64) for c in bad + small]).tolist()  # the one read
    bad_counts, n_small = counts[: len(bad)], sum(counts[len(bad) :])
    stats = GradStats(nonfinite=int(sum(bad_counts)))
    stats.first_nonfinite = [n for n, c in zip(names, bad_counts) if c > 0][:5]
    if small:
        stats.elements = int(sum(sizes))
        stats.underflow_frac = n_small / max(stats.elements, 1)
    return stats


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def sample_index(numel: int, sample: int = UPDATE_SAMPLE, seed: int = UPDATE_SEED) -> torch.Tensor:
    """Sorted, distinct flat positions (at most ``sample``; all of them when ``numel <= sample``), the
    same for every call with the same arguments. Random rather than strided: a stride that divides a
    row length would sample the same few columns of every row."""
    if numel <= sample:
        return torch.arange(numel)
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, numel, (sample,), generator=gen).unique()


def snapshot(
    named_params: Iterable[tuple[str, torch.Tensor]],
    sample: int = UPDATE_SAMPLE,
    cache: dict[tuple[str, int, str], torch.Tensor] | None = None,
) -> dict[str, tuple]:
    """``{name: (index, values, grad != 0)}`` at a fixed sample of each parameter's elements, taken before
    an optimizer step: ``sample`` elements per tensor at most, whatever the model size (a full copy of
    a 7B bf16 model would be 13 GB). FSDP2 DTensors are sampled on this rank's shard. Pass the same
    ``cache`` every step to build each index once; nothing here reads a value back to the host."""
    cache = {} if cache is None else cache
    snap = {}
    for name, p in named_params:
        if p.grad is None or not p.is_floating_point() or not p.numel():
            continue
        local = _local(p.detach())
        if not local.numel():  # an FSDP rank can hold an empty shard
            continue
        key = (name, local.numel(), str(local.device))
        idx = cache.get(key)
        if idx is None:
            idx = cache[key] = sample_index(local.numel(), sample).to(local.device)
        # take() indexes the tensor as if flat without copying it (reshape would, if non-contiguous)
        snap[name] = (idx, torch.take(local, idx), torch.take(_local(p.grad), idx) != 0)
    return snap


def update_underflow_rows(
    before: Mapping[str, tuple], named_params: Iterable[tuple[str, torch.Tensor]]
) -> list[dict[str, Any]]:
    """Per module (a parameter's owner), from a `snapshot` taken before the step: ``lost_frac``, the
    size-weighted fraction of sampled elements that kept their value despite a non-zero gradient,
    ``sampled`` (elements with a non-zero gradient in the sample) and ``size`` (the module's parameter
    elements). With bf16 master weights at a small learning rate most updates round away. One host
    read for all parameters."""
    names, sizes, news, olds, nonzeros = [], [], [], [], []
    for name, p in named_params:
        if name not in before:
            continue
        idx, old, nonzero = before[name]
        news.append(torch.take(_local(p.detach()), idx))
        olds.append(old)
        nonzeros.append(nonzero)
        names.append(name)
        sizes.append(p.numel())
    if not news:
        return []
    pairs = _lost_and_moving(news, olds, nonzeros)
    per_module: dict[str, list[float]] = {}
    for name, size, (lost, moving) in zip(names, sizes, pairs):
        if not moving:
            continue
        acc = per_module.setdefault(name.rsplit(".", 1)[0], [0.0, 0.0, 0.0])
        acc[0] += lost / moving * size
        acc[1] += size
        acc[2] += moving
    return [
        {"module": m, "lost_frac": lost / n, "sampled": int(k), "size": int(n)}
        for m, (lost, n, k) in per_module.items()
        if n
    ]


def _lost_and_moving(
    news: list[torch.Tensor], olds: list[torch.Tensor], nonzeros: list[torch.Tensor]
) -> list[list[int]]:
    """Per parameter, [sampled elements that kept their value despite a non-zero gradient, sampled
    elements with a non-zero gradient], with one host read. On one device the samples are compared
    concatenated (a handful of launches for the model rather than five per parameter; promoting the
    dtypes to a common one keeps equality exact) and counted per parameter with ``index_add_``."""
    dev = news[0].device
    if any(t.device != dev for t in news):
        counts = [
            torch.stack([((n == o) & z).sum(), z.sum()]).to(dev) for n, o, z in zip(news, olds, nonzeros)
        ]
        return torch.stack(counts).tolist()
    lens = [t.numel() for t in news]
    owner = torch.repeat_interleave(  # output_size given: no host read of the lengths' sum
        torch.arange(len(lens), device=dev), torch.tensor(lens, device=dev), output_size=sum(lens)
    )
    nonzero = torch.cat(nonzeros)
    kept = (torch.cat(news) == torch.cat(olds)) & nonzero
    counts = torch.zeros(len(lens), 2, dtype=torch.int64, device=dev)
    counts[:, 0].index_add_(0, owner, kept.long())
    counts[:, 1].index_add_(0, owner, nonzero.long())
    return counts.tolist()  # the one read


def update_underflow(
    before: Mapping[str, tuple], named_params: Iterable[tuple[str, torch.Tensor]]
) -> tuple[float, dict[str, float]]:
    """Fraction of parameter elements unchanged by the step despite a non-zero gradient, overall and
    per module, from a `snapshot` taken before it (`update_underflow_rows`, weighted by size, so a
    small norm weight does not count as much as a large projection)."""
    return update_underflow_summary(update_underflow_rows(before, named_params))


def update_underflow_summary(rows: list[Mapping[str, Any]]) -> tuple[float, dict[str, float]]:
    """(overall fraction weighted by module size, {module: fraction}) of `update_underflow_rows`."""
    total = sum(r["size"] for r in rows)
    overall = sum(r["lost_frac"] * r["size"] for r in rows) / total if total else 0.0
    return overall, {r["module"]: r["lost_frac"] for r in rows}


def underflow_findings(
    role: str,
    frac: float,
    per_module: Mapping[str, float],
    policy: RolePolicy,
    lr: float | None,
    *,
    step: int,
    phase: str | None,
) -> list[Finding]:
    """A warning when more than `UPDATE_UNDERFLOW_WARN` of the sampled updates were lost, naming the
    modules that lost the most."""
    if frac <= UPDATE_UNDERFLOW_WARN:
        return []
    top = sorted(per_module.items(), key=lambda kv: -kv[1])[:5]
    worst = ", ".join(f"{m} {v:.0%}" for m, v in top[:3])
    lr_key = "algo.critic_lr" if role == "critic" else "algo.lr"
    return [Finding(
        severity="warning", kind=K.UPDATE_UNDERFLOW, role=role, where=top[0][0] if top else None,
        step=step, phase=phase, observed={"fraction": round(frac, 4), "top_modules": {m: round(v, 4) for m, v in top}},
        expected=f"<= {UPDATE_UNDERFLOW_WARN}",
        message=f"{frac:.0%} of {role} weight updates were lost to {dn(policy.param_dtype)} rounding "
        f"(unchanged despite a non-zero gradient{f', lr={lr:g}' if lr else ''}; sampled, worst: {worst}): the "
        f"weights are stored in {dn(policy.param_dtype)} with no fp32 master copy (precision.preset bf16-pure, "
        f"a precision.overrides param_dtype or a model.setup cast), and an update of about {lr_key} "
        f"{lr if lr else '?'} per element is below half the {dn(policy.param_dtype)} spacing of the weights "
        "it is added to",
        fix="keep fp32 master weights (precision.preset: bf16, i.e. bf16 autocast with fp32 params; verl: "
        "actor_rollout_ref.actor.fsdp_config.model_dtype=fp32 with bf16 mixed_precision.param_dtype) "
        f"or raise the learning rate ({lr_key})",
    )]  # fmt: skip


_GRAD_FIX_SCALED = (
    "dynamic loss scaling handles occasional overflow; if it repeats, look at the numerics/nonfinite_* "
    "producer, lower the lr, or use bf16"
)
_GRAD_FIX_UNSCALED = (
    "without loss scaling this is no fp16 overflow: find the producer (audit level full), check attention "
    "rows that see no key (left padding) and custom autograd functions, or lower the lr"
)


def grad_findings(
    role: str, stats: GradStats, policy: RolePolicy, *, step: int, phase: str | None, skipped: bool
) -> list[Finding]:
    out = []
    if stats.nonfinite:
        handled = skipped and policy.loss_scaling == "dynamic"
        out.append(
            Finding(
                severity="warning" if handled else "error",
                kind=K.NONFINITE_GRADS,
                role=role,
                where=stats.first_nonfinite[0].rsplit(".", 1)[0] if stats.first_nonfinite else None,
                step=step,
                phase=phase,
                observed={"elements": stats.nonfinite, "first_params": stats.first_nonfinite},
                expected="finite",
                message=f"{stats.nonfinite} non-finite {role} gradient elements (first: "
                f"{', '.join(stats.first_nonfinite[:3])})"
                + ("; the loss scaler skipped the step" if handled else ""),
                fix=_GRAD_FIX_SCALED if policy.loss_scaling == "dynamic" else _GRAD_FIX_UNSCALED,
            )
        )
    if (
        stats.elements
        and stats.underflow_frac > GRAD_UNDERFLOW_WARN
        and policy.compute_dtype == torch.float16
    ):
        out.append(
            Finding(
                severity="warning",
                kind=K.GRAD_UNDERFLOW,
                role=role,
                where=None,
                step=step,
                phase=phase,
                observed=round(stats.underflow_frac, 4),
                expected=f"< {GRAD_UNDERFLOW_WARN}",
                message=f"{stats.underflow_frac:.1%} of {role} gradient elements are below fp16's smallest normal "
                f"({torch.finfo(torch.float16).tiny:.1e}) at the current loss scale",
                fix="use dynamic loss scaling with a larger init_scale, or bf16 (fp32's exponent range)",
            )
        )
    return out


def scaler_findings(
    role: str,
    state: Mapping[str, Any],
    skipped: bool,
    grad_norm: float,
    policy: RolePolicy,
    *,
    step: int,
    phase: str | None,
) -> list[Finding]:
    """Skipped steps — fp16 loss-scale backoffs AND bf16/fp32 non-finite skips, which tools that only
    watch the fp16 scaler miss."""
    if not skipped:
        return []
    mode = state.get("mode", policy.loss_scaling)
    scale = state.get("scale")
    if mode == "dynamic":
        msg = f"{role} optimizer step skipped: non-finite gradients; loss scale backed off to {scale:g}"
        fix = "occasional skips are the dynamic scaler working; many in a row mean a real overflow"
    else:
        msg = (
            f"{role} optimizer step skipped: non-finite gradients under {dn(policy.compute_dtype)} "
            f"without loss scaling (grad_norm={grad_norm})"
        )
        fix = "a bf16/fp32 overflow is not a scaling problem: find the producer (numerics/nonfinite_*), lower lr"
    return [Finding(severity="warning", kind=K.SKIPPED_STEP, role=role, where="optimizer", step=step,
                    phase=phase, observed={"scale": scale, "mode": mode, "skipped_steps": state.get("skipped_steps")},
                    expected="finite gradients", message=msg, fix=fix)]  # fmt: skip
