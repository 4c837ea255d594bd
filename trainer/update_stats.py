"""Metrics of how an update behaves, beside the losses' own (`trainer.losses`): what a clip removed, on
which side, how far the ratio moved, and which way a loss pushes what its objective names. They change
nothing the losses compute (every value is detached); the trainer emits them and knows nothing of who
reads them.

Policy losses (per micro-batch, averaged over a step like verl's ``actor/pg_clipfrac``):

- ``actor/pg_clipfrac_high`` / ``actor/pg_clipfrac_low``: the share of the tokens whose clipped term won
  with a positive / negative advantage (the upper / lower bound bound them); together ``actor/pg_clipfrac``.
- ``actor/ratio_max`` / ``actor/ratio_min``: the token importance ratio's extremes.
- ``actor/ratio_outside_usual_high`` / ``_low``: the share of the tokens the usual clip's upper / lower
  bound would bind (a positive advantage with ratio above 1 + `USUAL_HIGH`, a negative one below
  1 - `USUAL_LOW`), whatever this run's bounds are: beside the side's clip fraction it shows a bound
  opened so wide that it never binds.
- ``actor/logratio_adv_pos`` / ``actor/logratio_adv_neg``: the mean log-ratio of the tokens with a
  positive / negative advantage: the updates so far raised / lowered them when their signs are + / -.

DPO losses (per micro-batch): ``dpo/chosen_pull`` / ``dpo/rejected_pull``, the mean over pairs of minus the
loss's derivative in the chosen / rejected sequence log-prob (positive: the loss raises it), and
``dpo/chosen_pushed_down_frac``, the share of pairs whose loss lowers the chosen answer's log-prob;
``dpo/logratio_abs``, the mean over pairs of |log pi - log ref| of the two answers (nats per sequence: how far
the policy moved from the reference), and ``dpo/beta_margin_abs``, the mean |beta x margin| (the sigmoid's
argument: near 0 the loss is at its zero-margin value, whatever the log-ratios do): `dpo_drift`.
Every recipe, in a single-process run (ranks all-reduce a step's metrics by name, and a rank whose shard
is empty or resharded could not measure): ``actor/update_rel`` / ``critic/update_rel``, how far the step's
optimizer steps moved a sample of the weights relative to their size (`weight_sample`, `update_size`: a few thousand elements of
the first weight matrices, one copy and one read a step). Exercised by `pytest tests/test_update_effect.py`.
"""

from __future__ import annotations

import torch

USUAL_LOW = 0.2
"""verl's default clip_ratio: the lower side of the usual trust region [0.8, 1.28]."""
USUAL_HIGH = 0.28
"""DAPO's clip-higher, the widest upper side in common use."""


PUSH_TOL = 1e-3
"""A pair's chosen answer is pushed down when the loss's derivative in its log-prob is positive by more than
this share of the larger of the two derivatives (at policy = reference, apo_down's is 0 up to rounding)."""


def _mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    m = mask.to(values.dtype)
    return (values * m).sum() / m.sum().clamp(min=1.0)


def ratio_metrics(
    log_ratio: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clipped: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """The policy-update metrics of one micro-batch (module docstring). ``clipped``: the tokens whose
    clipped term won (None: a loss without a clip)."""
    with torch.no_grad():
        lr, adv = log_ratio.detach().float(), advantages.detach().float()
        valid = mask.bool() if mask.dtype == torch.bool else mask != 0
        out: dict[str, torch.Tensor] = {}
        pos, neg = valid & (adv > 0), valid & (adv < 0)
        ratio = torch.exp(lr)
        if clipped is None:
            clipped = torch.zeros_like(valid)
        out["actor/pg_clipfrac_high"] = _mean((clipped & pos).float(), valid)
        out["actor/pg_clipfrac_low"] = _mean((clipped & neg).float(), valid)
        inf = torch.tensor(float("inf"), device=lr.device)
        out["actor/ratio_max"] = torch.where(valid, ratio, -inf).amax()  # ratio[valid].max(), without a sync
        out["actor/ratio_min"] = torch.where(valid, ratio, inf).amin()
        out["actor/ratio_outside_usual_high"] = _mean((pos & (ratio > 1.0 + USUAL_HIGH)).float(), valid)
        out["actor/ratio_outside_usual_low"] = _mean((neg & (ratio < 1.0 - USUAL_LOW)).float(), valid)
        out["actor/logratio_adv_pos"] = _mean(lr, pos)  # 0 where no token has that sign
        out["actor/logratio_adv_neg"] = _mean(lr, neg)
        # an empty micro-batch: ratio 1 and zeros, the same keys on every call (ranks all-reduce them by name);
        # chosen on the device, so the trainer's step does not wait for the host on every micro-batch
        some = valid.any()
        one, zero = torch.ones((), device=lr.device), torch.zeros((), device=lr.device)
        return {
            k: torch.where(some, v, one if k.startswith("actor/ratio_m") else zero).detach()
            for k, v in out.items()
        }


RATIO_KEYS = (
    "actor/pg_clipfrac_high",
    "actor/pg_clipfrac_low",
    "actor/ratio_max",
    "actor/ratio_min",
    "actor/ratio_outside_usual_high",
    "actor/ratio_outside_usual_low",
    "actor/logratio_adv_pos",
    "actor/logratio_adv_neg",
)
"""Every key `ratio_metrics` returns, on every call (an empty micro-batch gives ratio 1 and zeros)."""


def dpo_direction(loss_fn, chosen, rejected, *args, **kwargs) -> dict[str, torch.Tensor]:
    """Which way the DPO loss ``loss_fn`` (`trainer.losses.dpo_loss`, called as the trainer calls it:
    per-pair summed log-probs, then the reference's and the loss's own arguments) moves the chosen and
    the rejected log-probs, from its derivative in detached copies of them (module docstring)."""
    with torch.enable_grad():
        c = chosen.detach().float().requires_grad_(True)
        r = rejected.detach().float().requires_grad_(True)
        losses = loss_fn(c, r, *args, **kwargs)[0]
        gc, gr = torch.autograd.grad(losses.sum(), (c, r), allow_unused=True)
    gc = torch.zeros_like(c) if gc is None else gc
    gr = torch.zeros_like(r) if gr is None else gr
    return {
        "dpo/chosen_pull": (-gc).mean().detach(),
        "dpo/rejected_pull": (-gr).mean().detach(),
        "dpo/chosen_pushed_down_frac": (gc > PUSH_TOL * torch.maximum(gc.abs(), gr.abs()))
        .float()
        .mean()
        .detach(),
    }


def dpo_drift(chosen, rejected, ref_chosen, ref_rejected, beta: float) -> dict[str, torch.Tensor]:
    """``dpo/logratio_abs`` (mean |log pi - log ref| of the two answers, nats per sequence) and
    ``dpo/beta_margin_abs`` (mean |beta x margin|, the sigmoid's argument) of one micro-batch of pairs."""
    with torch.no_grad():
        c, r = chosen.detach().float() - ref_chosen.float(), rejected.detach().float() - ref_rejected.float()
        return {
            "dpo/logratio_abs": (c.abs() + r.abs()).mean() / 2,
            "dpo/beta_margin_abs": (beta * (c - r)).abs().mean(),
        }


UPDATE_SAMPLE = 4096
"""Elements read from the start of each sampled weight matrix (`weight_sample`)."""
UPDATE_TENSORS = 16
"""Weight matrices sampled per model (the first ones that train)."""


def weight_sample(
    model: torch.nn.Module, distributed: bool = False
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(parameter, an fp32 copy of its first `UPDATE_SAMPLE` local elements) for the first `UPDATE_TENSORS`
    trainable weight matrices: taken before a phase's optimizer steps, read by `update_size` after."""
    out: list[tuple[torch.Tensor, torch.Tensor]] = []
    if distributed:
        return out  # `update_size` of an empty sample is no metric, on every rank alike
    with torch.no_grad():
        for p in model.parameters():
            if not p.requires_grad or p.dim() < 2:
                continue
            flat = _local_flat(p)
            if flat is not None and flat.numel():
                out.append((p, flat[:UPDATE_SAMPLE].float().clone()))
            if len(out) >= UPDATE_TENSORS:
                break
    return out


def _local_flat(p: torch.Tensor) -> torch.Tensor | None:
    """This rank's elements of ``p`` as a flat tensor, or None where they are not in memory now (an FSDP
    parameter resharded between phases holds a storage of size 0): a metric is never worth a failed step."""
    try:
        local = p.to_local() if hasattr(p, "to_local") else p  # an FSDP2 DTensor's own shard
        if local.untyped_storage().size() == 0:
            return None
        return local.detach().reshape(-1)
    except RuntimeError:
        return None


def update_size(sample: list[tuple[torch.Tensor, torch.Tensor]]) -> dict[str, float]:
    """``{"update_rel": |w_after - w_before| / |w_before|, "weight_rms": |w_before| / sqrt(n)}`` over the
    ``n`` sampled elements (`weight_sample`): how far the phase's optimizer steps moved the weights, relative
    to their size, and that size per element (Adam's step is ~lr per element: ``update_rel`` x
    ``weight_rms`` against lr says whether the learning rate set the step's size); empty: nothing sampled,
    e.g. an FSDP rank whose shards are empty."""
    if not sample:
        return {}
    parts = []
    with torch.no_grad():
        for p, before in sample:
            flat = _local_flat(p)
            if flat is None or flat.numel() < before.numel():
                return {}  # not in memory now: no measurement rather than a partial one
            now = flat[: before.numel()].float()
            part = torch.stack([((now - before) ** 2).sum(), (before**2).sum()])
            parts.append(part.to(parts[0].device) if parts else part)  # a model spread over devices
        sums = torch.stack(parts).tolist()  # one read from the device for the whole sample
    num = den = 0.0
    for n, d in sums:  # summed in Python, in order, as each tensor's float() was before
        num += n
        den += d
    count = sum(before.numel() for _, before in sample)
    return {"update_rel": (num / den) ** 0.5, "weight_rms": (den / count) ** 0.5} if den > 0 else {}
