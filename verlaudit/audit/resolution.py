"""Weights whose resolution a coarse grid took: a weight tensor whose nonzero values all lie on one uniform
grid (a quantiser's step: int8's max |w| / 127, a cast to a few bits) and of which most values are exactly
0 had its typical weight rounded away by a step larger than it (`weight_grid`). A per-tensor scale set by
one outlier (max |w| 40 among weights of ~0.05: a step of 0.31) does this to a whole matrix; the model's
output then hardly depends on its input (a reward model scoring every response the same).

The invariant, for every floating tensor of every role's model, once per model (at setup for the models
the audit holds, at the first reward for a reward model): at least `ZERO_SHARE` of a tensor's values
(up to `SAMPLE` of them) are exactly 0, the rest are not all 0 and sit on integer multiples of their
smallest magnitude (within `GRID_TOL`). A trained float tensor has almost no exact zeros; a quantised one
whose step fits its weights keeps most of them nonzero; a pruned one (2:4: half zeros) keeps float values
off any grid. Exercised by `pytest tests/test_resolution.py`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from verlaudit import kinds as K
from verlaudit.audit.invariants_data import local_shard
from verlaudit.rundir import Finding

ZERO_SHARE = 0.75
"""The share of a tensor's values that are exactly 0 from which the grid's step has swallowed its typical
weight (int8 absmax with an outlier 100x the typical weight zeroes ~99%)."""
MIN_VALUES = 16
"""Tensors with fewer values (a bias, a scalar gate) are not judged."""
SAMPLE = 1 << 16
"""Values read per tensor (its first ones): the check stays cheap on a 7B model's matrices."""
GRID_TOL = 1e-3
"""|value / step - round(value / step)| under which a value is on the grid."""
LEVELS_MAX = 1 << 15
"""A grid of at most this many steps to the largest value (int16 and narrower)."""


def _on_grid(t: torch.Tensor) -> dict[str, Any] | None:
    t = local_shard(t)  # an FSDP2 DTensor: this rank's shard (a grid is a grid in any shard)
    if t.is_meta:
        return None
    v = t.detach().reshape(-1)[:SAMPLE].double().cpu()
    n = v.numel()
    if n < MIN_VALUES or not bool(torch.isfinite(v).all()):
        return None
    nz = v[v != 0]
    zeros = 1.0 - nz.numel() / n
    if nz.numel() == 0 or zeros < ZERO_SHARE:
        return None
    step = float(nz.abs().min())
    q = nz / step
    levels = float(q.abs().max())
    if levels > LEVELS_MAX or float((q - q.round()).abs().max()) > GRID_TOL:
        return None
    return {
        "values": n,
        "zero_share": round(zeros, 4),
        "step": step,
        "max_abs": float(nz.abs().max()),
        "levels_to_max": round(levels),
        "distinct_nonzero": int(torch.unique(nz).numel()),
    }


SOURCES = {"actor": "path", "reference": "path", "critic": "critic_path", "reward": "reward_model"}
"""The ``model.*`` key that loads each role's weights."""


def source_key(config: Mapping[str, Any], role: str) -> str | None:
    """``model.<key> (<value>)`` for the suite key that loaded ``role``'s weights, when it is set."""
    key = SOURCES.get(role)
    value = ((config.get("model") or {}).get(key)) if key else None
    return f"model.{key} ({value})" if value else None


def weight_grid(role: str, model: nn.Module, source: str | None = None) -> list[Finding]:
    """One ``precision/weight_grid`` finding per role: the tensors of ``model`` whose values a coarse grid
    zeroed (module docstring). ``source``: the suite key that loaded the model (named in the message)."""
    hits: list[tuple[str, Mapping[str, Any]]] = []
    for name, p in model.named_parameters():
        if p.is_floating_point() and (got := _on_grid(p)) is not None:
            hits.append((name, got))
    if not hits:
        return []
    name, g = max(hits, key=lambda h: h[1]["zero_share"])
    by = f" ({source})" if source else ""
    rest = (
        f"its only other value is {g['max_abs']:.3g} in magnitude (the outlier that set the scale)"
        if g["distinct_nonzero"] <= 2 and g["levels_to_max"] <= 1
        else f"its other values are multiples of one step {g['step']:.3g} ({g['distinct_nonzero']} distinct, "
        f"up to {g['levels_to_max']} steps = max |w| {g['max_abs']:.3g})"
    )
    severity = "error" if g["zero_share"] >= 0.9 else "warning"
    return [
        Finding(
            severity=severity,
            kind=K.PRECISION_WEIGHT_GRID,
            role=role,
            where=source or name,
            message=f"the {role} model{by} has {len(hits)} weight tensor(s) rounded onto a coarse grid: {name} holds "
            f"{g['zero_share']:.0%} exact zeros of {g['values']} values and {rest}: a quantisation whose step (a per-tensor scale set by the largest "
            "weight) exceeds the typical weight rounded those weights to 0, so the model's output lost the "
            "resolution they carried",
            observed={"tensor": name, "tensors": [h[0] for h in hits][:8], **g},
            expected="a tensor's weights mostly nonzero (a grid step well below the typical |w|)",
            fix=f"{source + ': ' if source else ''}load the weights in float (fp32 / bf16), or quantise per channel "
            "(one scale per output row) or with an outlier-aware scale (clip the scale below the outlier, keep "
            "outliers in float) so the step stays below the typical weight",
        )
    ]
